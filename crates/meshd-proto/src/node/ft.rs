//! `--fault-tolerance node`: each node is one replica group (torchft's sense), and a
//! failure stops no more than the group it happened in.
//!
//! - A local rank fails: this node's ranks stop and start again (its own `--max-restarts`);
//!   nothing is sent to the others, whose ranks keep running. With no restarts left the
//!   node's group leaves the job (the node exits with the rank's status).
//! - A member is declared dead or leaves: it is dropped from the job (its Done is no longer
//!   waited for). Only when fewer than MIN groups remain does the job stop everywhere, as a
//!   whole-job failure does, with no restart round.
//! - SIGINT/SIGTERM on one node: that node's group leaves; the others go on.
//! - A node started after the launch with the same command finds the job running (the
//!   running-job block) and asks to be admitted ([`Message::FtJoin`], every
//!   [`JOIN_EVERY`]). The decider — the first live member in roster order — gives it the
//!   slot of a lost member (so a replacement gets the lost node's REPLICA_GROUP_ID) or a new
//!   one up to MAX, and sends the new roster, with a higher epoch, to every member and the
//!   joiner ([`Message::FtRoster`]). The joiner launches at once with the job's collective:
//!   its preflight was the job's.

use super::lifecycle::{Closing, Running};
use super::{Event, Level, Node, Outcome, OutcomeKind, Phase};
use crate::id::NodeId;
use crate::membership::MemberEvent;
use crate::meta::NodeState;
use crate::preflight::{Collective, Verdict};
use crate::rendezvous::{Message, RankFailure, Roster};
use crate::roster::RosterMember;
use std::time::{Duration, Instant};

/// How often a node that found the job running asks to be admitted.
pub(super) const JOIN_EVERY: Duration = Duration::from_millis(500);

/// The fault-tolerance state of a launched round.
#[derive(Debug, Default)]
pub(super) struct FtRunning {
    /// Restarts of this node's ranks so far.
    pub restarts: u32,
    /// The ranks are stopping after a local failure.
    stopping: Option<LocalFailure>,
}

#[derive(Debug)]
struct LocalFailure {
    reason: String,
    cause: Option<Box<RankFailure>>,
    /// The ranks start again once stopped (else the group leaves the job).
    again: bool,
}

impl Node {
    /// A local rank failed (or the ranks could not start): this node's ranks only.
    pub(super) fn ft_rank_failed(
        &mut self,
        _rank: Option<u32>,
        reason: String,
        cause: Option<Box<RankFailure>>,
        now: Instant,
    ) {
        let max = self.cfg.max_restarts;
        let Phase::Running(r) = &mut self.phase else { return };
        if r.ft.stopping.is_some() || r.local_done {
            return;
        }
        let again = r.ft.restarts < max;
        let line = if again {
            format!(
                "{reason}; restarting this node's ranks only (restart {} of {max}, --max-restarts); the other \
                 nodes' ranks keep running",
                r.ft.restarts + 1
            )
        } else {
            format!(
                "{reason}; no restarts left on this node (--max-restarts {max}): its replica group leaves the job, \
                 the other nodes' ranks keep running"
            )
        };
        r.ft.stopping = Some(LocalFailure { reason, cause, again });
        let spawned = std::mem::take(&mut r.spawned);
        self.log(if again { Level::Warn } else { Level::Error }, line);
        self.lh_local_gone(now);
        if spawned {
            self.events.push_back(Event::StopRanks);
        } else {
            self.ft_ranks_stopped(now);
        }
    }

