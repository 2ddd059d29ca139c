//! torchft's Lighthouse quorum rules as a sans-IO state machine.
//!
//! torchft (pytorch/torchft) runs one Lighthouse that every replica group's manager asks
//! for a quorum: the set of groups that train the next steps together. This module holds
//! the decision only; the gRPC server and the task that drives it live in the `meshd`
//! crate (`meshd::lighthouse`). Nothing here reads a clock: every input takes `now`.
//!
//! Inputs: [`Lighthouse::handle_quorum_request`] (a long-poll: it is answered by a later
//! [`Output::Quorum`] that names its [`RequestId`]), [`Lighthouse::handle_heartbeat`],
//! [`Lighthouse::replica_gone`] (the mesh's failure detector says so: unhealthy at once),
//! [`Lighthouse::cancel_request`] (the asker went away), [`Lighthouse::tick`] at
//! [`Lighthouse::poll_timeout`], and [`Lighthouse::observe_quorum_id`] (an id another
//! decider issued). Outputs: [`Lighthouse::poll_output`].
//!
//! The rules are torchft's `quorum_compute` and `_quorum_tick` (src/lighthouse.rs):
//!
//! - a replica is *healthy* when its last heartbeat (a quorum request counts as one) is
//!   younger than `heartbeat_timeout`; *participants* are the replicas with a pending
//!   quorum request, and only healthy participants count;
//! - if any healthy participant asks `shrink_only`, candidates are limited to the members
//!   of the previous quorum;
//! - *fast quorum*: when every member of the previous quorum is a healthy participant, the
//!   quorum is issued at once (no `min_replicas`, no half rule, no join timeout);
//! - otherwise at least `min_replicas` healthy participants, *more than half* of the healthy
//!   replicas (against split brain), and, while some healthy replica has not asked yet,
//!   a wait of `join_timeout` from the earliest participant's request;
//! - participants are sorted by `replica_id`; the quorum id changes when the sorted
//!   replica_id list differs from the previous quorum's, or when any participant reports
//!   `commit_failures > 0`;
//! - on issue, the participant set is cleared; a pending request whose replica is not in
//!   the issued quorum joins again (re-queued, joined = now), as torchft's long-poll does.
//!
//! # Quorum ids across deciders
//!
//! meshd may move the decider from node to node (the one that held it dies), and a
//! partition may for a while leave two deciders each answering its side. torchft's
//! managers reconfigure their process groups whenever the quorum id changes and key the
//! rendezvous store by it (`{store}/torchft/{quorum_id}/...`), so an id must never name two
//! different participant lists, and ids should only grow. The rule:
//!
//! `quorum_id = (counter << 10) | tag`, where `tag` (0..=1023, [`DeciderTag`]) is fixed per
//! decider by its owner (derived from the node id) and `counter` is the decider's own.
//!
//! - **Unique across deciders, without any message**: two deciders with different tags
//!   differ in the low 10 bits, so they can never issue the same id, even in a partition
//!   where neither hears from the other. (Owners must give live deciders distinct tags; a
//!   restarted decider on the same node keeps its tag but observes, below.)
//! - **Unique within one decider**: the counter only grows, and is raised by one for every
//!   change of participant list (or commit failure). An id is issued again only for the
//!   same sorted replica_id list as the quorum that first carried it (torchft's rule).
//! - **Increasing across a hand-over**: [`Lighthouse::observe_quorum_id`] raises the
//!   counter floor to the observed id's counter, and the next bump goes one above it. Since
//!   `(c + 1) << 10 > (c << 10) | 1023`, every id issued after observing `x` is greater
//!   than `x`, whatever `x`'s tag. A new decider has no previous quorum, so its first quorum
//!   always bumps: it never re-uses an observed id, even for the same list.
//! - What it does not give: ids that a decider never observed (issued by a dead decider
//!   whose last ids did not reach the new one, or by the other side of a partition) may be
//!   greater than the new decider's. They are still unique, which is what torchft needs
//!   for correctness (the managers compare ids for equality); monotonicity holds as far as
//!   the owner feeds the ids it has seen (e.g. gossiped with each issued quorum).
//!
//! The counter has 53 bits before `i64` overflows: at one quorum a millisecond, 285,000
//! years.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

#[cfg(test)]
mod tests;

/// Replicas whose heartbeats are tracked at most: a heartbeat from one more is ignored
/// (with a log) until expired ones are pruned. torchft keeps every id it ever saw.
pub const MAX_TRACKED_REPLICAS: usize = 65_536;

/// Bits of a quorum id that hold the decider's tag.
pub const TAG_BITS: u32 = 10;

/// A decider's tag: the low [`TAG_BITS`] bits of every quorum id it issues (0..=1023).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DeciderTag(u16);

