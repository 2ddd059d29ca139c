//! The memory a ring operation reduces in: a plain slice or a `CollectiveBuffer`.

use super::*;
use crate::collective::buffer::SharedWriter;

/// Accepts received transfer `id` and applies it to `buf` (whose range for it is not
/// lent), keeping the bytes that go on to the next node. `Avg` divides by `divisor`.
pub(super) fn apply_received<M: RingMemory>(
    state: &mut RingState,
    buf: &mut M,
    forwards: &mut HashMap<usize, (std::ops::Range<usize>, Bytes)>,
    id: u64,
    chunk: &Chunk,
    how: Reduction,
) -> Result<(), CollectiveError> {
    let action = state.on_received(id, chunk.len())?;
    let forward = match chunk {
        Chunk::Parts(parts) => buf.apply(&action, parts, how)?,
        Chunk::Applied { rest, .. } => buf.apply_rest(&action, rest, how)?,
    };
    if let Some(bytes) = forward {
        forwards.insert(action.range().start, (action.range(), bytes));
    }
    Ok(())
}

/// Applies what a direct sink could not take (`rest`: offset in the chunk, bytes) to
/// `dst`, the chunk's range, whose other bytes the sink reduced or copied already; then
/// finishes an `Avg` on the last reduce-scatter step. For a reduction, each run of
/// adjacent pieces must start and end on element boundaries (the sink takes only whole
/// elements, so what it leaves does).
fn reduce_rest(
    dst: &mut [u8],
    action: &Action,
    rest: &[(usize, Bytes)],
    how: Reduction,
) -> Result<(), CollectiveError> {
    let (reduce, last) = match action {
        Action::Reduce { last, .. } => (true, *last),
        Action::Copy { last, .. } => (false, *last),
    };
    let bad = CollectiveError::Direct;
    let mut pieces: Vec<&(usize, Bytes)> = rest.iter().collect();
    pieces.sort_unstable_by_key(|(at, _)| *at);
    let mut i = 0;
    while i < pieces.len() {
        // A run of adjacent pieces, joined when there are several.
        let start = pieces[i].0;
        let mut end = start;
        let mut j = i;
        while j < pieces.len() && pieces[j].0 == end {
            end += pieces[j].1.len();
            j += 1;
        }
        if j == i || end > dst.len() || (j < pieces.len() && pieces[j].0 < end) {
            return Err(bad(format!(
                "pieces left by the direct sink overlap or exceed the chunk at {start}"
            )));
        }
        let joined;
        let run: &[u8] = if j == i + 1 {
            &pieces[i].1
        } else {
            joined = pieces[i..j].iter().flat_map(|(_, b)| b.iter().copied()).collect::<Vec<u8>>();
            &joined
        };
        if reduce {
            meshd_proto::reduce::reduce_into(how.dtype, how.op, &mut dst[start..end], run)
                .map_err(|e| bad(format!("pieces left by the direct sink at {start}..{end}: {e}")))?;
        } else {
            dst[start..end].copy_from_slice(run);
        }
        i = j;
    }
    if reduce && last && how.op == ReduceOp::Avg {
        meshd_proto::reduce::finish_avg(how.dtype, dst, u32::try_from(how.divisor).unwrap_or(u32::MAX))
            .map_err(|e| bad(e.to_string()))?;
    }
    Ok(())
}

/// What the ring driver needs of the memory it reduces in: a plain slice (chunks sent are
/// copies) or a [`CollectiveBuffer`] (chunks sent are loans).
pub(super) trait RingMemory {
    fn len(&self) -> usize;
    /// Whether part of `range` is lent to the transport (and must not be written yet).
    fn is_lent(&self, range: &std::ops::Range<usize>) -> bool;
    /// The bytes of `range` to send as they are (a node's own step-0 chunks).
    fn send(&self, range: std::ops::Range<usize>) -> Bytes;
    /// A copy of the bytes of `range`.
    fn copy(&self, range: std::ops::Range<usize>) -> Bytes;
    /// Applies `action` (its range is not lent) and returns the bytes to send on, if any.
    fn apply(
        &mut self,
        action: &Action,
        parts: &[Bytes],
        how: Reduction,
    ) -> Result<Option<Bytes>, CollectiveError>;
    /// Applies `action` to a chunk whose bytes a direct sink reduced in place already,
    /// but for `rest`; returns the bytes to send on, as [`apply`](Self::apply). Only
    /// memory with a [`shared_writer`](Self::shared_writer) gets such chunks.
    fn apply_rest(
        &mut self,
        action: &Action,
        rest: &[(usize, Bytes)],
        how: Reduction,
    ) -> Result<Option<Bytes>, CollectiveError> {
        let _ = (action, rest, how);
        Err(CollectiveError::Direct("it arrived for memory that has no direct sink".into()))
    }
    /// A writer for the plane's direct sink, where this memory can have one.
    fn shared_writer(&self) -> Option<SharedWriter> {
        None
    }
    /// Notified when a loan ends.
    fn released(&self) -> Arc<Notify>;
    /// Replaces the whole buffer's bytes with `src` (nothing of it is lent).
    fn overwrite(&mut self, src: &[u8]) -> Result<(), CollectiveError>;
}

