//! Node loss under torchft, on the network lab: `meshd run --fault-tolerance node` against
//! torchft's own lighthouse (`torchft_lighthouse` on one host, a per-node `torchrun`).
//!
//! The same unmodified torchft script (tests/python/torchft_train.py) on 3 lab hosts x 2
//! ranks, each host one replica group, in two setups:
//! - meshd: the identical `meshd run --fault-tolerance node --nnodes 2:3 ...` on every host
//!   (as tests/lab_torchft.rs runs it): no lighthouse host, meshd serves the lighthouse;
//! - torchft_lighthouse: torchft 0.2.0's `torchft_lighthouse --min_replicas 2
//!   --join_timeout_ms 1000` on host 0, and on every host `torchrun --nnodes 1
//!   --nproc-per-node 2 --master-addr <its eth1> --master-port 29500 --max-restarts 2` with
//!   REPLICA_GROUP_ID, NUM_REPLICA_GROUPS=3 and TORCHFT_LIGHTHOUSE. torchft advertises its
//!   manager as `http://{socket.gethostname()}:port`, and the lab's hosts share the
//!   machine's hostname, so each host's torchrun runs in its own UTS namespace with hostname
//!   `ftN`, and each host's /etc/hosts (`ip netns exec` binds /etc/netns/NS/hosts) names
//!   ft0..ft2 by their eth1 addresses: what a user does on a cluster whose nodes have names.
//!
//! In each run, once every group has committed with all 3 groups past step 20 for 5 s (a
//! steady state: torchft's first quorum may leave out a group still starting), host 2 (not
//! meshd's decider, not the lighthouse's host) is SIGKILLed whole (every process in its
//! namespace). Measured:
//! - kill -> the survivors' next committed step with participants == 2;
//! - steps lost: the survivors' committed steps in the 5 s before the kill minus those in
//!   the 5 s after it (throughput the loss cost; their step counter never goes back,
//!   checked); the replacement starts only after those 5 s, so its start-up (a torch import
//!   on a 2-core machine) does not count against the survivors;
//! - replacement start (the same command on host 2) -> its first committed step;
//! - survivor restarts: distinct pids per (group, rank) of the survivors minus 1 (0 needed).
//!
//! Then every launcher must end 0 and the final weights agree across groups.
//! Run as root: `MESHD_TORCH2_PYTHON=/root/.cache/meshd/torch/2.15.0/venv/bin/python
//! cargo bench --bench torchft` (`-- --reps N`, `-- --only meshd|torchft`, `-- --steps N`,
//! default 500). Prints a table;
//! asserts nothing about speed; a run that fails panics with what went wrong (so a broken run
//! is never reported as a figure). `MESHD_LAB_KEEP=1` keeps the ranks' logs.

#[path = "../tests/lab/mod.rs"]
mod lab;

use lab::Lab;
use lab::torchft::{Line, Logs, ft_args, now_secs, rank_command, wait_lines};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

const TOKEN: (&str, &str) = ("MESHD_TOKEN", "torchft-bench");
/// Steps of the whole run (`--steps`): the survivors must still be training when the
/// replacement (a torch import on a loaded 2-core machine: up to ~30 s) joins.
const STEPS: u32 = 500;
/// The kill comes once every group has committed with all 3 past this step, for `WINDOW` s.
const WARM: i64 = 20;
const VICTIM: usize = 2;
/// The window, before and after the kill, in which steps are counted.
const WINDOW: f64 = 5.0;
const LIGHTHOUSE_PORT: u16 = 29510;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Setup {
    Meshd,
    Torchft,
}

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::Meshd => "meshd",
            Setup::Torchft => "torchft_lighthouse",
        }
    }
}

/// What one run measured.
#[derive(Clone, Debug)]
struct Figures {
    next_commit: f64,
    first_replacement_commit: f64,
    survivor_restarts: usize,
    before: i64,
    after: i64,
}

impl Figures {
    fn lost(&self) -> i64 {
        self.before - self.after
    }
}

/// One setup's job on a 3-host lab: how to start host `i`'s launcher, and the handles.
struct Job {
    setup: Setup,
    lab: Lab,
    logs: Logs,
    python: String,
    steps: u32,
    ks: Vec<usize>,
}

impl Job {
    fn new(setup: Setup, python: &str, steps: u32) -> Job {
        let lab = Lab::new(3);
        let logs = Logs::new("meshd-bench-torchft", setup.name());
        let mut job = Job { setup, lab, logs, python: python.to_string(), steps, ks: Vec::new() };
        if setup == Setup::Torchft {
            job.start_lighthouse();
        }
        job.ks = (0..3).map(|i| job.spawn(i)).collect();
        job
    }

