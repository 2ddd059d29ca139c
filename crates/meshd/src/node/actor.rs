//! The actor: the one loop over the transport's events, the core's timer, the IO edges'
//! results, the supervisor, signals and the library handle's commands. It owns the
//! `Node` core and the mesh's IO; after every input it sends the core's frames and carries
//! out its requests.

use super::edge::{Command, Edge, Wake};
use crate::collective::{StoreRequest, StoreSender};
use crate::lighthouse::LighthouseCall;
use crate::mesh::report::AuthRefusals;
use crate::mesh::{Mesh, MeshError};
use crate::nccl_root::NcclRoot;
use crate::preflight::{self, Listeners};
use crate::transport::TransportEvent;
use meshd_proto::NodeId;
use meshd_proto::membership::Delivery;
use meshd_proto::node::{self as core, Event, Input, Level, Node, Outcome, OutcomeKind};
use meshd_proto::wire::{MemberRole, StatusMember, StatusReply};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::{Instrument, debug, error, info, warn};

/// How long a node that leaves keeps its endpoint open for the leave to go out.
const LEAVE_LINGER: Duration = Duration::from_millis(50);

/// Results of the preflight's IO tasks, tagged with the round that asked: the core drops
/// an answer of an earlier round.
enum EdgeDone {
    Bound {
        round: u32,
        result: Result<(u16, Listeners, Vec<meshd_proto::preflight::TcpProbe>), preflight::ListenerError>,
        root: Option<Box<NcclRoot>>,
        id: Option<Vec<u8>>,
        note: Option<String>,
    },
    Dialed(Input),
}

/// Whether this node makes the round's NCCL id when it is master, and why not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum NcclPolicy {
    /// Make one (only a meshd binary can: the root process is `meshd __nccl-root`).
    Make,
    /// None, and why (libnccl missing, a library node).
    Without(String),
}

impl NcclPolicy {
    /// `Make` unless `missing` says why there can be no id.
    pub fn make_unless(missing: Option<&str>) -> NcclPolicy {
        missing.map_or(NcclPolicy::Make, |why| NcclPolicy::Without(why.to_string()))
    }
}

pub(crate) struct Actor {
    pub mesh: Mesh,
    pub core: Node,
    rx_seen: BTreeMap<NodeId, u64>,
    auth: AuthRefusals,
    status_at: Instant,
    edge_tx: mpsc::UnboundedSender<EdgeDone>,
    edge_rx: mpsc::UnboundedReceiver<EdgeDone>,
    /// Store requests of the edges (ranks through the local service, the library handle),
    /// relayed to the core; answers go back on each request's channel.
    store_tx: StoreSender,
    store_rx: mpsc::Receiver<StoreRequest>,
    store_pending: std::collections::HashMap<u64, tokio::sync::oneshot::Sender<core::StoreAnswer>>,
    next_store_req: u64,
    /// torchft Lighthouse calls of the ranks (`--fault-tolerance node`), relayed to the core;
    /// each Quorum call's answer goes back on its channel.
    lh_tx: mpsc::Sender<LighthouseCall>,
    lh_rx: mpsc::Receiver<LighthouseCall>,
    lh_pending: BTreeMap<u64, tokio::sync::oneshot::Sender<crate::lighthouse::Answer>>,
    next_lh_req: u64,
    listeners: Option<Listeners>,
    nccl_root: Option<Box<NcclRoot>>,
    nccl: NcclPolicy,
    connect_timeout: Duration,
    node_span: tracing::Span,
    round_span: tracing::Span,
}

impl Actor {
    pub fn new(mesh: Mesh, core: Node, nccl: NcclPolicy, connect_timeout: Duration) -> Actor {
        let (edge_tx, edge_rx) = mpsc::unbounded_channel();
        let (store_tx, store_rx) = mpsc::channel(crate::collective::store::MAX_IN_FLIGHT);
        let (lh_tx, lh_rx) = mpsc::channel(crate::lighthouse::CALL_QUEUE);
        let node_span = tracing::debug_span!("node", id = %mesh.node(), addr = %mesh.addr());
        let round_span = tracing::debug_span!(parent: &node_span, "round", restart = 0u32);
        Actor {
            mesh,
            core,
            rx_seen: BTreeMap::new(),
            auth: AuthRefusals::default(),
            status_at: Instant::now(),
            edge_tx,
            edge_rx,
            store_tx,
            store_rx,
            store_pending: Default::default(),
            next_store_req: 0,
            lh_tx,
            lh_rx,
            lh_pending: BTreeMap::new(),
            next_lh_req: 0,
            listeners: None,
            nccl_root: None,
            nccl,
            connect_timeout,
            node_span,
            round_span,
        }
    }

