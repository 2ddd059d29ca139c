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
    /// Of `bytes_out`, those sent on the data plane (the rest went on QUIC streams).
    pub plane_out: AtomicU64,
    /// Of `bytes_in`, those that came on the data plane.
    pub plane_in: AtomicU64,
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

    /// One line: connections and bytes, and how much of them the data plane carried (a
    /// tunnel whose bytes went on QUIC streams is slower: the plane was off or its
    /// datagrams did not get through, see the `data plane` lines).
    pub fn line(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mib = |n: u64| n as f64 / (1 << 20) as f64;
        let (out, inn) = (g(&self.bytes_out), g(&self.bytes_in));
        let (plane_out, plane_in) = (g(&self.plane_out), g(&self.plane_in));
        let path = if out + inn == 0 {
            String::new()
        } else if plane_out == out && plane_in == inn {
            " (all on the data plane)".to_string()
        } else if plane_out + plane_in == 0 {
            " (all on QUIC streams, none on the data plane)".to_string()
        } else {
            format!(
                " ({:.1} MiB sent and {:.1} MiB received on the data plane, the rest on QUIC streams)",
                mib(plane_out),
                mib(plane_in)
            )
        };
        format!(
            "{} opened by this node's ranks ({} failed), {} served for other nodes ({} refused), {} open; {:.1} MiB sent, {:.1} MiB received{path}",
            crate::plural(g(&self.opened), "tunnelled connection"),
            g(&self.failed),
            g(&self.served),
            g(&self.refused),
            g(&self.active),
            mib(out),
            mib(inn),
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
