//! The whole job lifecycle of one node as a sans-IO state machine.
//!
//! A [`Node`] composes the membership core, one [`Rendezvous`](crate::rendezvous::Rendezvous)
//! per restart round, the preflight's exchanges and the job lifecycle (Done, Abort, the
//! grace for a member that left, restart rounds). It has no clock, no socket and no thread:
//! the driver hands it [`Input`]s with the time (`handle`, `handle_timeout`) and drains
//! what it must send ([`Node::poll_transmit`]) and what it must do or know
//! ([`Node::poll_event`]). Requests to the IO ([`Event::StartPreflight`], [`Event::Dial`],
//! [`Event::Launch`], [`Event::StopRanks`], [`Event::ForwardSignal`]) come back as inputs
//! with their results. The same core runs inside meshd's actor and, a thousand at a time,
//! inside the simulator ([`crate::sim::node`]).
//!
//! Parts, one idea each:
//! - [`config`]: what a node is started with.
//! - `io`: the [`Input`]s the driver hands the core and what the core asks back
//!   ([`Event`], [`Transmit`]).
//! - `view`: what this node knows about the other members of its run.
//! - `round`: waiting for a roster (restart-round adoption, early frames, the running-job
//!   block, progress and timeout reports).
//! - `preflight`: ports, dials and reports, then the common verdict.
//! - `lifecycle`: launched ranks, Done, Abort (repeated until acknowledged), left grace,
//!   signals, restarts and the end.
//! - [`report`]: the words of the progress lines and the timeout message.

pub mod config;
mod ft;
mod io;
mod lh;
mod lifecycle;
mod preflight;
pub mod report;
mod round;
mod view;

#[cfg(test)]
mod tests;

pub use config::{FaultTolerance, LocalFacts, NodeConfig, Timing};
pub use io::{AbortGroup, DialTarget, Event, Input, Level, Outcome, OutcomeKind, Transmit};
pub use report::WaitReport;

use crate::id::NodeId;
use crate::membership::{Delivery, MemberEvent, MemberView, Membership};
use crate::meta::{NodeMeta, NodeState};
use crate::rendezvous::{Message, RankFailure, Roster};
use crate::wire::Frame;
use lifecycle::{AbortOut, Closing, Running};
use preflight::Preflight;
use round::Round;
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use view::View;

mod store;
pub use store::{MAX_GETS, StoreAnswer, StoreCall, StoreFailure};

/// Linux's SIGUSR1: the only signals a peer may ask this node to forward to its ranks.
pub const SIGUSR1: i32 = 10;
/// Linux's SIGUSR2 (see [`SIGUSR1`]).
pub const SIGUSR2: i32 = 12;

/// Frames of a later round kept for when this node gets there (bounded).
const MAX_EARLY: usize = 64;
/// Preflight and abort frames that came before this node's commit (bounded).
const MAX_HELD: usize = 4096;

/// Why a round ended.
#[derive(Clone, Debug, PartialEq)]
enum Failure {
    /// Restartable, with the failed rank's details when a rank failed.
    Job(String, Option<Box<RankFailure>>),
    /// A signal: stop, never restart.
    Signal(String, u8),
}

enum Phase {
    Rdzv(Box<Round>),
    Preflight(Box<Preflight>),
    Running(Box<Running>),
    /// Waiting for [`Input::RanksStopped`] before deciding what follows.
    Stopping(Failure),
    Closing(Box<Closing>),
    Finished,
}

/// One node's job protocol (see the module docs).
pub struct Node {
    cfg: NodeConfig,
    membership: Membership,
    meta: NodeMeta,
    view: View,
    restart: u32,
    phase: Phase,
    /// When this node started waiting for its first roster.
    started: Instant,
    early: Vec<(NodeId, Message)>,
    held: Vec<(NodeId, Message)>,
    aborts: Vec<AbortOut>,
    /// Nodes named for another `--nnodes` (kept for the timeout after they left).
    nnodes_named: BTreeMap<NodeId, String>,
    /// The latest round in which at least MIN members of this run were seen running, and
    /// their addresses (the running-job block, see `round`).
    ran: Option<(u32, std::collections::BTreeSet<std::net::IpAddr>)>,
    master: Option<NodeId>,
    member_fired: Option<Instant>,
    outbox: VecDeque<Transmit>,
    events: VecDeque<Event>,
    /// The launched round's store, and frames for it that came during the preflight.
    store: Option<store::RoundStore>,
    store_backlog: crate::store::Backlog,
    /// The program said it is done ([`Input::Finish`]).
    local_finish: bool,
    /// torchft's Lighthouse (`--fault-tolerance node`).
    lh: lh::Relay,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("id", &self.cfg.id).field("restart", &self.restart).finish()
    }
}