    /// Runs until the job is over on this node; leaves the mesh and closes the endpoint.
    pub async fn run<E: Edge>(mut self, mut edge: E) -> Result<Outcome, MeshError> {
        self.publish_status();
        let end = loop {
            if let Some(end) = self.drain(&mut edge).await {
                break end;
            }
            let wake = self.core.poll_timeout();
            let status_at = self.status_at + Duration::from_secs(1);
            let timer = async move {
                match wake {
                    Some(w) => tokio::time::sleep_until(w.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ev = self.mesh.events.recv() => match ev {
                    None => break Err(MeshError::Closed),
                    Some(ev) => self.on_transport(ev),
                },
                Some(found) = self.mesh.resolved.recv() => self.add_resolved(found),
                Some(done) = self.edge_rx.recv() => self.on_edge(done),
                Some(r) = self.store_rx.recv() => self.on_store_request(r),
                Some(c) = self.lh_rx.recv() => self.on_lighthouse_call(c),
                _ = timer => {
                    let now = Instant::now();
                    self.feed_liveness(now);
                    if self.core.poll_timeout().is_some_and(|t| t <= now) {
                        self.core.handle_timeout(now);
                    }
                }
                w = edge.next() => match w {
                    Wake::Input(i) => self.core.handle(i, Instant::now()),
                    Wake::Command(c) => {
                        if let Some(end) = self.on_command(c) {
                            break end;
                        }
                    }
                    Wake::Stalled(t) => {
                        if let Some(i) = edge.on_stall(t).await {
                            self.core.handle(i, Instant::now());
                        }
                    }
                    Wake::Nothing => {}
                },
                _ = tokio::time::sleep_until(status_at.into()) => {
                    self.publish_status();
                    edge.members(&self.core);
                }
            }
        };
        self.leave().await;
        match &end {
            Ok(o) => edge.finished(o),
            Err(e) => edge.finished(&Outcome { code: 1, message: e.to_string(), kind: OutcomeKind::Failed }),
        }
        end
    }

    async fn leave(&mut self) {
        self.core.handle(core::Input::Leave, Instant::now());
        self.send_transmits();
        // A moment for the leave to reach the others; alone there is nobody to tell.
        if !self.mesh.transport().connected().is_empty() {
            tokio::time::sleep(LEAVE_LINGER).await;
        }
        self.mesh.transport().shutdown().await;
    }

    /// Where the edges send store requests.
    pub fn store_sender(&self) -> StoreSender {
        self.store_tx.clone()
    }

    /// Where the local Lighthouse server sends its calls.
    pub fn lighthouse_sender(&self) -> mpsc::Sender<LighthouseCall> {
        self.lh_tx.clone()
    }

    /// A rank's Lighthouse call: to the core. torchft advertises its manager as
    /// `http://{gethostname()}:port`, which other nodes may not resolve (or resolve to
    /// themselves: every lab host has one name, every container may): the host becomes this
    /// node's address on the chosen interface, as does a loopback store address.
    fn on_lighthouse_call(&mut self, c: LighthouseCall) {
        let now = Instant::now();
        // Callers that went away (their process died, their deadline passed).
        let gone: Vec<u64> = self.lh_pending.iter().filter(|(_, r)| r.is_closed()).map(|(k, _)| *k).collect();
        for req in gone {
            self.lh_pending.remove(&req);
            self.core.handle(Input::LhCancel { req }, now);
        }
        match c {
            LighthouseCall::Heartbeat { replica_id } => {
                self.core.handle(Input::LhHeartbeat { replica_id }, now)
            }
            LighthouseCall::Quorum { mut member, reply } => {
                let ip = self.mesh.addr().ip();
                member.address = crate::lighthouse::rewrite_host(&member.address, ip);
                member.store_address = local_store_address(&member.store_address, ip);
                self.next_lh_req += 1;
                let req = self.next_lh_req;
                self.lh_pending.insert(req, reply);
                self.core.handle(Input::LhQuorum { req, member }, now);
            }
            // The owner's inputs of a local decider: the node core has these from the mesh.
            LighthouseCall::ReplicaGone { .. } | LighthouseCall::ObserveQuorumId(_) => {}
        }
    }

    /// A store request of an edge: to the core, with an id its answer will carry.
    fn on_store_request(&mut self, r: StoreRequest) {
        let req = self.next_store_req;
        self.next_store_req += 1;
        // A requester that gave up (its client hung up) needs no answer.
        self.store_pending.retain(|_, reply| !reply.is_closed());
        self.store_pending.insert(req, r.reply);
        self.core.handle(Input::Store { round: r.round, req, call: r.call }, Instant::now());
    }

    fn send_transmits(&mut self) {
        while let Some(t) = self.core.poll_transmit() {
            self.mesh.transport().send(t.to, &t.frame, t.delivery == Delivery::Reliable);
        }
    }

    /// Sends the core's frames and carries out its events, one at a time (frames first, so
    /// that an Abort is out before the ranks' stop is awaited). `Some`: the job is over.
    async fn drain<E: Edge>(&mut self, edge: &mut E) -> Option<Result<Outcome, MeshError>> {
        loop {
            self.send_transmits();
            let ev = self.core.poll_event()?;
            let span = self.round_span.clone();
            if let Some(end) = self.on_event(ev, edge).instrument(span).await {
                self.send_transmits();
                return Some(end);
            }
        }
    }

    async fn on_event<E: Edge>(&mut self, ev: Event, edge: &mut E) -> Option<Result<Outcome, MeshError>> {
        match ev {
            Event::Member(_) => {
                self.publish_status();
                edge.members(&self.core);
            }
            Event::Log(level, text) => match level {
                Level::Debug => debug!("{text}"),
                Level::Info => info!("{text}"),
                Level::Warn => warn!("{text}"),
                Level::Error => error!("{text}"),
            },
            Event::Waiting(report) => {
                let members = self.core.members();
                let missing: Vec<String> = self
                    .mesh
                    .silent_peers(&members, &self.auth)
                    .into_iter()
                    .chain(self.mesh.unresolved.iter().map(|l| format!("{l} (not resolved yet)")))
                    .collect();
                info!("{}", report.progress_line(&missing, &self.auth.words()));
            }
            Event::RoundBegan { restart } => {
                self.round_span = tracing::debug_span!(parent: &self.node_span, "round", restart);
                self.listeners = None;
                self.nccl_root = None;
                let port = edge.round_began(self.mesh.addr().ip());
                self.core.handle(Input::MasterPort { round: restart, port }, Instant::now());
            }
            Event::RosterAgreed(roster) => {
                self.publish_status();
                edge.roster_agreed(&roster, self.mesh.node());
            }
            Event::StartPreflight { roster, master } => self.start_preflight(&roster, master),
            Event::Dial { round, targets, nccl_id } => {
                let master = self.core.roster().and_then(|r| r.master()).map(|m| m.id);
                let (tx, limit) = (self.edge_tx.clone(), self.connect_timeout);
                tokio::spawn(async move {
                    let (probes, nccl_root) = preflight::dial_all(targets, nccl_id, master, limit).await;
                    let _ = tx.send(EdgeDone::Dialed(Input::Dialed { round, probes, nccl_root }));
                });
            }
            Event::Preflight(verdict) => {
                self.listeners = None;
                edge.verdict(self.core.roster(), &verdict);
            }
            Event::Launch { roster, verdict, nccl_id } => {
                let input = edge.launch(&self.mesh, &roster, &verdict, nccl_id.as_deref()).await;
                self.core.handle(input, Instant::now());
            }
            Event::StopRanks => {
                edge.stop().await;
                self.core.handle(Input::RanksStopped, Instant::now());
            }
            Event::ForwardSignal { signal, from } => {
                edge.forward(signal, from.as_deref());
            }
            Event::LhQuorum { req, quorum } => {
                if let Some(reply) = self.lh_pending.remove(&req) {
                    let _ = reply
                        .send(crate::lighthouse::Answer { quorum, created: std::time::SystemTime::now() });
                }
            }
            Event::StoreReply { req, answer } => {
                if let Some(reply) = self.store_pending.remove(&req) {
                    let _ = reply.send(answer);
                }
            }
            // The core's store stops waiting for it by itself.
            Event::PeerFinished(_) => {}
            Event::GroupLost { addr, who, abort } => edge.group_lost(addr, &who, abort),
            Event::RosterChanged(roster) => {
                self.publish_status();
                edge.roster_changed(&roster, self.mesh.node());
            }
            Event::RoundFailed { reason, cause, restarting, .. } => {
                self.nccl_root = None;
                edge.round_failed(&reason, cause.as_deref(), restarting).await;
            }
            Event::Finished(o) => {
                // After a success the ranks are gone but what they started and the round's
                // tunnel and service are not: the same stop as after a failure.
                edge.stop().await;
                self.nccl_root = None;
                // The outcome, with its code, is the end: a timed-out rendezvous gets its
                // message completed with what only the IO knows (who never answered).
                return Some(Ok(match &o.kind {
                    OutcomeKind::TimedOut(report) => {
                        let members = self.core.members();
                        let missing = self.mesh.silent_peers(&members, &self.auth);
                        let message = report.timeout_message(
                            &self.auth.clauses(),
                            &missing,
                            self.mesh.addr().port(),
                            &self.mesh.unresolved,
                        );
                        Outcome { message, ..o }
                    }
                    _ => o,
                }));
            }
        }
        None
    }

    fn start_preflight(&mut self, roster: &meshd_proto::rendezvous::Roster, master: bool) {
        let (tx, round, me, ip) =
            (self.edge_tx.clone(), roster.restart, self.mesh.node(), self.mesh.addr().ip());
        let master_port = master.then_some(roster.master_port);
        let make_id = master && self.nccl == NcclPolicy::Make;
        let mut note = match &self.nccl {
            NcclPolicy::Without(why) if master => Some(why.clone()),
            _ => None,
        };
        let iface = self.mesh.choice().name.clone();
        tokio::spawn(async move {
            // The master first creates the round's NCCL id in a root process that must
            // outlive every rank's init (kept until the round ends).
            let root = if make_id {
                match NcclRoot::spawn(&iface, Duration::from_secs(20)).await {
                    Ok(r) => Some(Box::new(r)),
                    Err(e) => {
                        warn!("no NCCL unique id: {e}");
                        note = Some(e.to_string());
                        None
                    }
                }
            } else {
                None
            };
            let id = root.as_ref().map(|r| r.id.clone());
            let result = preflight::bind(me, ip, master_port).await;
            let _ = tx.send(EdgeDone::Bound { round, result, root, id, note });
        });
    }

    /// A preflight task's result: to the core, which knows whether its round is still on.
    /// What the round holds (listeners, the NCCL root) is kept only while it is.
    fn on_edge(&mut self, done: EdgeDone) {
        let now = Instant::now();
        match done {
            EdgeDone::Bound { round, result, root, id, note } => match result {
                Ok((tcp_port, listeners, problems)) => {
                    if round == self.core.restart() {
                        self.listeners = Some(listeners);
                        self.nccl_root = root;
                    }
                    let ready =
                        Input::PreflightReady { round, tcp_port, nccl_id: id, nccl_note: note, problems };
                    self.core.handle(ready, now);
                }
                Err(e) => self.core.handle(Input::PreflightFailed { round, why: e.to_string() }, now),
            },
            EdgeDone::Dialed(input) => self.core.handle(input, now),
        }
    }

    fn on_transport(&mut self, ev: TransportEvent) {
        let now = Instant::now();
        match ev {
            TransportEvent::Frame { from, node, frame } => {
                self.core.handle(Input::Frame { from, node, frame }, now)
            }
            TransportEvent::AuthFailed { addr, reason } => self.auth.record(addr, reason),
            TransportEvent::PeerUp { addr, observed, .. } => {
                if let Some(o) = observed.filter(|o| o.ip() != self.mesh.addr().ip()) {
                    warn!(peer = %addr, "peer sees this node as {} but it advertises {} (NAT?)", o.ip(), self.mesh.addr().ip());
                }
            }
        }
    }

    fn on_command(&mut self, c: Command) -> Option<Result<Outcome, MeshError>> {
        let now = Instant::now();
        match c {
            Command::Abort(reason) => self.core.handle(Input::Abort(reason), now),
            Command::Finish => self.core.handle(Input::Finish, now),
            Command::Shutdown => {
                return Some(Ok(Outcome {
                    code: 0,
                    message: "shut down".into(),
                    kind: OutcomeKind::Stopped,
                }));
            }
        }
        None
    }

    /// Names that resolved after start: new seeds (this node's own address is skipped).
    fn add_resolved(&mut self, found: Vec<(String, SocketAddr)>) {
        let mut seeds = Vec::new();
        for (label, addr) in found {
            self.mesh.unresolved.retain(|l| *l != label);
            if self.mesh.cfg.peers.iter().any(|(_, a)| *a == addr) {
                continue;
            }
            self.mesh.cfg.peers.push((label.clone(), addr));
            let me = addr.port() == self.mesh.addr().port()
                && (addr.ip().is_loopback() || self.mesh.ifs.iter().any(|i| i.has(addr.ip())));
            if !me {
                info!("{label} resolved to {}: joining through it too", addr.ip());
                seeds.push(addr);
            }
        }
        if !seeds.is_empty() {
            self.core.handle(Input::Seeds(seeds), Instant::now());
        }
    }

    /// Tells the core which members' links received packets since the last look (probe
    /// answers can queue behind bulk data; the link's own traffic does not lie).
    fn feed_liveness(&mut self, now: Instant) {
        let counts: BTreeMap<NodeId, u64> = self.mesh.transport().rx_datagrams().into_iter().collect();
        for (node, count) in &counts {
            if self.rx_seen.get(node).is_some_and(|p| count > p) {
                self.core.handle(Input::HeardFrom(*node), now);
            }
        }
        self.rx_seen = counts;
    }

    /// The mesh as `meshd status` shows it.
    fn status(&self) -> StatusReply {
        let me = self.mesh.node();
        let master = self.core.master();
        let members = self
            .core
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
                rtt_us: if m.id == me {
                    None
                } else {
                    self.mesh
                        .transport()
                        .rtt(m.addr)
                        .or_else(|| self.core.membership().rtt(m.id))
                        .map(|d| d.as_micros() as u64)
                },
                role: match master {
                    Some(id) if id == m.id => MemberRole::Master,
                    Some(_) => MemberRole::Worker,
                    None => MemberRole::Waiting,
                },
                restarts: m.meta.restarts,
            })
            .collect();
        StatusReply { node: me, members }
    }

