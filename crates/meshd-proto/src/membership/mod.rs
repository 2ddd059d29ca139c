//! SWIM membership with Lifeguard suspicion, piggybacked dissemination and push-pull sync.
//!
//! The model (SWIM, as in hashicorp/memberlist):
//! - **Failure detection.** Every `probe_interval` a node pings one member, going
//!   round-robin over a shuffled list. No [`Message::Ack`] within `probe_timeout`: it asks
//!   `indirect_probes` others to ping the target for it ([`Message::PingReq`]). Still no
//!   ack when the period ends: the target becomes *Suspect*. A suspicion turns into *Dead*
//!   after `suspicion_mult x max(1, log10 N) x probe_interval`, shrinking towards half of
//!   that as other members independently confirm it (Lifeguard). A suspected (or declared
//!   dead) node that hears about it refutes by bumping its incarnation.
//! - **Ordering.** Every state a member is in carries its incarnation. Alive(i) overrides
//!   Suspect/Dead/Left(j) only when i > j; Suspect(i) overrides Alive(j) when i >= j;
//!   Dead/Left(i) override Alive/Suspect(j) when i >= j. Only a node raises its own
//!   incarnation (refutation, metadata or address change).
//! - **Dissemination.** Changes are queued ([`broadcast`]) and piggybacked on every probe
//!   message, each sent about `4 x ceil(log10(N + 1))` times, plus a push gossip to
//!   `gossip_fanout` random members every `gossip_interval` while there is something to say.
//!   Every node that learns something new queues it again (infection style).
//! - **Join and anti-entropy.** A node sends its table to its seeds ([`Message::SyncRequest`],
//!   reliable) and merges the full table they answer ([`Message::SyncResponse`]). It syncs
//!   again after 250 ms (with a seed), 500 ms and 1 s (random members), then every
//!   `sync_interval` (scaled up for clusters over 32 nodes) with a random member, and every
//!   `sync_interval` with a seed or a dead member that is not currently alive: that is how
//!   the two sides of a healed partition, or a node wrongly declared dead, find each other.
//!   Remote Dead verdicts arriving by sync become suspicions (as in memberlist), so a sync
//!   never kills a healthy node outright: it gives it the chance to refute.
//!
//! Identity is the [`NodeId`], never the address. A member's address is the one it
//! advertises; replies (acks, sync responses) go to the transport source address.
//! Everything is bounded: the member table ([`MAX_MEMBERS`]), the broadcast queue (one
//! entry per member), relayed probes, pending transmits and undelivered events.
//!
//! Files, one idea each (all of them `impl` blocks of [`Membership`], defined here with
//! its public driving API):
//! - `messages`: the wire messages, transmits and events ([`Message`], [`MemberEvent`]).
//! - `config`: [`MembershipConfig`] and the fixed bounds.
//! - `probe`: the failure detector's direct and indirect probes.
//! - `suspicion`: Suspect and Dead transitions, Lifeguard timeouts, refutation.
//! - `table`: Alive transitions, eviction from a full table, expiry of Dead/Left entries.
//! - `gossip`: piggybacked and pushed dissemination, corrections to stale senders.
//! - `broadcast`: the transmit-limited queue gossip draws from.
//! - `sync`: push-pull anti-entropy (join, periodic, rejoin towards seeds and the dead).

mod broadcast;
mod config;
mod gossip;
mod messages;
mod probe;
mod suspicion;
mod sync;
mod table;
#[cfg(test)]
mod tests;

pub use config::{MAX_MEMBERS, MAX_META, MAX_SYNC_BYTES, MembershipConfig};
pub use messages::{
    Delivery, MemberEvent, MemberState, MemberStatus, MemberView, Message, Transmit, Update, UpdateKind,
};

use crate::codec as wire;
use crate::id::NodeId;
use crate::meta::NodeMeta;
use crate::rng::Rng;
use broadcast::BroadcastQueue;
use config::{JOIN_RESYNC, MAX_EVENTS, MAX_RELAYS, MAX_SEEDS, MAX_TRANSMITS, REAP_EVERY};
use probe::{Probe, Relay};
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use suspicion::Suspicion;

#[derive(Debug)]
struct Member {
    addr: SocketAddr,
    meta: NodeMeta,
    meta_size: usize,
    incarnation: u64,
    status: MemberStatus,
    /// When the status last changed.
    since: Instant,
    srtt: Option<Duration>,
    /// Last time the driver saw traffic from this member on its own link
    /// ([`Membership::heard_from`]): evidence of life that does not wait in line behind
    /// bulk data the way a probe's answer does.
    heard: Option<Instant>,
}

