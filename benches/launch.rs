//! Launch benchmark on the network lab: meshd vs torchrun (c10d rendezvous), side by side.
//!
//! For 3 and 8 hosts x 2 processes: time from the last launcher's start until every rank
//! is running, the CPU time each meshd had used by then (from its launch line), and time
//! from a rank's failure until every launcher has exited. Then the one-node overhead:
//! `meshd run --nnodes 1 -- true` against `true` alone.
//! Run as root: `cargo bench --bench launch` (add `-- --reps 5` for more repetitions;
//! `-- --one-node-only` measures only the one-node overhead).
//! Prints a table; asserts nothing about speed (the machine is shared and noisy).

#[path = "../tests/lab/mod.rs"]
mod lab;

use lab::{Lab, meshd};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const TORCH: &str = "/usr/bin/python3";

fn now_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Rank command: print the start time, then either sleep or (rank 1) fail after `fail_after`.
fn rank_script(fail_after: Option<u32>) -> String {
    let tail = match fail_after {
        Some(s) => format!("if [ \"$RANK\" = 1 ]; then sleep {s}; date +FAILAT%s.%N; exit 1; fi; sleep 120"),
        None => "sleep 0".into(),
    };
    format!("date +START%s.%N; {tail}")
}

struct Outcome {
    launch: Option<f64>,
    teardown: Option<f64>,
    /// The most CPU any meshd had used when its ranks started (seconds).
    cpu: Option<f64>,
}

/// The CPU time in a meshd's launch line ("... meshd CPU 0.031 s").
fn parse_cpu(err: &str) -> Option<f64> {
    err.lines().find_map(|l| l.split("meshd CPU ").nth(1)?.split_whitespace().next()?.parse().ok())
}

fn parse_times(out: &str, tag: &str) -> Vec<f64> {
    out.lines().filter_map(|l| l.split(tag).nth(1)).filter_map(|t| t.trim().parse::<f64>().ok()).collect()
}

fn run_once(n: usize, torchrun: bool, fail: bool, limit: Duration) -> Outcome {
    let mut lab = Lab::new(n);
    let peers = lab.peers();
    let mut master = lab.hosts.iter().map(|h| h.eth1.clone()).collect::<Vec<_>>();
    master.sort_by_key(|a| a.parse::<std::net::Ipv4Addr>().ok());
    let script = rank_script(if fail { Some(3) } else { None });
    let nn = n.to_string();
    let endpoint = format!("{}:29500", master[0]);
    let mut ks = Vec::new();
    let mut last_start = 0.0;
    for i in 0..n {
        // torchrun decides which agent hosts the c10d store by matching the endpoint against
        // its host name; in the lab (as on many clouds) that fails, so the host of the
        // endpoint must be told `is_host=true`: a per-node flag, the thing meshd removes.
        // `--redirects 1 --tee 1` works around Debian's torch 1.13 on Python 3.11, whose
        // default redirect setting (0) fails to parse (enum iteration changed in 3.11).
        let conf = if lab.hosts[i].eth1 == master[0] { "is_host=true" } else { "is_host=false" };
        let args: Vec<&str> = if torchrun {
            vec![
                TORCH,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                &nn,
                "--nproc_per_node",
                "2",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                &endpoint,
                "--rdzv_id",
                "bench",
                "--rdzv_conf",
                conf,
                "--redirects",
                "1",
                "--tee",
                "1",
                "--no_python",
                "sh",
                "-c",
                &script,
            ]
        } else {
            vec![
                meshd(),
                "run",
                "--nnodes",
                &nn,
                "--peers",
                &peers,
                "--nproc-per-node",
                "2",
                "--grace",
                "1s",
                "--",
                "sh",
                "-c",
                &script,
            ]
        };
        last_start = now_s();
        // meshd at info: its launch line carries its CPU time.
        ks.push(lab.spawn(i, &args, &[("MESHD_LOG", "info"), ("LOGLEVEL", "WARNING")]));
    }
    let t0 = Instant::now();
    let mut starts = Vec::new();
    let mut fail_at = Vec::new();
    let mut exits = Vec::new();
    let mut cpus = Vec::new();
    for k in ks {
        let (code, out, err) = lab.wait(k, limit.saturating_sub(t0.elapsed()));
        starts.extend(parse_times(&out, "START"));
        starts.extend(parse_times(&err, "START"));
        fail_at.extend(parse_times(&out, "FAILAT"));
        fail_at.extend(parse_times(&err, "FAILAT"));
        cpus.push(parse_cpu(&err));
        exits.push(code.map(|_| now_s()));
        if code.is_none() && std::env::var("BENCH_VERBOSE").is_ok() {
            eprintln!("launcher timed out:\n{out}\n{err}");
        }
    }
    let launch =
        (starts.len() == 2 * n).then(|| starts.iter().cloned().fold(f64::MIN, f64::max) - last_start);
    // Exit times are observed as each wait returns, in order; the last is an upper bound.
    let teardown = if fail {
        match (fail_at.first(), exits.iter().all(Option::is_some)) {
            (Some(f), true) => Some(exits.iter().flatten().cloned().fold(f64::MIN, f64::max) - f),
            _ => None,
        }
    } else {
        None
    };
    let cpu = (!torchrun && cpus.iter().all(Option::is_some))
        .then(|| cpus.iter().flatten().cloned().fold(0.0, f64::max));
    Outcome { launch, teardown, cpu }
}

