//! Node identity.
//!
//! A node is a random 128-bit id chosen at start, not an address: on GPU clouds every
//! instance may carry the same container-bridge address (eth0 172.17.0.4), so two hosts
//! must never be told apart by address alone.

use core::fmt;
use serde::{Deserialize, Serialize};

/// A node's identity for one meshd process lifetime.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
pub struct NodeId(pub [u8; 16]);

impl NodeId {
    /// Builds an id from 128 random bits.
    pub fn from_u128(v: u128) -> Self {
        NodeId(v.to_be_bytes())
    }

    /// The id as a number (for ordering-independent hashing in tests and the simulator).
    pub fn as_u128(&self) -> u128 {
        u128::from_be_bytes(self.0)
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for NodeId {
    /// The first 6 bytes in hex: enough to tell nodes apart in a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}
