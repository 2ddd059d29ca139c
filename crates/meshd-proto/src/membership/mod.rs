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

mod broadcast;
#[cfg(test)]
mod tests;

use crate::id::NodeId;
use crate::meta::NodeMeta;
use crate::rng::Rng;
use crate::wire;
use broadcast::BroadcastQueue;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Most members (any status, self included) a node keeps; beyond it new ids are refused
/// unless a Dead/Left entry can be evicted.
pub const MAX_MEMBERS: usize = 10_000;
/// Largest encoded metadata accepted from a peer.
pub const MAX_META: usize = 8 * 1024;
/// Largest full-state sync message we build (the wire refuses frames over 4 MiB).
pub const MAX_SYNC_BYTES: usize = wire::MAX_FRAME - 64 * 1024;

const MAX_SEEDS: usize = 64;
const MAX_RELAYS: usize = 1024;
const MAX_TRANSMITS: usize = 16 * 1024;
/// Most stale-update corrections answered to one message.
const MAX_CORRECTIONS: usize = 8;
const MAX_EVENTS: usize = 4 * MAX_MEMBERS;
/// Lambda in "each update is sent lambda * log N times".
const RETRANSMIT_MULT: u32 = 4;
/// Independent confirmations that bring a suspicion down to its minimum timeout.
const MAX_CONFIRMATIONS: usize = 3;
/// Bytes of a datagram left free for the transport's frame wrapper.
const DATAGRAM_SLACK: usize = 8;
/// Delay of the first sync after joining; the next two double it.
const JOIN_RESYNC: Duration = Duration::from_millis(250);
const JOIN_RESYNCS: u32 = 3;
/// Dead/Left entries are checked for expiry at most this often.
const REAP_EVERY: Duration = Duration::from_secs(1);

/// Tuning of the membership protocol. The defaults target a LAN: a crash is known
/// everywhere within ~2 s (8 nodes) to ~5 s (1000 nodes) with no false verdicts under
/// 10 % datagram loss.
#[derive(Clone, Debug, PartialEq)]
pub struct MembershipConfig {
    /// Period of the failure detector: one member is probed per period.
    pub probe_interval: Duration,
    /// Wait for a direct ack before asking others to probe indirectly.
    pub probe_timeout: Duration,
    /// Members asked to probe indirectly when the direct probe times out.
    pub indirect_probes: usize,
    /// Period of push gossip (only sent while there are updates to disseminate).
    pub gossip_interval: Duration,
    /// Members each push gossip round goes to.
    pub gossip_fanout: usize,
    /// Suspicion timeout multiplier (Lifeguard): `mult x max(1, log10 N) x probe_interval`.
    pub suspicion_mult: u32,
    /// Period of full-state push-pull with a random member (scaled up over 32 members) and
    /// of the rejoin attempt towards seeds and dead members that are not alive.
    pub sync_interval: Duration,
    /// How long Dead and Left members stay in the table (and in syncs) before forgotten.
    pub dead_retention: Duration,
    /// Largest encoded [`Message`] sent with [`Delivery::Datagram`].
    pub max_datagram: usize,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            probe_interval: Duration::from_millis(400),
            probe_timeout: Duration::from_millis(150),
            indirect_probes: 3,
            gossip_interval: Duration::from_millis(100),
            gossip_fanout: 3,
            suspicion_mult: 2,
            sync_interval: Duration::from_secs(10),
            dead_retention: Duration::from_secs(120),
            max_datagram: 1100,
        }
    }
}

impl MembershipConfig {
    /// The same configuration with values that would make the core spin or never send
    /// anything raised to workable minimums.
    fn sanitized(mut self) -> Self {
        let ms = Duration::from_millis;
        self.probe_interval = self.probe_interval.max(ms(10));
        self.probe_timeout = self.probe_timeout.min(self.probe_interval);
        self.gossip_interval = self.gossip_interval.max(ms(1));
        self.sync_interval = self.sync_interval.max(ms(100));
        self.suspicion_mult = self.suspicion_mult.max(1);
        self.max_datagram = self.max_datagram.max(256);
        self
    }
}