impl DeciderTag {
    /// The largest tag.
    pub const MAX: u16 = (1 << TAG_BITS) - 1;

    /// A tag, or None when it does not fit in [`TAG_BITS`] bits.
    pub fn new(tag: u16) -> Option<DeciderTag> {
        (tag <= Self::MAX).then_some(DeciderTag(tag))
    }

    /// A tag from any number (e.g. a hash of the node id): its low bits.
    pub fn from_low_bits(x: u64) -> DeciderTag {
        DeciderTag((x & u64::from(Self::MAX)) as u16)
    }

    /// The tag's value.
    pub fn get(self) -> u16 {
        self.0
    }
}

/// The counter part of a quorum id (the id without its tag); 0 for negative ids.
pub fn id_counter(quorum_id: i64) -> i64 {
    quorum_id.max(0) >> TAG_BITS
}

/// The quorum id of `counter` issued by the decider tagged `tag`.
pub fn compose_id(counter: i64, tag: DeciderTag) -> i64 {
    (counter << TAG_BITS) | i64::from(tag.0)
}

/// The decider's settings. Defaults are torchft's `torchft_lighthouse` binary's, except
/// `join_timeout` (torchft: 60 s), which is the owner's choice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LighthouseConfig {
    /// Participants needed for a new (not fast) quorum.
    pub min_replicas: u64,
    /// How long healthy stragglers are waited for once a quorum is possible.
    pub join_timeout: Duration,
    /// A replica is healthy while its last heartbeat is younger than this.
    pub heartbeat_timeout: Duration,
    /// How often the quorum is checked while requests wait.
    pub quorum_tick: Duration,
    /// The low bits of every quorum id this decider issues (see the module's doc).
    pub tag: DeciderTag,
}

impl Default for LighthouseConfig {
    fn default() -> Self {
        LighthouseConfig {
            min_replicas: 1,
            join_timeout: Duration::from_secs(60),
            heartbeat_timeout: Duration::from_secs(5),
            quorum_tick: Duration::from_millis(100),
            tag: DeciderTag::default(),
        }
    }
}

/// One replica group's request, as torchft's `QuorumMember` (field for field).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The group's id (torchft appends `:{uuid4}` on every process start).
    pub replica_id: String,
    /// The group's manager URL (`http://host:port`).
    pub address: String,
    /// The group's TCPStore (`host:port`).
    pub store_address: String,
    /// The group's training step.
    pub step: i64,
    /// Ranks in the group.
    pub world_size: u64,
    /// Only members of the previous quorum may be in the next.
    pub shrink_only: bool,
    /// User data as a JSON string.
    pub data: String,
    /// Commits that failed since the last quorum.
    pub commit_failures: i64,
}

impl Member {
    /// The TCP endpoints the group advertises: its manager (`address`, a URL) and its store
    /// (`store_address`), where they name an IP address and a port.
    pub fn endpoints(&self) -> Vec<std::net::SocketAddr> {
        let manager = self.address.split_once("://").map_or(self.address.as_str(), |(_, rest)| rest);
        let manager = manager.split('/').next().unwrap_or("");
        [manager, self.store_address.as_str()].iter().filter_map(|a| a.parse().ok()).collect()
    }
}

/// An issued quorum (torchft's `Quorum` without `created`: the shell stamps the wall clock).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quorum {
    /// See the module's doc: `(counter << 10) | tag`.
    pub quorum_id: i64,
    /// Sorted by `replica_id`.
    pub participants: Vec<Member>,
}

/// A quorum request, named by the caller (unique among its pending requests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// What the core asks its shell to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// A quorum was issued: answer these requests with it.
    Quorum {
        /// The quorum.
        quorum: Quorum,
        /// The pending requests whose replica is in it, in id order.
        answers: Vec<RequestId>,
    },
    /// A line for the log: the quorum status when it changed (as torchft's
    /// `Quorum status: ...`), an id bump and why, a re-queued request.
    Log(String),
}

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The caller already has a pending request with this id.
    #[error("request {0:?} is already pending")]
    Duplicate(RequestId),
}

#[derive(Clone, Debug)]
struct Participant {
    joined: Instant,
    member: Member,
}

/// The quorum decider (see the module's doc).
#[derive(Debug)]
pub struct Lighthouse {
    cfg: LighthouseConfig,
    /// replica_id -> the request that made it a participant, and when.
    participants: BTreeMap<String, Participant>,
    /// replica_id -> last heartbeat.
    heartbeats: BTreeMap<String, Instant>,
    /// Pending long-polls: request -> the member it asked with.
    pending: BTreeMap<RequestId, Member>,
    prev_quorum: Option<Quorum>,
    /// The counter of the last id issued (or the floor raised by observed ids).
    counter: i64,
    next_tick: Option<Instant>,
    last_reason: Option<String>,
    out: VecDeque<Output>,
}

