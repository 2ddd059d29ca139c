//! The core's vocabulary with its driver: the [`Input`]s the IO hands it and what it asks
//! back ([`Event`], [`Transmit`]).

use super::{StoreAnswer, StoreCall, WaitReport};
use crate::id::NodeId;
use crate::membership::{Delivery, MemberEvent};
use crate::preflight::{TcpProbe, Verdict};
use crate::rendezvous::{RankFailure, Roster};
use crate::wire::Frame;
use std::net::SocketAddr;

/// Something the IO tells the core.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// A frame from an authenticated peer: `from` is the address it came from, `node` its id.
    Frame {
        /// Transport address of the sender.
        from: SocketAddr,
        /// Authenticated id of the sender.
        node: NodeId,
        /// The frame.
        frame: Frame,
    },
    /// Packets arrived from `node` since the last look (its link's own traffic is proof of
    /// life even when probe answers queue behind bulk data).
    HeardFrom(NodeId),
    /// More addresses to join through (names that resolved late).
    Seeds(Vec<SocketAddr>),
    /// Answer to [`Event::RoundBegan`]: the MASTER_PORT this node offers in that round.
    MasterPort {
        /// The round that asked (an answer of an earlier round is dropped).
        round: u32,
        /// A free TCP port on the chosen interface.
        port: u16,
    },
    /// Answer to [`Event::StartPreflight`]: the preflight listener is bound.
    PreflightReady {
        /// The round that asked (the roster's `restart`): an answer of an earlier round is
        /// dropped.
        round: u32,
        /// Its TCP port on the chosen interface.
        tcp_port: u16,
        /// The NCCL unique id (master only; `None` when it could not make one).
        nccl_id: Option<Vec<u8>>,
        /// Why there is no id, when the master has none.
        nccl_note: Option<String>,
        /// This node's own failures (MASTER_PORT cannot be bound on the master).
        problems: Vec<TcpProbe>,
    },
    /// Answer to [`Event::StartPreflight`]: the listener could not be bound.
    PreflightFailed {
        /// The round that asked (an answer of an earlier round is dropped).
        round: u32,
        /// Why, in words.
        why: String,
    },
    /// Answer to [`Event::Dial`].
    Dialed {
        /// The round that asked (an answer of an earlier round is dropped).
        round: u32,
        /// One result per target (and the NCCL root probe, if any).
        probes: Vec<TcpProbe>,
        /// The NCCL id's root address as decoded here (`None` without an id).
        nccl_root: Option<String>,
    },
    /// A store request of the IO (a rank's `store_set` / `store_get`, the library's) for
    /// restart round `round`: answered by [`Event::StoreReply`] with the same `req`.
    Store {
        /// The round it belongs to (a request of another round is answered at once).
        round: u32,
        /// The IO's id for the request.
        req: u64,
        /// What it asks.
        call: StoreCall,
    },
    /// Answer to [`Event::Launch`]: the ranks run.
    RanksSpawned,
    /// Answer to [`Event::Launch`]: the ranks could not be started.
    SpawnFailed(String),
    /// Every local rank exited 0.
    RanksExited,
    /// A library program is done with the job on this node (it has no ranks of its own: it
    /// is the ranks): the round counts as its ranks exited 0 as soon as it runs, this one
    /// and any later one.
    Finish,
    /// A local rank failed (or stalled): the job stops everywhere.
    RankFailed {
        /// Global rank, when one rank is to blame.
        rank: Option<u32>,
        /// What happened, in words.
        reason: String,
        /// The rank's details (exit, exception, traceback).
        cause: Option<Box<RankFailure>>,
    },
    /// Answer to [`Event::StopRanks`]: every local rank is gone.
    RanksStopped,
    /// This node received a signal for every rank (SIGUSR1/2): forward it everywhere.
    Signal(i32),
    /// This node was asked to stop (SIGINT, SIGTERM): abort everywhere, never restart.
    Stop {
        /// What happened, in words ("interrupted (SIGINT)").
        what: String,
        /// Exit status.
        code: u8,
    },
    /// The library user aborts the job (restartable, like a rank failure).
    Abort(String),
    /// Leave the mesh gracefully (the driver shuts down).
    Leave,
    /// `--fault-tolerance node`: a rank's torchft Lighthouse `Quorum` call, answered by
    /// [`Event::LhQuorum`] with the same `req` (its `address` already pointing at this node).
    LhQuorum {
        /// The IO's id for the call.
        req: u64,
        /// The requester.
        member: crate::lighthouse::Member,
    },
    /// A rank's Lighthouse `Heartbeat` call.
    LhHeartbeat {
        /// The replica.
        replica_id: String,
    },
    /// The caller of [`Input::LhQuorum`] `req` went away.
    LhCancel {
        /// The call.
        req: u64,
    },
}

/// What [`Event::GroupLost`] ends besides the connections to the lost node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortGroup {
    /// The other live members' hosts.
    pub peers: Vec<std::net::IpAddr>,
    /// The endpoints to leave alone: the quorum's managers and stores.
    pub keep: Vec<std::net::SocketAddr>,
}

