//! What membership nodes say to each other, what the core asks its driver to send, and
//! what it reports to it.

use crate::id::NodeId;
use crate::meta::NodeMeta;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// Status of a member as this node sees it.
///
/// Displayed (and serialized by name, as `health` in `meshd status --json`) in lowercase:
/// `alive`, `suspect`, `dead`, `left`. On the wire (postcard) it is the variant's index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberStatus {
    /// Answers probes.
    Alive,
    /// Missed a probe; declared Dead unless it refutes in time.
    Suspect,
    /// Declared failed.
    Dead,
    /// Left gracefully.
    Left,
}

impl MemberStatus {
    /// The word `meshd status` shows.
    pub fn name(self) -> &'static str {
        match self {
            MemberStatus::Alive => "alive",
            MemberStatus::Suspect => "suspect",
            MemberStatus::Dead => "dead",
            MemberStatus::Left => "left",
        }
    }

    pub(super) fn is_live(self) -> bool {
        matches!(self, MemberStatus::Alive | MemberStatus::Suspect)
    }
}

impl std::fmt::Display for MemberStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad`, not `write_str`: tables align these words with width specifiers.
        f.pad(self.name())
    }
}

/// One piece of disseminated news about a member.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Update {
    /// The member it is about.
    pub id: NodeId,
    /// The member's incarnation the news refers to.
    pub incarnation: u64,
    /// What happened.
    pub kind: UpdateKind,
}

/// What an [`Update`] says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum UpdateKind {
    /// The member is alive at this address with this metadata.
    Alive {
        /// Advertised address.
        addr: SocketAddr,
        /// Advertised metadata.
        meta: NodeMeta,
    },
    /// `accuser` could not reach the member.
    Suspect {
        /// Who suspects it (distinct accusers shorten the suspicion).
        accuser: NodeId,
    },
    /// `accuser` declared the member dead.
    Dead {
        /// Who declared it.
        accuser: NodeId,
    },
    /// The member left gracefully.
    Left,
}

/// One member's full state, as exchanged by sync.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemberState {
    /// Member id.
    pub id: NodeId,
    /// Advertised address.
    pub addr: SocketAddr,
    /// Advertised metadata.
    pub meta: NodeMeta,
    /// Incarnation of the status below.
    pub incarnation: u64,
    /// Status as the sender sees it.
    pub status: MemberStatus,
}

/// Membership messages between nodes. Append-only: new variants go at the end.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// Direct probe of `target`; answered with an [`Message::Ack`] carrying `seq`.
    Ping {
        /// Sender.
        from: NodeId,
        /// Probe sequence number, echoed in the ack.
        seq: u32,
        /// The node meant to answer (an address may have changed hands).
        target: NodeId,
        /// Piggybacked updates.
        updates: Vec<Update>,
    },
    /// Answer to a [`Message::Ping`].
    Ack {
        /// Sender (the probed node).
        from: NodeId,
        /// The ping's sequence number.
        seq: u32,
        /// Piggybacked updates.
        updates: Vec<Update>,
    },
    /// Request to probe `target` on the sender's behalf.
    PingReq {
        /// Sender (the original prober).
        from: NodeId,
        /// The original probe's sequence number, echoed in the indirect ack.
        seq: u32,
        /// The node to probe.
        target: NodeId,
        /// Where the sender reaches it.
        target_addr: SocketAddr,
        /// Piggybacked updates.
        updates: Vec<Update>,
    },
    /// `target` answered a probe relayed for the receiver.
    IndirectAck {
        /// Sender (the relay).
        from: NodeId,
        /// The original probe's sequence number.
        seq: u32,
        /// The node that answered.
        target: NodeId,
        /// Piggybacked updates.
        updates: Vec<Update>,
    },
    /// Push gossip: updates only.
    Gossip {
        /// Sender.
        from: NodeId,
        /// Updates.
        updates: Vec<Update>,
    },
    /// Push-pull: the sender's whole table; answered with [`Message::SyncResponse`].
    SyncRequest {
        /// Sender.
        from: NodeId,
        /// Sender's member table (itself included).
        members: Vec<MemberState>,
    },
    /// Answer to a [`Message::SyncRequest`]: the responder's whole table.
    SyncResponse {
        /// Sender.
        from: NodeId,
        /// Sender's member table (itself included).
        members: Vec<MemberState>,
    },
}

impl Message {
    pub(super) fn updates_mut(&mut self) -> Option<&mut Vec<Update>> {
        match self {
            Message::Ping { updates, .. }
            | Message::Ack { updates, .. }
            | Message::PingReq { updates, .. }
            | Message::IndirectAck { updates, .. }
            | Message::Gossip { updates, .. } => Some(updates),
            Message::SyncRequest { .. } | Message::SyncResponse { .. } => None,
        }
    }
}

/// How a [`Transmit`] must travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Unreliable (QUIC datagram); encodes to at most `max_datagram` bytes.
    Datagram,
    /// Reliable (QUIC stream); up to 4 MiB.
    Reliable,
}

/// A message for the driver to send.
#[derive(Clone, Debug, PartialEq)]
pub struct Transmit {
    /// Destination address.
    pub to: SocketAddr,
    /// The message.
    pub msg: Message,
    /// How to send it.
    pub delivery: Delivery,
}

/// A member as seen by this node.
#[derive(Clone, Debug, PartialEq)]
pub struct MemberView {
    /// Member id.
    pub id: NodeId,
    /// Advertised address.
    pub addr: SocketAddr,
    /// Advertised metadata.
    pub meta: NodeMeta,
    /// Status.
    pub status: MemberStatus,
    /// Incarnation of that status.
    pub incarnation: u64,
}

/// A change in the membership, for the driver.
#[derive(Clone, Debug, PartialEq)]
pub enum MemberEvent {
    /// A member became Alive for the first time, or again after Dead/Left.
    Up(MemberView),
    /// A live member changed its metadata or address, or refuted a suspicion.
    Updated(MemberView),
    /// A member is suspected.
    Suspect(NodeId),
    /// A member was declared Dead.
    Down(NodeId),
    /// A member left gracefully.
    Left(NodeId),
}
