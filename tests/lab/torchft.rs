//! tests/python/torchft_train.py in the lab, for tests/lab_torchft.rs and benches/torchft.rs:
//! its command and the log directory it writes to (`FT_LOG`): one JSON line per step and
//! process (`*.jsonl`), each process's own output (`*.out`).

use super::Lab;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The rank command: the script under `python`, its output to a file per process (a
/// rank's heavy logging must not fill the test's pipes).
pub fn rank_command(python: &str) -> String {
    let script = format!("{}/tests/python/torchft_train.py", env!("CARGO_MANIFEST_DIR"));
    format!("exec {python} -u {script} >> \"$FT_LOG/g$REPLICA_GROUP_ID.r$RANK.$$.out\" 2>&1")
}

/// The identical command of every host: `meshd run --fault-tolerance node` of `nnodes`,
/// 2 ranks per host, `--grace 1s --max-restarts 2`, then `extra`, running [`rank_command`].
pub fn ft_args(lab: &Lab, python: &str, nnodes: &str, extra: &[&str]) -> Vec<String> {
    lab.meshd_run()
        .nnodes(nnodes)
        .flags(&[
            "--fault-tolerance",
            "node",
            "--nproc-per-node",
            "2",
            "--grace",
            "1s",
            "--max-restarts",
            "2",
        ])
        .flags(extra)
        .cmd(&["sh", "-c", &rank_command(python)])
}

/// One JSON line of the script.
#[derive(Clone, Debug)]
pub struct Line {
    pub group: u64,
    pub rank: u64,
    pub pid: u64,
    pub t: f64,
    pub step: i64,
    pub committed: bool,
    pub participants: i64,
    pub final_digest: Option<String>,
}

/// The scripts' shared log directory, removed on drop (kept with `MESHD_LAB_KEEP`).
pub struct Logs(PathBuf);

impl Logs {
    /// A fresh, empty `PREFIX-NAME-PID` under the temp dir.
    pub fn new(prefix: &str, name: &str) -> Logs {
        let d = std::env::temp_dir().join(format!("{prefix}-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("log dir");
        Logs(d)
    }

    pub fn dir(&self) -> String {
        self.0.display().to_string()
    }

    pub fn path(&self) -> &std::path::Path {
        &self.0
    }

    /// Every process's lines so far, in time order.
    pub fn lines(&self) -> Vec<Line> {
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

    /// The last `tail` lines of every process's output (`*.out`, by name), for failure
    /// messages.
    pub fn outputs(&self, tail: usize) -> String {
        let mut s = String::new();
        let mut names: Vec<PathBuf> = std::fs::read_dir(&self.0)
            .expect("log dir")
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "out"))
            .collect();
        names.sort();
        for p in names {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let last: Vec<&str> = text.lines().rev().take(tail).collect();
            s.push_str(&format!("---- {}\n", p.file_name().unwrap_or_default().to_string_lossy()));
            for l in last.into_iter().rev() {
                s.push_str(l);
                s.push('\n');
            }
        }
        s
    }
}

impl Drop for Logs {
    fn drop(&mut self) {
        if std::env::var_os("MESHD_LAB_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        } else {
            eprintln!("logs kept in {}", self.0.display());
        }
    }
}

/// Seconds since the epoch, as the script's `t`.
pub fn now_secs() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Waits until `pred` holds for the lines (at most `limit`).
pub fn wait_lines(logs: &Logs, limit: Duration, pred: impl Fn(&[Line]) -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if pred(&logs.lines()) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    pred(&logs.lines())
}
