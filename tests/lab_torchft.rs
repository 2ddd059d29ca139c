//! Lab: torchft 0.2.0 (PyPI, with PyPI's torch 2.x, CPU Gloo) under
//! `meshd run --fault-tolerance node`, unmodified: no lighthouse host, no per-node flags.
//! Each host is one replica group of 2 ranks; the torchft script
//! (tests/python/torchft_train.py) logs every step to a shared directory, so the test sees
//! the job while it runs. Each test prints a `FIGURE` line with what it measured.

mod lab;
mod torches;
use lab::Lab;
use lab::torchft::{Line, Logs, ft_args, now_secs, wait_lines};
use std::collections::BTreeMap;
use std::time::Duration;

const TOKEN: (&str, &str) = ("MESHD_TOKEN", "torchft-lab");

fn spawn(
    lab: &mut Lab,
    i: usize,
    args: &[String],
    logs: &Logs,
    steps: u32,
    extra: &[(&str, String)],
) -> usize {
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let dir = logs.dir();
    let steps = steps.to_string();
    let mut env = vec![TOKEN, ("FT_LOG", dir.as_str()), ("FT_STEPS", &steps), ("FT_STEP_SLEEP", "0.1")];
    env.extend(extra.iter().map(|(k, v)| (*k, v.as_str())));
    lab.spawn(i, &a, &env)
}

/// Group of the node on host `i`: the REPLICA_GROUP_ID its ranks logged. Hosts are told
/// apart by the pids in their namespaces.
fn group_of_host(lab: &Lab, logs: &Logs, i: usize) -> Option<u64> {
    let pids: Vec<u64> = lab.pids(i).into_iter().map(|p| p as u64).collect();
    logs.lines().into_iter().find(|l| pids.contains(&l.pid)).map(|l| l.group)
}

/// How the victim node is lost.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    /// SIGKILL of its meshd and ranks: its kernel resets their connections.
    Kill,
    /// Its link cut: nothing comes back (no RST); the survivors' connections to it stay up
    /// until meshd ends them.
    LinkCut,
}

/// What a scenario measured.
struct Figures {
    next_commit: f64,
    /// When (Unix seconds) the survivors first committed without the lost group.
    resumed_at: f64,
    first_replacement_commit: f64,
    survivor_restarts: usize,
}

