//! The library side of the actor: commands from a [`NodeHandle`](super::NodeHandle), the
//! state it reads (roster, verdict, members, how the job ended), and the round's job-wide
//! store (a `meshd_proto::store::Store` core per launched round, as meshd's local service
//! runs it for ranks).

use super::actor::Wake;
use crate::transport::Transport;
use meshd_proto::NodeId;
use meshd_proto::node::Outcome;
use meshd_proto::preflight::Verdict;
use meshd_proto::rendezvous::Roster;
use meshd_proto::store::{SetId, Store, StoreConfig, StoreEvent};
use meshd_proto::wire::{Frame, StoreMsg};
use std::collections::BTreeMap;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot, watch};

/// Readers waiting for keys that are not set yet (bounded).
const MAX_WAITERS: usize = 4096;

/// What a handle asks the actor.
#[derive(Debug)]
pub(crate) enum Command {
    /// Stop the job everywhere (restartable, like a rank failure).
    Abort(String),
    /// This node's work is done: say Done, wait for every member, then end.
    Finish,
    /// Leave now.
    Shutdown,
    /// Set a store key; answered once every live roster member holds it.
    StoreSet(String, Vec<u8>, oneshot::Sender<Result<(), String>>),
    /// Read a store key; answered once it is set.
    StoreGet(String, oneshot::Sender<Vec<u8>>),
}

/// What a handle can read.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// The roster of the current round once launched (preflight passed).
    pub roster: Option<Roster>,
    /// The current round's preflight verdict, with its roster.
    pub verdict: Option<(Roster, Verdict)>,
    /// Why the last round failed, and whether a new one follows.
    pub failed: Option<(String, bool)>,
    /// How the job ended on this node.
    pub outcome: Option<Outcome>,
    /// Everyone known, with status (refreshed every second and on every change).
    pub members: Vec<meshd_proto::membership::MemberView>,
}

pub(crate) struct Library {
    cmds: mpsc::Receiver<Command>,
    snap: watch::Sender<Snapshot>,
    /// The handle is gone: nothing more comes from it.
    closed: bool,
    /// This round launched (its "ranks" are the library program itself).
    launched: bool,
    /// The program finished before the launch: say so right after it.
    finish_pending: bool,
    me: NodeId,
    store: Option<(Store, Roster)>,
    backlog: meshd_proto::store::Backlog,
    sets: BTreeMap<SetId, oneshot::Sender<Result<(), String>>>,
    gets: Vec<(String, oneshot::Sender<Vec<u8>>)>,
}

impl Library {
    pub fn new(me: NodeId, cmds: mpsc::Receiver<Command>, snap: watch::Sender<Snapshot>) -> Library {
        Library {
            cmds,
            snap,
            closed: false,
            launched: false,
            finish_pending: false,
            me,
            store: None,
            backlog: Default::default(),
            sets: BTreeMap::new(),
            gets: Vec::new(),
        }
    }

