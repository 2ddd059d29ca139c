//! CUBIC congestion control (RFC 9438) over bytes, with RFC 9002's recovery period.
//!
//! quinn-proto 0.11's controllers cannot be driven from outside quinn: their `on_ack`
//! takes a `&quinn_proto::RttEstimator`, which only quinn can construct. This is a small
//! CUBIC of the same shape (slow start, a multiplicative decrease of 0.7 once per round
//! trip, the cubic curve with the Reno-friendly region, fast convergence, and the minimum
//! window on persistent congestion), driven by the link's own RTT estimate.

use std::time::{Duration, Instant};

const BETA: f64 = 0.7;
const C: f64 = 0.4;

/// The congestion window of one link.
#[derive(Debug, Clone)]
pub struct Cubic {
    mss: u64,
    window: u64,
    ssthresh: u64,
    recovery_start: Option<Instant>,
    w_max: f64,
    k: f64,
    /// Bytes of growth earned but not yet applied (applied one MSS at a time).
    inc: u64,
}

impl Cubic {
    /// A controller for datagrams of `mss` bytes, starting at RFC 9002's initial window.
    pub fn new(mss: usize) -> Cubic {
        let mss = mss as u64;
        Cubic {
            mss,
            window: (10 * mss).min((2 * mss).max(14_720)),
            ssthresh: u64::MAX,
            recovery_start: None,
            w_max: 0.0,
            k: 0.0,
            inc: 0,
        }
    }

    /// Bytes that may be in flight.
    pub fn window(&self) -> u64 {
        self.window
    }

    /// The slow-start threshold (`u64::MAX` until the first loss).
    pub fn ssthresh(&self) -> u64 {
        self.ssthresh
    }

    fn min_window(&self) -> u64 {
        2 * self.mss
    }

    /// `bytes` sent at `sent` were acknowledged at `now`. `app_limited`: the sender had
    /// nothing more to send, so the window was not what limited it and must not grow.
    pub fn on_ack(&mut self, now: Instant, sent: Instant, bytes: u64, app_limited: bool, rtt: Duration) {
        if app_limited || self.recovery_start.is_some_and(|r| sent <= r) {
            return;
        }
        if self.window < self.ssthresh {
            self.window += bytes;
            return;
        }
        let start = *self.recovery_start.get_or_insert_with(|| {
            // Congestion avoidance without a loss yet (ssthresh was set by a timeout):
            // start the curve here.
            self.w_max = self.window as f64;
            self.k = 0.0;
            now
        });
        let t = now.saturating_duration_since(start);
        let mss = self.mss as f64;
        let w_max = self.w_max / mss;
        let target = (C * ((t + rtt).as_secs_f64() - self.k).powi(3) + w_max) * mss;
        let rtt_s = rtt.as_secs_f64().max(1e-6);
        let reno = (w_max * BETA + 3.0 * (1.0 - BETA) / (1.0 + BETA) * t.as_secs_f64() / rtt_s) * mss;
        let mut next = self.window;
        if target < reno {
            next = next.max(reno as u64);
        } else if (next as f64) < target {
            next = next.saturating_add(((target - next as f64) / next as f64 * mss) as u64);
        }
        self.inc = self.inc.saturating_add(next - self.window);
        // At most one MSS per window acknowledged (RFC 9002 §7.3.3).
        if self.inc >= self.mss {
            self.window += self.mss;
            self.inc = 0;
        }
    }

    /// Packets sent at `sent` were lost (detected at `now`). Only the first loss of a round
    /// trip reduces the window: losses of packets sent before the reduction are part of it.
    pub fn on_congestion_event(&mut self, now: Instant, sent: Instant, persistent: bool) {
        if self.recovery_start.is_some_and(|r| sent <= r) && !persistent {
            return;
        }
        self.recovery_start = Some(now);
        let w = self.window as f64;
        self.w_max = if w < self.w_max { w * (1.0 + BETA) / 2.0 } else { w };
        self.ssthresh = ((w * BETA) as u64).max(self.min_window());
        self.window = self.ssthresh;
        self.k = (self.w_max / self.mss as f64 * (1.0 - BETA) / C).cbrt();
        self.inc = (self.inc as f64 * BETA) as u64;
        if persistent {
            self.recovery_start = None;
            self.w_max = self.window as f64;
            self.inc = 0;
            self.window = self.min_window();
        }
    }
}

/// Spreads a window's worth of sending over a round trip (at 1.25 times window/RTT, so the
/// pacer never is what holds the window back), with a burst allowance of 2 ms of sending,
/// between 10 and 256 datagrams. The idea is quinn-proto's pacer; the code is this one.
#[derive(Debug, Clone)]
pub struct Pacer {
    tokens: u64,
    capacity: u64,
    /// The window and RTT `capacity` was computed for.
    sized_for: (u64, Duration),
    last: Instant,
}

