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

use crate::reduce::{self, DType, ReduceError, ReduceOp};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
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

/// Allreduces of at most this many bytes, among at most [`DIRECT_MAX_WORLD`] nodes, go
/// straight from every node to every other node, and each node reduces all contributions
/// itself: one hop instead of the ring's 2(n-1), each of which waits for the one before.
/// Part of the wire protocol: every node must choose the same way ([`is_direct`]). The
/// limit is the largest size at which going direct was still faster on the lab
/// (docs/PERFORMANCE.md, "Small allreduces go direct").
pub const DIRECT_MAX_BYTES: usize = 64 << 10;
/// Most nodes for a direct allreduce: each node sends n - 1 copies of its buffer.
pub const DIRECT_MAX_WORLD: usize = 16;
/// The transfer id of a direct contribution. No [`RingPlan`] produces it (its step would
/// be 2^31 - 1), so a node that runs the ring where its neighbour went direct, or the
/// other way round, finds out at the first header.
pub const DIRECT_TRANSFER_ID: u64 = u64::MAX;

/// Whether an allreduce of `len_bytes` across `world` nodes goes direct rather than
/// around the ring.
pub fn is_direct(world: usize, len_bytes: usize) -> bool {
    (2..=DIRECT_MAX_WORLD).contains(&world) && len_bytes <= DIRECT_MAX_BYTES
}

/// The result of a direct allreduce into `out`: every node's contribution (in rank order,
/// so every node computes the same bits whatever order they arrived in) reduced with
/// `how.op`, and for `Avg` divided by `how.divisor`.
pub fn direct_reduce<P: AsRef<[u8]>>(
    contributions: &[P],
    how: Reduction,
    out: &mut [u8],
) -> Result<(), RingError> {
    let Reduction { dtype, op, divisor } = how;
    let Some((first, rest)) = contributions.split_first() else {
        return Err(ReduceError::LengthMismatch { acc: out.len(), other: 0 }.into());
    };
    let first = first.as_ref();
    if first.len() != out.len() {
        return Err(ReduceError::LengthMismatch { acc: out.len(), other: first.len() }.into());
    }
    out.copy_from_slice(first);
    for c in rest {
        reduce::reduce_into(dtype, op, out, c.as_ref())?;
    }
    if op == ReduceOp::Avg {
        reduce::finish_avg(dtype, out, u32::try_from(divisor).unwrap_or(u32::MAX))?;
    }
    Ok(())
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

/// How received chunks are combined: the element type, the operation, and what `Avg`
/// divides by (the number of nodes whose data is summed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Reduction {
    /// Element type.
    pub dtype: DType,
    /// Element-wise operation.
    pub op: ReduceOp,
    /// `Avg` divides the sum by this (the world size); other operations ignore it.
    pub divisor: usize,
}

/// What to do with a received chunk's payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Reduce the payload into `transfer.range` of the local buffer.
    Reduce {
        /// The transfer received.
        transfer: Transfer,
        /// This was the last reduce-scatter step: the chunk is now final and belongs to
        /// the owned segment (an `Avg` divides it here, once, before it is sent on).
        last: bool,
    },
    /// Copy the payload over `transfer.range` of the local buffer.
    Copy {
        /// The transfer received.
        transfer: Transfer,
        /// This was the last all-gather step: the chunk is not sent on.
        last: bool,
    },
}

impl Action {
    /// The transfer this action applies.
    pub fn transfer(&self) -> &Transfer {
        match self {
            Action::Reduce { transfer, .. } | Action::Copy { transfer, .. } => transfer,
        }
    }

    /// Byte range of the local buffer the payload lands in.
    pub fn range(&self) -> Range<usize> {
        self.transfer().range.clone()
    }

    /// Applies the payload to `buf`: reduces or copies, and for `Avg` divides a final
    /// chunk by `how.divisor`, so the divided bytes are what the all-gather spreads.
    pub fn apply(&self, buf: &mut [u8], payload: &[u8], how: Reduction) -> Result<(), RingError> {
        self.apply_parts(buf, &[payload], how)
    }

