//! Soak: many short `meshd run` jobs on 4-8 lab hosts, with one random fault injected in
//! most runs, checking after every run that
//! - every meshd ended before the run's deadline (no hang),
//! - nothing is left in any lab namespace once the meshd processes are gone (no orphan;
//!   also checked on a host right after its meshd was SIGKILLed),
//! - no node's stderr says "panicked",
//! - the outcome is the one meshd promises where it is deterministic (no fault: all exit 0;
//!   a failing or killed rank: all exit non-zero; a failing rank with `--max-restarts 1`:
//!   all exit 0),
//!
//! and reporting the peak RSS of the meshd processes (VmHWM from /proc, sampled every
//! ~15 ms until exit; wait4's ru_maxrss would report `ip netns exec`'s own 13 MiB peak from
//! before it execs meshd), first vs last runs.
//!
//! `cargo test --test soak` runs a short bounded soak (12 runs). The long one:
//! `MESHD_SOAK_RUNS=300 MESHD_SOAK_WALL=1200 cargo test --test soak soak_random -- --nocapture`
//! (as root; the wall limit in seconds stops starting new runs; default 240).
//! `MESHD_SOAK_SEED=S` replays a seed's plan (the same hosts, jobs, faults and fault
//! moments; the timing of the processes themselves differs); `MESHD_SOAK_ONLY=K` runs only
//! run K of that plan; `MESHD_SOAK_FAULT=kill-node` (a kind as printed) gives every run
//! that fault.

mod lab;
use lab::{Lab, meshd};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// SplitMix64: small, seeded, good enough to pick faults.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.range(lo, hi))
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// The fault of one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    None,
    /// SIGKILL one node's meshd (its ranks must die with it: PR_SET_PDEATHSIG).
    KillNode,
    /// SIGKILL every process of one host (a lost instance).
    CrashHost,
    /// SIGTERM one node's meshd.
    TermNode,
    /// SIGKILL one rank process.
    KillRank,
    /// One rank exits 3.
    RankExit,
    /// One rank exits 3 in round 0, with `--max-restarts 1`: the job must then succeed.
    RankExitRestart,
    /// eth1 of one host down for a moment.
    Flap,
    /// Hosts split 2 | rest, healed after a moment.
    Partition,
    /// Random loss of P% of the packets arriving on eth1 in every host.
    Loss,
}

const ALL_FAULTS: [Fault; 10] = [
    Fault::None,
    Fault::KillNode,
    Fault::CrashHost,
    Fault::TermNode,
    Fault::KillRank,
    Fault::RankExit,
    Fault::RankExitRestart,
    Fault::Flap,
    Fault::Partition,
    Fault::Loss,
];

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::KillNode => "kill-node",
            Fault::CrashHost => "crash-host",
            Fault::TermNode => "term-node",
            Fault::KillRank => "kill-rank",
            Fault::RankExit => "rank-exit",
            Fault::RankExitRestart => "rank-exit-restart",
            Fault::Flap => "flap",
            Fault::Partition => "partition",
            Fault::Loss => "loss",
        }
    }
}

/// When a fault strikes: a moment after the start (often during the rendezvous), or a
/// moment after the victim host's ranks are seen running.
#[derive(Clone, Copy, Debug)]
enum When {
    AfterStart(Duration),
    AfterRanks(Duration),
}

/// Everything about one run, drawn from the run's own RNG.
#[derive(Clone, Debug)]
struct Plan {
    index: usize,
    n: usize,
    nproc: u32,
    /// How long each rank sleeps (ms).
    sleep_ms: u64,
    /// Ranks run their sleep in a background child (`sleep & wait`): a grandchild process.
    background: bool,
    fault: Fault,
    when: When,
    victim: usize,
    /// Global rank that fails (RankExit*).
    bad_rank: u32,
    /// Flap / partition length, loss percentage.
    length: Duration,
    loss_pct: u64,
}

const RDZV_TIMEOUT_S: u64 = 12;
const GRACE_S: u64 = 1;
/// Deadline of a run: the rendezvous timeout, the job, the grace, and 20 s.
fn deadline_of(p: &Plan) -> Duration {
    let restarts = if p.fault == Fault::RankExitRestart { 2 } else { 1 };
    Duration::from_secs(restarts * (RDZV_TIMEOUT_S + GRACE_S) + 20) + Duration::from_millis(2 * p.sleep_ms)
}

