//! Lifeguard suspicion: a missed probe makes a member Suspect; the timeout shrinks with
//! independent confirmations; a suspected node refutes by raising its incarnation.

use super::config::MAX_CONFIRMATIONS;
use super::{MemberEvent, MemberStatus, Membership, Update, UpdateKind};
use crate::id::NodeId;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub(super) struct Suspicion {
    pub(super) start: Instant,
    pub(super) min: Duration,
    pub(super) max: Duration,
    /// Confirmations that bring the timeout to `min`.
    pub(super) k: usize,
    /// The first accuser and the confirmers after it.
    pub(super) accusers: BTreeSet<NodeId>,
}

impl Suspicion {
    pub(super) fn deadline(&self) -> Instant {
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
    pub(super) fn confirm(&mut self, accuser: NodeId) -> bool {
        if self.accusers.len() > self.k {
            return false;
        }
        self.accusers.insert(accuser)
    }
}

impl Membership {
    pub(super) fn apply_suspect(&mut self, id: NodeId, inc: u64, accuser: NodeId, now: Instant) {
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

    pub(super) fn new_suspicion(&mut self, accuser: NodeId, now: Instant) -> Suspicion {
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

    pub(super) fn apply_dead(&mut self, id: NodeId, inc: u64, accuser: NodeId, left: bool, now: Instant) {
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

    /// Someone says we are suspect/dead/left (or alive at a newer incarnation): take an
    /// incarnation above theirs and say we are alive.
    pub(super) fn refute(&mut self, claimed: u64, now: Instant) {
        let id = self.id;
        if let Some(me) = self.members.get_mut(&id) {
            me.incarnation = me.incarnation.max(claimed).saturating_add(1);
        }
        self.announce_self(now);
    }

    /// Declares dead the suspects whose timeout passed, unless their link showed traffic
    /// since the suspicion started.
    pub(super) fn expire_suspicions(&mut self, now: Instant) {
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
    }
}
