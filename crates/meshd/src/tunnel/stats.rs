//! The tunnel's counters: `meshd status`, the end-of-job line, the end-of-round report.

use std::sync::atomic::{AtomicU64, Ordering};
use tracing::info;

/// Counters of one node's tunnel (both ends), for the end-of-job line and `meshd status`.
#[derive(Debug, Default)]
pub struct TunnelStats {
    /// Connections this node's ranks opened through the tunnel (established).
    pub opened: AtomicU64,
    /// Connections of this node's ranks that failed (refused, unreachable, timed out).
    pub failed: AtomicU64,
    /// Connections peers' ranks opened to this node through their tunnels (established).
    pub served: AtomicU64,
    /// Peers' tunnel streams this node refused (not a member, not the job's port, a cap).
    pub refused: AtomicU64,
    /// Tunnelled connections open now (both ends).
    pub active: AtomicU64,
    /// Bytes sent into the tunnel (to other nodes).
    pub bytes_out: AtomicU64,
    /// Bytes received from the tunnel (from other nodes).
    pub bytes_in: AtomicU64,
}

impl TunnelStats {
    /// The counters as `meshd status` gets them.
    pub fn reply(&self) -> meshd_proto::wire::TunnelReply {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        meshd_proto::wire::TunnelReply {
            opened: g(&self.opened),
            failed: g(&self.failed),
            served: g(&self.served),
            active: g(&self.active),
            bytes_out: g(&self.bytes_out),
            bytes_in: g(&self.bytes_in),
        }
    }

    /// One line: connections and bytes.
    pub fn line(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "{} opened by this node's ranks ({} failed), {} served for other nodes ({} refused), {} open; {:.1} MiB sent, {:.1} MiB received",
            crate::plural(g(&self.opened), "tunnelled connection"),
            g(&self.failed),
            g(&self.served),
            g(&self.refused),
            g(&self.active),
            g(&self.bytes_out) as f64 / (1 << 20) as f64,
            g(&self.bytes_in) as f64 / (1 << 20) as f64,
        )
    }
}

/// Logs the counters once a round ends, with the CPU meshd and its finished ranks used so
/// far (what a tunnelled byte costs: compare runs by CPU per MiB, not only by time).
pub fn report(stats: &TunnelStats) {
    let cpu = |who: i32| {
        // SAFETY: getrusage fills the struct it is given; both `who`s are valid.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::getrusage(who, &mut u) } != 0 {
            return 0.0;
        }
        let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
        t(u.ru_utime) + t(u.ru_stime)
    };
    info!(
        "tunnel: {}; CPU so far: meshd {:.2} s, finished ranks {:.2} s",
        stats.line(),
        cpu(libc::RUSAGE_SELF),
        cpu(libc::RUSAGE_CHILDREN)
    );
}