fn plan_run(seed: u64, index: usize, n: usize) -> Plan {
    let mut r = Rng(seed ^ (index as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
    r.next();
    let nproc = if r.chance(30) { 2 } else { 1 };
    let sleep_ms = r.range(300, 1500);
    let background = r.chance(30);
    let fault = if r.chance(25) {
        Fault::None
    } else {
        // Any fault but `None` (the first), uniformly.
        ALL_FAULTS[1 + r.below(ALL_FAULTS.len() as u64 - 1) as usize]
    };
    let when = if matches!(fault, Fault::KillRank) || r.chance(70) {
        When::AfterRanks(r.ms(0, sleep_ms / 2))
    } else {
        When::AfterStart(r.ms(0, 1500))
    };
    // MESHD_SOAK_FAULT=NAME: every run gets that fault (to chase one kind).
    let fault = match std::env::var("MESHD_SOAK_FAULT") {
        Ok(f) => *ALL_FAULTS.iter().find(|k| k.name() == f).unwrap_or_else(|| panic!("no fault kind {f}")),
        Err(_) => fault,
    };
    let victim = r.below(n as u64) as usize;
    let bad_rank = r.below(n as u64 * nproc as u64) as u32;
    let length = match fault {
        Fault::Flap => r.ms(300, 1500),
        _ => r.ms(500, 3000),
    };
    let loss_pct = r.range(3, 25);
    Plan { index, n, nproc, sleep_ms, background, fault, when, victim, bad_rank, length, loss_pct }
}

/// The plan of a seed: batches of runs sharing one lab of N hosts.
fn plan_batches(seed: u64, runs: usize) -> Vec<(usize, Vec<Plan>)> {
    let mut r = Rng(seed);
    let mut out = Vec::new();
    let mut i = 0;
    while i < runs {
        let n = r.range(4, 8) as usize;
        let size = (r.range(4, 14) as usize).min(runs - i);
        out.push((n, (i..i + size).map(|k| plan_run(seed, k, n)).collect()));
        i += size;
    }
    out
}

/// The job: the identical rank command on every node, marked so its processes are known.
fn job_script(p: &Plan) -> String {
    let secs = format!("{}.{:03}", p.sleep_ms / 1000, p.sleep_ms % 1000);
    let body = if p.background { format!("sleep {secs} & wait") } else { format!("sleep {secs}") };
    match p.fault {
        Fault::RankExit => format!(
            ": soakjob; if [ \"$RANK\" = {} ]; then sleep 0.{}; exit 3; fi; {body}",
            p.bad_rank,
            (p.sleep_ms / 300).clamp(1, 4)
        ),
        Fault::RankExitRestart => format!(
            ": soakjob; if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = {} ]; then sleep 0.2; exit 3; fi; {body}",
            p.bad_rank
        ),
        _ => format!(": soakjob; {body}"),
    }
}

/// One meshd process, spawned in a lab namespace (`ip netns exec` execs it: same pid).
struct Proc {
    pid: i32,
    err: PathBuf,
    /// Raw wait status, once reaped.
    ended: Option<i32>,
    /// Last VmHWM (KiB) read while the process was meshd.
    hwm_kib: i64,
}

impl Proc {
    fn spawn(ns: &str, args: &[String], envs: &[(&str, &str)], dir: &std::path::Path, tag: &str) -> Proc {
        let out = dir.join(format!("{tag}.out"));
        let err = dir.join(format!("{tag}.err"));
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).args(args);
        for (k, v) in envs {
            c.env(k, v);
        }
        // Reaped by `poll` (waitpid on the pid), not through the Child.
        #[allow(clippy::zombie_processes)]
        let child = c
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).expect("out file"))
            .stderr(std::fs::File::create(&err).expect("err file"))
            .spawn()
            .expect("spawn meshd");
        Proc { pid: child.id() as i32, err, ended: None, hwm_kib: 0 }
    }

    /// Reaps the process if it ended; true when it has.
    fn poll(&mut self) -> bool {
        if self.ended.is_some() {
            return true;
        }
        // VmHWM only grows: the last reading before the exit is the peak (to ~15 ms).
        if std::fs::read_to_string(format!("/proc/{}/comm", self.pid)).is_ok_and(|c| c.trim() == "meshd") {
            let st = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
            if let Some(kib) = st
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
            {
                self.hwm_kib = self.hwm_kib.max(kib);
            }
        }
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid out-pointer.
        let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
        if r == self.pid {
            self.ended = Some(status);
            return true;
        }
        false
    }

    fn kill(&self, sig: i32) {
        if self.ended.is_none() {
            // SAFETY: a signal to our own (unreaped) child.
            unsafe { libc::kill(self.pid, sig) };
        }
    }

    /// Exit code, or 128+signal.
    fn code(&self) -> Option<i32> {
        let s = self.ended?;
        if libc::WIFEXITED(s) { Some(libc::WEXITSTATUS(s)) } else { Some(128 + libc::WTERMSIG(s)) }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }
}

