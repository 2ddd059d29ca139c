//! Lab: waits that end (issue 21). `--nnodes MIN:MAX` with fewer than MAX nodes starts
//! every time; a waiting meshd sleeps; SIGINT/SIGTERM end every wait within a second;
//! nodes started with another `--nnodes` are named instead of waited for in silence.

mod lab;
use lab::Lab;
use std::time::{Duration, Instant};

const TOKEN: (&str, &str) = ("MESHD_TOKEN", "lab-secret");

/// 3 of 4 listed hosts started with `--nnodes 2:4`: the job starts, 20 tries in a row.
/// (Before the fix, 8 of 10 tries in one series never started: the nodes that were not
/// the proposer spun on the passed settle deadline and never read the proposal.)
#[test]
fn min_max_with_three_of_four_starts_twenty_times_in_a_row() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    // The fourth listed host never comes.
    let peers = format!("{},198.19.0.99", lab.peers());
    let tries: usize = std::env::var("MESHD_MINMAX_TRIES").ok().and_then(|t| t.parse().ok()).unwrap_or(20);
    for t in 0..tries {
        let args = lab
            .meshd_run()
            .nnodes("2:4")
            .peers(&peers)
            .flags(&["--settle", "1s", "--rdzv-timeout", "30s", "--nproc-per-node", "1"])
            .cmd(&["sh", "-c", "echo started $WORLD_SIZE"]);
        let started = Instant::now();
        let res = lab.run_on_all(&args, &[TOKEN], Duration::from_secs(30));
        println!("FIGURE min:max try {t}: all 3 hosts ended after {:?}", started.elapsed());
        for (i, (code, out, err)) in res.iter().enumerate() {
            assert_eq!(*code, Some(0), "try {t}, host {i} after {:?}:\n{out}\n{err}", started.elapsed());
            assert!(out.contains("started 3"), "try {t}, host {i}: a 3-node job:\n{out}\n{err}");
        }
    }
}

/// CPU seconds (user + system) of a process so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // Fields after the command name (which may contain spaces) start after ") ".
    let rest = stat.rsplit_once(") ").expect("stat format").1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().expect("utime") + f[12].parse::<f64>().expect("stime");
    ticks / 100.0
}

/// Sends `sig` to meshd child `k` and waits for it: it must exit within 1.5 s with
/// `code`; prints the time as a FIGURE line for `what`. Returns its stdout and stderr.
/// Waiting nodes sleep: two of three nodes up, the third never comes; over 2 s each
/// waiting meshd uses well under a tenth of a core (it spun at 65-94% of one before).
/// Then SIGINT and SIGTERM each end the wait within a second, with 130 and 143.
#[test]
fn waiting_nodes_sleep_and_end_on_sigint_and_sigterm_within_a_second() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let args = lab.meshd_run().flags(&["--rdzv-timeout", "60s"]).cmd(&["true"]);
    let k0 = lab.spawn(0, &args, &[TOKEN]);
    let k1 = lab.spawn(1, &args, &[TOKEN]);
    std::thread::sleep(Duration::from_secs(3));
    let pids = [lab.pid(k0), lab.pid(k1)];
    let before: Vec<f64> = pids.iter().map(|p| cpu_seconds(*p)).collect();
    std::thread::sleep(Duration::from_secs(2));
    for (p, b) in pids.iter().zip(&before) {
        let used = cpu_seconds(*p) - b;
        println!("FIGURE waiting meshd: {used:.2} CPU-s over 2 s");
        assert!(used < 0.2, "a waiting meshd used {used:.2} CPU-s in 2 s");
    }
    let (_, err) = lab.stop_within_a_second(k0, libc::SIGINT, 130, "SIGINT while waiting for nodes");
    assert!(err.contains("interrupted (SIGINT) while waiting for nodes"), "{err}");
    lab.stop_within_a_second(k1, libc::SIGTERM, 143, "SIGTERM while waiting for nodes");
}

