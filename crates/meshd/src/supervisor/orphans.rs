//! What ranks leave behind: when a job ends (success or failure), every process a rank
//! started goes too, including ones that outlived the rank in its process group
//! (`sh -c 'sleep 37 & exit 0'`) and ones that left the group (`setsid`, daemons).
//!
//! meshd is made a child subreaper (`PR_SET_CHILD_SUBREAPER`), so an orphan of a rank is
//! re-parented to meshd rather than to init, where meshd can still find it. At the end of
//! each round [`sweep`] stops, by pid, the processes still in a rank's process group and
//! meshd's children that are neither ranks nor meshd's own helpers (the reaper, the NCCL
//! root process): SIGTERM, up to the grace, SIGKILL; and reaps them.

use std::collections::BTreeSet;
use std::sync::{Mutex, Once};
use std::time::Duration;

/// meshd's own helper processes: never taken for an orphan of a rank.
static HELPERS: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

/// Records one of meshd's own helper processes (kept alive by meshd, not by a rank).
pub fn register_helper(pid: i32) {
    HELPERS.lock().unwrap_or_else(|e| e.into_inner()).insert(pid);
}

/// Forgets a helper that ended.
pub fn unregister_helper(pid: i32) {
    HELPERS.lock().unwrap_or_else(|e| e.into_inner()).remove(&pid);
}

/// Makes this process the subreaper of its descendants (once; Linux 3.4+).
pub fn become_subreaper() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: a plain prctl with integer arguments.
        let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        if r != 0 {
            tracing::debug!(
                "PR_SET_CHILD_SUBREAPER failed: {}; processes that leave a rank's group may outlive the job",
                std::io::Error::last_os_error()
            );
        }
    });
}

/// One process as /proc shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Proc {
    pid: i32,
    ppid: i32,
    pgrp: i32,
    zombie: bool,
}

/// Parses `/proc/PID/stat`: `pid (comm) state ppid pgrp ...` (comm may hold spaces and
/// parentheses, so fields are counted after the last `)`).
fn parse_stat(pid: i32, stat: &str) -> Option<Proc> {
    let rest = stat.rsplit_once(')')?.1;
    let mut f = rest.split_whitespace();
    let state = f.next()?;
    let ppid = f.next()?.parse().ok()?;
    let pgrp = f.next()?.parse().ok()?;
    Some(Proc { pid, ppid, pgrp, zombie: state == "Z" })
}

fn processes() -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter_map(|pid| parse_stat(pid, &std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?))
        .collect()
}

/// Every process's (pid, parent pid), from /proc.
pub(crate) fn process_parents() -> Vec<(i32, i32)> {
    processes().into_iter().map(|p| (p.pid, p.ppid)).collect()
}

/// The pids of `root`'s descendants (and `root` itself when `with_root`).
pub fn tree(root: i32, with_root: bool) -> BTreeSet<i32> {
    let procs = process_parents();
    let mut found: BTreeSet<i32> = BTreeSet::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(pid, ppid) in &procs {
            if ppid == p && found.insert(pid) {
                frontier.push(pid);
            }
        }
    }
    if with_root {
        found.insert(root);
    }
    found
}

/// The processes a round's ranks left behind: members of their process `groups`, and
/// meshd's children that are not its helpers (orphans re-parented to the subreaper).
fn left_behind(groups: &BTreeSet<i32>, me: i32, all: &[Proc]) -> Vec<Proc> {
    let helpers = HELPERS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    all.iter()
        .filter(|p| p.pid != me && !helpers.contains(&p.pid))
        .filter(|p| groups.contains(&p.pgrp) || p.ppid == me)
        .copied()
        .collect()
}

/// Reaps the zombies among meshd's own children that are not tokio's (orphans).
fn reap(procs: &[Proc], me: i32) {
    for p in procs.iter().filter(|p| p.ppid == me) {
        let mut status = 0;
        // SAFETY: waitpid on one specific pid, non-blocking; never -1 (tokio owns the rest).
        unsafe { libc::waitpid(p.pid, &mut status, libc::WNOHANG) };
    }
}

/// Stops everything the ranks of a round left behind (see the module doc); returns how
/// many processes it found. Call after every rank leader was reaped.
pub async fn sweep(groups: &BTreeSet<i32>, grace: Duration) -> usize {
    let me = std::process::id() as i32;
    let first = left_behind(groups, me, &processes());
    let found: Vec<&Proc> = first.iter().filter(|p| !p.zombie).collect();
    reap(&first, me);
    if found.is_empty() {
        return 0;
    }
    for p in &found {
        // SAFETY: a signal to a pid that /proc showed in one of our ranks' groups or as our child.
        unsafe { libc::kill(p.pid, libc::SIGTERM) };
    }
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = left_behind(groups, me, &processes());
        reap(&now, me);
        let alive: Vec<&Proc> = now.iter().filter(|p| !p.zombie).collect();
        if alive.is_empty() {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            for p in &alive {
                // SAFETY: as above.
                unsafe { libc::kill(p.pid, libc::SIGKILL) };
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            reap(&left_behind(groups, me, &processes()), me);
            break;
        }
    }
    found.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_with_odd_command_names_parse() {
        let p = parse_stat(42, "42 (a (b) c) S 7 42 42 0 -1 4194560").expect("parse");
        assert_eq!(p, Proc { pid: 42, ppid: 7, pgrp: 42, zombie: false });
        let z = parse_stat(43, "43 (sh) Z 1 40 40 0").expect("parse");
        assert!(z.zombie);
        assert!(parse_stat(1, "garbage").is_none());
    }

    #[test]
    fn left_behind_is_group_members_and_non_helper_children() {
        let me = 100;
        register_helper(101);
        let all = [
            Proc { pid: 101, ppid: me, pgrp: 101, zombie: false }, // the reaper: a helper
            Proc { pid: 102, ppid: me, pgrp: 102, zombie: false }, // a setsid orphan
            Proc { pid: 103, ppid: 50, pgrp: 7, zombie: false },   // in rank group 7
            Proc { pid: 104, ppid: 1, pgrp: 9, zombie: false },    // unrelated
        ];
        let groups: BTreeSet<i32> = [7].into_iter().collect();
        let got: Vec<i32> = left_behind(&groups, me, &all).iter().map(|p| p.pid).collect();
        unregister_helper(101);
        assert_eq!(got, vec![102, 103]);
    }
}
