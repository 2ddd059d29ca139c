//! The transmit-limited queue of membership updates to disseminate (memberlist's
//! `TransmitLimitedQueue`).
//!
//! At most one update per member is queued: a newer one replaces the older (it carries
//! everything the older said, by the incarnation rules). Packets take the least-sent
//! updates first, newest first among equals, and every update is dropped after it went
//! out `limit` times (about lambda * log N, computed by the caller).

use super::Update;
use crate::codec as wire;
use crate::id::NodeId;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

/// Stop filling a packet once less than this many bytes remain (no update is smaller).
const MIN_UPDATE: usize = 20;
/// Entries examined per packet, so one packet never costs O(queue).
const MAX_SCAN: usize = 256;

#[derive(Debug)]
struct Entry {
    update: Update,
    size: usize,
    transmits: u32,
    order: u64,
}

/// Updates waiting to be piggybacked, keyed by the member they are about.
#[derive(Debug, Default)]
pub(super) struct BroadcastQueue {
    entries: BTreeMap<NodeId, Entry>,
    /// (transmits, newest first, id): the order in which packets take updates.
    index: BTreeSet<(u32, Reverse<u64>, NodeId)>,
    next_order: u64,
}

impl BroadcastQueue {
    /// Queues `update`, replacing any queued update about the same member.
    pub(super) fn push(&mut self, update: Update) {
        let id = update.id;
        if let Some(old) = self.entries.remove(&id) {
            self.index.remove(&(old.transmits, Reverse(old.order), id));
        }
        let size = wire::encode(&update).len();
        let order = self.next_order;
        self.next_order += 1;
        self.index.insert((0, Reverse(order), id));
        self.entries.insert(id, Entry { update, size, transmits: 0, order });
    }

    /// Number of queued updates.
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is queued.
    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Takes updates whose encodings fit in `budget` bytes (a fresh packet's room), counting
    /// one transmission for each and retiring those sent `limit` times. Updates that could
    /// never fit a packet on their own are dropped (full-state sync carries them).
    pub(super) fn take(&mut self, budget: usize, limit: u32) -> Vec<Update> {
        let mut taken = Vec::new();
        let mut oversize = Vec::new();
        let mut remaining = budget;
        for key in self.index.iter().take(MAX_SCAN) {
            if remaining < MIN_UPDATE {
                break;
            }
            let Some(e) = self.entries.get(&key.2) else {
                continue;
            };
            if e.size > budget {
                oversize.push(*key);
            } else if e.size <= remaining {
                remaining -= e.size;
                taken.push(*key);
            }
        }
        for key in oversize {
            self.index.remove(&key);
            self.entries.remove(&key.2);
        }
        let mut out = Vec::with_capacity(taken.len());
        for key in taken {
            self.index.remove(&key);
            let id = key.2;
            let Some(e) = self.entries.get_mut(&id) else {
                continue;
            };
            e.transmits += 1;
            if e.transmits >= limit {
                if let Some(e) = self.entries.remove(&id) {
                    out.push(e.update);
                }
            } else {
                self.index.insert((e.transmits, Reverse(e.order), id));
                out.push(e.update.clone());
            }
        }
        out
    }
}
