//! Waiting for the roster of a restart round: candidates from the view, adoption of the
//! round the waiting survivors are in, proposals of later rounds kept, preflight and abort
//! frames that overtake the commit held, the running-job block, progress and timeout.
//!
//! The running-job block: a node never forms a roster while at least MIN live members of
//! its run are Running in a round at or after its own. Every roster has at least MIN
//! members, so fewer running nodes cannot be a roster that runs (they are a straggler of
//! an earlier job with the same run id, or a roster already tearing down); MIN or more
//! are treated as one. Nodes beyond MAX, and nodes that arrive once a roster runs, wait
//! instead of launching a second job of the run, say why, and join that job's next
//! restart round if there is one (or time out naming the running nodes).
//!
//! What is and is not guaranteed against a network partition (`--nnodes MIN:MAX`): a
//! commit needs an acknowledgement from every roster member, and every roster has at least
//! MIN members. Two disjoint rosters therefore need at least 2 x MIN live nodes of the run.
//! So with at most MAX nodes started and MIN > MAX/2 (a fixed size, MIN = MAX, included)
//! two halves can never both launch. With MIN <= MAX/2 (or more than MAX nodes started),
//! each side of a partition that holds MIN nodes forms its own roster: meshd keeps `MIN` as
//! the user's consent to run that small and does not invent a larger quorum; the
//! simulator test `partition_min_max` shows both cases.

use super::report::{nnodes_text, state_word};
use super::{Event, FaultTolerance, Level, MAX_HELD, Node, Outcome, OutcomeKind, Phase, WaitReport};
use crate::id::NodeId;
use crate::meta::NodeState;
use crate::rendezvous::{Message, RdzvEvent, Rendezvous, Roster};
use std::time::{Duration, Instant};

/// Shortest time between two looks at a changing view (a thousand joins are one look,
/// not a thousand).
const VIEW_EVERY: Duration = Duration::from_millis(2);

pub(super) struct Round {
    pub rdzv: Rendezvous,
    pub deadline: Instant,
    pub timeout: Duration,
    pub next_progress: Instant,
    /// The running-job block is on (said once per change).
    pub blocked: bool,
    pub last_look: Option<Instant>,
    pub dirty: bool,
    /// `--fault-tolerance node`, blocked by the running job: when to ask again to join it.
    pub ft_join_next: Option<Instant>,
}

impl Round {
    pub fn poll_timeout(&self) -> Option<Instant> {
        let look = if self.dirty { self.last_look.map(|l| l + VIEW_EVERY) } else { None };
        let join = self.ft_join_next.filter(|_| self.blocked);
        [self.rdzv.poll_timeout(), Some(self.next_progress), Some(self.deadline), look, join]
            .into_iter()
            .flatten()
            .min()
    }
}

impl Node {
    /// Starts waiting for the roster of round `restart`, for at most `timeout`.
    pub(super) fn begin_round(&mut self, restart: u32, timeout: Duration, now: Instant) {
        self.restart = restart;
        self.master = None;
        self.set_state(NodeState::Waiting, now);
        let mut rdzv =
            Rendezvous::new(self.cfg.id, self.meta.run_hash, restart, self.cfg.rdzv.clone(), None, now);
        let early: Vec<(NodeId, Message)> = std::mem::take(&mut self.early);
        for (from, m) in early {
            match &m {
                Message::Propose(r) if r.restart == restart => rdzv.handle_message(from, m, now),
                Message::Propose(r) if r.restart > restart => self.early.push((from, m)),
                _ => {}
            }
        }
        self.held.retain(|(_, m)| round_of(m).is_some_and(|r| r >= restart));
        self.phase = Phase::Rdzv(Box::new(Round {
            rdzv,
            deadline: now + timeout,
            timeout,
            next_progress: now + self.cfg.timing.progress_first,
            blocked: false,
            last_look: None,
            dirty: true,
            ft_join_next: None,
        }));
        // The IO answers with the round's MASTER_PORT; nothing is proposed before.
        self.events.push_back(Event::RoundBegan { restart });
        self.drain_rdzv(now);
    }

