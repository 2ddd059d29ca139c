//! Dissemination: piggybacking queued updates on every datagram, push gossip, and applying
//! the updates others send (with direct corrections to a sender that is behind).

use super::config::{DATAGRAM_SLACK, MAX_CORRECTIONS, RETRANSMIT_MULT};
use super::{Delivery, MemberStatus, Membership, Message, Update, UpdateKind};
use crate::codec as wire;
use crate::id::NodeId;
use std::net::SocketAddr;
use std::time::Instant;

impl Membership {
    pub(super) fn retransmit_limit(&mut self) -> u32 {
        let n = self.cluster_size() as f64;
        RETRANSMIT_MULT * ((n + 1.0).log10().ceil().max(1.0) as u32)
    }

    /// Sends `msg` as a datagram, filling the rest of its update list with queued
    /// broadcasts.
    pub(super) fn send_datagram(&mut self, to: SocketAddr, mut msg: Message) {
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

    /// Sends `updates` (as many as fit) in one gossip datagram.
    pub(super) fn send_updates(&mut self, to: SocketAddr, updates: Vec<Update>) {
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

    pub(super) fn announce_self(&mut self, _now: Instant) {
        let me = self.own();
        let update = Update {
            id: self.id,
            incarnation: me.incarnation,
            kind: UpdateKind::Alive { addr: me.addr, meta: me.meta.clone() },
        };
        self.broadcasts.push(update);
    }

    /// Applies piggybacked updates. Updates older than what we know mean the sender missed
    /// something (typically a refutation whose rumor died out before reaching it): it gets
    /// our newer state back directly, so a stale suspicion cannot outlive its refutation.
    pub(super) fn apply_updates(&mut self, from: SocketAddr, updates: Vec<Update>, now: Instant) {
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
    pub(super) fn correction(&self, id: NodeId, incarnation: u64) -> Option<Update> {
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

    pub(super) fn gossip_round(&mut self, _now: Instant) {
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
}