/// The SWIM membership state machine of one node. Sans-IO: feed it messages and timeouts,
/// drain transmits and events.
#[derive(Debug)]
pub struct Membership {
    id: NodeId,
    config: MembershipConfig,
    rng: Rng,
    members: BTreeMap<NodeId, Member>,
    /// Alive/Suspect members other than self, rebuilt when `live_dirty`.
    live: Vec<NodeId>,
    live_dirty: bool,
    suspicions: BTreeMap<NodeId, Suspicion>,
    broadcasts: BroadcastQueue,
    transmits: VecDeque<Transmit>,
    events: VecDeque<MemberEvent>,
    seeds: Vec<SocketAddr>,
    probe_order: Vec<NodeId>,
    probe_index: usize,
    probe: Option<Probe>,
    next_seq: u32,
    relays: BTreeMap<u32, Relay>,
    next_probe: Instant,
    next_gossip: Instant,
    next_sync: Instant,
    join_resyncs: u32,
    next_rejoin: Instant,
    next_reap: Instant,
    /// Earliest time a sync towards a node we think dead may be sent again.
    dead_sender_sync_at: Instant,
    left: bool,
}

impl Membership {
    /// A node alone in its table, Alive at incarnation 0. `seed` drives every random
    /// choice (replayable runs).
    pub fn new(
        id: NodeId,
        addr: SocketAddr,
        meta: NodeMeta,
        config: MembershipConfig,
        seed: u64,
        now: Instant,
    ) -> Self {
        let config = config.sanitized();
        let mut rng = Rng::new(seed);
        let meta_size = wire::encode(&meta).len();
        let mut members = BTreeMap::new();
        members.insert(
            id,
            Member {
                addr,
                meta,
                meta_size,
                incarnation: 0,
                status: MemberStatus::Alive,
                since: now,
                srtt: None,
                heard: None,
            },
        );
        // Random phases so that nodes started together do not probe in lockstep.
        let next_probe = now + config.probe_interval.mul_f64(rng.unit());
        let next_rejoin = now + config.sync_interval.mul_f64(0.5 + rng.unit());
        Membership {
            id,
            config,
            rng,
            members,
            live: Vec::new(),
            live_dirty: false,
            suspicions: BTreeMap::new(),
            broadcasts: BroadcastQueue::default(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            seeds: Vec::new(),
            probe_order: Vec::new(),
            probe_index: 0,
            probe: None,
            next_seq: 0,
            relays: BTreeMap::new(),
            next_probe,
            next_gossip: now,
            next_sync: now + JOIN_RESYNC,
            join_resyncs: 0,
            next_rejoin,
            next_reap: now + REAP_EVERY,
            dead_sender_sync_at: now,
            left: false,
        }
    }

    /// Adds addresses to join through and to retry when they are not alive members (our
    /// own address is ignored). Sends them our table right away and restarts the fast
    /// resync schedule of a joining node.
    pub fn add_seeds(&mut self, seeds: &[SocketAddr], now: Instant) {
        let own = self.own().addr;
        for &s in seeds {
            if s != own && !self.seeds.contains(&s) && self.seeds.len() < MAX_SEEDS {
                self.seeds.push(s);
            }
        }
        if self.left {
            return;
        }
        for s in self.seeds.clone() {
            self.send_sync(s, now);
        }
        self.join_resyncs = 0;
        self.next_sync = now + self.jitter(JOIN_RESYNC);
    }

    /// Handles a message received from transport address `from`.
    pub fn handle_message(&mut self, from: SocketAddr, msg: Message, now: Instant) {
        match msg {
            Message::Ping { from: sender, seq, target, updates } => {
                self.apply_updates(from, updates, now);
                if target == self.id {
                    let ack = Message::Ack { from: self.id, seq, updates: Vec::new() };
                    self.send_datagram(from, ack);
                }
                self.check_sender(sender, from, now);
            }
            Message::Ack { from: sender, seq, updates } => {
                self.apply_updates(from, updates, now);
                self.handle_ack(sender, seq, now);
            }
            Message::PingReq { from: sender, seq, target, target_addr, updates } => {
                self.apply_updates(from, updates, now);
                if target == self.id {
                    let ack = Message::IndirectAck { from: self.id, seq, target, updates: Vec::new() };
                    self.send_datagram(from, ack);
                } else if self.relays.len() < MAX_RELAYS {
                    let rseq = self.seq();
                    self.relays.insert(
                        rseq,
                        Relay {
                            origin: from,
                            origin_seq: seq,
                            target,
                            expires: now + self.config.probe_interval,
                        },
                    );
                    let ping = Message::Ping { from: self.id, seq: rseq, target, updates: Vec::new() };
                    self.send_datagram(target_addr, ping);
                }
                self.check_sender(sender, from, now);
            }
            Message::IndirectAck { from: _, seq, target, updates } => {
                self.apply_updates(from, updates, now);
                if let Some(p) = &mut self.probe {
                    if p.seq == seq && p.target == target {
                        p.acked = true;
                    }
                }
            }
            Message::Gossip { from: sender, updates } => {
                self.apply_updates(from, updates, now);
                self.check_sender(sender, from, now);
            }
            Message::SyncRequest { from: sender, members } => {
                self.merge(sender, members, now);
                let members = self.snapshot();
                let msg = Message::SyncResponse { from: self.id, members };
                self.push_transmit(from, msg, Delivery::Reliable);
            }
            Message::SyncResponse { from: sender, members } => self.merge(sender, members, now),
        }
    }

    /// The driver saw traffic from `id` on its link at `now` (for example, its QUIC
    /// connection received packets). A probe or a suspicion of `id` that started before
    /// `now` does not make it dead: under a bulk transfer on a loaded machine, a probe's
    /// answer can wait in the receive queue longer than the probe timeout although the
    /// member is alive and talking. A dead member sends nothing, so this never hides a
    /// death; it only needs traffic to be attributed to the right member.
    pub fn heard_from(&mut self, id: NodeId, now: Instant) {
        if id == self.id {
            return;
        }
        if let Some(m) = self.members.get_mut(&id) {
            m.heard = Some(m.heard.map_or(now, |h| h.max(now)));
        }
    }

    /// Runs whatever is due at `now` (probes, suspicion expiry, gossip, syncs).
    pub fn handle_timeout(&mut self, now: Instant) {
        if !self.left && now >= self.next_probe {
            self.probe_tick(now);
            self.next_probe = next_tick(self.next_probe, self.config.probe_interval, now);
        }
        self.check_probe(now);
        self.expire_suspicions(now);
        if now >= self.next_gossip {
            self.gossip_round(now);
            self.next_gossip = now + self.config.gossip_interval;
        }
        if !self.left && now >= self.next_sync {
            self.sync_round(now);
        }
        if !self.left && now >= self.next_rejoin {
            self.rejoin_round(now);
        }
        if now >= self.next_reap {
            self.reap(now);
            self.next_reap = now + REAP_EVERY;
        }
    }

    /// The next message to send, if any.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next membership event, if any.
    pub fn poll_event(&mut self) -> Option<MemberEvent> {
        self.events.pop_front()
    }

    /// When [`Membership::handle_timeout`] should be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        let mut consider = |x: Instant| t = Some(t.map_or(x, |t| t.min(x)));
        if !self.broadcasts.is_empty() || !self.suspicions.is_empty() {
            consider(self.next_gossip);
        }
        if self.left {
            return t;
        }
        consider(self.next_probe);
        consider(self.next_sync);
        consider(self.next_rejoin);
        consider(self.next_reap);
        if let Some(p) = &self.probe {
            if !p.acked && !p.indirect_sent {
                consider(p.indirect_at);
            }
        }
        for s in self.suspicions.values() {
            consider(s.deadline());
        }
        t
    }

