//! What a [`Node`](super::Node) is started with: identity, sizes, what it reports in the
//! preflight, and the lifecycle's timing.

use crate::id::NodeId;
use crate::membership::MembershipConfig;
use crate::meta::NodeMeta;
use crate::rendezvous::RdzvConfig;
use std::net::SocketAddr;
use std::time::Duration;

/// Everything a node core needs; nothing in it is read from the environment.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// This node.
    pub id: NodeId,
    /// Where this node answers (chosen interface address : meshd port).
    pub addr: SocketAddr,
    /// What it advertises; `state` and `restarts` are the core's to set.
    pub meta: NodeMeta,
    /// Addresses to join through.
    pub seeds: Vec<SocketAddr>,
    /// Membership tuning.
    pub membership: MembershipConfig,
    /// Rendezvous sizes and timing.
    pub rdzv: RdzvConfig,
    /// Give up waiting for a roster after this (per job, restart rounds included).
    pub rdzv_timeout: Duration,
    /// The preflight's limit for the port and report exchanges.
    pub preflight_timeout: Duration,
    /// Restarts allowed after a failure.
    pub max_restarts: u32,
    /// What this node contributes to the preflight besides its TCP findings.
    pub report: LocalFacts,
    /// Seed of the core's own random choices (membership probe order): runs replay.
    pub seed: u64,
    /// Resend periods and grace times.
    pub timing: Timing,
    /// The job-wide store's limits and timing (the same on every node of a job).
    pub store: crate::store::StoreConfig,
    /// What a failure stops (`--fault-tolerance`): the whole job, or one node's replica group.
    pub fault_tolerance: FaultTolerance,
    /// The torchft Lighthouse's quorum rules (`--fault-tolerance node`; its tag is the
    /// decider's own).
    pub lighthouse: crate::lighthouse::LighthouseConfig,
}

/// What a failure stops (`--fault-tolerance`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FaultTolerance {
    /// Any failure stops every rank on every node; `--max-restarts` restarts them all.
    #[default]
    Job,
    /// Each node is one replica group (torchft's sense): a failing rank restarts its own
    /// node's ranks only (`--max-restarts` per node), a lost node leaves the job while the
    /// others go on, a node started later joins the running job; the job stops everywhere
    /// only when fewer than MIN groups remain.
    Node,
}

/// The preflight facts of this node (compared across the roster).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalFacts {
    /// Command line (shortened), for messages.
    pub cmd: String,
    /// Hash of the full command.
    pub cmd_hash: u64,
    /// Processes this node starts.
    pub nproc: u32,
    /// GPUs found.
    pub gpus: u32,
    /// CUDA driver version.
    pub cuda_driver: u32,
    /// NCCL version code.
    pub nccl_version: u32,
    /// MTU of the chosen interface.
    pub mtu: u32,
    /// Chosen interface.
    pub iface: String,
    /// `--collective` when forced.
    pub forced: Option<crate::preflight::Collective>,
    /// The tunnel may carry the ranks' TCP when TCP between nodes is blocked: the mesh has
    /// a token (the same on every node: a node without one cannot join a mesh with one).
    /// Without a token anyone who reaches the UDP port could reach the ranks' ports.
    pub tunnel: bool,
}

/// Periods and bounds of the job lifecycle. The defaults are what `meshd run` uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timing {
    /// `Abort` is repeated this often to roster members that did not acknowledge it.
    pub abort_resend: Duration,
    /// `Abort` stops being repeated after this long (a member that neither answers nor is
    /// declared dead by then is beyond reach).
    pub abort_give_up: Duration,
    /// A node that ends after an abort waits at most this long for the acknowledgements.
    pub abort_linger: Duration,
    /// `Done` is repeated this often until every member said it.
    pub done_resend: Duration,
    /// After every member said `Done`, keep answering this long so our last `Done` arrives.
    pub done_linger: Duration,
    /// A member that left without `Done` is blamed only if no `Abort` explains it by then.
    pub left_grace: Duration,
    /// When the preflight refuses the launch, members exchange `Done` for at most this long.
    pub refuse_wait: Duration,
    /// First progress line while waiting for nodes, then one every `progress_every`.
    pub progress_first: Duration,
    /// See `progress_first`.
    pub progress_every: Duration,
    /// Roster sizes up to this dial every other member in the preflight; larger ones dial
    /// the master and a skip ring (distances 1, 2, 4, ...), so the preflight stays
    /// O(N log N) connections.
    pub dial_all_up_to: usize,
}

impl Default for Timing {
    fn default() -> Self {
        let ms = Duration::from_millis;
        Timing {
            abort_resend: ms(300),
            abort_give_up: Duration::from_secs(30),
            abort_linger: ms(1000),
            done_resend: ms(500),
            done_linger: ms(600),
            left_grace: Duration::from_secs(2),
            refuse_wait: Duration::from_secs(3),
            progress_first: Duration::from_secs(2),
            progress_every: Duration::from_secs(5),
            dial_all_up_to: 64,
        }
    }
}
