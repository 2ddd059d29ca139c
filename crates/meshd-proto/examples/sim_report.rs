//! Measures the membership protocol in the seeded simulator and prints a table.
//!
//! `cargo run --release -p meshd-proto --example sim_report -- [--seed S] [--trials T] [--sizes 8,64,1000]`
//!
//! For each cluster size N, on a LAN (0.2-1 ms one-way, 10 Gbit/s links):
//! - converge: all N nodes start at once with node 0 as their only seed; time until every
//!   node sees every node Alive (10 ms resolution);
//! - detect: a random node (not the seed) crashes 10 s after convergence; time until every
//!   other node sees it Dead (mean and worst over the trials);
//! - false Dead: Down verdicts about running nodes during 60 s at 10 % datagram loss;
//! - B/s/node: mean bytes sent per node per second, steady state without loss (a 120 s
//!   window: at least one scaled full sync per node at every size) and over the 60 s at 10 % loss;
//! - job form: N whole nodes (`sim::node`) of a fixed-size job start at once; time until
//!   every node launched its ranks (through membership, rendezvous and preflight);
//! - abort: one node's rank fails; time until every node stopped its ranks.

use meshd_proto::membership::MembershipConfig;
use meshd_proto::sim::{Sim, SimConfig};
use std::time::{Duration, Instant};

struct Row {
    n: usize,
    converge: Vec<Option<Duration>>,
    detect: Vec<Option<Duration>>,
    false_dead: usize,
    steady_bps: f64,
    lossy_bps: f64,
    wall: Duration,
}

fn config(n: usize, seed: u64, loss: f64) -> SimConfig {
    SimConfig { nodes: n, seed, loss, ..SimConfig::default() }
}

fn mean_bps(sim: &Sim, window: Duration) -> f64 {
    let stats = sim.stats();
    let total: u64 = stats.iter().map(|s| s.bytes_sent).sum();
    total as f64 / stats.len() as f64 / window.as_secs_f64()
}

fn measure(n: usize, seed: u64, trials: usize) -> Row {
    let started = Instant::now();
    let mut converge = Vec::new();
    let mut detect = Vec::new();
    let mut steady_bps = 0.0;
    for t in 0..trials {
        let trial_seed = seed.wrapping_add(t as u64 * 1_000_003);
        let mut sim = Sim::new(config(n, trial_seed, 0.0));
        sim.start_all();
        let c = sim.run_until(Duration::from_secs(60), Sim::converged);
        converge.push(c);
        if c.is_none() {
            eprintln!("N={n} seed {trial_seed}: no convergence within 60 s");
            detect.push(None);
            continue;
        }
        sim.run_for(Duration::from_secs(10));
        if t == 0 {
            sim.reset_stats();
            let window = Duration::from_secs(120);
            sim.run_for(window);
            steady_bps = mean_bps(&sim, window);
        }
        let victim_index = 1 + (trial_seed as usize % (n - 1));
        let victim = sim.id(victim_index);
        sim.crash(victim_index);
        let d = sim.run_until(Duration::from_secs(60), |s| s.all_see_gone(victim));
        if d.is_none() {
            eprintln!("N={n} seed {trial_seed}: crash of node {victim_index} not detected");
        }
        detect.push(d);
    }
    let mut lossy = Sim::new(config(n, seed ^ 0x5eed, 0.10));
    lossy.start_all();
    if lossy.run_until(Duration::from_secs(60), Sim::converged).is_none() {
        eprintln!("N={n} seed {}: no convergence at 10% loss", lossy.seed());
    }
    lossy.reset_stats();
    let window = Duration::from_secs(60);
    lossy.run_for(window);
    let false_dead = lossy.false_verdicts();
    if false_dead > 0 {
        eprintln!("N={n} seed {}: false verdicts {:?}", lossy.seed(), lossy.verdicts());
    }
    Row {
        n,
        converge,
        detect,
        false_dead,
        steady_bps,
        lossy_bps: mean_bps(&lossy, window),
        wall: started.elapsed(),
    }
}

fn stats(v: &[Option<Duration>]) -> (String, String) {
    if v.iter().any(Option::is_none) || v.is_empty() {
        let worst = "timeout".to_string();
        return (worst.clone(), worst);
    }
    let xs: Vec<f64> = v.iter().flatten().map(Duration::as_secs_f64).collect();
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    let max = xs.iter().copied().fold(0.0, f64::max);
    (format!("{mean:.2}"), format!("{max:.2}"))
}

fn main() {
    let mut seed = 1u64;
    let mut trials = 5usize;
    let mut sizes = vec![8usize, 64, 1000];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let val = args.next();
        match (a.as_str(), val) {
            ("--seed", Some(v)) => seed = v.parse().unwrap_or(seed),
            ("--trials", Some(v)) => trials = v.parse().unwrap_or(trials).max(1),
            ("--sizes", Some(v)) => sizes = v.split(',').filter_map(|s| s.trim().parse().ok()).collect(),
            _ => {
                eprintln!("usage: sim_report [--seed S] [--trials T] [--sizes 8,64,1000]");
                std::process::exit(2);
            }
        }
    }
    let c = MembershipConfig::default();
    println!("meshd membership simulation, seed {seed}, {trials} trials per size (1 at N >= 500)");
    println!(
        "config: probe {:?} (timeout {:?}, {} indirect), gossip {:?} x{}, suspicion mult {}, sync {:?}, max datagram {}",
        c.probe_interval,
        c.probe_timeout,
        c.indirect_probes,
        c.gossip_interval,
        c.gossip_fanout,
        c.suspicion_mult,
        c.sync_interval,
        c.max_datagram
    );
    println!("network: one-way latency 0.2-1 ms, 10 Gbit/s egress per node\n");
    println!(
        "{:>5} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>6} | {:>12} | {:>10} {:>10} | {:>8} {:>6} {:>6} {:>6} | {:>6}",
        "N",
        "converge",
        "(worst)",
        "target",
        "detect",
        "(worst)",
        "target",
        "false Dead",
        "B/s/node",
        "B/s @10%",
        "job form",
        "target",
        "abort",
        "target",
        "wall"
    );
    for &n in &sizes {
        if n < 2 {
            continue;
        }
        let t = if n >= 500 { 1 } else { trials };
        let row = measure(n, seed, t);
        let (cm, cw) = stats(&row.converge);
        let (dm, dw) = stats(&row.detect);
        let (ct, dt, jt) = match n {
            0..=8 => ("0.6", "2", "0.5"),
            9..=64 => ("1.2", "3", "1"),
            _ => ("3", "5", "3"),
        };
        let started = Instant::now();
        let (form, abort) = match meshd_proto::sim::node::job_figures(n, seed) {
            Ok((f, a)) => (format!("{:.2}", f.as_secs_f64()), format!("{:.3}", a.as_secs_f64())),
            Err(e) => {
                eprintln!("{e}");
                ("timeout".to_string(), "timeout".to_string())
            }
        };
        let wall = row.wall + started.elapsed();
        println!(
            "{:>5} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>6} | {:>12} | {:>10.0} {:>10.0} | {:>8} {:>6} {:>6} {:>6} | {:>5.1}s",
            row.n,
            cm,
            cw,
            ct,
            dm,
            dw,
            dt,
            row.false_dead,
            row.steady_bps,
            row.lossy_bps,
            form,
            jt,
            abort,
            "1",
            wall.as_secs_f64()
        );
    }
}
