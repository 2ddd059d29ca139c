//! The ring allreduce schedule, sans-IO.
//!
//! Model: `n` participants in ring order `0..n`, each holding a buffer of `len` elements
//! of `elem` bytes. The buffer is split into `n` segments, as equal as possible in whole
//! elements (the first `len % n` segments hold one element more; segments are empty when
//! `len < n`), and each segment into chunks of at most `chunk_bytes` (whole elements), so
//! that the network, the reduction and the copies of different chunks overlap.
//!
//! Rank `r` sends only to `r + 1` and receives only from `r - 1` (mod `n`):
//! - reduce-scatter, steps `s = 0..n-1`: send segment `r - s`, receive segment
//!   `r - s - 1` and reduce it into the local buffer. After `n - 1` steps, rank `r` owns
//!   the fully reduced segment `r + 1`.
//! - all-gather, steps `s = 0..n-1`: send segment `r + 1 - s`, receive segment `r - s`
//!   and copy it over the local one (no arithmetic).
//!
//! Written as one sequence of `2(n - 1)` global steps `g`, rank `r` sends segment `r - g`
//! and receives segment `r - g - 1`: what it receives at step `g` is exactly what it
//! sends at step `g + 1`. So chunk `c` of step `g + 1` may leave as soon as chunk `c` of
//! step `g` has arrived and been applied; that per-chunk dependency is the whole pipeline,
//! and chunks of step 0 (the rank's own data) may leave at once.
//!
//! Each segment is reduced along the ring in one fixed order, starting at the rank whose
//! index it bears and ending at its owner; every other rank then copies the owner's
//! bytes. So all ranks end bitwise identical even for f16/bf16, whose rounding depends on
//! the order (see [`crate::reduce`]).
//!
//! [`RingPlan`] is the pure arithmetic (segments, chunks, steps, transfer ids);
//! [`RingState`] is what a driver feeds: [`RingState::on_received`] in,
//! [`RingState::poll_send`] out, [`RingState::is_done`]. Frames on the wire carry the
//! [`transfer_id`], which sender and receiver compute identically, so chunks may arrive
//! in any order (several QUIC streams, several lanes). The id does not name the
//! collective: a driver running several allreduces on one link tags frames with its own
//! operation number as well.

mod action;
mod direct;
mod state;

pub use action::{Action, Reduction};
pub use direct::{DIRECT_MAX_BYTES, DIRECT_MAX_WORLD, DIRECT_TRANSFER_ID, direct_reduce, is_direct};
pub use state::RingState;

use crate::reduce::ReduceError;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// The two halves of a ring allreduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Phase {
    /// Partial sums travel around the ring and are reduced at each hop.
    ReduceScatter,
    /// Each owner's final segment travels around the ring and is copied at each hop.
    AllGather,
}

/// One step of one rank's schedule: a segment out to the next rank, one in from the
/// previous rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Step {
    /// Which half of the allreduce.
    pub phase: Phase,
    /// Step within the phase, `0..n-1`.
    pub step: usize,
    /// Segment sent to rank + 1.
    pub send_segment: usize,
    /// Segment received from rank - 1.
    pub recv_segment: usize,
}

/// One chunk crossing one link: what a frame on the wire carries.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Transfer {
    /// Which half of the allreduce.
    pub phase: Phase,
    /// Step within the phase.
    pub step: usize,
    /// Segment the chunk belongs to.
    pub segment: usize,
    /// Index of the chunk within its segment.
    pub chunk_index: usize,
    /// Byte range of the chunk in the buffer.
    pub range: Range<usize>,
}

impl Transfer {
    /// The chunk's [`transfer_id`].
    pub fn id(&self) -> u64 {
        transfer_id(self.phase, self.step, self.chunk_index)
    }
}

/// Largest world: the step must fit the 31 bits [`transfer_id`] gives it.
pub const MAX_WORLD: usize = 1 << 31;
/// Most chunks a segment may have: the chunk index must fit 32 bits of the id.
pub const MAX_CHUNKS_PER_SEGMENT: usize = 1 << 32;