    /// This node's ranks are stopped after a local failure: start them again, or leave.
    pub(super) fn ft_ranks_stopped(&mut self, now: Instant) {
        let Phase::Running(r) = &mut self.phase else { return };
        let Some(f) = r.ft.stopping.take() else { return };
        self.events.push_back(Event::RoundFailed {
            restart: self.restart,
            reason: f.reason.clone(),
            cause: f.cause.clone(),
            restarting: f.again,
        });
        if f.again {
            r.ft.restarts += 1;
            let (roster, verdict) = (r.roster.clone(), r.verdict.clone());
            self.events.push_back(Event::Launch { roster, verdict, nccl_id: None });
            return;
        }
        self.set_state(NodeState::Failed, now);
        let code = f.cause.map_or(1, |c| c.status);
        let outcome = Outcome {
            code,
            message: format!("this node's replica group left the job: {}", f.reason),
            kind: OutcomeKind::Failed,
        };
        self.close(Closing::after_abort(outcome, now, &self.cfg.timing));
    }

    /// A member died or left: drop its group, or stop the job when too few remain.
    pub(super) fn ft_member(&mut self, ev: MemberEvent, now: Instant) {
        let (id, how) = match ev {
            MemberEvent::Left(id) => (id, "left the mesh"),
            MemberEvent::Down(id) => (id, "stopped answering (declared dead by the mesh)"),
            MemberEvent::Up(v) | MemberEvent::Updated(v) => {
                // A joiner admitted by the decider (FtRoster) that this node's view had
                // not seen alive yet: it is a member from now on (it may be the decider).
                if let Phase::Running(r) = &mut self.phase {
                    if r.roster.node_rank(v.id).is_some()
                        && !r.everyone.contains(&v.id)
                        && !r.done.contains(&v.id)
                    {
                        r.everyone.insert(v.id);
                    }
                }
                return;
            }
            _ => return,
        };
        let min = self.cfg.rdzv.min_nodes.max(1) as usize;
        self.lh_member_gone(id, now);
        let Phase::Running(r) = &mut self.phase else { return };
        let was_done = r.done.remove(&id);
        if !r.everyone.remove(&id) {
            return;
        }
        let who = Self::describe(&r.roster, id);
        let group = r.roster.node_rank(id).unwrap_or_default();
        let left = r.everyone.len();
        if was_done {
            self.log(Level::Info, format!("{who} (replica group {group}) finished and left"));
        } else if left < min {
            let reason = format!("{who} {how}: {left} of at least {min} replica groups remain (--nnodes)");
            self.log(Level::Error, format!("{reason}; stopping the job on every node"));
            return self.running_fails(None, reason, None, now);
        } else {
            if let Some(m) = r.roster.members.iter().find(|m| m.id == id) {
                let addr = m.addr;
                let me = self.cfg.id;
                let peers: Vec<_> = r
                    .roster
                    .members
                    .iter()
                    .filter(|m| m.id != me && m.id != id && r.everyone.contains(&m.id))
                    .map(|m| m.addr.ip())
                    .collect();
                let abort = self.lh.last.as_ref().and_then(|q| {
                    let endpoints: Vec<_> = q.participants.iter().flat_map(|p| p.endpoints()).collect();
                    let with_lost =
                        endpoints.iter().any(|e| e.ip().to_canonical() == addr.ip().to_canonical());
                    with_lost.then_some(super::AbortGroup { peers, keep: endpoints })
                });
                let who = format!("{who}, replica group {group}");
                self.events.push_back(Event::GroupLost { addr, who, abort });
            }
            self.log(
                Level::Warn,
                format!(
                    "{who} (replica group {group}) {how}: dropped from the job; {}",
                    match left {
                        1 => "1 replica group goes on".to_string(),
                        n => format!("{n} replica groups go on"),
                    }
                ),
            );
        }
        self.running_check(now);
    }

    /// The first live member in roster order decides admissions (and the lighthouse).
    pub(super) fn ft_decider(r: &Running) -> Option<NodeId> {
        r.roster.members.iter().map(|m| m.id).find(|id| r.everyone.contains(id))
    }