const BURST_INTERVAL: Duration = Duration::from_millis(2);

impl Pacer {
    /// A pacer that starts with a full burst allowance.
    pub fn new(now: Instant, window: u64, rtt: Duration, mss: usize) -> Pacer {
        let capacity = Self::capacity(window, rtt, mss);
        Pacer { tokens: capacity, capacity, sized_for: (window, rtt), last: now }
    }

    fn capacity(window: u64, rtt: Duration, mss: usize) -> u64 {
        let rtt_ns = rtt.as_nanos().max(1);
        let burst = (window as u128 * BURST_INTERVAL.as_nanos() / rtt_ns) as u64;
        burst.clamp(10 * mss as u64, 256 * mss as u64)
    }

    /// Refills for the time since the last call; returns `None` when `bytes` may go now, or
    /// the instant when they may.
    pub fn delay(
        &mut self,
        now: Instant,
        bytes: u64,
        window: u64,
        rtt: Duration,
        mss: usize,
    ) -> Option<Instant> {
        // The capacity changes only with the window or the RTT (a 128-bit division a
        // packet otherwise).
        if (window, rtt) != self.sized_for {
            self.capacity = Self::capacity(window, rtt, mss);
            self.sized_for = (window, rtt);
        }
        let elapsed = now.saturating_duration_since(self.last);
        let rtt_s = rtt.as_secs_f64().max(1e-6);
        // A link plans a whole send batch at one `now`: only its first packet refills.
        if !elapsed.is_zero() {
            self.last = now;
            let earned = window as f64 * 1.25 * elapsed.as_secs_f64() / rtt_s;
            self.tokens = self.tokens.saturating_add(earned as u64).min(self.capacity);
        }
        if self.tokens >= bytes {
            return None;
        }
        let missing = bytes - self.tokens;
        let secs = missing as f64 * rtt_s / (window as f64 * 1.25);
        Some(now + Duration::from_secs_f64(secs.min(1.0)).max(Duration::from_micros(1)))
    }

    /// Spends tokens for a datagram that went out.
    pub fn on_sent(&mut self, bytes: u64) {
        self.tokens = self.tokens.saturating_sub(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_start_then_one_reduction_per_round_trip() {
        let t0 = Instant::now();
        let rtt = Duration::from_millis(10);
        let mut cc = Cubic::new(1452);
        let w0 = cc.window();
        cc.on_ack(t0, t0, 1452, false, rtt);
        assert_eq!(cc.window(), w0 + 1452, "slow start grows by what was acknowledged");
        cc.on_ack(t0, t0, 1452, true, rtt);
        assert_eq!(cc.window(), w0 + 1452, "an application-limited sender does not grow");
        let before = cc.window();
        let t1 = t0 + rtt;
        cc.on_congestion_event(t1, t0, false);
        assert_eq!(cc.window(), (before as f64 * BETA) as u64);
        let after = cc.window();
        cc.on_congestion_event(t1 + rtt / 2, t1 - rtt / 4, false);
        assert_eq!(cc.window(), after, "losses from before the reduction are part of it");
        cc.on_congestion_event(t1 + rtt, t1 + rtt / 2, false);
        assert!(cc.window() < after, "a later loss reduces again");
        cc.on_congestion_event(t1 + 2 * rtt, t1 + rtt, true);
        assert_eq!(cc.window(), 2 * 1452, "persistent congestion: minimum window");
    }

    #[test]
    fn congestion_avoidance_grows_back_toward_w_max() {
        let t0 = Instant::now();
        let rtt = Duration::from_millis(1);
        let mut cc = Cubic::new(1452);
        for _ in 0..100 {
            cc.on_ack(t0, t0, 1452, false, rtt);
        }
        let peak = cc.window();
        cc.on_congestion_event(t0, t0, false);
        let low = cc.window();
        let mut now = t0;
        for _ in 0..20_000 {
            now += Duration::from_micros(10);
            cc.on_ack(now, now, 1452, false, rtt);
        }
        assert!(cc.window() > low, "grows after the loss");
        assert!(cc.window() > peak * 9 / 10, "window {} peak {peak}", cc.window());
    }

    #[test]
    fn pacer_spreads_a_window_over_the_rtt() {
        let t0 = Instant::now();
        let rtt = Duration::from_millis(10);
        let window = 1000 * 1452;
        let mut p = Pacer::new(t0, window, rtt, 1452);
        let mut sent = 0u64;
        let mut now = t0;
        while now < t0 + rtt {
            match p.delay(now, 1452, window, rtt, 1452) {
                None => {
                    p.on_sent(1452);
                    sent += 1452;
                }
                Some(t) => now = t,
            }
        }
        let ratio = sent as f64 / window as f64;
        assert!((1.2..1.6).contains(&ratio), "sent {ratio} windows in one RTT");
    }
}