impl Node {
    /// A node that starts joining through `cfg.seeds` and waiting for its first roster.
    pub fn new(cfg: NodeConfig, now: Instant) -> Node {
        let mut meta = cfg.meta.clone();
        meta.gossip_addr = Some(cfg.addr);
        meta.state = NodeState::Waiting;
        meta.restarts = 0;
        meta.nnodes_min = cfg.rdzv.min_nodes;
        meta.nnodes_max = cfg.rdzv.max_nodes;
        let mut membership =
            Membership::new(cfg.id, cfg.addr, meta.clone(), cfg.membership.clone(), cfg.seed, now);
        let seeds: Vec<SocketAddr> = cfg.seeds.iter().copied().filter(|s| *s != cfg.addr).collect();
        membership.add_seeds(&seeds, now);
        let view = View::new(cfg.id, cfg.addr, &meta);
        let mut node = Node {
            phase: Phase::Finished,
            view,
            membership,
            meta,
            restart: 0,
            started: now,
            early: Vec::new(),
            held: Vec::new(),
            aborts: Vec::new(),
            nnodes_named: BTreeMap::new(),
            ran: None,
            master: None,
            member_fired: None,
            outbox: VecDeque::new(),
            events: VecDeque::new(),
            store: None,
            store_backlog: Default::default(),
            local_finish: false,
            lh: lh::Relay::new(cfg.lighthouse.clone()),
            cfg,
        };
        let timeout = node.cfg.rdzv_timeout;
        node.begin_round(0, timeout, now);
        node.after(now);
        node
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.cfg.id
    }

    /// This node's address.
    pub fn addr(&self) -> SocketAddr {
        self.cfg.addr
    }

    /// The restart round this node is in.
    pub fn restart(&self) -> u32 {
        self.restart
    }

    /// The master of the current roster (`None` while waiting for one).
    pub fn master(&self) -> Option<NodeId> {
        self.master
    }

    /// The roster of the current round, once agreed.
    pub fn roster(&self) -> Option<&Roster> {
        match &self.phase {
            Phase::Preflight(p) => Some(&p.roster),
            Phase::Running(r) => Some(&r.roster),
            _ => None,
        }
    }

    /// What this node advertises now.
    pub fn meta(&self) -> &NodeMeta {
        &self.meta
    }

    /// The value of `key` in this round's store (`None` before the launch, after the round,
    /// or when it is not set).
    pub fn store_value(&self, key: &str) -> Option<&[u8]> {
        self.store.as_ref().and_then(|s| s.get(key))
    }

    /// The membership core (read only: members, round-trip times).
    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// Everyone known, with status.
    pub fn members(&self) -> Vec<MemberView> {
        self.membership.members()
    }

    /// Whether the job is over on this node ([`Event::Finished`] was emitted).
    pub fn is_finished(&self) -> bool {
        matches!(self.phase, Phase::Finished)
    }

