//! Round-trip time estimation (RFC 9002 §5).

use std::time::Duration;

/// Timer granularity assumed for loss and probe timers (RFC 9002 §6.1.2).
pub const GRANULARITY: Duration = Duration::from_millis(1);

/// Smoothed RTT, its variation and the minimum, from acknowledgement samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rtt {
    latest: Duration,
    smoothed: Option<Duration>,
    var: Duration,
    min: Duration,
}

impl Rtt {
    /// An estimator that assumes `initial` until the first sample.
    pub fn new(initial: Duration) -> Rtt {
        Rtt { latest: initial, smoothed: None, var: initial / 2, min: initial }
    }

    /// Adds a sample: `rtt` measured from send to acknowledgement, of which the peer says it
    /// held the packet for `ack_delay` (already capped at the agreed maximum).
    pub fn update(&mut self, rtt: Duration, ack_delay: Duration) {
        self.latest = rtt;
        let Some(smoothed) = self.smoothed else {
            self.smoothed = Some(rtt);
            self.var = rtt / 2;
            self.min = rtt;
            return;
        };
        self.min = self.min.min(rtt);
        let adjusted = if rtt >= self.min + ack_delay { rtt - ack_delay } else { rtt };
        self.var = (3 * self.var + smoothed.abs_diff(adjusted)) / 4;
        self.smoothed = Some((7 * smoothed + adjusted) / 8);
    }

    /// The smoothed RTT (the initial guess before any sample).
    pub fn get(&self) -> Duration {
        self.smoothed.unwrap_or(self.latest)
    }

    /// The latest sample.
    pub fn latest(&self) -> Duration {
        self.latest
    }

    /// The smallest sample.
    pub fn min(&self) -> Duration {
        self.min
    }

    /// Whether any sample has arrived.
    pub fn has_sample(&self) -> bool {
        self.smoothed.is_some()
    }

    /// The probe timeout before backoff, without the peer's ack delay (RFC 9002 §6.2.1).
    pub fn pto_base(&self) -> Duration {
        self.get() + (4 * self.var).max(GRANULARITY)
    }

    /// How long after a later packet was acknowledged an earlier one counts as lost: 9/8 of
    /// the larger of the smoothed and latest RTT, at least the granularity (RFC 9002 §6.1.2).
    pub fn loss_delay(&self) -> Duration {
        (self.get().max(self.latest) * 9 / 8).max(GRANULARITY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converges_and_discounts_ack_delay() {
        let mut r = Rtt::new(Duration::from_millis(100));
        assert!(!r.has_sample());
        r.update(Duration::from_millis(10), Duration::ZERO);
        assert_eq!(r.get(), Duration::from_millis(10));
        for _ in 0..50 {
            r.update(Duration::from_millis(12), Duration::from_millis(2));
        }
        let ms = r.get().as_secs_f64() * 1e3;
        assert!((ms - 10.0).abs() < 0.1, "smoothed {ms} ms");
        assert_eq!(r.min(), Duration::from_millis(10));
        assert!(r.loss_delay() >= Duration::from_micros(13_400));
    }
}
