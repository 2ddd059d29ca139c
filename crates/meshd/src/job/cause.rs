//! Why a job failed, said everywhere: each rank's `TORCHELASTIC_ERROR_FILE` (torch's
//! `@record` writes the exception, traceback and time there), the rank's last stderr lines
//! when it wrote none, the root-cause block every meshd prints, and `--log-dir`'s
//! `error.json`.

use meshd_proto::rendezvous::{FailureSource, RankFailure};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Most bytes of a traceback carried and printed (its end is kept: the last frame).
pub const MAX_TRACEBACK: usize = 8 * 1024;
/// Most bytes of an exception message.
pub const MAX_MESSAGE: usize = 2 * 1024;

/// Where a run's per-round files go: `--log-dir`, else a private directory (mode 0700)
/// removed when the run ends, unless redirected output was left in it.
#[derive(Debug)]
pub struct LogDirs {
    base: PathBuf,
    /// The user's `--log-dir` (else the private directory).
    pub user: bool,
    /// Keep the private directory at the end (output redirected into it).
    keep: bool,
}

impl LogDirs {
    /// `--log-dir` if given and usable, else a fresh private directory.
    pub fn new(log_dir: Option<&Path>, keep_private: bool) -> std::io::Result<LogDirs> {
        if let Some(d) = log_dir {
            match std::fs::create_dir_all(d) {
                Ok(()) => return Ok(LogDirs { base: d.to_path_buf(), user: true, keep: true }),
                Err(e) => tracing::warn!(
                    "cannot create --log-dir {}: {e}; logging to the console only, error files in a private \
                     directory",
                    d.display()
                ),
            }
        }
        use std::os::unix::fs::DirBuilderExt;
        let tmp = std::env::temp_dir();
        let mut last = None;
        for _ in 0..8 {
            let name =
                format!("meshd-{}-{:08x}", std::process::id(), crate::random_node_id().as_u128() as u32);
            let p = tmp.join(name);
            match std::fs::DirBuilder::new().mode(0o700).create(&p) {
                Ok(()) => return Ok(LogDirs { base: p, user: false, keep: keep_private }),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("no private directory")))
    }

    /// The run's directory.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// Restart round `restart`'s directory (`attempt_N`), created, with the files of the
    /// given ranks from an earlier run removed (never appended to).
    pub fn round(&self, restart: u32, ranks: &[u32]) -> PathBuf {
        let d = self.base.join(format!("attempt_{restart}"));
        if let Err(e) = std::fs::create_dir_all(&d) {
            tracing::warn!("cannot create {}: {e}", d.display());
        }
        for g in ranks {
            for f in [rank_file(&d, *g, "out"), rank_file(&d, *g, "err"), error_file(&d, *g)] {
                let _ = std::fs::remove_file(f);
            }
        }
        d
    }
}

impl Drop for LogDirs {
    fn drop(&mut self) {
        if !self.user && !self.keep {
            let _ = std::fs::remove_dir_all(&self.base);
        }
    }
}

/// `DIR/rankR.out` or `.err`.
pub fn rank_file(round: &Path, global: u32, ext: &str) -> PathBuf {
    round.join(format!("rank{global}.{ext}"))
}

/// A rank's `TORCHELASTIC_ERROR_FILE`.
pub fn error_file(round: &Path, global: u32) -> PathBuf {
    round.join(format!("rank{global}.error.json"))
}

/// What an error file written by torch's `@record` (or anything writing its format) holds:
/// (message, traceback, unix time). Both of torch's formats: `{"message": {"message",
/// "extraInfo": {"py_callstack", "timestamp"}}}` and `{"message": "..."}`.
pub fn read_error_file(path: &Path) -> Option<(String, String, Option<u64>)> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let m = v.get("message")?;
    if let Some(s) = m.as_str() {
        return Some((s.to_string(), String::new(), None));
    }
    let msg = m.get("message").and_then(|x| x.as_str()).unwrap_or_default().to_string();
    let extra = m.get("extraInfo");
    let tb =
        extra.and_then(|e| e.get("py_callstack")).and_then(|x| x.as_str()).unwrap_or_default().to_string();
    let time = extra
        .and_then(|e| e.get("timestamp"))
        .and_then(|t| t.as_str().and_then(|s| s.trim().parse::<u64>().ok()).or_else(|| t.as_u64()));
    Some((msg, tb, time))
}

/// The end of `s`, at most `max` bytes, on a character boundary, marked when cut.
pub fn keep_end(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut i = s.len() - max;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    let rest = &s[i..];
    // Start at a line.
    let rest = rest.split_once('\n').map_or(rest, |(_, r)| r);
    format!("[... {} bytes cut ...]\n{rest}", s.len() - rest.len())
}

/// meshd's exit status for a rank's: its code, 128 + the signal that killed it.
pub fn exit_status(status: &std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => (c & 0xff).clamp(1, 255) as u8,
        (None, Some(s)) => (128 + s).clamp(1, 255) as u8,
        _ => 1,
    }
}

/// Seconds since the Unix epoch, now.
pub fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// `2026-01-31T12:00:00Z` for a Unix time.
pub fn rfc3339(t: u64) -> String {
    let (days, secs) = ((t / 86400) as i64, t % 86400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs / 60 % 60, secs % 60)
}

