//! A deterministic discrete-event network simulator over the real [`Membership`] core.
//!
//! Virtual time only: the clock is a base [`Instant`] plus an offset that jumps from one
//! event to the next, so a thousand nodes and a minute of gossip run in seconds of real
//! time. Every message is encoded with [`wire::encode`] and decoded with [`wire::decode`]
//! on delivery, so byte counts are real and a datagram over `max_datagram` bytes is caught
//! (it panics, naming the seed). Everything random (ids, latencies, losses, the cores'
//! own choices) comes from one seeded [`Rng`]: a run replays exactly from its seed.
//!
//! The network: each node has a distinct fake address `10.x.y.z:29400` (never used for
//! real IO). A message leaves after the node's egress link is free (optional bandwidth),
//! then takes a uniformly drawn latency. Datagrams are lost with probability `loss`;
//! reliable messages are never lost (QUIC retransmits) except across a partition or to a
//! crashed node. A partition drops everything between groups, both at send and at delivery.
//!
//! [`Sim::restart`] brings a node back at the same address with a **new** [`NodeId`], as a
//! restarted meshd process would be: the old id is expected to be declared dead and the new
//! one to join through node 0, the seed of every node.

mod net;
pub mod node;

use crate::id::NodeId;
use crate::membership::{Delivery, MemberEvent, MemberStatus, Membership, MembershipConfig, Message};
use crate::meta::{IfaceAddr, NodeMeta};
use crate::rng::Rng;
use crate::wire;
use net::{Net, simulator_api};
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

/// The simulated network and cluster.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Number of nodes.
    pub nodes: usize,
    /// Seed of every random choice in the run.
    pub seed: u64,
    /// One-way latency, drawn uniformly in `[min, max]` per message.
    pub latency: (Duration, Duration),
    /// Probability that a datagram is lost.
    pub loss: f64,
    /// Egress bandwidth of every node in bytes per second (`None`: unlimited).
    pub bandwidth: Option<u64>,
    /// How often [`Sim::run_until`] evaluates its predicate (its time resolution).
    pub check_interval: Duration,
    /// Configuration of every node's membership core.
    pub membership: MembershipConfig,
}

impl Default for SimConfig {
    /// 8 nodes on a LAN: 0.2-1 ms latency, no loss, 10 Gbit/s links.
    fn default() -> Self {
        SimConfig {
            nodes: 8,
            seed: 1,
            latency: (Duration::from_micros(200), Duration::from_millis(1)),
            loss: 0.0,
            bandwidth: Some(1_250_000_000),
            check_interval: Duration::from_millis(10),
            membership: MembershipConfig::default(),
        }
    }
}

/// Traffic counters of one node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Encoded bytes sent (datagrams and reliable messages).
    pub bytes_sent: u64,
    /// Encoded bytes delivered to it.
    pub bytes_received: u64,
    /// Datagrams sent.
    pub datagrams: u64,
    /// Reliable messages sent.
    pub reliable: u64,
}

/// A Down event seen by one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Simulated time of the verdict.
    pub at: Duration,
    /// Index of the node that declared it.
    pub observer: usize,
    /// The id declared dead.
    pub subject: NodeId,
    /// Whether that id belonged to a running node at the time (a false verdict, unless a
    /// partition made it unreachable).
    pub subject_running: bool,
}

#[derive(Debug)]
enum EventKind {
    Deliver { to: usize, from: usize, from_addr: SocketAddr, bytes: Vec<u8> },
    Wake { node: usize },
}

#[derive(Debug)]
struct SimNode {
    addr: SocketAddr,
    id: NodeId,
    core: Option<Membership>,
    wake: Option<Duration>,
    egress_free: Duration,
    stats: NodeStats,
}

/// A seeded simulation of `nodes` membership cores on a virtual network.
#[derive(Debug)]
pub struct Sim {
    config: SimConfig,
    rng: Rng,
    net: Net<EventKind>,
    nodes: Vec<SimNode>,
    by_addr: HashMap<SocketAddr, usize>,
    /// Current id of every running node.
    by_id: BTreeMap<NodeId, usize>,
    verdicts: Vec<Verdict>,
    events: u64,
}

simulator_api!(Sim, config);

