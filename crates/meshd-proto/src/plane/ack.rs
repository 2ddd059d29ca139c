//! Acknowledgements: what the receiver has seen, when it says so, and the ACK frame.
//!
//! The ACK frame is QUIC's (RFC 9000 §19.3) without ECN counts: the largest number, the
//! delay since it arrived (microseconds), then ranges from the highest down as
//! `first_range`, `(gap, length)*`. The receiver reports at most [`MAX_ACK_RANGES`] ranges,
//! the most recent ones; anything older has been reported many times already, and a packet
//! it forgets is at worst resent once and dropped as a duplicate fragment.
//!
//! When to acknowledge: at once when a packet arrives out of order (so the sender's
//! packet-threshold loss detection runs within one RTT), at once when two ack-eliciting
//! packets are unacknowledged (RFC 9000 §13.2.2's default, which keeps the sender's window
//! and RTT estimate fed), and otherwise after `max_ack_delay`. "At once" means at the next
//! `poll_transmit`: the IO drains a whole receive batch (GRO) before polling, so at line
//! rate one ACK covers a batch rather than every second packet.

use super::PlaneError;
use super::packet::{get_varint, put_varint, varint_len};
use super::ranges::RangeSet;
use std::ops::Range;
use std::time::{Duration, Instant};

/// Ranges one ACK frame reports at most.
pub const MAX_ACK_RANGES: usize = 32;
/// Frame type byte of an ACK frame.
pub const FRAME_ACK: u8 = 0x02;
/// Ack-eliciting packets that trigger an immediate acknowledgement.
const ACK_ELICITING_THRESHOLD: u32 = 2;
/// Largest encoded ACK frame: type, three varints, and two varints per further range.
pub const MAX_ACK_FRAME_LEN: usize = 1 + 8 * 4 + 16 * (MAX_ACK_RANGES - 1);

/// The receiving direction's acknowledgement state.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AckState {
    received: RangeSet,
    largest_at: Option<Instant>,
    unacked_eliciting: u32,
    deadline: Option<Instant>,
    immediate: bool,
}

impl AckState {
    /// Records an accepted packet.
    pub fn on_packet(&mut self, pn: u64, eliciting: bool, now: Instant, max_ack_delay: Duration) {
        let largest = self.received.max();
        let in_order = largest.is_none_or(|l| pn == l + 1);
        if largest.is_none_or(|l| pn > l) {
            self.largest_at = Some(now);
        }
        self.received.insert(pn..pn + 1);
        while self.received.range_count() > MAX_ACK_RANGES {
            self.received.pop_min();
        }
        if !eliciting {
            return;
        }
        self.unacked_eliciting += 1;
        if !in_order || self.unacked_eliciting >= ACK_ELICITING_THRESHOLD {
            self.immediate = true;
        } else if self.deadline.is_none() {
            self.deadline = Some(now + max_ack_delay);
        }
    }

    /// Whether an ACK should go out now.
    pub fn wants_ack(&self, now: Instant) -> bool {
        self.unacked_eliciting > 0 && (self.immediate || self.deadline.is_some_and(|d| d <= now))
    }

    /// Whether anything is waiting to be acknowledged (and so may ride on a data packet).
    pub fn pending(&self) -> bool {
        self.unacked_eliciting > 0
    }

    /// When the delayed ACK is due, if one is waiting.
    pub fn deadline(&self) -> Option<Instant> {
        if self.unacked_eliciting == 0 {
            return None;
        }
        if self.immediate { self.largest_at } else { self.deadline }
    }

    /// Bytes the frame [`write`](Self::write) would produce now.
    pub fn frame_len(&self, now: Instant) -> usize {
        let mut n = 1 + varint_len(self.received.max().unwrap_or(0)) + varint_len(self.delay_us(now));
        n += varint_len(self.received.range_count().saturating_sub(1) as u64);
        let mut prev_start: Option<u64> = None;
        for r in self.received.iter_rev() {
            match prev_start {
                None => n += varint_len(r.end - 1 - r.start),
                Some(ps) => n += varint_len(ps - r.end - 1) + varint_len(r.end - 1 - r.start),
            }
            prev_start = Some(r.start);
        }
        n
    }

    fn delay_us(&self, now: Instant) -> u64 {
        self.largest_at.map_or(0, |t| now.saturating_duration_since(t).as_micros() as u64)
    }

    /// Writes the ACK frame at `out[*pos..]` and marks everything acknowledged. Writes
    /// nothing when nothing has been received.
    pub fn write(&mut self, now: Instant, out: &mut [u8], pos: &mut usize) {
        let Some(largest) = self.received.max() else { return };
        out[*pos] = FRAME_ACK;
        *pos += 1;
        put_varint(out, pos, largest);
        put_varint(out, pos, self.delay_us(now));
        put_varint(out, pos, self.received.range_count() as u64 - 1);
        let mut prev_start: Option<u64> = None;
        for r in self.received.iter_rev() {
            if let Some(ps) = prev_start {
                put_varint(out, pos, ps - r.end - 1);
            }
            put_varint(out, pos, r.end - 1 - r.start);
            prev_start = Some(r.start);
        }
        self.unacked_eliciting = 0;
        self.immediate = false;
        self.deadline = None;
    }
}

