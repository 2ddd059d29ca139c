//! Lab: `meshd run` — the identical command on several hosts.

mod lab;
mod torches;
use lab::{Lab, meshd};
use std::collections::BTreeMap;
use std::time::Duration;

fn env_lines(out: &str) -> Vec<BTreeMap<String, String>> {
    // Each rank prints one line: "[rank N] K=V K=V ..."
    out.lines()
        .filter_map(|l| l.split_once("] ENV "))
        .map(|(_, kv)| {
            kv.split_whitespace()
                .filter_map(|p| p.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect()
}

#[test]
fn three_hosts_two_procs_get_the_exact_environment() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let vars = "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK NODE_RANK GROUP_WORLD_SIZE ROLE_NAME ROLE_RANK ROLE_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS TORCHELASTIC_ERROR_FILE PYTHONUNBUFFERED TORCH_NCCL_ASYNC_ERROR_HANDLING OMP_NUM_THREADS NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME MESHD_IFACE MESHD_NODE_ADDR MESHD_COLLECTIVE";
    let script = format!(
        "printf 'ENV'; for v in {vars}; do eval printf \"' %s=%s'\" $v \\\"\\${{$v}}\\\"; done; echo"
    );
    let logs = std::env::temp_dir().join(format!("meshd-logdir-{}", std::process::id()));
    let logs_s = logs.display().to_string();
    let res = lab.run_everywhere(
        &["--nproc-per-node", "2", "--log-dir", &logs_s],
        &["sh", "-c", &script],
        Duration::from_secs(60),
    );
    // --log-dir: each rank's stdout also lands in DIR/attempt_0/rankN.out (one directory per
    // restart round; files are never appended to across rounds).
    for r in 0..6 {
        let f = std::fs::read_to_string(logs.join(format!("attempt_0/rank{r}.out"))).unwrap_or_default();
        assert!(f.contains(&format!("ENV RANK={r} ")), "rank{r}.out: {f:?}");
    }
    let _ = std::fs::remove_dir_all(&logs);
    let mut all = Vec::new();
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i} failed:\n{err}");
        let envs = env_lines(out);
        assert_eq!(envs.len(), 2, "host {i} should run 2 ranks:\n{out}\n{err}");
        for e in &envs {
            assert_eq!(e["MESHD_NODE_ADDR"], lab.hosts[i].eth1, "host {i}");
        }
        all.extend(envs);
    }
    // Master = lowest eth1 address (host 1: .7), never eth0's shared 198.18.0.4.
    let mut eth1: Vec<&str> = lab.hosts.iter().map(|h| h.eth1.as_str()).collect();
    eth1.sort_by_key(|a| a.parse::<std::net::Ipv4Addr>().expect("ip"));
    let port = &all[0]["MASTER_PORT"];
    let mut ranks: Vec<u32> = Vec::new();
    for e in &all {
        assert_eq!(e["MASTER_ADDR"], eth1[0]);
        assert_eq!(&e["MASTER_PORT"], port);
        assert_eq!(e["WORLD_SIZE"], "6");
        assert_eq!(e["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(e["GROUP_WORLD_SIZE"], "3");
        assert_eq!(e["ROLE_NAME"], "default");
        assert_eq!(e["NCCL_SOCKET_IFNAME"], "=eth1");
        assert_eq!(e["GLOO_SOCKET_IFNAME"], "eth1");
        assert_eq!(e["MESHD_IFACE"], "eth1");
        assert_eq!(e["OMP_NUM_THREADS"], "1");
        assert_eq!(e["TORCH_NCCL_ASYNC_ERROR_HANDLING"], "1");
        assert_eq!(e["PYTHONUNBUFFERED"], "1");
        assert_eq!(
            e["TORCHELASTIC_ERROR_FILE"],
            format!("{logs_s}/attempt_0/rank{}.error.json", e["RANK"]),
            "a per-rank error file in the round's directory"
        );
        assert_eq!(e["TORCHELASTIC_RESTART_COUNT"], "0");
        assert_eq!(e["TORCHELASTIC_RUN_ID"], all[0]["TORCHELASTIC_RUN_ID"]);
        assert_eq!(e["GROUP_RANK"], e["NODE_RANK"]);
        assert_eq!(e["ROLE_RANK"], e["RANK"]);
        // Node rank follows the order of eth1 addresses.
        let node_rank: usize = e["NODE_RANK"].parse().expect("node rank");
        assert_eq!(e["MESHD_NODE_ADDR"], eth1[node_rank], "{e:?}");
        let local: u32 = e["LOCAL_RANK"].parse().expect("local");
        let rank: u32 = e["RANK"].parse().expect("rank");
        assert_eq!(rank, node_rank as u32 * 2 + local);
        ranks.push(rank);
    }
    ranks.sort();
    assert_eq!(ranks, vec![0, 1, 2, 3, 4, 5]);
}

#[test]
fn one_failing_rank_stops_the_job_on_every_node() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    // Rank 4 fails after a moment; every other rank would sleep for a minute.
    let script = "if [ \"$RANK\" = 4 ]; then sleep 1; exit 7; fi; sleep 60";
    let t = std::time::Instant::now();
    let res = lab.run_everywhere(
        &["--nproc-per-node", "2", "--grace", "2s"],
        &["sh", "-c", script],
        Duration::from_secs(45),
    );
    let took = t.elapsed();
    for (i, (code, _, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(7), "host {i} must exit with the failed rank's status 7:\n{err}");
        assert!(
            err.contains("rank 4 (local rank 0)") && err.contains("exited with status 7"),
            "host {i} must name the rank:\n{err}"
        );
    }
    assert!(took < Duration::from_secs(40), "teardown took {took:?}");
}

/// Distinctive tokens, so a leak into any log is found by a plain search.
const RIGHT: &str = "tok-right-Vb83kQ";
const WRONG: &str = "tok-wrong-Xe51pR";

#[test]
fn wrong_token_is_refused_and_both_ends_say_so() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    // Hosts 0 and 1 share a token and form a 2-node job; host 2 holds another token.
    let args = lab.meshd_run().nnodes("2").flags(&["--rdzv-timeout", "30s"]).cmd(&["sh", "-c", "sleep 3"]);
    let a = lab.spawn(0, &args, &[("MESHD_TOKEN", RIGHT)]);
    let b = lab.spawn(1, &args, &[("MESHD_TOKEN", RIGHT)]);
    let intruder = lab.meshd_run().flags(&["--rdzv-timeout", "4s"]).cmd(&["true"]);
    let c = lab.spawn(2, &intruder, &[("MESHD_TOKEN", WRONG)]);
    let (cc, cout, cerr) = lab.wait(c, Duration::from_secs(30));
    let (ac, aout, aerr) = lab.wait(a, Duration::from_secs(40));
    let (bc, bout, berr) = lab.wait(b, Duration::from_secs(40));
    assert_eq!(ac, Some(0), "host 0: {aerr}");
    assert_eq!(bc, Some(0), "host 1: {berr}");
    assert_ne!(cc, Some(0), "the intruder must fail: {cerr}");
    assert!(
        cerr.contains("failed authentication") && cerr.contains("different token"),
        "intruder's error:\n{cerr}"
    );
    assert!(
        [&aerr, &berr].iter().any(|e| e.contains("198.19.0.19") && e.contains("different token")),
        "a rightful node must name the intruder:\n{aerr}\n{berr}"
    );
    // Neither token appears anywhere in any node's output.
    for e in [&aout, &aerr, &bout, &berr, &cout, &cerr] {
        assert!(!e.contains(RIGHT) && !e.contains(WRONG), "token leaked:\n{e}");
    }
    // Each refusal is logged once per peer and direction (we refused it / it refused us),
    // however often the nodes retried.
    let warns = |log: &str, ip: &str| {
        log.lines()
            .filter(|l| l.contains("WARN") && l.contains(ip) && l.contains("failed authentication"))
            .count()
    };
    let (wa, wb) = (warns(&aerr, "198.19.0.19"), warns(&berr, "198.19.0.19"));
    let (wc0, wc1) = (warns(&cerr, "198.19.0.30"), warns(&cerr, "198.19.0.7"));
    eprintln!(
        "FIGURE wrong-token: refusal WARN lines: host 0 about the intruder {wa}, host 1 {wb}; \
         intruder about host 0 {wc0}, about host 1 {wc1}"
    );
    for (n, who) in [(wa, "host 0"), (wb, "host 1"), (wc0, "intruder/host 0"), (wc1, "intruder/host 1")] {
        assert!(n <= 2, "{who}: {n} refusal lines, want at most one per direction:\n{aerr}\n{berr}\n{cerr}");
    }
}

