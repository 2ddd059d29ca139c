//! Data streams kept for an operation other than the one being run.

use super::*;

/// Data streams that arrived for an operation other than the one being run, oldest first.
///
/// A neighbour is at most one operation ahead (each operation needs every node's data), so
/// at most `MAX_LANES` streams per peer are waiting legitimately. Streams of an operation
/// this node never ran (it failed here before it started) would wait forever, and each
/// holds one of the connection's 64 concurrent streams (`transport`): after 64 of them the
/// peer could not open another. So a peer keeps at most [`STASH_PER_PEER`] streams, and the
/// oldest goes first.
#[derive(Debug)]
pub(super) struct Stash<T> {
    waiting: VecDeque<(SocketAddr, u64, T)>,
}

/// Streams kept per peer: twice the most a neighbour one operation ahead can open.
pub(super) const STASH_PER_PEER: usize = 2 * MAX_LANES;

impl<T> Default for Stash<T> {
    fn default() -> Self {
        Stash { waiting: VecDeque::new() }
    }
}

impl<T> Stash<T> {
    /// The oldest stream kept from `peer` for `op`.
    pub(super) fn take(&mut self, peer: SocketAddr, op: u64) -> Option<T> {
        let i = self.waiting.iter().position(|(p, o, _)| *p == peer && *o == op)?;
        self.waiting.remove(i).map(|(_, _, t)| t)
    }

    /// Keeps a stream; returns the peer's oldest one (its operation and the stream, to be
    /// dropped) when the peer has more than [`STASH_PER_PEER`].
    pub(super) fn put(&mut self, peer: SocketAddr, op: u64, t: T) -> Option<(u64, T)> {
        self.waiting.push_back((peer, op, t));
        if self.waiting.iter().filter(|(p, _, _)| *p == peer).count() <= STASH_PER_PEER {
            return None;
        }
        let i = self.waiting.iter().position(|(p, _, _)| *p == peer)?;
        self.waiting.remove(i).map(|(_, o, t)| (o, t))
    }
}
