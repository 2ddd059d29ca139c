//! The replay window: which packet numbers have already been accepted.
//!
//! A bitmap of the [`WINDOW`] packet numbers up to the largest accepted one. A number
//! already in it, or older than the window, is refused before any AEAD work. Only a
//! datagram that opened is recorded, so forged ones cannot move the window.

use super::PlaneError;

/// Packet numbers the window remembers below the largest accepted one.
pub const WINDOW: u64 = 2048;
const WORDS: usize = (WINDOW / 64) as usize;

/// The replay window of one receiving direction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayWindow {
    largest: Option<u64>,
    /// Bit `i` of the window (word `i / 64`, bit `i % 64`) is packet `largest - i`.
    bits: [u64; WORDS],
}

impl Default for ReplayWindow {
    fn default() -> Self {
        ReplayWindow { largest: None, bits: [0; WORDS] }
    }
}

impl ReplayWindow {
    /// The largest packet number accepted so far.
    pub fn largest(&self) -> Option<u64> {
        self.largest
    }

    /// Whether `pn` may still be accepted: new, and not older than the window.
    pub fn check(&self, pn: u64) -> Result<(), PlaneError> {
        let Some(largest) = self.largest else { return Ok(()) };
        if pn > largest {
            return Ok(());
        }
        let age = largest - pn;
        if age >= WINDOW {
            return Err(PlaneError::TooOld(pn));
        }
        let (w, b) = ((age / 64) as usize, age % 64);
        if self.bits[w] >> b & 1 == 1 {
            return Err(PlaneError::Replayed(pn));
        }
        Ok(())
    }

    /// Records `pn` as accepted (after [`check`](Self::check) passed and the datagram opened).
    pub fn insert(&mut self, pn: u64) {
        let Some(largest) = self.largest else {
            self.largest = Some(pn);
            self.bits = [0; WORDS];
            self.bits[0] = 1;
            return;
        };
        if pn > largest {
            self.shift(pn - largest);
            self.largest = Some(pn);
            self.bits[0] |= 1;
        } else {
            let age = largest - pn;
            if age < WINDOW {
                self.bits[(age / 64) as usize] |= 1 << (age % 64);
            }
        }
    }

    /// Ages every bit by `by` positions.
    fn shift(&mut self, by: u64) {
        if by >= WINDOW {
            self.bits = [0; WORDS];
            return;
        }
        let words = (by / 64) as usize;
        let bits = (by % 64) as u32;
        for i in (0..WORDS).rev() {
            let src = i.checked_sub(words);
            let hi = src.map_or(0, |s| self.bits[s]);
            let lo = src.and_then(|s| s.checked_sub(1)).map_or(0, |s| self.bits[s]);
            self.bits[i] = if bits == 0 { hi } else { (hi << bits) | (lo >> (64 - bits)) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use std::collections::HashSet;

    #[test]
    fn duplicates_and_old_numbers_are_refused() {
        let mut w = ReplayWindow::default();
        for pn in [5, 3, 9, 4] {
            w.check(pn).expect("new");
            w.insert(pn);
        }
        for pn in [5, 3, 9, 4] {
            assert!(matches!(w.check(pn), Err(PlaneError::Replayed(p)) if p == pn));
        }
        w.check(6).expect("6 never seen");
        w.insert(9 + WINDOW);
        assert!(matches!(w.check(9), Err(PlaneError::TooOld(9))));
        w.check(10).expect("inside the window, never seen");
    }

    #[test]
    fn agrees_with_a_set_under_random_arrivals() {
        let mut rng = Rng::new(0x5eed);
        let mut w = ReplayWindow::default();
        let mut seen = HashSet::new();
        let mut top = 0u64;
        for _ in 0..200_000 {
            top += rng.below(3) as u64;
            let pn = top.saturating_sub(rng.below(2 * WINDOW as usize + 300) as u64);
            let largest = w.largest();
            let expect_ok = !seen.contains(&pn) && largest.is_none_or(|l| pn > l || l - pn < WINDOW);
            assert_eq!(w.check(pn).is_ok(), expect_ok, "pn {pn} largest {largest:?}");
            if expect_ok {
                w.insert(pn);
                seen.insert(pn);
            }
        }
    }
}
