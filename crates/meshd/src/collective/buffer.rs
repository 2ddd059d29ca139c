//! A buffer whose ranges the transport sends without copying them.
//!
//! QUIC must keep every byte it sends until the receiver acknowledges it, so quinn takes
//! ownership of what it sends (`Bytes`). A ring over a plain `&mut [u8]` therefore copies
//! each outgoing chunk into a fresh allocation first. [`CollectiveBuffer`] instead *lends*
//! ranges of itself to the transport as `Bytes` that point into it, and refuses to hand out
//! a range for writing while a loan of it is outstanding; the ring driver defers a write
//! to a lent range until quinn drops the loan (after the acknowledgement). That saves
//! the ring's own copies of everything it sends (docs/PERFORMANCE.md).

use bytes::Bytes;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;

/// Ranges shorter than this are copied when sent instead of lent: a copy of a small range
/// costs less than tracking it, and never makes a later write wait for an acknowledgement
/// (which keeps small collectives' latency as it was).
pub const LEND_FROM: usize = 64 << 10;

/// Memory for collectives whose ranges can be lent to the transport without copying.
///
/// Reading it (`as_slice`) is always possible; writing a range needs that no loan of it is
/// outstanding. After an operation the last loans may live on until the next node
/// acknowledges them: [`CollectiveBuffer::reset`] then starts fresh memory instead of
/// waiting, and the old memory is freed when its last loan is dropped.
pub struct CollectiveBuffer {
    inner: Arc<Inner>,
}

/// The memory (a `Vec<u8>`'s parts) and its loans. Loans read their range through `ptr`
/// from any thread; the owner writes through `ptr` only ranges no loan covers, and only
/// while it holds `&mut CollectiveBuffer` (so no `&[u8]` of the whole buffer exists then).
struct Inner {
    ptr: *mut u8,
    len: usize,
    cap: usize,
    lent: Mutex<Lent>,
    released: Arc<Notify>,
}

// SAFETY: the memory is owned by `Inner` alone; concurrent access is only reads of lent
// ranges (immutable until their loans end) and the owner's writes to ranges not lent.
unsafe impl Send for Inner {}
// SAFETY: as above; `lent` is behind a mutex.
unsafe impl Sync for Inner {}

#[derive(Default)]
struct Lent {
    /// Outstanding loans: `(start, end)` -> how many.
    ranges: BTreeMap<(usize, usize), usize>,
    /// The longest range lent so far: bounds the search for loans overlapping a range.
    longest: usize,
}

impl Inner {
    fn from_vec(v: Vec<u8>) -> Inner {
        let mut v = std::mem::ManuallyDrop::new(v);
        Inner {
            ptr: v.as_mut_ptr(),
            len: v.len(),
            cap: v.capacity(),
            lent: Mutex::new(Lent::default()),
            released: Arc::new(Notify::new()),
        }
    }

    fn lent(&self) -> MutexGuard<'_, Lent> {
        // A poisoned lock only means a panic elsewhere while it was held; the map itself
        // is always consistent (each change is one insert or remove).
        self.lent.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The memory back as a `Vec`, leaving `self` empty.
    fn take_vec(&mut self) -> Vec<u8> {
        let (ptr, len, cap) = (self.ptr, self.len, self.cap);
        (self.ptr, self.len, self.cap) = (std::ptr::null_mut(), 0, 0);
        if ptr.is_null() {
            return Vec::new();
        }
        // SAFETY: ptr, len and cap came from a Vec<u8> (`from_vec`) and are taken once.
        unsafe { Vec::from_raw_parts(ptr, len, cap) }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        drop(self.take_vec());
    }
}

impl Lent {
    fn overlaps(&self, r: &Range<usize>) -> bool {
        // Loans starting before r.end, the latest first; one starting `longest` or more
        // before r.start ends before it, and so does every earlier one.
        self.ranges
            .range(..(r.end, 0))
            .rev()
            .take_while(|((s, _), _)| s + self.longest > r.start)
            .any(|((_, e), _)| *e > r.start)
    }
}

