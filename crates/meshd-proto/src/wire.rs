//! The wire: versioned postcard frames, bounded in size.
//!
//! Every QUIC connection between two nodes starts with an [`AuthHello`] exchange on its
//! first bidirectional stream (the protocol version travels there as well as in the ALPN
//! `meshd/9`). After that, [`Frame`]s travel either as QUIC datagrams (gossip probes, where
//! loss is information) or length-prefixed on unidirectional streams (everything that must
//! arrive). Enums are append-only: a new variant goes at the end so older nodes decode the
//! old ones unchanged and refuse the new ones with a clear error.

use crate::id::NodeId;
use crate::{membership, rendezvous};

pub use crate::codec;
pub use crate::store::{MAX_STORE_KEY, MAX_STORE_VALUE, StoreMsg};
pub use codec::{MAX_FRAME, WireError, check_len, decode, encode, frame_with_len};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// Version of the frame format; bumped on any incompatible change.
pub const PROTOCOL_VERSION: u16 = 9;
/// ALPN protocol id; a peer speaking another version fails the TLS handshake.
pub const ALPN: &[u8] = b"meshd/9";

/// First message each side sends on a new connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthHello {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub version: u16,
    /// Sender's node id.
    pub node: NodeId,
    /// Hash of the sender's run id: a node of another run is refused with that reason.
    pub run_hash: u64,
    /// The accepting side's key confirmation (`confirm_s`, see meshd's `transport::auth`);
    /// all zero from the connecting side and without a token.
    pub mac: [u8; 32],
    /// Whether the sender holds a token at all (to word the refusal).
    pub has_token: bool,
    /// The address the sender saw its peer connect from (server side only): the peer's
    /// proof of which of its addresses is really reachable.
    pub observed: Option<SocketAddr>,
    /// 0 for a node's connection to a peer; `k` in `1..=`[`MAX_LANES`]` - 1` for the k-th
    /// extra connection ("lane") that carries only bulk collective data, so that several
    /// connections' packet work and encryption run on several cores.
    pub lane: u8,
    /// The sender's SPAKE2 message (none without a token). Fixed-size: decoding a hello
    /// allocates nothing, whatever an unauthenticated peer sends.
    pub pake: Option<PakeMessage>,
}

/// A SPAKE2 message: its side byte and an Ed25519 point (33 bytes on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PakeMessage {
    /// SPAKE2's side byte.
    pub side: u8,
    /// The compressed point.
    pub point: [u8; 32],
}

impl PakeMessage {
    /// From SPAKE2's 33-byte message; `None` for any other length.
    pub fn from_bytes(b: &[u8]) -> Option<PakeMessage> {
        let (&side, rest) = b.split_first()?;
        Some(PakeMessage { side, point: rest.try_into().ok()? })
    }

    /// SPAKE2's 33-byte message.
    pub fn to_bytes(&self) -> [u8; 33] {
        let mut b = [0u8; 33];
        b[0] = self.side;
        b[1..].copy_from_slice(&self.point);
        b
    }
}

/// Most connections (the main one and its lanes) one node opens to another.
pub const MAX_LANES: usize = 16;

/// Everything nodes say to each other once authenticated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Frame {
    /// Membership gossip (SWIM probes, acks, dissemination, sync).
    Gossip(membership::Message),
    /// Rendezvous: roster proposal, acknowledgement, commit.
    Rdzv(rendezvous::Message),
    /// The job-wide key-value store: a value set on one node, copied to every node.
    Store(StoreMsg),
}

/// A question asked on a probe connection (`meshd status`), on its own bidirectional stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Query {
    /// The members of the mesh as the answering node sees them.
    Status,
    /// The answering node's tunnel counters: an `Option<TunnelReply>` (`None` when its job
    /// does not run in tunnel mode). A node older than this variant closes the probe
    /// connection ("bad query").
    Tunnel,
}

/// Counters of a node's TCP tunnel (tunnel mode), answered to [`Query::Tunnel`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TunnelReply {
    /// Connections this node's ranks opened through the tunnel.
    pub opened: u64,
    /// Connections of this node's ranks that failed (refused, unreachable, timed out).
    pub failed: u64,
    /// Connections other nodes' ranks opened to this node.
    pub served: u64,
    /// Tunnelled connections open now (both ends).
    pub active: u64,
    /// Bytes sent to other nodes through the tunnel.
    pub bytes_out: u64,
    /// Bytes received from other nodes through the tunnel.
    pub bytes_in: u64,
}

/// One member in a [`StatusReply`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusMember {
    /// Node id.
    pub id: NodeId,
    /// Host name.
    pub hostname: String,
    /// Address on its chosen interface.
    pub addr: SocketAddr,
    /// Chosen interface.
    pub iface: String,
    /// GPUs it found.
    pub gpus: u32,
    /// Processes it starts.
    pub nproc: u32,
    /// Job state it advertises.
    pub state: crate::NodeState,
    /// Membership verdict.
    pub health: crate::membership::MemberStatus,
    /// Round-trip time from the answering node, microseconds.
    pub rtt_us: Option<u64>,
    /// Its place in the roster.
    pub role: MemberRole,
    /// Restarts so far.
    pub restarts: u32,
}

/// A member's place in the roster, as `meshd status` shows it.
///
/// Displayed (and serialized by name, as in `meshd status --json`) in lowercase: `master`,
/// `worker`, `waiting`. On the wire (postcard) it is the variant's index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberRole {
    /// The roster's master (node rank 0).
    Master,
    /// Another roster member.
    Worker,
    /// No roster yet.
    Waiting,
}

impl MemberRole {
    /// The word `meshd status` shows.
    pub fn name(self) -> &'static str {
        match self {
            MemberRole::Master => "master",
            MemberRole::Worker => "worker",
            MemberRole::Waiting => "waiting",
        }
    }
}

impl std::fmt::Display for MemberRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad`, not `write_str`: tables align these words with width specifiers.
        f.pad(self.name())
    }
}

/// Answer to [`Query::Status`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct StatusReply {
    /// The answering node.
    pub node: NodeId,
    /// Everyone it knows, itself included.
    pub members: Vec<StatusMember>,
}

#[cfg(test)]
mod tests;
