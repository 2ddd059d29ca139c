//! The job after the launch: Done from every member, Abort (repeated until every roster
//! member acknowledged it or is gone), the grace for a member that left without Done,
//! forwarded signals, the end of a round (restart or finish), and the last moments of a
//! node (answering until its last Done or Abort is in).

use super::{
    Event, Failure, FaultTolerance, Input, Level, Node, Outcome, OutcomeKind, Phase, SIGUSR1, SIGUSR2, Timing,
};
use crate::id::NodeId;
use crate::membership::MemberEvent;
use crate::meta::NodeState;
use crate::preflight::Verdict;
use crate::rendezvous::{Message, RankFailure, Roster};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Instant;

/// An Abort this node sent and repeats until acknowledged.
pub(super) struct AbortOut {
    pub restart: u32,
    pub msg: Message,
    /// Members that have not acknowledged yet (and are not dead or gone).
    pub waiting: BTreeMap<NodeId, SocketAddr>,
    pub next: Instant,
    pub give_up: Instant,
}

/// The launched round.
pub(super) struct Running {
    pub roster: Roster,
    /// Members whose Done the end waits for (with `--fault-tolerance node`, the live ones).
    pub everyone: BTreeSet<NodeId>,
    pub done: BTreeSet<NodeId>,
    /// The IO confirmed the ranks run.
    pub spawned: bool,
    pub local_done: bool,
    next_done: Option<Instant>,
    /// A member that left without Done, and when to blame it if no Abort comes.
    left: Option<(NodeId, Instant)>,
    /// The launch's verdict (a node's own restart launches with it again).
    pub verdict: Verdict,
    /// `--fault-tolerance node`: this node's own restarts, and the one being carried out
    /// (the ranks are stopping).
    pub ft: super::ft::FtRunning,
}

impl Running {
    pub fn new(roster: Roster, verdict: Verdict) -> Running {
        let everyone = roster.members.iter().map(|m| m.id).collect();
        Running {
            roster,
            everyone,
            done: BTreeSet::new(),
            spawned: false,
            local_done: false,
            next_done: None,
            left: None,
            verdict,
            ft: Default::default(),
        }
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        [self.next_done, self.left.map(|l| l.1)].into_iter().flatten().min()
    }
}

/// A node whose job is over, answering a little longer.
pub(super) struct Closing {
    outcome: Outcome,
    /// Not before this.
    linger_until: Option<Instant>,
    /// Until this, or until every Abort of ours is acknowledged.
    acks_until: Option<Instant>,
    /// Members exchange Done until every one said it or the deadline passed.
    done_wait: Option<DoneWait>,
}

struct DoneWait {
    roster: Roster,
    done: BTreeSet<NodeId>,
    deadline: Instant,
    next: Instant,
}

impl Closing {
    /// Ends once every abort of ours is acknowledged (or the linger is up).
    pub fn after_abort(outcome: Outcome, now: Instant, t: &Timing) -> Closing {
        Closing { outcome, linger_until: None, acks_until: Some(now + t.abort_linger), done_wait: None }
    }

    /// Ends after a fixed linger (our last Done must arrive).
    pub fn linger(outcome: Outcome, now: Instant, t: &Timing) -> Closing {
        Closing { outcome, linger_until: Some(now + t.done_linger), acks_until: None, done_wait: None }
    }

    /// Says Done until every member said it (bounded), then lingers.
    pub fn exchange_done(outcome: Outcome, roster: Roster, me: NodeId, now: Instant, t: &Timing) -> Closing {
        let done = [me].into_iter().collect();
        Closing {
            outcome,
            linger_until: None,
            acks_until: None,
            done_wait: Some(DoneWait {
                roster,
                done,
                deadline: now + t.refuse_wait,
                next: now + t.abort_resend,
            }),
        }
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        let dw = self.done_wait.as_ref().map(|d| d.next.min(d.deadline));
        [self.linger_until, self.acks_until, dw].into_iter().flatten().min()
    }
}

impl Node {
    /// Tells every roster member to stop round `roster.restart`, and keeps telling those
    /// that did not acknowledge.
    pub(super) fn start_abort(
        &mut self,
        roster: &Roster,
        rank: Option<u32>,
        reason: String,
        cause: Option<Box<RankFailure>>,
        now: Instant,
    ) {
        let hostname = roster
            .members
            .iter()
            .find(|m| m.id == self.cfg.id)
            .map(|m| m.hostname.clone())
            .unwrap_or_default();
        let msg =
            Message::Abort { restart: roster.restart, node: self.cfg.id, hostname, rank, reason, cause };
        self.broadcast(roster, &msg);
        let waiting: BTreeMap<NodeId, SocketAddr> = roster
            .members
            .iter()
            .filter(|m| m.id != self.cfg.id && self.view.is_live(m.id))
            .map(|m| (m.id, m.addr))
            .collect();
        if !waiting.is_empty() {
            let t = &self.cfg.timing;
            self.aborts.push(AbortOut {
                restart: roster.restart,
                msg,
                waiting,
                next: now + t.abort_resend,
                give_up: now + t.abort_give_up,
            });
        }
        self.set_state(NodeState::Failed, now);
    }