/// Writes ranges of a [`CollectiveBuffer`] from another task. It keeps the memory alive
/// (as a loan does) but takes no range itself: whoever hands it out must see to it that
/// the owner leaves a range alone while the writer writes it (the ring's direct sink
/// claims each range once, before the ring touches it, and the ring waits for the sink
/// to close before it returns).
pub(crate) struct SharedWriter {
    inner: Arc<Inner>,
}

impl SharedWriter {
    /// Whether some loan covers part of `range`.
    pub(crate) fn is_lent(&self, range: &Range<usize>) -> bool {
        self.inner.lent().overlaps(range)
    }

    /// `range` to write, or `None` when out of bounds.
    ///
    /// # Safety
    /// While the returned slice lives, nothing else reads or writes `range`: no loan
    /// covers it, the owner makes no reference to it, and no other writer writes it.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range_mut(&self, range: Range<usize>) -> Option<&mut [u8]> {
        if range.start > range.end || range.end > self.inner.len {
            return None;
        }
        if range.is_empty() {
            return Some(&mut []);
        }
        // SAFETY: in bounds, the memory lives as long as `inner`, and the caller promises
        // that nothing else touches `range` meanwhile.
        Some(unsafe { std::slice::from_raw_parts_mut(self.inner.ptr.add(range.start), range.len()) })
    }
}

/// A lent range: what the `Bytes` handed to the transport owns.
struct Loan {
    inner: Arc<Inner>,
    start: usize,
    end: usize,
}

impl AsRef<[u8]> for Loan {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the range is within the buffer (checked when lent), the memory lives as
        // long as `inner`, and nothing writes a lent range until its loan is dropped.
        unsafe { std::slice::from_raw_parts(self.inner.ptr.add(self.start), self.end - self.start) }
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        {
            let mut lent = self.inner.lent();
            let key = (self.start, self.end);
            if let Some(count) = lent.ranges.get_mut(&key) {
                *count -= 1;
                if *count == 0 {
                    lent.ranges.remove(&key);
                }
            }
        }
        self.inner.released.notify_one();
    }
}

impl CollectiveBuffer {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> CollectiveBuffer {
        CollectiveBuffer::from_vec(vec![0; len])
    }

