//! What a rank does with a received chunk: reduce it into its buffer or copy it over, and
//! what it sends on.

use super::{RingError, Transfer};
use crate::reduce::{self, DType, ReduceError, ReduceOp};
use std::ops::Range;

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
