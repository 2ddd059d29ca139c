//! What the actor does besides the protocol, behind one trait: an [`Edge`] runs a job's
//! ranks (`meshd run`: `crate::job::JobIo`) or serves a library handle
//! ([`super::library::Library`]). The actor (`super::actor`) is generic over it and knows
//! neither; the edges know the actor only through [`Wake`] and [`Command`].

use crate::mesh::Mesh;
use meshd_proto::NodeId;
use meshd_proto::node::{Input, Node, Outcome};
use meshd_proto::preflight::Verdict;
use meshd_proto::rendezvous::{RankFailure, Roster};
use std::future::Future;
use std::net::IpAddr;
use std::time::Duration;

/// What a library handle asks the actor.
#[derive(Debug)]
pub(crate) enum Command {
    /// Stop the job everywhere (restartable, like a rank failure).
    Abort(String),
    /// This node's work is done: say Done, wait for every member, then end.
    Finish,
    /// Leave now.
    Shutdown,
}

/// What an edge woke the actor with.
pub(crate) enum Wake {
    /// An input for the core.
    Input(Input),
    /// A command of a library handle.
    Command(Command),
    /// The job's ranks stalled this long (the edge collects their stacks: [`Edge::on_stall`]).
    Stalled(Duration),
    /// Nothing to do.
    Nothing,
}

/// The IO a node does besides the protocol; every method answers one of the core's events.
pub(crate) trait Edge {
    /// The next thing the edge has for the actor (cancel-safe: the actor's select drops it
    /// when another input comes first).
    fn next(&mut self) -> impl Future<Output = Wake> + Send;

    /// The membership changed (and once a second): the library shows it.
    fn members(&mut self, _core: &Node) {}

    /// A round begins (round 0 included): the MASTER_PORT to offer on `ip`.
    fn round_began(&mut self, ip: IpAddr) -> u16 {
        crate::preflight::master_port(ip, None)
    }

    /// The round's roster is agreed (before its preflight).
    fn roster_agreed(&mut self, _roster: &Roster, _me: NodeId) {}

    /// The preflight's verdict, with the round's roster.
    fn verdict(&mut self, roster: Option<&Roster>, verdict: &Verdict);

    /// The round launches: start what runs it; the answer is `RanksSpawned` or `SpawnFailed`.
    fn launch(
        &mut self,
        mesh: &Mesh,
        roster: &Roster,
        verdict: &Verdict,
        nccl_id: Option<&[u8]>,
    ) -> impl Future<Output = Input> + Send;

    /// Stop the round's ranks (and what ran beside them).
    fn stop(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Forward `signal` to the ranks (`from`: the node that asked).
    fn forward(&mut self, _signal: i32, _from: Option<&str>) {}

    /// `--fault-tolerance node`: the running job's roster changed (a node joined).
    fn roster_changed(&mut self, _roster: &Roster, _me: NodeId) {}

    /// `--fault-tolerance node`: the replica group at `addr` was dropped from the running
    /// job (`who`, in words); end the ranks' connections to it (and `abort`'s).
    fn group_lost(
        &mut self,
        _addr: std::net::SocketAddr,
        _who: &str,
        _abort: Option<meshd_proto::node::AbortGroup>,
    ) {
    }

    /// The round failed (ranks stopped); `restarting`: a new round follows.
    fn round_failed(
        &mut self,
        reason: &str,
        cause: Option<&RankFailure>,
        restarting: bool,
    ) -> impl Future<Output = ()> + Send;

    /// The ranks stalled for `t`: the input that ends the round, if any.
    fn on_stall(&mut self, _t: Duration) -> impl Future<Output = Option<Input>> + Send {
        async { None }
    }

    /// The node's job is over with `outcome`.
    fn finished(&mut self, _outcome: &Outcome) {}
}