#[test]
fn killed_node_stops_the_job_everywhere() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let args = lab.meshd_run().flags(&["--grace", "1s"]).cmd(&["sleep", "60"]);
    let ks: Vec<usize> = (0..3).map(|i| lab.spawn(i, &args, &[("MESHD_TOKEN", "t")])).collect();
    std::thread::sleep(Duration::from_secs(4)); // the job is running by now
    let t = std::time::Instant::now();
    lab.crash(2); // host 2 (198.19.0.19): meshd and its ranks SIGKILLed, like a lost instance
    for (i, k) in ks.into_iter().enumerate().take(2) {
        let (code, _, err) = lab.wait(k, Duration::from_secs(30));
        assert_eq!(code, Some(1), "host {i} must fail, not hang:\n{err}");
        assert!(
            err.contains("198.19.0.19") && err.contains("stopped answering"),
            "host {i} must name the dead node:\n{err}"
        );
    }
    eprintln!("FIGURE node-kill-to-exit: {:?}", t.elapsed());
}

#[test]
fn max_restarts_restarts_every_rank_and_succeeds() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let script = "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 3 ]; then exit 3; fi; \
                  if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 30; fi; echo RESTARTED count=$TORCHELASTIC_RESTART_COUNT";
    let res = lab.run_everywhere(
        &["--nproc-per-node", "2", "--max-restarts", "1", "--grace", "1s"],
        &["sh", "-c", script],
        Duration::from_secs(60),
    );
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        assert_eq!(
            out.matches("RESTARTED count=1").count(),
            2,
            "host {i} ranks must run again with count 1:\n{out}\n{err}"
        );
        assert!(err.contains("restart round 1 of 1: restarting all ranks"), "host {i}:\n{err}");
        // Round 0's cause is shown, but meshd does not say it exits with its status.
        assert!(
            err.contains("meshd: root cause: rank 3") && !err.contains("meshd: exit status"),
            "host {i}:\n{err}"
        );
    }
}

