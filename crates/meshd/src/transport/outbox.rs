//! The frames waiting to go to one peer, and when to try again after a failure.
//!
//! Reliable frames (rendezvous, Abort, Done, store, membership syncs) are kept in order
//! until a stream carried them, however long the peer takes to become reachable, up to a
//! horizon and a bound in frames and bytes; a frame given up on is counted and reported by
//! the caller, never dropped in silence. Datagrams (probes, gossip that may be lost) have a
//! small queue of their own whose oldest entry makes room for the newest, so a burst of
//! gossip never takes the room reliable frames need, and reliable frames never delay a
//! probe: the sender empties the datagram queue first.

use bytes::Bytes;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Reliable frames kept per peer.
pub const MAX_QUEUED_FRAMES: usize = 4096;
/// Bytes of reliable frames kept per peer (a store value may be 4 MiB).
pub const MAX_QUEUED_BYTES: usize = 64 << 20;
/// Datagrams kept per peer; past it the oldest is dropped (datagrams may be lost anyway).
pub const MAX_QUEUED_DATAGRAMS: usize = 256;

/// First wait after a failed connect or send.
pub const BACKOFF_FIRST: Duration = Duration::from_millis(50);
/// Longest wait between two attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// A reliable frame refused because the peer's queue is full (the caller reports it).
#[derive(Debug, PartialEq, Eq)]
pub struct Full {
    /// Frames queued for the peer.
    pub frames: usize,
    /// Their bytes.
    pub bytes: usize,
}

/// One peer's waiting frames.
#[derive(Debug, Default)]
pub struct Outbox {
    reliable: VecDeque<(Bytes, Instant)>,
    bytes: usize,
    datagrams: VecDeque<Bytes>,
}

impl Outbox {
    /// Queues a reliable frame at `now`, or refuses it when the queue is full.
    pub fn push_reliable(&mut self, frame: Bytes, now: Instant) -> Result<(), Full> {
        if self.reliable.len() >= MAX_QUEUED_FRAMES || self.bytes + frame.len() > MAX_QUEUED_BYTES {
            return Err(Full { frames: self.reliable.len(), bytes: self.bytes });
        }
        self.bytes += frame.len();
        self.reliable.push_back((frame, now));
        Ok(())
    }

    /// Queues a datagram; returns whether an older one was dropped to make room.
    pub fn push_datagram(&mut self, frame: Bytes) -> bool {
        let dropped = self.datagrams.len() >= MAX_QUEUED_DATAGRAMS;
        if dropped {
            self.datagrams.pop_front();
        }
        self.datagrams.push_back(frame);
        dropped
    }

    /// The oldest reliable frame, still queued (removed by [`Outbox::sent`] once delivered).
    pub fn front(&self) -> Option<Bytes> {
        self.reliable.front().map(|(b, _)| b.clone())
    }

    /// Removes the oldest reliable frame: a stream carried it.
    pub fn sent(&mut self) {
        if let Some((b, _)) = self.reliable.pop_front() {
            self.bytes -= b.len();
        }
    }

    /// Takes every queued datagram, oldest first.
    pub fn take_datagrams(&mut self) -> Vec<Bytes> {
        self.datagrams.drain(..).collect()
    }

    /// Drops the queued datagrams (the peer is unreachable: they would be stale when it is
    /// back); returns how many.
    pub fn drop_datagrams(&mut self) -> usize {
        let n = self.datagrams.len();
        self.datagrams.clear();
        n
    }

    /// Gives up on reliable frames queued `horizon` or longer before `now`; returns how many.
    pub fn expire(&mut self, now: Instant, horizon: Duration) -> usize {
        let mut n = 0;
        while self.reliable.front().is_some_and(|(_, at)| now.saturating_duration_since(*at) >= horizon) {
            self.sent();
            n += 1;
        }
        n
    }

    /// When the oldest reliable frame reaches `horizon`, if any is queued.
    pub fn next_expiry(&self, horizon: Duration) -> Option<Instant> {
        self.reliable.front().map(|(_, at)| *at + horizon)
    }

    /// Empties the queue; returns how many reliable frames it held.
    pub fn clear(&mut self) -> usize {
        let n = self.reliable.len();
        self.reliable.clear();
        self.datagrams.clear();
        self.bytes = 0;
        n
    }

