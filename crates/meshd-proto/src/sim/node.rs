//! Whole nodes in the simulator: N [`Node`] cores, each with a simulated IO around it
//! (preflight listener, TCP dials, ranks that exit 0, fail or hang, stops), on the same
//! virtual network as [`Sim`](super::Sim): seeded latency, datagram loss, partitions,
//! crashes and restarts at the same address with a new id.
//!
//! Every frame is encoded and decoded on its way ([`wire`]), so sizes are real and a frame
//! that does not survive the wire fails the run naming the seed. What the nodes do is
//! recorded ([`NodeSim::launches`], [`NodeSim::stops`], [`NodeSim::outcomes`]) for the
//! properties the tests check on every seed.
//!
//! Each launched round's job-wide store is the node core's own ([`NodeSim::store_set`],
//! [`NodeSim::store_get`]).

use super::net::{self, Net, simulator_api};
use super::node_addr;
use crate::id::NodeId;
use crate::membership::{Delivery, MembershipConfig};
use crate::meta::NodeMeta;
use crate::node::{Event, Input, LocalFacts, Node, NodeConfig, Outcome, Timing};
use crate::preflight::TcpProbe;
use crate::rendezvous::{RankFailure, RdzvConfig, Roster};
use crate::rng::Rng;
use crate::wire::{self, Frame};
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// What the simulated ranks of one node do in one round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ranks {
    /// Run this long, then all exit 0.
    Exit0(Duration),
    /// Run this long, then one fails with this exit status.
    Fail(Duration, u8),
    /// Never end on their own.
    Hang,
}

/// The simulated cluster of whole nodes.
#[derive(Clone, Debug)]
pub struct NodeSimConfig {
    /// Number of nodes.
    pub nodes: usize,
    /// Seed of every random choice in the run.
    pub seed: u64,
    /// One-way latency, drawn uniformly in `[min, max]` per frame.
    pub latency: (Duration, Duration),
    /// Probability that a datagram is lost.
    pub loss: f64,
    /// Time resolution of [`NodeSim::run_until`].
    pub check_interval: Duration,
    /// Every node's membership tuning.
    pub membership: MembershipConfig,
    /// `--nnodes` and the rendezvous timing of every node.
    pub rdzv: RdzvConfig,
    /// Rendezvous timeout.
    pub rdzv_timeout: Duration,
    /// Restarts allowed.
    pub max_restarts: u32,
    /// Lifecycle timing.
    pub timing: Timing,
    /// What ranks do unless [`NodeSim::set_ranks`] says otherwise.
    pub ranks: Ranks,
    /// How long binding a listener, spawning ranks and stopping them take.
    pub io_delay: Duration,
    /// How long a TCP connect to a blocked port takes to fail.
    pub connect_timeout: Duration,
    /// What a failure stops (`--fault-tolerance`).
    pub fault_tolerance: crate::node::FaultTolerance,
    /// The torchft Lighthouse's rules.
    pub lighthouse: crate::lighthouse::LighthouseConfig,
}

impl Default for NodeSimConfig {
    /// 8 nodes of a fixed-size job on a LAN whose ranks run 1 s and exit 0.
    fn default() -> Self {
        NodeSimConfig {
            nodes: 8,
            seed: 1,
            latency: (Duration::from_micros(200), Duration::from_millis(1)),
            loss: 0.0,
            check_interval: Duration::from_millis(10),
            membership: MembershipConfig::default(),
            rdzv: RdzvConfig { min_nodes: 8, max_nodes: 8, ..RdzvConfig::default() },
            rdzv_timeout: Duration::from_secs(60),
            max_restarts: 0,
            timing: Timing::default(),
            ranks: Ranks::Exit0(Duration::from_secs(1)),
            io_delay: Duration::from_millis(2),
            connect_timeout: Duration::from_secs(1),
            fault_tolerance: Default::default(),
            lighthouse: Default::default(),
        }
    }
}

/// A node's launch of its ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Simulated time.
    pub at: Duration,
    /// Node index.
    pub node: usize,
    /// Its id then.
    pub id: NodeId,
    /// The roster it launched with.
    pub roster: Roster,
}

/// A node stopping its ranks (an abort reached it, or it aborted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stopped {
    /// Simulated time.
    pub at: Duration,
    /// Node index.
    pub node: usize,
    /// Restart round.
    pub restart: u32,
}

