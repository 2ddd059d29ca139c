//! The datagram header, QUIC-style variable-length integers and packet-number expansion.
//!
//! ```text
//! byte 0      0b0010_001K   type/version 2; K = key phase; the top two bits are 0, which no
//!                           QUIC v1 packet has
//! byte 1      lane
//! bytes 2..10 link id: 8 bytes both ends derive from the direction's secret (`keys::link_id`)
//! bytes 10..14 the packet number's low 32 bits, big-endian
//! bytes 14..  AEAD ciphertext of the frames, then the 16-byte GCM tag
//! ```
//!
//! The whole 14-byte header is the AEAD's associated data, so none of it can be altered.
//! The link id lets a receiver pick the one link whose keys may open a datagram, and drop
//! a datagram no link of its own expects before any cryptography: an off-path spoofer,
//! who never sees the id, cannot make a node spend an AES-GCM open (docs/PROTOCOL.md).

use super::PlaneError;

/// Bytes in the plane header.
pub const HEADER_LEN: usize = 14;
/// Bytes in the AES-128-GCM tag that ends every datagram.
pub const TAG_LEN: usize = 16;
/// Header plus tag: what every datagram spends before its first frame byte.
pub const OVERHEAD: usize = HEADER_LEN + TAG_LEN;
/// First byte of a plane datagram of the version this end speaks (2), key phase 0 (phase 1
/// sets the low bit). Version 1 (0x20, no link id) is not spoken any more.
pub const FIRST_BYTE: u8 = 0x22;
/// Low bits of the packet number carried on the wire.
const PN_BITS: u32 = 32;

/// Whether a UDP payload whose first byte is `first` belongs to the data plane rather than
/// QUIC. Every QUIC v1 packet has the fixed bit (0x40) set once greasing is off, except
/// Version Negotiation, whose long-header bit (0x80) is always set; the plane clears both.
pub fn is_plane_datagram(first: u8) -> bool {
    first & 0xC0 == 0
}

/// The link id of a plane datagram of this version, read without any other check: what a
/// socket looks up to tell a datagram some link expects from one none does. `None` when
/// `datagram` is too short to be one or of another version.
pub fn link_id_of(datagram: &[u8]) -> Option<u64> {
    if datagram.len() < OVERHEAD || datagram[0] & !1 != FIRST_BYTE {
        return None;
    }
    let mut id = [0u8; 8];
    id.copy_from_slice(&datagram[2..10]);
    Some(u64::from_be_bytes(id))
}

/// A parsed plane header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The key phase bit.
    pub phase: bool,
    /// The lane this datagram belongs to.
    pub lane: u8,
    /// The id of the link (and direction) it belongs to.
    pub link_id: u64,
    /// The packet number's low 32 bits as sent.
    pub truncated_pn: u32,
}

impl Header {
    /// Parses the header of `datagram` without touching any state.
    pub fn parse(datagram: &[u8]) -> Result<Header, PlaneError> {
        if datagram.len() < OVERHEAD {
            return Err(PlaneError::Short(datagram.len()));
        }
        let first = datagram[0];
        if first & !1 != FIRST_BYTE {
            return Err(PlaneError::UnknownVersion(first));
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&datagram[2..10]);
        Ok(Header {
            phase: first & 1 == 1,
            lane: datagram[1],
            link_id: u64::from_be_bytes(id),
            truncated_pn: u32::from_be_bytes([datagram[10], datagram[11], datagram[12], datagram[13]]),
        })
    }

    /// Writes the header into the first [`HEADER_LEN`] bytes of `out`.
    pub fn write(phase: bool, lane: u8, link_id: u64, pn: u64, out: &mut [u8]) {
        out[0] = FIRST_BYTE | phase as u8;
        out[1] = lane;
        out[2..10].copy_from_slice(&link_id.to_be_bytes());
        out[10..14].copy_from_slice(&(pn as u32).to_be_bytes());
    }
}

/// Recovers a full packet number from its low 32 bits, choosing the candidate closest to
/// `largest + 1` (RFC 9000, Appendix A.3).
pub fn expand_pn(largest: Option<u64>, truncated: u32) -> u64 {
    let expected = largest.map_or(0, |l| l + 1);
    let win = 1u64 << PN_BITS;
    let hwin = win / 2;
    let mask = win - 1;
    let candidate = (expected & !mask) | u64::from(truncated);
    if candidate + hwin <= expected && candidate < (1u64 << 62) - win {
        candidate + win
    } else if candidate > expected + hwin && candidate >= win {
        candidate - win
    } else {
        candidate
    }
}