/// Something the IO must do or know.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A membership change (for status displays).
    Member(MemberEvent),
    /// A line for the log.
    Log(Level, String),
    /// Waiting for nodes: the progress report (the IO adds what only it knows: listed
    /// peers that never answered, authentication refusals).
    Waiting(WaitReport),
    /// A round began (round 0 at the start, then every restart round): answer
    /// [`Input::MasterPort`] with the MASTER_PORT to offer should this node be master. The
    /// round proposes no roster before.
    RoundBegan {
        /// The round.
        restart: u32,
    },
    /// The roster of this round is agreed.
    RosterAgreed(Roster),
    /// Bind the preflight listener (and MASTER_PORT and the NCCL id on the master); answer
    /// [`Input::PreflightReady`] or [`Input::PreflightFailed`] with the roster's round
    /// (`roster.restart`).
    StartPreflight {
        /// The roster.
        roster: Roster,
        /// Whether this node is master.
        master: bool,
    },
    /// Dial these TCP targets (and the NCCL id's root, if an id is given); answer
    /// [`Input::Dialed`] with the same `round`.
    Dial {
        /// The round that asks.
        round: u32,
        /// Where to connect.
        targets: Vec<DialTarget>,
        /// The round's NCCL id (probe its root too).
        nccl_id: Option<Vec<u8>>,
    },
    /// The preflight's verdict (before [`Event::Launch`], or before the refusal).
    Preflight(Verdict),
    /// Start the local ranks; answer [`Input::RanksSpawned`] or [`Input::SpawnFailed`].
    Launch {
        /// The roster.
        roster: Roster,
        /// The preflight's verdict (the collective to use).
        verdict: Verdict,
        /// The NCCL unique id for every rank.
        nccl_id: Option<Vec<u8>>,
    },
    /// Stop the local ranks; answer [`Input::RanksStopped`].
    StopRanks,
    /// Send `signal` to every local rank (`from`: the peer that asked, `None` for this node).
    ForwardSignal {
        /// Signal number.
        signal: i32,
        /// Who asked, in words ("node gpu-3 (10.0.0.3)").
        from: Option<String>,
    },
    /// A roster member is finished with this round: its ranks all exited (it said Done),
    /// or it left or died. The store stops waiting for its acknowledgements.
    PeerFinished(NodeId),
    /// `--fault-tolerance node`: a member's replica group was dropped from the running job
    /// (its node died or left while its ranks ran). The IO ends this node's ranks'
    /// connections to `addr`'s host (and the tunnel's), so that their collectives with it
    /// fail now, not at Gloo's or NCCL's timeout.
    GroupLost {
        /// The lost member's roster address.
        addr: std::net::SocketAddr,
        /// Who, in words ("node gpu-3 (10.0.0.3), replica group 2").
        who: String,
        /// The last quorum this node's ranks were given included the lost group: their
        /// process group's collectives are doomed, and a survivor waiting on a live peer
        /// that gave up (the dead one's neighbour in a ring) would wait for its timeout
        /// too. The IO ends every connection of the ranks to these peers' hosts except
        /// the groups' managers and stores (`keep`), so that every survivor fails the step
        /// now and asks for the next quorum.
        abort: Option<AbortGroup>,
    },
    /// `--fault-tolerance node`: the running job's roster changed (a node joined in a lost
    /// node's slot or a new one; its `epoch` grew). The IO lets the joiner's connections in
    /// (the tunnel's routes and the members it serves).
    RosterChanged(Roster),
    /// The answer to [`Input::Store`] request `req`.
    StoreReply {
        /// The request.
        req: u64,
        /// Its answer.
        answer: StoreAnswer,
    },
    /// A round ended in failure, ranks stopped (print the cause once).
    RoundFailed {
        /// The round.
        restart: u32,
        /// What happened.
        reason: String,
        /// The failed rank's details.
        cause: Option<Box<RankFailure>>,
        /// Whether a new round follows.
        restarting: bool,
    },
    /// The job is over on this node; the driver exits with `outcome.code`.
    Finished(Outcome),
    /// The answer to [`Input::LhQuorum`] `req`.
    LhQuorum {
        /// The call.
        req: u64,
        /// The quorum (the same participants and id on every member's node).
        quorum: crate::lighthouse::Quorum,
    },
}

/// Severity of an [`Event::Log`] line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Details.
    Debug,
    /// Progress.
    Info,
    /// Something is off but the job goes on.
    Warn,
    /// The job stops.
    Error,
}

/// A TCP target of the preflight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DialTarget {
    /// The member dialled.
    pub to: NodeId,
    /// Where.
    pub addr: SocketAddr,
    /// Which port.
    pub what: crate::preflight::TcpTarget,
}

/// How the job ended on this node.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// Exit status.
    pub code: u8,
    /// One line saying what happened.
    pub message: String,
    /// Which kind of end.
    pub kind: OutcomeKind,
}

/// Kinds of [`Outcome`].
#[derive(Clone, Debug, PartialEq)]
pub enum OutcomeKind {
    /// Every rank everywhere exited 0.
    Success,
    /// The job failed (or was refused, or stopped before launch).
    Failed,
    /// A signal stopped it.
    Stopped,
    /// No roster formed in time; the report says why (the IO adds what it knows).
    TimedOut(Box<WaitReport>),
}

/// A frame for the driver to send.
#[derive(Clone, Debug, PartialEq)]
pub struct Transmit {
    /// Destination.
    pub to: SocketAddr,
    /// The frame.
    pub frame: Frame,
    /// How it must travel.
    pub delivery: Delivery,
}
