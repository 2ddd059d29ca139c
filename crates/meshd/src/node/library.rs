//! The library side of the actor: commands from a [`NodeHandle`](super::NodeHandle) and the
//! state it reads (roster, verdict, members, how the job ended). The job-wide store is the
//! node core's; the handle's store calls reach it through the actor's store relay.

use super::edge::{Command, Edge, Wake};
use crate::mesh::Mesh;
use meshd_proto::node::{Input, Node, Outcome};
use meshd_proto::preflight::Verdict;
use meshd_proto::rendezvous::{RankFailure, Roster};
use tokio::sync::{mpsc, watch};

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
}

impl Library {
    pub fn new(cmds: mpsc::Receiver<Command>, snap: watch::Sender<Snapshot>) -> Library {
        Library { cmds, snap, closed: false }
    }
}

impl Edge for Library {
    async fn next(&mut self) -> Wake {
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

    fn members(&mut self, core: &Node) {
        let m = core.members();
        self.snap.send_modify(|s| s.members = m);
    }

    fn verdict(&mut self, roster: Option<&Roster>, v: &Verdict) {
        self.snap.send_modify(|s| s.verdict = roster.map(|r| (r.clone(), v.clone())));
    }

    /// The library program is the round's "ranks": they run.
    async fn launch(&mut self, _mesh: &Mesh, roster: &Roster, _v: &Verdict, _id: Option<&[u8]>) -> Input {
        self.snap.send_modify(|s| {
            s.roster = Some(roster.clone());
            s.failed = None;
        });
        Input::RanksSpawned
    }

    async fn round_failed(&mut self, reason: &str, _cause: Option<&RankFailure>, restarting: bool) {
        self.snap.send_modify(|s| {
            s.roster = None;
            s.failed = Some((reason.to_string(), restarting));
        });
    }

    fn finished(&mut self, o: &Outcome) {
        self.snap.send_modify(|s| {
            if s.outcome.is_none() {
                s.outcome = Some(o.clone());
            }
        });
    }
}