    pub(super) fn resend_aborts(&mut self, now: Instant) {
        self.aborts.retain(|a| now < a.give_up && !a.waiting.is_empty());
        let resend = self.cfg.timing.abort_resend;
        let mut out = Vec::new();
        for a in self.aborts.iter_mut().filter(|a| a.next <= now) {
            a.next = now + resend;
            out.extend(a.waiting.values().map(|to| (*to, a.msg.clone())));
        }
        for (to, m) in out {
            self.send(to, m);
        }
    }

    /// Aborts of ours still unacknowledged (for tests and the simulator's figures).
    pub fn aborts_pending(&self) -> usize {
        self.aborts.iter().map(|a| a.waiting.len()).sum()
    }

    pub(super) fn running_io(&mut self, input: Input, now: Instant) {
        let Phase::Running(r) = &mut self.phase else { return };
        let here = Self::describe(&r.roster, self.cfg.id);
        match input {
            Input::RanksSpawned if !r.spawned => {
                r.spawned = true;
                self.set_state(NodeState::Running, now);
                if self.local_finish {
                    self.running_io(Input::RanksExited, now);
                }
            }
            Input::SpawnFailed(e) => {
                let who = r.roster.members.iter().find(|m| m.id == self.cfg.id);
                let host = who.map(|m| m.hostname.clone()).unwrap_or_default();
                let reason = format!("node {host} ({}): {e}", self.cfg.addr.ip());
                if self.cfg.fault_tolerance == FaultTolerance::Node {
                    return self.ft_rank_failed(None, reason, None, now);
                }
                self.running_fails(None, reason, None, now);
            }
            Input::RanksExited if r.spawned && !r.local_done => {
                r.local_done = true;
                r.done.insert(self.cfg.id);
                r.next_done = Some(now + self.cfg.timing.done_resend);
                let roster = r.roster.clone();
                self.set_state(NodeState::Done, now);
                self.broadcast(&roster, &Message::Done { restart: self.restart });
                self.running_check(now);
            }
            Input::RankFailed { rank, reason, cause } if self.cfg.fault_tolerance == FaultTolerance::Node => {
                self.ft_rank_failed(rank, reason, cause, now);
            }
            Input::RankFailed { rank, reason, cause } => {
                self.log(Level::Error, format!("{reason}; stopping the job on every node"));
                self.running_fails(rank, reason, cause, now);
            }
            Input::RanksStopped => self.ft_ranks_stopped(now),
            Input::Abort(reason) => {
                let reason = format!("{reason} (on {here})");
                self.log(Level::Error, format!("{reason}; stopping the job on every node"));
                self.running_fails(None, reason, None, now);
            }
            Input::Stop { what, code } if self.cfg.fault_tolerance == FaultTolerance::Node => {
                let reason = format!("{what} on {here}");
                self.log(
                    Level::Warn,
                    format!("{reason}: this node's replica group leaves the job; the others go on"),
                );
                self.fail(Failure::Signal(reason, code), now);
            }
            Input::Stop { what, code } => {
                let reason = format!("{what} on {here}");
                let roster = r.roster.clone();
                self.start_abort(&roster, None, reason.clone(), None, now);
                self.fail(Failure::Signal(reason, code), now);
            }
            Input::Signal(signal) => {
                let hostname =
                    r.roster.members.iter().find(|m| m.id == self.cfg.id).map(|m| m.hostname.clone());
                let roster = r.roster.clone();
                let msg =
                    Message::Signal { restart: self.restart, signal, hostname: hostname.unwrap_or_default() };
                self.broadcast(&roster, &msg);
                self.events.push_back(Event::ForwardSignal { signal, from: None });
            }
            _ => {}
        }
    }

    /// Aborts everywhere and ends the round with a restartable failure.
    pub(super) fn running_fails(
        &mut self,
        rank: Option<u32>,
        reason: String,
        cause: Option<Box<RankFailure>>,
        now: Instant,
    ) {
        let Phase::Running(r) = &self.phase else { return };
        let roster = r.roster.clone();
        self.start_abort(&roster, rank, reason.clone(), cause.clone(), now);
        self.fail(Failure::Job(reason, cause), now);
    }