    pub(super) fn round_message(&mut self, from: NodeId, msg: Message, now: Instant) {
        let Phase::Rdzv(r) = &mut self.phase else { return };
        match &msg {
            Message::Propose(p) if p.restart > self.restart => self.keep_early(from, msg),
            // Faster nodes may begin the preflight (or even fail) before our commit arrives.
            Message::PreflightHello { restart, .. }
            | Message::PreflightReport { restart, .. }
            | Message::Abort { restart, .. } => {
                if *restart >= self.restart && self.held.len() < MAX_HELD {
                    self.held.push((from, msg));
                }
            }
            Message::Propose(_) | Message::Ack { .. } | Message::Commit { .. } => {
                r.rdzv.handle_message(from, msg, now);
                self.drain_rdzv(now);
            }
            Message::FtRoster { roster, collective } if self.cfg.fault_tolerance == FaultTolerance::Node => {
                let (roster, collective) = (roster.clone(), *collective);
                self.ft_admitted(from, roster, collective, now);
            }
            Message::Done { .. }
            | Message::Signal { .. }
            | Message::AbortAck { .. }
            | Message::FtJoin { .. }
            | Message::FtRoster { .. }
            | Message::LhAsk { .. }
            | Message::LhBeat { .. }
            | Message::LhCancel { .. }
            | Message::LhGone { .. }
            | Message::LhAnswer { .. }
            | Message::LhPing { .. }
            | Message::LhPong { .. } => {}
        }
    }

    pub(super) fn round_io(&mut self, input: super::Input, now: Instant) {
        let _ = now;
        let when = if self.restart > 0 {
            format!("while waiting for nodes (restart round {})", self.restart)
        } else {
            "while waiting for nodes".to_string()
        };
        match input {
            super::Input::Stop { what, code } => {
                self.finish(Outcome { code, message: format!("{what} {when}"), kind: OutcomeKind::Stopped })
            }
            super::Input::Abort(reason) => self.finish(Outcome {
                code: 1,
                message: format!("{reason} {when}"),
                kind: OutcomeKind::Failed,
            }),
            _ => {}
        }
    }

    pub(super) fn round_member(&mut self, _now: Instant) {
        if let Phase::Rdzv(r) = &mut self.phase {
            r.dirty = true;
        }
    }

    pub(super) fn round_timeout(&mut self, now: Instant) {
        let Phase::Rdzv(r) = &mut self.phase else { return };
        if r.rdzv.poll_timeout().is_some_and(|t| t <= now) {
            r.rdzv.handle_timeout(now);
        }
        self.drain_rdzv(now);
        let Phase::Rdzv(r) = &mut self.phase else { return };
        if now >= r.next_progress {
            r.next_progress = now + self.cfg.timing.progress_every;
            let report = self.wait_report();
            self.events.push_back(Event::Waiting(report));
        }
        let Phase::Rdzv(r) = &self.phase else { return };
        if r.blocked && self.cfg.fault_tolerance == FaultTolerance::Node {
            self.ft_ask_to_join(now);
        }
        let Phase::Rdzv(r) = &self.phase else { return };
        if now >= r.deadline {
            let report = self.wait_report();
            let message = report.timeout_message(&[], &[], self.cfg.addr.port(), &[]);
            self.finish(Outcome { code: 1, message, kind: OutcomeKind::TimedOut(Box::new(report)) });
        }
    }