    /// Reliable frames queued.
    pub fn reliable_len(&self) -> usize {
        self.reliable.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.reliable.is_empty() && self.datagrams.is_empty()
    }
}

/// Exponential backoff between attempts to reach a peer: [`BACKOFF_FIRST`], doubling up
/// to [`BACKOFF_MAX`], back to the start after a success.
#[derive(Debug, Default)]
pub struct Backoff {
    failures: u32,
}

impl Backoff {
    /// An attempt failed: how long to wait before the next.
    pub fn failed(&mut self) -> Duration {
        let wait = BACKOFF_FIRST.saturating_mul(1 << self.failures.min(16)).min(BACKOFF_MAX);
        self.failures = self.failures.saturating_add(1);
        wait
    }

    /// An attempt succeeded.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(n: usize, tag: u8) -> Bytes {
        Bytes::from(vec![tag; n])
    }

    #[test]
    fn reliable_frames_stay_in_order_until_sent() {
        let mut o = Outbox::default();
        let t = Instant::now();
        for i in 0..3 {
            o.push_reliable(frame(10, i), t).expect("room");
        }
        assert_eq!(o.front(), Some(frame(10, 0)));
        // A failed attempt leaves the frame first in line.
        assert_eq!(o.front(), Some(frame(10, 0)));
        o.sent();
        assert_eq!(o.front(), Some(frame(10, 1)));
        o.sent();
        o.sent();
        assert!(o.front().is_none() && o.is_empty());
        assert_eq!(o.bytes, 0);
    }

    #[test]
    fn a_full_queue_refuses_and_says_how_full() {
        let mut o = Outbox::default();
        let t = Instant::now();
        for _ in 0..MAX_QUEUED_FRAMES {
            o.push_reliable(frame(1, 0), t).expect("room");
        }
        assert_eq!(
            o.push_reliable(frame(1, 0), t),
            Err(Full { frames: MAX_QUEUED_FRAMES, bytes: MAX_QUEUED_FRAMES })
        );
        let mut o = Outbox::default();
        o.push_reliable(frame(MAX_QUEUED_BYTES - 10, 0), t).expect("room");
        assert!(o.push_reliable(frame(11, 0), t).is_err(), "bounded in bytes too");
        o.push_reliable(frame(10, 0), t).expect("exactly full fits");
    }

    #[test]
    fn datagrams_drop_their_oldest_and_never_take_reliable_room() {
        let mut o = Outbox::default();
        let t = Instant::now();
        for i in 0..MAX_QUEUED_DATAGRAMS {
            assert!(!o.push_datagram(frame(1, i as u8)));
        }
        assert!(o.push_datagram(frame(1, 0xff)), "the oldest made room");
        o.push_reliable(frame(1, 7), t).expect("reliable room is its own");
        let d = o.take_datagrams();
        assert_eq!(d.len(), MAX_QUEUED_DATAGRAMS);
        assert_eq!(d[0], frame(1, 1));
        assert_eq!(d[MAX_QUEUED_DATAGRAMS - 1], frame(1, 0xff));
        assert_eq!(o.reliable_len(), 1);
    }

    #[test]
    fn frames_expire_at_the_horizon_oldest_first() {
        let mut o = Outbox::default();
        let t0 = Instant::now();
        let h = Duration::from_secs(30);
        o.push_reliable(frame(1, 0), t0).expect("room");
        o.push_reliable(frame(1, 1), t0 + Duration::from_secs(10)).expect("room");
        assert_eq!(o.next_expiry(h), Some(t0 + h));
        assert_eq!(o.expire(t0 + Duration::from_secs(29), h), 0);
        assert_eq!(o.expire(t0 + h, h), 1);
        assert_eq!(o.front(), Some(frame(1, 1)));
        assert_eq!(o.expire(t0 + Duration::from_secs(100), h), 1);
        assert!(o.is_empty() && o.next_expiry(h).is_none());
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_resets() {
        let mut b = Backoff::default();
        assert_eq!(b.failed(), BACKOFF_FIRST);
        assert_eq!(b.failed(), BACKOFF_FIRST * 2);
        assert_eq!(b.failed(), BACKOFF_FIRST * 4);
        for _ in 0..40 {
            assert!(b.failed() <= BACKOFF_MAX);
        }
        assert_eq!(b.failed(), BACKOFF_MAX);
        b.reset();
        assert_eq!(b.failed(), BACKOFF_FIRST);
    }
}
