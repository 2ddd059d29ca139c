//! The library's entry point: [`Node::spawn`] starts a node whose actor runs on its own
//! (answering probes, forming rosters, running the preflight, Done and Abort) and returns
//! a [`NodeHandle`] to wait for the roster, read the members, open collectives, abort and
//! finish. `meshd run` uses the same actor with its job's IO edges (`crate::job`).

pub(crate) mod actor;
pub(crate) mod edge;
pub(crate) mod library;

pub use library::Snapshot;

use crate::collective::{RingConfig, RingNet};
use crate::interfaces::Choice;
use crate::mesh::{Mesh, MeshConfig, MeshError, stable_hash};
use crate::preflight::PreflightInput;
use crate::transport::{DataStream, Transport};
use actor::{Actor, NcclPolicy};
use edge::Command;
use library::Library;
use meshd_proto::NodeId;
use meshd_proto::membership::MemberView;
use meshd_proto::node::{self as core, LocalFacts, Outcome, Timing};
use meshd_proto::preflight::Verdict;
use meshd_proto::rendezvous::{RdzvConfig, Roster};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

/// How long the preflight's port and report exchanges may take.
pub const PREFLIGHT_TIMEOUT: Duration = Duration::from_secs(20);

/// How to start a library node.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Identity, port, token, run id, peers, sizes.
    pub mesh: MeshConfig,
    /// Rendezvous sizes and timing (by default from `mesh.min_nodes` / `max_nodes`).
    pub rdzv: RdzvConfig,
    /// Give up waiting for a roster after this.
    pub rdzv_timeout: Duration,
    /// Rounds that may follow a failure ([`NodeHandle::abort`], a member that died).
    pub max_restarts: u32,
    /// What this node reports in the preflight (compared across the roster).
    pub preflight: PreflightInput,
    /// The QUIC ring's lanes and chunk size for [`NodeHandle::ring`].
    pub ring: RingConfig,
    /// Make the round's NCCL unique id when master. Only a `meshd` binary can (the id's
    /// root runs as `meshd __nccl-root`); library programs leave this false.
    pub make_nccl_id: bool,
}

impl NodeConfig {
    /// A fixed-size configuration from `mesh` (its MIN:MAX, a 60 s rendezvous timeout, no
    /// restarts).
    pub fn new(mesh: MeshConfig) -> NodeConfig {
        let rdzv =
            RdzvConfig { min_nodes: mesh.min_nodes, max_nodes: mesh.max_nodes, ..RdzvConfig::default() };
        let preflight = PreflightInput {
            facts: LocalFacts { cmd_hash: mesh.cmd_hash, nproc: mesh.nproc, ..LocalFacts::default() },
            connect_timeout: Duration::from_secs(2),
            ..PreflightInput::default()
        };
        NodeConfig {
            mesh,
            rdzv,
            rdzv_timeout: Duration::from_secs(60),
            max_restarts: 0,
            preflight,
            ring: RingConfig::default(),
            make_nccl_id: false,
        }
    }
}

/// The core's configuration for a started mesh.
pub(crate) fn core_config(
    mesh: &Mesh,
    rdzv: &RdzvConfig,
    rdzv_timeout: Duration,
    max_restarts: u32,
    facts: &PreflightInput,
    fault_tolerance: core::FaultTolerance,
) -> core::NodeConfig {
    let iface = mesh.choice().name.clone();
    core::NodeConfig {
        id: mesh.node(),
        addr: mesh.addr(),
        meta: mesh.meta().clone(),
        seeds: mesh.seeds().to_vec(),
        membership: mesh.config().membership.clone(),
        rdzv: rdzv.clone(),
        rdzv_timeout,
        preflight_timeout: PREFLIGHT_TIMEOUT,
        max_restarts,
        report: LocalFacts {
            mtu: crate::preflight::mtu(&iface),
            iface,
            tunnel: mesh.transport().has_token(),
            ..facts.facts.clone()
        },
        seed: stable_hash(&[&mesh.node().0]),
        timing: Timing::default(),
        store: meshd_proto::store::StoreConfig::default(),
        fault_tolerance,
        // torchft's Lighthouse (`--fault-tolerance node`): a new quorum needs --nnodes MIN
        // groups; stragglers that heartbeat but have not asked are waited for 1 s (torchft's
        // binary: 60 s; the mesh already says who is alive).
        lighthouse: meshd_proto::lighthouse::LighthouseConfig {
            min_replicas: u64::from(rdzv.min_nodes.max(1)),
            join_timeout: Duration::from_secs(1),
            ..Default::default()
        },
    }
}