on_torches!([torch1_13, torch2]
fn pytorch_ddp_over_gloo_ends_with_identical_parameters(t) {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/ddp_gloo.py");
    let args = lab.meshd_run().flags(&["--rdzv-timeout", "60s", "--nproc-per-node", "2"]).cmd(&[
        &t.python,
        script,
        "--steps",
        "15",
    ]);
    let env = lab::token_env("lab-secret", t.env());
    let res = lab.run_on_all(&args, &lab::env_refs(&env), Duration::from_secs(180));
    let mut digests = Vec::new();
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
        for l in out.lines().filter(|l| l.contains("DDP rank=")) {
            assert!(l.contains("world=6") && l.contains("iface=eth1"), "{l}");
            let d =
                l.split("params_sha256=").nth(1).and_then(|s| s.split_whitespace().next()).expect("digest");
            digests.push(d.to_string());
        }
    }
    assert_eq!(digests.len(), 6, "every rank reports");
    assert!(digests.iter().all(|d| *d == digests[0]), "parameters differ across ranks: {digests:?}");
}
);

#[test]
fn a_dead_node_replaced_by_a_new_one_restarts_the_job_with_max_restarts() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let script = "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 60; fi; echo REPLACED count=$TORCHELASTIC_RESTART_COUNT";
    let args = lab.meshd_run().flags(&["--max-restarts", "1", "--grace", "1s"]).cmd(&["sh", "-c", script]);
    let env = [("MESHD_TOKEN", "replace")];
    let ks: Vec<usize> = (0..3).map(|i| lab.spawn(i, &args, &env)).collect();
    std::thread::sleep(Duration::from_secs(4));
    lab.crash(2); // the instance is lost...
    std::thread::sleep(Duration::from_secs(3));
    let fresh = lab.spawn(2, &args, &env); // ...and a new one takes its place, same command
    let mut outs = Vec::new();
    for (i, k) in ks.into_iter().take(2).chain([fresh]).enumerate() {
        let (code, out, err) = lab.wait(k, Duration::from_secs(60));
        assert_eq!(code, Some(0), "node {i}:\n{out}\n{err}");
        outs.push(out);
    }
    for (i, out) in outs.iter().enumerate() {
        assert!(out.contains("REPLACED count=1"), "node {i} must run restart round 1:\n{out}");
    }
}

