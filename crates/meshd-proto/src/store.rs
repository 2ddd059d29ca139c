//! The job-wide key-value store: versioned, acknowledged, bounded.
//!
//! Every node holds a full copy. A [`Store::set`] applies the value locally, sends it to
//! every other live roster member, and completes ([`StoreEvent::SetDone`]) once each of
//! them acknowledged it or was reported gone ([`Store::member_gone`]). Unacknowledged
//! copies are resent with a bounded backoff until a deadline, after which the set fails
//! naming the members that never answered ([`StoreEvent::SetFailed`]).
//!
//! Convergence: each set carries a [`Version`], a Lamport counter (bumped past every
//! version this node has seen, so a set made after seeing a value always beats it) and the
//! writer's [`NodeId`] as the tie-break. A node keeps, per key, the value of the highest
//! version it received, whatever the arrival order, so concurrent sets of one key end with
//! the same value on every node that received both. Duplicates and stale copies are
//! acknowledged and otherwise ignored, which makes resending safe.
//!
//! When a set completes, every live member holds its version *or a newer one* (a
//! concurrent set of the same key may win; that is the point of versions).
//!
//! A version is tied to its sender: a copy whose writer is not the node it came from is
//! dropped, and one whose counter jumps more than [`MAX_COUNTER_STEP`] past this node's
//! clock is refused, so no peer can make its value win over every later set of a key.
//!
//! Bounds ([`StoreConfig`]): key length ([`MAX_STORE_KEY`]), value length
//! ([`MAX_STORE_VALUE`]), number of keys, total bytes held (keys + values), and bytes of
//! sets still awaiting acknowledgement. A local set beyond a bound fails at once with a
//! [`StoreError`] naming it and changes nothing. A copy from another node beyond a bound is
//! not applied and is answered with an acknowledgement that carries the refusal, so the
//! writer's set fails promptly with that reason instead of resending until its deadline
//! (the writer and the members that accepted keep the value: a full store is an error the
//! job should stop on, not a state to run on).
//!
//! Restart rounds: a store belongs to one round ([`Store::reset`] empties it for the next);
//! copies and acknowledgements of another round are ignored (not acknowledged), so a
//! writer already in the next round resends until this node resets too.
//!
//! No clock and no IO: inputs take `now`, outputs are drained with [`Store::poll_transmit`],
//! [`Store::poll_event`] and [`Store::poll_timeout`].

use crate::id::NodeId;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

/// Order of sets of one key: the higher `(counter, writer)` wins everywhere.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Version {
    /// Lamport counter: above every version the writer had seen when it set the value.
    pub counter: u64,
    /// The node that set the value (breaks ties between concurrent sets).
    pub writer: NodeId,
}

/// A local set, to match its [`StoreEvent::SetDone`] or [`StoreEvent::SetFailed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SetId(pub u64);

/// Store limits and timing. All nodes of a job should use the same limits: a copy beyond a
/// receiver's limits is refused.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Most distinct keys held.
    pub max_keys: usize,
    /// Most bytes held, keys and values together.
    pub max_bytes: usize,
    /// Most bytes (key + value) of local sets awaiting acknowledgement at once.
    pub max_pending_bytes: usize,
    /// First resend of an unacknowledged copy after this long; doubles up to `resend_max`.
    pub resend_initial: Duration,
    /// Longest wait between two resends.
    pub resend_max: Duration,
    /// A set not acknowledged by every live member within this long fails.
    pub set_deadline: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            max_keys: 65_536,
            max_bytes: 64 << 20,
            max_pending_bytes: 64 << 20,
            resend_initial: Duration::from_millis(200),
            resend_max: Duration::from_secs(2),
            set_deadline: Duration::from_secs(10),
        }
    }
}