    fn bin(&self, name: &str) -> String {
        let dir = std::path::Path::new(&self.python).parent().expect("the venv's bin directory");
        dir.join(name).display().to_string()
    }

    /// torchft's lighthouse on host 0 (its output to a file: a pipe nobody reads would fill),
    /// and each host's /etc/hosts naming ft0..ft2. Returns once it listens.
    fn start_lighthouse(&mut self) {
        let names: String = self.lab.hosts.iter().map(|h| format!("{} ft{}\n", h.eth1, h.index)).collect();
        for i in 0..3 {
            self.lab.hosts_file(i, &names);
        }
        let cmd = format!(
            "exec {} --min_replicas 2 --join_timeout_ms 1000 --bind [::]:{LIGHTHOUSE_PORT} >> {}/lighthouse.out 2>&1",
            self.bin("torchft_lighthouse"),
            self.logs.dir()
        );
        self.lab.spawn(0, &["sh", "-c", &cmd], &[]);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let o = std::process::Command::new("ip")
                .args(["netns", "exec", &self.lab.hosts[0].ns, "ss", "-Hltn"])
                .output()
                .expect("ss");
            if String::from_utf8_lossy(&o.stdout).contains(&format!(":{LIGHTHOUSE_PORT} ")) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "torchft_lighthouse listens on host 0 within 20 s:\n{}",
                self.logs.outputs(20)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts host `i`'s launcher (the first one, or a replacement: the same command).
    fn spawn(&mut self, i: usize) -> usize {
        let dir = self.logs.dir();
        let steps = self.steps.to_string();
        let mut env: Vec<(&str, String)> =
            vec![("FT_LOG", dir), ("FT_STEPS", steps), ("FT_STEP_SLEEP", "0.1".into())];
        let rank = rank_command(&self.python);
        let args: Vec<String> = match self.setup {
            Setup::Meshd => {
                env.push((TOKEN.0, TOKEN.1.into()));
                // tests/lab_torchft.rs's: the identical command on every host.
                ft_args(&self.lab, &self.python, "2:3", &[])
            }
            Setup::Torchft => {
                let eth1 = self.lab.hosts[i].eth1.clone();
                env.push(("REPLICA_GROUP_ID", i.to_string()));
                env.push(("NUM_REPLICA_GROUPS", "3".into()));
                env.push((
                    "TORCHFT_LIGHTHOUSE",
                    format!("http://{}:{LIGHTHOUSE_PORT}", self.lab.hosts[0].eth1),
                ));
                // Its own hostname (a UTS namespace), then torchrun: one node per replica
                // group, its agent's TCPStore on this host's eth1 (the address the lighthouse
                // hands the other groups for the cross-group process group).
                let mut a: Vec<String> = ["unshare", "--uts", "sh", "-c", "hostname \"$0\" && exec \"$@\""]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
                a.push(format!("ft{i}"));
                a.push(self.bin("torchrun"));
                a.extend(
                    [
                        "--nnodes",
                        "1",
                        "--nproc-per-node",
                        "2",
                        "--master-addr",
                        &eth1,
                        "--master-port",
                        "29500",
                        "--max-restarts",
                        "2",
                        "--no-python",
                        "sh",
                        "-c",
                    ]
                    .iter()
                    .map(|s| s.to_string()),
                );
                a.push(rank);
                a
            }
        };
        let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let e: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        self.lab.spawn(i, &a, &e)
    }

    /// Group of the launcher on host `i`: the REPLICA_GROUP_ID its ranks logged (meshd
    /// chooses it; hosts are told apart by the pids in their namespaces).
    fn group_of_host(&self, i: usize) -> Option<u64> {
        let pids: Vec<u64> = self.lab.pids(i).into_iter().map(|p| p as u64).collect();
        self.logs.lines().into_iter().find(|l| pids.contains(&l.pid)).map(|l| l.group)
    }

    fn fail(&self, what: &str) -> ! {
        panic!("{}: {what}\n{}", self.setup.name(), self.logs.outputs(20))
    }
}

fn pids_by_rank(lines: &[Line]) -> BTreeMap<(u64, u64), BTreeSet<u64>> {
    let mut m: BTreeMap<(u64, u64), BTreeSet<u64>> = BTreeMap::new();
    for l in lines {
        m.entry((l.group, l.rank)).or_default().insert(l.pid);
    }
    m
}

/// The highest step rank 0 of `group` had committed by `t` (by its lines).
fn committed_by(lines: &[Line], group: u64, t: f64) -> i64 {
    lines
        .iter()
        .filter(|l| l.group == group && l.rank == 0 && l.committed && l.t <= t)
        .map(|l| l.step)
        .max()
        .unwrap_or(0)
}

fn run_once(setup: Setup, python: &str, steps: u32) -> Figures {
    let t_start = Instant::now();
    let mut job = Job::new(setup, python, steps);
    // Steady state first: every group committed with all 3 (torchft's first quorum may
    // leave out a group still starting, which then joins a few steps later), for WINDOW s,
    // and past step WARM.
    let steady = |l: &[Line]| {
        let mut since = BTreeMap::new();
        for x in l.iter().filter(|x| x.committed && x.participants == 3 && x.step >= WARM) {
            since.entry(x.group).or_insert(x.t);
        }
        (since.len() == 3).then(|| since.values().cloned().fold(0.0, f64::max))
    };
    if !wait_lines(&job.logs, Duration::from_secs(150), |l| steady(l).is_some()) {
        job.fail(&format!("every group commits with all 3 groups past step {WARM} within 150 s"));
    }
    let t3 = steady(&job.logs.lines()).unwrap_or(0.0);
    let rest = t3 + WINDOW - now_secs();
    if rest > 0.0 {
        std::thread::sleep(Duration::from_secs_f64(rest));
    }
    let vgroup = job.group_of_host(VICTIM).unwrap_or_else(|| job.fail("the victim's group"));
    let survivors: Vec<u64> = (0..3u64).filter(|g| *g != vgroup).collect();

    // The kill: every process of host 2.
    let t_kill = now_secs();
    job.lab.crash(VICTIM);
    let _ = job.lab.wait(job.ks[VICTIM], Duration::from_secs(10));
    let on = |x: &Line| x.t > t_kill && x.committed && x.group != vgroup && x.participants == 2;
    if !wait_lines(&job.logs, Duration::from_secs(60), |l| l.iter().any(on)) {
        job.fail("the survivors commit a step without the killed group within 60 s of the kill");
    }
    let lines = job.logs.lines();
    let next = lines.iter().filter(|x| on(x)).map(|x| x.t).fold(f64::INFINITY, f64::min) - t_kill;
    // The window after the kill, then the step counts.
    let until = t_kill + WINDOW;
    let rest = until - now_secs();
    if rest > 0.0 {
        std::thread::sleep(Duration::from_secs_f64(rest));
    }
    let lines = job.logs.lines();
    let mut before = i64::MAX;
    let mut after = i64::MAX;
    for &g in &survivors {
        let at_kill = committed_by(&lines, g, t_kill);
        before = before.min(at_kill - committed_by(&lines, g, t_kill - WINDOW));
        after = after.min(committed_by(&lines, g, until) - at_kill);
        // torchft never rolls a survivor back: its first commit after the kill is the next step.
        let first = lines.iter().find(|l| l.group == g && l.committed && l.t > t_kill).map(|l| l.step);
        if first.is_some_and(|s| s <= at_kill) {
            job.fail(&format!("group {g} went back: step {at_kill} at the kill, then {first:?}"));
        }
    }

    // The replacement: the same command on the same host.
    let t_rep = now_secs();
    job.ks[VICTIM] = job.spawn(VICTIM);
    let healed = wait_lines(&job.logs, Duration::from_secs(90), |l| {
        let done = l.iter().any(|x| x.final_digest.is_some());
        done || l.iter().any(|x| x.t > t_rep && x.group == vgroup && x.committed && x.participants == 3)
    });
    let lines = job.logs.lines();
    if !lines.iter().any(|x| x.t > t_rep && x.group == vgroup && x.committed && x.participants == 3) {
        if lines.iter().any(|x| x.final_digest.is_some()) {
            job.fail(&format!(
                "the survivors finished their {steps} steps before the replacement joined (raise --steps)"
            ));
        }
        job.fail(&format!(
            "the replacement heals and commits with all 3 groups within 90 s (healed: {healed})"
        ));
    }
    let first = job
        .logs
        .lines()
        .iter()
        .filter(|x| x.t > t_rep && x.group == vgroup && x.committed)
        .map(|x| x.t)
        .fold(f64::INFINITY, f64::min)
        - t_rep;

    // Every launcher ends 0; the final weights agree across groups, rank by rank.
    let deadline = Instant::now() + Duration::from_secs(120);
    for i in 0..3 {
        let (code, _, err) = job.lab.wait(job.ks[i], deadline.saturating_duration_since(Instant::now()));
        if code != Some(0) {
            let tail: Vec<&str> = err.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect();
            job.fail(&format!(
                "host {i}'s launcher ends 0 (within 120 s of the replacement's heal): got {code:?}\n{}",
                tail.join("\n")
            ));
        }
    }
    let lines = job.logs.lines();
    let mut finals: BTreeMap<u64, Vec<(u64, String)>> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.final_digest.is_some()) {
        finals.entry(l.rank).or_default().push((l.group, l.final_digest.clone().unwrap_or_default()));
    }
    for r in 0..2 {
        let v = finals.get(&r).cloned().unwrap_or_default();
        if v.len() != 3 || v.iter().any(|(_, d)| *d != v[0].1) {
            job.fail(&format!("rank {r}: a final line from every group, with equal weights: {v:?}"));
        }
    }
    let pids = pids_by_rank(&lines);
    let restarts: usize =
        pids.iter().filter(|((g, _), _)| survivors.contains(g)).map(|(_, p)| p.len().saturating_sub(1)).sum();
    let f = Figures {
        next_commit: next,
        first_replacement_commit: first,
        survivor_restarts: restarts,
        before,
        after,
    };
    eprintln!(
        "{}: kill -> survivors' next commit {:.2} s; replacement start -> first commit {:.2} s; survivor restarts \
         {}; steps in {WINDOW} s before / after the kill {} / {}; run {:.0} s",
        setup.name(),
        f.next_commit,
        f.first_replacement_commit,
        f.survivor_restarts,
        f.before,
        f.after,
        t_start.elapsed().as_secs_f64()
    );
    f
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn cell(v: Vec<f64>, unit: &str, prec: usize) -> String {
    let n = v.len();
    let (lo, hi) =
        (v.iter().cloned().fold(f64::INFINITY, f64::min), v.iter().cloned().fold(f64::MIN, f64::max));
    let m = median(v);
    if n == 1 { format!("{m:.prec$}{unit}") } else { format!("{m:.prec$}{unit} ({lo:.prec$}-{hi:.prec$})") }
}

fn main() {
    if !lab::bench_mode(env!("CARGO_CRATE_NAME")) {
        return;
    }
    let python = match std::env::var("MESHD_TORCH2_PYTHON") {
        Ok(p) if !p.trim().is_empty() => p,
        _ => panic!(
            "MESHD_TORCH2_PYTHON must name a venv's python with torch 2 and torchft 0.2.0 \
             (scripts/fetch-torch.sh makes it: /root/.cache/meshd/torch/2.15.0/venv/bin/python)"
        ),
    };
    let ok = std::process::Command::new(&python)
        .args(["-c", "import torchft, torch.distributed.run"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "MESHD_TORCH2_PYTHON={python} cannot import torchft");
    let reps: usize = lab::bench_opt("--reps", 1).max(1);
    let steps: u32 = lab::bench_opt("--steps", STEPS);
    let only: String = lab::bench_opt("--only", String::new());
    let setups: Vec<Setup> = match only.as_str() {
        "" => vec![Setup::Meshd, Setup::Torchft],
        "meshd" => vec![Setup::Meshd],
        "torchft" => vec![Setup::Torchft],
        o => panic!("--only takes meshd or torchft, not {o:?}"),
    };
    let mut results: Vec<(Setup, Vec<Figures>)> = setups.iter().map(|s| (*s, Vec::new())).collect();
    for _ in 0..reps {
        for (s, v) in results.iter_mut() {
            v.push(run_once(*s, &python, steps));
        }
    }
    println!(
        "torchft node loss: 3 lab hosts x 2 ranks, host {VICTIM} SIGKILLed after step {WARM}, {steps} steps, \
         {reps} repetition(s) (median, range)"
    );
    println!(
        "steps lost = the survivors' committed steps in the {WINDOW} s before the kill minus those in the {WINDOW} s \
         after it (before/after in brackets)"
    );
    println!(
        "{:<20} {:<30} {:<34} {:<18} steps lost",
        "setup", "kill -> survivors' next commit", "replacement start -> first commit", "survivor restarts"
    );
    for (s, v) in &results {
        let lost = cell(v.iter().map(|f| f.lost() as f64).collect(), "", 0);
        let ba: Vec<String> = v.iter().map(|f| format!("{}/{}", f.before, f.after)).collect();
        println!(
            "{:<20} {:<30} {:<34} {:<18} {lost} [{}]",
            s.name(),
            cell(v.iter().map(|f| f.next_commit).collect(), " s", 2),
            cell(v.iter().map(|f| f.first_replacement_commit).collect(), " s", 2),
            v.iter().map(|f| f.survivor_restarts).max().unwrap_or(0),
            ba.join(", ")
        );
    }
    let med = |s: Setup| {
        results.iter().find(|(x, _)| *x == s).map(|(_, v)| median(v.iter().map(|f| f.next_commit).collect()))
    };
    if let (Some(m), Some(t)) = (med(Setup::Meshd), med(Setup::Torchft)) {
        println!("kill -> survivors' next commit, meshd / torchft_lighthouse: {:.2}x", m / t);
    }
}
