//! When each launch phase of a round began and ended, and meshd's own CPU time: the
//! launch line that says which phase is slow.

use super::*;

/// When each launch phase of a round began and ended on this node.
pub(super) struct Phases {
    /// Round 0 only: when the mesh started and when it had its interface and port.
    pub(super) mesh: Option<(Instant, Instant)>,
    pub(super) round_began: Instant,
    pub(super) roster_at: Instant,
    pub(super) preflight_began: Instant,
    pub(super) spawn_began: Instant,
    pub(super) spawned_at: Instant,
}

impl Phases {
    /// "started 2 ranks 0.14 s after meshd started: interface 0.002 s, join and roster
    /// 0.120 s, preflight 0.010 s, spawn 0.003 s; meshd CPU 0.031 s": which phase is slow.
    pub(super) fn line(&self, ranks: usize, restart: u32) -> String {
        let s = |a: Instant, b: Instant| format!("{:.3} s", b.saturating_duration_since(a).as_secs_f64());
        let mut parts = Vec::new();
        let (from, what) = match self.mesh {
            Some((started, bound)) => {
                parts.push(format!("interface {}", s(started, bound)));
                parts.push(format!("join and roster {}", s(bound, self.roster_at)));
                (started, "meshd started".to_string())
            }
            None => {
                parts.push(format!("roster {}", s(self.round_began, self.roster_at)));
                (self.round_began, format!("restart round {restart} began"))
            }
        };
        parts.push(format!("preflight {}", s(self.preflight_began, self.spawn_began)));
        parts.push(format!("spawn {}", s(self.spawn_began, self.spawned_at)));
        format!(
            "started {} {} after {what}: {}; meshd CPU {:.3} s",
            crate::plural(ranks as u64, "rank"),
            s(from, self.spawned_at),
            parts.join(", "),
            cpu_seconds()
        )
    }
}

/// CPU time (user + system) of this process, in seconds, as the kernel counts it.
pub(super) fn process_cpu() -> f64 {
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is always valid.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// The process's CPU time when meshd started (see [`mark_cpu_start`]), in microseconds.
pub(super) static CPU_AT_START_US: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Records the CPU time already spent when meshd starts. A process keeps its CPU counts
/// across `exec`, so whatever ran before in the same process (`cargo run` builds, then execs
/// meshd; `ip netns exec` execs it) would otherwise count as meshd's. Call first in `main`.
pub fn mark_cpu_start() {
    CPU_AT_START_US.store((process_cpu() * 1e6) as u64, std::sync::atomic::Ordering::Relaxed);
}

/// CPU time (user + system) meshd used since [`mark_cpu_start`].
pub(super) fn cpu_seconds() -> f64 {
    let start = CPU_AT_START_US.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e6;
    (process_cpu() - start).max(0.0)
}
