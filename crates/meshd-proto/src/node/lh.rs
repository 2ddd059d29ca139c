//! torchft's Lighthouse served by every node of a `--fault-tolerance node` job: the ranks
//! ask their own meshd ([`Input::LhQuorum`], [`Input::LhHeartbeat`]), and one node, the
//! decider (the first live member in roster order, the same one that admits joiners),
//! runs the quorum core ([`crate::lighthouse::Lighthouse`]) for the whole job.
//!
//! - Every node relays its ranks' requests to the decider ([`Message::LhAsk`], with the
//!   highest quorum id it has seen, and [`Message::LhBeat`]); the decider answers each
//!   request on the node it came from ([`Message::LhAnswer`], then [`Event::LhQuorum`]).
//! - Requests stay pending on their node until answered, and are sent again when the
//!   decider changes (it died, or a joiner took an earlier slot) and every
//!   [`RESEND_EVERY`] (a decider that did not yet know itself one ignored them).
//! - A new decider starts with an empty core that first observes every quorum id the
//!   askers report: its ids are greater than any a survivor has seen, and they carry its
//!   own tag, so no id ever names two participant lists (`crate::lighthouse`'s doc).
//! - Health comes from the mesh as well as from heartbeats: a member declared dead or
//!   gone takes its replicas out at once ([`Message::LhGone`] from a node whose ranks
//!   failed; the decider's own view for a dead node), so the next quorum does not wait for
//!   the heartbeat timeout.
//! - The roll call: while a quorum request waits, the decider pings the nodes whose ranks
//!   have not asked ([`Message::LhPing`], [`ROLL_CALL_PINGS`] datagrams over
//!   [`ROLL_CALL_WITHIN`]). A node whose meshd does not answer in time is taken for gone as
//!   far as this quorum goes: its replicas are no longer healthy (a heartbeat makes them
//!   healthy again), so the quorum forms without waiting for the join timeout or for the
//!   mesh to declare the node dead (a suspicion period, 1-2 s). A node that answers is
//!   alive: its ranks are only slower, and torchft's join timeout applies as usual.

use super::{Event, Input, Node, Phase};
use crate::id::NodeId;
use crate::lighthouse::{DeciderTag, Lighthouse, LighthouseConfig, Member, Output, Quorum, RequestId};
use crate::rendezvous::Message;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// How often pending requests are sent to the decider again.
pub const RESEND_EVERY: Duration = Duration::from_secs(1);

/// Requests a node keeps pending for its ranks at most (a rank asks one at a time).
pub const MAX_PENDING: usize = 1024;

/// Replicas a node reports for its own ranks at most.
const MAX_LOCAL_REPLICAS: usize = 1024;

/// A new decider holds its first calls until every live member's node was heard (a request
/// or a heartbeat) or this long passed: deciding on the first asker alone would issue a
/// quorum of the fastest groups and leave the others for the next one. After a decider's
/// death the survivors notice it up to a suspicion period apart (1-2 s): longer than that.
pub const TAKEOVER_GRACE: Duration = Duration::from_secs(3);

/// Calls a new decider holds at most during [`TAKEOVER_GRACE`].
const MAX_HELD_CALLS: usize = 4096;

/// (node, replica) pairs whose newest request the decider remembers at most before it
/// forgets those of replicas it no longer knows.
const MAX_NEWEST: usize = 16384;

/// How long a node has to answer the decider's roll call. A node's meshd answers as soon
/// as it runs (it waits on nothing): this is scheduling slack on a loaded host, many round
/// trips of any network meshd runs on.
pub const ROLL_CALL_WITHIN: Duration = Duration::from_millis(300);

/// Pings of one roll call, [`ROLL_CALL_GAP`] apart: one lost datagram does not leave a live
/// group out.
pub const ROLL_CALL_PINGS: u32 = 3;
const ROLL_CALL_GAP: Duration = Duration::from_millis(60);

/// A node is called at most once this often (a new step's first request within it does
/// not call it again).
const ROLL_CALL_EVERY: Duration = Duration::from_millis(500);

/// One node's roll call in progress.
#[derive(Debug)]
struct RollCall {
    nonce: u64,
    sent: u32,
    next_ping: Instant,
    deadline: Instant,
}