    /// Handles one input at time `now`.
    pub fn handle(&mut self, input: Input, now: Instant) {
        match input {
            Input::Frame { from, node, frame } => match frame {
                Frame::Gossip(m) => self.membership.handle_message(from, m, now),
                Frame::Rdzv(m) => self.on_message(from, node, m, now),
                Frame::Store(msg) => self.store_frame(from, node, msg, now),
            },
            Input::HeardFrom(id) => self.membership.heard_from(id, now),
            Input::Seeds(seeds) => {
                let seeds: Vec<SocketAddr> = seeds.into_iter().filter(|s| *s != self.cfg.addr).collect();
                self.membership.add_seeds(&seeds, now);
            }
            Input::MasterPort { round, port } if round == self.restart => {
                if let Phase::Rdzv(r) = &mut self.phase {
                    r.rdzv.set_master_port(port, now);
                }
                self.drain_rdzv(now);
            }
            Input::Leave => self.membership.leave(now),
            Input::Store { round, req, call } => self.store_call(round, req, call, now),
            i @ (Input::LhQuorum { .. } | Input::LhHeartbeat { .. } | Input::LhCancel { .. }) => {
                self.lh_input(i, now)
            }
            // An IO answer of an earlier round (its request was overtaken by a restart).
            Input::MasterPort { round, .. }
            | Input::PreflightReady { round, .. }
            | Input::PreflightFailed { round, .. }
            | Input::Dialed { round, .. }
                if round != self.restart =>
            {
                self.log(
                    Level::Debug,
                    format!("an IO answer of round {round} dropped in round {}", self.restart),
                )
            }
            Input::Finish => {
                self.local_finish = true;
                if matches!(self.phase, Phase::Running(_)) {
                    self.running_io(Input::RanksExited, now);
                }
            }
            other => self.on_io(other, now),
        }
        self.after(now);
    }

