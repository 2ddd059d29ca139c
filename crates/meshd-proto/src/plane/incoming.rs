//! The receiver's record of messages: which byte ranges of which message arrived, so that a
//! resent fragment is recognised and handed to the application exactly once.
//!
//! The receiver keeps no payload: each fragment goes to the application straight from the
//! datagram it arrived in. What it keeps per open message is a few ranges, and the set of
//! finished message numbers. Both are bounded whatever the peer sends: at most `max_open`
//! messages partly received, a new message's number less than [`SEQ_WINDOW`] above the
//! lowest unfinished one (so the finished set holds at most that many ranges), and every
//! fragment but a message's last at least [`MIN_FRAGMENT`] bytes (so a message's pieces
//! cannot be made small and many).

use super::PlaneError;
use super::frame::DataHeader;
use super::ranges::RangeSet;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The hasher of open messages' numbers (here and in the plane driver's reassembly). SipHash (the std default) cost two hashes a
/// datagram, 2% of a link's CPU. These keys are message numbers from a datagram that
/// already opened under the link's key (no stranger picks them), kept within
/// [`SEQ_WINDOW`] of the lowest unfinished one and at most `max_open` at a time, so a
/// multiply-and-fold mix is enough: even a peer that chose colliding numbers on purpose
/// would only slow its own link, by at most `max_open` comparisons a lookup.
#[derive(Debug, Default)]
pub struct SeqHasher(u64);

impl Hasher for SeqHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn write_u64(&mut self, n: u64) {
        let x = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = x ^ (x >> 32);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by message numbers of datagrams that opened under a link's key.
pub type SeqMap<V> = HashMap<u64, V, BuildHasherDefault<SeqHasher>>;

/// How far above the lowest unfinished message number a new message may start.
pub const SEQ_WINDOW: u64 = 4096;
/// Fewest bytes a fragment that does not end its message carries. The plane's own sender
/// cuts fragments of a datagram's size less the headers: at least 1136 bytes, since a link's
/// datagrams are at least [`MIN_DATAGRAM`](super::link::MIN_DATAGRAM) bytes.
pub const MIN_FRAGMENT: u64 = 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
struct InMsg {
    tag: u64,
    total_len: u64,
    got: RangeSet,
    got_bytes: u64,
}

/// What a DATA fragment is to the receiver, decided before anything changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The first bytes of a message this end has not seen before.
    Opens,
    /// New bytes of a message already partly received.
    Continues,
    /// A copy of bytes already delivered.
    Duplicate,
}

/// The receiving direction's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incoming {
    open: SeqMap<InMsg>,
    done: RangeSet,
    max_open: usize,
    max_len: u64,
}

impl Incoming {
    /// At most `max_open` messages partly received at once, each at most `max_len` bytes.
    pub fn new(max_open: usize, max_len: u64) -> Incoming {
        Incoming { open: SeqMap::default(), done: RangeSet::default(), max_open, max_len }
    }

    /// Messages partly received.
    pub fn open_messages(&self) -> usize {
        self.open.len()
    }

    /// The lowest message number not finished yet.
    fn lowest_unfinished(&self) -> u64 {
        match self.done.first() {
            Some(r) if r.start == 0 => r.end,
            _ => 0,
        }
    }

    /// Classifies the fragment `h` of `len` bytes, or says why the peer sent nonsense.
    pub fn check(&self, h: &DataHeader, len: u64) -> Result<Verdict, PlaneError> {
        if self.done.contains(h.seq) {
            return Ok(Verdict::Duplicate);
        }
        if h.total_len > self.max_len {
            return Err(PlaneError::MessageTooLong { len: h.total_len, max: self.max_len });
        }
        if len < MIN_FRAGMENT && h.offset + len < h.total_len {
            return Err(PlaneError::Malformed("a fragment short of its message's end is under 1024 bytes"));
        }
        let range = h.offset..h.offset + len;
        match self.open.get(&h.seq) {
            None if self.open.len() >= self.max_open => Err(PlaneError::TooManyMessages(self.max_open)),
            None if h.seq >= self.lowest_unfinished().saturating_add(SEQ_WINDOW) => {
                Err(PlaneError::Malformed("message number too far ahead of the unfinished ones"))
            }
            None => Ok(Verdict::Opens),
            Some(m) if m.tag != h.tag || m.total_len != h.total_len => {
                Err(PlaneError::Malformed("fragment disagrees with its message's tag or length"))
            }
            Some(m) if m.got.contains_range(range.clone()) => Ok(Verdict::Duplicate),
            Some(m) if m.got.overlaps(range) => {
                Err(PlaneError::Malformed("fragment overlaps another's bytes"))
            }
            Some(_) => Ok(Verdict::Continues),
        }
    }