/// A node's end.
#[derive(Clone, Debug, PartialEq)]
pub struct Ended {
    /// Simulated time.
    pub at: Duration,
    /// Node index.
    pub node: usize,
    /// When its ranks last ended (exit, failure or stop), if they ran.
    pub ranks_ended: Option<Duration>,
    /// How.
    pub outcome: Outcome,
}

#[derive(Debug)]
enum Kind {
    Deliver { to: usize, life: u64, from: usize, from_addr: SocketAddr, id: NodeId, bytes: Vec<u8> },
    Wake { node: usize, life: u64 },
    Io { node: usize, life: u64, ranks: u64, input: Input },
}

struct SimNode {
    addr: SocketAddr,
    id: NodeId,
    /// Incarnation: results of an earlier incarnation's IO are dropped.
    life: u64,
    core: Option<Node>,
    wake: Option<Duration>,
    /// Generation of the ranks: a stop makes their pending exit moot.
    ranks_gen: u64,
    ranks_running: bool,
    ranks_ended: Option<Duration>,
    started: Option<Duration>,
    /// Answers to this node's store requests.
    store_replies: Vec<(u64, crate::node::StoreAnswer)>,
    /// Lighthouse answers to this node's ranks: (when, request, quorum).
    lh_answers: Vec<(Duration, u64, crate::lighthouse::Quorum)>,
    groups_lost: Vec<SocketAddr>,
    rosters_changed: Vec<Roster>,
    next_store_req: u64,
}

/// A seeded simulation of whole nodes.
pub struct NodeSim {
    cfg: NodeSimConfig,
    rng: Rng,
    net: Net<Kind>,
    nodes: Vec<SimNode>,
    by_addr: HashMap<SocketAddr, usize>,
    blocked_tcp: BTreeSet<(usize, usize)>,
    ranks: HashMap<(usize, u32), Ranks>,
    meta: HashMap<usize, NodeMeta>,
    rdzv: HashMap<usize, RdzvConfig>,
    seed_of: HashMap<usize, usize>,
    launches: Vec<Launch>,
    stops: Vec<Stopped>,
    outcomes: Vec<Ended>,
    bytes: u64,
    frames: u64,
}

impl std::fmt::Debug for NodeSim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeSim").field("seed", &self.cfg.seed).field("nodes", &self.nodes.len()).finish()
    }
}

simulator_api!(NodeSim, cfg);

impl NodeSim {
    /// A cluster of stopped nodes.
    pub fn new(cfg: NodeSimConfig) -> NodeSim {
        let mut rng = Rng::new(cfg.seed);
        let nodes: Vec<SimNode> = (0..cfg.nodes)
            .map(|i| SimNode {
                addr: node_addr(i),
                id: net::fresh_id(&mut rng),
                life: 0,
                core: None,
                wake: None,
                ranks_gen: 0,
                ranks_running: false,
                ranks_ended: None,
                started: None,
                store_replies: Vec::new(),
                lh_answers: Vec::new(),
                groups_lost: Vec::new(),
                rosters_changed: Vec::new(),
                next_store_req: 0,
            })
            .collect();
        let by_addr = nodes.iter().enumerate().map(|(i, n)| (n.addr, i)).collect();
        NodeSim {
            net: Net::new(cfg.nodes, cfg.latency, cfg.loss),
            cfg,
            rng,
            nodes,
            by_addr,
            blocked_tcp: BTreeSet::new(),
            ranks: HashMap::new(),
            meta: HashMap::new(),
            rdzv: HashMap::new(),
            seed_of: HashMap::new(),
            launches: Vec::new(),
            stops: Vec::new(),
            outcomes: Vec::new(),
            bytes: 0,
            frames: 0,
        }
    }

    /// The core of node `i`, while it runs.
    pub fn node(&self, i: usize) -> Option<&Node> {
        self.nodes[i].core.as_ref()
    }

    /// Every launch so far.
    pub fn launches(&self) -> &[Launch] {
        &self.launches
    }

    /// Every stop of ranks so far.
    pub fn stops(&self) -> &[Stopped] {
        &self.stops
    }

    /// Every node's end so far.
    pub fn outcomes(&self) -> &[Ended] {
        &self.outcomes
    }

