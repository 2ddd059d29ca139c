//! The job protocol's message catalogue between nodes (`Frame::Rdzv` on the wire): the
//! rendezvous' `Propose`, `Ack` and `Commit`, the preflight's exchanges, and the
//! lifecycle's `Abort`, `AbortAck`, `Done` and `Signal`. Defined here, beside no core, so
//! that the rendezvous, the preflight and the node core each import it without importing
//! each other. Append-only, as every wire enum.

use crate::id::NodeId;
use crate::roster::Roster;
use serde::{Deserialize, Serialize};

/// Rendezvous and job-lifecycle messages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    /// Master -> all: the roster to acknowledge.
    Propose(Roster),
    /// Member -> master: roster accepted.
    Ack {
        /// Restart round.
        restart: u32,
        /// Epoch acknowledged.
        epoch: u64,
    },
    /// Master -> all: every member acknowledged; start.
    Commit {
        /// Restart round.
        restart: u32,
        /// Epoch committed.
        epoch: u64,
    },
    /// Any -> all: stop the job now.
    Abort {
        /// Restart round.
        restart: u32,
        /// Node that failed (or stopped the job).
        node: NodeId,
        /// Its host name.
        hostname: String,
        /// Global rank that failed, if a rank did.
        rank: Option<u32>,
        /// What happened, in words.
        reason: String,
        /// The failed rank's details (exception, traceback, exit status), when a rank failed
        /// (boxed: it is large, and every other message is small).
        cause: Option<Box<RankFailure>>,
    },
    /// Any -> all: all my ranks exited 0.
    Done {
        /// Restart round.
        restart: u32,
    },
    /// Any -> all after a commit: the TCP port this node listens on for the preflight.
    PreflightHello {
        /// Restart round.
        restart: u32,
        /// Ephemeral TCP port on the chosen interface.
        tcp_port: u16,
        /// The NCCL unique id (from the master only).
        nccl_id: Option<Vec<u8>>,
    },
    /// Any -> all: what this node found in the preflight.
    PreflightReport {
        /// Restart round.
        restart: u32,
        /// The findings.
        report: crate::preflight::NodeReport,
    },
    /// Any -> all: a signal a meshd received (SIGUSR1, SIGUSR2) for every rank; the job goes on.
    Signal {
        /// Restart round.
        restart: u32,
        /// The signal number.
        signal: i32,
        /// Host name of the node that received it.
        hostname: String,
    },
    /// Reply to [`Message::Abort`]: the abort of round `restart` arrived. The aborting node
    /// repeats its `Abort` to every roster member until each acknowledged or is dead.
    AbortAck {
        /// Restart round of the `Abort` acknowledged.
        restart: u32,
    },
    /// A node started after the launch (`--fault-tolerance node`) -> the running job's
    /// members: admit me (the decider answers with [`Message::FtRoster`]).
    FtJoin {
        /// The node as it would stand in the roster.
        member: crate::roster::RosterMember,
    },
    /// The decider of a `--fault-tolerance node` job -> every live member and a joiner: the
    /// job's roster now (a higher `epoch` replaces a lower one; a member's index is its
    /// replica group) and the collective the ranks use.
    FtRoster {
        /// The roster.
        roster: Roster,
        /// The launched job's collective (a joiner skips the preflight).
        collective: crate::preflight::Collective,
    },
    /// Any node -> the lighthouse's decider: its ranks' torchft quorum request `req`.
    LhAsk {
        /// The asking node's id for the request.
        req: u64,
        /// The requester (torchft's QuorumMember).
        member: crate::lighthouse::Member,
        /// The highest quorum id the asking node has seen.
        seen: i64,
    },
    /// Any node -> the decider: a heartbeat of one of its ranks' replicas.
    LhBeat {
        /// The replica.
        replica_id: String,
    },
    /// Any node -> the decider: request `req` is no longer waited for.
    LhCancel {
        /// The request.
        req: u64,
    },
    /// Any node -> the decider: its ranks failed; these replicas are gone.
    LhGone {
        /// The replicas.
        replica_ids: Vec<String>,
    },
    /// The decider -> the node that asked: the quorum that answers its request `req`.
    LhAnswer {
        /// The request.
        req: u64,
        /// The quorum.
        quorum: crate::lighthouse::Quorum,
    },
    /// The decider -> a node whose ranks have not asked for a quorum that others wait in:
    /// the roll call (is its meshd there?). Answered at once with [`Message::LhPong`].
    LhPing {
        /// Echoed in the answer.
        nonce: u64,
    },
    /// A node -> the decider: here (the answer to [`Message::LhPing`] `nonce`).
    LhPong {
        /// The ping's nonce.
        nonce: u64,
    },
}