    fn publish_status(&mut self) {
        self.status_at = Instant::now();
        self.mesh.transport().set_status(&self.status());
    }
}

/// A group's store address (`host:port`) as other nodes reach it: a loopback host (the
/// user set MASTER_ADDR=localhost) becomes this node's address; anything else is kept.
fn local_store_address(addr: &str, ip: std::net::IpAddr) -> String {
    let Some((host, port)) = addr.rsplit_once(':') else { return addr.to_string() };
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = bare.eq_ignore_ascii_case("localhost")
        || bare.parse::<std::net::IpAddr>().is_ok_and(|a| a.is_loopback());
    if !loopback {
        return addr.to_string();
    }
    match ip {
        std::net::IpAddr::V6(v6) => format!("[{v6}]:{port}"),
        v4 => format!("{v4}:{port}"),
    }
}

#[cfg(test)]
mod lh_tests {
    use super::local_store_address;

    #[test]
    fn a_loopback_store_address_becomes_the_nodes() {
        let ip = "198.19.0.7".parse().expect("ip");
        assert_eq!(local_store_address("localhost:29500", ip), "198.19.0.7:29500");
        assert_eq!(local_store_address("127.0.0.1:29500", ip), "198.19.0.7:29500");
        assert_eq!(local_store_address("[::1]:29500", ip), "198.19.0.7:29500");
        assert_eq!(local_store_address("198.19.0.9:29500", ip), "198.19.0.9:29500");
        assert_eq!(local_store_address("gpu-3:29500", ip), "gpu-3:29500");
        assert_eq!(local_store_address("garbage", ip), "garbage");
        assert_eq!(local_store_address("localhost:1", "fd00::7".parse().expect("ip")), "[fd00::7]:1");
    }
}