    /// Looks at the view when it changed (at most every [`VIEW_EVERY`]).
    pub(super) fn round_step(&mut self, now: Instant) {
        let Phase::Rdzv(r) = &mut self.phase else { return };
        r.dirty |= std::mem::take(&mut self.view.dirty);
        if !r.dirty || r.last_look.is_some_and(|l| now < l + VIEW_EVERY) {
            return;
        }
        r.dirty = false;
        r.last_look = Some(now);
        let run = self.meta.run_hash;
        // A replacement node starts at round 0: it adopts the round the waiting survivors
        // are in.
        let round = self
            .view
            .live
            .values()
            .filter(|p| p.run_hash == run && p.state == NodeState::Waiting)
            .map(|p| p.restarts)
            .max()
            .unwrap_or(self.restart);
        if round > self.restart {
            let left = r.deadline.saturating_duration_since(now);
            self.log(Level::Info, format!("joining restart round {round} of the running job"));
            self.begin_round(round, left, now);
            return self.round_step(now);
        }
        let restart = self.restart;
        let running: Vec<(u32, std::net::IpAddr)> = self
            .view
            .others(run)
            .filter(|(_, p)| p.state == NodeState::Running && p.restarts >= restart)
            .map(|(_, p)| (p.restarts, p.addr.ip()))
            .collect();
        if !running.is_empty() && running.len() >= self.cfg.rdzv.min_nodes.max(1) as usize {
            let round = running.iter().map(|r| r.0).max().unwrap_or(restart);
            match &mut self.ran {
                Some((r, addrs)) if *r == round => addrs.extend(running.iter().map(|r| r.1)),
                Some((r, _)) if *r > round => {}
                _ => self.ran = Some((round, running.iter().map(|r| r.1).collect())),
            }
        }
        // Sticky: once a roster of this run ran in this round or a later one, this node
        // never forms one of its own in this round (it may still adopt a later round).
        let blocked = self.ran.as_ref().is_some_and(|(r, _)| *r >= restart);
        let candidates = if blocked { Vec::new() } else { self.view.candidates(run, restart) };
        let Phase::Rdzv(r) = &mut self.phase else { return };
        let said = r.blocked;
        r.blocked = blocked;
        r.rdzv.handle_candidates(candidates, now);
        if blocked && self.cfg.fault_tolerance == FaultTolerance::Node {
            if !said {
                let line = self.ran_words();
                self.log(Level::Info, format!("{line}; asking to join it (--fault-tolerance node)"));
            }
            self.ft_ask_to_join(now);
        } else if blocked && !said {
            let line = self.ran_words();
            self.log(
                Level::Warn,
                format!("{line}; it waits and joins that job's next restart round, if there is one"),
            );
        }
        // A disagreement is named as soon as it is seen, once per node.
        for (id, why) in self.disagreeing() {
            if why.contains("--nnodes") && !self.nnodes_named.contains_key(&id) {
                self.log(
                    Level::Warn,
                    format!("{why}: these nodes cannot form one roster; give every node the same --nnodes"),
                );
                self.nnodes_named.insert(id, why);
            }
        }
        self.drain_rdzv(now);
    }

    pub(super) fn drain_rdzv(&mut self, now: Instant) {
        let Phase::Rdzv(r) = &mut self.phase else { return };
        let mut out = Vec::new();
        while let Some(t) = r.rdzv.poll_transmit() {
            out.push(t);
        }
        let mut committed = None;
        let mut refused = Vec::new();
        while let Some(ev) = r.rdzv.poll_event() {
            match ev {
                RdzvEvent::Committed(roster) => committed = Some(roster),
                RdzvEvent::Refused(why) => refused.push(why),
            }
        }
        for (to, m) in out {
            self.send(to, m);
        }
        for why in refused {
            self.log(Level::Warn, why);
        }
        if let Some(roster) = committed {
            self.on_commit(roster, now);
        }
    }

