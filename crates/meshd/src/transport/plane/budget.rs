//! What the plane holds for each peer host, and the rule that keeps it bounded.
//!
//! The receiver hands fragments on as pieces of the receive buffers they arrived in (no
//! copy after the kernel's), so what a peer's messages cost is the buffers they keep
//! alive, not their payload. A [`Budget`] per peer host counts both:
//!
//! - `held`: bytes of receive buffers alive because a piece of them is kept somewhere (a
//!   message being reassembled, a complete one nobody took yet, one the ring still
//!   reduces from): each such buffer is a [`Held`] whose drop gives its bytes back;
//! - `reserved`: twice the bytes still missing from the peer's open messages, set aside
//!   when a message opens, so that every message once begun can finish.
//!
//! A message opens only while `held + reserved + 2 x its length` stays within
//! [`PEER_BUDGET`] and fewer than [`MAX_OPEN_PER_PEER`] are open; a fragment that would
//! open one past that is dropped unacknowledged (the sender resends it later, and its
//! loss recovery slows it down). Twice the length, because the driver keeps a receive
//! buffer in place only for a message that fills at least half of it and copies any
//! other fragment out into a buffer of its own size (`Driver::receive`): a message never
//! holds more than twice its bytes. So `held + reserved <= PEER_BUDGET` at all times, and
//! what a peer makes this node hold is bounded whatever it sends.

use bytes::Bytes;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// Most bytes of receive buffers the plane holds (and reserves) for one peer host: enough
/// for the ring's normal work (a few 1 MiB chunks being reassembled per lane, the ones it
/// has not reduced yet, the neighbour's next operation) without ever refusing one, and
/// the same bound as a QUIC connection's receive window (`guard::RECEIVE_WINDOW`).
pub const PEER_BUDGET: usize = 64 << 20;

/// Most messages partly received from one peer host at once (all links and lanes).
pub const MAX_OPEN_PER_PEER: usize = 256;

/// The plane's account of one peer host.
#[derive(Debug, Default)]
pub struct Budget {
    held: AtomicUsize,
    reserved: AtomicUsize,
    open: AtomicUsize,
    peak: AtomicUsize,
    refused: AtomicU64,
}

impl Budget {
    /// Opens a message of `total` bytes if the budget allows (see the module's rule).
    pub fn open(&self, total: u64) -> bool {
        let need = usize::try_from(total).unwrap_or(usize::MAX).saturating_mul(2);
        if self.open.fetch_add(1, Relaxed) >= MAX_OPEN_PER_PEER {
            self.open.fetch_sub(1, Relaxed);
            return false;
        }
        let fits = self.reserved.fetch_update(Relaxed, Relaxed, |r| {
            let used = self.held.load(Relaxed).saturating_add(r);
            (used.saturating_add(need) <= PEER_BUDGET).then_some(r + need)
        });
        if fits.is_err() {
            self.open.fetch_sub(1, Relaxed);
            return false;
        }
        true
    }

    /// `len` bytes of an open message arrived: their reservation is released (the buffer
    /// they arrived in is counted as held instead).
    pub fn arrived(&self, len: u64) {
        let n = usize::try_from(len).unwrap_or(usize::MAX).saturating_mul(2);
        let _ = self.reserved.fetch_update(Relaxed, Relaxed, |r| Some(r.saturating_sub(n)));
    }

    /// A message opened with [`open`](Self::open) is complete (`missing` 0) or abandoned
    /// with `missing` bytes never received (its link went away).
    pub fn close(&self, missing: u64) {
        self.arrived(missing);
        let _ = self.open.fetch_update(Relaxed, Relaxed, |o| Some(o.saturating_sub(1)));
    }

    /// A datagram refused because no message could open: counted.
    pub fn refuse(&self) {
        self.refused.fetch_add(1, Relaxed);
    }

    /// Bytes of receive buffers held now.
    pub fn held(&self) -> usize {
        self.held.load(Relaxed)
    }

    /// The most `held` has been.
    pub fn peak(&self) -> usize {
        self.peak.load(Relaxed)
    }

    /// Datagrams refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Relaxed)
    }

    /// Messages open now.
    pub fn open_messages(&self) -> usize {
        self.open.load(Relaxed)
    }
}

/// Receive buffers whose pieces were all dropped, kept for the next receives of a lane: a
/// fresh allocation of a GRO batch's size is memory the kernel must fault in and zero
/// before its copy can write it (`clear_page`, measured at 3-4% of the machine on the
/// plane's ring), a recycled one is already mapped and likely still cached.
#[derive(Debug)]
pub struct BufferPool {
    free: Mutex<Vec<Vec<u8>>>,
    /// Capacity every pooled buffer has exactly.
    size: usize,
    /// Most buffers kept.
    max: usize,
}

