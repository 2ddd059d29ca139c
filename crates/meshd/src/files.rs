//! Open files: the process's limit (raised to the hard limit at start), how many are open,
//! and accept loops that wait out EMFILE and its kin instead of ending.
//!
//! A job in tunnel mode holds one open file per tunnelled connection at each end (Gloo with
//! 8 ranks on 17 nodes: about 1024 per node), and the usual soft limit is 1024. meshd raises
//! its soft limit to the hard one at start ([`raise_limit`]); the ranks inherit it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tracing::warn;

/// RLIMIT_NOFILE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    /// The soft limit (what the process may open).
    pub soft: usize,
    /// The hard limit (how far the soft one may be raised).
    pub hard: usize,
}

fn clamp(v: libc::rlim_t) -> usize {
    if v == libc::RLIM_INFINITY { usize::MAX } else { usize::try_from(v).unwrap_or(usize::MAX) }
}

/// The open-files limit now.
pub fn limit() -> Limit {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit fills the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return Limit { soft: 1024, hard: 1024 };
    }
    Limit { soft: clamp(r.rlim_cur), hard: clamp(r.rlim_max) }
}

/// Raises the soft open-files limit to the hard one (no privilege needed); returns the
/// limit in force afterwards. The kernel caps an "unlimited" hard limit at `nr_open`.
pub fn raise_limit() -> Limit {
    let before = limit();
    if before.soft < before.hard {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit/setrlimit on a struct of the right type.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 {
                r.rlim_cur = r.rlim_max;
                if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                    // An unlimited hard limit above fs.nr_open: take nr_open.
                    if let Some(n) = std::fs::read_to_string("/proc/sys/fs/nr_open")
                        .ok()
                        .and_then(|s| s.trim().parse::<libc::rlim_t>().ok())
                    {
                        r.rlim_cur = n.min(r.rlim_max);
                        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
                    }
                }
            }
        }
    }
    limit()
}

/// Files this process has open now.
pub fn open_now() -> Option<usize> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count())
}

/// Says once per process that it ran out of open files, with what to do.
pub fn warn_once_out_of_files(what: &str) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        let l = limit();
        warn!(
            "{what}; the open-files limit is {} (hard {}): raise it (ulimit -n, LimitNOFILE=, \
             docker --ulimit nofile=) for jobs with many connections (said once)",
            l.soft, l.hard
        );
    }
}

/// Accept errors of one listener: a warning at the first of a run of them, and a wait that
/// doubles from 10 ms to 1 s, so a process out of open files neither spins nor stops
/// accepting for good.
#[derive(Debug)]
pub struct AcceptErrors {
    what: &'static str,
    backoff: Duration,
    warned: bool,
}

impl AcceptErrors {
    /// For the listener `what` names ("the local service's socket").
    pub fn new(what: &'static str) -> AcceptErrors {
        AcceptErrors { what, backoff: Duration::ZERO, warned: false }
    }

    /// An accept succeeded: the next error starts a new run.
    pub fn ok(&mut self) {
        if self.warned {
            warn!("{}: accepting again", self.what);
        }
        self.backoff = Duration::ZERO;
        self.warned = false;
    }

    /// An accept failed with `e`: how long to wait before the next.
    pub fn failed(&mut self, e: &std::io::Error) -> Duration {
        self.backoff = (self.backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
        if !self.warned {
            self.warned = true;
            let files = matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE));
            let l = limit();
            if files {
                warn!(
                    "{}: cannot accept: {e} (open-files limit {}, hard {}); retrying until files are free",
                    self.what, l.soft, l.hard
                );
            } else {
                warn!("{}: cannot accept: {e}; retrying", self.what);
            }
        }
        self.backoff
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_errors_back_off_and_start_over_after_a_success() {
        let mut a = AcceptErrors::new("test");
        let e = std::io::Error::from_raw_os_error(libc::EMFILE);
        let waits: Vec<Duration> = (0..10).map(|_| a.failed(&e)).collect();
        assert_eq!(waits[0], Duration::from_millis(10));
        assert_eq!(waits[1], Duration::from_millis(20));
        assert_eq!(*waits.last().expect("waits"), Duration::from_secs(1));
        a.ok();
        assert_eq!(a.failed(&e), Duration::from_millis(10));
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let l = raise_limit();
        assert!(l.soft == l.hard || l.hard == usize::MAX, "{l:?}");
        assert!(open_now().is_some_and(|n| n >= 3));
    }
}
