//! The wire: versioned postcard frames, bounded in size.
//!
//! Every QUIC connection between two nodes starts with an [`AuthHello`] exchange on its
//! first bidirectional stream (the protocol version travels there as well as in the ALPN
//! `meshd/6`). After that, [`Frame`]s travel either as QUIC datagrams (gossip probes, where
//! loss is information) or length-prefixed on unidirectional streams (everything that must
//! arrive). Enums are append-only: a new variant goes at the end so older nodes decode the
//! old ones unchanged and refuse the new ones with a clear error.

use crate::id::NodeId;
use crate::store::{StoreError, Version};
use crate::{membership, rendezvous};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// Version of the frame format; bumped on any incompatible change.
pub const PROTOCOL_VERSION: u16 = 6;
/// ALPN protocol id; a peer speaking another version fails the TLS handshake.
pub const ALPN: &[u8] = b"meshd/6";
/// Largest frame accepted on a stream. Bigger length prefixes are refused before reading.
pub const MAX_FRAME: usize = 4 << 20;

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

/// Why a frame could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// Longer than [`MAX_FRAME`].
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    /// Not a valid encoding (truncated, unknown variant, bad varint...).
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// Valid prefix followed by garbage.
    #[error("{0} trailing bytes after frame")]
    Trailing(usize),
}

/// Encodes any wire value with postcard.
pub fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // postcard only fails on serializers that cannot represent a value (never for our
    // derive-generated types into a Vec), so an empty frame here is unreachable in practice
    // and would be rejected by the peer's decoder rather than crash us.
    postcard::to_allocvec(v).unwrap_or_default()
}

/// Decodes a complete wire value, refusing oversized input and trailing bytes.
pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, WireError> {
    if bytes.len() > MAX_FRAME {
        return Err(WireError::TooLarge(bytes.len()));
    }
    let (v, rest) = postcard::take_from_bytes(bytes).map_err(|e| WireError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::Trailing(rest.len()));
    }
    Ok(v)
}

/// Prefixes an encoded frame with its length (u32 big-endian) for a stream.
pub fn frame_with_len(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// Reads a length prefix, refusing lengths over [`MAX_FRAME`] before any allocation.
pub fn check_len(prefix: [u8; 4]) -> Result<usize, WireError> {
    let n = u32::from_be_bytes(prefix) as usize;
    if n > MAX_FRAME {
        return Err(WireError::TooLarge(n));
    }
    Ok(n)
}

#[cfg(test)]
mod tests;