    /// Admission traffic while the job runs here.
    pub(super) fn ft_message(&mut self, from: NodeId, msg: Message, now: Instant) {
        let _ = now;
        let max = self.cfg.rdzv.max_nodes.max(1) as usize;
        let me = self.cfg.id;
        let Phase::Running(r) = &mut self.phase else { return };
        match msg {
            Message::FtJoin { member } if member.id == from && Self::ft_decider(r) == Some(me) => {
                if r.roster.node_rank(from).is_none() {
                    let mut roster = r.roster.clone();
                    let free = roster.members.iter().position(|m| m.id != me && !r.everyone.contains(&m.id));
                    let slot = match free {
                        Some(i) => {
                            roster.members[i] = member;
                            i
                        }
                        None if roster.members.len() < max => {
                            roster.members.push(member);
                            roster.members.len() - 1
                        }
                        None => return,
                    };
                    roster.epoch += 1;
                    r.everyone.insert(from);
                    r.roster = roster;
                    let who = Self::describe(&r.roster, from);
                    self.events.push_back(Event::RosterChanged(r.roster.clone()));
                    self.log(Level::Info, format!("{who} joins the running job as replica group {slot}"));
                }
                let Phase::Running(r) = &self.phase else { return };
                let msg = Message::FtRoster { roster: r.roster.clone(), collective: r.verdict.collective };
                let roster = r.roster.clone();
                self.broadcast(&roster, &msg);
            }
            Message::FtRoster { roster, .. }
                if roster.run_hash == r.roster.run_hash
                    && roster.restart == r.roster.restart
                    && roster.epoch > r.roster.epoch
                    && r.everyone.contains(&from)
                    && roster.node_rank(me).is_some() =>
            {
                for m in roster.members.iter().filter(|m| r.roster.node_rank(m.id).is_none()) {
                    if self.view.is_live(m.id) {
                        r.everyone.insert(m.id);
                    }
                }
                r.everyone.retain(|id| roster.node_rank(*id).is_some());
                r.roster = roster.clone();
                self.events.push_back(Event::RosterChanged(roster));
            }
            _ => {}
        }
    }

    /// While blocked by the running job: the admission request (every [`JOIN_EVERY`]).
    pub(super) fn ft_ask_to_join(&mut self, now: Instant) {
        let Phase::Rdzv(r) = &mut self.phase else { return };
        if r.ft_join_next.is_some_and(|t| now < t) {
            return;
        }
        r.ft_join_next = Some(now + JOIN_EVERY);
        let run = self.meta.run_hash;
        let member = RosterMember {
            id: self.cfg.id,
            addr: self.cfg.addr,
            nproc: self.meta.nproc,
            hostname: self.meta.hostname.clone(),
        };
        let to: Vec<_> = self
            .view
            .others(run)
            .filter(|(_, p)| p.state == NodeState::Running || p.state == NodeState::Done)
            .map(|(_, p)| p.addr)
            .collect();
        for addr in to {
            self.send(addr, Message::FtJoin { member: member.clone() });
        }
    }

    /// The decider admitted this waiting node: launch with the job's collective.
    pub(super) fn ft_admitted(&mut self, from: NodeId, roster: Roster, collective: Collective, now: Instant) {
        let Some(slot) = roster.node_rank(self.cfg.id) else { return };
        if roster.run_hash != self.meta.run_hash || roster.node_rank(from).is_none() {
            return;
        }
        self.restart = roster.restart;
        self.master = Some(from);
        self.log(
            Level::Info,
            format!("admitted to the running job as replica group {slot} of {}", roster.members.len()),
        );
        self.events.push_back(Event::RosterAgreed(roster.clone()));
        let verdict = Verdict {
            ok: true,
            collective,
            checks: Vec::new(),
            tcp_blocked: Vec::new(),
            nccl_id: false,
            nodes: roster.members.len(),
        };
        self.store_open(&roster, now);
        self.events.push_back(Event::Launch {
            roster: roster.clone(),
            verdict: verdict.clone(),
            nccl_id: None,
        });
        let mut run = Running::new(roster, verdict);
        let me = self.cfg.id;
        run.everyone.retain(|id| *id == me || self.view.is_live(*id));
        self.phase = Phase::Running(Box::new(run));
    }
}
