//! Lab: when only meshd's UDP port is open, jobs still train through the QUIC ring.

mod lab;
use lab::{Lab, meshd};
use std::time::Duration;

const PY: &str = "/usr/bin/python3";

fn firewalled_lab() -> Lab {
    let lab = Lab::new(3);
    for i in 0..3 {
        lab.firewall_only_udp(i, 29400);
    }
    lab
}

fn run3(lab: &mut Lab, cmd: &[&str]) -> Vec<(Option<i32>, String, String)> {
    let peers = lab.peers();
    let mut args = vec![meshd(), "run", "--nnodes", "3", "--peers", &peers, "--nproc-per-node", "2", "--"];
    args.extend_from_slice(cmd);
    lab.run_on_all(&args, &[("MESHD_TOKEN", "quic")], Duration::from_secs(180))
}

fn check_training(res: &[(Option<i32>, String, String)], ddp: bool) {
    let mut digests = Vec::new();
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        assert!(err.contains("collective: quic"), "the preflight must choose quic:\n{err}");
        for l in out.lines().filter(|l| l.contains("QUIC-TRAIN")) {
            assert!(
                l.contains("world=6")
                    && l.contains("collective=quic")
                    && l.contains(&format!("ddp={}", if ddp { "True" } else { "False" })),
                "{l}"
            );
            digests.push(
                l.split("params_sha256=")
                    .nth(1)
                    .and_then(|s| s.split_whitespace().next())
                    .expect("digest")
                    .to_string(),
            );
        }
    }
    assert_eq!(digests.len(), 6, "every rank reports");
    assert!(digests.iter().all(|d| *d == digests[0]), "parameters differ: {digests:?}");
}

fn needs_torch() {
    let ok = std::process::Command::new(PY).args(["-c", "import torch"]).status().is_ok_and(|s| s.success());
    assert!(ok, "Debian's python3-torch is required (apt-get install python3-torch; .ci/run installs it)");
}

#[test]
fn training_loop_averages_gradients_over_quic_behind_a_one_port_firewall() {
    if !lab::available() {
        return;
    }
    needs_torch();
    let mut lab = firewalled_lab();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/train_quic.py");
    check_training(&run3(&mut lab, &[PY, script, "--steps", "10"]), false);
}

#[test]
fn ddp_hook_averages_gradients_over_quic_behind_a_one_port_firewall() {
    if !lab::available() {
        return;
    }
    needs_torch();
    let mut lab = firewalled_lab();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/train_quic.py");
    check_training(&run3(&mut lab, &[PY, script, "--steps", "10", "--ddp"]), true);
}

#[test]
fn collectives_store_and_barrier_across_firewalled_hosts() {
    if !lab::available() {
        return;
    }
    let mut lab = firewalled_lab();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/collectives_check.py");
    for (i, (code, out, err)) in run3(&mut lab, &[PY, script]).iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        assert_eq!(out.matches("COLLECTIVES OK").count(), 2, "host {i}:\n{out}\n{err}");
    }
}
