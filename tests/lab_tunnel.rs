//! Lab: tunnel mode. Behind the one-port firewall on every host (all TCP and all UDP but
//! meshd's port dropped on the real network), unmodified PyTorch jobs and plain sockets
//! reach the other nodes: meshd carries the ranks' TCP connections over its QUIC
//! connections (LD_PRELOAD interposer, docs/PROTOCOL.md "The TCP tunnel").

mod lab;
mod torches;
use lab::{Lab, python_job};
use std::time::Duration;
use torches::Torch;

const PY: &str = torches::DEBIAN_PYTHON;

fn firewalled_lab(n: usize) -> Lab {
    let lab = Lab::new(n);
    for i in 0..n {
        lab.firewall_only_udp(i, 29400);
    }
    lab
}

fn run(lab: &mut Lab, t: &Torch, args: &[String]) -> Vec<(Option<i32>, String, String)> {
    let env = lab::token_env("tunnel", t.env());
    lab.run_on_all(args, &lab::env_refs(&env), Duration::from_secs(240))
}

/// The preflight chose the tunnel by itself, said so, and the tunnel carried connections.
fn check_tunnel_lines(i: usize, err: &str) {
    assert!(
        err.contains("collective: tunnel (TCP between nodes is blocked"),
        "host {i}: the preflight must choose the tunnel:\n{err}"
    );
    check_counters(i, err);
}

/// The end-of-round counters say connections went through the tunnel.
fn check_counters(i: usize, err: &str) {
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

on_torches!([torch1_13, torch2]
fn unmodified_ddp_over_gloo_trains_to_identical_parameters_behind_a_one_port_firewall(t) {
    lab_or_skip!();
    let mut lab = firewalled_lab(3);
    let args = python_job(&t.python, &lab.peers(), 3, 2, "auto", "ddp_gloo.py", &["--steps", "15"]);
    let mut digests = Vec::new();
    for (i, (code, out, err)) in run(&mut lab, t, &args).iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        check_tunnel_lines(i, err);
        for l in out.lines().filter(|l| l.contains("DDP rank=")) {
            assert!(l.contains("world=6"), "{l}");
            let d =
                l.split("params_sha256=").nth(1).and_then(|s| s.split_whitespace().next()).expect("digest");
            digests.push(d.to_string());
        }
    }
    assert_eq!(digests.len(), 6, "every rank reports ({})", t.label());
    assert!(digests.iter().all(|d| *d == digests[0]), "parameters differ across ranks: {digests:?}");
}
);

/// Listens on `ip:port` outside any job (as sshd would) for `secs`, printing one line per
/// connection it gets.
fn outside_listener(ip: &str, port: u16, secs: u32) -> String {
    format!(
        "import socket, time\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind(({ip:?}, {port}))\ns.listen(16)\ns.settimeout(0.5)\nprint('LISTENING', flush=True)\n\
         end = time.time() + {secs}\nwhile time.time() < end:\n    try:\n        c, a = s.accept()\n        \
         print('OUTSIDE CONNECTION', a, flush=True)\n        c.close()\n    except socket.timeout:\n        pass\n"
    )
}

// torch 2's all_gather_object needs numpy (it reads the gathered bytes with .numpy()).
// Also issue 29: an sshd-like listener started outside meshd on every node's address is
// out of reach through the tunnel (ECONNREFUSED, and it never sees a connection), while
// the job's own TCPStore, Gloo and user listeners work.
on_torches!([torch1_13, torch2_numpy]
fn store_objects_user_sockets_and_refusals_go_through_the_tunnel(t) {
    lab_or_skip!();
    let mut lab = firewalled_lab(3);
    const OUTSIDE: u16 = 2222;
    let outside: Vec<usize> = (0..3)
        .map(|i| {
            let script = outside_listener(&lab.hosts[i].eth1.clone(), OUTSIDE, 200);
            lab.spawn(i, &[PY, "-c", &script], &[])
        })
        .collect();
    let args = python_job(&t.python, &lab.peers(), 3, 2, "auto", "tunnel_check.py", &[]);
    let env = lab::token_env("tunnel", [("MESHD_TEST_OUTSIDE_PORT", OUTSIDE.to_string())].into_iter().chain(t.env()));
    let results = lab.run_on_all(&args, &lab::env_refs(&env), Duration::from_secs(240));
    for k in outside {
        lab.signal(k, libc::SIGKILL);
        let (_, out, err) = lab.wait(k, Duration::from_secs(5));
        assert!(out.contains("LISTENING"), "the outside listener did not start:\n{out}\n{err}");
        assert!(!out.contains("OUTSIDE CONNECTION"), "the tunnel reached a port outside the job:\n{out}");
    }
    for (i, (code, out, err)) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        check_tunnel_lines(i, err);
        assert!(
            err.contains("no rank of this job listens on port 2222 here"),
            "host {i}: the refusal is logged, naming the port:\n{err}"
        );
        let ok: Vec<&str> = out.lines().filter(|l| l.contains("TUNNEL OK")).collect();
        assert_eq!(ok.len(), 2, "host {i}: both ranks pass:\n{out}\n{err}");
        for l in ok {
            assert!(l.contains("world=6") && l.contains("collective=tunnel") && l.contains("nodes=3"), "{l}");
        }
    }
}
);