/// Fills in the message and traceback of a failed rank: its error file if it wrote one,
/// else its last stderr lines.
pub fn explain(f: &mut RankFailure, error_file: &Path, tail: &[String]) {
    match read_error_file(error_file) {
        Some((msg, tb, time)) => {
            f.message = keep_end(&msg, MAX_MESSAGE);
            f.traceback = keep_end(tb.trim_end(), MAX_TRACEBACK);
            if let Some(t) = time {
                f.time = t;
            }
            f.source = FailureSource::ErrorFile;
        }
        None => {
            if f.message.is_empty() {
                let last = tail.iter().rev().find(|l| !l.trim().is_empty()).cloned().unwrap_or_default();
                f.message = keep_end(last.trim(), MAX_MESSAGE);
            }
            if f.traceback.is_empty() {
                f.traceback = keep_end(&tail.join("\n"), MAX_TRACEBACK);
                f.source = FailureSource::Stderr;
            }
        }
    }
}

/// The root-cause block every meshd prints (several lines, each starting with `meshd: `
/// or two spaces).
/// A round that restarts (`restarting`) does not end meshd: the block then leaves out the
/// exit status line (the restart's own warning says what happens next).
pub fn block(f: &RankFailure, restarting: bool) -> String {
    let mut s = format!(
        "meshd: root cause: rank {} (local rank {}, node rank {}) on {} ({}) {} at {}\n",
        f.rank,
        f.local_rank,
        f.node_rank,
        if f.host.is_empty() { "?" } else { &f.host },
        f.addr,
        f.exit,
        rfc3339(f.time)
    );
    if !f.message.is_empty() {
        s.push_str(&format!("  {}\n", f.message));
    }
    if !f.traceback.is_empty() {
        let what = match f.source {
            FailureSource::ErrorFile => "traceback (the rank's TORCHELASTIC_ERROR_FILE)",
            FailureSource::Stall => "stacks of the stalled ranks (PYTHONFAULTHANDLER, SIGABRT)",
            FailureSource::Stderr | FailureSource::Unknown => "last lines of the rank's stderr",
        };
        s.push_str(&format!("  {what}:\n"));
        for l in f.traceback.lines() {
            s.push_str("    ");
            s.push_str(l);
            s.push('\n');
        }
    }
    if !restarting {
        let whose = if f.source == FailureSource::Stall { "the job stalled" } else { "the failed rank's" };
        s.push_str(&format!("meshd: exit status {} ({whose})\n", f.status));
    }
    s
}

/// `--log-dir`'s `error.json`: torch's error-file shape (`message.message`,
/// `message.extraInfo.py_callstack`, `timestamp`, `errorCode`) plus where the rank ran.
pub fn error_json(f: &RankFailure) -> String {
    let v = serde_json::json!({
        "message": {
            "message": f.message,
            "extraInfo": { "py_callstack": f.traceback, "timestamp": f.time.to_string() },
            "errorCode": f.status,
        },
        "rank": f.rank,
        "local_rank": f.local_rank,
        "node_rank": f.node_rank,
        "host": f.host,
        "addr": f.addr,
        "exit": f.exit,
        "exit_status": f.status,
        "time": rfc3339(f.time),
        "source": f.source.as_str(),
    });
    serde_json::to_string_pretty(&v).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_as_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_767_225_599), "2025-12-31T23:59:59Z");
    }

    #[test]
    fn torch_error_files_of_both_shapes_are_read() {
        let d = std::env::temp_dir().join(format!("meshd-cause-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("dir");
        let p = d.join("e.json");
        std::fs::write(
            &p,
            r#"{"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"x.py\", line 3, in f\nValueError: boom\n", "timestamp": "1700000000"}}}"#,
        )
        .expect("w");
        let mut f = RankFailure { status: 1, ..Default::default() };
        explain(&mut f, &p, &["ignored".into()]);
        assert_eq!(f.message, "ValueError: boom");
        assert!(f.traceback.contains("line 3, in f"));
        assert_eq!((f.time, f.source.as_str()), (1_700_000_000, "error file"));
        std::fs::write(&p, r#"{"message": "RuntimeError: new format"}"#).expect("w");
        assert_eq!(read_error_file(&p).expect("read").0, "RuntimeError: new format");
        // No file: the stderr tail.
        let _ = std::fs::remove_dir_all(&d);
        let mut f = RankFailure::default();
        explain(&mut f, &p, &["a".into(), "KeyError: 'x'".into(), "".into()]);
        assert_eq!((f.message.as_str(), f.source.as_str()), ("KeyError: 'x'", "stderr"));
        let b = block(&f, false);
        assert!(b.contains("last lines of the rank's stderr") && b.contains("    KeyError: 'x'"), "{b}");
        assert!(b.contains("meshd: exit status 0 (the failed rank's)"), "{b}");
        // A round that restarts: the cause, but no exit status (meshd goes on).
        let r = block(&f, true);
        assert!(r.contains("meshd: root cause:") && !r.contains("exit status"), "{r}");
    }

    #[test]
    fn long_tracebacks_keep_their_end() {
        let tb: String = (0..2000).map(|i| format!("line {i}\n")).collect();
        let k = keep_end(&tb, MAX_TRACEBACK);
        assert!(k.len() <= MAX_TRACEBACK + 40, "{}", k.len());
        assert!(k.ends_with("line 1999\n") && k.starts_with("[... "));
    }

    #[test]
    fn exit_status_is_the_code_or_128_plus_the_signal() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(exit_status(&std::process::ExitStatus::from_raw(7 << 8)), 7);
        assert_eq!(exit_status(&std::process::ExitStatus::from_raw(9)), 137);
        assert_eq!(exit_status(&std::process::ExitStatus::from_raw(15)), 143);
    }
}