    /// Frames and encoded bytes sent so far.
    pub fn traffic(&self) -> (u64, u64) {
        (self.frames, self.bytes)
    }

    /// What node `i`'s ranks do in round `restart`.
    pub fn set_ranks(&mut self, i: usize, restart: u32, r: Ranks) {
        self.ranks.insert((i, restart), r);
    }

    /// Node `i` advertises `f(meta)` (another run, command, process count) from its next start.
    pub fn set_meta(&mut self, i: usize, f: impl FnOnce(&mut NodeMeta)) {
        let mut m = self.default_meta(i);
        f(&mut m);
        self.meta.insert(i, m);
    }

    /// Node `i` is started with another `--nnodes` (from its next start).
    pub fn set_rdzv(&mut self, i: usize, r: RdzvConfig) {
        self.rdzv.insert(i, r);
    }

    /// Node `i` joins through node `j` instead of node 0 (from its next start).
    pub fn set_seed_node(&mut self, i: usize, j: usize) {
        self.seed_of.insert(i, j);
    }

    /// TCP from `a` to `b` (and back) fails from now on.
    pub fn block_tcp(&mut self, a: usize, b: usize) {
        self.blocked_tcp.insert((a, b));
        self.blocked_tcp.insert((b, a));
    }

    /// Node `i` sets `key` in the store of its current round, as a rank's `store_set`
    /// does; returns the request's id (its answer comes in [`NodeSim::store_replies`]), or
    /// `None` when node `i` is not running.
    pub fn store_set(&mut self, i: usize, key: &str, value: &[u8]) -> Option<u64> {
        let now = self.instant();
        let req = self.nodes[i].next_store_req;
        let core = self.nodes[i].core.as_mut()?;
        let call = crate::node::StoreCall::Set { key: key.to_string(), value: value.to_vec() };
        core.handle(Input::Store { round: core.restart(), req, call }, now);
        self.nodes[i].next_store_req += 1;
        self.after(i);
        Some(req)
    }

    /// The value of `key` in node `i`'s store.
    pub fn store_get(&self, i: usize, key: &str) -> Option<Vec<u8>> {
        self.nodes[i].core.as_ref().and_then(|c| c.store_value(key)).map(<[u8]>::to_vec)
    }

    /// The answers node `i`'s core gave to its store requests.
    pub fn store_replies(&self, i: usize) -> &[(u64, crate::node::StoreAnswer)] {
        &self.nodes[i].store_replies
    }

    /// The lighthouse's answers to node `i`'s ranks (`Input::LhQuorum`): when, which
    /// request, what quorum.
    pub fn lh_answers(&self, i: usize) -> &[(Duration, u64, crate::lighthouse::Quorum)] {
        &self.nodes[i].lh_answers
    }

    /// The roster addresses of the replica groups node `i` was told were lost
    /// ([`Event::GroupLost`]), in order.
    pub fn groups_lost(&self, i: usize) -> &[SocketAddr] {
        &self.nodes[i].groups_lost
    }

    /// The running job's rosters node `i` was told of after its launch
    /// ([`Event::RosterChanged`]: a node joined), in order.
    pub fn rosters_changed(&self, i: usize) -> &[Roster] {
        &self.nodes[i].rosters_changed
    }

    /// Starts every node now.
    pub fn start_all(&mut self) {
        for i in 0..self.nodes.len() {
            self.start(i);
        }
    }

    /// Starts node `i` now (seeded with node 0), if it is not running.
    pub fn start(&mut self, i: usize) {
        if self.nodes[i].core.is_some() {
            return;
        }
        let now = self.instant();
        let addr = self.nodes[i].addr;
        let meta = self.meta.get(&i).cloned().unwrap_or_else(|| self.default_meta(i));
        let cfg = NodeConfig {
            id: self.nodes[i].id,
            addr,
            report: LocalFacts {
                cmd: "train.py".into(),
                cmd_hash: meta.cmd_hash,
                nproc: meta.nproc,
                gpus: meta.gpus,
                cuda_driver: meta.cuda_driver,
                nccl_version: meta.nccl_version,
                mtu: 1500,
                iface: "eth0".into(),
                forced: None,
                tunnel: true,
            },
            meta,
            seeds: vec![node_addr(self.seed_of.get(&i).copied().unwrap_or(0))],
            membership: self.cfg.membership.clone(),
            rdzv: self.rdzv.get(&i).cloned().unwrap_or_else(|| self.cfg.rdzv.clone()),
            rdzv_timeout: self.cfg.rdzv_timeout,
            preflight_timeout: Duration::from_secs(20),
            max_restarts: self.cfg.max_restarts,
            seed: self.rng.next_u64(),
            timing: self.cfg.timing.clone(),
            store: crate::store::StoreConfig::default(),
            fault_tolerance: self.cfg.fault_tolerance,
            lighthouse: self.cfg.lighthouse.clone(),
        };
        let n = &mut self.nodes[i];
        n.life += 1;
        n.started = Some(self.net.now());
        n.ranks_running = false;
        n.ranks_ended = None;
        n.core = Some(Node::new(cfg, now));
        self.after(i);
    }