/// Starts library nodes.
#[derive(Debug)]
pub struct Node;

impl Node {
    /// Chooses the interface, binds the port and starts the node's actor, which joins the
    /// mesh and forms a roster on its own.
    pub async fn spawn(cfg: NodeConfig) -> Result<NodeHandle, MeshError> {
        let nccl = if cfg.make_nccl_id {
            NcclPolicy::make_unless(cfg.preflight.nccl_note.as_deref())
        } else {
            NcclPolicy::Without("no NCCL id (a library node)".into())
        };
        let mesh = Mesh::start(cfg.mesh.clone()).await?;
        let transport = mesh.transport().clone();
        let incoming = transport.take_data_streams().ok_or(MeshError::DataStreamsTaken)?;
        let core_cfg = core_config(
            &mesh,
            &cfg.rdzv,
            cfg.rdzv_timeout,
            cfg.max_restarts,
            &cfg.preflight,
            core::FaultTolerance::Job,
        );
        let core = core::Node::new(core_cfg, Instant::now());
        let (id, addr, choice) = (mesh.node(), mesh.addr(), mesh.choice().clone());
        let (cmd_tx, cmd_rx) = mpsc::channel(16);
        let (snap_tx, snap_rx) = watch::channel(Snapshot::default());
        let actor = Actor::new(mesh, core, nccl, cfg.preflight.connect_timeout);
        let store = actor.store_sender();
        let task = tokio::spawn(actor.run(Library::new(cmd_rx, snap_tx)));
        Ok(NodeHandle {
            cmds: cmd_tx,
            snap: snap_rx,
            transport,
            id,
            addr,
            choice,
            incoming: Arc::new(tokio::sync::Mutex::new(incoming)),
            ring: cfg.ring.clone(),
            store,
            task,
        })
    }
}

/// A running node, from [`Node::spawn`].
#[derive(Debug)]
pub struct NodeHandle {
    cmds: mpsc::Sender<Command>,
    snap: watch::Receiver<Snapshot>,
    transport: Transport,
    id: NodeId,
    addr: SocketAddr,
    choice: Choice,
    incoming: Arc<tokio::sync::Mutex<mpsc::Receiver<DataStream>>>,
    ring: RingConfig,
    /// The actor's store relay (the store is the node core's).
    store: crate::collective::StoreSender,
    task: tokio::task::JoinHandle<Result<Outcome, MeshError>>,
}

impl NodeHandle {
    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// This node's address (chosen interface, meshd port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The chosen interface and why.
    pub fn choice(&self) -> &Choice {
        &self.choice
    }

    /// The node's transport (path statistics, probes).
    pub fn transport(&self) -> &Transport {
        &self.transport
    }

    /// Everyone known, with status (at most a second old).
    pub fn members(&self) -> Vec<MemberView> {
        self.snap.borrow().members.clone()
    }

    /// What the node knows now.
    pub fn snapshot(&self) -> Snapshot {
        self.snap.borrow().clone()
    }

    /// Waits until the roster of the current round is agreed and its preflight passed.
    /// `Err` when the job ended first (the rendezvous timed out, the preflight refused it).
    pub async fn roster(&mut self) -> Result<Roster, MeshError> {
        let s = self.wait(|s| s.roster.is_some()).await?;
        s.roster.ok_or(MeshError::Closed)
    }

