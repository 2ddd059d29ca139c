//! Process supervision: one child per local rank, each in its own process group, its
//! console lines prefixed with its global rank ([`output`]: progress bars, long lines, a
//! writer thread), stopped as a group (SIGTERM, grace, SIGKILL). Children also get
//! PR_SET_PDEATHSIG so a meshd killed with SIGKILL does not leave ranks running, and
//! every rank's process group is registered with a small reaper process (forked once per
//! meshd) that SIGKILLs the groups still registered when meshd dies, so the processes a
//! rank started (a shell script's python, its workers) go too: PR_SET_PDEATHSIG reaches
//! only the rank's first process. When a round ends, [`orphans::sweep`] stops what the
//! ranks left behind, in their groups or re-parented to meshd (a child subreaper).

pub mod cut;
pub mod orphans;
pub mod output;
pub mod sockets;

use output::{Activity, Sink, Tail, pump};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// One rank to start.
#[derive(Clone, Debug)]
pub struct RankSpec {
    /// Global rank (RANK).
    pub global: u32,
    /// Local rank (LOCAL_RANK).
    pub local: u32,
    /// Environment variables set for it.
    pub env: Vec<(String, String)>,
}

/// Which of a rank's streams a torchrun-style `--redirects` / `--tee` names: bit 1 stdout,
/// bit 2 stderr (0 none, 3 both), for every local rank or per local rank (`0:1,1:2`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StdStreams {
    /// For local ranks not listed.
    pub all: u8,
    /// (local rank, streams) given one by one.
    pub per_rank: Vec<(u32, u8)>,
}

/// Why a `--redirects` / `--tee` value does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StdStreamsError {
    /// A value that is not 0 to 3.
    #[error("{0:?}: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both)")]
    Streams(String),
    /// A per-rank entry without its colon.
    #[error("{0:?}: expected LOCAL_RANK:0..3")]
    NoRank(String),
    /// A per-rank entry whose rank is no number.
    #[error("{part:?}: {rank:?} is not a local rank")]
    NotARank {
        /// The entry.
        part: String,
        /// Its rank.
        rank: String,
    },
}

impl StdStreams {
    /// Parses `0`..`3` or `LOCAL:0..3,...`.
    pub fn parse(s: &str) -> Result<StdStreams, StdStreamsError> {
        let bits = |v: &str| match v.trim() {
            "0" => Ok(0u8),
            "1" => Ok(1),
            "2" => Ok(2),
            "3" => Ok(3),
            other => Err(StdStreamsError::Streams(other.to_string())),
        };
        let s = s.trim();
        if !s.contains(':') {
            return Ok(StdStreams { all: bits(s)?, per_rank: Vec::new() });
        }
        let mut per_rank = Vec::new();
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let (r, v) = part.split_once(':').ok_or_else(|| StdStreamsError::NoRank(part.to_string()))?;
            let r = r
                .trim()
                .parse::<u32>()
                .map_err(|_| StdStreamsError::NotARank { part: part.to_string(), rank: r.to_string() })?;
            per_rank.push((r, bits(v)?));
        }
        Ok(StdStreams { all: 0, per_rank })
    }

    /// Whether it names `local`'s stderr (`err`) or stdout.
    pub fn has(&self, local: u32, err: bool) -> bool {
        let v = self.per_rank.iter().find(|(r, _)| *r == local).map_or(self.all, |(_, v)| *v);
        v & if err { 2 } else { 1 } != 0
    }
}

/// Where the ranks' output goes besides the log files (torchrun's `--redirects`, `--tee`,
/// `--local-ranks-filter`).
#[derive(Clone, Debug, Default)]
pub struct OutputSpec {
    /// Streams that go to the log files only.
    pub redirects: StdStreams,
    /// Streams that go to the console as well (overrides `redirects`).
    pub tee: StdStreams,
    /// Only these local ranks on the console (None: all).
    pub console_ranks: Option<Vec<u32>>,
}

impl OutputSpec {
    /// Whether `local`'s stream goes to meshd's console.
    pub fn console(&self, local: u32, err: bool) -> bool {
        let shown = self.console_ranks.as_ref().is_none_or(|r| r.contains(&local));
        shown && (!self.redirects.has(local, err) || self.tee.has(local, err))
    }

    /// Whether any stream is kept off the console for the log files.
    pub fn redirects_any(&self) -> bool {
        self.redirects.all != 0 || self.redirects.per_rank.iter().any(|(_, v)| *v != 0)
    }
}

/// Where one round's output goes: the log files' directory (if any) and the routing.
#[derive(Clone, Debug, Default)]
pub struct RoundOutput {
    /// `rankN.out` / `rankN.err` go here.
    pub dir: Option<PathBuf>,
    /// Console routing.
    pub spec: OutputSpec,
    /// Marked whenever a rank writes output (shared with the local service).
    pub activity: Option<Arc<Activity>>,
}