    /// Records a fragment [`check`](Self::check) called new; returns whether its message is
    /// now complete.
    pub fn commit(&mut self, h: &DataHeader, len: u64) -> bool {
        let m = self.open.entry(h.seq).or_insert_with(|| InMsg {
            tag: h.tag,
            total_len: h.total_len,
            got: RangeSet::default(),
            got_bytes: 0,
        });
        m.got.insert(h.offset..h.offset + len);
        m.got_bytes += len;
        if m.got_bytes < m.total_len {
            return false;
        }
        self.open.remove(&h.seq);
        self.done.insert(h.seq..h.seq + 1);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn message_numbers_spread_over_the_buckets() {
        // A window of consecutive numbers, as a link opens them: the low bits (the bucket)
        // and the top 7 (hashbrown's tag) both spread as a random hash would (4096 into
        // 4096 buckets leaves about 63% of them used).
        let b = BuildHasherDefault::<SeqHasher>::default();
        for base in [0u64, 1 << 20, u64::MAX - 5000] {
            let hs: Vec<u64> = (base..base + 4096).map(|n| b.hash_one(n)).collect();
            let low: std::collections::HashSet<u64> = hs.iter().map(|h| h & 4095).collect();
            let top: std::collections::HashSet<u64> = hs.iter().map(|h| h >> 57).collect();
            assert!(low.len() > 2300, "{} of 4096 buckets from base {base}", low.len());
            assert_eq!(top.len(), 128, "tags from base {base}");
        }
    }

    fn h(seq: u64, offset: u64) -> DataHeader {
        DataHeader { seq, tag: 9, total_len: 30, offset }
    }

    #[test]
    fn each_fragment_counts_once() {
        let mut inc = Incoming::new(2, 1 << 20);
        let big = |seq, offset| DataHeader { seq, tag: 9, total_len: 3072, offset };
        assert_eq!(inc.check(&big(0, 1024), 1024).expect("ok"), Verdict::Opens);
        assert!(!inc.commit(&big(0, 1024), 1024));
        assert_eq!(inc.check(&big(0, 1024), 1024).expect("ok"), Verdict::Duplicate);
        assert!(inc.check(&big(0, 1500), 1024).is_err(), "overlap");
        assert_eq!(inc.check(&big(0, 0), 1024).expect("ok"), Verdict::Continues);
        inc.commit(&big(0, 0), 1024);
        assert!(inc.commit(&big(0, 2048), 1024));
        assert_eq!(inc.check(&big(0, 0), 1024).expect("ok"), Verdict::Duplicate);
        assert_eq!(inc.open_messages(), 0);
        inc.commit(&h(1, 0), 10);
        inc.commit(&h(2, 0), 10);
        assert!(matches!(inc.check(&h(3, 20), 10), Err(PlaneError::TooManyMessages(2))));
        let long = DataHeader { seq: 4, tag: 9, total_len: (1 << 20) + 1, offset: 0 };
        assert!(matches!(inc.check(&long, 1), Err(PlaneError::MessageTooLong { .. })));
    }

    #[test]
    fn small_middle_fragments_and_far_message_numbers_are_refused() {
        let mut inc = Incoming::new(8, 1 << 20);
        // Only a message's last fragment may be short.
        assert!(inc.check(&h(0, 0), 10).is_err(), "10 of 30 bytes, not the end");
        assert_eq!(inc.check(&h(0, 20), 10).expect("the end"), Verdict::Opens);
        assert_eq!(inc.check(&h(0, 0), 30).expect("the whole"), Verdict::Opens);
        // Message numbers stay within the window above the lowest unfinished one.
        let one = |seq| DataHeader { seq, tag: 9, total_len: 8, offset: 0 };
        assert!(inc.check(&one(SEQ_WINDOW), 8).is_err());
        assert_eq!(inc.check(&one(SEQ_WINDOW - 1), 8).expect("in the window"), Verdict::Opens);
        for seq in 0..10 {
            assert!(inc.commit(&one(seq), 8));
        }
        assert_eq!(inc.check(&one(SEQ_WINDOW + 9), 8).expect("the window moved"), Verdict::Opens);
        assert!(inc.check(&one(SEQ_WINDOW + 10), 8).is_err());
    }
}
