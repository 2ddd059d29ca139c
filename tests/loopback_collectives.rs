//! Collectives across several meshd nodes on loopback (no root needed): world sizes from 1
//! to 5 nodes, 1 or 2 processes each, odd lengths, every dtype the client supports.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn run_nodes(nodes: usize, nproc: usize, base_port: u16) {
    let peers: Vec<String> = (0..nodes).map(|i| format!("127.0.0.1:{}", base_port + i as u16)).collect();
    let peers = peers.join(",");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/collectives_check.py");
    let mut children: Vec<_> = (0..nodes)
        .map(|i| {
            let port = (base_port + i as u16).to_string();
            let nn = nodes.to_string();
            let np = nproc.to_string();
            Command::new(env!("CARGO_BIN_EXE_meshd"))
                .args(["run", "--nnodes", &nn, "--peers", &peers, "--port", &port, "--nproc-per-node", &np])
                .args(["--rdzv-timeout", "60s", "--", "/usr/bin/python3", script])
                .env("MESHD_TOKEN", "loopback")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn meshd")
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    for c in children.iter_mut() {
        while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
    }
    let mut ok = 0;
    for (i, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().expect("output");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{nodes} nodes x {nproc}: node {i} failed:\n{stdout}\n{stderr}");
        // meshd is the ranks' parent, so it may read their memory: buffers go in place.
        ok += stdout.matches("COLLECTIVES OK").count();
        assert_eq!(stdout.matches("in_place=True").count(), nproc, "node {i}:\n{stdout}");
    }
    assert_eq!(ok, nodes * nproc, "every rank must pass its checks");
}

#[test]
fn one_node() {
    run_nodes(1, 2, 29610);
}

#[test]
fn two_nodes() {
    run_nodes(2, 1, 29620);
}

#[test]
fn four_nodes_two_procs() {
    run_nodes(4, 2, 29630);
}

#[test]
fn five_nodes() {
    run_nodes(5, 1, 29640);
}

#[test]
fn in_place_requests_that_cannot_be_served_are_refused_with_the_cause() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/in_place_check.py");
    let out = Command::new(env!("CARGO_BIN_EXE_meshd"))
        .args(["run", "--nnodes", "1", "--peers", "127.0.0.1:29690", "--port", "29690"])
        .args(["--", "/usr/bin/python3", script])
        .env("MESHD_TOKEN", "loopback")
        .output()
        .expect("run meshd");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("IN-PLACE OK"), "{stdout}\n{stderr}");
}