    /// The chunk's range of `buf`, once `parts` is known to fill it exactly.
    fn target<'b, P: AsRef<[u8]>>(&self, buf: &'b mut [u8], parts: &[P]) -> Result<&'b mut [u8], RingError> {
        let dst = self.chunk_of(buf)?;
        fills(dst, parts)?;
        Ok(dst)
    }

    /// The chunk's range of `buf`, if `buf` is long enough.
    fn chunk_of<'b>(&self, buf: &'b mut [u8]) -> Result<&'b mut [u8], RingError> {
        let (range, have) = (self.range(), buf.len());
        buf.get_mut(range.clone()).ok_or(RingError::BufferTooSmall { need: range.end, have })
    }

    /// [`Action::apply`] for a payload that arrives in pieces (a transport's received
    /// segments), without first gathering them into one buffer. Pieces may split an
    /// element anywhere; the result is bitwise the same as applying the joined payload.
    pub fn apply_parts<P: AsRef<[u8]>>(
        &self,
        buf: &mut [u8],
        parts: &[P],
        how: Reduction,
    ) -> Result<(), RingError> {
        self.apply_to(self.chunk_of(buf)?, parts, how)
    }

    /// [`Action::apply_parts`] onto `dst`, the chunk's own bytes (`range()` of the buffer)
    /// rather than the whole buffer: for a driver that must not hold a reference to the
    /// rest of its buffer (ranges of it are being sent).
    pub fn apply_to<P: AsRef<[u8]>>(
        &self,
        dst: &mut [u8],
        parts: &[P],
        how: Reduction,
    ) -> Result<(), RingError> {
        let Reduction { dtype, op, divisor: n } = how;
        if dst.len() != self.range().len() {
            return Err(ReduceError::LengthMismatch { acc: dst.len(), other: self.range().len() }.into());
        }
        fills(dst, parts)?;
        if !matches!(self, Action::Reduce { .. }) {
            copy_parts(dst, parts, |_| {});
            return Ok(());
        }
        for_elements(parts, dtype, dst.len(), |at, p| {
            Ok(reduce::reduce_into(dtype, op, &mut dst[at..at + p.len()], p)?)
        })?;
        if let Action::Reduce { last: true, .. } = self {
            if op == ReduceOp::Avg {
                reduce::finish_avg(dtype, dst, u32::try_from(n).unwrap_or(u32::MAX))?;
            }
        }
        Ok(())
    }

    /// [`Action::apply_parts`], and in the same pass over the data the bytes this rank
    /// sends next for the same chunk (`None` after the last all-gather step, which is
    /// not sent on). Saves the driver copying the chunk out of `buf` afterwards.
    ///
    /// A reduce-scatter chunk that is only passed on (every step but the last) is not
    /// written to `buf` at all: its partial sum is what travels, and the all-gather
    /// overwrites that range of `buf` with the final value before this rank reads it
    /// again. Every other action leaves `buf` exactly as `apply_parts` would.
    pub fn apply_forward<P: AsRef<[u8]>>(
        &self,
        buf: &mut [u8],
        parts: &[P],
        how: Reduction,
    ) -> Result<Option<Vec<u8>>, RingError> {
        let Reduction { dtype, op, divisor: n } = how;
        if let Action::Copy { last: true, .. } = self {
            self.apply_parts(buf, parts, how)?;
            return Ok(None);
        }
        let dst = self.target(buf, parts)?;
        let mut out = Vec::with_capacity(dst.len());
        match self {
            Action::Copy { .. } => copy_parts(dst, parts, |p| out.extend_from_slice(p)),
            // Piece by piece (about a packet each, so the block stays in L1 cache):
            // copy the local partial sum out, add the received one to it.
            Action::Reduce { last: false, .. } => for_elements(parts, dtype, dst.len(), |at, p| {
                let end = out.len() + p.len();
                out.extend_from_slice(&dst[at..at + p.len()]);
                Ok(reduce::reduce_into(dtype, op, &mut out[at..end], p)?)
            })?,
            Action::Reduce { last: true, .. } => {
                let avg = (op == ReduceOp::Avg).then(|| u32::try_from(n).unwrap_or(u32::MAX));
                for_elements(parts, dtype, dst.len(), |at, p| {
                    let block = &mut dst[at..at + p.len()];
                    reduce::reduce_into(dtype, op, block, p)?;
                    if let Some(n) = avg {
                        reduce::finish_avg(dtype, block, n)?;
                    }
                    out.extend_from_slice(block);
                    Ok(())
                })?
            }
        }
        Ok(Some(out))
    }
}

