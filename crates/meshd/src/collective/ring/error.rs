//! What a collective operation can fail with, and how a stall is worded.

use super::*;

/// Collective failures.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The schedule rejected something (a peer sent an unexpected chunk, bad sizes).
    #[error("ring: {0}")]
    Ring(#[from] RingError),
    /// The link to a neighbour failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A neighbour's stream broke or closed early.
    #[error("ring link with {peer} broke: {reason}")]
    Link {
        /// The neighbour.
        peer: SocketAddr,
        /// What happened.
        reason: String,
    },
    /// A neighbour did not start the operation in time.
    #[error("node {peer} did not join collective operation {op} within {timeout:?}")]
    Timeout {
        /// The neighbour.
        peer: SocketAddr,
        /// The operation.
        op: u64,
        /// How long we waited.
        timeout: Duration,
    },
    /// The buffer has an incomplete element at its end.
    #[error("buffer of {len} bytes is not a whole number of {dtype} elements")]
    Misaligned {
        /// The buffer's length in bytes.
        len: usize,
        /// Its element type.
        dtype: DType,
    },
    /// Part of the buffer is still lent to the transport (an earlier operation's chunks
    /// being sent) where this one must write.
    #[error("ring: bytes {range:?} of the buffer are still being sent")]
    BufferLent {
        /// The bytes that could not be written.
        range: std::ops::Range<usize>,
    },
    /// A broadcast named a root that is not a node of the ring.
    #[error("broadcast root {root} is not a node (world {world})")]
    NoSuchRoot {
        /// The root asked for.
        root: usize,
        /// Nodes in the ring.
        world: usize,
    },
    /// A chunk the data plane's driver reduced as its datagrams opened could not be
    /// finished (what it left over did not fit the chunk).
    #[error("ring: a chunk reduced as it arrived: {0}")]
    Direct(String),
    /// The local reduction failed (an element type the operation does not support).
    #[error(transparent)]
    Reduce(#[from] meshd_proto::reduce::ReduceError),
    /// A neighbour's link is up but the operation moved no byte from it (or to it, when
    /// only sends are left) for `timeout`.
    #[error("{}", stalled_text(*.peer, *.node, *.op, *.timeout, *.sending))]
    Stalled {
        /// The neighbour.
        peer: SocketAddr,
        /// Its node id, when connected.
        node: Option<NodeId>,
        /// The operation.
        op: u64,
        /// How long nothing moved.
        timeout: Duration,
        /// Whether it was the neighbour taking our data that stalled (else: sending us its).
        sending: bool,
    },
}

/// The operation's sequence number and restart round, as the service numbers it.
pub(super) fn op_name(op: u64) -> String {
    match op >> 40 {
        0 => format!("collective operation #{}", op & ((1 << 40) - 1)),
        r => format!("collective operation #{} (restart round {r})", op & ((1 << 40) - 1)),
    }
}

fn stalled_text(peer: SocketAddr, node: Option<NodeId>, op: u64, timeout: Duration, sending: bool) -> String {
    let who = match node {
        Some(n) => format!("node {n} ({peer})"),
        None => format!("node {peer}"),
    };
    if sending {
        format!(
            "{who} took no data for {timeout:?} in {}: its link is up, but its collective stalled",
            op_name(op)
        )
    } else {
        format!(
            "no data from {who} for {timeout:?} in {}: its link is up, but its collective stalled",
            op_name(op)
        )
    }
}