    pub(super) fn running_message(&mut self, from: NodeId, msg: Message, now: Instant) {
        let Phase::Running(r) = &mut self.phase else { return };
        // Lifecycle messages count only from this round's roster: a straggler of an earlier
        // job with the same run id (an earlier srun step) neither stops this one nor, with
        // its Done, keeps it from finishing.
        let member = r.everyone.contains(&from);
        match msg {
            Message::Abort { restart, reason, cause, .. } if restart == self.restart && member => {
                let who = Self::describe(&r.roster, from);
                self.log(Level::Error, format!("job stopped by {who}: {reason}"));
                self.set_state(NodeState::Failed, now);
                self.fail(Failure::Job(reason, cause), now);
            }
            Message::Done { restart } if restart == self.restart && member => {
                let first = r.done.insert(from);
                if first {
                    self.events.push_back(Event::PeerFinished(from));
                    self.store_member_gone(from, now);
                }
                self.running_check(now);
            }
            // Only the signals meshd forwards: a peer cannot make ranks die this way.
            Message::Signal { restart, signal, .. }
                if restart == self.restart
                    && member
                    && [SIGUSR1, SIGUSR2].contains(&signal)
                    && !r.local_done =>
            {
                let who = Self::describe(&r.roster, from);
                self.events.push_back(Event::ForwardSignal { signal, from: Some(who) });
            }
            m @ Message::Propose(_) => self.keep_early(from, m),
            m @ (Message::FtJoin { .. } | Message::FtRoster { .. }) => self.ft_message(from, m, now),
            _ => {}
        }
    }

    pub(super) fn running_member(&mut self, ev: MemberEvent, now: Instant) {
        let Phase::Running(r) = &self.phase else { return };
        if let MemberEvent::Left(id) | MemberEvent::Down(id) = &ev {
            if r.everyone.contains(id) {
                self.events.push_back(Event::PeerFinished(*id));
                self.store_member_gone(*id, now);
            }
        }
        if self.cfg.fault_tolerance == FaultTolerance::Node {
            return self.ft_member(ev, now);
        }
        let Phase::Running(r) = &mut self.phase else { return };
        match ev {
            MemberEvent::Left(id)
                if r.everyone.contains(&id) && !r.done.contains(&id) && r.left.is_none() =>
            {
                // Usually a node stopping on an Abort that is still on its way here.
                let grace = self.cfg.timing.left_grace;
                r.left = Some((id, now + grace));
                let who = Self::describe(&r.roster, id);
                self.log(
                    Level::Info,
                    format!(
                        "{who} left the mesh before saying it was done; waiting up to {grace:?} for its reason before \
                         stopping the job"
                    ),
                );
            }
            MemberEvent::Down(id) if r.everyone.contains(&id) && !r.done.contains(&id) => {
                let reason = format!(
                    "{} stopped answering (declared dead by the mesh)",
                    Self::describe(&r.roster, id)
                );
                self.log(Level::Error, format!("{reason}; stopping the job on every node"));
                self.running_fails(None, reason, None, now);
            }
            _ => {}
        }
    }

    pub(super) fn running_timeout(&mut self, now: Instant) {
        let Phase::Running(r) = &mut self.phase else { return };
        if let Some((id, at)) = r.left {
            if r.done.contains(&id) {
                r.left = None;
            } else if now >= at {
                let reason =
                    format!("{} left the mesh before the job finished", Self::describe(&r.roster, id));
                self.log(Level::Error, format!("{reason}; stopping the job on every node"));
                return self.running_fails(None, reason, None, now);
            }
        }
        if r.next_done.is_some_and(|t| now >= t) {
            r.next_done = Some(now + self.cfg.timing.done_resend);
            let roster = r.roster.clone();
            self.broadcast(&roster, &Message::Done { restart: self.restart });
        }
    }

    /// Every member said Done and this node's ranks are done: the job is over here.
    pub(super) fn running_check(&mut self, now: Instant) {
        let Phase::Running(r) = &self.phase else { return };
        if !(r.local_done && r.done == r.everyone) {
            return;
        }
        let world = r.roster.world_size();
        let outcome = Outcome {
            code: 0,
            message: match world {
                1 => "job finished: the rank exited 0".to_string(),
                n => format!("job finished: all {n} ranks exited 0"),
            },
            kind: OutcomeKind::Success,
        };
        if r.everyone.len() == 1 {
            return self.finish(outcome);
        }
        // Keep answering a moment so our last Done reaches everyone.
        let roster = r.roster.clone();
        self.broadcast(&roster, &Message::Done { restart: self.restart });
        self.close(Closing::linger(outcome, now, &self.cfg.timing));
    }