/// Checks that `parts` together are exactly as long as `dst`.
fn fills<P: AsRef<[u8]>>(dst: &[u8], parts: &[P]) -> Result<(), RingError> {
    let total: usize = parts.iter().map(|p| p.as_ref().len()).sum();
    if total != dst.len() {
        return Err(ReduceError::LengthMismatch { acc: dst.len(), other: total }.into());
    }
    Ok(())
}

/// Copies `parts` one after another into `dst`, handing each to `also` as well.
fn copy_parts<P: AsRef<[u8]>>(dst: &mut [u8], parts: &[P], mut also: impl FnMut(&[u8])) {
    let mut at = 0;
    for p in parts {
        let p = p.as_ref();
        dst[at..at + p.len()].copy_from_slice(p);
        also(p);
        at += p.len();
    }
}

/// Walks a payload that arrives in `parts` as runs of whole `dtype` elements: calls
/// `f(offset, run)` in order, re-joining an element split across two parts in a small
/// buffer. `len` (the payload's total length) must be a whole number of elements.
fn for_elements<P: AsRef<[u8]>>(
    parts: &[P],
    dtype: DType,
    len: usize,
    mut f: impl FnMut(usize, &[u8]) -> Result<(), RingError>,
) -> Result<(), RingError> {
    let es = dtype.size();
    if len % es != 0 {
        return Err(ReduceError::NotMultiple { len, size: es, dtype }.into());
    }
    let (mut at, mut carry, mut carried) = (0usize, [0u8; 16], 0usize);
    for part in parts {
        let mut p = part.as_ref();
        if carried > 0 {
            // Finish the element split across the previous piece and this one.
            let take = (es - carried).min(p.len());
            carry[carried..carried + take].copy_from_slice(&p[..take]);
            carried += take;
            p = &p[take..];
            if carried < es {
                continue;
            }
            f(at, &carry[..es])?;
            at += es;
        }
        let whole = p.len() / es * es;
        if whole > 0 {
            f(at, &p[..whole])?;
            at += whole;
        }
        let rest = &p[whole..];
        carry[..rest.len()].copy_from_slice(rest);
        carried = rest.len();
    }
    Ok(())
}

/// One rank's progress through its [`RingPlan`], for a driver that does the IO.
///
/// Contract: the driver applies each [`Action`] to its buffer before its next call to
/// [`RingState::poll_send`], and copies (or sends) a transfer's range out of the buffer
/// before it applies further actions. A driver that sends what [`Action::apply_forward`]
/// returns may instead go on receiving and applying while sendable transfers wait for
/// room on the link (and must, or a ring whose segments outgrow the links' buffers
/// deadlocks): the only transfers it still copies out of the buffer are its own step-0
/// chunks, and no action writes such a chunk's range before that chunk has been sent
/// around the whole ring. A driver that sends ranges of its buffer without copying them
/// (lends them to a transport that may retransmit) must not write a lent range: it holds
/// a received transfer back, without calling [`RingState::on_received`], until the loan
/// ends, and then applies the action in place ([`Action::apply_to`]). Memory is fixed at
/// construction (a bit per
/// expected transfer and a queue of at most one entry per expected transfer): nothing a
/// peer sends makes it grow.
#[derive(Clone, Debug)]
pub struct RingState {
    plan: RingPlan,
    /// Chunk slots per step: the chunk count of the largest segment.
    stride: usize,
    /// One bit per (global step, chunk index): received.
    received: Vec<u64>,
    /// Sendable (global step, chunk index), in the order they became sendable.
    ready: VecDeque<(usize, usize)>,
    sends_left: usize,
    recvs_left: usize,
}