/// What `quorum_compute` decided: the participants, or None, and why.
#[derive(Debug)]
struct Decision {
    participants: Option<Vec<Member>>,
    reason: String,
}

impl Lighthouse {
    /// A decider with no state.
    pub fn new(cfg: LighthouseConfig) -> Lighthouse {
        Lighthouse {
            cfg,
            participants: BTreeMap::new(),
            heartbeats: BTreeMap::new(),
            pending: BTreeMap::new(),
            prev_quorum: None,
            counter: 0,
            next_tick: None,
            last_reason: None,
            out: VecDeque::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &LighthouseConfig {
        &self.cfg
    }

    /// A quorum request (torchft's `Quorum` RPC): a heartbeat, the replica joins the
    /// participants, and the quorum is checked at once. Answered by a later
    /// [`Output::Quorum`] naming `id` (possibly from this very call).
    pub fn handle_quorum_request(
        &mut self,
        now: Instant,
        id: RequestId,
        member: Member,
    ) -> Result<(), RequestError> {
        if self.pending.contains_key(&id) {
            return Err(RequestError::Duplicate(id));
        }
        self.heartbeats.insert(member.replica_id.clone(), now);
        self.participants
            .insert(member.replica_id.clone(), Participant { joined: now, member: member.clone() });
        self.pending.insert(id, member);
        self.tick(now);
        Ok(())
    }

    /// A heartbeat (torchft's `Heartbeat` RPC).
    pub fn handle_heartbeat(&mut self, now: Instant, replica_id: &str) {
        let full = self.heartbeats.len() >= MAX_TRACKED_REPLICAS;
        match self.heartbeats.get_mut(replica_id) {
            Some(t) => *t = now,
            None if full => {
                self.out.push_back(Output::Log(format!(
                    "heartbeat from {replica_id} ignored: {MAX_TRACKED_REPLICAS} replicas already tracked"
                )));
            }
            None => {
                self.heartbeats.insert(replica_id.to_string(), now);
            }
        }
        self.schedule(now);
    }

    /// The replica is known dead (the mesh's failure detection): it is unhealthy from now
    /// on, until it heartbeats or asks again. Its pending requests stay until cancelled.
    pub fn replica_gone(&mut self, now: Instant, replica_id: &str) {
        if self.heartbeats.remove(replica_id).is_some() {
            self.out.push_back(Output::Log(format!("replica {replica_id} is gone: no longer healthy")));
        }
        self.tick(now);
    }

    /// The asker of `id` went away (its deadline passed, its connection closed): it is no
    /// longer answered nor re-queued. As in torchft, its replica stays a participant until
    /// the next quorum is issued.
    pub fn cancel_request(&mut self, id: RequestId) {
        self.pending.remove(&id);
    }

    /// An id another decider issued: ids this one issues from now on are greater (see the
    /// module's doc).
    pub fn observe_quorum_id(&mut self, quorum_id: i64) {
        self.counter = self.counter.max(id_counter(quorum_id));
    }

    /// The periodic check (every `quorum_tick`, at [`Lighthouse::poll_timeout`]).
    pub fn tick(&mut self, now: Instant) {
        // Expired heartbeats change no decision (they are not healthy) but would pile up:
        // torchft's replica ids are new on every process start.
        let timeout = self.cfg.heartbeat_timeout;
        self.heartbeats.retain(|_, t| now.saturating_duration_since(*t) < timeout);
        let d = self.compute(now);
        if self.last_reason.as_deref() != Some(d.reason.as_str()) {
            self.out.push_back(Output::Log(format!("Quorum status: {}", d.reason)));
            self.last_reason = Some(d.reason);
        }
        if let Some(participants) = d.participants {
            self.issue(now, participants);
        }
        self.next_tick = Some(now + self.cfg.quorum_tick);
    }

    /// When [`Lighthouse::tick`] is due next; None before any input.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_tick
    }

    /// The next output, until None.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// The quorum status now, in torchft's words (for a status page or a log).
    pub fn status(&self, now: Instant) -> String {
        self.compute(now).reason
    }

    /// The last quorum issued.
    pub fn prev_quorum(&self) -> Option<&Quorum> {
        self.prev_quorum.as_ref()
    }

    /// Requests waiting for an answer.
    pub fn pending_requests(&self) -> usize {
        self.pending.len()
    }

    fn schedule(&mut self, now: Instant) {
        if self.next_tick.is_none() {
            self.next_tick = Some(now + self.cfg.quorum_tick);
        }
    }

    fn issue(&mut self, now: Instant, participants: Vec<Member>) {
        let changed = match &self.prev_quorum {
            None => true,
            Some(prev) => !same_replica_ids(&participants, &prev.participants),
        };
        let failures: Vec<&str> =
            participants.iter().filter(|p| p.commit_failures > 0).map(|p| p.replica_id.as_str()).collect();
        if changed || !failures.is_empty() {
            self.counter += 1;
            let id = compose_id(self.counter, self.cfg.tag);
            let why = if changed {
                "Detected quorum change".to_string()
            } else {
                format!("Detected commit failures in [{}]", failures.join(", "))
            };
            self.out.push_back(Output::Log(format!("{why}, bumping quorum_id to {id}")));
        }
        let quorum = Quorum { quorum_id: compose_id(self.counter, self.cfg.tag), participants };
        let ids: BTreeSet<&str> = quorum.participants.iter().map(|p| p.replica_id.as_str()).collect();
        self.participants.clear();
        let mut answers = Vec::new();
        let mut still = BTreeMap::new();
        for (rid, member) in std::mem::take(&mut self.pending) {
            if ids.contains(member.replica_id.as_str()) {
                answers.push(rid);
            } else {
                // Not in this quorum: the long-poll goes on, and the replica joins again.
                self.out
                    .push_back(Output::Log(format!("Replica {} not in quorum, retrying", member.replica_id)));
                self.participants
                    .insert(member.replica_id.clone(), Participant { joined: now, member: member.clone() });
                still.insert(rid, member);
            }
        }
        self.pending = still;
        self.out.push_back(Output::Log(format!("Quorum! {}", Summary(&quorum))));
        self.prev_quorum = Some(quorum.clone());
        self.out.push_back(Output::Quorum { quorum, answers });
    }

    /// torchft's `quorum_compute`, rule for rule (see the module's doc).
    fn compute(&self, now: Instant) -> Decision {
        let timeout = self.cfg.heartbeat_timeout;
        let healthy: BTreeSet<&str> = self
            .heartbeats
            .iter()
            .filter(|(_, t)| now.saturating_duration_since(**t) < timeout)
            .map(|(r, _)| r.as_str())
            .collect();
        let healthy_participants: BTreeMap<&str, &Participant> = self
            .participants
            .iter()
            .filter(|(r, _)| healthy.contains(r.as_str()))
            .map(|(r, p)| (r.as_str(), p))
            .collect();
        // A BTreeMap's values come sorted by replica_id already.
        let mut candidates: Vec<Member> = healthy_participants.values().map(|p| p.member.clone()).collect();
        let shrink_only = healthy_participants.values().any(|p| p.member.shrink_only);
        let metadata = format!(
            "[{}/{} participants healthy][{} heartbeating][shrink_only={}]",
            healthy_participants.len(),
            self.participants.len(),
            healthy.len(),
            shrink_only
        );

        if let Some(prev) = &self.prev_quorum {
            let prev_ids: BTreeSet<&str> = prev.participants.iter().map(|p| p.replica_id.as_str()).collect();
            if shrink_only {
                candidates.retain(|p| prev_ids.contains(p.replica_id.as_str()));
            }
            if prev.participants.iter().all(|p| healthy_participants.contains_key(p.replica_id.as_str())) {
                return Decision {
                    participants: Some(candidates),
                    reason: format!("Fast quorum found! {metadata}"),
                };
            }
        }

        let n = healthy_participants.len();
        if (n as u64) < self.cfg.min_replicas {
            return Decision {
                participants: None,
                reason: format!(
                    "New quorum not ready, only have {n} participants, need min_replicas {} {metadata}",
                    self.cfg.min_replicas
                ),
            };
        }
        if n <= healthy.len() / 2 {
            return Decision {
                participants: None,
                reason: format!(
                    "New quorum not ready, only have {n} participants, need at least half of {} healthy workers {metadata}",
                    healthy.len()
                ),
            };
        }
        let all_joined = n == healthy.len();
        let first_joined = healthy_participants.values().map(|p| p.joined).min().unwrap_or(now);
        if !all_joined && now.saturating_duration_since(first_joined) < self.cfg.join_timeout {
            return Decision {
                participants: None,
                reason: format!(
                    "Valid quorum with {n} participants, waiting for {} healthy but not participating stragglers due to join timeout {metadata}",
                    healthy.len() - n
                ),
            };
        }
        Decision { participants: Some(candidates), reason: format!("Valid quorum found {metadata}") }
    }
}

fn same_replica_ids(a: &[Member], b: &[Member]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.replica_id == y.replica_id)
}

/// `id=N [a@step, b@step]`: a quorum in one short line.
struct Summary<'a>(&'a Quorum);

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "quorum_id={} [", self.0.quorum_id)?;
        for (i, p) in self.0.participants.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{} step={}", p.replica_id, p.step)?;
        }
        write!(f, "]")
    }
}
