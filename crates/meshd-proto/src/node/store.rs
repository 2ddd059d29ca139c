//! The job-wide store of the launched round, owned by the node core.
//!
//! A round's [`Store`] is created at the launch and dropped when the round stops (sets
//! still waiting fail with [`SetFailure::Reset`], waiting gets return nothing). Store frames
//! reach it only from this round's roster members, from their roster addresses; those that
//! arrive during this node's preflight (a faster node's ranks already set values) wait in a
//! bounded [`crate::store::Backlog`]. Members that finished or died stop being waited for. The IO asks
//! with [`super::Input::Store`] (a rank's `store_set`/`store_get`, the library's) and gets
//! [`Event::StoreReply`] with the same request id; the store's frames leave through the
//! node's outbox like every other frame.

use super::{Event, Level, Node, Phase, Transmit};
use crate::id::NodeId;
use crate::membership::Delivery;
use crate::rendezvous::Roster;
use crate::store::{SetFailure, SetId, Store, StoreError, StoreEvent};
use crate::wire::{Frame, StoreMsg};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// `store_get` calls waiting at once; more are answered "not set" at once.
pub const MAX_GETS: usize = 65_536;

/// What the IO asks of the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreCall {
    /// Set `key` to `value` on every node of the round.
    Set {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
    },
    /// The value of `key`, waiting up to `wait` for it to be set.
    Get {
        /// The key.
        key: String,
        /// How long to wait for it.
        wait: Duration,
    },
}

/// Why a `store_set` did not complete.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreFailure {
    /// A bound of this node's store (nothing changed).
    #[error("{0}")]
    Refused(#[from] StoreError),
    /// Not every member holds the value: the members, by host and address, and why.
    #[error("{0}")]
    NotEverywhere(String),
    /// The request belongs to a round that is not running here (the store of a round
    /// exists from its launch to its end).
    #[error("no store for restart round {0} on this node: the store belongs to a launched round")]
    NoRound(u32),
}

/// The answer to an [`super::Input::Store`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreAnswer {
    /// A set completed (every live member holds it or a newer value), or why not.
    Set(Result<(), StoreFailure>),
    /// A get: the value, or `None` when it was not set in time (or the round ended).
    Get(Option<Vec<u8>>),
}

/// The launched round's store and who waits on it.
pub(super) struct RoundStore {
    store: Store,
    /// Every other roster member: id -> (address, "host (address)").
    members: BTreeMap<NodeId, (SocketAddr, String)>,
    sets: BTreeMap<SetId, u64>,
    gets: Vec<(u64, String, Instant)>,
}

impl RoundStore {
    /// The value of `key` here.
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.store.get(key)
    }

    fn name(&self, id: NodeId) -> String {
        self.members.get(&id).map_or_else(|| format!("node {id}"), |m| m.1.clone())
    }

    /// A failed set in words, members named by host and address.
    fn describe(&self, failure: &SetFailure) -> String {
        match failure {
            SetFailure::Unacknowledged(ids) => {
                let names: Vec<String> = ids.iter().map(|id| self.name(*id)).collect();
                format!("not acknowledged by {} within the store's deadline", names.join(", "))
            }
            SetFailure::Refused(r) => {
                let r: Vec<String> = r.iter().map(|(id, e)| format!("{}: {e}", self.name(*id))).collect();
                format!("refused by {}", r.join("; "))
            }
            SetFailure::Reset => failure.to_string(),
        }
    }
}

impl Node {
    /// The round launched: its store starts, with what came before.
    pub(super) fn store_open(&mut self, roster: &Roster, now: Instant) {
        let members = roster
            .members
            .iter()
            .filter(|m| m.id != self.cfg.id)
            .map(|m| (m.id, (m.addr, format!("{} ({})", m.hostname, m.addr))))
            .collect();
        let mut store = Store::new(self.cfg.id, roster.restart, self.cfg.store.clone());
        for (from, msg) in self.store_backlog.take() {
            store.handle_message(from, msg, now);
        }
        self.store = Some(RoundStore { store, members, sets: BTreeMap::new(), gets: Vec::new() });
        self.store_drain();
    }

    /// The round stopped: sets still waiting fail, gets get nothing, the store goes.
    pub(super) fn store_close(&mut self) {
        self.store_backlog.take();
        let Some(mut s) = self.store.take() else { return };
        s.store.reset(s.store.restart());
        while let Some(ev) = s.store.poll_event() {
            if let StoreEvent::SetFailed(id, why) = ev {
                if let Some(req) = s.sets.remove(&id) {
                    let answer = StoreAnswer::Set(Err(StoreFailure::NotEverywhere(s.describe(&why))));
                    self.events.push_back(Event::StoreReply { req, answer });
                }
            }
        }
        for (req, _, _) in s.gets.drain(..) {
            self.events.push_back(Event::StoreReply { req, answer: StoreAnswer::Get(None) });
        }
    }

