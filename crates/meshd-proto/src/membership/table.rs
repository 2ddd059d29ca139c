//! The member table's Alive transitions, eviction when full, and expiry of Dead/Left
//! entries.

use super::config::{MAX_MEMBERS, MAX_META};
use super::{Member, MemberEvent, MemberStatus, Membership, Update, UpdateKind, view};
use crate::codec as wire;
use crate::id::NodeId;
use crate::meta::NodeMeta;
use std::net::SocketAddr;
use std::time::Instant;

impl Membership {
    pub(super) fn apply_alive(
        &mut self,
        id: NodeId,
        inc: u64,
        addr: SocketAddr,
        meta: NodeMeta,
        now: Instant,
        rebroadcast: bool,
    ) {
        if id == self.id {
            if !self.left && inc > self.own().incarnation {
                self.refute(inc, now);
            }
            return;
        }
        let prev = match self.members.get(&id) {
            Some(m) if inc <= m.incarnation => return,
            Some(m) => Some((m.status, m.addr != addr || m.meta != meta)),
            None => None,
        };
        let meta_size = wire::encode(&meta).len();
        if meta_size > MAX_META {
            return;
        }
        if prev.is_none() && !self.make_room() {
            return;
        }
        if rebroadcast {
            self.broadcasts.push(Update {
                id,
                incarnation: inc,
                kind: UpdateKind::Alive { addr, meta: meta.clone() },
            });
        }
        match prev {
            None => {
                self.members.insert(
                    id,
                    Member {
                        addr,
                        meta,
                        meta_size,
                        incarnation: inc,
                        status: MemberStatus::Alive,
                        since: now,
                        srtt: None,
                        heard: None,
                    },
                );
                self.live_dirty = true;
                self.add_to_probe_order(id);
                self.emit_view(id, true);
            }
            Some((status, changed)) => {
                if let Some(m) = self.members.get_mut(&id) {
                    m.addr = addr;
                    m.meta = meta;
                    m.meta_size = meta_size;
                    m.incarnation = inc;
                    if m.status != MemberStatus::Alive {
                        m.status = MemberStatus::Alive;
                        m.since = now;
                    }
                }
                match status {
                    MemberStatus::Dead | MemberStatus::Left => {
                        self.live_dirty = true;
                        self.add_to_probe_order(id);
                        self.emit_view(id, true);
                    }
                    MemberStatus::Suspect => {
                        self.suspicions.remove(&id);
                        self.emit_view(id, false);
                    }
                    MemberStatus::Alive if changed => self.emit_view(id, false),
                    MemberStatus::Alive => {}
                }
            }
        }
    }

    pub(super) fn emit_view(&mut self, id: NodeId, up: bool) {
        if let Some(v) = self.members.get(&id).map(|m| view(id, m)) {
            self.emit(if up { MemberEvent::Up(v) } else { MemberEvent::Updated(v) });
        }
    }

    /// Makes room for one more member: true if there is (after evicting the Dead/Left
    /// member gone the longest, if the table is full).
    pub(super) fn make_room(&mut self) -> bool {
        if self.members.len() < MAX_MEMBERS {
            return true;
        }
        // O(1) refusal when nothing is evictable, so a flood of new ids against a full
        // table of live members costs nothing per id.
        if self.live_peers().len() + 1 >= self.members.len() {
            return false;
        }
        let own = self.id;
        let victim = self
            .members
            .iter()
            .filter(|(id, m)| **id != own && !m.status.is_live())
            .min_by_key(|(_, m)| m.since)
            .map(|(id, _)| *id);
        match victim {
            Some(id) => {
                self.members.remove(&id);
                self.suspicions.remove(&id);
                true
            }
            None => false,
        }
    }

    pub(super) fn reap(&mut self, now: Instant) {
        let retention = self.config.dead_retention;
        let id = self.id;
        self.members.retain(|m_id, m| {
            *m_id == id || m.status.is_live() || now.saturating_duration_since(m.since) < retention
        });
        self.relays.retain(|_, r| r.expires > now);
    }
}
