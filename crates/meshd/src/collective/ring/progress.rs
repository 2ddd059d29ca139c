//! Progress of an operation: bytes moved, and waits that end when none move.

use super::*;

/// Bytes an operation moved on its links, counted by its reader and writer tasks: any
/// change is progress.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    pub(super) received: AtomicU64,
    pub(super) sent: AtomicU64,
}

impl Progress {
    pub(crate) fn received(&self, n: usize) {
        self.received.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn sent(&self, n: usize) {
        self.sent.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(super) fn total(&self) -> u64 {
        self.received.load(Ordering::Relaxed).wrapping_add(self.sent.load(Ordering::Relaxed))
    }
}

/// Watches a byte count for `timeout` without change. It is looked at every quarter of
/// the timeout, so a stall is found between 1 and 1.25 timeouts after the last byte (the
/// hot path only bumps a counter, never reads the clock).
#[derive(Debug)]
pub(super) struct Watch {
    timeout: Duration,
    seen: u64,
    since: Instant,
}

impl Watch {
    pub(super) fn new(timeout: Duration, count: u64, now: Instant) -> Self {
        Watch { timeout, seen: count, since: now }
    }

    /// How often to [`Watch::stalled`].
    pub(super) fn every(&self) -> Duration {
        (self.timeout / 4).max(Duration::from_millis(1))
    }

    /// Whether `count` has not moved for the timeout as of `now`.
    pub(super) fn stalled(&mut self, count: u64, now: Instant) -> bool {
        if count != self.seen {
            self.seen = count;
            self.since = now;
            return false;
        }
        now.saturating_duration_since(self.since) >= self.timeout
    }
}

/// Runs `fut` while `count` shows progress; `None` once it has not moved for `timeout`.
pub(super) async fn watched<T>(
    fut: impl std::future::Future<Output = T>,
    count: impl Fn() -> u64,
    timeout: Duration,
) -> Option<T> {
    tokio::pin!(fut);
    let mut watch = Watch::new(timeout, count(), Instant::now());
    loop {
        tokio::select! {
            r = &mut fut => return Some(r),
            _ = tokio::time::sleep(watch.every()) => {
                if watch.stalled(count(), Instant::now()) {
                    return None;
                }
            }
        }
    }
}