/// A caller's slice: every chunk sent is a copy.
pub(super) struct Plain<'a>(pub(super) &'a mut [u8]);

impl RingMemory for Plain<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn is_lent(&self, _: &std::ops::Range<usize>) -> bool {
        false
    }
    fn send(&self, range: std::ops::Range<usize>) -> Bytes {
        self.copy(range)
    }
    fn copy(&self, range: std::ops::Range<usize>) -> Bytes {
        Bytes::copy_from_slice(&self.0[range])
    }
    fn apply(
        &mut self,
        action: &Action,
        parts: &[Bytes],
        how: Reduction,
    ) -> Result<Option<Bytes>, CollectiveError> {
        // Reduce or copy straight from the received pieces (no gathering copy), making
        // the bytes sent on in the same pass.
        Ok(action.apply_forward(self.0, parts, how)?.map(Bytes::from))
    }
    fn released(&self) -> Arc<Notify> {
        Arc::new(Notify::new()) // nothing is lent
    }
    fn overwrite(&mut self, src: &[u8]) -> Result<(), CollectiveError> {
        self.0.copy_from_slice(src);
        Ok(())
    }
}

impl RingMemory for CollectiveBuffer {
    fn len(&self) -> usize {
        CollectiveBuffer::len(self)
    }
    fn is_lent(&self, range: &std::ops::Range<usize>) -> bool {
        CollectiveBuffer::is_lent(self, range)
    }
    fn send(&self, range: std::ops::Range<usize>) -> Bytes {
        self.lend(range)
    }
    fn copy(&self, range: std::ops::Range<usize>) -> Bytes {
        Bytes::copy_from_slice(self.slice(range))
    }
    fn apply(
        &mut self,
        action: &Action,
        parts: &[Bytes],
        how: Reduction,
    ) -> Result<Option<Bytes>, CollectiveError> {
        self.in_place(action, |dst| Ok(action.apply_to(dst, parts, how)?))
    }
    fn apply_rest(
        &mut self,
        action: &Action,
        rest: &[(usize, Bytes)],
        how: Reduction,
    ) -> Result<Option<Bytes>, CollectiveError> {
        self.in_place(action, |dst| reduce_rest(dst, action, rest, how))
    }
    fn shared_writer(&self) -> Option<SharedWriter> {
        Some(CollectiveBuffer::shared_writer(self))
    }
    fn released(&self) -> Arc<Notify> {
        CollectiveBuffer::released(self)
    }
    fn overwrite(&mut self, src: &[u8]) -> Result<(), CollectiveError> {
        let len = src.len();
        let dst = self.range_mut(0..len).ok_or(CollectiveError::BufferLent { range: 0..len })?;
        dst.copy_from_slice(src);
        Ok(())
    }
}

impl CollectiveBuffer {
    /// Applies a received chunk to its range with `write` (which must not be lent), in
    /// place; what goes on is a loan of the result (a partial sum until the last
    /// reduce-scatter step, which the all-gather overwrites once the loan ends), except
    /// after the last all-gather step.
    fn in_place(
        &mut self,
        action: &Action,
        write: impl FnOnce(&mut [u8]) -> Result<(), CollectiveError>,
    ) -> Result<Option<Bytes>, CollectiveError> {
        let range = action.range();
        let dst = self
            .range_mut(range.clone())
            .ok_or_else(|| CollectiveError::BufferLent { range: range.clone() })?;
        write(dst)?;
        Ok((!matches!(action, Action::Copy { last: true, .. })).then(|| self.lend(range)))
    }
}
