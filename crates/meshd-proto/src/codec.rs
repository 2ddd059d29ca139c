//! The codec: postcard encoding, decoding bounded in size, and length prefixes. A leaf:
//! the protocol cores that only need sizes and bytes (membership, the store) use it without
//! the frame catalogue of [`crate::wire`] (which re-exports it as `wire::codec`).

use serde::{Deserialize, Serialize};

/// Largest frame accepted on a stream. Bigger length prefixes are refused before reading.
pub const MAX_FRAME: usize = 4 << 20;

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