/// Live (non-zombie) processes in a namespace.
fn ns_pids(ns: &str) -> Vec<i32> {
    let o = Command::new("ip").args(["netns", "pids", ns]).output().expect("ip netns pids");
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter(|p| proc_state(*p).is_some_and(|s| s != 'Z'))
        .collect()
}

fn proc_stat(pid: i32) -> Option<(char, i32)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let mut it = rest.split_whitespace();
    let state = it.next()?.chars().next()?;
    let ppid = it.next()?.parse().ok()?;
    Some((state, ppid))
}

fn proc_state(pid: i32) -> Option<char> {
    proc_stat(pid).map(|s| s.0)
}

fn cmdline(pid: i32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " ").trim().to_string())
        .unwrap_or_default()
}

/// The rank processes (children of meshd `pid` running the job script).
fn ranks_of(ns: &str, pid: i32) -> Vec<i32> {
    ns_pids(ns)
        .into_iter()
        .filter(|p| {
            proc_stat(*p).is_some_and(|(_, pp)| pp == pid) && cmdline(*p).starts_with("sh -c : soakjob")
        })
        .collect()
}

fn nft(ns: &str, rules: &str) -> bool {
    let mut c = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("nft");
    {
        use std::io::Write;
        let _ = c.stdin.take().expect("stdin").write_all(rules.as_bytes());
    }
    c.wait().is_ok_and(|s| s.success())
}

/// Drops `pct`% of the packets arriving on eth1 in host namespace `ns` (inside the lab only).
fn loss_on(ns: &str, pct: u64) {
    let rules = format!(
        "table inet mdsoakloss {{\n chain in {{\n type filter hook input priority -5; policy accept;\n \
         iifname \"eth1\" numgen random mod 100 < {pct} drop\n }}\n}}\n"
    );
    assert!(nft(ns, &rules), "nft loss rule failed in {ns}");
}

fn loss_off(ns: &str) {
    let _ = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "delete", "table", "inet", "mdsoakloss"])
        .stderr(Stdio::null())
        .status();
}

/// What one run showed.
#[derive(Debug)]
struct Outcome {
    plan: Plan,
    /// Whether the fault was injected (a rank to kill may be gone already).
    injected: bool,
    codes: Vec<Option<i32>>,
    hung: Vec<usize>,
    orphans: Vec<String>,
    panics: Vec<usize>,
    /// Outcome not the promised one (deterministic cases only).
    unexpected: Option<String>,
    peak_rss_kib: i64,
    took: Duration,
}

struct Soak {
    token: String,
    dir: PathBuf,
}

