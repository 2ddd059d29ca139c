//! Lab: `meshd ifaces --peers` chooses eth1 on every host, never the shared-address eth0.

mod lab;
use lab::{Lab, meshd};
use std::time::Duration;

#[test]
fn ifaces_chooses_eth1_on_each_of_three_hosts() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let peers = lab.peers();
    for i in 0..3 {
        let (code, out, err) =
            lab.run(i, &[meshd(), "ifaces", "--json", "--peers", &peers], Duration::from_secs(20));
        assert_eq!(code, Some(0), "host {i}: {err}");
        let v: serde_json::Value =
            serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("bad json {e}: {out}"));
        assert_eq!(v["chosen"]["name"], "eth1", "host {i}: {v}");
        assert_eq!(v["chosen"]["addr"], lab.hosts[i].eth1.as_str(), "host {i}: {v}");
        assert_eq!(v["proven"], true, "host {i}: {v}");
        let eth0 = v["interfaces"]
            .as_array()
            .expect("interfaces")
            .iter()
            .find(|x| x["name"] == "eth0")
            .expect("eth0 listed");
        assert_eq!(eth0["addrs"][0], "198.18.0.4/16");
        // Exactly one of the three peers is this host itself.
        let selfs = v["peers"].as_array().expect("peers").iter().filter(|p| p["self"] == true).count();
        assert_eq!(selfs, 1, "{v}");
    }
    // Human output names the choice and its reason.
    let (code, out, _) = lab.run(1, &[meshd(), "ifaces", "--peers", &peers], Duration::from_secs(20));
    assert_eq!(code, Some(0));
    assert!(
        out.contains("chosen: eth1 198.19.0.7 (the kernel routes to all 2 other peers through eth1"),
        "{out}"
    );
}

#[test]
fn ifaces_forced_and_missing_iface() {
    lab_or_skip!();
    let mut lab = Lab::new(1);
    let (code, _, _) = lab.run(0, &[meshd(), "ifaces", "--iface", "eth0"], Duration::from_secs(10));
    assert_eq!(code, Some(0));
    let (code, out, _) = lab.run(0, &[meshd(), "ifaces", "--iface", "ib0"], Duration::from_secs(10));
    assert_eq!(code, Some(1));
    assert!(out.contains("--iface ib0: no such interface"), "{out}");
}

/// Without --peers nothing can be proven: eth0 (the isolated, lowest address) is not
/// presented as the choice; the candidates are listed and --peers decides.
#[test]
fn ifaces_without_peers_lists_candidates_and_proves_nothing() {
    lab_or_skip!();
    let mut lab = Lab::new(1);
    let (code, out, err) = lab.run(0, &[meshd(), "ifaces"], Duration::from_secs(10));
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.contains("chosen:"), "nothing is chosen without proof:\n{out}");
    assert!(out.contains("eth0 198.18.0.4 (private)") && out.contains("eth1 198.19.0.30 (private)"), "{out}");
    assert!(out.contains("`--peers` decides"), "{out}");
    let (code, out, _) = lab.run(0, &[meshd(), "ifaces", "--json"], Duration::from_secs(10));
    assert_eq!(code, Some(0));
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["proven"], false, "{v}");
    let names: Vec<&str> =
        v["candidates"].as_array().expect("candidates").iter().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(names, ["eth0", "eth1"], "{v}");
    assert!(v["reason"].as_str().is_some_and(|r| r.contains("--peers` decides")), "{v}");
}
