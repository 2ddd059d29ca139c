//! The preflight's exchanges after a commit: every node binds a TCP listener (the IO does,
//! [`Event::StartPreflight`]), says its port ([`Message::PreflightHello`]; the master adds
//! the round's NCCL id), dials its targets once it knows their ports ([`Event::Dial`]),
//! broadcasts what it found ([`Message::PreflightReport`]) and computes the verdict from
//! every report, the same on every node. A member that stops or aborts meanwhile stops
//! the launch everywhere.

use super::lifecycle::{Closing, Running};
use super::{DialTarget, Event, Input, Node, Outcome, OutcomeKind, Phase};
use crate::id::NodeId;
use crate::membership::MemberEvent;
use crate::meta::NodeState;
use crate::preflight::{self, Collective, NodeReport, TcpProbe, TcpTarget};
use crate::rendezvous::{Message, Roster};
use std::collections::BTreeMap;
use std::time::Instant;

#[derive(Debug, PartialEq, Eq)]
enum Stage {
    /// Waiting for the IO's listener.
    Binding,
    /// Waiting for every member's port.
    Ports,
    /// Waiting for the IO's dial results.
    Dialing,
    /// Waiting for every member's report.
    Reports,
}

pub(super) struct Preflight {
    pub roster: Roster,
    master: bool,
    deadline: Instant,
    stage: Stage,
    ports: BTreeMap<NodeId, u16>,
    reports: BTreeMap<NodeId, NodeReport>,
    nccl_id: Option<Vec<u8>>,
    nccl_note: Option<String>,
    problems: Vec<TcpProbe>,
}

impl Preflight {
    pub fn poll_timeout(&self) -> Option<Instant> {
        // Binding and dialing wait for the IO, whose own limits end them.
        matches!(self.stage, Stage::Ports | Stage::Reports).then_some(self.deadline)
    }
}

impl Node {
    pub(super) fn begin_preflight(&mut self, roster: Roster, now: Instant) {
        let master = roster.master().map(|m| m.id) == Some(self.cfg.id);
        self.events.push_back(Event::StartPreflight { roster: roster.clone(), master });
        self.phase = Phase::Preflight(Box::new(Preflight {
            roster,
            master,
            deadline: now + self.cfg.preflight_timeout,
            stage: Stage::Binding,
            ports: BTreeMap::new(),
            reports: BTreeMap::new(),
            nccl_id: None,
            nccl_note: None,
            problems: Vec::new(),
        }));
    }

    pub(super) fn preflight_message(&mut self, from: NodeId, msg: Message, now: Instant) {
        let Phase::Preflight(p) = &mut self.phase else { return };
        let member = p.roster.node_rank(from).is_some();
        let restart = self.restart;
        match msg {
            Message::PreflightHello { restart: r, tcp_port, nccl_id } if r == restart && member => {
                p.ports.insert(from, tcp_port);
                if p.roster.master().map(|m| m.id) == Some(from)
                    && nccl_id.as_ref().is_some_and(|b| b.len() == 128)
                {
                    p.nccl_id = nccl_id;
                }
                self.preflight_progress(now);
            }
            Message::PreflightReport { restart: r, report } if r == restart && member => {
                p.reports.insert(from, report);
                self.preflight_progress(now);
            }
            // Only the roster of this round may stop it: a straggler of an earlier job with
            // the same run id (an earlier srun step) must not.
            Message::Abort { restart: r, reason, .. } if r == restart && member => {
                self.preflight_stopped(reason, now)
            }
            m @ Message::Propose(_) => self.keep_early(from, m),
            _ => {}
        }
    }

    pub(super) fn preflight_member(&mut self, ev: MemberEvent, now: Instant) {
        let Phase::Preflight(p) = &self.phase else { return };
        if let MemberEvent::Down(id) | MemberEvent::Left(id) = ev {
            if let Some(m) = p.roster.members.iter().find(|m| m.id == id) {
                let reason = format!("node {} stopped answering during the preflight", m.addr.ip());
                self.preflight_stopped(reason, now);
            }
        }
    }

    pub(super) fn preflight_io(&mut self, input: Input, now: Instant) {
        let Phase::Preflight(p) = &mut self.phase else { return };
        match input {
            Input::PreflightReady { tcp_port, nccl_id, nccl_note, problems, .. }
                if p.stage == Stage::Binding =>
            {
                if p.master {
                    p.nccl_id = nccl_id.filter(|b| b.len() == 128);
                    p.nccl_note = nccl_note;
                }
                p.problems = problems;
                p.stage = Stage::Ports;
                let hello = Message::PreflightHello {
                    restart: self.restart,
                    tcp_port,
                    nccl_id: if p.master { p.nccl_id.clone() } else { None },
                };
                let roster = p.roster.clone();
                self.broadcast(&roster, &hello);
                self.preflight_progress(now);
            }
            Input::PreflightFailed { why, .. } => {
                let roster = p.roster.clone();
                self.start_abort(&roster, None, why.clone(), None, now);
                self.close(Closing::after_abort(
                    Outcome { code: 1, message: why, kind: OutcomeKind::Failed },
                    now,
                    &self.cfg.timing,
                ));
            }
            Input::Dialed { probes, nccl_root, .. } if p.stage == Stage::Dialing => {
                let mut tcp = probes;
                tcp.append(&mut p.problems);
                let f = &self.cfg.report;
                let mine = NodeReport {
                    tcp,
                    cmd_hash: f.cmd_hash,
                    cmd: f.cmd.clone(),
                    nproc: f.nproc,
                    gpus: f.gpus,
                    cuda_driver: f.cuda_driver,
                    nccl_version: f.nccl_version,
                    mtu: f.mtu,
                    iface: f.iface.clone(),
                    // The report's words: empty when there is nothing to say.
                    nccl_root: nccl_root.filter(|_| p.master).unwrap_or_default(),
                    nccl_note: p.nccl_note.clone().filter(|_| p.master).unwrap_or_default(),
                };
                p.reports.insert(self.cfg.id, mine.clone());
                p.stage = Stage::Reports;
                let roster = p.roster.clone();
                self.broadcast(&roster, &Message::PreflightReport { restart: self.restart, report: mine });
                self.preflight_progress(now);
            }
            Input::Stop { what, code } => {
                // Tell the others, so that none of them launches without this node.
                let here = Self::describe(&p.roster, self.cfg.id);
                let reason = format!("{what} on {here} during the preflight");
                let roster = p.roster.clone();
                self.start_abort(&roster, None, reason.clone(), None, now);
                self.close(Closing::after_abort(
                    Outcome { code, message: reason, kind: OutcomeKind::Stopped },
                    now,
                    &self.cfg.timing,
                ));
            }
            Input::Abort(reason) => self.preflight_stopped(reason, now),
            _ => {}
        }
    }