/// A rank that ended.
#[derive(Clone, Debug)]
pub struct RankExit {
    /// Global rank.
    pub global: u32,
    /// Local rank.
    pub local: u32,
    /// How it ended.
    pub status: ExitStatus,
}

/// Words for an exit status: "exited with status 3", "killed by signal 9 (SIGKILL)".
pub fn describe(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(c) = status.code() {
        return format!("exited with status {c}");
    }
    match status.signal() {
        Some(s) => format!("killed by signal {s} ({})", signal_name(s)),
        None => "ended".into(),
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGHUP => "SIGHUP",
        _ => "signal",
    }
}

/// Starting a rank failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot start rank {rank} ({cmd}): {source}")]
pub struct SpawnError {
    /// The rank.
    pub rank: u32,
    /// The command.
    pub cmd: String,
    /// Why.
    pub source: std::io::Error,
}

/// The running ranks of this node.
#[derive(Debug)]
pub struct Supervisor {
    /// (global, local, pid) of ranks not yet reaped.
    running: Vec<(u32, u32, i32)>,
    /// Every rank's process group, kept after the leader exits: what it left is swept.
    groups: std::collections::BTreeSet<i32>,
    exits: mpsc::Receiver<RankExit>,
    /// Each rank's last stderr lines.
    tails: Vec<(u32, Arc<Mutex<Tail>>)>,
    /// When any rank last wrote output.
    activity: Arc<Activity>,
}

impl Supervisor {
    /// Starts every rank. On a failure, the ranks already started are stopped.
    pub async fn spawn(
        cmd: &[String],
        ranks: &[RankSpec],
        out: &RoundOutput,
    ) -> Result<Supervisor, SpawnError> {
        let (tx, rx) = mpsc::channel(ranks.len().max(1));
        orphans::become_subreaper();
        let activity = out.activity.clone().unwrap_or_default();
        activity.touch();
        let mut sup = Supervisor {
            running: Vec::new(),
            groups: Default::default(),
            exits: rx,
            tails: Vec::new(),
            activity,
        };
        for r in ranks {
            let tail = Arc::new(Mutex::new(Tail::default()));
            sup.tails.push((r.global, tail.clone()));
            match start(cmd, r, out, tail, sup.activity.clone(), tx.clone()) {
                Ok(pid) => {
                    sup.running.push((r.global, r.local, pid));
                    sup.groups.insert(pid);
                }
                Err(source) => {
                    sup.stop(Duration::from_secs(2)).await;
                    return Err(SpawnError { rank: r.global, cmd: cmd.join(" "), source });
                }
            }
        }
        Ok(sup)
    }

    /// Number of ranks still running.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// The last lines rank `global` wrote to stderr (oldest first).
    pub fn tail(&self, global: u32) -> Vec<String> {
        self.tails
            .iter()
            .find(|(g, _)| *g == global)
            .map(|(_, t)| t.lock().unwrap_or_else(|e| e.into_inner()).lines())
            .unwrap_or_default()
    }

    /// When any rank last wrote output (or the ranks started), as the pumps saw it.
    pub fn activity(&self) -> Arc<Activity> {
        self.activity.clone()
    }

    /// (global, local, pid) of the ranks still running.
    pub fn ranks(&self) -> &[(u32, u32, i32)] {
        &self.running
    }

    /// Sends `sig` to every running rank's process (the rank itself, not its group: a
    /// shell's children keep their own handling, as under torchrun).
    pub fn signal_all(&self, sig: i32) {
        for (_, _, pid) in &self.running {
            // SAFETY: plain syscall on a child we started and have not reaped.
            unsafe { libc::kill(*pid, sig) };
        }
    }

    /// The next rank to end (None when none are left).
    pub async fn next_exit(&mut self) -> Option<RankExit> {
        if self.running.is_empty() {
            return None;
        }
        let e = self.exits.recv().await?;
        self.running.retain(|(g, _, _)| *g != e.global);
        Some(e)
    }

    /// Stops every rank's process group: SIGTERM, up to `grace`, then SIGKILL; then
    /// whatever the ranks left behind (their groups' other members, orphans that left them).
    pub async fn stop(&mut self, grace: Duration) {
        self.stop_ranks(grace).await;
        let n = orphans::sweep(&self.groups, grace).await;
        if n > 0 {
            tracing::info!(
                "stopped {n} {} that the ranks had left running",
                if n == 1 { "process" } else { "processes" }
            );
        }
    }

