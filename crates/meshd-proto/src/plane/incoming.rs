//! The receiver's record of messages: which byte ranges of which message arrived, so that a
//! resent fragment is recognised and handed to the application exactly once.
//!
//! The receiver keeps no payload: each fragment goes to the application straight from the
//! datagram it arrived in. What it keeps per open message is a few ranges, and the set of
//! finished message numbers (one range while messages finish in order).

use super::PlaneError;
use super::frame::DataHeader;
use super::ranges::RangeSet;
use std::collections::HashMap;

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
    /// Bytes the application has not seen.
    New,
    /// A copy of bytes already delivered.
    Duplicate,
}

/// The receiving direction's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incoming {
    open: HashMap<u64, InMsg>,
    done: RangeSet,
    max_open: usize,
    max_len: u64,
}

impl Incoming {
    /// At most `max_open` messages partly received at once, each at most `max_len` bytes.
    pub fn new(max_open: usize, max_len: u64) -> Incoming {
        Incoming { open: HashMap::new(), done: RangeSet::default(), max_open, max_len }
    }

    /// Messages partly received.
    pub fn open_messages(&self) -> usize {
        self.open.len()
    }

    /// Classifies the fragment `h` of `len` bytes, or says why the peer sent nonsense.
    pub fn check(&self, h: &DataHeader, len: u64) -> Result<Verdict, PlaneError> {
        if self.done.contains(h.seq) {
            return Ok(Verdict::Duplicate);
        }
        if h.total_len > self.max_len {
            return Err(PlaneError::MessageTooLong { len: h.total_len, max: self.max_len });
        }
        let range = h.offset..h.offset + len;
        match self.open.get(&h.seq) {
            None if self.open.len() >= self.max_open => Err(PlaneError::TooManyMessages(self.max_open)),
            None => Ok(Verdict::New),
            Some(m) if m.tag != h.tag || m.total_len != h.total_len => {
                Err(PlaneError::Malformed("fragment disagrees with its message's tag or length"))
            }
            Some(m) if m.got.contains_range(range.clone()) => Ok(Verdict::Duplicate),
            Some(m) if m.got.overlaps(range) => {
                Err(PlaneError::Malformed("fragment overlaps another's bytes"))
            }
            Some(_) => Ok(Verdict::New),
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

    fn h(seq: u64, offset: u64) -> DataHeader {
        DataHeader { seq, tag: 9, total_len: 30, offset }
    }

    #[test]
    fn each_fragment_counts_once() {
        let mut inc = Incoming::new(2, 100);
        assert_eq!(inc.check(&h(0, 10), 10).expect("ok"), Verdict::New);
        assert!(!inc.commit(&h(0, 10), 10));
        assert_eq!(inc.check(&h(0, 10), 10).expect("ok"), Verdict::Duplicate);
        assert!(inc.check(&h(0, 15), 10).is_err(), "overlap");
        inc.commit(&h(0, 0), 10);
        assert!(inc.commit(&h(0, 20), 10));
        assert_eq!(inc.check(&h(0, 0), 10).expect("ok"), Verdict::Duplicate);
        assert_eq!(inc.open_messages(), 0);
        inc.commit(&h(1, 0), 10);
        inc.commit(&h(2, 0), 10);
        assert!(matches!(inc.check(&h(3, 0), 10), Err(PlaneError::TooManyMessages(2))));
        let long = DataHeader { seq: 4, tag: 9, total_len: 101, offset: 0 };
        assert!(matches!(inc.check(&long, 1), Err(PlaneError::MessageTooLong { .. })));
    }
}