    pub(super) fn preflight_timeout(&mut self, now: Instant) {
        let Phase::Preflight(p) = &self.phase else { return };
        if now >= p.deadline {
            self.preflight_progress(now);
        }
    }

    /// A member stopped or aborted: this node stops too and tells the others, so that none
    /// launches without it (never restarted: the preflight found the mesh broken).
    fn preflight_stopped(&mut self, reason: String, now: Instant) {
        let Phase::Preflight(p) = &self.phase else { return };
        let roster = p.roster.clone();
        self.start_abort(&roster, None, reason.clone(), None, now);
        self.close(Closing::after_abort(
            Outcome {
                code: 1,
                message: format!("job stopped before launch: {reason}"),
                kind: OutcomeKind::Failed,
            },
            now,
            &self.cfg.timing,
        ));
    }

    /// Moves to the next stage once this one has what it waits for (or its time is up).
    fn preflight_progress(&mut self, now: Instant) {
        let Phase::Preflight(p) = &mut self.phase else { return };
        let late = now >= p.deadline;
        let others = p.roster.members.len() - 1;
        if p.stage == Stage::Ports && (p.ports.len() >= others || late) {
            p.stage = Stage::Dialing;
            let targets = dial_plan(&p.roster, self.cfg.id, &p.ports, self.cfg.timing.dial_all_up_to);
            let nccl_id = p.nccl_id.clone();
            self.events.push_back(Event::Dial { round: self.restart, targets, nccl_id });
            return;
        }
        if p.stage == Stage::Reports && (p.reports.len() >= p.roster.members.len() || late) {
            let verdict =
                preflight::evaluate(&p.roster, &p.reports, self.cfg.report.forced, self.cfg.report.tunnel);
            let roster = p.roster.clone();
            let nccl_id = p.nccl_id.clone();
            self.events.push_back(Event::Preflight(verdict.clone()));
            if verdict.ok {
                self.store_open(&roster, now);
                self.events.push_back(Event::Launch {
                    roster: roster.clone(),
                    verdict: verdict.clone(),
                    nccl_id,
                });
                self.phase = Phase::Running(Box::new(Running::new(roster, verdict)));
                return;
            }
            let failed: Vec<String> = verdict
                .checks
                .iter()
                .filter(|c| !c.ok && c.fatal)
                .map(|c| format!("{} {}", c.kind, c.detail))
                .collect();
            let why = if failed.is_empty() && self.cfg.report.forced == Some(Collective::Nccl) {
                "--collective nccl was forced but TCP between the nodes fails".to_string()
            } else {
                failed.join("; ")
            };
            self.set_state(NodeState::Failed, now);
            let outcome = Outcome {
                code: 1,
                message: format!("launch refused by the preflight: {why}"),
                kind: OutcomeKind::Failed,
            };
            let done = super::Message::Done { restart: self.restart };
            self.broadcast(&roster, &done);
            self.close(Closing::exchange_done(outcome, roster, self.cfg.id, now, &self.cfg.timing));
        }
    }
}

/// Whom this node dials: every other member's port (small rosters) or a skip ring over the
/// node ranks (distances 1, 2, 4, ...), and the master's MASTER_PORT. Members whose port
/// never came are skipped (the verdict names their missing report).
fn dial_plan(
    roster: &Roster,
    me: NodeId,
    ports: &BTreeMap<NodeId, u16>,
    all_up_to: usize,
) -> Vec<DialTarget> {
    let n = roster.members.len();
    let Some(rank) = roster.node_rank(me) else { return Vec::new() };
    let mut ranks: Vec<usize> = if n <= all_up_to {
        (0..n).filter(|r| *r != rank).collect()
    } else {
        let mut v = Vec::new();
        let mut d = 1;
        while d < n {
            v.push((rank + d) % n);
            d *= 2;
        }
        v
    };
    ranks.sort_unstable();
    ranks.dedup();
    let mut targets = Vec::new();
    for r in ranks {
        let m = &roster.members[r];
        if let Some(p) = ports.get(&m.id) {
            targets.push(DialTarget {
                to: m.id,
                addr: std::net::SocketAddr::new(m.addr.ip(), *p),
                what: TcpTarget::EphemeralPort,
            });
        }
    }
    if let Some(master) = roster.master().filter(|m| m.id != me) {
        targets.push(DialTarget {
            to: master.id,
            addr: std::net::SocketAddr::new(master.addr.ip(), roster.master_port),
            what: TcpTarget::MasterPort,
        });
    }
    targets
}