impl RingState {
    /// The start of the allreduce: every chunk of this rank's own segment is sendable.
    pub fn new(plan: RingPlan) -> RingState {
        let total = plan.total_steps();
        let stride = plan.chunk_count(0); // segment 0 is never smaller than another
        let sends_left: usize = (0..total).map(|g| plan.chunk_count(plan.send_segment(g))).sum();
        let recvs_left: usize = (0..total).map(|g| plan.chunk_count(plan.recv_segment(g))).sum();
        let mut ready = VecDeque::new();
        if total > 0 {
            ready.extend((0..plan.chunk_count(plan.send_segment(0))).map(|c| (0, c)));
        }
        RingState {
            received: vec![0; (total * stride).div_ceil(64)],
            plan,
            stride,
            ready,
            sends_left,
            recvs_left,
        }
    }

    /// The plan this state follows.
    pub fn plan(&self) -> &RingPlan {
        &self.plan
    }

    /// The next chunk that may be sent to rank + 1, if any. Call until `None` after
    /// [`RingState::new`] and after each accepted [`RingState::on_received`].
    pub fn poll_send(&mut self) -> Option<Transfer> {
        let (g, c) = self.ready.pop_front()?;
        self.sends_left -= 1;
        self.plan.transfer(g, self.plan.send_segment(g), c)
    }

    /// What an incoming transfer from rank - 1 is, without accepting it: lets a driver
    /// check a frame's header (and size its read) before taking the payload.
    pub fn expect(&self, id: u64) -> Result<Transfer, RingError> {
        let (g, c) = self.locate(id)?;
        if self.is_received(g, c) {
            return Err(RingError::DuplicateTransfer(id));
        }
        self.plan.transfer(g, self.plan.recv_segment(g), c).ok_or(RingError::UnknownTransfer(id))
    }

    /// Accepts transfer `id` carrying `len` payload bytes from rank - 1 and says where
    /// the payload goes. Unknown or duplicate ids and wrong lengths are refused, with no
    /// change to the state.
    pub fn on_received(&mut self, id: u64, len: usize) -> Result<Action, RingError> {
        let transfer = self.expect(id)?;
        if transfer.range.len() != len {
            return Err(RingError::WrongLength { id, expected: transfer.range.len(), got: len });
        }
        let (g, c) = self.locate(id)?;
        let bit = g * self.stride + c;
        if let Some(word) = self.received.get_mut(bit / 64) {
            *word |= 1 << (bit % 64);
        }
        self.recvs_left -= 1;
        if g + 1 < self.plan.total_steps() {
            self.ready.push_back((g + 1, c));
        }
        let per = self.plan.steps_per_phase();
        let last = g + 1 == per || g + 1 == self.plan.total_steps();
        Ok(if g < per { Action::Reduce { transfer, last } } else { Action::Copy { transfer, last } })
    }

    /// Every transfer sent (polled) and received. Immediately true for `n = 1`.
    pub fn is_done(&self) -> bool {
        self.sends_left == 0 && self.recvs_left == 0
    }

    /// Transfers still to be received.
    pub fn recvs_left(&self) -> usize {
        self.recvs_left
    }

    /// Transfers still to be sent (sendable now or later).
    pub fn sends_left(&self) -> usize {
        self.sends_left
    }

    /// `(global step, chunk index)` of an id this rank could receive, else an error.
    fn locate(&self, id: u64) -> Result<(usize, usize), RingError> {
        let (phase, step, c) = decode_transfer_id(id);
        let g = self.plan.global(phase, step).ok_or(RingError::UnknownTransfer(id))?;
        if c >= self.plan.chunk_count(self.plan.recv_segment(g)) {
            return Err(RingError::UnknownTransfer(id));
        }
        Ok((g, c))
    }

    fn is_received(&self, g: usize, c: usize) -> bool {
        let bit = g * self.stride + c;
        self.received.get(bit / 64).is_some_and(|w| w & (1 << (bit % 64)) != 0)
    }
}

#[cfg(test)]
mod tests;
