//! Lab: tunnel mode. Behind the one-port firewall on every host (all TCP and all UDP but
//! meshd's port dropped on the real network), unmodified PyTorch jobs and plain sockets
//! reach the other nodes: meshd carries the ranks' TCP connections over its QUIC
//! connections (LD_PRELOAD interposer, docs/PROTOCOL.md "The TCP tunnel").

mod lab;
use lab::{Lab, python_job};
use std::time::Duration;

const PY: &str = "/usr/bin/python3";

fn needs_torch() {
    let ok = std::process::Command::new(PY).args(["-c", "import torch"]).status().is_ok_and(|s| s.success());
    assert!(ok, "Debian's python3-torch is required (apt-get install python3-torch; .ci/run installs it)");
}

fn firewalled_lab(n: usize) -> Lab {
    let lab = Lab::new(n);
    for i in 0..n {
        lab.firewall_only_udp(i, 29400);
    }
    lab
}

fn run(lab: &mut Lab, args: &[String]) -> Vec<(Option<i32>, String, String)> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    lab.run_on_all(&args, &[("MESHD_TOKEN", "tunnel")], Duration::from_secs(240))
}

/// The preflight chose the tunnel by itself, said so, and the tunnel carried connections.
fn check_tunnel_lines(i: usize, err: &str) {
    assert!(
        err.contains("collective: tunnel (TCP between nodes is blocked"),
        "host {i}: the preflight must choose the tunnel:\n{err}"
    );
    let line = err.lines().find(|l| l.contains("tunnel: ") && l.contains("opened by this node's ranks"));
    let line = line.unwrap_or_else(|| panic!("host {i}: no tunnel counters line:\n{err}"));
    // "tunnel: N tunnelled connections opened by this node's ranks (F failed), S served for other nodes"
    let num = |after: &str| -> u64 {
        line.split(after)
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|n| n.trim_start_matches('(').parse().ok())
            .unwrap_or(0)
    };
    let (opened, served) = (num("tunnel: "), num("failed), "));
    assert!(opened + served > 0, "host {i}: no connection went through the tunnel: {line}");
}

#[test]
fn unmodified_ddp_over_gloo_trains_to_identical_parameters_behind_a_one_port_firewall() {
    if !lab::available() {
        return;
    }
    needs_torch();
    let mut lab = firewalled_lab(3);
    let args = python_job(&lab.peers(), 3, 2, "auto", "ddp_gloo.py", &["--steps", "15"]);
    let mut digests = Vec::new();
    for (i, (code, out, err)) in run(&mut lab, &args).iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        check_tunnel_lines(i, err);
        for l in out.lines().filter(|l| l.contains("DDP rank=")) {
            assert!(l.contains("world=6"), "{l}");
            let d =
                l.split("params_sha256=").nth(1).and_then(|s| s.split_whitespace().next()).expect("digest");
            digests.push(d.to_string());
        }
    }
    assert_eq!(digests.len(), 6, "every rank reports");
    assert!(digests.iter().all(|d| *d == digests[0]), "parameters differ across ranks: {digests:?}");
}

#[test]
fn store_objects_user_sockets_and_refusals_go_through_the_tunnel() {
    if !lab::available() {
        return;
    }
    needs_torch();
    let mut lab = firewalled_lab(3);
    let args = python_job(&lab.peers(), 3, 2, "auto", "tunnel_check.py", &[]);
    for (i, (code, out, err)) in run(&mut lab, &args).iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        check_tunnel_lines(i, err);
        let ok: Vec<&str> = out.lines().filter(|l| l.contains("TUNNEL OK")).collect();
        assert_eq!(ok.len(), 2, "host {i}: both ranks pass:\n{out}\n{err}");
        for l in ok {
            assert!(l.contains("world=6") && l.contains("collective=tunnel") && l.contains("nodes=3"), "{l}");
        }
    }
}

/// A node that dies while ranks stream through the tunnel to it: the others' tunnelled
/// sockets fail (the QUIC connection is lost) and the job is torn down as it is without
/// the tunnel: every surviving meshd exits non-zero, saying why, and leaves no rank.
#[test]
fn a_node_killed_mid_transfer_tears_the_job_down() {
    if !lab::available() {
        return;
    }
    needs_torch();
    let mut lab = firewalled_lab(3);
    let args = python_job(&lab.peers(), 3, 2, "auto", "ddp_gloo.py", &["--steps", "1000000"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ks: Vec<usize> = (0..3).map(|i| lab.spawn(i, &args, &[("MESHD_TOKEN", "tunnel")])).collect();
    std::thread::sleep(Duration::from_secs(12));
    assert!(!lab.exited(ks[0]) && !lab.exited(ks[1]), "the job must still be training");
    // `meshd status` counts the tunnelled connections and bytes of the running job.
    let k = lab.spawn(0, &[lab::meshd(), "status", "--json"], &[("MESHD_TOKEN", "tunnel")]);
    let (code, out, err) = lab.wait(k, Duration::from_secs(20));
    assert_eq!(code, Some(0), "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("status JSON");
    let t = &v["tunnel"];
    let n = |k: &str| t[k].as_u64().unwrap_or(0);
    assert!(n("opened") + n("served") > 0 && n("active") > 0, "{v}");
    assert!(n("bytes_out") > 0 && n("bytes_in") > 0, "{v}");
    let t = std::time::Instant::now();
    lab.crash(2);
    for i in [0, 1] {
        let (code, out, err) = lab.wait(ks[i], Duration::from_secs(60));
        assert!(code.is_some_and(|c| c != 0), "host {i} must stop with an error:\n{out}\n{err}");
        assert!(
            err.contains("stopped answering")
                || err.contains("job stopped by")
                || err.contains("left the mesh"),
            "host {i} must say why:\n{err}"
        );
        assert!(err.contains("collective: tunnel"), "host {i}:\n{err}");
        assert!(lab.pids(i).is_empty(), "host {i}: processes left: {:?}", lab.pids(i));
    }
    eprintln!("FIGURE tunnel: a node killed mid-transfer: the job stopped everywhere in {:?}", t.elapsed());
}