/// Why a set was refused (locally at once, or by another node in its acknowledgement).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum StoreError {
    /// The key is empty.
    #[error("store key is empty")]
    EmptyKey,
    /// The key is longer than [`MAX_STORE_KEY`].
    #[error("store key of {len} bytes exceeds the {max}-byte limit")]
    KeyTooLong {
        /// Its length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The value is longer than [`MAX_STORE_VALUE`].
    #[error("store value of {len} bytes exceeds the {max}-byte limit")]
    ValueTooLarge {
        /// Its length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A new key beyond [`StoreConfig::max_keys`].
    #[error("store full: it holds {max} keys, the limit")]
    TooManyKeys {
        /// The limit.
        max: u64,
    },
    /// The value would take the store beyond [`StoreConfig::max_bytes`].
    #[error("store full: {held} bytes held, {needed} more needed, limit {max} bytes")]
    Full {
        /// Bytes held now.
        held: u64,
        /// Bytes the set would add.
        needed: u64,
        /// The limit.
        max: u64,
    },
    /// This node saw a version numbered `u64::MAX` (only a hostile or broken peer sends
    /// one): no later set can be numbered past it.
    #[error("store versions exhausted: a peer sent the largest possible version number")]
    VersionsExhausted,
    /// Too many bytes of earlier sets still await acknowledgement
    /// ([`StoreConfig::max_pending_bytes`]).
    #[error("store busy: {pending} bytes of earlier sets await acknowledgement, limit {max} bytes")]
    Busy {
        /// Bytes awaiting acknowledgement.
        pending: u64,
        /// The limit.
        max: u64,
    },
    /// A copy's version counter is further above this node's clock than any run of sets
    /// could take it ([`MAX_COUNTER_STEP`]): only a hostile or broken peer sends one, and
    /// keeping it would let that value beat every later set of its key.
    #[error("store version {counter} is too far ahead of this node's {clock} (a broken or hostile peer)")]
    VersionTooFar {
        /// The copy's counter.
        counter: u64,
        /// This node's clock.
        clock: u64,
    },
}

/// How far above this node's Lamport clock a copy's counter may be. Every node sees every
/// set of its round, so honest counters differ by the sets in flight at once (bounded by
/// the pending-bytes limit): 2^32 is never reached, and a peer that jumps by it at every set
/// needs 2^32 sets to exhaust the counters, so no single copy can freeze a key.
pub const MAX_COUNTER_STEP: u64 = 1 << 32;

/// Why a local set did not complete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SetFailure {
    /// These members did not acknowledge before [`StoreConfig::set_deadline`].
    Unacknowledged(Vec<NodeId>),
    /// These members refused the value (each with its reason); the others acknowledged.
    Refused(Vec<(NodeId, StoreError)>),
    /// The store was reset for another restart round before the set completed.
    Reset,
}

impl std::fmt::Display for SetFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SetFailure::Unacknowledged(ids) => {
                let ids: Vec<String> = ids.iter().map(NodeId::to_string).collect();
                write!(f, "not acknowledged by {}", ids.join(", "))
            }
            SetFailure::Refused(r) => {
                let r: Vec<String> = r.iter().map(|(id, e)| format!("{id}: {e}")).collect();
                write!(f, "refused by {}", r.join("; "))
            }
            SetFailure::Reset => f.write_str("the job restarted before every node had the value"),
        }
    }
}

/// What the store tells its driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreEvent {
    /// Every live member holds the set's version or a newer one.
    SetDone(SetId),
    /// The set did not reach every live member (the value stays where it was applied).
    SetFailed(SetId, SetFailure),
    /// `key` has a new value on this node (read it with [`Store::get`]).
    Changed(String),
}

#[derive(Debug)]
struct Entry {
    version: Version,
    value: Vec<u8>,
}

#[derive(Debug)]
struct Pending {
    key: String,
    value: Vec<u8>,
    version: Version,
    waiting: BTreeSet<NodeId>,
    refused: Vec<(NodeId, StoreError)>,
    next_resend: Instant,
    backoff: Duration,
    deadline: Instant,
}

impl Pending {
    fn bytes(&self) -> usize {
        self.key.len() + self.value.len()
    }
}

