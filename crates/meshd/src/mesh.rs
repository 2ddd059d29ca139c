//! The mesh's IO: choosing the interface, binding meshd's one UDP port, resolving listed
//! names in the background, and what this node advertises. [`Mesh::start`] returns these
//! edges; the actor ([`crate::node`]) owns them together with the `Node` core and is the
//! only loop over the transport's events.

pub mod report;
pub mod seed;

use crate::interfaces::{self, Choice, ChoiceError, Interface};
use crate::peers::PeerSpec;
use crate::transport::auth::Token;
use crate::transport::{Transport, TransportConfig, TransportError, TransportEvent};
use meshd_proto::membership::MembershipConfig;
use meshd_proto::{NodeId, NodeMeta, NodeState};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// How to form the mesh.
#[derive(Clone, Debug)]
pub struct MeshConfig {
    /// This node.
    pub node: NodeId,
    /// meshd's one UDP port.
    pub port: u16,
    /// Shared secret.
    pub token: Option<Token>,
    /// Run id text (TORCHELASTIC_RUN_ID); its hash separates runs.
    pub run_id: String,
    /// Listed peers (label, address); this node may be among them.
    pub peers: Vec<(String, SocketAddr)>,
    /// Listed entries that did not resolve yet (and `dns:` names, re-resolved): tried again
    /// with backoff while the mesh runs; each new address joins the seeds.
    pub unresolved: Vec<PeerSpec>,
    /// How long [`Mesh::start`] waits for a name to resolve when no other entry of the list
    /// can be used (`--rdzv-timeout`).
    pub resolve_timeout: Duration,
    /// `--nnodes` MIN (advertised: nodes that disagree are named).
    pub min_nodes: u32,
    /// `--nnodes` MAX. 1 is a single-node job, the only one that runs on loopback.
    pub max_nodes: u32,
    /// `--iface`.
    pub iface: Option<String>,
    /// Processes this node starts.
    pub nproc: u32,
    /// Hash of the job command (agreement check).
    pub cmd_hash: u64,
    /// Membership tuning.
    pub membership: MembershipConfig,
    /// UDP segmentation offload ([`TransportConfig::gso`]).
    pub gso: bool,
    /// Run the data plane ([`TransportConfig::plane`]); `None`: on (at every MTU).
    pub plane: Option<bool>,
    /// Lanes of the data plane ([`TransportConfig::plane_lanes`]); `None`: its default.
    pub plane_lanes: Option<std::num::NonZeroUsize>,
    /// Congestion control ([`TransportConfig::cc`]).
    pub cc: crate::transport::CongestionControl,
}

impl MeshConfig {
    /// A mesh of exactly `nodes` nodes joining through `peers`, with `token`, and
    /// `meshd run`'s defaults for everything else (interface by proof, 60 s to resolve
    /// names, one process, GSO on, the data plane by MTU, CUBIC).
    pub fn new(
        node: NodeId,
        port: u16,
        token: Option<Token>,
        run_id: impl Into<String>,
        peers: Vec<(String, SocketAddr)>,
        nodes: u32,
    ) -> MeshConfig {
        MeshConfig {
            node,
            port,
            token,
            run_id: run_id.into(),
            peers,
            unresolved: Vec::new(),
            resolve_timeout: Duration::from_secs(60),
            min_nodes: nodes,
            max_nodes: nodes,
            iface: None,
            nproc: 1,
            cmd_hash: 0,
            membership: MembershipConfig::default(),
            gso: true,
            plane: None,
            plane_lanes: None,
            cc: Default::default(),
        }
    }
}

/// Errors forming or running the mesh.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    /// The interfaces could not be listed.
    #[error("interface: {0}")]
    ListInterfaces(std::io::Error),
    /// No interface fits (the one `--iface` names, or one that reaches the peers).
    #[error("interface: {0}")]
    Choice(ChoiceError),
    /// The task resolving peer names ended without an answer (it panicked).
    #[error("interface: the resolver task failed")]
    Resolver,
    /// The transport's data streams were already taken by another user of this mesh.
    #[error("the mesh transport's data streams were already taken")]
    DataStreamsTaken,
    /// The transport could not start.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// Rendezvous did not complete in time.
    #[error("{0}")]
    Timeout(String),
    /// A store set did not complete.
    #[error("store: {0}")]
    Store(meshd_proto::node::StoreFailure),
    /// The transport stopped.
    #[error("the mesh transport stopped")]
    Closed,
    /// Another node stopped the job.
    #[error("{0}")]
    Aborted(String),
    /// The peer list gives this node nothing to start from (no other node, no address of
    /// its own that others could reach).
    #[error(transparent)]
    Peers(seed::NoSeed),
    /// The local torchft Lighthouse API could not listen (`--fault-tolerance node`).
    #[error("torchft Lighthouse API on 127.0.0.1: {0}")]
    Lighthouse(std::io::Error),
}

