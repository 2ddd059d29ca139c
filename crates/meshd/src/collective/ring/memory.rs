//! The memory a ring operation reduces in: a plain slice or a `CollectiveBuffer`.

use super::*;

/// Accepts received transfer `id` and applies it to `buf` (whose range for it is not
/// lent), keeping the bytes that go on to the next node. `Avg` divides by `divisor`.
pub(super) fn apply_received<M: RingMemory>(
    state: &mut RingState,
    buf: &mut M,
    forwards: &mut HashMap<usize, (std::ops::Range<usize>, Bytes)>,
    id: u64,
    parts: &[Bytes],
    how: Reduction,
) -> Result<(), CollectiveError> {
    let len = parts.iter().map(|p| p.len()).sum();
    let action = state.on_received(id, len)?;
    if let Some(bytes) = buf.apply(&action, parts, how)? {
        forwards.insert(action.range().start, (action.range(), bytes));
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
        Bytes::copy_from_slice(&self.as_slice()[range])
    }
    fn apply(
        &mut self,
        action: &Action,
        parts: &[Bytes],
        how: Reduction,
    ) -> Result<Option<Bytes>, CollectiveError> {
        let range = action.range();
        let dst = self
            .range_mut(range.clone())
            .ok_or_else(|| CollectiveError::BufferLent { range: range.clone() })?;
        // In place; what goes on is a loan of the result (a partial sum until the
        // last reduce-scatter step, which the all-gather overwrites once the loan ends).
        action.apply_to(dst, parts, how)?;
        Ok((!matches!(action, Action::Copy { last: true, .. })).then(|| self.lend(range)))
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