    fn on_commit(&mut self, roster: Roster, now: Instant) {
        self.master = roster.master().map(|m| m.id);
        if roster.node_rank(self.cfg.id).is_none() {
            return self.finish(Outcome {
                code: 1,
                message: "not part of the agreed roster".into(),
                kind: OutcomeKind::Failed,
            });
        }
        self.events.push_back(Event::RosterAgreed(roster.clone()));
        self.begin_preflight(roster, now);
        let restart = self.restart;
        let held = std::mem::take(&mut self.held);
        for (from, m) in held {
            match round_of(&m) {
                Some(r) if r == restart => self.preflight_message(from, m, now),
                Some(r) if r > restart => self.held.push((from, m)),
                _ => {}
            }
        }
    }

    /// "a job of this run is running on 10.0.0.1, 10.0.0.2: this node does not start a
    /// second one".
    fn ran_words(&self) -> String {
        let Some((_, addrs)) = &self.ran else { return String::new() };
        let shown: Vec<String> = addrs.iter().take(8).map(|a| a.to_string()).collect();
        let more = if addrs.len() > shown.len() {
            format!(" and {} more", addrs.len() - shown.len())
        } else {
            String::new()
        };
        format!(
            "a job of this run is running on {}{more} (started while this node waited): this node does not start a second one",
            shown.join(", ")
        )
    }

    /// Members of this run that answered but cannot join this round, each with why.
    pub(super) fn disagreeing(&self) -> Vec<(NodeId, String)> {
        let mine = nnodes_text(self.cfg.rdzv.min_nodes, self.cfg.rdzv.max_nodes);
        self.view
            .others(self.meta.run_hash)
            .filter_map(|(id, p)| {
                let who = p.addr.ip();
                let theirs = nnodes_text(p.nnodes.0, p.nnodes.1);
                let why = if theirs != mine {
                    format!("{who} was started with --nnodes {theirs}, this node with --nnodes {mine}")
                } else if p.state != NodeState::Waiting {
                    format!("{who} is {} (a job of this run is under way there)", state_word(p.state))
                } else if p.restarts != self.restart {
                    format!("{who} is in restart round {}, this node in {}", p.restarts, self.restart)
                } else {
                    return None;
                };
                Some((*id, why))
            })
            .collect()
    }

    /// The wait as it stands, for a progress line or the timeout message.
    pub(super) fn wait_report(&self) -> WaitReport {
        let Phase::Rdzv(r) = &self.phase else {
            return WaitReport {
                restart: self.restart,
                present: 0,
                min: self.cfg.rdzv.min_nodes,
                max: self.cfg.rdzv.max_nodes,
                settle: self.cfg.rdzv.settle,
                timeout: self.cfg.rdzv_timeout,
                members: Vec::new(),
                disagreeing: Vec::new(),
                gone: Vec::new(),
            };
        };
        let (_, min, max) = r.rdzv.progress();
        let run = self.meta.run_hash;
        let candidates = self.view.candidates(run, self.restart);
        let present = candidates.len();
        let members = candidates
            .iter()
            .map(|c| {
                if c.id == self.cfg.id {
                    format!("{} (this node)", c.addr.ip())
                } else {
                    c.addr.ip().to_string()
                }
            })
            .collect();
        let mut why = self.nnodes_named.clone();
        why.extend(self.disagreeing());
        let ran = self.ran.as_ref().filter(|(r, _)| *r >= self.restart).map(|_| self.ran_words());
        let gone = self
            .view
            .gone
            .values()
            .filter(|(_, h, _)| *h == run)
            .map(|(a, _, dead)| format!("{a} {}", if *dead { "stopped answering" } else { "left" }))
            .collect();
        WaitReport {
            restart: self.restart,
            present,
            min,
            max,
            settle: self.cfg.rdzv.settle,
            timeout: r.timeout,
            members,
            disagreeing: ran.into_iter().chain(why.into_values()).collect(),
            gone,
        }
    }
}

/// The restart round a preflight or abort frame belongs to.
pub(super) fn round_of(m: &Message) -> Option<u32> {
    match m {
        Message::PreflightHello { restart, .. }
        | Message::PreflightReport { restart, .. }
        | Message::Abort { restart, .. } => Some(*restart),
        _ => None,
    }
}