/// Store replication between nodes (see [`crate::store`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoreMsg {
    /// Writer -> each member: `key` holds `value` from `version` on (the highest version
    /// wins); answered with [`StoreMsg::Ack`], resent until then.
    Set {
        /// Restart round the value belongs to.
        restart: u32,
        /// Key (at most [`MAX_STORE_KEY`] bytes).
        key: String,
        /// Value (at most [`MAX_STORE_VALUE`] bytes).
        value: Vec<u8>,
        /// The set's version (Lamport counter, writer).
        version: Version,
    },
    /// Member -> writer: the [`StoreMsg::Set`] of `version` arrived (applied, or already
    /// superseded by a newer version), or was refused because of a store limit.
    Ack {
        /// Restart round of the set.
        restart: u32,
        /// Version of the set acknowledged.
        version: Version,
        /// The limit the value would have broken on the member; `None` when accepted.
        refused: Option<StoreError>,
    },
}

/// Longest store key accepted.
pub const MAX_STORE_KEY: usize = 1024;
/// Largest store value accepted.
pub const MAX_STORE_VALUE: usize = 1 << 20;

/// One node's copy of the store (see the module docs).
#[derive(Debug)]
pub struct Store {
    me: NodeId,
    restart: u32,
    cfg: StoreConfig,
    clock: u64,
    entries: BTreeMap<String, Entry>,
    bytes: usize,
    pending: BTreeMap<SetId, Pending>,
    /// The pending set of each of this node's versions (an ack names the version).
    by_version: BTreeMap<Version, SetId>,
    pending_bytes: usize,
    gone: BTreeSet<NodeId>,
    next_id: u64,
    transmits: VecDeque<(NodeId, StoreMsg)>,
    events: VecDeque<StoreEvent>,
}