    /// Waits for the current round's preflight verdict (also when it refuses the launch).
    pub async fn verdict(&mut self) -> Result<(Roster, Verdict), MeshError> {
        let s = self.wait(|s| s.verdict.is_some()).await?;
        s.verdict.ok_or(MeshError::Closed)
    }

    /// Waits until the current round fails (a member died or aborted; `true`: a new round
    /// follows) or the job ends; returns why.
    pub async fn failed(&mut self) -> (String, bool) {
        match self.wait(|s| s.failed.is_some()).await {
            Ok(s) => s.failed.unwrap_or_default(),
            Err(e) => (e.to_string(), false),
        }
    }

    async fn wait(&mut self, f: impl Fn(&Snapshot) -> bool) -> Result<Snapshot, MeshError> {
        let r = self.snap.wait_for(|s| f(s) || s.outcome.is_some()).await.map(|s| s.clone());
        match r {
            Ok(s) if f(&s) => Ok(s),
            Ok(s) => Err(match s.outcome {
                Some(o) if matches!(o.kind, core::OutcomeKind::TimedOut(_)) => MeshError::Timeout(o.message),
                o => MeshError::Aborted(o.map(|o| o.message).unwrap_or_default()),
            }),
            Err(_) => Err(MeshError::Closed),
        }
    }

    /// The collectives over this round's roster (ring allreduce, broadcast, barrier), on
    /// the node's own QUIC endpoint. `None` before a roster (see [`NodeHandle::roster`]).
    pub fn ring(&self) -> Option<RingNet> {
        let roster = self.snap.borrow().roster.clone()?;
        let rank = roster.node_rank(self.id)?;
        let addrs = roster.members.iter().map(|m| m.addr).collect();
        Some(RingNet::new(self.transport.clone(), rank, addrs, self.incoming.clone(), &self.ring))
    }

    /// Sets `key` to `value` in the job-wide store of this round; returns once every live
    /// roster member holds it (or a newer value of the key: concurrent sets converge to
    /// the same value everywhere). `Err` names why (no roster yet, a store limit, members
    /// that never acknowledged, the round ended).
    pub async fn store_set(
        &self,
        key: impl Into<String>,
        value: impl Into<Vec<u8>>,
    ) -> Result<(), MeshError> {
        let Some(round) = self.snap.borrow().roster.as_ref().map(|r| r.restart) else {
            return Err(MeshError::Store(core::StoreFailure::NoRound(0)));
        };
        let call = core::StoreCall::Set { key: key.into(), value: value.into() };
        match crate::collective::store::ask(&self.store, round, call).await {
            Some(core::StoreAnswer::Set(r)) => r.map_err(MeshError::Store),
            _ => Err(MeshError::Closed),
        }
    }

    /// The value of `key` in this round's store, waiting up to `timeout` for it to be set.
    pub async fn store_get(&self, key: impl Into<String>, timeout: Duration) -> Option<Vec<u8>> {
        let round = self.snap.borrow().roster.as_ref().map(|r| r.restart)?;
        let call = core::StoreCall::Get { key: key.into(), wait: timeout };
        match crate::collective::store::ask(&self.store, round, call).await {
            Some(core::StoreAnswer::Get(v)) => v,
            _ => None,
        }
    }

    /// Stops the job on every node (a restartable failure: a new round follows when
    /// restarts are left).
    pub async fn abort(&self, reason: impl Into<String>) {
        let _ = self.cmds.send(Command::Abort(reason.into())).await;
    }

    /// This node's work is done: says Done, waits until every member said it (or is
    /// gone), leaves the mesh and returns how the job ended.
    pub async fn finish(self) -> Result<Outcome, MeshError> {
        let _ = self.cmds.send(Command::Finish).await;
        self.task.await.map_err(|_| MeshError::Closed)?
    }

    /// Leaves the mesh now.
    pub async fn shutdown(self) {
        let _ = self.cmds.send(Command::Shutdown).await;
        let _ = self.task.await;
    }
}
