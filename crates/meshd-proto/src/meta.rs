//! What a node tells the mesh about itself; carried by membership gossip.

use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};

/// The life cycle of a node as others see it.
///
/// Displayed (and serialized by name, as in `meshd status --json`) in lowercase: `waiting`,
/// `running`, `done`, `failed`. On the wire (postcard) it is the variant's index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    /// Joined the mesh, waiting for the roster.
    #[default]
    Waiting,
    /// Its ranks are running.
    Running,
    /// Its ranks all exited 0.
    Done,
    /// A rank failed or the node is stopping the job.
    Failed,
}

impl NodeState {
    /// The word `meshd status` shows.
    pub fn name(self) -> &'static str {
        match self {
            NodeState::Waiting => "waiting",
            NodeState::Running => "running",
            NodeState::Done => "done",
            NodeState::Failed => "failed",
        }
    }
}

impl std::fmt::Display for NodeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad`, not `write_str`: tables align these words with width specifiers.
        f.pad(self.name())
    }
}

/// One address of a local interface.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IfaceAddr {
    /// Interface name (eth1).
    pub name: String,
    /// Address on it.
    pub addr: IpAddr,
}

/// Everything a node advertises. Later fields are appended only (wire compatibility).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct NodeMeta {
    /// Where this node's meshd answers (chosen interface address : meshd port).
    pub gossip_addr: Option<SocketAddr>,
    /// Host name, for messages only.
    pub hostname: String,
    /// The interface this node chose and its address there.
    pub iface: String,
    /// Every address of every interface (for address proof and `meshd status`).
    pub addrs: Vec<IfaceAddr>,
    /// Number of local processes it will start (GPUs, or `--nproc-per-node`).
    pub nproc: u32,
    /// GPUs visible through the CUDA driver (0 if none or no driver).
    pub gpus: u32,
    /// CUDA driver version as reported by cuDriverGetVersion (0 if none).
    pub cuda_driver: u32,
    /// NCCL version code (0 if libnccl is not loadable).
    pub nccl_version: u32,
    /// meshd's version string.
    pub meshd_version: String,
    /// Hash of the job's command line (agreement check before launch).
    pub cmd_hash: u64,
    /// Hash of the run id: nodes of different runs never mix.
    pub run_hash: u64,
    /// Where it is in the job.
    pub state: NodeState,
    /// Restarts done so far.
    pub restarts: u32,
    /// `--nnodes` MIN this node was started with (nodes that disagree never form a roster:
    /// the others name the disagreement instead of waiting in silence).
    pub nnodes_min: u32,
    /// `--nnodes` MAX this node was started with.
    pub nnodes_max: u32,
}