    /// Stops node `i` abruptly (its ranks die with it).
    pub fn crash(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        n.core = None;
        n.wake = None;
        n.ranks_running = false;
        n.ranks_gen += 1;
    }

    /// Crashes node `i` and starts it again at the same address with a new id.
    pub fn restart(&mut self, i: usize) {
        self.crash(i);
        self.nodes[i].id = net::fresh_id(&mut self.rng);
        self.start(i);
    }

    /// Gives node `i` an input now (a rank failure, a signal, a user abort).
    pub fn input(&mut self, i: usize, input: Input) {
        let now = self.instant();
        let n = &mut self.nodes[i];
        if n.core.is_some() && matches!(input, Input::RankFailed { .. } | Input::RanksExited) {
            n.ranks_running = false;
            n.ranks_ended = Some(self.net.now());
            n.ranks_gen += 1;
        }
        if let Some(c) = n.core.as_mut() {
            c.handle(input, now);
            self.after(i);
        }
    }

    /// Sends `frame` to node `to` as if from `from_addr` with id `id` (a straggler of an
    /// earlier job, a hostile peer).
    pub fn send_raw(&mut self, from_addr: SocketAddr, id: NodeId, to: usize, frame: &Frame) {
        let bytes = wire::encode(frame);
        let at = self.net.now() + self.cfg.latency.0;
        let life = self.nodes[to].life;
        self.net.push(at, Kind::Deliver { to, life, from: usize::MAX, from_addr, id, bytes });
    }

    /// Whether every node that was started has ended.
    pub fn all_ended(&self) -> bool {
        self.nodes.iter().all(|n| n.core.is_none())
    }

    // ---- internals ----

    fn default_meta(&self, i: usize) -> NodeMeta {
        super::node_meta(i, self.nodes[i].addr)
    }

    /// The clock as the cores read it.
    fn instant(&self) -> Instant {
        self.net.at(self.net.now())
    }

    fn io(&mut self, i: usize, after: Duration, input: Input) {
        let (life, ranks) = (self.nodes[i].life, self.nodes[i].ranks_gen);
        self.net.push(self.net.now() + after, Kind::Io { node: i, life, ranks, input });
    }

    fn run_to(&mut self, end: Duration) {
        while let Some((at, kind)) = self.net.next_by(end) {
            let now = self.instant();
            match kind {
                Kind::Wake { node, life } => {
                    let n = &mut self.nodes[node];
                    if n.life != life || n.wake != Some(at) {
                        continue;
                    }
                    n.wake = None;
                    if let Some(c) = n.core.as_mut() {
                        if c.poll_timeout().is_some_and(|t| t <= now) {
                            c.handle_timeout(now);
                        }
                        self.after(node);
                    }
                }
                Kind::Deliver { to, life, from, from_addr, id, bytes } => {
                    let partitioned = from != usize::MAX && !self.net.reachable(to, from);
                    if partitioned || self.nodes[to].life != life || self.nodes[to].core.is_none() {
                        continue;
                    }
                    let frame: Frame = match wire::decode(&bytes) {
                        Ok(f) => f,
                        Err(e) => panic!("node sim seed {}: a frame failed to decode: {e}", self.cfg.seed),
                    };
                    if let Some(c) = self.nodes[to].core.as_mut() {
                        c.handle(Input::Frame { from: from_addr, node: id, frame }, now);
                        self.after(to);
                    }
                }
                Kind::Io { node, life, ranks, input } => {
                    let n = &mut self.nodes[node];
                    if n.life != life {
                        continue;
                    }
                    let rank_result = matches!(input, Input::RanksExited | Input::RankFailed { .. });
                    if rank_result {
                        if n.ranks_gen != ranks || !n.ranks_running {
                            continue;
                        }
                        n.ranks_running = false;
                        n.ranks_ended = Some(self.net.now());
                    }
                    if let Some(c) = n.core.as_mut() {
                        c.handle(input, now);
                        self.after(node);
                    }
                }
            }
        }
        self.net.reach(end);
    }