impl Sim {
    /// A network of `config.nodes` stopped nodes (see [`Sim::start_all`]).
    pub fn new(config: SimConfig) -> Self {
        let mut rng = Rng::new(config.seed);
        let nodes: Vec<SimNode> = (0..config.nodes)
            .map(|i| SimNode {
                addr: node_addr(i),
                id: net::fresh_id(&mut rng),
                core: None,
                wake: None,
                egress_free: Duration::ZERO,
                stats: NodeStats::default(),
            })
            .collect();
        let by_addr = nodes.iter().enumerate().map(|(i, n)| (n.addr, i)).collect();
        Sim {
            net: Net::new(config.nodes, config.latency, config.loss),
            config,
            rng,
            nodes,
            by_addr,
            by_id: BTreeMap::new(),
            verdicts: Vec::new(),
            events: 0,
        }
    }

    /// Address of node `i`.
    pub fn addr(&self, i: usize) -> SocketAddr {
        self.nodes[i].addr
    }

    /// The membership core of node `i`, if running.
    pub fn core(&self, i: usize) -> Option<&Membership> {
        self.nodes[i].core.as_ref()
    }

    /// Traffic counters of every node.
    pub fn stats(&self) -> Vec<NodeStats> {
        self.nodes.iter().map(|n| n.stats).collect()
    }

    /// Zeroes the traffic counters (to measure a steady state).
    pub fn reset_stats(&mut self) {
        for n in &mut self.nodes {
            n.stats = NodeStats::default();
        }
    }

    /// Every Down event so far.
    pub fn verdicts(&self) -> &[Verdict] {
        &self.verdicts
    }

    /// Down events about ids of nodes that were running at the time.
    pub fn false_verdicts(&self) -> usize {
        self.verdicts.iter().filter(|v| v.subject_running).count()
    }

    /// Events processed so far (a cost measure).
    pub fn events_processed(&self) -> u64 {
        self.events
    }

    /// Starts every node at the current time, all with node 0 as their seed.
    pub fn start_all(&mut self) {
        for i in 0..self.nodes.len() {
            self.boot(i);
        }
    }

    /// Stops node `i` abruptly: it sends nothing more, and what reaches it is lost.
    pub fn crash(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        n.core = None;
        n.wake = None;
        self.by_id.remove(&n.id);
    }

    /// Crashes node `i` if needed and starts it again at the same address with a new id,
    /// seeded with node 0.
    pub fn restart(&mut self, i: usize) {
        self.crash(i);
        self.nodes[i].id = self.fresh_id();
        self.boot(i);
    }

    /// Whether every running node sees every running node (itself included) Alive.
    pub fn converged(&self) -> bool {
        let running: Vec<NodeId> = self.by_id.keys().copied().collect();
        self.nodes.iter().filter_map(|n| n.core.as_ref()).all(|c| {
            c.count(MemberStatus::Alive) >= running.len()
                && running.iter().all(|id| c.status(*id) == Some(MemberStatus::Alive))
        })
    }

    /// Whether every running node considers `id` not alive (Dead, Left or unknown).
    pub fn all_see_gone(&self, id: NodeId) -> bool {
        self.nodes
            .iter()
            .filter_map(|n| n.core.as_ref())
            .all(|c| !matches!(c.status(id), Some(MemberStatus::Alive | MemberStatus::Suspect)))
    }

    // ---- internals ----

    fn fresh_id(&mut self) -> NodeId {
        net::fresh_id(&mut self.rng)
    }

    fn boot(&mut self, i: usize) {
        if self.nodes[i].core.is_some() {
            return;
        }
        let now = self.net.at(self.net.now());
        let addr = self.nodes[i].addr;
        let id = self.nodes[i].id;
        let core_seed = self.rng.next_u64();
        let mut core =
            Membership::new(id, addr, node_meta(i, addr), self.config.membership.clone(), core_seed, now);
        core.add_seeds(&[node_addr(0)], now);
        self.nodes[i].core = Some(core);
        self.by_id.insert(id, i);
        self.after(i);
    }