/// A node's side of the lighthouse.
#[derive(Debug, Default)]
pub(super) struct Relay {
    /// The ranks' requests not answered yet.
    pending: BTreeMap<u64, Member>,
    /// Replica ids the local ranks used (reported gone when they fail).
    local: BTreeSet<String>,
    /// The decider the pending requests were last sent to.
    sent_to: Option<NodeId>,
    next_resend: Option<Instant>,
    /// The highest quorum id seen here.
    seen: i64,
    /// The last quorum this node's ranks were given.
    pub last: Option<Quorum>,
    /// The quorum core, while this node is the decider.
    decider: Option<Decider>,
    /// The core's settings (min replicas, timeouts), from the node's config.
    pub cfg: LighthouseConfig,
}

#[derive(Debug)]
struct Decider {
    core: Lighthouse,
    /// Core request -> (node that asked, its request id).
    origin: BTreeMap<RequestId, (NodeId, u64)>,
    by_origin: BTreeMap<(NodeId, u64), RequestId>,
    /// Which node each replica asked from.
    replica_node: BTreeMap<String, NodeId>,
    /// The newest request each node made for each replica (a node numbers its requests in
    /// order): a request re-sent after it was answered, which crossed its answer, is stale.
    newest: BTreeMap<(NodeId, String), u64>,
    next: u64,
    /// Until every live member was heard (or the grace is over): the calls held, the
    /// nodes heard, the end of the grace.
    held: Vec<(NodeId, Message)>,
    heard: BTreeSet<NodeId>,
    ready_at: Option<Instant>,
    /// Roll calls in progress, and when each node was last called.
    calls: BTreeMap<NodeId, RollCall>,
    called: BTreeMap<NodeId, Instant>,
}

impl Relay {
    pub fn new(cfg: LighthouseConfig) -> Relay {
        Relay { cfg, ..Default::default() }
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        let resend = self.next_resend.filter(|_| !self.pending.is_empty());
        let core = self.decider.as_ref().and_then(|d| d.core.poll_timeout());
        let grace = self.decider.as_ref().and_then(|d| d.ready_at);
        let calls = self.decider.as_ref().and_then(|d| {
            d.calls.values().map(|c| if c.sent < ROLL_CALL_PINGS { c.next_ping } else { c.deadline }).min()
        });
        [resend, core, grace, calls].into_iter().flatten().min()
    }
}

impl Node {
    /// The decider now: while the job runs here, the first live member in roster order.
    fn lh_decider(&self) -> Option<NodeId> {
        match &self.phase {
            Phase::Running(r) => Self::ft_decider(r),
            _ => None,
        }
    }

    /// The ranks' lighthouse calls (IO inputs).
    pub(super) fn lh_input(&mut self, input: Input, now: Instant) {
        match input {
            Input::LhQuorum { req, member } => {
                if self.lh.pending.len() >= MAX_PENDING {
                    self.log(super::Level::Warn, "lighthouse: too many pending quorum requests; one refused");
                    return;
                }
                if self.lh.local.len() < MAX_LOCAL_REPLICAS {
                    self.lh.local.insert(member.replica_id.clone());
                }
                self.lh.pending.insert(req, member.clone());
                let seen = self.lh.seen;
                self.lh_to_decider(Message::LhAsk { req, member, seen }, now);
            }
            Input::LhHeartbeat { replica_id } => {
                if self.lh.local.len() < MAX_LOCAL_REPLICAS {
                    self.lh.local.insert(replica_id.clone());
                }
                self.lh_to_decider(Message::LhBeat { replica_id }, now);
            }
            Input::LhCancel { req } if self.lh.pending.remove(&req).is_some() => {
                self.lh_to_decider(Message::LhCancel { req }, now);
            }
            _ => {}
        }
    }

    /// Sends `msg` to the decider, or hands it to this node's core when it is the decider.
    fn lh_to_decider(&mut self, msg: Message, now: Instant) {
        let Some(d) = self.lh_decider() else { return };
        if d == self.cfg.id {
            let me = self.cfg.id;
            return self.lh_decide(me, msg, now);
        }
        if let Some(addr) = self.lh_addr(d) {
            self.send(addr, msg);
        }
    }

    fn lh_addr(&self, id: NodeId) -> Option<std::net::SocketAddr> {
        let Phase::Running(r) = &self.phase else { return None };
        r.roster.members.iter().find(|m| m.id == id).map(|m| m.addr)
    }