/// A torchrun launch line, unchanged but for `torchrun` -> `meshd run`: underscores, the
/// rendezvous endpoint of a head node (not the master), a script path without `--`, and
/// torchrun's per-node flags (here deliberately not what meshd decides: each node is told its
/// host index as node rank, so every node warns, naming both values).
#[test]
fn a_torchrun_launch_line_runs_on_three_hosts() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let (dir, script_s) = lab::script_in_temp(
        "torchrun-line",
        "print_env.py",
        "import os, sys\n\
         keys = 'RANK LOCAL_RANK WORLD_SIZE NODE_RANK MASTER_ADDR TORCHELASTIC_RUN_ID TORCHELASTIC_MAX_RESTARTS'.split()\n\
         print('ENV ' + ' '.join(f'{k}={os.environ[k]}' for k in keys) + ' ARGS=' + ','.join(sys.argv[1:]) \
         + ' U=' + str('-u' in sys.orig_argv))\n",
    );
    let head = format!("{}:29400", lab.hosts[0].eth1);
    let ks: Vec<usize> = (0..3)
        .map(|i| {
            let node_rank = format!("--node_rank={i}");
            let args = [
                meshd(),
                "run",
                "--nnodes=3",
                "--nproc_per_node=2",
                "--max_restarts=0",
                "--rdzv_id=torchrun-line",
                "--rdzv_backend=c10d",
                "--rdzv_endpoint",
                &head,
                &node_rank,
                &script_s,
                "--lr",
                "3",
                "--epochs=2",
            ];
            lab.spawn(i, &args, &[("MESHD_TOKEN", "lab-secret")])
        })
        .collect();
    // Node ranks follow eth1 addresses: host 0 (.30) is node 2, host 1 (.7) node 0, host 2 (.19) node 1.
    let agreed = [2, 0, 1];
    let mut ranks = Vec::new();
    for (i, k) in ks.into_iter().enumerate() {
        let (code, out, err) = lab.wait(k, Duration::from_secs(60));
        assert_eq!(code, Some(0), "host {i}:\n{out}\n{err}");
        let envs = env_lines(&out);
        assert_eq!(envs.len(), 2, "host {i}:\n{out}\n{err}");
        for e in &envs {
            assert_eq!(e["WORLD_SIZE"], "6");
            assert_eq!(e["TORCHELASTIC_RUN_ID"], "torchrun-line");
            assert_eq!(e["TORCHELASTIC_MAX_RESTARTS"], "0");
            assert_eq!(e["NODE_RANK"], agreed[i].to_string(), "host {i}");
            assert_eq!(e["ARGS"], "--lr,3,--epochs=2", "the script's own arguments");
            assert_eq!(e["U"], "True", "run as python -u");
            ranks.push(e["RANK"].parse::<u32>().expect("rank"));
        }
        let want = format!("--node-rank {i} disagrees with the node rank the nodes agreed on, {}", agreed[i]);
        assert!(err.contains(&want), "host {i} must warn ({want}):\n{err}");
    }
    ranks.sort();
    assert_eq!(ranks, [0, 1, 2, 3, 4, 5]);
    let _ = std::fs::remove_dir_all(&dir);
}

