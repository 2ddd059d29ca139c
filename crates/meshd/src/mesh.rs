//! The mesh: one task owns the membership and rendezvous cores and drives them over the
//! transport. This is the library API for custom rendezvous: start a [`Mesh`] from seeds, a
//! token and an expected size, await the agreed [`Roster`], then do anything.
//!
//! `Mesh` is an actor without a mailbox: it is owned by one task and every method takes
//! `&mut self`, so the cores are never shared or locked. Inputs (frames, timers) are
//! pulled by [`Mesh::next`]; outputs (`poll_transmit`) are flushed after every input.

mod report;
pub mod seed;

use crate::interfaces::{self, Choice, ChoiceError, Interface};
use crate::peers::PeerSpec;
use crate::transport::auth::Token;
use crate::transport::{Transport, TransportConfig, TransportError, TransportEvent};
use meshd_proto::membership::{
    Delivery, MemberEvent, MemberStatus, MemberView, Membership, MembershipConfig,
};
use meshd_proto::rendezvous::{self, Candidate, RdzvConfig, RdzvEvent, Rendezvous, Roster};
use meshd_proto::wire::{Frame, MemberRole, StatusMember, StatusReply};
use meshd_proto::{NodeId, NodeMeta, NodeState};
use report::nnodes_text;
use std::collections::{BTreeMap, VecDeque};
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
    /// Congestion control ([`TransportConfig::cc`]).
    pub cc: crate::transport::CongestionControl,
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
    /// The preflight's TCP listener could not be opened on the chosen address.
    #[error("preflight listener on {ip}: {error}")]
    PreflightListener {
        /// The chosen interface's address.
        ip: IpAddr,
        /// Why (part of the message, not a source: the CLI prints one line).
        error: std::io::Error,
    },
    /// The transport's data streams were already taken by another user of this mesh.
    #[error("the mesh transport's data streams were already taken")]
    DataStreamsTaken,
    /// The transport could not start.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// Rendezvous did not complete in time.
    #[error("{0}")]
    Timeout(String),
    /// The transport stopped.
    #[error("the mesh transport stopped")]
    Closed,
    /// Another node stopped the job.
    #[error("{0}")]
    Aborted(String),
    /// The peer list gives this node nothing to start from (no other node, no address of
    /// its own that others could reach).
    #[error("{0}")]
    Peers(String),
}

/// Something that happened in the mesh, for the job loop.
#[derive(Debug)]
pub enum MeshInput {
    /// A rendezvous or job-lifecycle message from an authenticated member.
    Rdzv(NodeId, rendezvous::Message),
    /// Membership changed.
    Member(MemberEvent),
    /// A peer failed authentication.
    AuthFailed(SocketAddr, String),
    /// A store update from another node.
    Store(NodeId, meshd_proto::wire::StoreMsg),
    /// The deadline given to [`Mesh::next`] passed.
    Tick,
}

/// Authentication refusals named in a rendezvous timeout message.
const MAX_AUTH_REPORTED: usize = 16;

