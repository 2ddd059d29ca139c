//! The datagram header, QUIC-style variable-length integers and packet-number expansion.
//!
//! ```text
//! byte 0      0b0010_000K   K = key phase; the top two bits are 0, which no QUIC v1 packet has
//! byte 1      lane
//! bytes 2..6  the packet number's low 32 bits, big-endian
//! bytes 6..   AEAD ciphertext of the frames, then the 16-byte GCM tag
//! ```
//!
//! The whole 6-byte header is the AEAD's associated data, so none of it can be altered.

use super::PlaneError;

/// Bytes in the plane header.
pub const HEADER_LEN: usize = 6;
/// Bytes in the AES-128-GCM tag that ends every datagram.
pub const TAG_LEN: usize = 16;
/// Header plus tag: what every datagram spends before its first frame byte.
pub const OVERHEAD: usize = HEADER_LEN + TAG_LEN;
/// First byte of a version-1 plane datagram, key phase 0 (phase 1 sets the low bit).
pub const FIRST_BYTE_V1: u8 = 0x20;
/// Low bits of the packet number carried on the wire.
const PN_BITS: u32 = 32;

/// Whether a UDP payload whose first byte is `first` belongs to the data plane rather than
/// QUIC. Every QUIC v1 packet has the fixed bit (0x40) set once greasing is off, except
/// Version Negotiation, whose long-header bit (0x80) is always set; the plane clears both.
pub fn is_plane_datagram(first: u8) -> bool {
    first & 0xC0 == 0
}

/// A parsed plane header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The key phase bit.
    pub phase: bool,
    /// The lane this datagram belongs to.
    pub lane: u8,
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
        if first & !1 != FIRST_BYTE_V1 {
            return Err(PlaneError::UnknownVersion(first));
        }
        Ok(Header {
            phase: first & 1 == 1,
            lane: datagram[1],
            truncated_pn: u32::from_be_bytes([datagram[2], datagram[3], datagram[4], datagram[5]]),
        })
    }

    /// Writes the header into the first [`HEADER_LEN`] bytes of `out`.
    pub fn write(phase: bool, lane: u8, pn: u64, out: &mut [u8]) {
        out[0] = FIRST_BYTE_V1 | phase as u8;
        out[1] = lane;
        out[2..6].copy_from_slice(&(pn as u32).to_be_bytes());
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
        assert!(is_plane_datagram(FIRST_BYTE_V1));
        assert!(is_plane_datagram(FIRST_BYTE_V1 | 1));
        // QUIC short header, long header, and Version Negotiation with a random fixed bit.
        assert!(!is_plane_datagram(0x40));
        assert!(!is_plane_datagram(0xC0));
        assert!(!is_plane_datagram(0x80));
        let mut d = [0u8; OVERHEAD];
        Header::write(true, 3, (7u64 << 32) + 9, &mut d);
        let h = Header::parse(&d).expect("parses");
        assert_eq!(h, Header { phase: true, lane: 3, truncated_pn: 9 });
        d[0] = 0x30;
        assert!(matches!(Header::parse(&d), Err(PlaneError::UnknownVersion(0x30))));
        assert!(matches!(Header::parse(&d[..5]), Err(PlaneError::Short(5))));
    }
}