/// The tag of a chunk on the wire, identical at sender and receiver: bit 63 is the phase
/// (1 = all-gather), bits 32..63 the step within the phase, bits 0..32 the chunk index
/// within its segment. The segment itself is implied by the link and the step.
///
/// Stable: part of the wire protocol. Values out of range (which a [`RingPlan`] never
/// produces) are masked, so they cannot collide with the phase bit.
pub fn transfer_id(phase: Phase, step: usize, chunk_index: usize) -> u64 {
    let p = match phase {
        Phase::ReduceScatter => 0,
        Phase::AllGather => 1u64 << 63,
    };
    p | ((step as u64 & 0x7fff_ffff) << 32) | (chunk_index as u64 & 0xffff_ffff)
}

/// Splits an id into `(phase, step, chunk_index)`. Every `u64` decodes; whether it names
/// a real transfer is for [`RingState`] to check against its plan.
pub fn decode_transfer_id(id: u64) -> (Phase, usize, usize) {
    let phase = if id >> 63 == 1 { Phase::AllGather } else { Phase::ReduceScatter };
    (phase, ((id >> 32) & 0x7fff_ffff) as usize, (id & 0xffff_ffff) as usize)
}

/// Bytes of the header before each chunk's payload on a data stream: the [`transfer_id`]
/// (u64 big-endian), then the payload's length (u32 big-endian).
pub const CHUNK_HEADER_LEN: usize = 12;

/// The header sent before a chunk's payload.
pub fn encode_chunk_header(id: u64, len: u32) -> [u8; CHUNK_HEADER_LEN] {
    let mut head = [0u8; CHUNK_HEADER_LEN];
    head[..8].copy_from_slice(&id.to_be_bytes());
    head[8..].copy_from_slice(&len.to_be_bytes());
    head
}

/// Reads a chunk header into `(transfer id, payload length)`, refusing a length above
/// `max_chunk` before the receiver allocates anything for the payload.
pub fn decode_chunk_header(
    head: &[u8; CHUNK_HEADER_LEN],
    max_chunk: usize,
) -> Result<(u64, usize), RingError> {
    let mut id = [0u8; 8];
    id.copy_from_slice(&head[..8]);
    let mut len = [0u8; 4];
    len.copy_from_slice(&head[8..]);
    let len = u32::from_be_bytes(len) as usize;
    if len > max_chunk {
        return Err(RingError::ChunkTooLong { len, max: max_chunk });
    }
    Ok((u64::from_be_bytes(id), len))
}

/// Why a plan could not be built or an input was refused. A refused input leaves the
/// [`RingState`] unchanged.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RingError {
    /// A ring of zero participants.
    #[error("a ring needs at least one participant")]
    EmptyWorld,
    /// More participants than transfer ids can name.
    #[error("world of {0} exceeds the maximum of {MAX_WORLD}")]
    WorldTooLarge(usize),
    /// The rank is not in `0..n`.
    #[error("rank {rank} is not in a world of {n}")]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// The world size.
        n: usize,
    },
    /// Elements of zero bytes.
    #[error("element size must be at least one byte")]
    ZeroElemSize,
    /// A chunk cannot hold a single element.
    #[error("chunk of {chunk_bytes} bytes cannot hold one {elem_size}-byte element")]
    ChunkTooSmall {
        /// Chunk size given.
        chunk_bytes: usize,
        /// Element size given.
        elem_size: usize,
    },
    /// The buffer's size in bytes overflows `usize`, or a segment would need more than
    /// [`MAX_CHUNKS_PER_SEGMENT`] chunks.
    #[error("buffer of {len_elems} elements is too large for this plan")]
    BufferTooLarge {
        /// Elements given.
        len_elems: usize,
    },
    /// The id names no transfer this rank receives.
    #[error("unknown transfer id {0:#x}")]
    UnknownTransfer(u64),
    /// The transfer was already received.
    #[error("duplicate transfer id {0:#x}")]
    DuplicateTransfer(u64),
    /// A chunk header announces more bytes than the chunk size.
    #[error("chunk of {len} bytes exceeds the {max}-byte chunk size")]
    ChunkTooLong {
        /// Length announced.
        len: usize,
        /// The chunk size.
        max: usize,
    },
    /// The payload does not have the chunk's length.
    #[error("transfer {id:#x} carries {got} bytes, expected {expected}")]
    WrongLength {
        /// Transfer id.
        id: u64,
        /// The chunk's length.
        expected: usize,
        /// The payload's length.
        got: usize,
    },
    /// The buffer given to [`Action::apply`] is shorter than the chunk's range.
    #[error("buffer of {have} bytes does not hold range ending at {need}")]
    BufferTooSmall {
        /// End of the range.
        need: usize,
        /// Buffer length.
        have: usize,
    },
    /// The reduction refused the payload (dtype does not match the element size).
    #[error(transparent)]
    Reduce(#[from] ReduceError),
}