/// Bytes a QUIC variable-length integer takes for `v` (`v < 2^62`).
pub fn varint_len(v: u64) -> usize {
    match v {
        0..=63 => 1,
        64..=16_383 => 2,
        16_384..=1_073_741_823 => 4,
        _ => 8,
    }
}

/// Largest value a varint can carry.
pub const VARINT_MAX: u64 = (1 << 62) - 1;

/// Appends `v` as a QUIC varint at `out[*pos..]`, advancing `pos`. The caller sized `out`.
pub fn put_varint(out: &mut [u8], pos: &mut usize, v: u64) {
    put_varint_width(out, pos, v, varint_len(v));
}

/// Appends `v` as a QUIC varint of `n` bytes (1, 2, 4 or 8, at least `varint_len(v)`);
/// QUIC allows the longer encodings, and they keep a message's fragments the same size.
pub fn put_varint_width(out: &mut [u8], pos: &mut usize, v: u64, n: usize) {
    debug_assert!(v <= VARINT_MAX && n >= varint_len(v));
    let tag = match n {
        1 => 0u64,
        2 => 1,
        4 => 2,
        _ => 3,
    };
    let wire = v | (tag << (8 * n - 2));
    out[*pos..*pos + n].copy_from_slice(&wire.to_be_bytes()[8 - n..]);
    *pos += n;
}

/// Reads a QUIC varint at `buf[*pos..]`, advancing `pos`.
pub fn get_varint(buf: &[u8], pos: &mut usize) -> Result<u64, PlaneError> {
    let first = *buf.get(*pos).ok_or(PlaneError::Malformed("truncated varint"))?;
    let n = 1usize << (first >> 6);
    let bytes = buf.get(*pos..*pos + n).ok_or(PlaneError::Malformed("truncated varint"))?;
    let mut v = u64::from(first & 0x3f);
    for b in &bytes[1..] {
        v = (v << 8) | u64::from(*b);
    }
    *pos += n;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_at_every_width_boundary() {
        for v in [0, 63, 64, 16_383, 16_384, 1_073_741_823, 1_073_741_824, VARINT_MAX] {
            let mut buf = [0u8; 8];
            let mut pos = 0;
            put_varint(&mut buf, &mut pos, v);
            assert_eq!(pos, varint_len(v));
            let mut rpos = 0;
            assert_eq!(get_varint(&buf[..pos], &mut rpos).expect("decodes"), v);
            assert_eq!(rpos, pos);
            assert!(get_varint(&buf[..pos - 1], &mut 0).is_err() || pos == 1);
        }
    }

    #[test]
    fn packet_numbers_expand_across_the_32_bit_wrap() {
        assert_eq!(expand_pn(None, 0), 0);
        assert_eq!(expand_pn(Some(10), 9), 9);
        let big = (5u64 << 32) + 0xFFFF_FFF0;
        assert_eq!(expand_pn(Some(big), 0x0000_0005), (6u64 << 32) + 5);
        assert_eq!(expand_pn(Some((6u64 << 32) + 5), 0xFFFF_FFF0), big);
        assert_eq!(expand_pn(Some(big), big as u32), big);
    }

    #[test]
    fn first_byte_separates_plane_from_quic() {
        assert!(is_plane_datagram(FIRST_BYTE));
        assert!(is_plane_datagram(FIRST_BYTE | 1));
        // QUIC short header, long header, and Version Negotiation with a random fixed bit.
        assert!(!is_plane_datagram(0x40));
        assert!(!is_plane_datagram(0xC0));
        assert!(!is_plane_datagram(0x80));
        let mut d = [0u8; OVERHEAD];
        Header::write(true, 3, 0x0102_0304_0506_0708, (7u64 << 32) + 9, &mut d);
        let h = Header::parse(&d).expect("parses");
        assert_eq!(h, Header { phase: true, lane: 3, link_id: 0x0102_0304_0506_0708, truncated_pn: 9 });
        assert_eq!(link_id_of(&d), Some(0x0102_0304_0506_0708));
        assert_eq!(link_id_of(&d[..OVERHEAD - 1]), None);
        // Version 1 (no link id) and other type bytes are refused.
        for first in [0x20, 0x21, 0x30] {
            d[0] = first;
            assert!(matches!(Header::parse(&d), Err(PlaneError::UnknownVersion(f)) if f == first));
            assert_eq!(link_id_of(&d), None);
        }
        assert!(matches!(Header::parse(&d[..5]), Err(PlaneError::Short(5))));
    }
}
