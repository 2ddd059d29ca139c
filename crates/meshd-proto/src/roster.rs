//! An agreed roster: who is in a round of the job, in node-rank order (master first), and
//! what each member runs. A leaf: the rendezvous agrees on it, the preflight and the
//! lifecycle read it.

use crate::id::NodeId;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// One node in an agreed roster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RosterMember {
    /// Node identity.
    pub id: NodeId,
    /// Its address on the chosen interface (meshd's port).
    pub addr: SocketAddr,
    /// Processes it starts.
    pub nproc: u32,
    /// Host name (messages only).
    pub hostname: String,
}

/// The agreed job layout. Node rank = index in `members`; member 0 is the master.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Roster {
    /// Run this roster belongs to.
    pub run_hash: u64,
    /// Restart round (TORCHELASTIC_RESTART_COUNT).
    pub restart: u32,
    /// Proposal number, unique per restart round.
    pub epoch: u64,
    /// A free TCP port on the master (MASTER_PORT).
    pub master_port: u16,
    /// Members ordered by address on the chosen interface.
    pub members: Vec<RosterMember>,
}

impl Roster {
    /// Total number of processes (saturating: a roster that overflows is never agreed, see
    /// [`Roster::checked_world_size`]).
    pub fn world_size(&self) -> u32 {
        self.checked_world_size().unwrap_or(u32::MAX)
    }

    /// Total number of processes, or `None` when it does not fit a `u32` (a hostile or
    /// broken proposal: refused before any acknowledgement).
    pub fn checked_world_size(&self) -> Option<u32> {
        self.members.iter().try_fold(0u32, |acc, m| acc.checked_add(m.nproc))
    }

    /// The master (node rank 0).
    pub fn master(&self) -> Option<&RosterMember> {
        self.members.first()
    }

    /// Node rank of `id`.
    pub fn node_rank(&self, id: NodeId) -> Option<usize> {
        self.members.iter().position(|m| m.id == id)
    }

    /// Global rank of local rank 0 on node `rank`.
    pub fn first_global_rank(&self, node_rank: usize) -> u32 {
        self.members[..node_rank.min(self.members.len())]
            .iter()
            .fold(0u32, |acc, m| acc.saturating_add(m.nproc))
    }
}