    /// Takes over `v` (no copy).
    pub fn from_vec(v: Vec<u8>) -> CollectiveBuffer {
        CollectiveBuffer { inner: Arc::new(Inner::from_vec(v)) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The whole buffer, to read (lent ranges included: they are not changing).
    pub fn as_slice(&self) -> &[u8] {
        if self.inner.ptr.is_null() {
            return &[];
        }
        // SAFETY: the memory lives as long as `inner`; writes need `&mut self`.
        unsafe { std::slice::from_raw_parts(self.inner.ptr, self.inner.len) }
    }

    /// `range` to read (panics when out of bounds, as slicing does). Unlike
    /// [`as_slice`](Self::as_slice), it makes no reference to bytes outside `range`, which
    /// a [`SharedWriter`] may be writing during a ring operation.
    pub fn slice(&self, range: Range<usize>) -> &[u8] {
        assert!(range.start <= range.end && range.end <= self.inner.len, "range {range:?} out of bounds");
        if range.is_empty() {
            return &[];
        }
        // SAFETY: in bounds; the memory lives as long as `inner`; the owner writes only
        // with `&mut self`, and a shared writer only ranges the owner leaves alone.
        unsafe { std::slice::from_raw_parts(self.inner.ptr.add(range.start), range.len()) }
    }

    /// A handle that writes ranges of this buffer from another task (the data plane's
    /// driver, reducing received bytes in place while they are in cache). See
    /// [`SharedWriter::range_mut`] for the rule that keeps it sound.
    pub(crate) fn shared_writer(&self) -> SharedWriter {
        SharedWriter { inner: self.inner.clone() }
    }

    /// The whole buffer to write, if no range of it is lent out.
    pub fn try_as_mut(&mut self) -> Option<&mut [u8]> {
        let inner = Arc::get_mut(&mut self.inner)?; // every loan holds a reference
        if inner.ptr.is_null() {
            return Some(&mut []);
        }
        // SAFETY: unique (no loans, no other handle), within the allocation.
        Some(unsafe { std::slice::from_raw_parts_mut(inner.ptr, inner.len) })
    }

    /// Makes this a buffer of `len` bytes with nothing lent out, for the next operation,
    /// and returns it to fill. Reuses the memory when the transport has dropped every
    /// loan (the bytes are then what they were, and zeros past the old length); otherwise
    /// starts zeroed memory instead of waiting, and the old memory goes with its last loan.
    pub fn reset(&mut self, len: usize) -> &mut [u8] {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => {
                let mut v = inner.take_vec();
                v.resize(len, 0);
                *inner = Inner::from_vec(v);
            }
            None => self.inner = Arc::new(Inner::from_vec(vec![0; len])),
        }
        self.try_as_mut().unwrap_or_default()
    }

    /// The memory as a `Vec`, if nothing is lent out; else the buffer back.
    pub fn into_vec(self) -> Result<Vec<u8>, CollectiveBuffer> {
        match Arc::try_unwrap(self.inner) {
            Ok(mut inner) => Ok(inner.take_vec()),
            Err(inner) => Err(CollectiveBuffer { inner }),
        }
    }

    /// Whether some loan covers part of `range`.
    pub fn is_lent(&self, range: &Range<usize>) -> bool {
        self.inner.lent().overlaps(range)
    }

    /// How many loans are outstanding.
    pub fn loans(&self) -> usize {
        self.inner.lent().ranges.values().sum()
    }

    /// `range` to write, unless it is out of bounds or a loan covers part of it.
    pub fn range_mut(&mut self, range: Range<usize>) -> Option<&mut [u8]> {
        if range.start > range.end || range.end > self.inner.len || self.is_lent(&range) {
            return None;
        }
        if range.is_empty() {
            return Some(&mut []);
        }
        // SAFETY: in bounds, no loan reads it, and `&mut self` excludes every other
        // reference the owner could hold; loans read only other ranges.
        Some(unsafe { std::slice::from_raw_parts_mut(self.inner.ptr.add(range.start), range.len()) })
    }

    /// `range` as `Bytes` for the transport: lent (no copy) from [`LEND_FROM`] bytes up,
    /// copied below. A lent range cannot be written until every clone of the returned
    /// `Bytes` is dropped. Panics if `range` is out of bounds, as slicing does.
    pub fn lend(&self, range: Range<usize>) -> Bytes {
        // Only `range` is read (a [`SharedWriter`] may be writing another range now).
        let slice = self.slice(range.clone());
        if slice.len() < LEND_FROM {
            return Bytes::copy_from_slice(slice);
        }
        {
            let mut lent = self.inner.lent();
            *lent.ranges.entry((range.start, range.end)).or_default() += 1;
            lent.longest = lent.longest.max(range.len());
        }
        Bytes::from_owner(Loan { inner: self.inner.clone(), start: range.start, end: range.end })
    }

    /// Notified each time a loan ends (a permit is kept if nobody is waiting).
    pub(crate) fn released(&self) -> Arc<Notify> {
        self.inner.released.clone()
    }
}

impl std::fmt::Debug for CollectiveBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CollectiveBuffer").field("len", &self.len()).field("loans", &self.loans()).finish()
    }
}

impl Default for CollectiveBuffer {
    /// An empty buffer.
    fn default() -> Self {
        CollectiveBuffer::from_vec(Vec::new())
    }
}