    fn run_to(&mut self, end: Duration) {
        while let Some((at, kind)) = self.net.next_by(end) {
            self.events += 1;
            let now = self.net.at(self.net.now());
            match kind {
                EventKind::Wake { node } => {
                    if self.nodes[node].wake != Some(at) {
                        continue; // superseded
                    }
                    self.nodes[node].wake = None;
                    if let Some(c) = self.nodes[node].core.as_mut() {
                        c.handle_timeout(now);
                        self.after(node);
                    }
                }
                EventKind::Deliver { to, from, from_addr, bytes } => {
                    if !self.net.reachable(to, from) || self.nodes[to].core.is_none() {
                        continue;
                    }
                    let msg: Message = match wire::decode(&bytes) {
                        Ok(m) => m,
                        Err(e) => panic!(
                            "sim seed {}: a membership message failed to decode: {e}",
                            self.config.seed
                        ),
                    };
                    self.nodes[to].stats.bytes_received += bytes.len() as u64;
                    if let Some(c) = self.nodes[to].core.as_mut() {
                        c.handle_message(from_addr, msg, now);
                        self.after(to);
                    }
                }
            }
        }
        self.net.reach(end);
    }

    /// Drains node `i`'s transmits and events and reschedules its timer.
    fn after(&mut self, i: usize) {
        let Some(mut core) = self.nodes[i].core.take() else {
            return;
        };
        let max_datagram = self.config.membership.max_datagram;
        while let Some(t) = core.poll_transmit() {
            let bytes = wire::encode(&t.msg);
            let len = bytes.len();
            let node = &mut self.nodes[i];
            node.stats.bytes_sent += len as u64;
            match t.delivery {
                Delivery::Datagram => {
                    node.stats.datagrams += 1;
                    assert!(
                        len <= max_datagram,
                        "sim seed {}: node {i} sent a {len}-byte datagram (max {max_datagram}): {:?}",
                        self.config.seed,
                        t.msg
                    );
                }
                Delivery::Reliable => node.stats.reliable += 1,
            }
            let depart = match self.config.bandwidth {
                Some(bw) if bw > 0 => {
                    let start = node.egress_free.max(self.net.now());
                    let free = start + Duration::from_secs_f64(len as f64 / bw as f64);
                    node.egress_free = free;
                    free
                }
                _ => self.net.now(),
            };
            let Some(&to) = self.by_addr.get(&t.to) else {
                continue;
            };
            if t.delivery == Delivery::Datagram && self.net.lost(&mut self.rng) {
                continue;
            }
            if !self.net.reachable(to, i) {
                continue;
            }
            let latency = self.net.latency(&mut self.rng);
            let from_addr = self.nodes[i].addr;
            self.net.push(depart + latency, EventKind::Deliver { to, from: i, from_addr, bytes });
        }
        while let Some(ev) = core.poll_event() {
            if let MemberEvent::Down(subject) = ev {
                self.verdicts.push(Verdict {
                    at: self.net.now(),
                    observer: i,
                    subject,
                    subject_running: self.by_id.contains_key(&subject),
                });
            }
        }
        let wake = core.poll_timeout().map(|t| self.net.since_start(t));
        self.nodes[i].core = Some(core);
        if wake != self.nodes[i].wake {
            self.nodes[i].wake = wake;
            if let Some(at) = wake {
                self.net.push(at, EventKind::Wake { node: i });
            }
        }
    }
}

/// The fake address of node `i`: 10.x.y.z:29400.
pub fn node_addr(i: usize) -> SocketAddr {
    let n = 0x0a00_0001u32 + i as u32;
    SocketAddr::new(IpAddr::V4(Ipv4Addr::from(n)), 29400)
}

/// Metadata of the size a real node advertises.
fn node_meta(i: usize, addr: SocketAddr) -> NodeMeta {
    NodeMeta {
        gossip_addr: Some(addr),
        hostname: format!("gpu-node-{i:04}"),
        iface: "eth0".into(),
        addrs: vec![
            IfaceAddr { name: "eth0".into(), addr: addr.ip() },
            IfaceAddr { name: "docker0".into(), addr: IpAddr::V4(Ipv4Addr::new(172, 17, 0, 1)) },
        ],
        nproc: 8,
        gpus: 8,
        cuda_driver: 12040,
        nccl_version: 22105,
        meshd_version: env!("CARGO_PKG_VERSION").into(),
        cmd_hash: 0x1234_5678_9abc_def0,
        run_hash: 0x0fed_cba9_8765_4321,
        ..NodeMeta::default()
    }
}

#[cfg(test)]
mod tests;