/// A node that dies while ranks stream through the tunnel to it: the others' tunnelled
/// sockets fail (the QUIC connection is lost) and the job is torn down as it is without
/// the tunnel: every surviving meshd exits non-zero, saying why, and leaves no rank.
#[test]
fn a_node_killed_mid_transfer_tears_the_job_down() {
    lab_or_skip!();
    let t = Torch::debian();
    let mut lab = firewalled_lab(3);
    let args = python_job(&t.python, &lab.peers(), 3, 2, "auto", "ddp_gloo.py", &["--steps", "1000000"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ks: Vec<usize> = (0..3).map(|i| lab.spawn(i, &args, &[("MESHD_TOKEN", "tunnel")])).collect();
    // `meshd status` counts the tunnelled connections and bytes of the running job. The
    // ranks import torch first (tens of seconds on a loaded machine): asked until the job's
    // connections show, within a bound.
    let asked = std::time::Instant::now();
    loop {
        std::thread::sleep(Duration::from_secs(3));
        for &k in &ks[..2] {
            if lab.exited(k) {
                let (code, out, err) = lab.wait(k, Duration::from_secs(1));
                panic!("the job must still be training: host {k} exited ({code:?}):\n{out}\n{err}");
            }
        }
        let k = lab.spawn(0, &[lab::meshd(), "status", "--json"], &[("MESHD_TOKEN", "tunnel")]);
        let (code, out, err) = lab.wait(k, Duration::from_secs(20));
        assert_eq!(code, Some(0), "{out}\n{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("status JSON");
        let t = &v["tunnel"];
        let n = |k: &str| t[k].as_u64().unwrap_or(0);
        let counted =
            n("opened") + n("served") > 0 && n("active") > 0 && n("bytes_out") > 0 && n("bytes_in") > 0;
        if counted {
            break;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(90),
            "no tunnelled connection counted within 90 s: {v}"
        );
    }
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

/// A node killed while a rank streams both ways to it through the tunnel (plain sockets):
/// the surviving rank's sockets fail as over TCP when the peer is reset: its read on the
/// connection it opened (the near end: a Unix socket to meshd, which the preload library
/// reports as reset) and its write on the one it accepted (the far end: meshd's loopback
/// TCP connection, closed with RST) both fail with ECONNRESET, not end of file or EPIPE.
#[test]
fn a_node_killed_mid_transfer_resets_the_ranks_tunnelled_sockets() {
    lab_or_skip!();
    let mut lab = firewalled_lab(2);
    let ready = format!("/tmp/meshd-lab-reset-{}-", std::process::id());
    let args = python_job(PY, &lab.peers(), 2, 1, "auto", "tunnel_reset.py", &[&ready]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ks: Vec<usize> = (0..2).map(|i| lab.spawn(i, &args, &[("MESHD_TOKEN", "tunnel")])).collect();
    let files: Vec<String> = lab.peers().split(',').map(|a| format!("{ready}{a}")).collect();
    let t = std::time::Instant::now();
    while !files.iter().all(|f| std::path::Path::new(f).exists()) {
        assert!(t.elapsed() < Duration::from_secs(90), "the ranks never streamed both ways");
        assert!(!lab.exited(ks[0]) && !lab.exited(ks[1]), "a node stopped before streaming");
        std::thread::sleep(Duration::from_millis(100));
    }
    for f in &files {
        let _ = std::fs::remove_file(f);
    }
    lab.crash(1);
    let (code, out, err) = lab.wait(ks[0], Duration::from_secs(60));
    assert!(code.is_some_and(|c| c != 0), "the job must stop with an error:\n{out}\n{err}");
    assert!(err.contains("collective: tunnel"), "{err}");
    let line = out
        .lines()
        .find(|l| l.contains("RESET client="))
        .unwrap_or_else(|| panic!("no RESET line:\n{out}\n{err}"));
    assert!(
        line.contains("client=errno 104 server=errno 104"),
        "both sockets must read as reset: {line}\n{err}"
    );
    assert!(lab.pids(0).is_empty(), "processes left: {:?}", lab.pids(0));
}

/// With libnccl (the PyPI wheel's, no GPU needed): behind the one-port firewall every rank
/// reaches the root of the NCCL unique id meshd hands out (on the master's eth1) through
/// the tunnel, as ncclCommInitRank's bootstrap must.
#[test]
fn the_nccl_unique_ids_root_is_reachable_through_the_tunnel_from_every_node() {
    lab_or_skip!();
    let libpath = match std::env::var("MESHD_NCCL_LIB") {
        Ok(p) if std::path::Path::new(&p).exists() => p,
        _ if std::env::var("MESHD_REQUIRE_NCCL").is_ok() => {
            panic!("MESHD_REQUIRE_NCCL is set but MESHD_NCCL_LIB does not name libnccl.so.2")
        }
        _ => {
            eprintln!(
                "*** NCCL TUNNEL LAB TEST SKIPPED: MESHD_NCCL_LIB not set (run scripts/fetch-nccl.sh) ***"
            );
            return;
        }
    };
    let mut lab = firewalled_lab(3);
    // The id's sockaddr: family (LE u16) at byte 8, port (BE) at 10, IPv4 at 12. Eight bytes
    // that are not NCCL's magic, then close (what the preflight sends: safe on every version).
    let script = r#"
import os, socket
b = bytes.fromhex(os.environ["MESHD_NCCL_UNIQUE_ID"])
assert int.from_bytes(b[8:10], "little") == 2
port, ip = int.from_bytes(b[10:12], "big"), ".".join(str(x) for x in b[12:16])
s = socket.create_connection((ip, port), timeout=20)
s.sendall(b"\0" * 8)
s.close()
print(f"NCCLROOT OK {ip}:{port} from {os.environ['MESHD_NODE_ADDR']}", flush=True)
"#;
    let args = lab.meshd_run().flags(&["--nproc-per-node", "2"]).cmd(&[PY, "-c", script]);
    let res = lab.run_on_all(
        &args,
        &[("MESHD_NCCL_LIB", &libpath), ("MESHD_TOKEN", "nccl-tunnel")],
        Duration::from_secs(120),
    );
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        assert!(err.contains("collective: tunnel"), "host {i}:\n{err}");
        let ok: Vec<&str> = out.lines().filter(|l| l.contains("NCCLROOT OK 198.19.0.7:")).collect();
        assert_eq!(ok.len(), 2, "host {i}: both ranks reach the root:\n{out}\n{err}");
    }
}

/// A quick figure (not a check; `cargo bench --bench allreduce` has the side-by-side one):
/// Gloo's allreduce of `MESHD_TUNNEL_FIGURE_SIZE` bytes (64 MiB) through the tunnel,
/// 3 hosts x 1 rank, MTU `MESHD_TUNNEL_FIGURE_MTU` (1500), `MESHD_TUNNEL_FIGURE_ITERS`
/// timed allreduces (5).
#[test]
#[ignore]
fn figure_gloo_allreduce_through_the_tunnel() {
    lab_or_skip!();
    let size = std::env::var("MESHD_TUNNEL_FIGURE_SIZE").unwrap_or_else(|_| (64 << 20).to_string());
    let mtu: u32 = std::env::var("MESHD_TUNNEL_FIGURE_MTU").ok().and_then(|m| m.parse().ok()).unwrap_or(1500);
    let iters = std::env::var("MESHD_TUNNEL_FIGURE_ITERS").unwrap_or_else(|_| "5".into());
    let mut lab = firewalled_lab(3);
    if mtu != 1500 {
        lab.set_mtu(mtu);
    }
    let args = python_job(
        PY,
        &lab.peers(),
        3,
        1,
        "auto",
        "gloo_allreduce_bench.py",
        &["--size", &size, "--iters", &iters],
    );
    for (i, (code, out, err)) in run(&mut lab, &Torch::debian(), &args).iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        for l in out.lines().filter(|l| l.contains("GLOO ")) {
            eprintln!("FIGURE tunnel mtu {mtu} host {i}: {l}");
        }
        for l in err.lines().filter(|l| l.contains("tunnel: ") && l.contains("MiB")) {
            eprintln!("FIGURE tunnel mtu {mtu} host {i}: {l}");
        }
    }
}

/// `--collective tunnel` on an open network: the ranks' connections to other nodes go
/// through meshd although TCP works, and the launch line says it was forced.
#[test]
fn collective_tunnel_can_be_forced_on_an_open_network() {
    lab_or_skip!();
    let t = Torch::debian();
    let mut lab = Lab::new(3);
    let args = python_job(&t.python, &lab.peers(), 3, 2, "tunnel", "tunnel_check.py", &[]);
    for (i, (code, out, err)) in run(&mut lab, &t, &args).iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        assert!(err.contains("collective: tunnel (forced by --collective"), "host {i}:\n{err}");
        assert!(!err.contains("TCP between nodes is blocked"), "host {i}:\n{err}");
        assert_eq!(out.matches("TUNNEL OK").count(), 2, "host {i}:\n{out}\n{err}");
        check_counters(i, err);
    }
}

/// Issue 29: the tunnel under `prlimit --nofile=128` on every meshd, 2 hosts x 2 ranks
/// (`tests/python/tunnel_fds.py`): 150 connections held at once, more than 128 files allow,
/// each connected or refused at once (ECONNREFUSED, never a hang), and after they close one
/// more connects: the accept loops wait out EMFILE, and the tunnel's budget of open files
/// refuses past it. Before, the first EMFILE ended the tunnel's accept loop for good.
#[test]
fn tunnelled_connections_past_the_open_files_limit_are_refused_and_the_tunnel_lives_on() {
    lab_or_skip!();
    let mut lab = firewalled_lab(2);
    let script = format!("{}/tests/python/tunnel_fds.py", env!("CARGO_MANIFEST_DIR"));
    let meshd_run =
        lab.meshd_run().flags(&["--nproc-per-node", "2", "--collective", "tunnel"]).cmd(&[PY, &script]);
    let args = [vec!["prlimit".to_string(), "--nofile=128".to_string()], meshd_run].concat();
    let results = lab.run_on_all(&args, &[("MESHD_TOKEN", "tunnel")], Duration::from_secs(120));
    for (i, (code, out, err)) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        assert_eq!(out.matches("FDS OK").count(), 2, "host {i}:\n{out}\n{err}");
    }
    let said = results.iter().any(|(_, _, err)| err.contains("all its open files allow"));
    assert!(said, "a refusal names the open-files limit:\n{results:?}");
}

/// `meshd run --collective tunnel` of tests/python/`script` under `python`, one rank on
/// each host of `lab`.
fn python_test_job(lab: &Lab, python: &str, script: &str) -> Vec<String> {
    let script = format!("{}/tests/python/{script}", env!("CARGO_MANIFEST_DIR"));
    lab.meshd_run().flags(&["--nproc-per-node", "1", "--collective", "tunnel"]).cmd(&[python, &script])
}

// Issue 29, item 8: plain sockets cannot tell the tunnel from TCP (tests/python/
// tunnel_sockets.py, behind the one-port firewall): options and bind set before connect
// hold (SO_RCVTIMEO makes a recv time out), a non-blocking connect is in progress until
// meshd has answered (EINPROGRESS, writable, SO_ERROR 0 or ECONNREFUSED), the program's
// own connect timeouts hold (create_connection(timeout=1), asyncio's wait_for), dup'd
// and exec-inherited fds are TCP sockets, and children forked while other threads use
// the interposer do not hang.
on_torches!([torch1_13, torch2]
fn plain_sockets_cannot_tell_the_tunnel_from_tcp(t) {
    lab_or_skip!();
    let mut lab = firewalled_lab(2);
    let args = python_test_job(&lab, &t.python, "tunnel_sockets.py");
    for (i, (code, out, err)) in run(&mut lab, t, &args).iter().enumerate() {
        assert_eq!(*code, Some(0), "{}, host {i}:\n{out}\n{err}", t.label());
        for c in ["rcvtimeo", "options", "nonblocking", "timeout", "asyncio", "dup", "exec", "fork"] {
            assert!(out.contains(&format!("CHECK {c} ok")), "{}, host {i}: check {c}:\n{out}\n{err}", t.label());
        }
        assert!(out.contains("SOCKETS OK"), "{}, host {i}:\n{out}\n{err}", t.label());
        assert!(err.contains("collective: tunnel"), "{}, host {i}:\n{err}", t.label());
        check_counters(i, err);
    }
}
);
