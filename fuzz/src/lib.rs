//! Shared parts of meshd's fuzz targets: a counting allocator (so a target can assert how
//! much a decoder allocated), the properties every postcard decoder must have, and the
//! seed corpus built from real encoded messages ([`seeds`]).

use meshd_proto::wire::{self, MAX_FRAME, WireError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::alloc::{GlobalAlloc, Layout, System};
use std::fmt::Debug;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

pub mod seeds;

/// The local service's request parser, compiled here on its own (it names only
/// `meshd_proto` and `serde_json`), so fuzzing it does not build the QUIC stack.
#[path = "../../crates/meshd/src/collective/request.rs"]
pub mod request;

/// Heap a decoder may hold at its peak regardless of its input (an error's message).
pub const HEAP_SLACK: usize = 4096;
/// Heap a decoder may hold per input byte. postcard passes a sequence's length prefix to
/// serde as a preallocation hint only when that many bytes remain, so a lying prefix
/// preallocates at most one element per remaining byte; elements are larger in memory
/// than on the wire (a `MemberState` is 232 bytes, at least ~40 encoded), and a frame
/// nests two sequences (member tables holding interface lists). The worst seen while
/// fuzzing is ~200 bytes per input byte.
pub const HEAP_PER_BYTE: usize = 512;

/// The most heap decoding `len` bytes may hold at once.
pub fn heap_limit(len: usize) -> usize {
    HEAP_SLACK + HEAP_PER_BYTE * len
}

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
    ALLOCS.fetch_add(1, Relaxed);
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Counted as holding both blocks for a moment, as a moving realloc does.
        grew(new_size);
        // SAFETY: same contract as ours.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        LIVE.fetch_sub(layout.size(), Relaxed);
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// What a closure allocated.
#[derive(Clone, Copy, Debug)]
pub struct HeapUse {
    /// Most bytes held at once beyond what was held before the call.
    pub peak: usize,
    /// Number of allocations (reallocations included).
    pub allocs: usize,
}

/// Runs `f` and says how much heap it used (the targets are single-threaded).
pub fn measure<R>(f: impl FnOnce() -> R) -> (R, HeapUse) {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    ALLOCS.store(0, Relaxed);
    let r = f();
    let peak = PEAK.load(Relaxed).saturating_sub(base);
    (r, HeapUse { peak, allocs: ALLOCS.load(Relaxed) })
}

/// Decodes `bytes` as a `T` with `meshd_proto::wire::decode` and checks what every wire
/// decoder must guarantee:
/// - the heap held while decoding stays within [`heap_limit`] of the input's length;
/// - a decoded value re-encodes to at most as many bytes (postcard accepts over-long
///   varints, so not always the same bytes), and those decode to an equal value and
///   re-encode to themselves (one canonical encoding);
/// - the input without its last byte does not decode (no value is a prefix of another);
/// - `Trailing(n)` means the first `len - n` bytes decode; `TooLarge` only above
///   `MAX_FRAME`.
///
/// Returns the value and the heap its decoding used.
pub fn check_wire<T>(bytes: &[u8]) -> Option<(T, HeapUse)>
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    let (res, heap) = measure(|| wire::decode::<T>(bytes));
    assert!(
        heap.peak <= heap_limit(bytes.len()),
        "decoding {} bytes held {} bytes of heap (limit {})",
        bytes.len(),
        heap.peak,
        heap_limit(bytes.len())
    );
    match res {
        Ok(v) => {
            let e = wire::encode(&v);
            assert!(!e.is_empty(), "{v:?} encodes to nothing");
            assert!(e.len() <= bytes.len(), "{v:?} re-encodes longer: {} > {}", e.len(), bytes.len());
            let back: T = wire::decode(&e).unwrap_or_else(|err| panic!("re-encoded {v:?} fails: {err}"));
            assert_eq!(back, v, "re-encoding changed the value");
            assert_eq!(wire::encode(&back), e, "encoding is not canonical");
            assert!(wire::decode::<T>(&bytes[..bytes.len() - 1]).is_err(), "a strict prefix decodes too");
            Some((v, heap))
        }
        Err(WireError::Trailing(n)) => {
            assert!(n > 0 && n < bytes.len(), "Trailing({n}) of {} bytes", bytes.len());
            let head = &bytes[..bytes.len() - n];
            if let Err(e) = wire::decode::<T>(head) {
                panic!("the {} bytes before {n} trailing ones do not decode: {e}", head.len());
            }
            None
        }
        Err(WireError::TooLarge(n)) => {
            assert!(n == bytes.len() && n > MAX_FRAME, "TooLarge({n}) for {} bytes", bytes.len());
            None
        }
        Err(WireError::Malformed(_)) => None,
    }
}