    /// Lighthouse traffic from another node.
    pub(super) fn lh_message(&mut self, from: NodeId, msg: Message, now: Instant) {
        let member = matches!(&self.phase, Phase::Running(r) if r.everyone.contains(&from));
        if !member {
            return;
        }
        match msg {
            Message::LhAnswer { req, quorum }
                if self.lh_decider() == Some(from) || self.lh.pending.contains_key(&req) =>
            {
                self.lh_answered(req, quorum);
            }
            m @ (Message::LhAsk { .. }
            | Message::LhBeat { .. }
            | Message::LhCancel { .. }
            | Message::LhGone { .. })
                if self.lh_decider() == Some(self.cfg.id) =>
            {
                self.lh_decide(from, m, now);
            }
            // Answered whoever asks (a member): the roll call needs this node's meshd, nothing more.
            Message::LhPing { nonce } => {
                if let Some(addr) = self.lh_addr(from) {
                    self.send_datagram(addr, Message::LhPong { nonce });
                }
            }
            Message::LhPong { nonce } => {
                if let Some(d) = self.lh.decider.as_mut() {
                    if d.calls.get(&from).is_some_and(|c| c.nonce == nonce) {
                        d.calls.remove(&from);
                    }
                }
            }
            _ => {}
        }
    }

    /// While requests wait in the decider's core: calls the nodes that hold replicas the
    /// decider knows of and asked nothing that waits (once per [`ROLL_CALL_EVERY`]).
    fn lh_roll_call(&mut self, now: Instant) {
        let me = self.cfg.id;
        let Some(d) = self.lh.decider.as_mut() else { return };
        if d.origin.is_empty() || d.ready_at.is_some() {
            return;
        }
        let asking: BTreeSet<NodeId> = d.by_origin.keys().map(|(n, _)| *n).collect();
        let silent: BTreeSet<NodeId> =
            d.replica_node.values().copied().filter(|n| *n != me && !asking.contains(n)).collect();
        let mut pings = Vec::new();
        for n in silent {
            if d.calls.contains_key(&n) || d.called.get(&n).is_some_and(|t| now < *t + ROLL_CALL_EVERY) {
                continue;
            }
            d.next += 1;
            let nonce = d.next;
            d.called.insert(n, now);
            d.calls.insert(
                n,
                RollCall { nonce, sent: 1, next_ping: now + ROLL_CALL_GAP, deadline: now + ROLL_CALL_WITHIN },
            );
            pings.push((n, nonce));
        }
        for (n, nonce) in pings {
            if let Some(addr) = self.lh_addr(n) {
                self.send_datagram(addr, Message::LhPing { nonce });
            }
        }
    }

    /// Roll calls due: the next ping, or the verdict on a node that did not answer.
    fn lh_roll_call_due(&mut self, now: Instant) {
        let Some(d) = self.lh.decider.as_mut() else { return };
        let mut pings = Vec::new();
        let mut absent = Vec::new();
        for (n, c) in d.calls.iter_mut() {
            if now >= c.deadline {
                absent.push(*n);
            } else if c.sent < ROLL_CALL_PINGS && now >= c.next_ping {
                c.sent += 1;
                c.next_ping = now + ROLL_CALL_GAP;
                pings.push((*n, c.nonce));
            }
        }
        let mut gone = Vec::new();
        for n in &absent {
            d.calls.remove(n);
            let replicas: Vec<String> =
                d.replica_node.iter().filter(|(_, node)| *node == n).map(|(r, _)| r.clone()).collect();
            for r in &replicas {
                d.core.replica_gone(now, r);
            }
            gone.push((*n, replicas.len()));
        }
        for (n, nonce) in pings {
            if let Some(addr) = self.lh_addr(n) {
                self.send_datagram(addr, Message::LhPing { nonce });
            }
        }
        for (n, k) in gone {
            let who = match &self.phase {
                Phase::Running(r) => Self::describe(&r.roster, n),
                _ => format!("node {n}"),
            };
            self.log(
                super::Level::Info,
                format!(
                    "lighthouse: {who} did not answer the roll call within {} ms: its {} leave the quorum being \
                     formed (a heartbeat brings them back)",
                    ROLL_CALL_WITHIN.as_millis(),
                    if k == 1 { "replica".to_string() } else { format!("{k} replicas") }
                ),
            );
        }
        if !absent.is_empty() {
            self.lh_drain();
        }
    }