on_torches!([torch1_13, torch2]
/// A rank's Python exception, recorded by torch's `@record` in its TORCHELASTIC_ERROR_FILE,
/// is the root cause every node prints; every meshd exits with the rank's status, and
/// `--log-dir` gets error.json.
fn a_rank_exception_is_the_root_cause_on_every_node(t) {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let dir = std::env::temp_dir().join(format!("meshd-root-cause-{}-{}", std::process::id(), t.variant));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let script = dir.join("fail.py");
    std::fs::write(
        &script,
        "import os, time\n\
         from torch.distributed.elastic.multiprocessing.errors import record\n\
         def deepest_frame_xq():\n    raise ValueError('boom-7d1f3 on rank ' + os.environ['RANK'])\n\
         @record\n\
         def main():\n    if os.environ['RANK'] == '2':\n        time.sleep(1)\n        deepest_frame_xq()\n    time.sleep(60)\n\
         if __name__ == '__main__':\n    main()\n",
    )
    .expect("script");
    let logs = dir.join("logs");
    let (script_s, logs_s) = (script.display().to_string(), logs.display().to_string());
    let args = lab
        .meshd_run()
        .flags(&["--rdzv-timeout", "60s", "--nproc-per-node", "1", "--grace", "2s", "--log-dir", &logs_s])
        .args(&[&script_s]);
    let env = lab::token_env("lab-secret", [("MESHD_PYTHON", t.python.clone())].into_iter().chain(t.env()));
    let res = lab.run_on_all(&args, &lab::env_refs(&env), Duration::from_secs(120));
    for (i, (code, _, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(1), "host {i} must exit with the rank's status 1:\n{err}");
        let block = err
            .split("meshd: root cause: ")
            .nth(1)
            .unwrap_or_else(|| panic!("host {i}: no root cause:\n{err}"));
        assert!(block.starts_with("rank 2 (local rank 0, node rank"), "host {i}:\n{block}");
        assert!(block.contains("ValueError: boom-7d1f3 on rank 2"), "host {i}:\n{block}");
        assert!(block.contains("in deepest_frame_xq"), "the traceback's last frame, host {i}:\n{block}");
        assert!(block.contains("TORCHELASTIC_ERROR_FILE"), "host {i}:\n{block}");
    }
    let json = std::fs::read_to_string(logs.join("error.json")).expect("error.json");
    let v: serde_json::Value = serde_json::from_str(&json).expect("json");
    assert_eq!(v["rank"], 2, "{json}");
    assert_eq!(v["exit_status"], 1, "{json}");
    assert_eq!(v["message"]["message"], "ValueError: boom-7d1f3 on rank 2", "{json}");
    assert!(
        v["message"]["extraInfo"]["py_callstack"].as_str().unwrap_or("").contains("deepest_frame_xq"),
        "{json}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
);

/// A rank killed by a signal: every meshd exits 128 + N, naming the signal and the rank's last
/// stderr lines.
#[test]
fn a_rank_killed_by_a_signal_gives_128_plus_n_on_every_node() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let script = "if [ \"$RANK\" = 2 ]; then echo last-words-5e2 >&2; sleep 1; kill -9 $$; fi; sleep 60";
    let res = lab.run_everywhere(&["--grace", "1s"], &["sh", "-c", script], Duration::from_secs(45));
    for (i, (code, _, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(137), "host {i} must exit 128+9:\n{err}");
        assert!(err.contains("killed by signal 9 (SIGKILL)"), "host {i}:\n{err}");
        let block = err.split("meshd: root cause: ").nth(1).unwrap_or_else(|| panic!("host {i}:\n{err}"));
        assert!(block.contains("last-words-5e2"), "the rank's stderr tail, host {i}:\n{block}");
    }
}

/// SIGUSR1 (and SIGUSR2) sent to one meshd reaches every rank on every node; meshd goes on,
/// and SIGHUP (in torchrun's default --signals-to-handle) stops the job with 128+1.
#[test]
fn sigusr1_to_one_meshd_reaches_every_rank_on_every_node() {
    lab_or_skip!();
    let mut lab = Lab::new(2);
    let script = "trap 'echo GOT-USR1 rank=$RANK; exit 0' USR1; echo STARTED rank=$RANK; \
                  i=0; while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; exit 5";
    let args = lab.meshd_run().flags(&["--nproc-per-node", "2", "--grace", "1s"]).cmd(&["sh", "-c", script]);
    let ks: Vec<usize> = (0..2).map(|i| lab.spawn(i, &args, &[("MESHD_TOKEN", "sig")])).collect();
    std::thread::sleep(Duration::from_secs(6)); // the job runs by now
    lab.signal(ks[1], libc::SIGUSR1);
    for (i, k) in ks.into_iter().enumerate() {
        let (code, out, err) = lab.wait(k, Duration::from_secs(40));
        assert_eq!(code, Some(0), "host {i}: the ranks trapped it and exited 0:\n{out}\n{err}");
        assert_eq!(out.matches("GOT-USR1").count(), 2, "host {i}: both ranks got it:\n{out}\n{err}");
    }
    // SIGHUP is one of the signals that stop the job: exit 128+1 there, the others fail too.
    let ks: Vec<usize> = (0..2).map(|i| lab.spawn(i, &args, &[("MESHD_TOKEN", "sig")])).collect();
    std::thread::sleep(Duration::from_secs(6));
    lab.signal(ks[0], libc::SIGHUP);
    let (code, _, err) = lab.wait(ks[0], Duration::from_secs(30));
    assert_eq!(code, Some(129), "SIGHUP stops meshd with 129:\n{err}");
    let (code, _, err) = lab.wait(ks[1], Duration::from_secs(30));
    assert_ne!(code, Some(0), "the other node stops too:\n{err}");
}

/// Ranks that neither write nor call meshd for --stall-timeout: the job ends on every node
/// with the stall named and the Python stacks (PYTHONFAULTHANDLER + SIGABRT) in the output.
#[test]
fn a_stalled_job_ends_everywhere_with_python_stacks() {
    lab_or_skip!();
    let mut lab = Lab::new(2);
    let (dir, script_s) = lab::script_in_temp(
        "stall",
        "stall.py",
        "import os, time\n\
         def wait_forever_zq():\n    while True:\n        time.sleep(1000)\n\
         print('started', os.environ['RANK'])\n\
         wait_forever_zq()\n",
    );
    let args = lab
        .meshd_run()
        .flags(&["--nproc-per-node", "1", "--grace", "1s", "--stall-timeout", "3s"])
        .args(&[&script_s]);
    let t = std::time::Instant::now();
    let res = lab.run_on_all(
        &args,
        &[("MESHD_TOKEN", "stall"), ("MESHD_PYTHON", "/usr/bin/python3")],
        Duration::from_secs(60),
    );
    for (i, (code, out, err)) in res.iter().enumerate() {
        assert_eq!(*code, Some(124), "host {i}:\n{out}\n{err}");
        let block = err.split("meshd: root cause: ").nth(1).unwrap_or_else(|| panic!("host {i}:\n{err}"));
        assert!(block.contains("stalled: no output or meshd call for 3s"), "host {i}:\n{block}");
        assert!(block.contains("in wait_forever_zq"), "a Python stack, host {i}:\n{block}");
    }
    assert!(t.elapsed() < Duration::from_secs(40), "took {:?}", t.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}
