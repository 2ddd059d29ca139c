//! Small allreduces go direct: every node sends its buffer to every other node, and each
//! reduces all contributions itself, instead of going around the ring.

use super::{Reduction, RingError};
use crate::reduce::{self, ReduceError, ReduceOp};

/// Allreduces of at most this many bytes, among at most [`DIRECT_MAX_WORLD`] nodes, go
/// straight from every node to every other node, and each node reduces all contributions
/// itself: one hop instead of the ring's 2(n-1), each of which waits for the one before.
/// Part of the wire protocol: every node must choose the same way ([`is_direct`]). The
/// limit is the largest size at which going direct was still faster on the lab
/// (docs/PERFORMANCE.md, "Small allreduces go direct").
pub const DIRECT_MAX_BYTES: usize = 64 << 10;
/// Most nodes for a direct allreduce: each node sends n - 1 copies of its buffer.
pub const DIRECT_MAX_WORLD: usize = 16;
/// The transfer id of a direct contribution. No [`RingPlan`](super::RingPlan) produces it (its step would
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