    async fn stop_ranks(&mut self, grace: Duration) {
        for (_, _, pid) in &self.running {
            // SAFETY: plain syscall on a process group we created; errors (already gone) are fine.
            unsafe { libc::kill(-pid, libc::SIGTERM) };
        }
        let deadline = tokio::time::Instant::now() + grace;
        while !self.running.is_empty() {
            match tokio::time::timeout_at(deadline, self.next_exit()).await {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => {
                    for (_, _, pid) in &self.running {
                        // SAFETY: as above.
                        unsafe { libc::kill(-pid, libc::SIGKILL) };
                    }
                    while tokio::time::timeout(Duration::from_secs(5), self.next_exit())
                        .await
                        .ok()
                        .flatten()
                        .is_some()
                    {}
                    break;
                }
            }
        }
    }
}

fn start(
    cmd: &[String],
    r: &RankSpec,
    out: &RoundOutput,
    tail: Arc<Mutex<Tail>>,
    activity: Arc<Activity>,
    tx: mpsc::Sender<RankExit>,
) -> std::io::Result<i32> {
    let (prog, args) = cmd.split_first().ok_or_else(|| std::io::Error::other("empty command"))?;
    let mut c = tokio::process::Command::new(prog);
    c.args(args)
        .envs(r.env.iter().map(|(k, v)| (k, v)))
        // The token is meshd's alone: a rank (and whatever it runs) never sees it.
        .env_remove("MESHD_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.process_group(0);
    // If meshd dies between the fork and the prctl, the death signal never comes: the
    // child sees another parent then, and gives up instead of running unguarded (a soak
    // run that SIGKILLed meshd as it started its rank found the rank alive 300 ms later).
    let meshd_pid = std::process::id() as libc::pid_t;
    // SAFETY: prctl and getppid are async-signal-safe; nothing else runs between fork and
    // exec.
    unsafe {
        c.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != meshd_pid {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    let mut child = c.spawn()?;
    let pid = child.id().map(|p| p as i32).ok_or_else(|| std::io::Error::other("child has no pid"))?;
    // The rank leads its own process group (process_group(0)): pgid = pid.
    reaper::register(pid);
    let sink = |err: bool| Sink {
        console: out.spec.console(r.local, err),
        file: out
            .dir
            .as_ref()
            .map(|d| d.join(format!("rank{}.{}", r.global, if err { "err" } else { "out" }))),
        tail: err.then(|| tail.clone()),
        activity: activity.clone(),
    };
    let (out_sink, err_sink) = (sink(false), sink(true));
    let out = child.stdout.take().map(|o| tokio::spawn(pump(o, r.global, false, out_sink)));
    let err = child.stderr.take().map(|e| tokio::spawn(pump(e, r.global, true, err_sink)));
    let (global, local) = (r.global, r.local);
    tokio::spawn(async move {
        let status = child.wait().await;
        // Reaped: the group id may be reused once the group empties; stop guarding it.
        reaper::unregister(pid);
        // Let the last lines reach the console before the exit is reported.
        for t in [out, err].into_iter().flatten() {
            let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
        }
        let status = status.unwrap_or_else(|_| std::os::unix::process::ExitStatusExt::from_raw(255 << 8));
        let _ = tx.send(RankExit { global, local, status }).await;
    });
    Ok(pid)
}

/// A process forked from meshd the first time a rank starts, living as long as meshd: it
/// reads process group ids from a socket (`+pgid` registers, `-pgid` unregisters) and, when
/// the socket closes because meshd died however it died (SIGKILL, OOM killer, a crash),
/// SIGKILLs every group still registered, then exits. Its child side uses only
/// async-signal-safe system calls (it is forked from a multi-threaded process) and closes
/// every inherited descriptor so it holds none of meshd's sockets or pipes.
pub mod reaper {
    use std::sync::Mutex;

    enum State {
        Unstarted,
        Running(i32),
        Failed,
    }

    static STATE: Mutex<State> = Mutex::new(State::Unstarted);

    /// Most groups the reaper holds at once (ranks of one node across restarts).
    const MAX_GROUPS: usize = 4096;

    /// Guards process group `pgid`: SIGKILLed if meshd dies while it is registered.
    pub fn register(pgid: i32) {
        send(pgid);
    }

    /// Stops guarding `pgid`.
    pub fn unregister(pgid: i32) {
        send(-pgid);
    }

    fn ensure(st: &mut State) -> Option<i32> {
        if let State::Unstarted = st {
            *st = match start() {
                Some(fd) => State::Running(fd),
                None => {
                    tracing::warn!(
                        "cannot start the rank reaper: processes started by ranks may outlive a killed meshd"
                    );
                    State::Failed
                }
            };
        }
        match st {
            State::Running(fd) => Some(*fd),
            _ => None,
        }
    }

    fn send(v: i32) {
        if v == 0 {
            return;
        }
        let mut st = STATE.lock().unwrap_or_else(|e| e.into_inner());
        let Some(fd) = ensure(&mut st) else { return };
        let b = v.to_le_bytes();
        // SAFETY: a write of 4 bytes from a live buffer to our own socket; MSG_NOSIGNAL
        // turns a dead reaper into EPIPE instead of SIGPIPE.
        let n = unsafe { libc::send(fd, b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL) };
        if n != b.len() as isize {
            // SAFETY: closing our own descriptor once.
            unsafe { libc::close(fd) };
            *st = State::Failed;
        }
    }

    fn start() -> Option<i32> {
        let mut fds = [0i32; 2];
        // SAFETY: socketpair with a valid out-array of two descriptors.
        let r = unsafe {
            libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr())
        };
        if r != 0 {
            return None;
        }
        let (ours, theirs) = (fds[0], fds[1]);
        // SAFETY: the child runs only async-signal-safe system calls, then _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: we are the freshly forked child.
            unsafe { child(theirs) }
        }
        if pid > 0 {
            super::orphans::register_helper(pid);
        }
        // SAFETY: closing descriptors we own.
        unsafe { libc::close(theirs) };
        if pid < 0 {
            // SAFETY: as above.
            unsafe { libc::close(ours) };
            return None;
        }
        Some(ours)
    }

    /// The reaper itself. No allocation, no locks: fork of a multi-threaded process.
    unsafe fn child(fd: i32) -> ! {
        // SAFETY (whole body): async-signal-safe system calls on plain integers and stack
        // buffers only.
        unsafe {
            // Only the end of meshd matters: not Ctrl-C, not a signal to meshd's group.
            for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT, libc::SIGPIPE] {
                libc::signal(s, libc::SIG_IGN);
            }
            libc::setpgid(0, 0);
            // Hold nothing of meshd's (its UDP socket, the ranks' pipes, its stdout): keep the
            // socket as descriptor 3, close every other one.
            let fd = if fd == 3 { fd } else { libc::dup2(fd, 3) };
            if fd != 3 {
                libc::_exit(1);
            }
            for (lo, hi) in [(0u32, 2u32), (4, u32::MAX)] {
                if libc::syscall(libc::SYS_close_range, lo, hi, 0) != 0 {
                    for f in lo..=hi.min(65535) {
                        libc::close(f as i32);
                    }
                }
            }
            let mut groups = [0i32; MAX_GROUPS];
            let mut len = 0usize;
            let mut rec = [0u8; 4];
            let mut have = 0usize;
            loop {
                let n = libc::read(fd, rec.as_mut_ptr().add(have).cast(), 4 - have);
                if n < 0 && *libc::__errno_location() == libc::EINTR {
                    continue;
                }
                if n <= 0 {
                    break;
                }
                have += n as usize;
                if have < 4 {
                    continue;
                }
                have = 0;
                let v = i32::from_le_bytes(rec);
                if v > 0 {
                    if len < MAX_GROUPS {
                        groups[len] = v;
                        len += 1;
                    }
                } else if let Some(i) = groups[..len].iter().position(|g| *g == -v) {
                    groups[i] = groups[len - 1];
                    len -= 1;
                }
            }
            for g in &groups[..len] {
                libc::kill(-*g, libc::SIGKILL);
            }
            libc::_exit(0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirects_tee_and_the_rank_filter_route_like_torchrun() {
        let none = OutputSpec::default();
        assert!(none.console(0, false) && none.console(3, true));
        let r = |s: &str| StdStreams::parse(s).expect(s);
        // --redirects 3: files only; --tee 1 brings stdout back.
        let spec = OutputSpec { redirects: r("3"), tee: r("1"), console_ranks: None };
        assert!(spec.console(0, false) && !spec.console(0, true));
        assert!(spec.redirects_any());
        // Per local rank: 0:2 redirects rank 0's stderr only.
        let spec = OutputSpec { redirects: r("0:2,1:1"), tee: StdStreams::default(), console_ranks: None };
        assert!(spec.console(0, false) && !spec.console(0, true));
        assert!(!spec.console(1, false) && spec.console(1, true));
        assert!(spec.console(2, false) && spec.console(2, true));
        // --local-ranks-filter 0: only local rank 0 on the console.
        let spec = OutputSpec { console_ranks: Some(vec![0]), ..Default::default() };
        assert!(spec.console(0, true) && !spec.console(1, false));
        assert!(StdStreams::parse("4").is_err());
        assert!(StdStreams::parse("0:x").is_err());
        assert!(StdStreams::parse("a:1").is_err());
    }
}
