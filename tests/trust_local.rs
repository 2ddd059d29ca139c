//! Local trust (issue 16), through the real binary on loopback: nothing a rank started
//! outlives the job, ranks never see the token, a token file others can read is refused,
//! a multi-node mesh without a token is refused unless `--insecure`, `meshd token` makes
//! private tokens.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn meshd(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_meshd"));
    c.args(args).stdin(Stdio::null()).env_remove("MESHD_TOKEN");
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().expect("run meshd")
}

/// `meshd run FLAGS` of a 2-node job on loopback port 29774 whose other node (29775)
/// never comes: a 1 s rendezvous timeout ends it.
fn two_node_job_that_times_out(flags: &[&str]) -> Output {
    let tail = ["--nnodes", "2", "--peers", "127.0.0.1:29775", "--port", "29774", "--rdzv-timeout", "1s"];
    meshd(&[&["run"], flags, &tail, &["--", "true"]].concat(), &[])
}

fn single(port: u16, script: &str) -> Output {
    let p = port.to_string();
    meshd(
        &["run", "--nnodes", "1", "--port", &p, "--grace", "1s", "--", "sh", "-c", script],
        &[("MESHD_TOKEN", "trust-local-test")],
    )
}

/// Processes whose whole command line is `args`.
fn running(args: &[&str]) -> Vec<i32> {
    let want: Vec<u8> = args.iter().flat_map(|a| a.bytes().chain([0u8])).collect();
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let zombie = stat.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z'));
            !zombie && std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == want)
        })
        .collect()
}

fn kill_all(pids: &[i32]) {
    for p in pids {
        // SAFETY: a signal to a test's own leftover.
        unsafe { libc::kill(*p, libc::SIGKILL) };
    }
}

/// `sh -c 'sleep & exit 0'` and a `setsid` daemon: both gone when meshd exits 0.
#[test]
fn nothing_a_rank_started_outlives_the_job() {
    let t = Instant::now();
    let out = single(29771, "sleep 37.31 & setsid sleep 37.32 & sleep 0.2; exit 0");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let left: Vec<i32> = [running(&["sleep", "37.31"]), running(&["sleep", "37.32"])].concat();
    kill_all(&left);
    assert!(left.is_empty(), "processes left behind: {left:?}\n{err}");
    assert!(err.contains("stopped 2 processes that the ranks had left running"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(20));
}

#[test]
fn ranks_never_see_the_token() {
    let out = single(29772, "echo TOKEN_SEEN=${MESHD_TOKEN:-none}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("TOKEN_SEEN=none"), "{stdout}");
}

#[test]
fn token_files_others_can_read_are_refused_and_meshd_token_makes_private_ones() {
    let dir = std::env::temp_dir().join(format!("meshd-trust-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let f = dir.join("token");
    let fs = f.display().to_string();
    let out = meshd(&["token", "--file", &fs], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&f).expect("meta").permissions().mode() & 0o777, 0o600);
    let token = std::fs::read_to_string(&f).expect("read");
    assert_eq!(token.trim().len(), 32, "128 bits in hex: {token:?}");
    // Printed, two in a row differ.
    let a = String::from_utf8_lossy(&meshd(&["token"], &[]).stdout).trim().to_string();
    let b = String::from_utf8_lossy(&meshd(&["token"], &[]).stdout).trim().to_string();
    assert!(a.len() == 32 && a != b, "{a} {b}");
    // Readable by others: refused like ssh refuses such a key.
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let out = meshd(&["run", "--nnodes", "1", "--port", "29773", "--token-file", &fs, "--", "true"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("can be read by other users (mode 0644)") && err.contains("chmod 600"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 29: `--insecure` and the tunnel do not mix (the tunnel reaches the ranks' ports):
/// asking for it without a token is refused at once, naming why.
#[test]
fn the_tunnel_without_a_token_is_refused() {
    let out = meshd(
        &["run", "--insecure", "--nnodes", "2", "--peers", "127.0.0.1:29775", "--port", "29774"]
            .into_iter()
            .chain(["--collective", "tunnel", "--", "true"])
            .collect::<Vec<_>>(),
        &[],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--collective tunnel needs a token") && err.contains("--token-file"), "{err}");
}

#[test]
fn a_multi_node_mesh_without_a_token_is_refused_unless_insecure() {
    for cmd in [
        vec!["run", "--nnodes", "2", "--peers", "127.0.0.1:29775", "--port", "29774", "--", "true"],
        vec!["doctor", "--nnodes", "2", "--peers", "127.0.0.1:29775", "--port", "29774"],
        vec!["bench", "allreduce", "--nnodes", "2", "--peers", "127.0.0.1:29775", "--port", "29774"],
    ] {
        let out = meshd(&cmd, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{cmd:?}: {err}");
        assert!(
            err.contains("meshd token --file ~/.meshd-token") && err.contains("--insecure"),
            "{cmd:?}: {err}"
        );
    }
    // With --insecure it starts (and waits for the other node: a short timeout ends it).
    let out = two_node_job_that_times_out(&["--insecure"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rendezvous timed out"), "{err}");
    // README: a timed-out rendezvous exits 1 (the node core's outcome), not 2 (bad usage).
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("ANYONE who can reach UDP 29774"), "{err}");
    // A token on the command line works, with a warning that ps shows it.
    let out = two_node_job_that_times_out(&["--token", "visible"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--token on the command line is visible"), "{err}");
}

/// The run id (TORCHELASTIC_RUN_ID, the socket path) says nothing about the token: two
/// tokens give the same one, so nothing published can be used to test token guesses.
#[test]
fn the_run_id_does_not_depend_on_the_token() {
    let run = |token: &str, port: &str| {
        let out = meshd(
            &[
                "run",
                "--nnodes",
                "1",
                "--port",
                port,
                "--",
                "sh",
                "-c",
                "echo RUNID=$TORCHELASTIC_RUN_ID SOCK=$MESHD_SOCKET",
            ],
            &[("MESHD_TOKEN", token)],
        );
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let s = String::from_utf8_lossy(&out.stdout).to_string();
        let id = s
            .split("RUNID=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_default()
            .to_string();
        let sock =
            s.split("SOCK=").nth(1).and_then(|r| r.split_whitespace().next()).unwrap_or_default().to_string();
        (id, sock)
    };
    let (a, sock_a) = run("first-secret", "29776");
    let (b, _) = run("another-secret", "29776");
    assert_eq!(a, b, "the run id must not depend on the token");
    assert_eq!(a, "meshd-default");
    assert!(!sock_a.contains("first-secret"), "{sock_a}");
    // The socket directory was removed at exit.
    let dir = std::path::Path::new(&sock_a).parent().expect("dir").to_path_buf();
    assert!(!dir.exists(), "{} left behind", dir.display());
}