    /// The round failed: stop the ranks (if any run), then restart or end.
    pub(super) fn fail(&mut self, f: Failure, now: Instant) {
        self.store_close();
        let spawned = matches!(&self.phase, Phase::Running(r) if r.spawned);
        self.phase = Phase::Stopping(f);
        if spawned {
            self.events.push_back(Event::StopRanks);
        } else {
            self.ranks_stopped(now);
        }
    }

    pub(super) fn ranks_stopped(&mut self, now: Instant) {
        let Phase::Stopping(f) = std::mem::replace(&mut self.phase, Phase::Finished) else { return };
        match f {
            Failure::Signal(message, code) => self.close(Closing::after_abort(
                Outcome { code, message, kind: OutcomeKind::Stopped },
                now,
                &self.cfg.timing,
            )),
            Failure::Job(m, cause) => {
                // With `--fault-tolerance node` the restarts are each node's own: a failure of
                // the whole job (fewer than MIN groups left) ends it.
                let restarting =
                    self.restart < self.cfg.max_restarts && self.cfg.fault_tolerance == FaultTolerance::Job;
                self.events.push_back(Event::RoundFailed {
                    restart: self.restart,
                    reason: m.clone(),
                    cause: cause.clone(),
                    restarting,
                });
                if restarting {
                    let next = self.restart + 1;
                    let max = self.cfg.max_restarts;
                    let left = max - next;
                    self.log(
                        Level::Warn,
                        format!(
                            "{m}; restart round {next} of {max}: restarting all ranks on every node ({left} {} left \
                             after this one)",
                            if left == 1 { "restart" } else { "restarts" }
                        ),
                    );
                    let timeout = self.cfg.rdzv_timeout;
                    self.begin_round(next, timeout, now);
                } else {
                    self.set_state(NodeState::Failed, now);
                    let code = cause.map_or(1, |c| c.status);
                    let outcome =
                        Outcome { code, message: format!("job failed: {m}"), kind: OutcomeKind::Failed };
                    self.close(Closing::after_abort(outcome, now, &self.cfg.timing));
                }
            }
        }
    }

    pub(super) fn closing_message(&mut self, from: NodeId, msg: Message) {
        if let Phase::Closing(c) = &mut self.phase {
            if let (Some(d), Message::Done { restart }) = (&mut c.done_wait, &msg) {
                if *restart == d.roster.restart && d.roster.node_rank(from).is_some() {
                    d.done.insert(from);
                }
            }
        }
        if let m @ Message::Propose(_) = msg {
            self.keep_early(from, m);
        }
    }

    pub(super) fn closing_member(&mut self, ev: MemberEvent) {
        if let (Phase::Closing(c), MemberEvent::Down(id) | MemberEvent::Left(id)) = (&mut self.phase, ev) {
            if let Some(d) = &mut c.done_wait {
                d.done.insert(id);
            }
        }
    }

    pub(super) fn closing_timeout(&mut self, now: Instant) {
        let Phase::Closing(c) = &mut self.phase else { return };
        let Some(d) = &mut c.done_wait else { return };
        if now >= d.next {
            d.next = now + self.cfg.timing.abort_resend;
            let roster = d.roster.clone();
            self.broadcast(&roster, &Message::Done { restart: roster.restart });
        }
    }

    pub(super) fn close(&mut self, c: Closing) {
        self.store_close();
        self.phase = Phase::Closing(Box::new(c));
    }

    /// Ends the job on this node now.
    pub(super) fn finish(&mut self, outcome: Outcome) {
        self.store_close();
        self.phase = Phase::Finished;
        self.events.push_back(Event::Finished(outcome));
    }

    /// A closing node ends once what it waits for is in (or its time is up).
    pub(super) fn try_finish(&mut self, now: Instant) {
        let restart = self.restart;
        let pending = self.aborts.iter().any(|a| a.restart == restart && !a.waiting.is_empty());
        let Phase::Closing(c) = &mut self.phase else { return };
        if let Some(d) = &c.done_wait {
            let everyone = d.roster.members.iter().all(|m| d.done.contains(&m.id));
            if !everyone && now < d.deadline {
                return;
            }
            c.done_wait = None;
            c.linger_until = Some(now + self.cfg.timing.done_linger);
            return;
        }
        if c.linger_until.is_some_and(|t| now < t) {
            return;
        }
        if c.acks_until.is_some_and(|t| now < t) && pending {
            return;
        }
        let outcome = c.outcome.clone();
        self.finish(outcome);
    }
}
