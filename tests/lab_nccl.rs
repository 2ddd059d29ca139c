//! Lab: a real NCCL unique id (libnccl from the PyPI wheel; no GPU needed) given to every
//! rank of a 3-host job, its root on the master's eth1 (NCCL alone would pick eth0, the
//! container bridge with the same address on every host) and reachable from every host.

mod lab;
use lab::{Lab, meshd};
use std::time::Duration;

/// The library path, or None after saying loudly why the test does not run.
fn nccl_lib() -> Option<String> {
    match std::env::var("MESHD_NCCL_LIB") {
        Ok(p) if std::path::Path::new(&p).exists() => Some(p),
        _ if std::env::var("MESHD_REQUIRE_NCCL").is_ok() => {
            panic!(
                "MESHD_REQUIRE_NCCL is set but MESHD_NCCL_LIB does not name libnccl.so.2 (run scripts/fetch-nccl.sh)"
            )
        }
        _ => {
            eprintln!("*** NCCL LAB TEST SKIPPED: MESHD_NCCL_LIB not set (run scripts/fetch-nccl.sh) ***");
            None
        }
    }
}

fn decode_root(hex: &str) -> (u16, String) {
    let b: Vec<u8> =
        (0..hex.len() / 2).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex")).collect();
    assert_eq!(b.len(), 128);
    let family = u16::from_le_bytes([b[8], b[9]]);
    assert_eq!(family, 2, "AF_INET root expected");
    let port = u16::from_be_bytes([b[10], b[11]]);
    (port, format!("{}.{}.{}.{}", b[12], b[13], b[14], b[15]))
}

#[test]
fn every_rank_gets_the_same_checked_nccl_id_rooted_on_eth1() {
    lab_or_skip!();
    let Some(libpath) = nccl_lib() else { return };
    let mut lab = Lab::new(3);
    let args = lab.meshd_run().flags(&["--nproc-per-node", "2"]).cmd(&[
        "sh",
        "-c",
        "echo NCCLID $MESHD_NCCL_UNIQUE_ID",
    ]);
    let res = lab.run_on_all(
        &args,
        &[("MESHD_NCCL_LIB", &libpath), ("MESHD_TOKEN", "nccl")],
        Duration::from_secs(60),
    );
    let mut ids = Vec::new();
    for (i, (code, out, err)) in res.into_iter().enumerate() {
        assert_eq!(code, Some(0), "host {i}:\n{out}\n{err}");
        for l in out.lines().filter_map(|l| l.split("NCCLID ").nth(1)) {
            ids.push(l.trim().to_string());
        }
    }
    assert_eq!(ids.len(), 6, "every rank gets MESHD_NCCL_UNIQUE_ID: {ids:?}");
    assert!(ids.iter().all(|id| *id == ids[0] && id.len() == 256), "{ids:?}");
    let (port, ip) = decode_root(&ids[0]);
    assert_eq!(ip, "198.19.0.7", "root on the master's eth1, not eth0's 198.18.0.4");
    assert!(port > 0);
}

#[test]
fn doctor_checks_the_nccl_root_from_every_host() {
    lab_or_skip!();
    let Some(libpath) = nccl_lib() else { return };
    let mut lab = Lab::new(3);
    let peers = lab.peers();
    let args = [meshd(), "doctor", "--json", "--nnodes", "3", "--peers", &peers];
    let res = lab.run_on_all(
        &args,
        &[("MESHD_NCCL_LIB", &libpath), ("MESHD_TOKEN", "nccl")],
        Duration::from_secs(60),
    );
    for (i, (code, out, err)) in res.into_iter().enumerate() {
        assert_eq!(code, Some(0), "host {i}:\n{out}\n{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
        let checks = v["checks"].as_array().expect("checks");
        let id = checks.iter().find(|c| c["name"] == "nccl id").expect("nccl id check");
        assert_eq!(id["ok"], true, "{id}");
        assert!(id["detail"].as_str().expect("detail").contains("198.19.0.7:"), "{id}");
        let tcp = checks.iter().find(|c| c["name"] == "tcp").expect("tcp");
        assert_eq!(tcp["ok"], true, "the root accepts TCP from every host: {tcp}");
        let ver = checks.iter().find(|c| c["name"] == "nccl version").expect("version");
        assert!(ver["detail"].as_str().expect("d").contains("22705") || ver["ok"] == true, "{ver}");
    }
}
