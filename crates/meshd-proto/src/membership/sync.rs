//! Push-pull anti-entropy: full-table syncs on join, periodically, and towards seeds and
//! dead members (how healed partitions and wrongly declared nodes find each other).

use super::config::{JOIN_RESYNC, JOIN_RESYNCS, MAX_SYNC_BYTES};
use super::{Delivery, Member, MemberState, MemberStatus, Membership, Message};
use crate::id::NodeId;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

impl Membership {
    pub(super) fn send_sync(&mut self, to: SocketAddr, _now: Instant) {
        let members = self.snapshot();
        let msg = Message::SyncRequest { from: self.id, members };
        self.push_transmit(to, msg, Delivery::Reliable);
    }

    /// Our table for a sync: self first, then live members, then Dead/Left, cut before
    /// [`MAX_SYNC_BYTES`].
    pub(super) fn snapshot(&self) -> Vec<MemberState> {
        let mut out = Vec::with_capacity(self.members.len());
        let mut size = 0usize;
        let state = |id: NodeId, m: &Member| MemberState {
            id,
            addr: m.addr,
            meta: m.meta.clone(),
            incarnation: m.incarnation,
            status: m.status,
        };
        out.push(state(self.id, self.own()));
        let others = self.members.iter().filter(|(id, _)| **id != self.id);
        let live = others.clone().filter(|(_, m)| m.status.is_live());
        let gone = others.filter(|(_, m)| !m.status.is_live());
        for (id, m) in live.chain(gone) {
            // id + addr + incarnation + status upper bounds.
            size += m.meta_size + 48;
            if size > MAX_SYNC_BYTES {
                break;
            }
            out.push(state(*id, m));
        }
        out
    }

    /// Push-pull merge. Remote Dead verdicts become suspicions (the member may refute),
    /// third-party Alive states are applied without re-gossip (the sender's own state is
    /// gossiped: that is how a join is announced).
    pub(super) fn merge(&mut self, sender: NodeId, members: Vec<MemberState>, now: Instant) {
        for st in members {
            match st.status {
                MemberStatus::Alive => {
                    let gossip = st.id == sender;
                    self.apply_alive(st.id, st.incarnation, st.addr, st.meta, now, gossip);
                }
                MemberStatus::Suspect => {
                    if !self.members.contains_key(&st.id) {
                        self.apply_alive(st.id, st.incarnation, st.addr, st.meta, now, false);
                    }
                    self.apply_suspect(st.id, st.incarnation, sender, now);
                }
                MemberStatus::Dead => self.apply_suspect(st.id, st.incarnation, sender, now),
                MemberStatus::Left => self.apply_dead(st.id, st.incarnation, st.id, true, now),
            }
        }
    }

    /// A message came from a member we consider Dead: it does not know. Push-pull with it
    /// (rate-limited) so it refutes and we see it alive again.
    pub(super) fn check_sender(&mut self, sender: NodeId, from: SocketAddr, now: Instant) {
        if self.left || sender == self.id || now < self.dead_sender_sync_at {
            return;
        }
        if self.status(sender) == Some(MemberStatus::Dead) {
            self.dead_sender_sync_at = now + self.config.probe_interval;
            self.send_sync(from, now);
        }
    }

    /// Push-pull with a seed (first fast resync) or a random live member.
    pub(super) fn sync_round(&mut self, now: Instant) {
        let target = if self.join_resyncs == 0 && !self.seeds.is_empty() {
            let i = self.rng.below(self.seeds.len());
            Some(self.seeds[i])
        } else {
            self.random_peers(1, None).first().and_then(|id| self.members.get(id)).map(|m| m.addr)
        };
        if let Some(to) = target {
            self.send_sync(to, now);
        }
        let interval = if self.join_resyncs + 1 < JOIN_RESYNCS {
            JOIN_RESYNC * 2u32.pow(self.join_resyncs + 1)
        } else {
            self.scaled_sync_interval()
        };
        self.join_resyncs = self.join_resyncs.saturating_add(1);
        self.next_sync = now + self.jitter(interval);
    }

    /// memberlist's push-pull scaling: one more interval per doubling above 32 members.
    pub(super) fn scaled_sync_interval(&mut self) -> Duration {
        let n = self.cluster_size() as f64;
        let mult = if n <= 32.0 { 1.0 } else { (n.log2() - 5.0).ceil() + 1.0 };
        self.config.sync_interval.mul_f64(mult)
    }

    /// Push-pull with a seed or a retained Dead member whose address is not that of a live
    /// member: heals partitions and brings back nodes wrongly declared dead. Runs every
    /// `sync_interval`, or every second while we know no live peer.
    pub(super) fn rejoin_round(&mut self, now: Instant) {
        let alone = self.live_peers().is_empty();
        let live_addrs: BTreeSet<SocketAddr> =
            self.members.values().filter(|m| m.status.is_live()).map(|m| m.addr).collect();
        let own = self.own().addr;
        let mut candidates: Vec<SocketAddr> =
            self.seeds.iter().copied().filter(|a| !live_addrs.contains(a)).collect();
        if !alone || candidates.is_empty() {
            candidates.extend(
                self.members
                    .values()
                    .filter(|m| m.status == MemberStatus::Dead && !live_addrs.contains(&m.addr))
                    .map(|m| m.addr),
            );
        }
        candidates.retain(|a| *a != own);
        candidates.sort();
        candidates.dedup();
        if !candidates.is_empty() {
            let i = self.rng.below(candidates.len());
            self.send_sync(candidates[i], now);
        }
        let interval = if alone {
            self.config.sync_interval.min(Duration::from_secs(1))
        } else {
            self.config.sync_interval
        };
        self.next_rejoin = now + self.jitter(interval);
    }
}