    /// Our own metadata changed: adopt it and disseminate it under a new incarnation.
    pub fn set_meta(&mut self, meta: NodeMeta, now: Instant) {
        if self.left || self.own().meta == meta {
            return;
        }
        let id = self.id;
        if let Some(me) = self.members.get_mut(&id) {
            me.meta_size = wire::encode(&meta).len();
            me.meta = meta;
            me.incarnation = me.incarnation.saturating_add(1);
        }
        self.announce_self(now);
        // Our own state changes are what a rendezvous or a restart round waits for (a node
        // moving to round r+1, or to Running): say it now rather than at the next gossip
        // tick, so forming a roster costs round trips, not gossip intervals.
        self.gossip_round(now);
        self.next_gossip = now + self.config.gossip_interval;
    }

    /// Our advertised address changed: adopt it and disseminate it under a new incarnation.
    pub fn set_addr(&mut self, addr: SocketAddr, now: Instant) {
        if self.left || self.own().addr == addr {
            return;
        }
        let id = self.id;
        if let Some(me) = self.members.get_mut(&id) {
            me.addr = addr;
            me.incarnation = me.incarnation.saturating_add(1);
        }
        self.seeds.retain(|s| *s != addr);
        self.announce_self(now);
    }

    /// Leaves gracefully: a Left update is pushed to several members at once and
    /// disseminated; probing and syncing stop. Final for this node id.
    pub fn leave(&mut self, now: Instant) {
        if self.left {
            return;
        }
        self.left = true;
        let id = self.id;
        let inc = match self.members.get_mut(&id) {
            Some(me) => {
                me.incarnation = me.incarnation.saturating_add(1);
                me.status = MemberStatus::Left;
                me.since = now;
                me.incarnation
            }
            None => 0,
        };
        self.probe = None;
        self.broadcasts.push(Update { id, incarnation: inc, kind: UpdateKind::Left });
        let fanout = self.config.gossip_fanout;
        self.config.gossip_fanout = fanout.saturating_mul(2).max(1);
        self.gossip_round(now);
        self.config.gossip_fanout = fanout;
        self.next_gossip = now + self.config.gossip_interval;
    }