    fn lh_answered(&mut self, req: u64, quorum: Quorum) {
        self.lh.seen = self.lh.seen.max(quorum.quorum_id);
        if self.lh.pending.remove(&req).is_some() {
            if self.lh.last.as_ref().is_none_or(|l| l.quorum_id <= quorum.quorum_id) {
                self.lh.last = Some(quorum.clone());
            }
            self.events.push_back(Event::LhQuorum { req, quorum });
        }
    }

    /// The decider's handling of one relayed call from node `from`.
    fn lh_decide(&mut self, from: NodeId, msg: Message, now: Instant) {
        let tag =
            DeciderTag::from_low_bits(u64::from_le_bytes(self.cfg.id.0[..8].try_into().unwrap_or_default()));
        let cfg = LighthouseConfig { tag, ..self.lh.cfg.clone() };
        let me = self.cfg.id;
        let d = self.lh.decider.get_or_insert_with(|| Decider {
            core: Lighthouse::new(cfg),
            origin: BTreeMap::new(),
            by_origin: BTreeMap::new(),
            replica_node: BTreeMap::new(),
            newest: BTreeMap::new(),
            next: 0,
            held: Vec::new(),
            heard: [me].into_iter().collect(),
            ready_at: Some(now + TAKEOVER_GRACE),
            calls: BTreeMap::new(),
            called: BTreeMap::new(),
        });
        if d.ready_at.is_some() {
            d.heard.insert(from);
            if d.held.len() < MAX_HELD_CALLS {
                d.held.push((from, msg));
            }
            return self.lh_release(now);
        }
        self.lh_apply(from, msg, now);
        self.lh_drain();
    }

    /// Ends a new decider's grace once every live member was heard or the grace is over,
    /// and hands the held calls to its core.
    fn lh_release(&mut self, now: Instant) {
        let live: Vec<NodeId> = match &self.phase {
            Phase::Running(r) => r.everyone.iter().copied().collect(),
            _ => Vec::new(),
        };
        let Some(d) = self.lh.decider.as_mut() else { return };
        let Some(at) = d.ready_at else { return };
        if now < at && !live.iter().all(|id| d.heard.contains(id)) {
            return;
        }
        d.ready_at = None;
        let held = std::mem::take(&mut d.held);
        // Every replica heard during the grace is healthy before the first request is looked
        // at, so that the core waits for the ones that have not asked yet (its join timeout).
        for (_, msg) in &held {
            match msg {
                Message::LhBeat { replica_id } => d.core.handle_heartbeat(now, replica_id),
                Message::LhAsk { member, .. } => d.core.handle_heartbeat(now, &member.replica_id),
                _ => {}
            }
        }
        for (from, msg) in held {
            self.lh_apply(from, msg, now);
        }
        self.lh_drain();
    }

    /// One call into the decider's core.
    fn lh_apply(&mut self, from: NodeId, msg: Message, now: Instant) {
        let Some(d) = self.lh.decider.as_mut() else { return };
        match msg {
            Message::LhAsk { req, member, seen } => {
                d.core.observe_quorum_id(seen);
                // Held already, or answered (a resend that crossed its answer): the core would
                // take it for the replica's next request and answer that one instead.
                let key = (from, member.replica_id.clone());
                if d.by_origin.contains_key(&(from, req)) || d.newest.get(&key).is_some_and(|n| req <= *n) {
                    return;
                }
                if d.newest.len() >= MAX_NEWEST {
                    let known = &d.replica_node;
                    d.newest.retain(|(_, r), _| known.contains_key(r));
                }
                d.newest.insert(key, req);
                d.next += 1;
                let id = RequestId(d.next);
                d.origin.insert(id, (from, req));
                d.by_origin.insert((from, req), id);
                d.replica_node.insert(member.replica_id.clone(), from);
                if d.core.handle_quorum_request(now, id, member).is_err() {
                    d.origin.remove(&id);
                    d.by_origin.remove(&(from, req));
                }
            }
            Message::LhBeat { replica_id } => {
                d.replica_node.insert(replica_id.clone(), from);
                d.core.handle_heartbeat(now, &replica_id);
            }
            Message::LhCancel { req } => {
                if let Some(id) = d.by_origin.remove(&(from, req)) {
                    d.origin.remove(&id);
                    d.core.cancel_request(id);
                }
            }
            Message::LhGone { replica_ids } => {
                for r in replica_ids.iter().take(MAX_LOCAL_REPLICAS) {
                    d.core.replica_gone(now, r);
                }
            }
            _ => {}
        }
    }