/// The arithmetic of one rank's ring allreduce: segments, chunks, steps, transfers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingPlan {
    n: usize,
    rank: usize,
    len_elems: usize,
    elem_size: usize,
    chunk_elems: usize,
}

impl RingPlan {
    /// A plan for `rank` in a ring of `n` over `len_elems` elements of `elem_size` bytes,
    /// chunked by at most `chunk_bytes` (rounded down to whole elements).
    pub fn new(
        n: usize,
        rank: usize,
        len_elems: usize,
        elem_size: usize,
        chunk_bytes: usize,
    ) -> Result<RingPlan, RingError> {
        if n == 0 {
            return Err(RingError::EmptyWorld);
        }
        if n > MAX_WORLD {
            return Err(RingError::WorldTooLarge(n));
        }
        if rank >= n {
            return Err(RingError::RankOutOfRange { rank, n });
        }
        if elem_size == 0 {
            return Err(RingError::ZeroElemSize);
        }
        if chunk_bytes < elem_size {
            return Err(RingError::ChunkTooSmall { chunk_bytes, elem_size });
        }
        let chunk_elems = chunk_bytes / elem_size;
        let plan = RingPlan { n, rank, len_elems, elem_size, chunk_elems };
        if len_elems.checked_mul(elem_size).is_none() || plan.chunk_count(0) > MAX_CHUNKS_PER_SEGMENT {
            return Err(RingError::BufferTooLarge { len_elems });
        }
        Ok(plan)
    }

    /// Participants in the ring.
    pub fn world(&self) -> usize {
        self.n
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Buffer length in elements.
    pub fn len_elems(&self) -> usize {
        self.len_elems
    }

    /// Element size in bytes.
    pub fn elem_size(&self) -> usize {
        self.elem_size
    }

    /// Buffer length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_elems * self.elem_size
    }

