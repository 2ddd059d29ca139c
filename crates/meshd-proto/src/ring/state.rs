//! One rank's progress through a ring allreduce, fed by a driver that does the IO.

use super::{Action, RingError, RingPlan, Transfer, decode_transfer_id};
use std::collections::VecDeque;

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
    pub(super) plan: RingPlan,
    /// Chunk slots per step: the chunk count of the largest segment.
    pub(super) stride: usize,
    /// One bit per (global step, chunk index): received.
    pub(super) received: Vec<u64>,
    /// Sendable (global step, chunk index), in the order they became sendable.
    pub(super) ready: VecDeque<(usize, usize)>,
    pub(super) sends_left: usize,
    pub(super) recvs_left: usize,
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