    /// A store frame: to this round's store when it comes from a member of this round's
    /// agreed roster, from that member's roster address, for this round; kept for the
    /// store while this node's preflight runs. Nothing else may fill a store (or its
    /// backlog), and a token holder claiming a member's id from elsewhere writes nothing.
    pub(super) fn store_frame(&mut self, from: SocketAddr, node: NodeId, msg: StoreMsg, now: Instant) {
        let restart = match &msg {
            StoreMsg::Set { restart, .. } | StoreMsg::Ack { restart, .. } => *restart,
        };
        let member = self.roster().and_then(|r| {
            let m = r.members.iter().find(|m| m.id == node && m.id != self.cfg.id)?;
            Some((r.restart, m.addr.ip().to_canonical()))
        });
        match member {
            Some((round, ip)) if round == restart && ip == from.ip().to_canonical() => {}
            _ => return,
        }
        match &mut self.store {
            Some(s) => {
                s.store.handle_message(node, msg, now);
                self.store_drain();
            }
            None if matches!(self.phase, Phase::Preflight(_)) => {
                self.store_backlog.push(node, msg);
            }
            None => {}
        }
    }

    /// A store request of the IO; answered now or later with [`Event::StoreReply`].
    pub(super) fn store_call(&mut self, round: u32, req: u64, call: StoreCall, now: Instant) {
        let reply = |answer| Event::StoreReply { req, answer };
        let Some(s) = self.store.as_mut().filter(|s| s.store.restart() == round) else {
            let answer = match call {
                StoreCall::Set { .. } => StoreAnswer::Set(Err(StoreFailure::NoRound(round))),
                StoreCall::Get { .. } => StoreAnswer::Get(None),
            };
            self.events.push_back(reply(answer));
            return;
        };
        match call {
            StoreCall::Set { key, value } => {
                let members: Vec<NodeId> = s.members.keys().copied().collect();
                match s.store.set(key, value, members, now) {
                    Ok(id) => {
                        s.sets.insert(id, req);
                    }
                    Err(e) => self.events.push_back(reply(StoreAnswer::Set(Err(e.into())))),
                }
            }
            StoreCall::Get { key, wait } => match s.store.get(&key) {
                Some(v) => self.events.push_back(reply(StoreAnswer::Get(Some(v.to_vec())))),
                None if s.gets.len() < MAX_GETS => {
                    // A wait past what an Instant holds is a wait for the round's end.
                    let deadline = now.checked_add(wait).unwrap_or(now + Duration::from_secs(365 * 86_400));
                    s.gets.push((req, key, deadline))
                }
                None => {
                    self.log(Level::Warn, format!("more than {MAX_GETS} store_get calls wait at once"));
                    self.events.push_back(reply(StoreAnswer::Get(None)));
                }
            },
        }
        self.store_drain();
    }

    /// A member finished (its ranks all exited) or left: no set waits for it.
    pub(super) fn store_member_gone(&mut self, id: NodeId, _now: Instant) {
        if let Some(s) = &mut self.store {
            s.store.member_gone(id);
            self.store_drain();
        }
    }

    /// Resends, set deadlines and get deadlines.
    pub(super) fn store_timeout(&mut self, now: Instant) {
        let Some(s) = &mut self.store else { return };
        if s.store.poll_timeout().is_some_and(|t| t <= now) {
            s.store.handle_timeout(now);
        }
        let (expired, waiting): (Vec<_>, Vec<_>) = s.gets.drain(..).partition(|g| g.2 <= now);
        s.gets = waiting;
        for (req, _, _) in expired {
            self.events.push_back(Event::StoreReply { req, answer: StoreAnswer::Get(None) });
        }
        self.store_drain();
    }

    /// When [`Node::store_timeout`] wants to run.
    pub(super) fn store_poll_timeout(&self) -> Option<Instant> {
        let s = self.store.as_ref()?;
        [s.store.poll_timeout(), s.gets.iter().map(|g| g.2).min()].into_iter().flatten().min()
    }

    /// The store's frames to the outbox, its events to replies.
    fn store_drain(&mut self) {
        let Some(s) = &mut self.store else { return };
        while let Some((to, msg)) = s.store.poll_transmit() {
            if let Some((addr, _)) = s.members.get(&to) {
                self.outbox.push_back(Transmit {
                    to: *addr,
                    frame: Frame::Store(msg),
                    delivery: Delivery::Reliable,
                });
            }
        }
        let mut replies = Vec::new();
        let mut logs = Vec::new();
        while let Some(ev) = s.store.poll_event() {
            match ev {
                StoreEvent::SetDone(id) => {
                    if let Some(req) = s.sets.remove(&id) {
                        replies.push((req, StoreAnswer::Set(Ok(()))));
                    }
                }
                StoreEvent::SetFailed(id, why) => {
                    let why = s.describe(&why);
                    logs.push(format!("store_set failed: {why}"));
                    if let Some(req) = s.sets.remove(&id) {
                        replies.push((req, StoreAnswer::Set(Err(StoreFailure::NotEverywhere(why)))));
                    }
                }
                StoreEvent::Changed(key) => {
                    if let Some(v) = s.store.get(&key) {
                        let (ready, waiting): (Vec<_>, Vec<_>) = s.gets.drain(..).partition(|g| g.1 == key);
                        s.gets = waiting;
                        replies.extend(ready.into_iter().map(|g| (g.0, StoreAnswer::Get(Some(v.to_vec())))));
                    }
                }
            }
        }
        for (req, answer) in replies {
            self.events.push_back(Event::StoreReply { req, answer });
        }
        for l in logs {
            self.log(Level::Warn, l);
        }
    }
}
