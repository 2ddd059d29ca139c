//! The data plane's datagram header, read by every node from any sender before anything
//! else (a spoofer's datagrams included): `packet::Header::parse`, the socket's
//! `packet::link_id_of`, packet-number expansion and QUIC varints.
//!
//! Checks:
//! - nothing allocates;
//! - `Header::parse` succeeds exactly when the datagram is at least a header and a tag
//!   long and its first byte is this version's (either key phase); `link_id_of` agrees
//!   with it; writing the parsed header back gives the same 14 bytes;
//! - the expanded packet number keeps the low 32 bits it was given and is the candidate
//!   nearest the expected one (within 2^31 of it, below 2^62);
//! - a varint that decodes re-encodes (shortest form) to at most the bytes it took and
//!   decodes to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshd_fuzz::measure;
use meshd_proto::plane::packet::{
    FIRST_BYTE, HEADER_LEN, Header, OVERHEAD, expand_pn, get_varint, link_id_of, put_varint, varint_len,
};

fuzz_target!(|data: &[u8]| {
    let ((parsed, id), heap) = measure(|| (Header::parse(data), link_id_of(data)));
    assert_eq!(heap.allocs, 0, "reading a header allocated");
    let valid = data.len() >= OVERHEAD && data[0] & !1 == FIRST_BYTE;
    assert_eq!(parsed.is_ok(), valid, "{parsed:?} for {} bytes", data.len());
    assert_eq!(id, parsed.as_ref().ok().map(|h| h.link_id));
    if let Ok(h) = parsed {
        let mut back = [0u8; HEADER_LEN];
        Header::write(h.phase, h.lane, h.link_id, u64::from(h.truncated_pn), &mut back);
        assert_eq!(&back[..], &data[..HEADER_LEN]);
    }

    // Packet numbers: the first 8 bytes are the largest accepted (as a 62-bit number or
    // none), the next 4 the truncated number.
    if let (Some(l), Some(t)) = (data.get(..8), data.get(8..12)) {
        let l = u64::from_be_bytes(l.try_into().unwrap_or([0; 8]));
        let largest = (l & 1 == 1).then_some((l >> 2) & ((1 << 62) - 1));
        let t = u32::from_be_bytes(t.try_into().unwrap_or([0; 4]));
        let pn = expand_pn(largest, t);
        assert_eq!(pn as u32, t, "expansion changed the low bits");
        let expected = largest.map_or(0, |l| l + 1);
        let far = pn.abs_diff(expected);
        if expected < (1 << 62) - (1 << 32) && expected >= 1 << 32 {
            assert!(far <= 1 << 31, "{pn} is {far} from the expected {expected}");
        }
    }

    // Varints, from the start.
    let mut pos = 0;
    if let Ok(v) = get_varint(data, &mut pos) {
        assert!(pos <= data.len() && pos >= 1);
        let mut out = [0u8; 8];
        let mut n = 0;
        put_varint(&mut out, &mut n, v);
        assert_eq!(n, varint_len(v));
        assert!(n <= pos, "{v} re-encoded in {n} bytes, read from {pos}");
        let mut m = 0;
        assert_eq!(get_varint(&out[..n], &mut m), Ok(v));
        assert_eq!(m, n);
    }
});