impl Store {
    /// An empty store of node `me` for restart round `restart`.
    pub fn new(me: NodeId, restart: u32, cfg: StoreConfig) -> Store {
        Store {
            me,
            restart,
            cfg,
            clock: 0,
            entries: BTreeMap::new(),
            bytes: 0,
            pending: BTreeMap::new(),
            by_version: BTreeMap::new(),
            pending_bytes: 0,
            gone: BTreeSet::new(),
            next_id: 0,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    /// Empties the store for restart round `restart`: values, members reported gone and
    /// queued messages go; sets still awaiting acknowledgement fail with
    /// [`SetFailure::Reset`].
    pub fn reset(&mut self, restart: u32) {
        self.restart = restart;
        self.clock = 0;
        self.entries.clear();
        self.bytes = 0;
        self.gone.clear();
        self.transmits.clear();
        self.events.retain(|e| !matches!(e, StoreEvent::Changed(_)));
        self.by_version.clear();
        for (id, _) in std::mem::take(&mut self.pending) {
            self.events.push_back(StoreEvent::SetFailed(id, SetFailure::Reset));
        }
        self.pending_bytes = 0;
    }

    /// The restart round this store belongs to.
    pub fn restart(&self) -> u32 {
        self.restart
    }

    /// Sets `key` to `value` here and starts copying it to each of `members` (other than
    /// this node and those reported gone). Completes with [`StoreEvent::SetDone`] (at once
    /// when there is nobody to copy to) or [`StoreEvent::SetFailed`].
    pub fn set(
        &mut self,
        key: String,
        value: Vec<u8>,
        members: impl IntoIterator<Item = NodeId>,
        now: Instant,
    ) -> Result<SetId, StoreError> {
        self.check(&key, &value)?;
        let waiting: BTreeSet<NodeId> =
            members.into_iter().filter(|m| *m != self.me && !self.gone.contains(m)).collect();
        let size = key.len() + value.len();
        if !waiting.is_empty() && self.pending_bytes + size > self.cfg.max_pending_bytes {
            return Err(StoreError::Busy {
                pending: self.pending_bytes as u64,
                max: self.cfg.max_pending_bytes as u64,
            });
        }
        if self.clock == u64::MAX {
            return Err(StoreError::VersionsExhausted);
        }
        self.clock += 1;
        let version = Version { counter: self.clock, writer: self.me };
        let id = SetId(self.next_id);
        self.next_id += 1;
        self.apply(key.clone(), version, value.clone());
        if waiting.is_empty() {
            self.events.push_back(StoreEvent::SetDone(id));
            return Ok(id);
        }
        let p = Pending {
            key,
            value,
            version,
            waiting,
            refused: Vec::new(),
            next_resend: now + self.cfg.resend_initial,
            backoff: self.cfg.resend_initial,
            deadline: now + self.cfg.set_deadline,
        };
        send_copies(&mut self.transmits, self.restart, &p);
        self.pending_bytes += p.bytes();
        self.by_version.insert(version, id);
        self.pending.insert(id, p);
        Ok(id)
    }

    /// The value of `key` on this node.
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.entries.get(key).map(|e| e.value.as_slice())
    }

    /// The version of `key`'s value on this node.
    pub fn version(&self, key: &str) -> Option<Version> {
        self.entries.get(key).map(|e| e.version)
    }

    /// Number of keys held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes held (keys and values).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Members a local set still waits for (empty when it is not pending).
    pub fn unacknowledged(&self, id: SetId) -> Vec<NodeId> {
        self.pending.get(&id).map(|p| p.waiting.iter().copied().collect()).unwrap_or_default()
    }

    /// A member left the job (declared dead): no set waits for it any more, and later sets
    /// of this round do not copy to it.
    pub fn member_gone(&mut self, id: NodeId) {
        self.gone.insert(id);
        let ids: Vec<SetId> = self.pending.keys().copied().collect();
        for sid in ids {
            if let Some(p) = self.pending.get_mut(&sid) {
                p.waiting.remove(&id);
            }
            self.finish_if_answered(sid);
        }
    }

    /// A store message from node `from`.
    pub fn handle_message(&mut self, from: NodeId, msg: StoreMsg, now: Instant) {
        let _ = now;
        match msg {
            StoreMsg::Set { restart, key, value, version } => {
                // A copy comes from its writer (sets are not forwarded): one naming another
                // writer is a forgery, and is neither kept nor acknowledged.
                if restart != self.restart || version.writer != from {
                    return;
                }
                let too_far = version.counter > self.clock.saturating_add(MAX_COUNTER_STEP);
                let refused = match self.entries.get(&key) {
                    _ if too_far => {
                        Some(StoreError::VersionTooFar { counter: version.counter, clock: self.clock })
                    }
                    Some(e) if e.version >= version => None,
                    _ => match self.check(&key, &value) {
                        Ok(()) => {
                            // Only a value this node holds moves its clock: a refused copy
                            // must not make later local sets lose to a value nobody kept.
                            self.clock = self.clock.max(version.counter);
                            self.apply(key, version, value);
                            None
                        }
                        Err(e) => Some(e),
                    },
                };
                self.transmits.push_back((from, StoreMsg::Ack { restart, version, refused }));
            }
            StoreMsg::Ack { restart, version, refused } => {
                if restart != self.restart || version.writer != self.me {
                    return;
                }
                let Some(&sid) = self.by_version.get(&version) else { return };
                let Some(p) = self.pending.get_mut(&sid) else { return };
                if p.waiting.remove(&from) {
                    p.refused.extend(refused.map(|e| (from, e)));
                }
                self.finish_if_answered(sid);
            }
        }
    }

    /// Resends copies that are due and fails sets past their deadline.
    pub fn handle_timeout(&mut self, now: Instant) {
        let ids: Vec<SetId> = self.pending.keys().copied().collect();
        for sid in ids {
            let Some(p) = self.pending.get_mut(&sid) else { continue };
            if now >= p.deadline {
                let waiting: Vec<NodeId> = p.waiting.iter().copied().collect();
                self.remove_pending(sid);
                self.events.push_back(StoreEvent::SetFailed(sid, SetFailure::Unacknowledged(waiting)));
                continue;
            }
            if now >= p.next_resend {
                p.backoff = (p.backoff * 2).min(self.cfg.resend_max);
                p.next_resend = now + p.backoff;
                send_copies(&mut self.transmits, self.restart, p);
            }
        }
    }

    /// The next message to send: (to, message).
    pub fn poll_transmit(&mut self) -> Option<(NodeId, StoreMsg)> {
        self.transmits.pop_front()
    }

    /// The next event for the driver.
    pub fn poll_event(&mut self) -> Option<StoreEvent> {
        self.events.pop_front()
    }

    /// When [`Store::handle_timeout`] wants to run next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.pending.values().map(|p| p.next_resend.min(p.deadline)).min()
    }