    /// Effective chunk size: the requested one rounded down to whole elements.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_elems * self.elem_size
    }

    /// Steps per phase, `n - 1`.
    pub fn steps_per_phase(&self) -> usize {
        self.n - 1
    }

    /// The segment this rank holds fully reduced after the reduce-scatter, `rank + 1`.
    pub fn owned_segment(&self) -> usize {
        (self.rank + 1) % self.n
    }

    /// Element range of segment `i`; empty (at the end) for `i >= n`.
    fn segment_elems(&self, i: usize) -> Range<usize> {
        if i >= self.n {
            return self.len_elems..self.len_elems;
        }
        let base = self.len_elems / self.n;
        let extra = self.len_elems % self.n;
        let start = i * base + i.min(extra);
        start..start + base + usize::from(i < extra)
    }

    /// Byte range of segment `i`; empty (at the end of the buffer) for `i >= n`.
    pub fn segment(&self, i: usize) -> Range<usize> {
        let r = self.segment_elems(i);
        r.start * self.elem_size..r.end * self.elem_size
    }

    /// Number of chunks of segment `i` (0 for an empty segment).
    pub fn chunk_count(&self, segment: usize) -> usize {
        self.segment_elems(segment).len().div_ceil(self.chunk_elems)
    }

    /// Byte range of chunk `c` of `segment`, if there is one.
    pub fn chunk(&self, segment: usize, c: usize) -> Option<Range<usize>> {
        let seg = self.segment_elems(segment);
        let start = seg.start.checked_add(c.checked_mul(self.chunk_elems)?)?;
        if start >= seg.end {
            return None;
        }
        let end = seg.end.min(start + self.chunk_elems);
        Some(start * self.elem_size..end * self.elem_size)
    }

    /// Byte ranges of the chunks of `segment`, in order; they tile the segment.
    pub fn chunks(&self, segment: usize) -> impl Iterator<Item = Range<usize>> + use<> {
        let seg = self.segment(segment);
        let step = self.chunk_bytes();
        let end = seg.end;
        seg.step_by(step).map(move |s| s..end.min(s + step))
    }

    /// Number of global steps, `2(n - 1)`.
    fn total_steps(&self) -> usize {
        2 * (self.n - 1)
    }

    /// Global step `g` (reduce-scatter steps, then all-gather steps). `g` must be below
    /// `2(n - 1)`.
    fn step_at(&self, g: usize) -> Step {
        let per = self.n - 1;
        let (phase, step) = if g < per { (Phase::ReduceScatter, g) } else { (Phase::AllGather, g - per) };
        Step { phase, step, send_segment: self.send_segment(g), recv_segment: self.recv_segment(g) }
    }

    fn global(&self, phase: Phase, step: usize) -> Option<usize> {
        let per = self.n - 1;
        if step >= per {
            return None;
        }
        Some(match phase {
            Phase::ReduceScatter => step,
            Phase::AllGather => per + step,
        })
    }

    /// Segment sent at global step `g`: `rank - g (mod n)`.
    fn send_segment(&self, g: usize) -> usize {
        (self.rank + self.n - g % self.n) % self.n
    }

    /// Segment received at global step `g`: `rank - g - 1 (mod n)`.
    fn recv_segment(&self, g: usize) -> usize {
        (self.rank + self.n - (g + 1) % self.n) % self.n
    }

    /// The step `step` of `phase`, if it exists (`step < n - 1`).
    pub fn step(&self, phase: Phase, step: usize) -> Option<Step> {
        self.global(phase, step).map(|g| self.step_at(g))
    }

    /// This rank's whole schedule: `n - 1` reduce-scatter steps, then `n - 1` all-gather
    /// steps. Empty for `n = 1`.
    pub fn steps(&self) -> impl Iterator<Item = Step> + use<> {
        let plan = self.clone();
        (0..self.total_steps()).map(move |g| plan.step_at(g))
    }

    /// The chunk transfers this rank sends in `step`.
    pub fn sends(&self, step: &Step) -> impl Iterator<Item = Transfer> + use<> {
        self.transfers(step.phase, step.step, step.send_segment)
    }

    /// The chunk transfers this rank receives in `step`.
    pub fn recvs(&self, step: &Step) -> impl Iterator<Item = Transfer> + use<> {
        self.transfers(step.phase, step.step, step.recv_segment)
    }

    fn transfers(&self, phase: Phase, step: usize, segment: usize) -> impl Iterator<Item = Transfer> + use<> {
        self.chunks(segment).enumerate().map(move |(chunk_index, range)| Transfer {
            phase,
            step,
            segment,
            chunk_index,
            range,
        })
    }

    fn transfer(&self, g: usize, segment: usize, chunk_index: usize) -> Option<Transfer> {
        let st = self.step_at(g);
        Some(Transfer {
            phase: st.phase,
            step: st.step,
            segment,
            chunk_index,
            range: self.chunk(segment, chunk_index)?,
        })
    }
}

#[cfg(test)]
mod tests;
