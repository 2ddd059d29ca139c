//! Rendezvous: who is in the job, who is master, which rank is whose.
//!
//! The rule, identical on every node so no node needs a master flag:
//! 1. Candidates are the alive members of the same run (same run hash), each with the
//!    address it advertises on its chosen interface.
//! 2. Once at least `min_nodes` are present and either `max_nodes` are present or no
//!    newcomer arrived for `settle`, the candidates are ordered by (address, node id); the
//!    first `max_nodes` form the roster and the first of them is the master.
//! 3. The master proposes the roster (with epoch, restart count and MASTER_PORT). Every
//!    other member acknowledges only if the proposer is the lowest-addressed candidate it
//!    sees itself and every roster member is alive in its own view.
//! 4. With every acknowledgement in, the master commits; nothing starts before a commit.
//!    A missing acknowledgement (timeout) makes the master propose again with a new epoch.
//!
//! Since a commit needs an acknowledgement from every roster member, two halves of a
//! partition cannot both launch a fixed-size job: at most one half holds all of them.
//!
//! Its messages are the job protocol's ([`crate::job_msg::Message`]: `Propose`, `Ack`,
//! `Commit` here; the lifecycle's are the node core's); the roster is [`crate::roster`].

use crate::id::NodeId;
use std::collections::{BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

pub use crate::job_msg::{FailureSource, Message, RankFailure};
pub use crate::roster::{Roster, RosterMember};

/// A candidate for the roster, as the membership layer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// Node identity.
    pub id: NodeId,
    /// Address on its chosen interface.
    pub addr: SocketAddr,
    /// Processes it would start.
    pub nproc: u32,
    /// Host name.
    pub hostname: String,
}

/// Rendezvous settings.
#[derive(Clone, Debug)]
pub struct RdzvConfig {
    /// Start once this many nodes are present (and `settle` passed, if fewer than max).
    pub min_nodes: u32,
    /// Never more than this many nodes in a roster.
    pub max_nodes: u32,
    /// With min < present < max: start after this long without a newcomer.
    pub settle: Duration,
    /// How long a proposal waits for acknowledgements (or an ack for the commit).
    pub ack_timeout: Duration,
}

impl Default for RdzvConfig {
    fn default() -> Self {
        RdzvConfig {
            min_nodes: 1,
            max_nodes: 1,
            settle: Duration::from_secs(3),
            ack_timeout: Duration::from_secs(3),
        }
    }
}

/// Something the driver must do or know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RdzvEvent {
    /// The roster is agreed: launch.
    Committed(Roster),
    /// A proposal (or the view it would come from) was refused, with why; the round goes
    /// on waiting (the driver logs it).
    Refused(String),
}

#[derive(Debug)]
enum Phase {
    Waiting,
    /// We are master and proposed.
    Proposed {
        roster: Roster,
        acks: BTreeSet<NodeId>,
        deadline: Instant,
    },
    /// We acknowledged a proposal and wait for its commit.
    Acked {
        roster: Roster,
        deadline: Instant,
    },
    Committed,
}

/// The rendezvous state machine for one restart round.
#[derive(Debug)]
pub struct Rendezvous {
    me: NodeId,
    run_hash: u64,
    restart: u32,
    config: RdzvConfig,
    /// `None` until the IO says which: this node proposes nothing before.
    master_port: Option<u16>,
    candidates: Vec<Candidate>,
    last_change: Instant,
    epoch: u64,
    /// A proposal we could not accept yet because our own view lagged behind.
    pending: Option<(NodeId, Roster)>,
    /// The last refusal said (not repeated while the view stays the same).
    last_refusal: Option<String>,
    phase: Phase,
    /// The next deadline, always later than the last `now` this core was given: a deadline
    /// that passed has fired and is cleared, so a driver that sleeps until `poll_timeout`
    /// can never spin on a deadline in the past.
    timer: Option<Instant>,
    outbox: VecDeque<(SocketAddr, Message)>,
    events: VecDeque<RdzvEvent>,
}

