//! The failure detector's probes: one direct ping per period, round-robin over a shuffled
//! order, then indirect pings through other members when the direct one times out.

use super::config::MAX_MEMBERS;
use super::{MemberStatus, Membership, Message, Update, UpdateKind};
use crate::id::NodeId;
use std::net::SocketAddr;
use std::time::Instant;

#[derive(Debug)]
pub(super) struct Probe {
    pub(super) target: NodeId,
    pub(super) seq: u32,
    pub(super) sent: Instant,
    pub(super) indirect_at: Instant,
    pub(super) indirect_sent: bool,
    pub(super) acked: bool,
}

#[derive(Debug)]
pub(super) struct Relay {
    pub(super) origin: SocketAddr,
    pub(super) origin_seq: u32,
    pub(super) target: NodeId,
    pub(super) expires: Instant,
}

impl Membership {
    pub(super) fn heard_since(&self, id: NodeId, since: Instant) -> bool {
        self.members.get(&id).and_then(|m| m.heard).is_some_and(|h| h > since)
    }

    pub(super) fn handle_ack(&mut self, sender: NodeId, seq: u32, now: Instant) {
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

    pub(super) fn add_to_probe_order(&mut self, id: NodeId) {
        if self.probe_order.len() >= MAX_MEMBERS {
            return;
        }
        let lo = self.probe_index.min(self.probe_order.len());
        let pos = lo + self.rng.below(self.probe_order.len() - lo + 1);
        self.probe_order.insert(pos, id);
    }

    pub(super) fn next_probe_target(&mut self) -> Option<NodeId> {
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

    pub(super) fn probe_tick(&mut self, now: Instant) {
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

    pub(super) fn send_indirect(&mut self, _now: Instant) {
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

    /// The current probe went unanswered for `probe_timeout`: ask others to ping the target,
    /// unless its link showed traffic since the ping (then it counts as answered).
    pub(super) fn check_probe(&mut self, now: Instant) {
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
    }
}