    /// Deadlines passed (call at [`Node::poll_timeout`]).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.membership.poll_timeout().is_some_and(|t| t <= now) {
            self.member_fired = Some(now);
            self.membership.handle_timeout(now);
        }
        self.resend_aborts(now);
        self.store_timeout(now);
        self.lh_step(now);
        self.phase_timeout(now);
        self.after(now);
    }

    /// The next frame to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.outbox.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`Node::handle_timeout`] must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let member = self.membership.poll_timeout().filter(|t| self.member_fired.is_none_or(|f| *t > f));
        let aborts = self.aborts.iter().map(|a| a.next).min();
        let phase = match &self.phase {
            Phase::Rdzv(r) => r.poll_timeout(),
            Phase::Preflight(p) => p.poll_timeout(),
            Phase::Running(r) => r.poll_timeout(),
            Phase::Closing(c) => c.poll_timeout(),
            Phase::Stopping(_) | Phase::Finished => None,
        };
        [member, aborts, phase, self.store_poll_timeout(), self.lh.poll_timeout()].into_iter().flatten().min()
    }

    // ---- internals shared by the phases ----

    fn log(&mut self, level: Level, text: impl Into<String>) {
        self.events.push_back(Event::Log(level, text.into()));
    }

    fn send(&mut self, to: SocketAddr, msg: Message) {
        self.outbox.push_back(Transmit { to, frame: Frame::Rdzv(msg), delivery: Delivery::Reliable });
    }

    /// `msg` as one datagram: lost rather than late (a roll call repeats its own).
    fn send_datagram(&mut self, to: SocketAddr, msg: Message) {
        self.outbox.push_back(Transmit { to, frame: Frame::Rdzv(msg), delivery: Delivery::Datagram });
    }

    fn broadcast(&mut self, roster: &Roster, msg: &Message) {
        for m in roster.members.iter().filter(|m| m.id != self.cfg.id) {
            self.outbox.push_back(Transmit {
                to: m.addr,
                frame: Frame::Rdzv(msg.clone()),
                delivery: Delivery::Reliable,
            });
        }
    }

    fn set_state(&mut self, state: NodeState, now: Instant) {
        if self.meta.state == state && self.meta.restarts == self.restart {
            return;
        }
        self.meta.state = state;
        self.meta.restarts = self.restart;
        self.view.set_own(&self.meta);
        self.membership.set_meta(self.meta.clone(), now);
    }

    /// "node gpu-3 (10.0.0.3)" for a roster member.
    fn describe(roster: &Roster, id: NodeId) -> String {
        roster
            .members
            .iter()
            .find(|m| m.id == id)
            .map(|m| {
                format!("node {} ({})", if m.hostname.is_empty() { "?" } else { &m.hostname }, m.addr.ip())
            })
            .unwrap_or_else(|| format!("node {id}"))
    }

    fn on_message(&mut self, from: SocketAddr, node: NodeId, msg: Message, now: Instant) {
        match &msg {
            // Acknowledged whatever the round: the sender stops repeating it.
            Message::Abort { restart, .. } => self.send(from, Message::AbortAck { restart: *restart }),
            Message::AbortAck { restart } => {
                for a in self.aborts.iter_mut().filter(|a| a.restart == *restart) {
                    a.waiting.remove(&node);
                }
                self.aborts.retain(|a| !a.waiting.is_empty());
                return;
            }
            Message::LhAsk { .. }
            | Message::LhBeat { .. }
            | Message::LhCancel { .. }
            | Message::LhGone { .. }
            | Message::LhAnswer { .. }
            | Message::LhPing { .. }
            | Message::LhPong { .. } => return self.lh_message(node, msg, now),
            _ => {}
        }
        match &mut self.phase {
            Phase::Rdzv(_) => self.round_message(node, msg, now),
            Phase::Preflight(_) => self.preflight_message(node, msg, now),
            Phase::Running(_) => self.running_message(node, msg, now),
            Phase::Stopping(_) | Phase::Closing(_) | Phase::Finished => self.closing_message(node, msg),
        }
    }

    /// Keeps a proposal of a later round for when this node gets there.
    fn keep_early(&mut self, from: NodeId, msg: Message) {
        if matches!(&msg, Message::Propose(r) if r.restart > self.restart) && self.early.len() < MAX_EARLY {
            self.early.push((from, msg));
        }
    }

    fn on_io(&mut self, input: Input, now: Instant) {
        match &self.phase {
            Phase::Rdzv(_) => self.round_io(input, now),
            Phase::Preflight(_) => self.preflight_io(input, now),
            Phase::Running(_) => self.running_io(input, now),
            Phase::Stopping(_) => {
                if input == Input::RanksStopped {
                    self.ranks_stopped(now);
                }
            }
            Phase::Closing(_) | Phase::Finished => {}
        }
    }

    fn phase_timeout(&mut self, now: Instant) {
        match &self.phase {
            Phase::Rdzv(_) => self.round_timeout(now),
            Phase::Preflight(_) => self.preflight_timeout(now),
            Phase::Running(_) => self.running_timeout(now),
            Phase::Closing(_) => self.closing_timeout(now),
            Phase::Stopping(_) | Phase::Finished => {}
        }
    }

    /// Drains the membership core after any input: its frames go out, its events update
    /// the view and reach the phase.
    fn after(&mut self, now: Instant) {
        loop {
            while let Some(t) = self.membership.poll_transmit() {
                self.outbox.push_back(Transmit {
                    to: t.to,
                    frame: Frame::Gossip(t.msg),
                    delivery: t.delivery,
                });
            }
            let mut changed = Vec::new();
            while let Some(ev) = self.membership.poll_event() {
                self.view.apply(&ev);
                if let MemberEvent::Down(id) | MemberEvent::Left(id) = &ev {
                    for a in &mut self.aborts {
                        a.waiting.remove(id);
                    }
                    self.aborts.retain(|a| !a.waiting.is_empty());
                }
                changed.push(ev.clone());
                self.events.push_back(Event::Member(ev));
            }
            if changed.is_empty() {
                break;
            }
            for ev in changed {
                self.on_member(ev, now);
            }
        }
        self.phase_step(now);
        self.try_finish(now);
        self.lh_step(now);
    }

    fn on_member(&mut self, ev: MemberEvent, now: Instant) {
        match &self.phase {
            Phase::Rdzv(_) => self.round_member(now),
            Phase::Preflight(_) => self.preflight_member(ev, now),
            Phase::Running(_) => self.running_member(ev, now),
            Phase::Closing(_) => self.closing_member(ev),
            Phase::Stopping(_) | Phase::Finished => {}
        }
    }

    fn phase_step(&mut self, now: Instant) {
        if let Phase::Rdzv(_) = &self.phase {
            self.round_step(now);
        }
    }
}

impl Node {
    /// How long this node has waited for its first roster (for tests and reports).
    pub fn waited(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.started)
    }
}