    /// Everyone known, self included, sorted by id.
    pub fn members(&self) -> Vec<MemberView> {
        self.members.iter().map(|(id, m)| view(*id, m)).collect()
    }

    /// Alive and Suspect members, self included (unless it left), sorted by id.
    pub fn alive(&self) -> Vec<MemberView> {
        self.members.iter().filter(|(_, m)| m.status.is_live()).map(|(id, m)| view(*id, m)).collect()
    }

    /// This node's id.
    pub fn local_id(&self) -> NodeId {
        self.id
    }

    /// Smoothed round-trip time of direct probes to `id`.
    pub fn rtt(&self, id: NodeId) -> Option<Duration> {
        self.members.get(&id).and_then(|m| m.srtt)
    }

    /// One member's view (cheaper than [`Membership::members`] for a single lookup).
    pub fn member(&self, id: NodeId) -> Option<MemberView> {
        self.members.get(&id).map(|m| view(id, m))
    }

    /// Status of `id`, if known.
    pub fn status(&self, id: NodeId) -> Option<MemberStatus> {
        self.members.get(&id).map(|m| m.status)
    }

    /// Number of members (self included) with `status`.
    pub fn count(&self, status: MemberStatus) -> usize {
        self.members.values().filter(|m| m.status == status).count()
    }

    /// Our current incarnation.
    pub fn incarnation(&self) -> u64 {
        self.own().incarnation
    }

    /// Updates waiting to be disseminated (for `meshd status` and tests).
    pub fn queued_updates(&self) -> usize {
        self.broadcasts.len()
    }

    fn own(&self) -> &Member {
        // The own entry is inserted in `new` and never removed (reap skips it).
        match self.members.get(&self.id) {
            Some(m) => m,
            None => unreachable!("own member entry is never removed"),
        }
    }

    fn seq(&mut self) -> u32 {
        self.next_seq = self.next_seq.wrapping_add(1);
        self.next_seq
    }

    fn jitter(&mut self, d: Duration) -> Duration {
        d.mul_f64(0.75 + 0.5 * self.rng.unit())
    }

    fn emit(&mut self, ev: MemberEvent) {
        if self.events.len() >= MAX_EVENTS {
            self.events.pop_front();
        }
        self.events.push_back(ev);
    }

    fn push_transmit(&mut self, to: SocketAddr, msg: Message, delivery: Delivery) {
        if self.transmits.len() < MAX_TRANSMITS {
            self.transmits.push_back(Transmit { to, msg, delivery });
        }
    }

    /// Live peers (Alive or Suspect, not self).
    fn live_peers(&mut self) -> &[NodeId] {
        if self.live_dirty {
            let id = self.id;
            self.live = self
                .members
                .iter()
                .filter(|(m_id, m)| **m_id != id && m.status.is_live())
                .map(|(m_id, _)| *m_id)
                .collect();
            self.live_dirty = false;
        }
        &self.live
    }

    /// Cluster size estimate used by the formulas: live peers plus self.
    fn cluster_size(&mut self) -> usize {
        self.live_peers().len() + 1
    }

    /// Up to `k` distinct random live peers, excluding `exclude`.
    fn random_peers(&mut self, k: usize, exclude: Option<NodeId>) -> Vec<NodeId> {
        let mut pool: Vec<NodeId> = Vec::new();
        let n = self.live_peers().len();
        if n <= k + 1 {
            pool.extend(self.live_peers().iter().filter(|id| Some(**id) != exclude));
            self.rng.shuffle(&mut pool);
            pool.truncate(k);
            return pool;
        }
        let mut tries = 0;
        while pool.len() < k && tries < 8 * k {
            tries += 1;
            let i = self.rng.below(n);
            let id = self.live[i];
            if Some(id) != exclude && !pool.contains(&id) {
                pool.push(id);
            }
        }
        pool
    }
}

fn view(id: NodeId, m: &Member) -> MemberView {
    MemberView { id, addr: m.addr, meta: m.meta.clone(), status: m.status, incarnation: m.incarnation }
}

/// The next periodic tick after `prev`, skipping missed ones.
fn next_tick(prev: Instant, period: Duration, now: Instant) -> Instant {
    let next = prev + period;
    if next <= now { now + period } else { next }
}