/// Why a rank failed, as the node that ran it saw it; travels in [`Message::Abort`] so that
/// every node prints the same root cause and exits with the same status.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankFailure {
    /// Host name of the rank's node.
    pub host: String,
    /// The node's address on the chosen interface.
    pub addr: String,
    /// The node's rank.
    pub node_rank: u32,
    /// Global rank.
    pub rank: u32,
    /// Local rank.
    pub local_rank: u32,
    /// How it ended, in words ("exited with status 1", "killed by signal 9 (SIGKILL)").
    pub exit: String,
    /// meshd's exit status for it: the rank's exit code, 128 + signal when killed.
    pub status: u8,
    /// When it failed (seconds since the Unix epoch; the error file's time when it has one).
    pub time: u64,
    /// The exception ("ValueError: ...") from the rank's error file, or what meshd knows.
    pub message: String,
    /// The traceback from the error file, else the rank's last stderr lines (bounded).
    pub traceback: String,
    /// Where `traceback` came from.
    pub source: FailureSource,
}

/// Where a [`RankFailure`]'s traceback came from. On the wire it is its word
/// ([`FailureSource::as_str`], a string as it always was): the encoding is unchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailureSource {
    /// Not known (an empty word on the wire).
    #[default]
    Unknown,
    /// The rank's error file (`TORCHELASTIC_ERROR_FILE`, `@record`).
    ErrorFile,
    /// The rank's last stderr lines.
    Stderr,
    /// The stacks of stalled ranks (`--stall-timeout`).
    Stall,
}

impl FailureSource {
    /// Its word: "error file", "stderr", "stall" ("" when not known).
    pub fn as_str(self) -> &'static str {
        match self {
            FailureSource::Unknown => "",
            FailureSource::ErrorFile => "error file",
            FailureSource::Stderr => "stderr",
            FailureSource::Stall => "stall",
        }
    }

    /// The source a word names (an unknown word: [`FailureSource::Unknown`]).
    pub fn from_word(w: &str) -> FailureSource {
        [FailureSource::ErrorFile, FailureSource::Stderr, FailureSource::Stall]
            .into_iter()
            .find(|s| s.as_str() == w)
            .unwrap_or_default()
    }
}

impl Serialize for FailureSource {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for FailureSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = String::deserialize(d)?;
        Ok(FailureSource::from_word(&w))
    }
}

#[cfg(test)]
mod tests {
    use super::FailureSource;

    /// The typed source travels as the word it always was: the same bytes as a string.
    #[test]
    fn a_failure_source_is_its_word_on_the_wire() {
        for s in
            [FailureSource::Unknown, FailureSource::ErrorFile, FailureSource::Stderr, FailureSource::Stall]
        {
            let bytes = crate::wire::encode(&s);
            assert_eq!(bytes, crate::wire::encode(&s.as_str().to_string()));
            assert_eq!(crate::wire::decode::<FailureSource>(&bytes).ok(), Some(s));
        }
        let other = crate::wire::encode(&"a word of a later version".to_string());
        assert_eq!(crate::wire::decode::<FailureSource>(&other).ok(), Some(FailureSource::Unknown));
    }
}