    /// A store command: applied to this round's store (refused without one).
    pub fn store_command(&mut self, c: Command, now: Instant) {
        match c {
            Command::StoreSet(key, value, reply) => {
                let Some((store, roster)) = self.store.as_mut() else {
                    let _ = reply.send(Err("no roster yet: the store belongs to a launched round".into()));
                    return;
                };
                let members: Vec<NodeId> = roster.members.iter().map(|m| m.id).collect();
                match store.set(key, value, members, now) {
                    Ok(id) => {
                        self.sets.insert(id, reply);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e.to_string()));
                    }
                }
            }
            Command::StoreGet(key, reply) => match self.store.as_ref().and_then(|(s, _)| s.get(&key)) {
                Some(v) => {
                    let _ = reply.send(v.to_vec());
                }
                None if self.gets.len() < MAX_WAITERS => self.gets.push((key, reply)),
                None => {}
            },
            _ => {}
        }
    }

    /// A store frame from `from`: to this round's store when `from` is in its roster.
    pub fn store_msg(&mut self, from: NodeId, msg: StoreMsg, now: Instant) {
        match self.store.as_mut() {
            Some((s, roster)) if roster.node_rank(from).is_some() => s.handle_message(from, msg, now),
            Some(_) => {}
            None => {
                self.backlog.push(from, msg);
            }
        }
    }

    /// A roster member is finished: the store stops waiting for it.
    pub fn member_gone(&mut self, id: NodeId) {
        if let Some((s, _)) = self.store.as_mut() {
            s.member_gone(id);
        }
    }

    /// When the store's timer is due.
    pub fn store_timeout(&self) -> Option<Instant> {
        self.store.as_ref().and_then(|(s, _)| s.poll_timeout())
    }

    /// Runs the store's timer if due, sends its frames, answers finished sets and waiting
    /// readers.
    pub fn drive_store(&mut self, transport: &Transport, now: Instant) {
        let Some((store, roster)) = self.store.as_mut() else { return };
        if store.poll_timeout().is_some_and(|t| t <= now) {
            store.handle_timeout(now);
        }
        while let Some((to, msg)) = store.poll_transmit() {
            if let Some(m) = roster.members.iter().find(|m| m.id == to) {
                transport.send(m.addr, &Frame::Store(msg), true);
            }
        }
        while let Some(ev) = store.poll_event() {
            match ev {
                StoreEvent::SetDone(id) => {
                    if let Some(r) = self.sets.remove(&id) {
                        let _ = r.send(Ok(()));
                    }
                }
                StoreEvent::SetFailed(id, why) => {
                    if let Some(r) = self.sets.remove(&id) {
                        let _ = r.send(Err(why.to_string()));
                    }
                }
                StoreEvent::Changed(key) => {
                    if let Some(v) = store.get(&key) {
                        let (ready, wait): (Vec<_>, Vec<_>) =
                            std::mem::take(&mut self.gets).into_iter().partition(|(k, _)| *k == key);
                        self.gets = wait;
                        for (_, r) in ready {
                            let _ = r.send(v.to_vec());
                        }
                    }
                }
            }
        }
    }

    pub async fn next(&mut self) -> Wake {
        if self.closed {
            return std::future::pending().await;
        }
        match self.cmds.recv().await {
            Some(c) => Wake::Command(c),
            None => {
                // Every handle dropped: the node leaves, as after `shutdown`.
                self.closed = true;
                Wake::Command(Command::Shutdown)
            }
        }
    }

    pub fn verdict(&mut self, roster: Option<Roster>, v: Verdict) {
        self.snap.send_modify(|s| s.verdict = roster.map(|r| (r, v)));
    }

    /// The round launched; `true` when the program already finished.
    pub fn launched(&mut self, roster: Roster) -> bool {
        self.launched = true;
        let now = Instant::now();
        let mut store = Store::new(self.me, roster.restart, StoreConfig::default());
        for (from, msg) in self.backlog.take() {
            if roster.node_rank(from).is_some() {
                store.handle_message(from, msg, now);
            }
        }
        self.store = Some((store, roster.clone()));
        self.snap.send_modify(|s| {
            s.roster = Some(roster);
            s.failed = None;
        });
        std::mem::take(&mut self.finish_pending)
    }

    /// The program is done: `true` when the round runs (tell the core now), else it is
    /// told at the launch.
    pub fn finish(&mut self) -> bool {
        if !self.launched {
            self.finish_pending = true;
        }
        self.launched
    }

    pub fn round_failed(&mut self, reason: String, restarting: bool) {
        self.launched = false;
        self.store = None;
        for (_, r) in std::mem::take(&mut self.sets) {
            let _ = r.send(Err(format!("the round ended before every node had the value: {reason}")));
        }
        self.snap.send_modify(|s| {
            s.roster = None;
            s.failed = Some((reason, restarting));
        });
    }

    pub fn members(&mut self, m: Vec<meshd_proto::membership::MemberView>) {
        self.snap.send_modify(|s| s.members = m);
    }

    pub fn finished(&mut self, o: Outcome) {
        self.snap.send_modify(|s| {
            if s.outcome.is_none() {
                s.outcome = Some(o);
            }
        });
    }
}