impl Rendezvous {
    /// A new round. `master_port` is the free TCP port this node offers should it be master;
    /// with `None` it proposes nothing until [`Rendezvous::set_master_port`] (it acknowledges
    /// others' proposals all the same).
    pub fn new(
        me: NodeId,
        run_hash: u64,
        restart: u32,
        config: RdzvConfig,
        master_port: impl Into<Option<u16>>,
        now: Instant,
    ) -> Self {
        Rendezvous {
            me,
            run_hash,
            restart,
            config,
            master_port: master_port.into(),
            candidates: Vec::new(),
            last_change: now,
            epoch: 0,
            pending: None,
            last_refusal: None,
            phase: Phase::Waiting,
            timer: None,
            outbox: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    /// The current candidates changed (alive members of this run, us included).
    pub fn handle_candidates(&mut self, mut candidates: Vec<Candidate>, now: Instant) {
        candidates.sort_by_key(|c| (c.addr.ip(), c.id));
        candidates.dedup_by_key(|c| c.id);
        let ids = |v: &[Candidate]| v.iter().map(|c| c.id).collect::<BTreeSet<_>>();
        if ids(&candidates) != ids(&self.candidates) {
            // Only a newcomer (or a departure) restarts the settle clock.
            self.last_change = now;
        }
        self.candidates = candidates;
        if let Some((from, roster)) = self.pending.take() {
            self.consider_proposal(from, roster, now);
        }
        self.step(now);
        self.rearm(now);
    }

    /// A rendezvous message from an authenticated member.
    pub fn handle_message(&mut self, from: NodeId, msg: Message, now: Instant) {
        self.dispatch(from, msg, now);
        self.rearm(now);
    }

    fn dispatch(&mut self, from: NodeId, msg: Message, now: Instant) {
        match msg {
            Message::Propose(roster) => self.consider_proposal(from, roster, now),
            Message::Ack { restart, epoch } if restart == self.restart => {
                if let Phase::Proposed { roster, acks, .. } = &mut self.phase {
                    if roster.epoch == epoch && roster.node_rank(from).is_some() {
                        acks.insert(from);
                    }
                }
                self.step(now);
            }
            Message::Commit { restart, epoch } if restart == self.restart => {
                if let Phase::Acked { roster, .. } = &self.phase {
                    let master = roster.master().map(|m| m.id);
                    if roster.epoch == epoch && master == Some(from) {
                        let roster = roster.clone();
                        self.phase = Phase::Committed;
                        self.events.push_back(RdzvEvent::Committed(roster));
                    }
                }
            }
            // Stale rounds, and lifecycle messages the driver handles.
            _ => {}
        }
    }

    /// Deadlines passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.step(now);
        self.rearm(now);
    }

    /// Expires a passed proposal deadline and computes the next one, later than `now`.
    fn rearm(&mut self, now: Instant) {
        if let Phase::Proposed { deadline, .. } | Phase::Acked { deadline, .. } = &self.phase {
            if now >= *deadline {
                // Somebody did not answer: forget this proposal and decide again from the
                // current view.
                self.phase = Phase::Waiting;
                self.step(now);
            }
        }
        self.timer = match &self.phase {
            Phase::Proposed { deadline, .. } | Phase::Acked { deadline, .. } => Some(*deadline),
            // Settled (or full) and not the proposer: nothing changes until the candidates
            // do, and `handle_candidates` re-arms then.
            Phase::Waiting if self.enough_present() && !self.full() => {
                Some(self.last_change + self.config.settle).filter(|d| *d > now)
            }
            _ => None,
        };
    }

    /// Sets the MASTER_PORT this node offers in its next proposal (the IO picked a free one
    /// for this round); a proposal that waited for it goes out now.
    pub fn set_master_port(&mut self, port: u16, now: Instant) {
        self.master_port = Some(port);
        self.step(now);
        self.rearm(now);
    }

    /// The next message to send.
    pub fn poll_transmit(&mut self) -> Option<(SocketAddr, Message)> {
        self.outbox.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<RdzvEvent> {
        self.events.pop_front()
    }

    /// When `handle_timeout` must be called next: always later than the `now` of the last
    /// `handle_*` call (a passed deadline fires once, then is cleared).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timer
    }

    /// (present, expected minimum, expected maximum) for a progress line.
    pub fn progress(&self) -> (usize, u32, u32) {
        (self.candidates.len(), self.config.min_nodes, self.config.max_nodes)
    }

    /// Whether this round reached a commit.
    pub fn is_committed(&self) -> bool {
        matches!(self.phase, Phase::Committed)
    }

    fn enough_present(&self) -> bool {
        self.candidates.len() >= self.config.min_nodes as usize
    }

    fn full(&self) -> bool {
        self.candidates.len() >= self.config.max_nodes as usize
    }

    /// The roster the current view yields, if the view allows one now.
    fn roster_from_view(&self, now: Instant) -> Option<Vec<RosterMember>> {
        if !self.enough_present() {
            return None;
        }
        if !self.full() && now < self.last_change + self.config.settle {
            return None;
        }
        Some(
            self.candidates
                .iter()
                .take(self.config.max_nodes as usize)
                .map(|c| RosterMember {
                    id: c.id,
                    addr: c.addr,
                    nproc: c.nproc,
                    hostname: c.hostname.clone(),
                })
                .collect(),
        )
    }

    fn step(&mut self, now: Instant) {
        match &self.phase {
            Phase::Waiting => {
                let Some(members) = self.roster_from_view(now) else { return };
                if members.first().map(|m| m.id) != Some(self.me) {
                    return;
                }
                let Some(master_port) = self.master_port else { return };
                self.epoch += 1;
                let roster = Roster {
                    run_hash: self.run_hash,
                    restart: self.restart,
                    epoch: self.epoch,
                    master_port,
                    members,
                };
                if roster.checked_world_size().is_none() {
                    // Never proposed; said once per change of the view.
                    if let Some(m) = roster.members.iter().max_by_key(|m| m.nproc) {
                        let why = format!(
                            "cannot propose a roster: the process counts add up past 2^32 ({} asks for {})",
                            m.addr, m.nproc
                        );
                        if self.last_refusal.as_deref() != Some(why.as_str()) {
                            self.last_refusal = Some(why.clone());
                            self.events.push_back(RdzvEvent::Refused(why));
                        }
                    }
                    return;
                }
                for m in roster.members.iter().skip(1) {
                    self.outbox.push_back((m.addr, Message::Propose(roster.clone())));
                }
                let mut acks = BTreeSet::new();
                acks.insert(self.me);
                self.phase = Phase::Proposed { roster, acks, deadline: now + self.config.ack_timeout };
                self.step(now);
            }
            Phase::Proposed { roster, acks, .. } => {
                if acks.len() == roster.members.len() {
                    let roster = roster.clone();
                    for m in roster.members.iter().skip(1) {
                        self.outbox.push_back((
                            m.addr,
                            Message::Commit { restart: self.restart, epoch: roster.epoch },
                        ));
                    }
                    self.phase = Phase::Committed;
                    self.events.push_back(RdzvEvent::Committed(roster));
                }
            }
            Phase::Acked { .. } | Phase::Committed => {}
        }
    }

    fn consider_proposal(&mut self, from: NodeId, roster: Roster, now: Instant) {
        if roster.run_hash != self.run_hash || roster.restart != self.restart {
            return;
        }
        if matches!(self.phase, Phase::Committed) {
            return;
        }
        let Some(master) = roster.master() else { return };
        if master.id != from || roster.node_rank(self.me).is_none() {
            return;
        }
        // This node's entry must say what this node itself advertises (its process count and
        // address): a roster that disagrees would start a job of another shape.
        let entry = roster.members.iter().find(|m| m.id == self.me);
        let own = self.candidates.iter().find(|c| c.id == self.me);
        if let (Some(e), Some(o)) = (entry, own) {
            if e.nproc != o.nproc || e.addr != o.addr {
                self.events.push_back(RdzvEvent::Refused(format!(
                    "refused the roster proposed by {}: it gives this node {} processes at {}, but this node \
                     starts {} at {}",
                    master.addr, e.nproc, e.addr, o.nproc, o.addr
                )));
                return;
            }
        }
        if roster.checked_world_size().is_none() {
            let big = roster.members.iter().max_by_key(|m| m.nproc).map(|m| (m.addr, m.nproc));
            self.events.push_back(RdzvEvent::Refused(format!(
                "refused the roster proposed by {}: its process counts add up past 2^32 (largest: {:?})",
                master.addr, big
            )));
            return;
        }
        // Our own view must agree: every roster member alive here, and the proposer the
        // lowest-addressed candidate we know of. Otherwise keep it until our view catches up
        // (gossip lags by a few hundred milliseconds) and re-check on the next change.
        let view_has_all = roster.members.iter().all(|m| self.candidates.iter().any(|c| c.id == m.id));
        let lowest = self.candidates.first().map(|c| c.id);
        if !view_has_all || lowest != Some(from) || !self.enough_present() {
            self.pending = Some((from, roster));
            return;
        }
        self.outbox.push_back((master.addr, Message::Ack { restart: self.restart, epoch: roster.epoch }));
        self.phase = Phase::Acked { roster, deadline: now + self.config.ack_timeout * 2 };
    }
}

#[cfg(test)]
mod tests;