    /// Sends node `i`'s frames, carries out its requests, reschedules its timer.
    fn after(&mut self, i: usize) {
        let Some(mut core) = self.nodes[i].core.take() else { return };
        let mut finished = false;
        loop {
            let mut any = false;
            while let Some(t) = core.poll_transmit() {
                any = true;
                self.transmit(i, core.id(), t.to, &t.frame, t.delivery);
            }
            while let Some(ev) = core.poll_event() {
                any = true;
                // The round's MASTER_PORT, at once (as meshd's actor answers).
                if let Event::RoundBegan { restart } = ev {
                    core.handle(Input::MasterPort { round: restart, port: 29500 }, self.instant());
                    continue;
                }
                if self.carry_out(i, &core, ev) {
                    finished = true;
                }
            }
            if finished {
                // meshd leaves the mesh on its way out, then its process ends.
                core.handle(Input::Leave, self.instant());
                while let Some(t) = core.poll_transmit() {
                    self.transmit(i, core.id(), t.to, &t.frame, t.delivery);
                }
                let n = &mut self.nodes[i];
                n.wake = None;
                n.ranks_gen += 1;
                return;
            }
            if !any {
                break;
            }
        }
        let wake = core.poll_timeout().map(|t| self.net.since_start(t));
        let life = self.nodes[i].life;
        self.nodes[i].core = Some(core);
        if wake != self.nodes[i].wake {
            self.nodes[i].wake = wake;
            if let Some(at) = wake {
                self.net.push(at, Kind::Wake { node: i, life });
            }
        }
    }

    fn transmit(&mut self, i: usize, id: NodeId, to: SocketAddr, frame: &Frame, delivery: Delivery) {
        let bytes = wire::encode(frame);
        self.frames += 1;
        self.bytes += bytes.len() as u64;
        if delivery == Delivery::Datagram {
            assert!(
                bytes.len() <= self.cfg.membership.max_datagram,
                "node sim seed {}: node {i} sent a {}-byte datagram",
                self.cfg.seed,
                bytes.len()
            );
            if self.net.lost(&mut self.rng) {
                return;
            }
        }
        let Some(&j) = self.by_addr.get(&to) else { return };
        if !self.net.reachable(i, j) {
            return;
        }
        let latency = self.net.latency(&mut self.rng);
        let from_addr = self.nodes[i].addr;
        let life = self.nodes[j].life;
        self.net.push(self.net.now() + latency, Kind::Deliver { to: j, life, from: i, from_addr, id, bytes });
    }