/// A restart round that waits for a node that is gone still ends on SIGINT at once.
#[test]
fn sigint_ends_a_restart_round_wait() {
    lab_or_skip!();
    let mut lab = Lab::new(2);
    // Host 1's rank fails once; then host 1 is crashed, so round 1 waits for it.
    let marks = std::env::temp_dir().join(format!("meshd-round-{}", std::process::id()));
    std::fs::create_dir_all(&marks).expect("mkdir");
    let script = format!(
        "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 1 ]; then touch {}/r$RANK; fi; \
         if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exit 3; fi; sleep 30",
        marks.display()
    );
    let args = lab
        .meshd_run()
        .flags(&["--max-restarts", "2", "--rdzv-timeout", "60s", "--nproc-per-node", "1"])
        .cmd(&["sh", "-c", &script]);
    let k0 = lab.spawn(0, &args, &[TOKEN]);
    let k1 = lab.spawn(1, &args, &[TOKEN]);
    // Wait for round 1 to be under way on both hosts, then crash host 1.
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && !(marks.join("r0").exists() && marks.join("r1").exists()) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_dir_all(&marks);
    lab.crash(1);
    let _ = lab.wait(k1, Duration::from_secs(5));
    // Host 0 stops round 1 (its peer died) and waits in round 2 for a node that is gone.
    std::thread::sleep(Duration::from_secs(4));
    assert!(!lab.exited(k0), "host 0 should be waiting for round 2");
    let (_, err) = lab.stop_within_a_second(k0, libc::SIGINT, 130, "SIGINT in a restart round's wait");
    assert!(err.contains("restart round"), "{err}");
}

/// Nodes started with different `--nnodes` are named at once, and the timeout lists no
/// present node as missing.
#[test]
fn a_different_nnodes_is_named_not_waited_for_in_silence() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let ks: Vec<usize> = (0..3)
        .map(|i| {
            let n = if i == 0 { "3" } else { "4" };
            let args = lab.meshd_run().nnodes(n).flags(&["--rdzv-timeout", "6s"]).cmd(&["true"]);
            lab.spawn(i, &args, &[TOKEN])
        })
        .collect();
    let res = lab.wait_all(ks, Duration::from_secs(30));
    let h0 = &lab.hosts[0].eth1;
    for (i, (code, _, err)) in res.iter().enumerate() {
        assert_ne!(*code, Some(0), "host {i} cannot start:\n{err}");
        assert!(err.contains("was started with --nnodes"), "host {i} names the disagreement:\n{err}");
        let timeout = err
            .lines()
            .find(|l| l.contains("rendezvous timed out"))
            .unwrap_or_else(|| panic!("host {i}:\n{err}"));
        assert!(!timeout.contains("never answered"), "host {i}: everyone answered:\n{timeout}");
        if i == 0 {
            assert!(timeout.contains("with --nnodes 4, this node with --nnodes 3"), "{timeout}");
        } else {
            assert!(
                timeout.contains(&format!("{h0} was started with --nnodes 3, this node with --nnodes 4")),
                "{timeout}"
            );
        }
    }
}

/// SIGINT during the preflight (TCP between the hosts dropped, so its probes wait out their
/// 2 s connect timeout) ends it within a second, exit 130; the other node is told and stops
/// too, nobody launches.
#[test]
fn sigint_ends_the_preflight_wait() {
    lab_or_skip!();
    let mut lab = Lab::new(2);
    for i in 0..2 {
        lab.firewall_only_udp(i, 29400);
    }
    let args = lab.meshd_run().flags(&["--rdzv-timeout", "30s"]).cmd(&["sh", "-c", "echo LAUNCHED"]);
    let k0 = lab.spawn(0, &args, &[TOKEN]);
    let k1 = lab.spawn(1, &args, &[TOKEN]);
    // Roster in well under a second; the preflight's TCP probes then wait 2 s.
    std::thread::sleep(Duration::from_millis(1000));
    let (out, err) = lab.stop_within_a_second(k0, libc::SIGINT, 130, "SIGINT during the preflight");
    assert!(err.contains("during the preflight"), "the signal came in another phase:\n{err}");
    assert!(!out.contains("LAUNCHED"), "{out}");
    let (code1, out1, err1) = lab.wait(k1, Duration::from_secs(15));
    assert_ne!(code1, Some(0), "the other node must not launch alone:\n{err1}");
    assert!(!out1.contains("LAUNCHED"), "{out1}");
}
