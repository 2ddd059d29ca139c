//! A set of `u64` numbers kept as disjoint half-open ranges: received packet numbers,
//! received byte ranges of a message, completed message numbers.

use std::collections::BTreeMap;
use std::ops::Range;

/// Disjoint, non-adjacent half-open ranges, keyed by start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeSet {
    map: BTreeMap<u64, u64>,
}

impl RangeSet {
    /// Adds `r`, merging it with every range it touches.
    pub fn insert(&mut self, r: Range<u64>) {
        if r.is_empty() {
            return;
        }
        let (mut start, mut end) = (r.start, r.end);
        // In order (packet numbers, a message's bytes, finished messages): `r` touches or
        // follows the highest range only, which grows in place or is followed by a new one.
        if let Some(mut last) = self.map.last_entry() {
            if *last.key() <= start {
                if *last.get() >= start {
                    let e = last.get_mut();
                    *e = (*e).max(end);
                } else {
                    self.map.insert(start, end);
                }
                return;
            }
        }
        if let Some((&s, &e)) = self.map.range(..=start).next_back() {
            if e >= end {
                return;
            }
            if e >= start {
                start = s;
                self.map.remove(&s);
            }
        }
        while let Some((&s, &e)) = self.map.range(start..=end).next() {
            end = end.max(e);
            self.map.remove(&s);
        }
        self.map.insert(start, end);
    }

    /// Whether every number of `r` is in the set.
    pub fn contains_range(&self, r: Range<u64>) -> bool {
        r.is_empty() || self.map.range(..=r.start).next_back().is_some_and(|(_, &e)| e >= r.end)
    }

    /// Whether `n` is in the set.
    pub fn contains(&self, n: u64) -> bool {
        n < u64::MAX && self.contains_range(n..n + 1)
    }

    /// Whether any number of `r` is in the set.
    pub fn overlaps(&self, r: Range<u64>) -> bool {
        !r.is_empty() && self.map.range(..r.end).next_back().is_some_and(|(_, &e)| e > r.start)
    }

    /// Number of disjoint ranges.
    pub fn range_count(&self) -> usize {
        self.map.len()
    }

    /// Removes the lowest range.
    pub fn pop_min(&mut self) -> Option<Range<u64>> {
        self.map.pop_first().map(|(s, e)| s..e)
    }

    /// The lowest range, if any.
    pub fn first(&self) -> Option<Range<u64>> {
        self.map.first_key_value().map(|(&s, &e)| s..e)
    }

    /// The ranges from the highest down.
    pub fn iter_rev(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        self.map.iter().rev().map(|(&s, &e)| s..e)
    }

    /// The largest number in the set.
    pub fn max(&self) -> Option<u64> {
        self.map.last_key_value().map(|(_, &e)| e - 1)
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn matches_a_bitmap_under_random_inserts() {
        let mut rng = Rng::new(11);
        let mut set = RangeSet::default();
        let mut bits = vec![false; 300];
        for _ in 0..2000 {
            let a = rng.below(290) as u64;
            let b = a + rng.below(10) as u64;
            let covered = (a..b).all(|i| bits[i as usize]);
            let any = (a..b).any(|i| bits[i as usize]);
            assert_eq!(set.contains_range(a..b), covered);
            assert_eq!(set.overlaps(a..b), any);
            set.insert(a..b);
            for i in a..b {
                bits[i as usize] = true;
            }
            let mut prev_end = None;
            let mut count = 0;
            for r in set.iter_rev() {
                if let Some(pe) = prev_end {
                    assert!(r.end < pe, "ranges stay disjoint and non-adjacent");
                }
                prev_end = Some(r.start);
                count += r.end - r.start;
            }
            assert_eq!(count, bits.iter().filter(|b| **b).count() as u64);
        }
    }
}
