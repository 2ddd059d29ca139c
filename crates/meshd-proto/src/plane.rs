//! The data plane: meshd's own AEAD datagrams for bulk transfer, beside QUIC on the same
//! UDP port (docs/PROTOCOL.md, "The data plane").
//!
//! Sans-IO like the rest of this crate: a [`Link`] takes datagrams and `now`, and fills
//! the caller's buffer with sealed datagrams; the IO (socket, GSO/GRO, key export from the
//! QUIC connection) lives in `meshd`. One idea per file:
//! - [`packet`]: the header, varints, packet-number expansion, telling plane from QUIC;
//! - [`keys`]: AES-128-GCM keys from per-direction secrets, nonces, the key update;
//! - [`replay`]: the replay window;
//! - [`ranges`]: sets of numbers as ranges;
//! - [`ack`]: when to acknowledge, and the ACK frame;
//! - [`frame`]: the frames in a packet;
//! - [`incoming`]: the receiver's record of message bytes, for exactly-once delivery;
//! - [`rtt`], [`congestion`]: RTT estimate, CUBIC and the pacer;
//! - [`sender`]: messages, packets in flight, loss detection, retransmission;
//! - [`link`]: all of it composed into one end of a link.

pub mod ack;
pub mod congestion;
pub mod frame;
pub mod incoming;
pub mod keys;
pub mod link;
pub mod packet;
pub mod ranges;
pub mod replay;
pub mod rtt;
pub mod sender;

#[cfg(test)]
mod tests;

pub use keys::LinkKeys;
pub use link::{Link, LinkConfig, LinkStats, Offer, Received, Transmit};
pub use packet::is_plane_datagram;
pub use sender::Event;

/// Why a datagram was refused or a call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaneError {
    /// Shorter than a header and a tag.
    #[error("plane datagram of {0} bytes is shorter than its header and tag")]
    Short(usize),
    /// The first byte names no plane version this end speaks.
    #[error("unknown plane datagram type/version byte {0:#04x}")]
    UnknownVersion(u8),
    /// A datagram whose link id is not this link's (another link's, or a stranger's).
    #[error("plane datagram of link {0:#018x}, not this link's")]
    UnknownLink(u64),
    /// A datagram for another lane reached this link.
    #[error("plane datagram for lane {got} reached lane {want}")]
    WrongLane {
        /// The lane in the header.
        got: u8,
        /// This link's lane.
        want: u8,
    },
    /// The packet number was accepted before.
    #[error("plane packet {0} was already received (replay)")]
    Replayed(u64),
    /// The packet number is older than the replay window.
    #[error("plane packet {0} is older than the replay window")]
    TooOld(u64),
    /// The AEAD tag did not verify: not from the peer, or altered.
    #[error("plane datagram failed authentication")]
    Auth,
    /// An authenticated packet whose frames make no sense.
    #[error("malformed plane packet from the peer: {0}")]
    Malformed(&'static str),
    /// The peer acknowledged a packet this end never sent.
    #[error("the peer acknowledged plane packet {0}, which was never sent")]
    AckOfUnsent(u64),
    /// The peer started a message longer than this end accepts.
    #[error("plane message of {len} bytes exceeds the limit of {max}")]
    MessageTooLong {
        /// The message's length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The peer has too many messages partly delivered.
    #[error("the peer has more than {0} plane messages partly delivered")]
    TooManyMessages(usize),
    /// The application refused the datagram's new fragment (its memory budget for the
    /// peer is spent): dropped unacknowledged, as if lost.
    #[error("plane fragment refused: the receiver's budget for the peer is spent")]
    OverBudget,
    /// A message tag too large for the wire's varints.
    #[error("plane message tag {0:#x} does not fit in 62 bits")]
    TagTooLarge(u64),
    /// A link configuration that cannot work.
    #[error("plane link configuration: {0}")]
    Config(String),
}