    /// Whether `key` = `value` fits the bounds, counting what it replaces.
    fn check(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        if key.is_empty() {
            return Err(StoreError::EmptyKey);
        }
        if key.len() > MAX_STORE_KEY {
            return Err(StoreError::KeyTooLong { len: key.len() as u64, max: MAX_STORE_KEY as u64 });
        }
        if value.len() > MAX_STORE_VALUE {
            return Err(StoreError::ValueTooLarge { len: value.len() as u64, max: MAX_STORE_VALUE as u64 });
        }
        let old = self.entries.get(key);
        if old.is_none() && self.entries.len() >= self.cfg.max_keys {
            return Err(StoreError::TooManyKeys { max: self.cfg.max_keys as u64 });
        }
        let freed = old.map_or(0, |e| key.len() + e.value.len());
        let needed = key.len() + value.len();
        if self.bytes - freed + needed > self.cfg.max_bytes {
            return Err(StoreError::Full {
                held: self.bytes as u64,
                needed: (needed.saturating_sub(freed)) as u64,
                max: self.cfg.max_bytes as u64,
            });
        }
        Ok(())
    }

    /// Stores a checked value (the caller made sure `version` is newer than the held one).
    fn apply(&mut self, key: String, version: Version, value: Vec<u8>) {
        let added = key.len() + value.len();
        let freed = self.entries.get(&key).map_or(0, |e| key.len() + e.value.len());
        self.bytes = self.bytes - freed + added;
        self.entries.insert(key.clone(), Entry { version, value });
        self.events.push_back(StoreEvent::Changed(key));
    }

    fn finish_if_answered(&mut self, sid: SetId) {
        let Some(p) = self.pending.get(&sid) else { return };
        if !p.waiting.is_empty() {
            return;
        }
        let refused = p.refused.clone();
        self.remove_pending(sid);
        self.events.push_back(if refused.is_empty() {
            StoreEvent::SetDone(sid)
        } else {
            StoreEvent::SetFailed(sid, SetFailure::Refused(refused))
        });
    }

    fn remove_pending(&mut self, sid: SetId) {
        if let Some(p) = self.pending.remove(&sid) {
            self.pending_bytes -= p.bytes();
            self.by_version.remove(&p.version);
        }
    }
}

/// Store frames that arrive before this node's store of their round exists (a faster
/// node's ranks already set values while this node's still start), kept for it: bounded
/// in frames and in bytes, beyond which a frame is dropped (its writer resends it until
/// acknowledged). Only frames the node core let through reach it: those of this round's
/// roster members, from their roster addresses.
#[derive(Debug, Default)]
pub struct Backlog {
    frames: Vec<(NodeId, StoreMsg)>,
    bytes: usize,
}

impl Backlog {
    /// Most frames kept.
    pub const MAX_FRAMES: usize = 4096;
    /// Most bytes kept (a frame counts its key, its value and 64 bytes).
    pub const MAX_BYTES: usize = 16 << 20;

    /// Keeps `msg` from `from` when it fits; whether it was kept.
    pub fn push(&mut self, from: NodeId, msg: StoreMsg) -> bool {
        let bytes = 64
            + match &msg {
                StoreMsg::Set { key, value, .. } => key.len() + value.len(),
                StoreMsg::Ack { .. } => 0,
            };
        if self.frames.len() >= Self::MAX_FRAMES || self.bytes + bytes > Self::MAX_BYTES {
            return false;
        }
        self.bytes += bytes;
        self.frames.push((from, msg));
        true
    }

    /// The frames kept, oldest first; the backlog is empty after.
    pub fn take(&mut self) -> Vec<(NodeId, StoreMsg)> {
        self.bytes = 0;
        std::mem::take(&mut self.frames)
    }

    /// Bytes kept now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// Queues a copy of `p` to every member it still waits for.
fn send_copies(transmits: &mut VecDeque<(NodeId, StoreMsg)>, restart: u32, p: &Pending) {
    for to in &p.waiting {
        let msg = StoreMsg::Set { restart, key: p.key.clone(), value: p.value.clone(), version: p.version };
        transmits.push_back((*to, msg));
    }
}

#[cfg(test)]
mod tests;