    /// The simulated IO for one event of node `i`; true when the node finished.
    fn carry_out(&mut self, i: usize, core: &Node, ev: Event) -> bool {
        let d = self.cfg.io_delay;
        match ev {
            Event::StartPreflight { roster, master } => {
                let nccl_id = master.then(|| vec![7u8; 128]);
                let input = Input::PreflightReady {
                    round: roster.restart,
                    tcp_port: 40000,
                    nccl_id,
                    nccl_note: None,
                    problems: vec![],
                };
                self.io(i, d, input);
            }
            Event::Dial { round, targets, .. } => {
                let mut slowest = d;
                let probes = targets
                    .into_iter()
                    .map(|t| {
                        let j = self.by_addr.get(&SocketAddr::new(t.addr.ip(), 29400)).copied();
                        let blocked =
                            j.is_none_or(|j| self.blocked_tcp.contains(&(i, j)) || !self.net.reachable(i, j));
                        if blocked {
                            slowest = slowest.max(self.cfg.connect_timeout);
                        }
                        TcpProbe {
                            to: t.to,
                            target: t.addr.to_string(),
                            ok: !blocked,
                            detail: if blocked { "connection timed out".into() } else { String::new() },
                            what: t.what,
                        }
                    })
                    .collect();
                self.io(i, slowest, Input::Dialed { round, probes, nccl_root: None });
            }
            Event::Launch { roster, .. } => {
                self.launches.push(Launch {
                    at: self.net.now() + d,
                    node: i,
                    id: core.id(),
                    roster: roster.clone(),
                });
                self.nodes[i].ranks_gen += 1;
                self.nodes[i].ranks_running = true;
                self.io(i, d, Input::RanksSpawned);
                let plan = self.ranks.get(&(i, roster.restart)).copied().unwrap_or(self.cfg.ranks);
                match plan {
                    Ranks::Exit0(t) => self.io(i, d + t, Input::RanksExited),
                    Ranks::Fail(t, status) => {
                        let cause = RankFailure {
                            status,
                            host: format!("gpu-node-{i:04}"),
                            ..RankFailure::default()
                        };
                        let reason = format!("rank 0 on node {i} exited with status {status}");
                        self.io(
                            i,
                            d + t,
                            Input::RankFailed { rank: Some(0), reason, cause: Some(Box::new(cause)) },
                        );
                    }
                    Ranks::Hang => {}
                }
            }
            Event::StoreReply { req, answer } => self.nodes[i].store_replies.push((req, answer)),
            Event::LhQuorum { req, quorum } => self.nodes[i].lh_answers.push((self.net.now(), req, quorum)),
            // MESHD_SIM_LOG=1: every node's log lines, for replaying a seed by hand.
            Event::Log(_, text) if std::env::var_os("MESHD_SIM_LOG").is_some() => {
                eprintln!("{:?} node {i}: {text}", self.net.now())
            }
            Event::PeerFinished(_) => {}
            Event::GroupLost { addr, .. } => self.nodes[i].groups_lost.push(addr),
            Event::RosterChanged(r) => self.nodes[i].rosters_changed.push(r),
            Event::StopRanks => {
                self.stops.push(Stopped { at: self.net.now(), node: i, restart: core.restart() });
                let n = &mut self.nodes[i];
                n.ranks_gen += 1;
                if n.ranks_running {
                    n.ranks_running = false;
                    n.ranks_ended = Some(self.net.now() + d);
                }
                self.io(i, d, Input::RanksStopped);
            }
            Event::Finished(outcome) => {
                let ranks_ended = self.nodes[i].ranks_ended;
                self.outcomes.push(Ended { at: self.net.now(), node: i, ranks_ended, outcome });
                return true;
            }
            _ => {}
        }
        false
    }
}

/// The figures of issue 17, seeded: job formation (N nodes of a fixed-size job start at
/// once -> every node launched its ranks) and abort propagation (a rank fails on one node
/// -> every node stopped its ranks), in simulated time on a LAN.
pub fn job_figures(n: usize, seed: u64) -> Result<(Duration, Duration), String> {
    let cfg = NodeSimConfig {
        nodes: n,
        seed,
        rdzv: RdzvConfig { min_nodes: n as u32, max_nodes: n as u32, ..RdzvConfig::default() },
        rdzv_timeout: Duration::from_secs(120),
        ranks: Ranks::Hang,
        ..NodeSimConfig::default()
    };
    let mut s = NodeSim::new(cfg);
    s.start_all();
    if s.run_until(Duration::from_secs(60), |s| s.launches().len() >= n).is_none() {
        return Err(format!("N={n} seed {seed}: {} of {n} nodes launched within 60 s", s.launches().len()));
    }
    let formed = s.launches().iter().map(|l| l.at).max().unwrap_or_default();
    s.run_for(Duration::from_millis(500));
    let t0 = s.now();
    s.input(n / 2, Input::RankFailed { rank: Some(0), reason: "rank failed".into(), cause: None });
    let reached = s.run_until(Duration::from_secs(30), |s| {
        s.stops().iter().map(|x| x.node).collect::<BTreeSet<usize>>().len() >= n
    });
    if reached.is_none() {
        return Err(format!("N={n} seed {seed}: the abort did not reach all {n} nodes within 30 s"));
    }
    let last = s.stops().iter().map(|x| x.at).max().unwrap_or(t0);
    Ok((formed, last - t0))
}

#[cfg(test)]
mod ft_tests;
#[cfg(test)]
mod tests;