impl From<Vec<u8>> for CollectiveBuffer {
    fn from(v: Vec<u8>) -> Self {
        CollectiveBuffer::from_vec(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: usize = LEND_FROM;

    #[test]
    fn a_lent_range_cannot_be_written_until_its_bytes_are_dropped() {
        let mut b = CollectiveBuffer::from_vec((0..4 * K).map(|i| i as u8).collect());
        let sent = b.lend(K..2 * K);
        let copy = sent.clone();
        assert_eq!(b.loans(), 1);
        assert_eq!(&sent[..], &b.as_slice()[K..2 * K]);
        assert!(b.range_mut(K..2 * K).is_none());
        assert!(b.range_mut(K + 10..K + 20).is_none(), "inside a loan");
        assert!(b.range_mut(0..K + 1).is_none(), "overlapping its start");
        assert!(b.range_mut(2 * K - 1..3 * K).is_none(), "overlapping its end");
        assert!(b.try_as_mut().is_none());
        // Its neighbours are free.
        b.range_mut(0..K).expect("before").fill(7);
        b.range_mut(2 * K..4 * K).expect("after").fill(9);
        assert_eq!(&sent[..], &(K..2 * K).map(|i| i as u8).collect::<Vec<_>>()[..]);
        drop(sent);
        assert!(b.range_mut(K..2 * K).is_none(), "a clone still holds it");
        drop(copy);
        assert_eq!(b.loans(), 0);
        b.range_mut(K..2 * K).expect("released").fill(8);
        assert!(b.try_as_mut().is_some());
        assert_eq!(
            b.into_vec().expect("unique").iter().map(|&x| x as usize).sum::<usize>(),
            (7 + 8 + 9 + 9) * K
        );
    }

    #[test]
    fn overlap_search_finds_loans_of_any_length() {
        let b = CollectiveBuffer::zeroed(64 * K);
        let _long = b.lend(0..40 * K);
        let _short = b.lend(50 * K..51 * K);
        assert!(b.is_lent(&(39 * K..39 * K + 1)), "the long loan reaches past later short ones");
        assert!(!b.is_lent(&(40 * K..50 * K)));
        assert!(b.is_lent(&(45 * K..50 * K + 1)));
        assert!(!b.is_lent(&(51 * K..64 * K)));
    }

    #[test]
    fn small_ranges_are_copied_not_lent() {
        let mut b = CollectiveBuffer::zeroed(2 * K);
        let small = b.lend(0..K - 1);
        assert_eq!(b.loans(), 0);
        b.range_mut(0..K).expect("not lent").fill(1);
        assert!(small.iter().all(|&x| x == 0), "the copy keeps what was sent");
    }

    #[test]
    fn reset_while_lent_starts_new_memory_and_loans_keep_the_old() {
        let mut b = CollectiveBuffer::from_vec(vec![5; 2 * K]);
        let sent = b.lend(0..K);
        let fresh = b.reset(3 * K);
        assert_eq!(fresh.len(), 3 * K);
        assert!(fresh.iter().all(|&x| x == 0));
        fresh.fill(6);
        assert!(sent.iter().all(|&x| x == 5), "the old memory lives while lent");
        assert_eq!(b.loans(), 0, "the new memory has no loans");
        drop(sent); // frees the old memory
        let again = b.reset(K);
        assert!(again.iter().all(|&x| x == 6), "unlent memory is reused as it is");
    }

    #[test]
    fn out_of_bounds_ranges_are_refused() {
        let mut b = CollectiveBuffer::zeroed(10);
        assert!(b.range_mut(5..11).is_none());
        assert!(b.range_mut(11..12).is_none());
        assert_eq!(b.range_mut(10..10).map(|s| s.len()), Some(0));
        let empty = CollectiveBuffer::from_vec(Vec::new());
        assert!(empty.is_empty() && empty.as_slice().is_empty());
    }

    /// The transport reads a loan on its own thread while the owner writes the range next
    /// to it (Miri's race and aliasing checks run this: `cargo +nightly miri test -p meshd
    /// --lib collective::buffer`).
    #[test]
    fn a_loan_is_read_on_another_thread_while_its_neighbour_is_written() {
        let mut b = CollectiveBuffer::from_vec(vec![1; 2 * K]);
        let sent = b.lend(0..K);
        let reader =
            std::thread::spawn(move || (0..4).map(|_| sent.iter().map(|&x| x as usize).sum::<usize>()).max());
        for round in 0..4u8 {
            b.range_mut(K..2 * K).expect("not lent").fill(round);
        }
        assert_eq!(reader.join().expect("reader"), Some(K), "the loan never changed");
        assert!(b.try_as_mut().is_some(), "the loan ended with the reader");
    }

    #[tokio::test]
    async fn dropping_a_loan_on_another_thread_wakes_a_waiter() {
        let b = CollectiveBuffer::zeroed(2 * K);
        let sent = b.lend(0..K);
        let released = b.released();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            drop(sent);
        });
        tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while b.is_lent(&(0..K)) {
                released.notified().await;
            }
        })
        .await
        .expect("woken when the loan ended");
        t.join().expect("thread");
    }
}