/// A parsed, validated ACK frame borrowing its ranges from the packet.
#[derive(Debug, Clone, Copy)]
pub struct AckFrame<'a> {
    /// Largest packet number acknowledged.
    pub largest: u64,
    /// How long the receiver held the largest packet before acknowledging it.
    pub delay: Duration,
    count: u64,
    first: u64,
    rest: &'a [u8],
}

impl<'a> AckFrame<'a> {
    /// Parses an ACK frame (after its type byte) at `buf[*pos..]`, checking that every
    /// range is well formed, advancing `pos`.
    pub fn parse(buf: &'a [u8], pos: &mut usize) -> Result<AckFrame<'a>, PlaneError> {
        let largest = get_varint(buf, pos)?;
        let delay_us = get_varint(buf, pos)?;
        let count = get_varint(buf, pos)?;
        if count as usize >= MAX_ACK_RANGES {
            return Err(PlaneError::Malformed("too many ACK ranges"));
        }
        let first = get_varint(buf, pos)?;
        let start = *pos;
        let mut smallest = largest.checked_sub(first).ok_or(PlaneError::Malformed("ACK range below 0"))?;
        for _ in 0..count {
            let gap = get_varint(buf, pos)?;
            let len = get_varint(buf, pos)?;
            let high = smallest.checked_sub(gap + 2).ok_or(PlaneError::Malformed("ACK gap below 0"))?;
            smallest = high.checked_sub(len).ok_or(PlaneError::Malformed("ACK range below 0"))?;
        }
        Ok(AckFrame {
            largest,
            delay: Duration::from_micros(delay_us),
            count,
            first,
            rest: &buf[start..*pos],
        })
    }

    /// The acknowledged ranges, highest first.
    pub fn ranges(&self) -> impl Iterator<Item = Range<u64>> + 'a {
        let mut pos = 0;
        let rest = self.rest;
        let mut smallest = self.largest - self.first;
        let first = Some(smallest..self.largest + 1);
        // `parse` checked every number, so decoding again cannot fail or underflow.
        let more = (0..self.count).map(move |_| {
            let gap = get_varint(rest, &mut pos).unwrap_or(0);
            let len = get_varint(rest, &mut pos).unwrap_or(0);
            let high = smallest - gap - 2;
            smallest = high - len;
            smallest..high + 1
        });
        first.into_iter().chain(more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trips_the_received_set() {
        let now = Instant::now();
        let mut st = AckState::default();
        let pns = [0u64, 1, 2, 5, 6, 9, 20, 21, 22, 23, 100];
        for &pn in &pns {
            st.on_packet(pn, true, now, Duration::from_millis(1));
        }
        let mut buf = vec![0u8; MAX_ACK_FRAME_LEN];
        let mut pos = 0;
        let len = st.frame_len(now);
        st.write(now, &mut buf, &mut pos);
        assert_eq!(pos, len);
        assert!(!st.pending());
        assert_eq!(buf[0], FRAME_ACK);
        let mut p = 1;
        let f = AckFrame::parse(&buf[..pos], &mut p).expect("parses");
        assert_eq!(p, pos);
        let mut got: Vec<u64> = f.ranges().flat_map(|r| r.rev()).collect();
        got.reverse();
        assert_eq!(got, pns);
    }

    #[test]
    fn acks_once_per_two_packets_or_after_the_delay_or_on_reorder() {
        let t0 = Instant::now();
        let d = Duration::from_millis(1);
        let mut st = AckState::default();
        st.on_packet(0, true, t0, d);
        assert!(!st.wants_ack(t0));
        assert!(st.wants_ack(t0 + d));
        st.on_packet(1, true, t0, d);
        assert!(st.wants_ack(t0));
        st.write(t0, &mut [0u8; 64], &mut 0);
        st.on_packet(3, true, t0, d);
        assert!(st.wants_ack(t0), "a gap is acknowledged at once");
        st.write(t0, &mut [0u8; 64], &mut 0);
        st.on_packet(4, false, t0, d);
        assert!(!st.pending(), "ACK-only packets are not acknowledged");
    }

    #[test]
    fn hostile_frames_are_refused_not_wrapped() {
        let mut buf = [0u8; 32];
        let mut pos = 0;
        put_varint(&mut buf, &mut pos, 3); // largest
        put_varint(&mut buf, &mut pos, 0); // delay
        put_varint(&mut buf, &mut pos, 0); // count
        put_varint(&mut buf, &mut pos, 9); // first range: below 0
        assert!(AckFrame::parse(&buf[..pos], &mut 0).is_err());
        let mut pos = 0;
        put_varint(&mut buf, &mut pos, 3);
        put_varint(&mut buf, &mut pos, 0);
        put_varint(&mut buf, &mut pos, 1);
        put_varint(&mut buf, &mut pos, 1);
        put_varint(&mut buf, &mut pos, 5); // gap below 0
        put_varint(&mut buf, &mut pos, 0);
        assert!(AckFrame::parse(&buf[..pos], &mut 0).is_err());
        assert!(AckFrame::parse(&buf[..2], &mut 0).is_err());
    }
}