/// Status of a member as this node sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum MemberStatus {
    /// Answers probes.
    Alive,
    /// Missed a probe; declared Dead unless it refutes in time.
    Suspect,
    /// Declared failed.
    Dead,
    /// Left gracefully.
    Left,
}

impl MemberStatus {
    fn is_live(self) -> bool {
        matches!(self, MemberStatus::Alive | MemberStatus::Suspect)
    }
}

/// One piece of disseminated news about a member.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Update {
    /// The member it is about.
    pub id: NodeId,
    /// The member's incarnation the news refers to.
    pub incarnation: u64,
    /// What happened.
    pub kind: UpdateKind,
}

/// What an [`Update`] says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum UpdateKind {
    /// The member is alive at this address with this metadata.
    Alive {
        /// Advertised address.
        addr: SocketAddr,
        /// Advertised metadata.
        meta: NodeMeta,
    },
    /// `accuser` could not reach the member.
    Suspect {
        /// Who suspects it (distinct accusers shorten the suspicion).
        accuser: NodeId,
    },
    /// `accuser` declared the member dead.
    Dead {
        /// Who declared it.
        accuser: NodeId,
    },
    /// The member left gracefully.
    Left,
}

/// One member's full state, as exchanged by sync.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemberState {
    /// Member id.
    pub id: NodeId,
    /// Advertised address.
    pub addr: SocketAddr,
    /// Advertised metadata.
    pub meta: NodeMeta,
    /// Incarnation of the status below.
    pub incarnation: u64,
    /// Status as the sender sees it.
    pub status: MemberStatus,
}

/// Membership messages between nodes. Append-only: new variants go at the end.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// Direct probe of `target`; answered with an [`Message::Ack`] carrying `seq`.
    Ping {
        /// Sender.
        from: NodeId,
        /// Probe sequence number, echoed in the ack.
        seq: u32,
        /// The node meant to answer (an address may have changed hands).
        target: NodeId,
        /// Piggybacked updates.
        updates: Vec<Update>,
    },
    /// Answer to a [`Message::Ping`].
    Ack {
        /// Sender (the probed node).
        from: NodeId,
        /// The ping's sequence number.
        seq: u32,
        /// Piggybacked updates.
        updates: Vec<Update>,
    },
    /// Request to probe `target` on the sender's behalf.
    PingReq {
        /// Sender (the original prober).
        from: NodeId,
        /// The original probe's sequence number, echoed in the indirect ack.
        seq: u32,
        /// The node to probe.
        target: NodeId,
        /// Where the sender reaches it.
        target_addr: SocketAddr,
        /// Piggybacked updates.
        updates: Vec<Update>,
    },
    /// `target` answered a probe relayed for the receiver.
    IndirectAck {
        /// Sender (the relay).
        from: NodeId,
        /// The original probe's sequence number.
        seq: u32,
        /// The node that answered.
        target: NodeId,
        /// Piggybacked updates.
        updates: Vec<Update>,
    },
    /// Push gossip: updates only.
    Gossip {
        /// Sender.
        from: NodeId,
        /// Updates.
        updates: Vec<Update>,
    },
    /// Push-pull: the sender's whole table; answered with [`Message::SyncResponse`].
    SyncRequest {
        /// Sender.
        from: NodeId,
        /// Sender's member table (itself included).
        members: Vec<MemberState>,
    },
    /// Answer to a [`Message::SyncRequest`]: the responder's whole table.
    SyncResponse {
        /// Sender.
        from: NodeId,
        /// Sender's member table (itself included).
        members: Vec<MemberState>,
    },
}

impl Message {
    fn updates_mut(&mut self) -> Option<&mut Vec<Update>> {
        match self {
            Message::Ping { updates, .. }
            | Message::Ack { updates, .. }
            | Message::PingReq { updates, .. }
            | Message::IndirectAck { updates, .. }
            | Message::Gossip { updates, .. } => Some(updates),
            Message::SyncRequest { .. } | Message::SyncResponse { .. } => None,
        }
    }
}

/// How a [`Transmit`] must travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Unreliable (QUIC datagram); encodes to at most `max_datagram` bytes.
    Datagram,
    /// Reliable (QUIC stream); up to 4 MiB.
    Reliable,
}