/// A node in the mesh.
pub struct Mesh {
    cfg: MeshConfig,
    choice: Choice,
    addr: SocketAddr,
    run_hash: u64,
    transport: Transport,
    events: tokio::sync::mpsc::Receiver<TransportEvent>,
    membership: Membership,
    meta: NodeMeta,
    pending: VecDeque<MeshInput>,
    /// Datagrams received per peer connection at the last look ([`Mesh::feed_liveness`]).
    rx_seen: BTreeMap<NodeId, u64>,
    /// Frames of a later restart round that arrived before we got there.
    early: Vec<(NodeId, rendezvous::Message)>,
    /// The master of the current roster, once agreed (for `meshd status`).
    master: Option<NodeId>,
    status_at: Instant,
    requeue: Vec<MeshInput>,
    /// This host's interfaces (is a newly resolved peer this node?).
    ifs: Vec<Interface>,
    /// Addresses of names resolved after start, from [`seed::spawn_resolver`].
    resolved: tokio::sync::mpsc::Receiver<Vec<(String, SocketAddr)>>,
    /// Labels of listed entries that have not resolved yet (named in timeouts).
    unresolved: Vec<String>,
    /// The last `until` of [`Mesh::next`] that fired, and the last `now` the membership's
    /// timer was handled at: a deadline at or before these never fires again, so a caller or
    /// a core that keeps asking for a deadline in the past cannot make the loop spin.
    fired: Option<Instant>,
    member_fired: Option<Instant>,
    /// When [`Mesh::start`] began, and when the interface was chosen and the port bound.
    started: Instant,
    bound: Instant,
    /// Nodes of this run started with another `--nnodes`, with the words that named them
    /// (kept for the timeout message after such a node gave up and left).
    nnodes_named: BTreeMap<NodeId, String>,
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
        let now = Instant::now();
        let seed = stable_hash(&[&cfg.node.0]);
        let mut membership = Membership::new(cfg.node, addr, meta.clone(), cfg.membership.clone(), seed, now);
        membership.add_seeds(&others, now);
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
        let mut mesh = Mesh {
            cfg,
            choice,
            addr,
            run_hash,
            transport,
            events,
            membership,
            meta,
            pending: VecDeque::new(),
            rx_seen: BTreeMap::new(),
            early: Vec::new(),
            master: None,
            status_at: Instant::now(),
            started,
            bound: Instant::now(),
            requeue: Vec::new(),
            ifs,
            resolved,
            unresolved,
            fired: None,
            member_fired: None,
            nnodes_named: Default::default(),
        };
        mesh.flush();
        Ok(mesh)
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

    /// Everyone known, with status.
    pub fn members(&self) -> Vec<MemberView> {
        self.membership.members()
    }

    /// Round-trip time to a member (QUIC's estimate, else the probe RTT).
    pub fn rtt(&self, m: &MemberView) -> Option<Duration> {
        self.transport.rtt(m.addr).or_else(|| self.membership.rtt(m.id))
    }

    /// Publishes a new state (and restart count) of this node.
    pub fn set_state(&mut self, state: NodeState, restarts: u32) {
        self.meta.state = state;
        self.meta.restarts = restarts;
        self.membership.set_meta(self.meta.clone(), Instant::now());
        self.flush();
    }

    /// Sends a rendezvous/job message to `addr` reliably.
    pub fn send(&self, addr: SocketAddr, msg: rendezvous::Message) {
        self.transport.send(addr, &Frame::Rdzv(msg), true);
    }

    /// Sends a message to every roster member but us.
    pub fn broadcast(&self, roster: &Roster, msg: rendezvous::Message) {
        for m in roster.members.iter().filter(|m| m.id != self.cfg.node) {
            self.send(m.addr, msg.clone());
        }
    }

    fn flush(&mut self) {
        while let Some(t) = self.membership.poll_transmit() {
            self.transport.send(t.to, &Frame::Gossip(t.msg), matches!(t.delivery, Delivery::Reliable));
        }
        let mut changed = false;
        while let Some(ev) = self.membership.poll_event() {
            // Frames still queued for a member that is gone can no longer arrive: the
            // transport stops retrying them (and counts them as undelivered).
            // Not when another live member has the address (a node restarted there).
            if let MemberEvent::Down(id) | MemberEvent::Left(id) = &ev {
                let members = self.membership.members();
                let live = |a: SocketAddr| {
                    members.iter().any(|o| {
                        o.id != *id
                            && matches!(o.status, MemberStatus::Alive | MemberStatus::Suspect)
                            && (o.addr == a || o.meta.gossip_addr == Some(a))
                    })
                };
                if let Some(m) = members.iter().find(|m| m.id == *id) {
                    for a in std::iter::once(m.addr).chain(m.meta.gossip_addr) {
                        if !live(a) {
                            self.transport.forget(a);
                        }
                    }
                }
            }
            self.pending.push_back(MeshInput::Member(ev));
            changed = true;
        }
        if changed || self.status_at.elapsed() > Duration::from_secs(1) {
            self.publish_status();
        }
    }

