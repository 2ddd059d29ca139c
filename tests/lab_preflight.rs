//! Lab: the preflight (`meshd doctor`, and before every `meshd run`).

mod lab;
use lab::{Lab, meshd};
use std::time::Duration;

fn doctor_everywhere(lab: &mut Lab) -> Vec<serde_json::Value> {
    let peers = lab.peers();
    let args = [meshd(), "doctor", "--json", "--nnodes", "3", "--peers", &peers, "--rdzv-timeout", "30s"];
    lab.run_on_all(&args, &[("MESHD_TOKEN", "doc")], Duration::from_secs(60))
        .into_iter()
        .enumerate()
        .map(|(i, (code, out, err))| {
            assert_eq!(code, Some(0), "host {i}:\n{out}\n{err}");
            serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("host {i}: {e}: {out}\n{err}"))
        })
        .collect()
}

#[test]
fn doctor_reports_nccl_on_an_open_network() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    for v in doctor_everywhere(&mut lab) {
        assert_eq!(v["ok"], true, "{v}");
        assert_eq!(v["collective"], "nccl", "{v}");
        assert_eq!(v["iface"], "eth1", "{v}");
        assert_eq!(v["master"], "198.19.0.7", "{v}");
        let tcp =
            v["checks"].as_array().expect("checks").iter().find(|c| c["name"] == "tcp").expect("tcp check");
        assert_eq!(tcp["ok"], true, "{tcp}");
    }
}

#[test]
fn doctor_reports_the_tunnel_behind_a_one_port_firewall_and_names_the_path() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    // Host 2 (198.19.0.19) drops all TCP and all UDP but meshd's port.
    lab.firewall_only_udp(2, 29400);
    for v in doctor_everywhere(&mut lab) {
        assert_eq!(v["ok"], true, "a job still works, through the tunnel: {v}");
        assert_eq!(v["collective"], "tunnel", "{v}");
        let tcp =
            v["checks"].as_array().expect("checks").iter().find(|c| c["name"] == "tcp").expect("tcp check");
        assert_eq!(tcp["ok"], false);
        let d = tcp["detail"].as_str().expect("detail");
        assert!(d.contains("-> 198.19.0.19:"), "names the blocked path: {d}");
        assert!(d.contains("open TCP"), "says what to open: {d}");
        // The verdict says what will and will not work, not just "a job would work".
        let verdict = v["verdict"].as_str().expect("verdict");
        assert!(
            verdict.contains("the ranks' TCP connections to other nodes (Gloo, NCCL's sockets, the TCPStore"),
            "{verdict}"
        );
        assert!(verdict.contains("go through meshd's UDP port (tunnel mode)"), "{verdict}");
        assert!(verdict.contains("meshd's client and DDP hook work"), "{verdict}");
        assert!(verdict.contains("(198.19.0.7 <-> 198.19.0.19, 198.19.0.19 <-> 198.19.0.30)"), "{verdict}");
    }
}

#[test]
fn run_behind_a_one_port_firewall_warns_once_on_every_node_and_tunnels() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    lab.firewall_only_udp(2, 29400);
    let args = lab.meshd_run().flags(&["--rdzv-timeout", "30s"]).cmd(&["true"]);
    for (i, (code, out, err)) in
        lab.run_on_all(&args, &[("MESHD_TOKEN", "fw")], Duration::from_secs(60)).into_iter().enumerate()
    {
        assert_eq!(code, Some(0), "host {i}:\n{out}\n{err}");
        let warnings: Vec<&str> =
            err.lines().filter(|l| l.contains("TCP between nodes is blocked")).collect();
        let one: Vec<&&str> = warnings.iter().filter(|l| l.contains("WARN")).collect();
        assert_eq!(one.len(), 1, "host {i}: exactly one warning line:\n{err}");
        let w = one[0];
        assert!(
            w.contains("(198.19.0.7 <-> 198.19.0.19, 198.19.0.19 <-> 198.19.0.30)"),
            "host {i} names the blocked pairs: {w}"
        );
        assert!(w.contains("init_process_group"), "host {i}: {w}");
        assert!(w.contains("go through meshd's UDP port instead (MESHD_COLLECTIVE=tunnel)"), "host {i}: {w}");
        assert!(w.contains("static binaries"), "host {i}: what it cannot carry: {w}");
        assert!(
            w.contains("open TCP 1024-65535 between the nodes on eth1"),
            "host {i}: the direct path: {w}"
        );
        assert!(!err.contains("WARN preflight tcp"), "the long tcp detail is not repeated at warn:\n{err}");
        assert!(err.contains("collective: tunnel"), "host {i}:\n{err}");
    }
}

#[test]
fn launch_refused_when_one_node_runs_another_command() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let ks: Vec<usize> = (0..3)
        .map(|i| {
            let epochs = if i == 2 { "4" } else { "3" };
            let args = lab.meshd_run().cmd(&["echo", "train", "--epochs", epochs]);
            lab.spawn(i, &args, &[("MESHD_TOKEN", "cmd")])
        })
        .collect();
    for (i, k) in ks.into_iter().enumerate() {
        let (code, out, err) = lab.wait(k, Duration::from_secs(60));
        assert_eq!(code, Some(1), "host {i} must refuse:\n{out}\n{err}");
        assert!(!out.contains("[rank"), "no rank may start: {out}");
        assert!(err.contains("launch refused by the preflight"), "host {i}:\n{err}");
        assert!(
            err.contains("`echo train --epochs 4` on 198.19.0.19"),
            "host {i} must say who differs:\n{err}"
        );
    }
}