    /// The decider's outputs: answers to their nodes, log lines.
    fn lh_drain(&mut self) {
        let Some(d) = self.lh.decider.as_mut() else { return };
        let mut answers: Vec<(NodeId, u64, Quorum)> = Vec::new();
        let mut logs = Vec::new();
        while let Some(out) = d.core.poll_output() {
            match out {
                Output::Log(line) => logs.push(line),
                Output::Quorum { quorum, answers: ids } => {
                    for id in ids {
                        if let Some((node, req)) = d.origin.remove(&id) {
                            d.by_origin.remove(&(node, req));
                            answers.push((node, req, quorum.clone()));
                        }
                    }
                }
            }
        }
        for line in logs {
            self.log(super::Level::Debug, format!("lighthouse: {line}"));
        }
        for (node, req, q) in &answers {
            let ids: Vec<&str> = q.participants.iter().map(|m| m.replica_id.as_str()).collect();
            self.log(
                super::Level::Debug,
                format!("lighthouse: quorum {} {ids:?} answers {node}'s request {req}", q.quorum_id),
            );
        }
        for (node, req, quorum) in answers {
            if node == self.cfg.id {
                self.lh_answered(req, quorum);
            } else if let Some(addr) = self.lh_addr(node) {
                self.lh.seen = self.lh.seen.max(quorum.quorum_id);
                self.send(addr, Message::LhAnswer { req, quorum });
            }
        }
    }

    /// A member died or left: the decider takes its replicas out at once.
    pub(super) fn lh_member_gone(&mut self, id: NodeId, now: Instant) {
        let Some(d) = self.lh.decider.as_mut() else { return };
        let gone: Vec<String> =
            d.replica_node.iter().filter(|(_, n)| **n == id).map(|(r, _)| r.clone()).collect();
        for r in &gone {
            d.replica_node.remove(r);
            d.core.replica_gone(now, r);
        }
        d.newest.retain(|(n, _), _| *n != id);
        let reqs: Vec<(u64, RequestId)> =
            d.by_origin.iter().filter(|((n, _), _)| *n == id).map(|((_, q), r)| (*q, *r)).collect();
        for (q, r) in reqs {
            d.by_origin.remove(&(id, q));
            d.origin.remove(&r);
            d.core.cancel_request(r);
        }
        self.lh_drain();
    }

    /// This node's ranks failed: their replicas are gone (they come back with new ids).
    pub(super) fn lh_local_gone(&mut self, now: Instant) {
        let replica_ids: Vec<String> = std::mem::take(&mut self.lh.local).into_iter().collect();
        if !replica_ids.is_empty() {
            self.lh_to_decider(Message::LhGone { replica_ids }, now);
        }
    }

    /// After any input: a new decider gets the pending requests again; periodic resends;
    /// a node that is no longer the decider drops its core.
    pub(super) fn lh_step(&mut self, now: Instant) {
        let decider = self.lh_decider();
        if decider != Some(self.cfg.id) && self.lh.decider.is_some() {
            self.lh.decider = None;
        }
        let due = self.lh.next_resend.is_some_and(|t| now >= t);
        if decider.is_some() && (decider != self.lh.sent_to || due) && !self.lh.pending.is_empty() {
            self.lh.sent_to = decider;
            self.lh.next_resend = Some(now + RESEND_EVERY);
            let seen = self.lh.seen;
            let asks: Vec<(u64, Member)> = self.lh.pending.iter().map(|(r, m)| (*r, m.clone())).collect();
            for (req, member) in asks {
                self.lh_to_decider(Message::LhAsk { req, member, seen }, now);
            }
        } else if self.lh.pending.is_empty() {
            self.lh.sent_to = decider;
            self.lh.next_resend = Some(now + RESEND_EVERY);
        }
        if self.lh.decider.as_ref().is_some_and(|d| d.ready_at.is_some()) {
            self.lh_release(now);
        }
        if let Some(d) = self.lh.decider.as_mut().filter(|d| d.ready_at.is_none()) {
            if d.core.poll_timeout().is_some_and(|t| t <= now) {
                d.core.tick(now);
                self.lh_drain();
            }
        }
        self.lh_roll_call_due(now);
        self.lh_roll_call(now);
    }
}