    /// Records the agreed master (None: waiting for a roster).
    pub fn set_master(&mut self, master: Option<NodeId>) {
        self.master = master;
        self.publish_status();
    }

    /// The mesh as `meshd status` shows it.
    pub fn status(&self) -> StatusReply {
        let members = self
            .membership
            .members()
            .into_iter()
            .map(|m| StatusMember {
                id: m.id,
                hostname: m.meta.hostname.clone(),
                addr: m.meta.gossip_addr.unwrap_or(m.addr),
                iface: m.meta.iface.clone(),
                gpus: m.meta.gpus,
                nproc: m.meta.nproc,
                state: m.meta.state,
                health: m.status,
                rtt_us: if m.id == self.cfg.node { None } else { self.rtt(&m).map(|d| d.as_micros() as u64) },
                role: match self.master {
                    Some(id) if id == m.id => MemberRole::Master,
                    Some(_) => MemberRole::Worker,
                    None => MemberRole::Waiting,
                },
                restarts: m.meta.restarts,
            })
            .collect();
        StatusReply { node: self.cfg.node, members }
    }

    fn publish_status(&mut self) {
        self.status_at = Instant::now();
        self.transport.set_status(&self.status());
    }

    /// The next input, or `Tick` once `until` passes. `None`: the transport stopped.
    ///
    /// A deadline fires once: `Tick` for a given `until` comes at most once, and asking
    /// again with the same (or an earlier) `until` waits for inputs only. So no caller can
    /// turn a deadline in the past into a busy loop that starves the transport and signals.
    pub async fn next(&mut self, until: Option<Instant>) -> Option<MeshInput> {
        let until = until.filter(|u| self.fired.is_none_or(|f| *u > f));
        loop {
            self.flush();
            if let Some(ev) = self.pending.pop_front() {
                return Some(ev);
            }
            let now = Instant::now();
            if let Some(u) = until.filter(|u| now >= *u) {
                self.fired = Some(u);
                return Some(MeshInput::Tick);
            }
            let member_wake =
                self.membership.poll_timeout().filter(|w| self.member_fired.is_none_or(|f| *w > f));
            let wake = [member_wake, until].into_iter().flatten().min();
            let sleep = async {
                match wake {
                    Some(w) => tokio::time::sleep_until(w.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ev = self.events.recv() => {
                    let now = Instant::now();
                    match ev? {
                        TransportEvent::Frame { from, node, frame } => match frame {
                            Frame::Gossip(m) => self.membership.handle_message(from, m, now),
                            Frame::Rdzv(m) => self.pending.push_back(MeshInput::Rdzv(node, m)),
                            Frame::Store(m) => self.pending.push_back(MeshInput::Store(node, m)),
                        },
                        TransportEvent::AuthFailed { addr, reason } => {
                            self.pending.push_back(MeshInput::AuthFailed(addr, reason));
                        }
                        TransportEvent::PeerUp { addr, observed, .. } => {
                            if let Some(o) = observed.filter(|o| o.ip() != self.addr.ip()) {
                                warn!(peer = %addr, "peer sees this node as {} but it advertises {} (NAT?)", o.ip(), self.addr.ip());
                            }
                        }
                    }
                }
                Some(found) = self.resolved.recv() => self.add_resolved(found),
                _ = sleep => {
                    let now = Instant::now();
                    self.member_fired = Some(now);
                    self.feed_liveness(now);
                    self.membership.handle_timeout(now);
                }
            }
        }
    }

    /// Names that resolved after start: new seeds (this node's own address is skipped).
    fn add_resolved(&mut self, found: Vec<(String, SocketAddr)>) {
        let now = Instant::now();
        for (label, addr) in found {
            self.unresolved.retain(|l| *l != label);
            if self.cfg.peers.iter().any(|(_, a)| *a == addr) {
                continue;
            }
            self.cfg.peers.push((label.clone(), addr));
            let me = addr.port() == self.addr.port()
                && (addr.ip().is_loopback() || self.ifs.iter().any(|i| i.has(addr.ip())));
            if !me {
                info!("{label} resolved to {}: joining through it too", addr.ip());
                self.membership.add_seeds(&[addr], now);
            }
        }
        self.flush();
    }

    /// Tells the membership which members' links received packets since the last look
    /// (probe answers can queue behind bulk data; the link's own traffic does not lie).
    fn feed_liveness(&mut self, now: Instant) {
        let counts: BTreeMap<NodeId, u64> = self.transport.rx_datagrams().into_iter().collect();
        for (node, count) in &counts {
            if self.rx_seen.get(node).is_some_and(|p| count > p) {
                self.membership.heard_from(*node, now);
            }
        }
        self.rx_seen = counts;
    }

    /// Alive members of this run, as rendezvous candidates.
    fn candidates(&self) -> Vec<Candidate> {
        self.membership
            .alive()
            .into_iter()
            .filter(|m| m.meta.run_hash == self.run_hash && m.meta.state == NodeState::Waiting)
            .filter(|m| m.meta.restarts == self.meta.restarts)
            .map(|m| Candidate {
                id: m.id,
                addr: m.meta.gossip_addr.unwrap_or(m.addr),
                nproc: m.meta.nproc,
                hostname: m.meta.hostname.clone(),
            })
            .collect()
    }

    /// Waits for the roster of restart round `restart`. `master_port` is offered should this
    /// node be master. Prints a progress line every few seconds; gives up after `timeout`
    /// naming the peers that never answered.
    pub async fn rendezvous(
        &mut self,
        restart: u32,
        rdzv: RdzvConfig,
        master_port: u16,
        timeout: Duration,
    ) -> Result<Roster, MeshError> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut core =
            Rendezvous::new(self.cfg.node, self.run_hash, restart, rdzv.clone(), master_port, start);
        self.set_state(NodeState::Waiting, restart);
        core.handle_candidates(self.candidates(), start);
        for (from, m) in std::mem::take(&mut self.early) {
            core.handle_message(from, m, start);
        }
        let mut next_progress = start + Duration::from_secs(2);
        // Authentication refusals by peer IP (an attacker retrying from new ports is one
        // entry), bounded: the timeout message names a few and counts the rest.
        let mut last_auth: BTreeMap<IpAddr, String> = BTreeMap::new();
        let mut auth_overflow = 0usize;
        loop {
            while let Some((to, msg)) = core.poll_transmit() {
                self.send(to, msg);
            }
            while let Some(ev) = core.poll_event() {
                match ev {
                    RdzvEvent::Committed(roster) => {
                        for input in std::mem::take(&mut self.requeue).into_iter().rev() {
                            self.pending.push_front(input);
                        }
                        return Ok(roster);
                    }
                    RdzvEvent::Refused(why) => warn!("{why}"),
                }
            }
            let wake = [core.poll_timeout(), Some(next_progress), Some(deadline)].into_iter().flatten().min();
            let Some(input) = self.next(wake).await else { return Err(MeshError::Closed) };
            let now = Instant::now();
            match input {
                MeshInput::Rdzv(from, m) => match &m {
                    rendezvous::Message::Propose(r) if r.restart > restart => self.early.push((from, m)),
                    // Faster nodes may begin the preflight (or even fail) before our commit
                    // arrives: keep those for whoever reads the mesh next.
                    rendezvous::Message::PreflightHello { .. }
                    | rendezvous::Message::PreflightReport { .. }
                    | rendezvous::Message::Abort { .. } => self.requeue.push(MeshInput::Rdzv(from, m)),
                    _ => core.handle_message(from, m, now),
                },
                MeshInput::Member(_) => {
                    // A replacement node starts at round 0: it adopts the round the waiting
                    // survivors are in.
                    let round = self
                        .membership
                        .alive()
                        .iter()
                        .filter(|m| m.meta.run_hash == self.run_hash && m.meta.state == NodeState::Waiting)
                        .map(|m| m.meta.restarts)
                        .max()
                        .unwrap_or(restart);
                    if round > restart {
                        info!("joining restart round {round} of the running job");
                        return Box::pin(self.rendezvous(
                            round,
                            rdzv,
                            master_port,
                            deadline.saturating_duration_since(now),
                        ))
                        .await;
                    }
                    core.handle_candidates(self.candidates(), now)
                }
                MeshInput::AuthFailed(addr, reason) => {
                    if last_auth.len() < MAX_AUTH_REPORTED || last_auth.contains_key(&addr.ip()) {
                        last_auth.insert(addr.ip(), reason);
                    } else {
                        auth_overflow += 1;
                    }
                }
                // A faster node's ranks may already use the store: keep it for the job.
                s @ MeshInput::Store(..) => {
                    if self.requeue.len() < 4096 {
                        self.requeue.push(s);
                    }
                }
                MeshInput::Tick => core.handle_timeout(now),
            }
            // A disagreement is named as soon as it is seen, once per node.
            for (id, why) in self.disagreeing(restart) {
                if why.contains("--nnodes") && !self.nnodes_named.contains_key(&id) {
                    warn!("{why}: these nodes cannot form one roster; give every node the same --nnodes");
                    self.nnodes_named.insert(id, why);
                }
            }
            if now >= next_progress {
                let (present, min, max) = core.progress();
                let missing: Vec<String> = self
                    .missing_peers()
                    .into_iter()
                    .filter(|m| !last_auth.keys().any(|a| m.contains(&a.to_string())))
                    .chain(self.unresolved.iter().map(|l| format!("{l} (not resolved yet)")))
                    .collect();
                let mut line = format!("waiting for nodes: {present}/{} present", nnodes_text(min, max));
                if min < max && present >= min as usize {
                    line.push_str(&format!(", starting once no newcomer arrived for {:?}", rdzv.settle));
                }
                if !missing.is_empty() {
                    line.push_str(&format!("; no answer yet from {}", missing.join(", ")));
                }
                for (_, why) in self.disagreeing(restart) {
                    line.push_str(&format!("; {why}"));
                }
                for (a, r) in &last_auth {
                    // The keyword only ("different token"); the full reason was logged once.
                    let r = r.strip_prefix(crate::transport::REFUSED_US).unwrap_or(r);
                    line.push_str(&format!(
                        "; {a} failed authentication ({})",
                        r.split(':').next().unwrap_or(r)
                    ));
                }
                info!("{line}");
                next_progress = now + Duration::from_secs(5);
            }
            if now >= deadline {
                let (present, min, max) = core.progress();
                return Err(MeshError::Timeout(self.timeout_message(
                    timeout,
                    restart,
                    present,
                    (min, max),
                    &last_auth,
                    auth_overflow,
                )));
            }
        }
    }

    /// Inputs a phase read but that belong to the next reader (store frames that arrived
    /// during the preflight): they come out of [`Mesh::next`] first, in order (bounded).
    pub fn put_back(&mut self, inputs: Vec<MeshInput>) {
        for input in inputs.into_iter().take(4096).rev() {
            self.pending.push_front(input);
        }
    }

    /// Keeps a rendezvous message of a later round for [`Mesh::rendezvous`].
    pub fn defer(&mut self, from: NodeId, msg: rendezvous::Message) {
        if self.early.len() < 64 {
            self.early.push((from, msg));
        }
    }

    /// Membership verdict on member `id`.
    pub fn member_status(&self, id: NodeId) -> Option<MemberStatus> {
        self.membership.members().into_iter().find(|m| m.id == id).map(|m| m.status)
    }

    /// Leaves gracefully and closes the endpoint.
    pub async fn shutdown(mut self) {
        self.membership.leave(Instant::now());
        self.flush();
        // A moment for the leave to reach the others; alone (a single-node job) there is
        // nobody to tell, and meshd's exit is the job's.
        if !self.transport.connected().is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.transport.shutdown().await;
    }
}