/// A message for the driver to send.
#[derive(Clone, Debug, PartialEq)]
pub struct Transmit {
    /// Destination address.
    pub to: SocketAddr,
    /// The message.
    pub msg: Message,
    /// How to send it.
    pub delivery: Delivery,
}

/// A member as seen by this node.
#[derive(Clone, Debug, PartialEq)]
pub struct MemberView {
    /// Member id.
    pub id: NodeId,
    /// Advertised address.
    pub addr: SocketAddr,
    /// Advertised metadata.
    pub meta: NodeMeta,
    /// Status.
    pub status: MemberStatus,
    /// Incarnation of that status.
    pub incarnation: u64,
}

/// A change in the membership, for the driver.
#[derive(Clone, Debug, PartialEq)]
pub enum MemberEvent {
    /// A member became Alive for the first time, or again after Dead/Left.
    Up(MemberView),
    /// A live member changed its metadata or address, or refuted a suspicion.
    Updated(MemberView),
    /// A member is suspected.
    Suspect(NodeId),
    /// A member was declared Dead.
    Down(NodeId),
    /// A member left gracefully.
    Left(NodeId),
}

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

#[derive(Debug)]
struct Suspicion {
    start: Instant,
    min: Duration,
    max: Duration,
    /// Confirmations that bring the timeout to `min`.
    k: usize,
    /// The first accuser and the confirmers after it.
    accusers: BTreeSet<NodeId>,
}

impl Suspicion {
    fn deadline(&self) -> Instant {
        let confirmations = self.accusers.len().saturating_sub(1);
        let timeout = if self.k == 0 {
            self.min
        } else {
            let frac = ((confirmations as f64 + 1.0).ln() / (self.k as f64 + 1.0).ln()).min(1.0);
            let span = self.max.saturating_sub(self.min);
            self.max.saturating_sub(span.mul_f64(frac)).max(self.min)
        };
        self.start + timeout
    }

    /// Records `accuser`; true when it is a new independent confirmation.
    fn confirm(&mut self, accuser: NodeId) -> bool {
        if self.accusers.len() > self.k {
            return false;
        }
        self.accusers.insert(accuser)
    }
}

#[derive(Debug)]
struct Probe {
    target: NodeId,
    seq: u32,
    sent: Instant,
    indirect_at: Instant,
    indirect_sent: bool,
    acked: bool,
}

#[derive(Debug)]
struct Relay {
    origin: SocketAddr,
    origin_seq: u32,
    target: NodeId,
    expires: Instant,
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

    fn heard_since(&self, id: NodeId, since: Instant) -> bool {
        self.members.get(&id).and_then(|m| m.heard).is_some_and(|h| h > since)
    }