/// A node's mesh IO, before the actor takes it over.
pub struct Mesh {
    pub(crate) cfg: MeshConfig,
    choice: Choice,
    addr: SocketAddr,
    run_hash: u64,
    transport: Transport,
    pub(crate) events: tokio::sync::mpsc::Receiver<TransportEvent>,
    meta: NodeMeta,
    /// Listed peers other than this node: the addresses to join through.
    seeds: Vec<SocketAddr>,
    /// This host's interfaces (is a newly resolved peer this node?).
    pub(crate) ifs: Vec<Interface>,
    /// Addresses of names resolved after start, from [`seed::spawn_resolver`].
    pub(crate) resolved: tokio::sync::mpsc::Receiver<Vec<(String, SocketAddr)>>,
    /// Labels of listed entries that have not resolved yet (named in timeouts).
    pub(crate) unresolved: Vec<String>,
    /// When [`Mesh::start`] began, and when the interface was chosen and the port bound.
    started: Instant,
    bound: Instant,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh").field("node", &self.cfg.node).field("addr", &self.addr).finish()
    }
}

/// A stable 64-bit hash (SHA-256 prefix): the same on every node and every build.
pub fn stable_hash(parts: &[&[u8]]) -> u64 {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for p in parts {
        ctx.update(&(p.len() as u64).to_be_bytes());
        ctx.update(p);
    }
    let d = ctx.finish();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d.as_ref()[..8]);
    u64::from_be_bytes(b)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default()
}

