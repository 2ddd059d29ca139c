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
    /// Bit `pn % WINDOW` is set when packet `pn` (within the window) was accepted. A ring:
    /// moving the window forward clears only the bits it passes over.
    bits: [u64; WORDS],
}

impl Default for ReplayWindow {
    fn default() -> Self {
        ReplayWindow { largest: None, bits: [0; WORDS] }
    }
}

fn slot(pn: u64) -> (usize, u64) {
    let i = pn % WINDOW;
    ((i / 64) as usize, 1 << (i % 64))
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
        if largest - pn >= WINDOW {
            return Err(PlaneError::TooOld(pn));
        }
        let (w, b) = slot(pn);
        if self.bits[w] & b != 0 {
            return Err(PlaneError::Replayed(pn));
        }
        Ok(())
    }

    /// Records `pn` as accepted (after [`check`](Self::check) passed and the datagram opened).
    pub fn insert(&mut self, pn: u64) {
        match self.largest {
            Some(largest) if pn <= largest => {
                if largest - pn >= WINDOW {
                    return;
                }
            }
            Some(largest) if pn - largest < WINDOW => {
                // The numbers passed over leave the window's far end: clear their slots.
                let mut n = largest + 1;
                while n < pn {
                    let (w, b) = slot(n);
                    if n % 64 == 0 && pn - n >= 64 {
                        self.bits[w] = 0;
                        n += 64;
                    } else {
                        self.bits[w] &= !b;
                        n += 1;
                    }
                }
                self.largest = Some(pn);
            }
            _ => {
                self.bits = [0; WORDS];
                self.largest = Some(pn);
            }
        }
        let (w, b) = slot(pn);
        self.bits[w] |= b;
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
