//! Process supervision: one child per local rank, each in its own process group, its
//! console lines prefixed with its global rank, stopped as a group (SIGTERM, grace,
//! SIGKILL). Children also get PR_SET_PDEATHSIG so a meshd killed with SIGKILL does not
//! leave ranks running.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
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
    exits: mpsc::Receiver<RankExit>,
}

impl Supervisor {
    /// Starts every rank. On a failure, the ranks already started are stopped.
    pub async fn spawn(
        cmd: &[String],
        ranks: &[RankSpec],
        log_dir: Option<&Path>,
    ) -> Result<Supervisor, SpawnError> {
        let (tx, rx) = mpsc::channel(ranks.len().max(1));
        let mut sup = Supervisor { running: Vec::new(), exits: rx };
        for r in ranks {
            match start(cmd, r, log_dir, tx.clone()) {
                Ok(pid) => sup.running.push((r.global, r.local, pid)),
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

    /// The next rank to end (None when none are left).
    pub async fn next_exit(&mut self) -> Option<RankExit> {
        if self.running.is_empty() {
            return None;
        }
        let e = self.exits.recv().await?;
        self.running.retain(|(g, _, _)| *g != e.global);
        Some(e)
    }

    /// Stops every rank's process group: SIGTERM, up to `grace`, then SIGKILL.
    pub async fn stop(&mut self, grace: Duration) {
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
    log_dir: Option<&Path>,
    tx: mpsc::Sender<RankExit>,
) -> std::io::Result<i32> {
    let (prog, args) = cmd.split_first().ok_or_else(|| std::io::Error::other("empty command"))?;
    let mut c = tokio::process::Command::new(prog);
    c.args(args)
        .envs(r.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.process_group(0);
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        c.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = c.spawn()?;
    let pid = child.id().map(|p| p as i32).ok_or_else(|| std::io::Error::other("child has no pid"))?;
    let files =
        log_dir.map(|d| (d.join(format!("rank{}.out", r.global)), d.join(format!("rank{}.err", r.global))));
    let out = child
        .stdout
        .take()
        .map(|o| tokio::spawn(pump(o, r.global, false, files.as_ref().map(|f| f.0.clone()))));
    let err = child
        .stderr
        .take()
        .map(|e| tokio::spawn(pump(e, r.global, true, files.as_ref().map(|f| f.1.clone()))));
    let (global, local) = (r.global, r.local);
    tokio::spawn(async move {
        let status = child.wait().await;
        // Let the last lines reach the console before the exit is reported.
        for t in [out, err].into_iter().flatten() {
            let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
        }
        let status = status.unwrap_or_else(|_| std::os::unix::process::ExitStatusExt::from_raw(255 << 8));
        let _ = tx.send(RankExit { global, local, status }).await;
    });
    Ok(pid)
}

async fn pump(src: impl AsyncRead + Unpin, rank: u32, is_err: bool, file: Option<PathBuf>) {
    use std::io::Write;
    let mut file = file.and_then(|p| std::fs::OpenOptions::new().create(true).append(true).open(p).ok());
    let mut reader = BufReader::new(src);
    let mut line = Vec::with_capacity(256);
    let prefix = format!("[rank {rank}] ");
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if !line.ends_with(b"\n") {
            line.push(b'\n');
        }
        if let Some(f) = file.as_mut() {
            let _ = f.write_all(&line);
        }
        let mut buf = Vec::with_capacity(prefix.len() + line.len());
        buf.extend_from_slice(prefix.as_bytes());
        buf.extend_from_slice(&line);
        let _ = if is_err {
            std::io::stderr().lock().write_all(&buf)
        } else {
            std::io::stdout().lock().write_all(&buf)
        };
    }
}
