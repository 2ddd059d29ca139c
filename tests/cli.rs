//! The `meshd` binary on one machine: defaults, flag errors, start-up errors (no lab).

use std::process::{Command, Output};

fn meshd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_meshd"))
        .args(args)
        .env_remove("SLURM_NNODES")
        .env_remove("SLURM_JOB_NODELIST")
        .env_remove("MESHD_TOKEN")
        .output()
        .expect("run meshd")
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into(), String::from_utf8_lossy(&o.stderr).into())
}

/// A free UDP port on loopback (bound then released).
fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Like torchrun, one machine needs no --nnodes.
#[test]
fn one_machine_needs_no_nnodes() {
    let port = free_udp_port().to_string();
    let o = meshd(&[
        "run",
        "--nproc-per-node",
        "2",
        "--port",
        &port,
        "--",
        "sh",
        "-c",
        "echo rank $RANK of $WORLD_SIZE",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("rank 0 of 2") && out.contains("rank 1 of 2"), "{out}");
}

/// With peers, --nnodes stays required, and the error says what to pass.
#[test]
fn peers_without_nnodes_say_what_to_pass() {
    let o = meshd(&["run", "--peers", "127.0.0.1,127.0.0.2", "--", "true"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("pass --nnodes N") && err.contains("--nnodes 2"), "{err}");
}

/// A mistyped flag gets a suggestion.
#[test]
fn mistyped_flag_gets_a_suggestion() {
    let o = meshd(&["run", "--nproc-per-nod", "2", "--", "true"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("--nproc-per-node"), "did you mean ...? {err}");
    assert!(err.contains("similar argument exists") || err.contains("did you mean"), "{err}");
}

/// Counts of one read "1 node", never "1 nodes".
#[test]
fn one_node_messages_use_the_singular() {
    let port = free_udp_port().to_string();
    let o = meshd(&["run", "--nproc-per-node", "1", "--port", &port, "--", "true"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains("roster agreed: 1 node,"), "{err}");
    for bad in ["1 nodes", "1 ranks", "all 1 ", "1 lanes", "lane(s)"] {
        assert!(!err.contains(bad), "{bad:?} in:\n{err}");
    }
}

/// A port in use: the error once, naming what holds the port.
#[test]
fn port_in_use_is_said_once_with_its_holder() {
    let held = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    let port = held.local_addr().expect("addr").port().to_string();
    let o = meshd(&["run", "--nnodes", "1", "--port", &port, "--", "true"]);
    let (_, err) = text(&o);
    assert!(!o.status.success(), "{err}");
    assert_eq!(err.matches("Address already in use").count(), 1, "said once:\n{err}");
    assert_eq!(err.matches("cannot bind UDP").count(), 1, "said once:\n{err}");
    let me = format!("held by pid {} (", std::process::id());
    assert!(err.contains(&me), "names the holder ({me}):\n{err}");
    assert!(err.contains("--port"), "{err}");
    drop(held);
}

/// torchrun's PET_ variables (as Kubeflow's PyTorchJob sets them) stand in for flags; a flag
/// wins over its variable; a script path without `--` runs under Python.
#[test]
fn pet_variables_stand_in_for_flags_and_a_flag_wins() {
    let dir = std::env::temp_dir().join(format!("meshd-cli-pet-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let script = dir.join("ws.py");
    std::fs::write(&script, "import os\nprint('WS', os.environ['WORLD_SIZE'], os.environ['ROLE_NAME'])\n")
        .expect("w");
    let run = |extra: &[&str]| {
        let mut args = vec!["run"];
        args.extend_from_slice(extra);
        let s = script.display().to_string();
        args.push(&s);
        let o = Command::new(env!("CARGO_BIN_EXE_meshd"))
            .args(&args)
            .env_remove("SLURM_NNODES")
            .env_remove("SLURM_JOB_NODELIST")
            .env_remove("MESHD_TOKEN")
            .env("PET_NPROC_PER_NODE", "3")
            .env("PET_STANDALONE", "1")
            .env("PET_ROLE", "worker")
            .env("PET_RDZV_BACKEND", "c10d")
            .output()
            .expect("run meshd");
        let (out, err) = text(&o);
        assert!(o.status.success(), "{out}\n{err}");
        out
    };
    let out = run(&[]);
    assert_eq!(out.matches("WS 3 worker").count(), 3, "{out}");
    let out = run(&["--nproc_per_node", "1"]);
    assert_eq!(out.matches("WS 1 worker").count(), 1, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 24: nothing slow on the start path. No interpreter is started (a `python3` on
/// PATH that records being run is never run, also while looking for libnccl), and the line
/// that says the ranks started gives this node's phases and meshd's CPU time.
#[test]
fn the_start_path_runs_no_interpreter_and_says_where_the_time_went() {
    let dir = std::env::temp_dir().join(format!("meshd-nopython-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let marker = dir.join("python-was-run");
    let py = dir.join("python3");
    std::fs::write(&py, format!("#!/bin/sh\ntouch {}\nexec /usr/bin/python3 \"$@\"\n", marker.display()))
        .expect("py");
    std::fs::set_permissions(&py, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let port = free_udp_port().to_string();
    let path = format!("{}:/usr/bin:/bin", dir.display());
    let o = Command::new(env!("CARGO_BIN_EXE_meshd"))
        .args(["run", "--nnodes", "1", "--nproc-per-node", "2", "--port", &port, "--", "true"])
        .env("PATH", &path)
        .env_remove("MESHD_NCCL_LIB")
        .env_remove("MESHD_TOKEN")
        .output()
        .expect("run meshd");
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(!marker.exists(), "meshd started python3 on its start path:\n{err}");
    let line = err
        .lines()
        .find(|l| l.contains("started 2 ranks"))
        .unwrap_or_else(|| panic!("no launch line:\n{err}"));
    for phase in ["after meshd started", "interface", "join and roster", "preflight", "spawn", "meshd CPU"] {
        assert!(line.contains(phase), "{phase:?} missing: {line}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rendezvous that times out exits 1 (as torchrun's), the code the README documents; a
/// bad flag exits 2. The peer is a loopback port nobody answers on.
#[test]
fn a_timed_out_rendezvous_exits_1_and_a_bad_flag_2() {
    let port = free_udp_port().to_string();
    let silent = format!("127.0.0.1:{}", free_udp_port());
    let start = std::time::Instant::now();
    let o = meshd(&[
        "run",
        "--nnodes",
        "2",
        "--peers",
        &silent,
        "--port",
        &port,
        "--rdzv-timeout",
        "2s",
        "--insecure",
        "--",
        "true",
    ]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "a timed-out rendezvous exits 1:\n{out}\n{err}");
    assert!(err.contains("timed out"), "the error says the rendezvous timed out:\n{err}");
    assert!(start.elapsed() < std::time::Duration::from_secs(30), "it must not hang past its deadline");
    let o = meshd(&["run", "--rdzv-timeout", "soon", "--", "true"]);
    assert_eq!(o.status.code(), Some(2), "a bad flag exits 2: {}", text(&o).1);
}