impl Soak {
    fn run(&self, lab: &mut Lab, p: &Plan) -> Outcome {
        let t0 = Instant::now();
        let n = p.n;
        let hosts: Vec<String> = lab.hosts.iter().map(|h| h.ns.clone()).collect();
        let peers = lab.peers();
        let mut args: Vec<String> = vec![
            meshd().into(),
            "run".into(),
            "--nnodes".into(),
            n.to_string(),
            "--peers".into(),
            peers,
            "--rdzv-timeout".into(),
            format!("{RDZV_TIMEOUT_S}s"),
            "--grace".into(),
            format!("{GRACE_S}s"),
            "--nproc-per-node".into(),
            p.nproc.to_string(),
        ];
        if p.fault == Fault::RankExitRestart {
            args.extend(["--max-restarts".into(), "1".into()]);
        }
        args.extend(["--".into(), "sh".into(), "-c".into(), job_script(p)]);
        let envs = [("MESHD_TOKEN", self.token.as_str())];
        let dir = self.dir.join(format!("run{}", p.index));
        std::fs::create_dir_all(&dir).expect("run dir");
        let limit = deadline_of(p);
        let mut procs: Vec<Proc> = hosts
            .iter()
            .enumerate()
            .map(|(i, ns)| Proc::spawn(ns, &args, &envs, &dir, &format!("h{i}")))
            .collect();
        let start = Instant::now();
        let deadline = start + limit;

        // The fault's state machine.
        let mut injected = false;
        let mut undo_at: Option<Instant> = None;
        let mut ranks_seen_at: Option<Instant> = None;
        let mut orphans = Vec::new();
        let partition_a: Vec<usize> = {
            let v = p.victim;
            vec![v, (v + 1) % n]
        };
        let partition_b: Vec<usize> = (0..n).filter(|i| !partition_a.contains(i)).collect();
        let needs_injection =
            p.fault != Fault::None && p.fault != Fault::RankExit && p.fault != Fault::RankExitRestart;
        let mut gave_up = false;
        let mut hung = Vec::new();
        loop {
            let mut all = true;
            for pr in procs.iter_mut() {
                all &= pr.poll();
            }
            if all {
                break;
            }
            let now = Instant::now();
            if now > deadline {
                for (i, pr) in procs.iter_mut().enumerate() {
                    if !pr.poll() {
                        hung.push(i);
                        pr.kill(libc::SIGKILL);
                    }
                }
                let until = Instant::now() + Duration::from_secs(5);
                while procs.iter_mut().any(|pr| !pr.poll()) && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(20));
                }
                break;
            }
            if needs_injection && !injected && !gave_up {
                let due = match p.when {
                    When::AfterStart(d) => now >= start + d,
                    When::AfterRanks(d) => {
                        if ranks_seen_at.is_none() {
                            if procs[p.victim].ended.is_some() {
                                gave_up = true; // the victim ended before its ranks ran
                            } else if !ranks_of(&hosts[p.victim], procs[p.victim].pid).is_empty() {
                                ranks_seen_at = Some(now);
                            }
                        }
                        ranks_seen_at.is_some_and(|t| now >= t + d)
                    }
                };
                if due {
                    injected = self.inject(p, lab, &hosts, &procs, &partition_a, &partition_b, &mut orphans);
                    if injected {
                        undo_at = Some(Instant::now() + p.length);
                    } else {
                        gave_up = true;
                    }
                }
            }
            if let Some(t) = undo_at {
                if now >= t {
                    undo(p, lab, &hosts, &partition_a, &partition_b);
                    undo_at = None;
                }
            }
            std::thread::sleep(Duration::from_millis(15));
        }
        let took = start.elapsed();
        // Always leave the network whole for the next run.
        undo(p, lab, &hosts, &partition_a, &partition_b);

        // No process may outlive the meshd processes: give exiting ones a moment.
        let settle = Instant::now() + Duration::from_millis(1000);
        let mut left: Vec<(usize, i32)>;
        loop {
            left = hosts
                .iter()
                .enumerate()
                .flat_map(|(i, ns)| ns_pids(ns).into_iter().map(move |p| (i, p)))
                .collect();
            if left.is_empty() || Instant::now() > settle {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for (i, pid) in left {
            orphans.push(format!("host {i} pid {pid}: {}", cmdline(pid)));
            // SAFETY: a leftover process inside the lab namespace.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }

        let codes: Vec<Option<i32>> = procs.iter().map(|pr| pr.code()).collect();
        let stderrs: Vec<String> = procs.iter().map(|pr| pr.stderr()).collect();
        let panics: Vec<usize> = (0..n).filter(|&i| stderrs[i].contains("panicked")).collect();
        let peak_rss_kib = procs.iter().map(|pr| pr.hwm_kib).max().unwrap_or(0);
        let unexpected = expect(p, injected, &codes, &stderrs);
        let o = Outcome {
            plan: p.clone(),
            injected,
            codes,
            hung,
            orphans,
            panics,
            unexpected,
            peak_rss_kib,
            took,
        };
        let bad =
            !o.hung.is_empty() || !o.orphans.is_empty() || !o.panics.is_empty() || o.unexpected.is_some();
        if bad {
            // Keep the logs of a bad run; print every node's stderr.
            let mut s = String::new();
            for (i, e) in stderrs.iter().enumerate() {
                let _ = writeln!(s, "---- host {i} ({}) code {:?}\n{e}", lab.hosts[i].eth1, o.codes[i]);
            }
            eprintln!("soak: run {} BAD: {o:?}\n{s}", p.index);
        } else if o.codes.contains(&Some(0)) && o.codes.iter().any(|c| *c != Some(0)) {
            // Some nodes succeeded, others failed: allowed under network faults, logs kept.
            eprintln!("soak: run {} mixed outcome, logs kept in {}", p.index, dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let _ = t0;
        o
    }

    #[allow(clippy::too_many_arguments)]
    fn inject(
        &self,
        p: &Plan,
        lab: &Lab,
        hosts: &[String],
        procs: &[Proc],
        a: &[usize],
        b: &[usize],
        orphans: &mut Vec<String>,
    ) -> bool {
        let v = p.victim;
        match p.fault {
            Fault::None | Fault::RankExit | Fault::RankExitRestart => false,
            Fault::KillNode => {
                if procs[v].ended.is_some() {
                    return false;
                }
                procs[v].kill(libc::SIGKILL);
                // Its ranks (and their children) must go with it, right away.
                std::thread::sleep(Duration::from_millis(300));
                for pid in ns_pids(&hosts[v]) {
                    if pid != procs[v].pid {
                        orphans.push(format!(
                            "host {v} pid {pid} alive 300 ms after its meshd was SIGKILLed: {}",
                            cmdline(pid)
                        ));
                    }
                }
                true
            }
            Fault::CrashHost => {
                if procs[v].ended.is_some() {
                    return false;
                }
                lab.crash(v);
                true
            }
            Fault::TermNode => {
                if procs[v].ended.is_some() {
                    return false;
                }
                procs[v].kill(libc::SIGTERM);
                true
            }
            Fault::KillRank => {
                let ranks = ranks_of(&hosts[v], procs[v].pid);
                let Some(r) = ranks.first() else { return false };
                if proc_state(*r).is_none_or(|s| s == 'Z') {
                    return false;
                }
                // SAFETY: a rank process inside the lab namespace.
                unsafe { libc::kill(*r, libc::SIGKILL) == 0 }
            }
            Fault::Flap => {
                lab.link(v, false);
                true
            }
            Fault::Partition => {
                for &i in a {
                    lab.partition(i, b);
                }
                for &j in b {
                    lab.partition(j, a);
                }
                true
            }
            Fault::Loss => {
                for ns in hosts {
                    loss_on(ns, p.loss_pct);
                }
                true
            }
        }
    }
}

/// Undoes a network fault (idempotent).
fn undo(p: &Plan, lab: &Lab, hosts: &[String], a: &[usize], b: &[usize]) {
    match p.fault {
        Fault::Flap => lab.link(p.victim, true),
        Fault::Partition => {
            for &i in a.iter().chain(b) {
                lab.heal(i);
            }
        }
        Fault::Loss => {
            for ns in hosts {
                loss_off(ns);
            }
        }
        _ => {}
    }
}

/// The promised outcome where it is deterministic; None when it holds (or is not).
fn expect(p: &Plan, injected: bool, codes: &[Option<i32>], stderrs: &[String]) -> Option<String> {
    let all_zero = codes.iter().all(|c| *c == Some(0));
    let all_nonzero = codes.iter().all(|c| c.is_some_and(|c| c != 0));
    match p.fault {
        Fault::None | Fault::RankExitRestart if !all_zero => {
            Some(format!("expected every node to exit 0: {codes:?}"))
        }
        Fault::RankExit if !all_nonzero => Some(format!("expected every node to fail: {codes:?}")),
        Fault::RankExit => {
            let what = format!("rank {} ", p.bad_rank);
            (!stderrs.iter().all(|e| e.contains(&what) && e.contains("exited with status 3")))
                .then(|| format!("not every node named rank {} exiting with 3", p.bad_rank))
        }
        Fault::KillRank if injected && !all_nonzero => {
            Some(format!("a rank was SIGKILLed but not every node failed: {codes:?}"))
        }
        Fault::KillNode | Fault::CrashHost if injected && matches!(p.when, When::AfterRanks(_)) => {
            // Survivors of a node lost mid-job must fail (the job cannot have finished).
            let bad: Vec<usize> =
                (0..codes.len()).filter(|&i| i != p.victim && codes[i] == Some(0)).collect();
            (!bad.is_empty())
                .then(|| format!("hosts {bad:?} exited 0 after a node was lost mid-job: {codes:?}"))
        }
        _ => None,
    }
}

fn mib(kib: i64) -> f64 {
    kib as f64 / 1024.0
}

fn rss_stats(v: &[i64]) -> String {
    if v.is_empty() {
        return "-".into();
    }
    let mut s = v.to_vec();
    s.sort();
    format!("median {:.1} max {:.1} MiB", mib(s[s.len() / 2]), mib(s[s.len() - 1]))
}

#[test]
fn soak_random_faults_never_hang_orphan_or_panic() {
    lab_or_skip!();
    let runs = env_u64("MESHD_SOAK_RUNS").unwrap_or(12) as usize;
    let wall = Duration::from_secs(env_u64("MESHD_SOAK_WALL").unwrap_or(240));
    let seed = env_u64("MESHD_SOAK_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let only = env_u64("MESHD_SOAK_ONLY").map(|k| k as usize);
    eprintln!(
        "soak: seed={seed} runs={runs} wall limit {wall:?} (replay: MESHD_SOAK_SEED={seed} MESHD_SOAK_RUNS={runs}{})",
        only.map(|k| format!(" MESHD_SOAK_ONLY={k}")).unwrap_or_default()
    );
    let soak = Soak {
        token: format!("soak-{seed}"),
        dir: std::env::temp_dir().join(format!("meshd-soak-{}", std::process::id())),
    };
    let t = Instant::now();
    let mut outs: Vec<Outcome> = Vec::new();
    let mut stopped_early = false;
    'batches: for (n, plans) in plan_batches(seed, runs) {
        let plans: Vec<Plan> = plans.into_iter().filter(|p| only.is_none_or(|k| k == p.index)).collect();
        if plans.is_empty() {
            continue;
        }
        let mut lab = Lab::new(n);
        for p in plans {
            if t.elapsed() > wall {
                stopped_early = true;
                break 'batches;
            }
            let o = soak.run(&mut lab, &p);
            eprintln!(
                "soak: run {:>3} n={} nproc={} sleep={}ms{} fault={}{} victim=h{} codes={:?} took={:.1}s rss={:.1}MiB{}",
                p.index,
                p.n,
                p.nproc,
                p.sleep_ms,
                if p.background { " bg" } else { "" },
                p.fault.name(),
                match (p.fault, p.when, o.injected) {
                    (Fault::None | Fault::RankExit | Fault::RankExitRestart, _, _) => String::new(),
                    (_, _, false) => "(not injected)".into(),
                    (_, When::AfterStart(d), _) => format!("@start+{}ms", d.as_millis()),
                    (_, When::AfterRanks(d), _) => format!("@ranks+{}ms", d.as_millis()),
                },
                p.victim,
                o.codes,
                o.took.as_secs_f64(),
                mib(o.peak_rss_kib),
                if o.hung.is_empty() && o.orphans.is_empty() && o.panics.is_empty() && o.unexpected.is_none()
                {
                    ""
                } else {
                    "  <-- BAD"
                }
            );
            outs.push(o);
        }
    }
    let _ = std::fs::remove_dir(&soak.dir); // only when empty: logs of bad or mixed runs stay

    // Summary.
    let mut by_kind: BTreeMap<Fault, (usize, usize)> = BTreeMap::new();
    for o in &outs {
        let e = by_kind.entry(o.plan.fault).or_default();
        e.0 += 1;
        if o.injected || matches!(o.plan.fault, Fault::RankExit | Fault::RankExitRestart) {
            e.1 += 1;
        }
    }
    let faults: usize = by_kind.iter().filter(|(k, _)| **k != Fault::None).map(|(_, v)| v.1).sum();
    let kinds: Vec<String> = by_kind
        .iter()
        .filter(|(k, _)| **k != Fault::None)
        .map(|(k, (planned, inj))| {
            if planned == inj {
                format!("{} {inj}", k.name())
            } else {
                format!("{} {inj}/{planned}", k.name())
            }
        })
        .collect();
    let hangs: usize = outs.iter().filter(|o| !o.hung.is_empty()).count();
    let orphans: usize = outs.iter().filter(|o| !o.orphans.is_empty()).count();
    let panics: usize = outs.iter().filter(|o| !o.panics.is_empty()).count();
    let unexpected: usize = outs.iter().filter(|o| o.unexpected.is_some()).count();
    let k = (outs.len() / 2).clamp(1, 50);
    let rss: Vec<i64> = outs.iter().map(|o| o.peak_rss_kib).collect();
    let first = &rss[..k.min(rss.len())];
    let last = &rss[rss.len().saturating_sub(k)..];
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    for o in &outs {
        let c = if o.codes.iter().all(|c| *c == Some(0)) {
            "all-0"
        } else if o.codes.iter().all(|c| c.is_some_and(|c| c != 0)) {
            "all-failed"
        } else {
            "mixed"
        };
        *outcomes.entry(c).or_default() += 1;
    }
    let took: Vec<f64> = outs.iter().map(|o| o.took.as_secs_f64()).collect();
    let max_took = took.iter().cloned().fold(0.0, f64::max);
    let summary = format!(
        "soak: runs={} faults={faults} ({}) hangs={hangs} orphans={orphans} panics={panics} unexpected={unexpected} \
         outcomes={outcomes:?} slowest-run={max_took:.1}s rss_peak_first{k}=[{}] last{k}=[{}] wall={:.0}s seed={seed}{}",
        outs.len(),
        kinds.join(", "),
        rss_stats(first),
        rss_stats(last),
        t.elapsed().as_secs_f64(),
        if stopped_early { " (stopped at the wall limit)" } else { "" }
    );
    println!("{summary}");
    eprintln!("{summary}");
    assert!(!outs.is_empty(), "no run completed");
    assert_eq!(hangs + orphans + panics + unexpected, 0, "{summary}");
}

/// A meshd killed with SIGKILL takes with it not only its ranks (PR_SET_PDEATHSIG) but the
/// processes they started (a shell script's `python`, here a `sleep`): its rank reaper
/// SIGKILLs their process groups. Found by the soak's kill-node fault.
#[test]
fn sigkilled_meshd_leaves_no_grandchild_of_a_rank() {
    lab_or_skip!();
    let lab = Lab::new(1);
    let ns = lab.hosts[0].ns.clone();
    let dir = std::env::temp_dir().join(format!("meshd-soak-kill9-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let args: Vec<String> = [
        meshd(),
        "run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        ": soakjob; sleep 300; true",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut p = Proc::spawn(&ns, &args, &[("MESHD_TOKEN", "kill9")], &dir, "h0");
    let t = Instant::now();
    let sleeps = |ns: &str| ns_pids(ns).into_iter().filter(|q| cmdline(*q) == "sleep 300").count();
    while sleeps(&ns) < 2 {
        assert!(t.elapsed() < Duration::from_secs(30), "the ranks never started: {}", p.stderr());
        assert!(!p.poll(), "meshd ended early: {}", p.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_dir_all(&dir);
    kill9_leaves_nothing(&ns, &mut p);
}

/// SIGKILLs meshd `p` and checks that within 3 s nothing is left in namespace `ns`.
fn kill9_leaves_nothing(ns: &str, p: &mut Proc) {
    p.kill(libc::SIGKILL);
    let t = Instant::now();
    let mut left = vec![0];
    while !left.is_empty() && t.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(50));
        p.poll();
        left = ns_pids(ns).into_iter().filter(|q| *q != p.pid).collect();
    }
    let what: Vec<String> = left.iter().map(|q| format!("{q}: {}", cmdline(*q))).collect();
    assert!(what.is_empty(), "left running 3 s after meshd was SIGKILLed: {what:?}");
}

/// meshd's start-up once ran `python3 -c ...` to find libnccl, and a meshd SIGKILLed
/// meanwhile left it behind (found by the soak: kill-node during startup). Now libnccl is
/// found from the file system alone and no interpreter is started at all: with a stand-in
/// python3 that would sleep on PATH, the job ends at once and no probe ever appears.
#[test]
fn meshd_starts_no_nccl_probe_that_could_outlive_it() {
    lab_or_skip!();
    let lab = Lab::new(1);
    let ns = lab.hosts[0].ns.clone();
    let dir = std::env::temp_dir().join(format!("meshd-soak-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let py = dir.join("python3");
    std::fs::write(&py, "#!/bin/sh\nexec sleep 299\n").expect("fake python3");
    let mode = <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755);
    std::fs::set_permissions(&py, mode).expect("chmod");
    let path = format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default());
    let args: Vec<String> =
        [meshd(), "run", "--nnodes", "1", "--", "true"].iter().map(|s| s.to_string()).collect();
    // An empty MESHD_NCCL_LIB counts as unset (CI sets it).
    let mut p = Proc::spawn(&ns, &args, &[("PATH", &path), ("MESHD_NCCL_LIB", "")], &dir, "h0");
    let t = Instant::now();
    let mut probe_seen = false;
    while !p.poll() {
        probe_seen |= ns_pids(&ns).into_iter().any(|q| cmdline(q) == "sleep 299");
        assert!(t.elapsed() < Duration::from_secs(20), "meshd did not finish: {}", p.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!probe_seen, "meshd started python3: {}", p.stderr());
    kill9_leaves_nothing(&ns, &mut p);
    let _ = std::fs::remove_dir_all(&dir);
}

/// When a rank fails, every node names that rank, even one that hears of another node
/// leaving (that node stopped on the Abort) before the Abort itself reaches it. Found by
/// the soak (rank-exit runs: a node blamed an innocent node that "stopped answering").
/// Here host 1 gets nothing from host 0 (where the rank fails) for a moment around the
/// failure, while host 2 gets the Abort at once and leaves; host 0 stays a while (its other
/// rank ignores SIGTERM), so its Abort reaches host 1 once the moment is over.
#[test]
fn a_node_leaving_on_an_abort_is_not_blamed_for_it() {
    lab_or_skip!();
    let lab = Lab::new(3);
    let (h0, h1) = (lab.hosts[0].clone(), lab.hosts[1].clone());
    // Node ranks follow eth1 addresses: .7 (host 1) 0, .19 (host 2) 1, .30 (host 0) 2, so
    // ranks 4 and 5 run on host 0.
    let script = ": soakjob; if [ \"$RANK\" = 4 ]; then sleep 1; exit 3; fi; \
                  if [ \"$RANK\" = 5 ]; then trap '' TERM; fi; sleep 30";
    let peers = lab.peers();
    let args: Vec<String> =
        [meshd(), "run", "--nnodes", "3", "--peers", &peers, "--nproc-per-node", "2", "--grace", "3s", "--"]
            .iter()
            .chain(&["sh", "-c", script])
            .map(|s| s.to_string())
            .collect();
    let dir = std::env::temp_dir().join(format!("meshd-soak-left-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let mut procs: Vec<Proc> = lab
        .hosts
        .iter()
        .enumerate()
        .map(|(i, h)| Proc::spawn(&h.ns, &args, &[("MESHD_TOKEN", "left")], &dir, &format!("h{i}")))
        .collect();
    let t = Instant::now();
    while ranks_of(&h0.ns, procs[0].pid).is_empty() {
        assert!(t.elapsed() < Duration::from_secs(30), "no rank on host 0: {}", procs[0].stderr());
        std::thread::sleep(Duration::from_millis(10));
    }
    let seen = Instant::now();
    std::thread::sleep(Duration::from_millis(600));
    let block = format!(
        "table inet mdsoakblk {{\n chain in {{\n type filter hook input priority -5; policy accept;\n \
         ip saddr {} drop\n }}\n}}\n",
        h0.eth1
    );
    assert!(nft(&h1.ns, &block), "nft");
    std::thread::sleep((seen + Duration::from_millis(1400)).saturating_duration_since(Instant::now()));
    let _ = Command::new("ip")
        .args(["netns", "exec", &h1.ns, "nft", "delete", "table", "inet", "mdsoakblk"])
        .status();
    let deadline = Instant::now() + Duration::from_secs(40);
    while procs.iter_mut().any(|p| !p.poll()) {
        assert!(Instant::now() < deadline, "a node hangs");
        std::thread::sleep(Duration::from_millis(20));
    }
    let errs: Vec<String> = procs.iter().map(|p| p.stderr()).collect();
    let _ = std::fs::remove_dir_all(&dir);
    for (i, p) in procs.iter().enumerate() {
        assert_eq!(p.code(), Some(3), "host {i}:\n{}", errs[i]);
        assert!(
            errs[i].contains("rank 4 (local rank 0)") && errs[i].contains("exited with status 3"),
            "host {i} must name the failed rank:\n{}",
            errs[i]
        );
    }
}