    /// Runs whatever is due at `now` (probes, suspicion expiry, gossip, syncs).
    pub fn handle_timeout(&mut self, now: Instant) {
        if !self.left && now >= self.next_probe {
            self.probe_tick(now);
            self.next_probe = next_tick(self.next_probe, self.config.probe_interval, now);
        }
        if let Some((target, sent, due)) = self
            .probe
            .as_ref()
            .filter(|p| !p.acked && !p.indirect_sent)
            .map(|p| (p.target, p.sent, p.indirect_at))
        {
            if self.heard_since(target, sent) {
                if let Some(p) = &mut self.probe {
                    p.acked = true;
                }
            } else if now >= due {
                self.send_indirect(now);
            }
        }
        let expired: Vec<NodeId> =
            self.suspicions.iter().filter(|(_, s)| s.deadline() <= now).map(|(id, _)| *id).collect();
        for id in expired {
            let start = self.suspicions.get(&id).map(|s| s.start).unwrap_or(now);
            if self.heard_since(id, start) {
                // Alive on its link: keep suspecting (it refutes when our gossip reaches it)
                // but do not declare it dead.
                if let Some(s) = self.suspicions.get_mut(&id) {
                    s.start = now;
                }
                continue;
            }
            self.suspicions.remove(&id);
            if let Some(inc) = self.members.get(&id).map(|m| m.incarnation) {
                let accuser = self.id;
                self.apply_dead(id, inc, accuser, false, now);
            }
        }
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

    // ---- internals ----

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

    fn retransmit_limit(&mut self) -> u32 {
        let n = self.cluster_size() as f64;
        RETRANSMIT_MULT * ((n + 1.0).log10().ceil().max(1.0) as u32)
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

    /// Sends `msg` as a datagram, filling the rest of its update list with queued
    /// broadcasts.
    fn send_datagram(&mut self, to: SocketAddr, mut msg: Message) {
        let header = wire::encode(&msg).len();
        // +2: the update count may grow from one to three varint bytes.
        let budget = self.config.max_datagram.saturating_sub(header + DATAGRAM_SLACK + 2);
        if !self.broadcasts.is_empty() && budget > 0 {
            let limit = self.retransmit_limit();
            let updates = self.broadcasts.take(budget, limit);
            if let Some(slot) = msg.updates_mut() {
                slot.extend(updates);
            }
        }
        self.push_transmit(to, msg, Delivery::Datagram);
    }

    fn send_sync(&mut self, to: SocketAddr, _now: Instant) {
        let members = self.snapshot();
        let msg = Message::SyncRequest { from: self.id, members };
        self.push_transmit(to, msg, Delivery::Reliable);
    }

    /// Our table for a sync: self first, then live members, then Dead/Left, cut before
    /// [`MAX_SYNC_BYTES`].
    fn snapshot(&self) -> Vec<MemberState> {
        let mut out = Vec::with_capacity(self.members.len());
        let mut size = 0usize;
        let state = |id: NodeId, m: &Member| MemberState {
            id,
            addr: m.addr,
            meta: m.meta.clone(),
            incarnation: m.incarnation,
            status: m.status,
        };
        out.push(state(self.id, self.own()));
        let others = self.members.iter().filter(|(id, _)| **id != self.id);
        let live = others.clone().filter(|(_, m)| m.status.is_live());
        let gone = others.filter(|(_, m)| !m.status.is_live());
        for (id, m) in live.chain(gone) {
            // id + addr + incarnation + status upper bounds.
            size += m.meta_size + 48;
            if size > MAX_SYNC_BYTES {
                break;
            }
            out.push(state(*id, m));
        }
        out
    }

    fn announce_self(&mut self, _now: Instant) {
        let me = self.own();
        let update = Update {
            id: self.id,
            incarnation: me.incarnation,
            kind: UpdateKind::Alive { addr: me.addr, meta: me.meta.clone() },
        };
        self.broadcasts.push(update);
    }

    /// Someone says we are suspect/dead/left (or alive at a newer incarnation): take an
    /// incarnation above theirs and say we are alive.
    fn refute(&mut self, claimed: u64, now: Instant) {
        let id = self.id;
        if let Some(me) = self.members.get_mut(&id) {
            me.incarnation = me.incarnation.max(claimed).saturating_add(1);
        }
        self.announce_self(now);
    }

    /// Applies piggybacked updates. Updates older than what we know mean the sender missed
    /// something (typically a refutation whose rumor died out before reaching it): it gets
    /// our newer state back directly, so a stale suspicion cannot outlive its refutation.
    fn apply_updates(&mut self, from: SocketAddr, updates: Vec<Update>, now: Instant) {
        let mut seen: Vec<(NodeId, u64)> = Vec::with_capacity(updates.len().min(MAX_CORRECTIONS));
        for u in updates {
            if seen.len() < MAX_CORRECTIONS && !seen.contains(&(u.id, u.incarnation)) {
                seen.push((u.id, u.incarnation));
            }
            match u.kind {
                UpdateKind::Alive { addr, meta } => {
                    self.apply_alive(u.id, u.incarnation, addr, meta, now, true)
                }
                UpdateKind::Suspect { accuser } => self.apply_suspect(u.id, u.incarnation, accuser, now),
                UpdateKind::Dead { accuser } => self.apply_dead(u.id, u.incarnation, accuser, false, now),
                UpdateKind::Left => self.apply_dead(u.id, u.incarnation, u.id, true, now),
            }
        }
        // After applying: what is still newer here is news to the sender (this includes
        // our own refutation when the sender suspected us).
        let corrections: Vec<Update> =
            seen.into_iter().filter_map(|(id, inc)| self.correction(id, inc)).collect();
        if !corrections.is_empty() {
            self.send_updates(from, corrections);
        }
    }

    /// Our newer state of the member `u` is about, if `u` is stale and we know better
    /// (Alive, Dead or Left at a higher incarnation; a Suspect state is not ours to repeat).
    fn correction(&self, id: NodeId, incarnation: u64) -> Option<Update> {
        let m = self.members.get(&id)?;
        if m.incarnation <= incarnation {
            return None;
        }
        let kind = match m.status {
            MemberStatus::Alive => UpdateKind::Alive { addr: m.addr, meta: m.meta.clone() },
            MemberStatus::Dead => UpdateKind::Dead { accuser: self.id },
            MemberStatus::Left => UpdateKind::Left,
            MemberStatus::Suspect => return None,
        };
        Some(Update { id, incarnation: m.incarnation, kind })
    }

    /// Sends `updates` (as many as fit) in one gossip datagram.
    fn send_updates(&mut self, to: SocketAddr, updates: Vec<Update>) {
        let mut msg = Message::Gossip { from: self.id, updates: Vec::new() };
        let header = wire::encode(&msg).len();
        let mut room = self.config.max_datagram.saturating_sub(header + DATAGRAM_SLACK + 2);
        let mut packed = Vec::new();
        for u in updates {
            let size = wire::encode(&u).len();
            if size <= room {
                room -= size;
                packed.push(u);
            }
        }
        if packed.is_empty() {
            return;
        }
        if let Some(slot) = msg.updates_mut() {
            *slot = packed;
        }
        self.push_transmit(to, msg, Delivery::Datagram);
    }

    /// Push-pull merge. Remote Dead verdicts become suspicions (the member may refute),
    /// third-party Alive states are applied without re-gossip (the sender's own state is
    /// gossiped: that is how a join is announced).
    fn merge(&mut self, sender: NodeId, members: Vec<MemberState>, now: Instant) {
        for st in members {
            match st.status {
                MemberStatus::Alive => {
                    let gossip = st.id == sender;
                    self.apply_alive(st.id, st.incarnation, st.addr, st.meta, now, gossip);
                }
                MemberStatus::Suspect => {
                    if !self.members.contains_key(&st.id) {
                        self.apply_alive(st.id, st.incarnation, st.addr, st.meta, now, false);
                    }
                    self.apply_suspect(st.id, st.incarnation, sender, now);
                }
                MemberStatus::Dead => self.apply_suspect(st.id, st.incarnation, sender, now),
                MemberStatus::Left => self.apply_dead(st.id, st.incarnation, st.id, true, now),
            }
        }
    }

    /// Makes room for one more member: true if there is (after evicting the Dead/Left
    /// member gone the longest, if the table is full).
    fn make_room(&mut self) -> bool {
        if self.members.len() < MAX_MEMBERS {
            return true;
        }
        // O(1) refusal when nothing is evictable, so a flood of new ids against a full
        // table of live members costs nothing per id.
        if self.live_peers().len() + 1 >= self.members.len() {
            return false;
        }
        let own = self.id;
        let victim = self
            .members
            .iter()
            .filter(|(id, m)| **id != own && !m.status.is_live())
            .min_by_key(|(_, m)| m.since)
            .map(|(id, _)| *id);
        match victim {
            Some(id) => {
                self.members.remove(&id);
                self.suspicions.remove(&id);
                true
            }
            None => false,
        }
    }

    fn apply_alive(
        &mut self,
        id: NodeId,
        inc: u64,
        addr: SocketAddr,
        meta: NodeMeta,
        now: Instant,
        rebroadcast: bool,
    ) {
        if id == self.id {
            if !self.left && inc > self.own().incarnation {
                self.refute(inc, now);
            }
            return;
        }
        let prev = match self.members.get(&id) {
            Some(m) if inc <= m.incarnation => return,
            Some(m) => Some((m.status, m.addr != addr || m.meta != meta)),
            None => None,
        };
        let meta_size = wire::encode(&meta).len();
        if meta_size > MAX_META {
            return;
        }
        if prev.is_none() && !self.make_room() {
            return;
        }
        if rebroadcast {
            self.broadcasts.push(Update {
                id,
                incarnation: inc,
                kind: UpdateKind::Alive { addr, meta: meta.clone() },
            });
        }
        match prev {
            None => {
                self.members.insert(
                    id,
                    Member {
                        addr,
                        meta,
                        meta_size,
                        incarnation: inc,
                        status: MemberStatus::Alive,
                        since: now,
                        srtt: None,
                        heard: None,
                    },
                );
                self.live_dirty = true;
                self.add_to_probe_order(id);
                self.emit_view(id, true);
            }
            Some((status, changed)) => {
                if let Some(m) = self.members.get_mut(&id) {
                    m.addr = addr;
                    m.meta = meta;
                    m.meta_size = meta_size;
                    m.incarnation = inc;
                    if m.status != MemberStatus::Alive {
                        m.status = MemberStatus::Alive;
                        m.since = now;
                    }
                }
                match status {
                    MemberStatus::Dead | MemberStatus::Left => {
                        self.live_dirty = true;
                        self.add_to_probe_order(id);
                        self.emit_view(id, true);
                    }
                    MemberStatus::Suspect => {
                        self.suspicions.remove(&id);
                        self.emit_view(id, false);
                    }
                    MemberStatus::Alive if changed => self.emit_view(id, false),
                    MemberStatus::Alive => {}
                }
            }
        }
    }

    fn emit_view(&mut self, id: NodeId, up: bool) {
        if let Some(v) = self.members.get(&id).map(|m| view(id, m)) {
            self.emit(if up { MemberEvent::Up(v) } else { MemberEvent::Updated(v) });
        }
    }

    fn apply_suspect(&mut self, id: NodeId, inc: u64, accuser: NodeId, now: Instant) {
        if id == self.id {
            if !self.left && inc >= self.own().incarnation {
                self.refute(inc, now);
            }
            return;
        }
        let Some(status) = self.members.get(&id).filter(|m| inc >= m.incarnation).map(|m| m.status) else {
            return;
        };
        match status {
            MemberStatus::Dead | MemberStatus::Left => {}
            MemberStatus::Suspect => {
                if let Some(m) = self.members.get_mut(&id) {
                    m.incarnation = inc;
                }
                let fresh = match self.suspicions.get_mut(&id) {
                    Some(s) => s.confirm(accuser),
                    None => {
                        let s = self.new_suspicion(accuser, now);
                        self.suspicions.insert(id, s);
                        true
                    }
                };
                if fresh {
                    self.broadcasts.push(Update {
                        id,
                        incarnation: inc,
                        kind: UpdateKind::Suspect { accuser },
                    });
                }
            }
            MemberStatus::Alive => {
                if let Some(m) = self.members.get_mut(&id) {
                    m.incarnation = inc;
                    m.status = MemberStatus::Suspect;
                    m.since = now;
                }
                let s = self.new_suspicion(accuser, now);
                self.suspicions.insert(id, s);
                self.emit(MemberEvent::Suspect(id));
                self.broadcasts.push(Update { id, incarnation: inc, kind: UpdateKind::Suspect { accuser } });
            }
        }
    }

    fn new_suspicion(&mut self, accuser: NodeId, now: Instant) -> Suspicion {
        let n = self.cluster_size();
        let scale = (n as f64).log10().max(1.0);
        let max = self.config.probe_interval.mul_f64(self.config.suspicion_mult as f64 * scale);
        Suspicion {
            start: now,
            min: max / 2,
            max,
            k: MAX_CONFIRMATIONS.min(n.saturating_sub(2)),
            accusers: BTreeSet::from([accuser]),
        }
    }

    fn apply_dead(&mut self, id: NodeId, inc: u64, accuser: NodeId, left: bool, now: Instant) {
        if id == self.id {
            if !self.left && inc >= self.own().incarnation {
                self.refute(inc, now);
            }
            return;
        }
        let Some(m) = self.members.get_mut(&id) else {
            return;
        };
        if inc < m.incarnation {
            return;
        }
        match m.status {
            MemberStatus::Left => return,
            MemberStatus::Dead if !left => return,
            _ => {}
        }
        m.incarnation = inc;
        m.status = if left { MemberStatus::Left } else { MemberStatus::Dead };
        m.since = now;
        self.live_dirty = true;
        self.suspicions.remove(&id);
        self.emit(if left { MemberEvent::Left(id) } else { MemberEvent::Down(id) });
        let kind = if left { UpdateKind::Left } else { UpdateKind::Dead { accuser } };
        self.broadcasts.push(Update { id, incarnation: inc, kind });
    }

    /// A message came from a member we consider Dead: it does not know. Push-pull with it
    /// (rate-limited) so it refutes and we see it alive again.
    fn check_sender(&mut self, sender: NodeId, from: SocketAddr, now: Instant) {
        if self.left || sender == self.id || now < self.dead_sender_sync_at {
            return;
        }
        if self.status(sender) == Some(MemberStatus::Dead) {
            self.dead_sender_sync_at = now + self.config.probe_interval;
            self.send_sync(from, now);
        }
    }

    fn handle_ack(&mut self, sender: NodeId, seq: u32, now: Instant) {
        if let Some(p) = &mut self.probe {
            if p.seq == seq && p.target == sender {
                p.acked = true;
                let sample = now.saturating_duration_since(p.sent);
                if let Some(m) = self.members.get_mut(&sender) {
                    m.srtt = Some(match m.srtt {
                        None => sample,
                        Some(s) => (s * 7 + sample) / 8,
                    });
                }
                return;
            }
        }
        if self.relays.get(&seq).is_some_and(|r| r.target == sender) {
            if let Some(r) = self.relays.remove(&seq) {
                let msg = Message::IndirectAck {
                    from: self.id,
                    seq: r.origin_seq,
                    target: sender,
                    updates: Vec::new(),
                };
                self.send_datagram(r.origin, msg);
            }
        }
    }

    fn add_to_probe_order(&mut self, id: NodeId) {
        if self.probe_order.len() >= MAX_MEMBERS {
            return;
        }
        let lo = self.probe_index.min(self.probe_order.len());
        let pos = lo + self.rng.below(self.probe_order.len() - lo + 1);
        self.probe_order.insert(pos, id);
    }

    fn next_probe_target(&mut self) -> Option<NodeId> {
        for _ in 0..2 {
            while self.probe_index < self.probe_order.len() {
                let id = self.probe_order[self.probe_index];
                self.probe_index += 1;
                if id != self.id && self.status(id).is_some_and(MemberStatus::is_live) {
                    return Some(id);
                }
            }
            let mut order = self.live_peers().to_vec();
            self.rng.shuffle(&mut order);
            self.probe_order = order;
            self.probe_index = 0;
        }
        None
    }

    fn probe_tick(&mut self, now: Instant) {
        if let Some(p) = self.probe.take() {
            if !p.acked && !self.heard_since(p.target, p.sent) {
                if let Some(inc) =
                    self.members.get(&p.target).filter(|m| m.status.is_live()).map(|m| m.incarnation)
                {
                    let accuser = self.id;
                    self.apply_suspect(p.target, inc, accuser, now);
                }
            }
        }
        let Some(target) = self.next_probe_target() else {
            return;
        };
        let Some((addr, status, incarnation)) =
            self.members.get(&target).map(|m| (m.addr, m.status, m.incarnation))
        else {
            return;
        };
        // A suspect is told so in the probe itself: if alive, it refutes and its answer
        // (see `apply_updates`) clears the suspicion here even when the rumor missed us.
        let mut updates = Vec::new();
        if status == MemberStatus::Suspect {
            updates.push(Update { id: target, incarnation, kind: UpdateKind::Suspect { accuser: self.id } });
        }
        let seq = self.seq();
        self.probe = Some(Probe {
            target,
            seq,
            sent: now,
            indirect_at: now + self.config.probe_timeout,
            indirect_sent: false,
            acked: false,
        });
        let ping = Message::Ping { from: self.id, seq, target, updates };
        self.send_datagram(addr, ping);
    }

    fn send_indirect(&mut self, _now: Instant) {
        let Some((target, seq)) = self.probe.as_mut().map(|p| {
            p.indirect_sent = true;
            (p.target, p.seq)
        }) else {
            return;
        };
        let Some(target_addr) = self.members.get(&target).map(|m| m.addr) else {
            return;
        };
        for relay in self.random_peers(self.config.indirect_probes, Some(target)) {
            let Some(addr) = self.members.get(&relay).map(|m| m.addr) else {
                continue;
            };
            let msg = Message::PingReq { from: self.id, seq, target, target_addr, updates: Vec::new() };
            self.send_datagram(addr, msg);
        }
    }

    fn gossip_round(&mut self, _now: Instant) {
        // Members we suspect ourselves hear it from us directly every round, so that a live
        // one refutes without depending on the rumor reaching it (it answers with its
        // refutation at once, see `apply_updates`).
        let mine: Vec<(NodeId, SocketAddr, u64)> = self
            .suspicions
            .iter()
            .filter(|(_, s)| s.accusers.contains(&self.id))
            .filter_map(|(id, _)| {
                let m = self.members.get(id)?;
                Some((*id, m.addr, m.incarnation))
            })
            .collect();
        for (id, addr, incarnation) in mine {
            let u = Update { id, incarnation, kind: UpdateKind::Suspect { accuser: self.id } };
            self.send_updates(addr, vec![u]);
        }
        if self.broadcasts.is_empty() {
            return;
        }
        for peer in self.random_peers(self.config.gossip_fanout, None) {
            if self.broadcasts.is_empty() {
                break;
            }
            let Some(addr) = self.members.get(&peer).map(|m| m.addr) else {
                continue;
            };
            let msg = Message::Gossip { from: self.id, updates: Vec::new() };
            self.send_datagram(addr, msg);
        }
    }

    /// Push-pull with a seed (first fast resync) or a random live member.
    fn sync_round(&mut self, now: Instant) {
        let target = if self.join_resyncs == 0 && !self.seeds.is_empty() {
            let i = self.rng.below(self.seeds.len());
            Some(self.seeds[i])
        } else {
            self.random_peers(1, None).first().and_then(|id| self.members.get(id)).map(|m| m.addr)
        };
        if let Some(to) = target {
            self.send_sync(to, now);
        }
        let interval = if self.join_resyncs + 1 < JOIN_RESYNCS {
            JOIN_RESYNC * 2u32.pow(self.join_resyncs + 1)
        } else {
            self.scaled_sync_interval()
        };
        self.join_resyncs = self.join_resyncs.saturating_add(1);
        self.next_sync = now + self.jitter(interval);
    }

    /// memberlist's push-pull scaling: one more interval per doubling above 32 members.
    fn scaled_sync_interval(&mut self) -> Duration {
        let n = self.cluster_size() as f64;
        let mult = if n <= 32.0 { 1.0 } else { (n.log2() - 5.0).ceil() + 1.0 };
        self.config.sync_interval.mul_f64(mult)
    }

    /// Push-pull with a seed or a retained Dead member whose address is not that of a live
    /// member: heals partitions and brings back nodes wrongly declared dead. Runs every
    /// `sync_interval`, or every second while we know no live peer.
    fn rejoin_round(&mut self, now: Instant) {
        let alone = self.live_peers().is_empty();
        let live_addrs: BTreeSet<SocketAddr> =
            self.members.values().filter(|m| m.status.is_live()).map(|m| m.addr).collect();
        let own = self.own().addr;
        let mut candidates: Vec<SocketAddr> =
            self.seeds.iter().copied().filter(|a| !live_addrs.contains(a)).collect();
        if !alone || candidates.is_empty() {
            candidates.extend(
                self.members
                    .values()
                    .filter(|m| m.status == MemberStatus::Dead && !live_addrs.contains(&m.addr))
                    .map(|m| m.addr),
            );
        }
        candidates.retain(|a| *a != own);
        candidates.sort();
        candidates.dedup();
        if !candidates.is_empty() {
            let i = self.rng.below(candidates.len());
            self.send_sync(candidates[i], now);
        }
        let interval = if alone {
            self.config.sync_interval.min(Duration::from_secs(1))
        } else {
            self.config.sync_interval
        };
        self.next_rejoin = now + self.jitter(interval);
    }

    fn reap(&mut self, now: Instant) {
        let retention = self.config.dead_retention;
        let id = self.id;
        self.members.retain(|m_id, m| {
            *m_id == id || m.status.is_live() || now.saturating_duration_since(m.since) < retention
        });
        self.relays.retain(|_, r| r.expires > now);
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