/// A running 3-host job: each host's command's handle, the args, the logs.
struct Job {
    lab: Lab,
    logs: Logs,
    args: Vec<String>,
    ks: Vec<usize>,
    steps: u32,
    /// Each host's extra environment (a replacement gets its host's).
    envs: Vec<Vec<(&'static str, String)>>,
}

impl Job {
    /// The identical command on 3 hosts (with `env` of host `i` from `extra_env`), until
    /// every group has passed step `warm`.
    fn start(
        name: &str,
        steps: u32,
        warm: i64,
        firewall: bool,
        extra_env: &dyn Fn(usize) -> Vec<(&'static str, String)>,
    ) -> Job {
        let torch = torches::Torch::current(true).expect("torch 2 with torchft");
        let mut lab = Lab::new(3);
        if firewall {
            // Only meshd's UDP port between the hosts: every TCP connection torchft makes
            // (stores, managers, Gloo, checkpoints) must go through the tunnel.
            for i in 0..3 {
                lab.firewall_only_udp(i, 29400);
            }
        }
        let logs = Logs::new("meshd-torchft", name);
        let args = ft_args(&lab, &torch.python, "2:3", &[]);
        let envs: Vec<Vec<(&'static str, String)>> = (0..3).map(extra_env).collect();
        let ks: Vec<usize> = (0..3).map(|i| spawn(&mut lab, i, &args, &logs, steps, &envs[i])).collect();
        let started = wait_lines(&logs, Duration::from_secs(120), |l| {
            let groups: std::collections::BTreeSet<u64> =
                l.iter().filter(|l| l.step >= warm).map(|l| l.group).collect();
            groups.len() == 3
        });
        assert!(started, "every group reaches step {warm}:\n{}", logs.outputs(25));
        Job { lab, logs, args, ks, steps, envs }
    }

    /// Loses host `victim`'s node by `fault`, checks that the survivors commit without it,
    /// starts its replacement (the same command) and waits for it to heal and commit with
    /// all 3 groups. Returns (victim's group, kill -> survivors' next commit, replacement
    /// start -> its first commit, the survivors' next commit in Unix seconds).
    fn lose_and_replace(
        &mut self,
        victim: usize,
        fault: Fault,
        limit_resume: Duration,
    ) -> (u64, f64, f64, f64) {
        let logs = &self.logs;
        let vgroup = group_of_host(&self.lab, logs, victim).expect("the victim's group");
        if std::env::var_os("FT_DEBUG_SS").is_some() {
            let o = std::process::Command::new("ip")
                .args(["netns", "exec", &self.lab.hosts[0].ns, "ss", "-tnp"])
                .output()
                .expect("ss");
            eprintln!("SS host 0:\n{}", String::from_utf8_lossy(&o.stdout));
        }
        let t_kill = now_secs();
        eprintln!("{fault:?} of host {victim} at {t_kill:.3}");
        match fault {
            Fault::Kill => self.lab.crash(victim),
            Fault::LinkCut => self.lab.link(victim, false),
        }
        // Survivors go on: a committed step without the victim's group.
        let survivors_on = |x: &Line| x.t > t_kill && x.committed && x.group != vgroup && x.participants == 2;
        let resumed = wait_lines(logs, limit_resume, |l| l.iter().any(survivors_on));
        assert!(
            resumed,
            "{fault:?}: the survivors commit a step without the lost group within {limit_resume:?}:\n{}",
            logs.outputs(25)
        );
        let next = logs.lines().iter().filter(|x| survivors_on(x)).map(|x| x.t).fold(f64::INFINITY, f64::min);
        if fault == Fault::LinkCut {
            self.lab.crash(victim);
            self.lab.link(victim, true);
        }
        let (_, _, err) = self.lab.wait(self.ks[victim], Duration::from_secs(10));
        if fault == Fault::LinkCut {
            // The cut-off node found itself alone: fewer than MIN groups.
            eprintln!(
                "cut-off node's last words:\n{}",
                err.lines().rev().take(5).collect::<Vec<_>>().join("\n")
            );
        }
        // The replacement: the same command on the same host.
        let t_rep = now_secs();
        self.ks[victim] =
            spawn(&mut self.lab, victim, &self.args, &self.logs, self.steps, &self.envs[victim]);
        let healed = wait_lines(&self.logs, Duration::from_secs(120), |l| {
            l.iter().any(|x| x.t > t_rep && x.group == vgroup && x.committed && x.participants == 3)
        });
        if !healed {
            let nodes = self.stop_all();
            panic!(
                "the replacement heals and commits with all 3 groups:\n{}\n{nodes}",
                self.logs.outputs(25)
            );
        }
        let first = self
            .logs
            .lines()
            .iter()
            .filter(|x| x.t > t_rep && x.group == vgroup && x.committed)
            .map(|x| x.t)
            .fold(f64::INFINITY, f64::min);
        (vgroup, next - t_kill, first - t_rep, next)
    }

    /// Stops every node (a failed test) and returns the last lines of each meshd's log.
    fn stop_all(&mut self) -> String {
        let mut out = String::new();
        for i in 0..3 {
            self.lab.crash(i);
            let (_, _, err) = self.lab.wait(self.ks[i], Duration::from_secs(10));
            let tail: Vec<&str> = err.lines().rev().take(40).collect();
            out.push_str(&format!("==== meshd on host {i}:\n"));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// Every node ends 0 and the final weights agree across groups, rank by rank. Returns
    /// every node's stderr, by host.
    fn finish(mut self) -> (Logs, Vec<String>) {
        // Every group stops 20 steps on (FT_STEPS is only the bound).
        let at = self.logs.lines().iter().map(|l| l.step).max().unwrap_or(0) + 20;
        let stop = self.logs.path().join("stop_at");
        std::fs::write(stop.with_extension("tmp"), at.to_string()).expect("stop_at");
        std::fs::rename(stop.with_extension("tmp"), &stop).expect("stop_at");
        let mut errs = Vec::new();
        for i in 0..3 {
            let (code, _, err) = self.lab.wait(self.ks[i], Duration::from_secs(180));
            assert_eq!(code, Some(0), "host {i} ends 0:\n{err}\n{}", self.logs.outputs(25));
            errs.push(err);
        }
        let mut finals: BTreeMap<u64, Vec<(u64, String)>> = BTreeMap::new();
        for l in self.logs.lines().iter().filter(|l| l.final_digest.is_some()) {
            finals.entry(l.rank).or_default().push((l.group, l.final_digest.clone().unwrap_or_default()));
        }
        assert_eq!(finals.len(), 2, "final lines of both ranks: {finals:?}");
        for (rank, v) in &finals {
            assert_eq!(v.len(), 3, "rank {rank}: a final line from every group: {v:?}");
            assert!(v.iter().all(|(_, d)| *d == v[0].1), "rank {rank}: the groups' weights agree: {v:?}");
        }
        (self.logs, errs)
    }
}

/// Survivors kept their processes: one pid per (group, rank) outside `changed` groups, the
/// same as `before`. Returns how many survivor processes were restarted (0).
fn survivors_kept(before: &BTreeMap<(u64, u64), Vec<u64>>, lines: &[Line], changed: &[u64]) -> usize {
    let after = pids_by_rank(lines);
    let mut restarted = 0;
    for ((g, r), pids) in &after {
        if !changed.contains(g) {
            let had = before.get(&(*g, *r));
            assert_eq!(Some(pids), had, "group {g} rank {r} kept its process");
            restarted += pids.len() - had.map_or(0, Vec::len);
        }
    }
    restarted
}

/// How a scenario's job runs.
#[derive(Clone, Copy, Debug, Default)]
struct Setup {
    /// Only meshd's UDP port open between the hosts (the tunnel carries every connection).
    firewall: bool,
    /// torchft's default checkpoint transport (HTTP, at `http://{gethostname()}:port`)
    /// instead of the process group's.
    http_checkpoints: bool,
}

/// Scenarios (a), (b), (c), (d): a whole node lost at step 20 (by `fault`): the survivors
/// keep their processes and go on committing, a replacement started with the same command
/// heals from a peer and commits, and the final weights agree across groups.
fn node_lost_and_replaced(victim: usize, fault: Fault, name: &str, setup: Setup) -> Figures {
    let extra = |_| -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
        // The ranks' own timeouts long (60 s, torchft's default) for a cut link: the
        // survivors must not be saved by them.
        if fault == Fault::LinkCut {
            v.push(("FT_TIMEOUT", "60".into()));
        }
        if setup.http_checkpoints {
            v.push(("FT_TRANSPORT", "http".into()));
        }
        v
    };
    let mut job = Job::start(name, 5000, 20, setup.firewall, &extra);
    let before = pids_by_rank(&job.logs.lines());
    let limit = Duration::from_secs(if fault == Fault::LinkCut { 30 } else { 60 });
    let (vgroup, next, first, resumed_at) = job.lose_and_replace(victim, fault, limit);
    let (logs, errs) = job.finish();
    let restarted = survivors_kept(&before, &logs.lines(), &[vgroup]);
    let f = Figures {
        next_commit: next,
        resumed_at,
        first_replacement_commit: first,
        survivor_restarts: restarted,
    };
    eprintln!(
        "FIGURE torchft {name}: lost -> survivors' next committed step {:.2} s; replacement start -> its first \
         committed step {:.2} s; survivor restarts {}",
        f.next_commit, f.first_replacement_commit, f.survivor_restarts
    );
    if std::env::var_os("MESHD_LAB_SHOW").is_some() {
        for (i, e) in errs.iter().enumerate() {
            eprintln!("==== meshd on host {i}:\n{e}");
        }
    }
    if setup.firewall {
        // Every survivor's ranks went through the tunnel, and meshd reset their tunnelled
        // connections with the lost node when the mesh dropped it.
        for (i, e) in errs.iter().enumerate().filter(|(i, _)| *i != victim) {
            assert!(e.contains("collective: tunnel"), "host {i} ran through the tunnel:\n{e}");
            assert!(e.contains("tunnelled connection"), "host {i} reset the lost node's connections:\n{e}");
        }
    }
    if fault == Fault::LinkCut {
        // meshd ended the survivors' connections to the cut-off node, or the survivors had
        // already gone on without it: torchft's quorum can form without a member whose
        // request never came (the link was cut as the step's quorum was asked for), and
        // then the ranks close their connections to it themselves. Only the second is
        // proved by time: the survivors committed before this node's meshd dropped it.
        for (i, e) in errs.iter().enumerate().filter(|(i, _)| *i != victim) {
            if e.contains("TCP connection") && e.contains("so that their collectives") {
                continue;
            }
            let dropped = e
                .lines()
                .find(|l| l.contains("held no TCP connections to"))
                .and_then(log_time)
                .unwrap_or_else(|| panic!("host {i} closed its ranks' connections to the lost node:\n{e}"));
            assert!(
                f.resumed_at < dropped,
                "host {i}'s ranks held no connections to the lost node when meshd dropped it at {dropped:.3}, \
                 but the survivors had not gone on without it (they did at {:.3}):\n{e}",
                f.resumed_at
            );
        }
    }
    f
}

/// The time (Unix seconds) of a meshd log line, from its RFC 3339 UTC stamp
/// (`2026-12-06T16:32:26.507075Z ...`).
fn log_time(line: &str) -> Option<f64> {
    let stamp = line.split_whitespace().next()?.strip_suffix('Z')?;
    let (date, time) = stamp.split_once('T')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (h, min, sec) =
        (t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?);
    // Days from 1970-01-01 to the civil date (Howard Hinnant's days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + h * 3600.0 + min * 60.0 + sec)
}

#[test]
fn log_time_reads_meshds_stamps() {
    assert_eq!(log_time("1970-01-01T00:00:01.5Z INFO x"), Some(1.5));
    let t = log_time("2026-12-06T16:32:26.507075Z  WARN node vm").expect("a meshd stamp parses");
    assert!((t - 1_796_574_746.507_075).abs() < 1e-3, "{t}");
    assert_eq!(log_time("no stamp here"), None);
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

// The decider is the first live member in roster order (by address): host 1 holds the
// lowest (198.19.0.7); host 2 (198.19.0.19) is a worker.

/// (a), with torchft's default checkpoint transport: the replacement heals over HTTP from
/// the address torchft advertises (`http://{gethostname()}:port`; the lab's hosts share
/// one name, which resolves to loopback), which meshd makes this node's own.
#[test]
fn a_killed_node_leaves_the_quorum_the_others_train_on_and_its_replacement_heals() {
    lab_or_skip!();
    if torches::Torch::current(true).is_none() {
        return;
    }
    let setup = Setup { http_checkpoints: true, ..Setup::default() };
    let f = node_lost_and_replaced(2, Fault::Kill, "worker killed", setup);
    assert_eq!(f.survivor_restarts, 0);
}

/// (c): behind a firewall that drops all TCP between the hosts (only meshd's UDP port is
/// open), the same: every connection torchft makes goes through the tunnel, a lost node's
/// tunnelled connections are reset at once, and the replacement (a new node id at the same
/// address) is let in by the survivors' tunnels.
#[test]
fn behind_a_one_port_firewall_a_killed_node_is_replaced_without_stopping_the_others() {
    lab_or_skip!();
    if torches::Torch::current(true).is_none() {
        return;
    }
    let setup = Setup { firewall: true, ..Setup::default() };
    let f = node_lost_and_replaced(2, Fault::Kill, "firewalled worker killed", setup);
    assert_eq!(f.survivor_restarts, 0);
}

/// (b) A cut link sends no RST: the survivors' connections to the lost node stay up, and
/// only meshd's closing them keeps the survivors from waiting out their 60 s timeouts.
#[test]
fn a_cut_off_node_does_not_hold_the_survivors_for_their_timeout() {
    lab_or_skip!();
    if torches::Torch::current(true).is_none() {
        return;
    }
    let f = node_lost_and_replaced(2, Fault::LinkCut, "worker's link cut", Setup::default());
    assert!(f.next_commit < 30.0);
}

/// (e) then (d): a rank failing on host 0 restarts host 0's ranks only, which heal and
/// commit again; then the decider's node (host 1) is killed, the survivors go on, and its
/// replacement heals.
#[test]
fn a_failed_rank_restarts_its_node_only_and_the_deciders_loss_is_survived() {
    lab_or_skip!();
    if torches::Torch::current(true).is_none() {
        return;
    }
    let extra = |i: usize| -> Vec<(&'static str, String)> {
        if i == 0 { vec![("FT_FAIL_AT", "15".into())] } else { Vec::new() }
    };
    let mut job = Job::start("rank failure then decider killed", 5000, 10, false, &extra);
    // Host 0's rank 1 exits 3 at step 15 (once): host 0's ranks restart, nobody else's.
    let g0 = group_of_host(&job.lab, &job.logs, 0).expect("host 0's group");
    let before = pids_by_rank(&job.logs.lines());
    let restarted_and_healed = wait_lines(&job.logs, Duration::from_secs(120), |l| {
        let fresh =
            |x: &&Line| x.group == g0 && !before.get(&(x.group, x.rank)).is_some_and(|p| p.contains(&x.pid));
        l.iter().filter(fresh).any(|x| x.committed && x.participants == 3)
    });
    assert!(
        restarted_and_healed,
        "host 0's restarted ranks commit with all 3 groups:\n{}",
        job.logs.outputs(25)
    );
    // While host 0's ranks restarted, the others committed steps without it.
    let lines = job.logs.lines();
    let old = |x: &Line| before.get(&(x.group, x.rank)).is_some_and(|p| p.contains(&x.pid));
    let t_down = lines.iter().filter(|x| x.group == g0 && old(x)).map(|x| x.t).fold(0.0, f64::max);
    let t_back = lines
        .iter()
        .filter(|x| x.group == g0 && !old(x) && x.committed)
        .map(|x| x.t)
        .fold(f64::INFINITY, f64::min);
    let others_on = lines
        .iter()
        .any(|x| x.group != g0 && x.committed && x.participants == 2 && x.t > t_down && x.t < t_back);
    assert!(others_on, "the other groups committed steps while host 0 restarted:\n{}", job.logs.outputs(25));
    // Now the decider.
    let mid = pids_by_rank(&job.logs.lines());
    let (g1, next, first, _) = job.lose_and_replace(1, Fault::Kill, Duration::from_secs(60));
    let (logs, errs) = job.finish();
    assert!(errs[0].contains("restarting this node's ranks only"), "host 0:\n{}", errs[0]);
    for (i, e) in errs.iter().enumerate().skip(1) {
        assert!(!e.contains("restarting"), "host {i} restarted nothing:\n{e}");
    }
    // Host 0: each rank had 2 processes (the restart); host 2 kept its own throughout.
    let lines = logs.lines();
    let pids = pids_by_rank(&lines);
    for r in 0..2 {
        assert_eq!(pids.get(&(g0, r)).map(Vec::len), Some(2), "host 0 rank {r}: one restart: {pids:?}");
    }
    let restarted = survivors_kept(&mid, &lines, &[g1]);
    let g2 = before.keys().map(|(g, _)| *g).find(|g| *g != g0 && *g != g1).expect("a third group");
    assert_eq!(pids.get(&(g2, 0)), before.get(&(g2, 0)), "host 2's ranks never restarted");
    eprintln!(
        "FIGURE torchft decider killed: lost -> survivors' next committed step {next:.2} s; replacement start -> its \
         first committed step {first:.2} s; survivor restarts {restarted}"
    );
    assert_eq!(restarted, 0);
}