impl BufferPool {
    /// A pool of at most `max` buffers of `size` bytes' capacity.
    pub fn new(size: usize, max: usize) -> BufferPool {
        BufferPool { free: Mutex::new(Vec::new()), size, max }
    }

    /// An empty buffer with `size` bytes of capacity: a recycled one if there is one.
    pub fn take(&self) -> Vec<u8> {
        let recycled = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        recycled.unwrap_or_else(|| Vec::with_capacity(self.size))
    }

    /// Keeps `buf` for a later [`take`](Self::take) if it has the pool's size and the pool
    /// has room; drops it otherwise.
    pub fn give(&self, mut buf: Vec<u8>) {
        if buf.capacity() != self.size {
            return;
        }
        buf.clear();
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < self.max {
            free.push(buf);
        }
    }

    /// Buffers kept now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// A receive buffer kept alive by the pieces handed on from it; its bytes count as held
/// by its peer's [`Budget`] until the last piece is dropped, when it goes back to its pool
/// (if it came from one).
struct Held {
    data: Vec<u8>,
    budget: Arc<Budget>,
    pool: Option<Arc<BufferPool>>,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.data.capacity(), Relaxed);
        if let Some(pool) = &self.pool {
            pool.give(std::mem::take(&mut self.data));
        }
    }
}

/// `data` as shared bytes whose allocation counts as held by `budget` until its last
/// slice is dropped; then it goes back to `pool`, if given.
pub fn hold(data: Vec<u8>, budget: &Arc<Budget>, pool: Option<&Arc<BufferPool>>) -> Bytes {
    let now = budget.held.fetch_add(data.capacity(), Relaxed) + data.capacity();
    budget.peak.fetch_max(now, Relaxed);
    Bytes::from_owner(Held { data, budget: budget.clone(), pool: pool.cloned() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_open_only_within_the_budget_and_held_bytes_come_back() {
        let b = Arc::new(Budget::default());
        let mib = 1u64 << 20;
        // 16 MiB reserves 32: two fit, a third does not.
        assert!(b.open(16 * mib));
        assert!(b.open(16 * mib));
        assert!(!b.open(1));
        assert_eq!(b.open_messages(), 2);
        // The first one's bytes arrive and are held (at most twice their size): still full.
        b.arrived(16 * mib);
        let piece = hold(vec![0u8; 20 << 20], &b, None).slice(0..10);
        assert!(!b.open(7 * mib));
        // It completes and the ring drops it: room again.
        b.close(0);
        drop(piece);
        assert_eq!(b.held(), 0);
        assert_eq!(b.peak(), 20 << 20);
        assert!(b.open(16 * mib));
        // An abandoned message gives its reservation back.
        b.close(16 * mib);
        b.close(16 * mib);
        assert_eq!(b.open_messages(), 0);
        assert!(b.open(32 * mib - 1));
    }

    #[test]
    fn a_held_buffer_goes_back_to_its_pool_when_its_last_piece_drops() {
        let b = Arc::new(Budget::default());
        let pool = Arc::new(BufferPool::new(4096, 2));
        let mut buf = pool.take();
        assert_eq!(buf.capacity(), 4096);
        buf.extend_from_slice(&[7u8; 100]);
        let ptr = buf.as_ptr();
        let whole = hold(buf, &b, Some(&pool));
        let (a, c) = (whole.slice(0..10), whole.slice(50..60));
        drop(whole);
        drop(a);
        assert_eq!(pool.len(), 0, "a piece still holds it");
        assert_eq!(&c[..], &[7u8; 10]);
        drop(c);
        assert_eq!((pool.len(), b.held()), (1, 0));
        let again = pool.take();
        assert_eq!((again.as_ptr(), again.len(), again.capacity()), (ptr, 0, 4096), "the same buffer, empty");
        // Buffers of another size, and any past the pool's bound, are freed.
        pool.give(Vec::with_capacity(10));
        for _ in 0..3 {
            pool.give(Vec::with_capacity(4096));
        }
        assert_eq!(pool.len(), 2);
    }

    #[test]
    fn the_count_of_open_messages_is_bounded() {
        let b = Budget::default();
        for _ in 0..MAX_OPEN_PER_PEER {
            assert!(b.open(8));
        }
        assert!(!b.open(8));
        b.close(0);
        assert!(b.open(8));
    }
}