fn fmt(v: &[Option<f64>], limit: Duration) -> String {
    let ok: Vec<f64> = v.iter().flatten().cloned().collect();
    if ok.is_empty() {
        return format!("> {:.0} s (never)", limit.as_secs_f64());
    }
    let mut s = ok.clone();
    s.sort_by(|a, b| a.total_cmp(b));
    let med = s[s.len() / 2];
    let miss = v.len() - ok.len();
    format!(
        "{med:.2} s (median of {}{})",
        ok.len(),
        if miss > 0 { format!(", {miss} never") } else { String::new() }
    )
}

fn main() {
    if !lab::bench_mode(env!("CARGO_CRATE_NAME")) {
        return;
    }
    let reps: usize = lab::bench_opt("--reps", 3);
    if std::env::args().any(|a| a == "--one-node-only") {
        one_node_overhead(reps.max(3) * 5);
        return;
    }
    let has_torch = std::process::Command::new(TORCH)
        .args(["-c", "import torch.distributed.run"])
        .status()
        .is_ok_and(|s| s.success());
    println!("launch benchmark: {reps} repetitions, 2 processes per host (median)");
    println!(
        "{:<6} {:<9} {:<34} {:<34} meshd CPU at launch (max of hosts)",
        "hosts", "launcher", "last start -> all ranks running", "rank failure -> all launchers exited"
    );
    for n in [3usize, 8] {
        for torchrun in [false, true] {
            if torchrun && !has_torch {
                println!("{n:<6} torchrun  (python3-torch missing: not measured)");
                continue;
            }
            let limit = Duration::from_secs(if torchrun { 90 } else { 60 });
            let runs: Vec<Outcome> = (0..reps).map(|_| run_once(n, torchrun, false, limit)).collect();
            let launch: Vec<Option<f64>> = runs.iter().map(|o| o.launch).collect();
            let cpu: Vec<Option<f64>> = runs.iter().map(|o| o.cpu).collect();
            let tear_limit = Duration::from_secs(45);
            let tear: Vec<Option<f64>> =
                (0..reps).map(|_| run_once(n, torchrun, true, tear_limit).teardown).collect();
            println!(
                "{n:<6} {:<9} {:<34} {:<34} {}",
                if torchrun { "torchrun" } else { "meshd" },
                fmt(&launch, limit),
                fmt(&tear, tear_limit),
                if torchrun { "-".to_string() } else { fmt(&cpu, limit) }
            );
        }
    }
    one_node_overhead(reps.max(3) * 5);
}

/// `meshd run --nnodes 1 --nproc-per-node 1 -- true` against `true` alone, on this machine
/// (loopback, no lab), `n` times each, alternating: medians and their difference.
fn one_node_overhead(n: usize) {
    let time = |args: &[&str]| {
        let t = Instant::now();
        let ok = std::process::Command::new(args[0])
            .args(&args[1..])
            .env_remove("MESHD_TOKEN")
            .env("MESHD_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| t.elapsed().as_secs_f64())
    };
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port().to_string())
        .unwrap_or_else(|_| "29466".into());
    let (mut m, mut t) = (Vec::new(), Vec::new());
    for _ in 0..n {
        m.push(time(&[
            meshd(),
            "run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "1",
            "--port",
            &port,
            "--",
            "true",
        ]));
        t.push(time(&["true"]));
    }
    let med = |v: &[Option<f64>]| {
        let mut s: Vec<f64> = v.iter().flatten().cloned().collect();
        s.sort_by(|a, b| a.total_cmp(b));
        s.get(s.len() / 2).cloned()
    };
    match (med(&m), med(&t)) {
        (Some(a), Some(b)) => println!(
            "one node: `meshd run --nnodes 1 -- true` {:.1} ms, `true` {:.1} ms: overhead {:.1} ms (median of {n})",
            a * 1e3,
            b * 1e3,
            (a - b) * 1e3
        ),
        _ => println!("one node: a run failed (meshd or true did not exit 0)"),
    }
}
