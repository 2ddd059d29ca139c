//! Lab: torchft 0.2.0 (PyPI, with PyPI's torch 2.x, CPU Gloo) under
//! `meshd run --fault-tolerance node`, unmodified: no lighthouse host, no per-node flags.
//! Each host is one replica group of 2 ranks; the torchft script
//! (tests/python/torchft_train.py) logs every step to a shared directory, so the test sees
//! the job while it runs. Each test prints a `FIGURE` line with what it measured.

mod lab;
mod torches;
use lab::{Lab, meshd};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const TOKEN: (&str, &str) = ("MESHD_TOKEN", "torchft-lab");

/// One JSON line of the script.
#[derive(Clone, Debug)]
struct Line {
    group: u64,
    rank: u64,
    pid: u64,
    t: f64,
    step: i64,
    committed: bool,
    participants: i64,
    final_digest: Option<String>,
}

/// The scripts' shared log directory, removed on drop.
struct Logs(PathBuf);

impl Logs {
    fn new(name: &str) -> Logs {
        let d = std::env::temp_dir().join(format!("meshd-torchft-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("log dir");
        Logs(d)
    }

    fn dir(&self) -> String {
        self.0.display().to_string()
    }

    fn lines(&self) -> Vec<Line> {
        let mut v = Vec::new();
        for e in std::fs::read_dir(&self.0).expect("log dir").flatten() {
            if !e.file_name().to_string_lossy().ends_with(".jsonl") {
                continue;
            }
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            for l in text.lines() {
                let Ok(j) = serde_json::from_str::<serde_json::Value>(l) else { continue };
                v.push(Line {
                    group: j["group"].as_u64().unwrap_or(u64::MAX),
                    rank: j["rank"].as_u64().unwrap_or(u64::MAX),
                    pid: j["pid"].as_u64().unwrap_or(0),
                    t: j["t"].as_f64().unwrap_or(0.0),
                    step: j["step"].as_i64().unwrap_or(-1),
                    committed: j["committed"].as_bool().unwrap_or(false),
                    participants: j["participants"].as_i64().unwrap_or(0),
                    final_digest: j["digest"].as_str().map(String::from),
                });
            }
        }
        v.sort_by(|a, b| a.t.total_cmp(&b.t));
        v
    }

    /// The ranks' own output (stdout and stderr of every process), for failure messages.
    fn outputs(&self) -> String {
        let mut s = String::new();
        for e in std::fs::read_dir(&self.0).expect("log dir").flatten() {
            if e.file_name().to_string_lossy().ends_with(".out") {
                let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(25).collect();
                s.push_str(&format!("---- {}\n", e.file_name().to_string_lossy()));
                for l in tail.into_iter().rev() {
                    s.push_str(l);
                    s.push('\n');
                }
            }
        }
        s
    }
}

impl Drop for Logs {
    fn drop(&mut self) {
        if std::env::var_os("MESHD_LAB_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn now_secs() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// The identical command of every host: `--fault-tolerance node`, 2 ranks per host, the
/// script's output to files (a rank's heavy logging must not fill the test's pipes).
fn ft_args(lab: &Lab, python: &str, nnodes: &str, extra: &[&str]) -> Vec<String> {
    let script = format!("{}/tests/python/torchft_train.py", env!("CARGO_MANIFEST_DIR"));
    let mut a: Vec<String> = [
        meshd(),
        "run",
        "--fault-tolerance",
        "node",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "2",
        "--peers",
        &lab.peers(),
        "--grace",
        "1s",
        "--max-restarts",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a.extend(["--", "sh", "-c"].iter().map(|s| s.to_string()));
    a.push(format!("exec {python} -u {script} >> \"$FT_LOG/g$REPLICA_GROUP_ID.r$RANK.$$.out\" 2>&1"));
    a
}

fn spawn(lab: &mut Lab, i: usize, args: &[String], logs: &Logs, steps: u32) -> usize {
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let dir = logs.dir();
    let steps = steps.to_string();
    lab.spawn(i, &a, &[TOKEN, ("FT_LOG", &dir), ("FT_STEPS", &steps), ("FT_STEP_SLEEP", "0.1")])
}

/// Waits until `pred` holds for the lines (at most `limit`).
fn wait_lines(logs: &Logs, limit: Duration, pred: impl Fn(&[Line]) -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if pred(&logs.lines()) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    pred(&logs.lines())
}

/// Group of the node on host `i`: the REPLICA_GROUP_ID its ranks logged. Hosts are told
/// apart by the pids in their namespaces.
fn group_of_host(lab: &Lab, logs: &Logs, i: usize) -> Option<u64> {
    let pids: Vec<u64> = lab.pids(i).into_iter().map(|p| p as u64).collect();
    logs.lines().into_iter().find(|l| pids.contains(&l.pid)).map(|l| l.group)
}

/// Scenario (a), (d): a whole node SIGKILLed at step 20 (its meshd and ranks): the survivors
/// keep their processes and go on committing, a replacement started with the same command
/// heals from a peer and commits, and the final weights agree across groups.
fn node_killed_and_replaced(victim_is_decider: bool) {
    let Some(torch) = torches::Torch::current(true) else { return };
    let mut lab = Lab::new(3);
    let logs = Logs::new(if victim_is_decider { "decider" } else { "worker" });
    let steps = 220;
    let args = ft_args(&lab, &torch.python, "2:3", &[]);
    let ks: Vec<usize> = (0..3).map(|i| spawn(&mut lab, i, &args, &logs, steps)).collect();
    let started = wait_lines(&logs, Duration::from_secs(120), |l| {
        let groups: std::collections::BTreeSet<u64> =
            l.iter().filter(|l| l.step >= 20).map(|l| l.group).collect();
        groups.len() == 3
    });
    assert!(started, "every group reaches step 20:\n{}", logs.outputs());
    // The decider is the first live member in roster order (by address): host 1 holds the
    // lowest (198.19.0.7).
    let victim = if victim_is_decider { 1 } else { 2 };
    let vgroup = group_of_host(&lab, &logs, victim).expect("the victim's group");
    let before: BTreeMap<(u64, u64), Vec<u64>> = pids_by_rank(&logs.lines());
    let t_kill = now_secs();
    lab.crash(victim);
    let _ = lab.wait(ks[victim], Duration::from_secs(5));
    // Survivors go on: a committed step without the victim's group.
    let resumed = wait_lines(&logs, Duration::from_secs(60), |l| {
        l.iter().any(|x| x.t > t_kill && x.committed && x.group != vgroup && x.participants == 2)
    });
    assert!(resumed, "the survivors commit a step without the killed group:\n{}", logs.outputs());
    let lines = logs.lines();
    let next = lines
        .iter()
        .filter(|x| x.t > t_kill && x.committed && x.group != vgroup && x.participants == 2)
        .map(|x| x.t)
        .fold(f64::INFINITY, f64::min);
    // The replacement: the same command on the same host.
    let t_rep = now_secs();
    let k = spawn(&mut lab, victim, &args, &logs, steps);
    let healed = wait_lines(&logs, Duration::from_secs(120), |l| {
        l.iter().any(|x| x.t > t_rep && x.group == vgroup && x.committed && x.participants == 3)
    });
    assert!(healed, "the replacement heals and commits with all 3 groups:\n{}", logs.outputs());
    let first_rep = logs
        .lines()
        .iter()
        .filter(|x| x.t > t_rep && x.group == vgroup && x.committed)
        .map(|x| x.t)
        .fold(f64::INFINITY, f64::min);
    // Every node ends 0.
    for (i, kk) in [(0, ks[0]), (1, ks[1]), (2, ks[2]), (victim, k)] {
        if kk == ks[victim] {
            continue;
        }
        let (code, _, err) = lab.wait(kk, Duration::from_secs(180));
        assert_eq!(code, Some(0), "host {i} ends 0:\n{err}\n{}", logs.outputs());
    }
    let lines = logs.lines();
    // Survivors kept their processes: one pid per (group, rank) for the survived groups.
    let after = pids_by_rank(&lines);
    let mut restarted = 0;
    for ((g, r), pids) in &after {
        if *g != vgroup {
            assert_eq!(Some(pids), before.get(&(*g, *r)), "group {g} rank {r} kept its process");
            restarted += pids.len() - 1;
        }
    }
    // The final weights agree across groups, rank by rank.
    let mut finals: BTreeMap<u64, Vec<(u64, String)>> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.final_digest.is_some()) {
        finals.entry(l.rank).or_default().push((l.group, l.final_digest.clone().unwrap_or_default()));
    }
    for (rank, v) in &finals {
        assert_eq!(v.len(), 3, "rank {rank}: a final line from every group: {v:?}");
        assert!(v.iter().all(|(_, d)| *d == v[0].1), "rank {rank}: the groups' weights agree: {v:?}");
    }
    let lost: i64 = 0;
    eprintln!(
        "FIGURE torchft {}: kill -> survivors' next committed step {:.2} s; replacement start -> its first committed \
         step {:.2} s; survivor restarts {restarted}; steps lost {lost}",
        if victim_is_decider { "decider killed" } else { "worker killed" },
        next - t_kill,
        first_rep - t_rep
    );
}

fn pids_by_rank(lines: &[Line]) -> BTreeMap<(u64, u64), Vec<u64>> {
    let mut m: BTreeMap<(u64, u64), Vec<u64>> = BTreeMap::new();
    for l in lines {
        let v = m.entry((l.group, l.rank)).or_default();
        if !v.contains(&l.pid) {
            v.push(l.pid);
        }
    }
    m
}

#[test]
fn a_killed_node_leaves_the_quorum_the_others_train_on_and_its_replacement_heals() {
    lab_or_skip!();
    node_killed_and_replaced(false);
}