impl Mesh {
    /// Chooses the interface, binds the port and starts joining through the listed peers.
    pub async fn start(mut cfg: MeshConfig) -> Result<Mesh, MeshError> {
        let started = Instant::now();
        let ifs = interfaces::list().map_err(MeshError::ListInterfaces)?;
        let single_node = cfg.max_nodes <= 1;
        if !single_node {
            Self::await_a_usable_entry(&mut cfg, &ifs).await?;
        }
        let reach = interfaces::routes(&ifs, &cfg.peers, cfg.port);
        let others: Vec<SocketAddr> = reach.iter().filter(|r| !r.is_self).map(|r| r.addr).collect();
        let choice = if (others.is_empty() || single_node) && cfg.iface.is_none() {
            // Only this node listed: a single-node job on loopback, or the seed the others
            // join through, on the interface of its listed address.
            seed::alone(&ifs, &reach, single_node, cfg.max_nodes).map_err(MeshError::Peers)?
        } else {
            interfaces::choose(&ifs, &reach, cfg.iface.as_deref()).map_err(MeshError::Choice)?
        };
        let run_hash = stable_hash(&[cfg.run_id.as_bytes()]);
        let mut tc = TransportConfig::new(cfg.node, cfg.port);
        tc.token = cfg.token.clone();
        tc.run_hash = run_hash;
        tc.gso = cfg.gso;
        tc.cc = cfg.cc;
        tc.mtu = ifs.iter().find(|i| i.name == choice.name).and_then(|i| i.mtu);
        // The data plane at every MTU: with the ring's receiver credit it measured faster
        // than QUIC streams at 9000 too, with less CPU and memory (docs/PERFORMANCE.md,
        // "Ring credit on the plane"); a path where its datagrams do not pass falls back
        // to streams per link.
        tc.plane = cfg.plane.unwrap_or(true);
        if let Some(l) = cfg.plane_lanes {
            tc.plane_lanes = l.get();
        }
        if choice.addr.is_ipv6() {
            tc.bind = IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED);
        }
        let (transport, events) = Transport::bind(tc)?;
        let addr = SocketAddr::new(choice.addr, transport.local_addr().port());
        let meta = NodeMeta {
            gossip_addr: Some(addr),
            hostname: hostname(),
            iface: choice.name.clone(),
            addrs: ifs
                .iter()
                .flat_map(|i| {
                    i.addrs.iter().map(|a| meshd_proto::meta::IfaceAddr { name: i.name.clone(), addr: a.ip })
                })
                .collect(),
            nproc: cfg.nproc,
            gpus: 0,
            cuda_driver: 0,
            nccl_version: 0,
            meshd_version: env!("CARGO_PKG_VERSION").to_string(),
            cmd_hash: cfg.cmd_hash,
            run_hash,
            state: NodeState::Waiting,
            restarts: 0,
            nnodes_min: cfg.min_nodes,
            nnodes_max: cfg.max_nodes,
        };
        info!(node = %cfg.node, iface = %choice.name, addr = %addr, "joining: {}", choice.reason);
        if cfg.token.is_none() && !single_node {
            warn!(
                "no token (--insecure): traffic is encrypted but ANYONE who can reach UDP {} can join this job; \
                 make one with `meshd token --file ~/.meshd-token` and give every node --token-file",
                addr.port()
            );
        }
        let (resolved_tx, resolved) = tokio::sync::mpsc::channel(16);
        let unresolved = cfg.unresolved.iter().map(seed::label).collect();
        if !single_node {
            seed::spawn_resolver(cfg.unresolved.clone(), cfg.port, resolved_tx);
        }
        Ok(Mesh {
            cfg,
            choice,
            addr,
            run_hash,
            transport,
            events,
            meta,
            seeds: others,
            started,
            bound: Instant::now(),
            ifs,
            resolved,
            unresolved,
        })
    }

    /// With no usable entry in the list yet (every other node's name unresolved), waits
    /// for one to resolve, with backoff, up to `resolve_timeout`: the interface is chosen
    /// from the routes to the peers, so it cannot be chosen before one is known.
    async fn await_a_usable_entry(cfg: &mut MeshConfig, ifs: &[Interface]) -> Result<(), MeshError> {
        let usable = |cfg: &MeshConfig| {
            interfaces::routes(ifs, &cfg.peers, cfg.port)
                .iter()
                .any(|r| !r.is_self || !r.addr.ip().is_loopback())
        };
        if usable(cfg) || cfg.unresolved.is_empty() || cfg.iface.is_some() {
            return Ok(());
        }
        let names: Vec<String> = cfg.unresolved.iter().map(seed::label).collect();
        info!("waiting for {} to resolve (DNS may lag behind a node's start)", names.join(", "));
        let deadline = Instant::now() + cfg.resolve_timeout;
        let mut delay = seed::RESOLVE_FIRST;
        loop {
            tokio::time::sleep(delay.min(deadline.saturating_duration_since(Instant::now()))).await;
            delay = (delay * 2).min(seed::RESOLVE_MAX);
            let results =
                seed::resolve_each(cfg.unresolved.clone(), cfg.port).await.ok_or(MeshError::Resolver)?;
            let mut still = Vec::new();
            let mut errors = Vec::new();
            for (spec, (addrs, errs)) in std::mem::take(&mut cfg.unresolved).into_iter().zip(results) {
                for a in addrs {
                    if !cfg.peers.contains(&a) {
                        cfg.peers.push(a);
                    }
                }
                if !errs.is_empty() || matches!(spec, PeerSpec::Dns { .. }) {
                    errors.extend(errs);
                    still.push(spec);
                }
            }
            cfg.unresolved = still;
            if usable(cfg) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(MeshError::Timeout(format!(
                    "no listed peer resolved within {:?}: {}",
                    cfg.resolve_timeout,
                    errors.join("; ")
                )));
            }
        }
    }

    /// The transport (for collectives that run beside the actor).
    pub fn transport(&self) -> &Transport {
        &self.transport
    }

    /// The chosen interface and why.
    pub fn choice(&self) -> &Choice {
        &self.choice
    }

    /// When [`Mesh::start`] began, and when it had chosen the interface and bound the port
    /// (the first phases of the launch line).
    pub fn started(&self) -> (Instant, Instant) {
        (self.started, self.bound)
    }

    /// This node's address (chosen interface, meshd port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// This node's id.
    pub fn node(&self) -> NodeId {
        self.cfg.node
    }

    /// Hash of the run id.
    pub fn run_hash(&self) -> u64 {
        self.run_hash
    }

    /// What this node advertises (state and restarts are the core's).
    pub fn meta(&self) -> &NodeMeta {
        &self.meta
    }

    /// Listed peers other than this node (where joining starts).
    pub fn seeds(&self) -> &[SocketAddr] {
        &self.seeds
    }

    /// The configuration it was started with.
    pub fn config(&self) -> &MeshConfig {
        &self.cfg
    }

    /// Closes the endpoint (after the actor left the mesh).
    pub async fn shutdown(self) {
        self.transport.shutdown().await;
    }
}
