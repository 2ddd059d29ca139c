//! The frames inside an opened plane datagram (what a member holding the keys can put
//! there): `frame::parse` with its ACK, PING, PADDING and DATA frames.
//!
//! Checks:
//! - nothing allocates;
//! - a parsed DATA frame's bytes lie inside the plaintext, end where it ends and within
//!   the message (`offset + len <= total_len`), and are not empty unless the message is;
//!   its header written again (offset as wide as the total length) parses to the same
//!   header;
//! - a parsed ACK frame reports at most 32 ranges, highest first, each non-empty, below or
//!   at `largest`, separated by at least one missing number;
//! - a packet that parses carries at least one frame.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshd_fuzz::measure;
use meshd_proto::plane::ack::MAX_ACK_RANGES;
use meshd_proto::plane::frame::{self, FRAME_DATA};

fuzz_target!(|data: &[u8]| {
    let (res, heap) = measure(|| frame::parse(data).map(|f| (f, f.ack.map(|a| a.ranges().collect::<Vec<_>>()))));
    // Collecting the ranges allocates one vector; parsing itself nothing.
    assert!(heap.allocs <= 1, "parsing a frame allocated {} times", heap.allocs);
    let Ok((f, ranges)) = res else { return };
    assert!(f.ack.is_some() || f.ping || f.data.is_some(), "a packet without frames parsed");
    if let (Some(ack), Some(ranges)) = (f.ack, ranges) {
        assert!(!ranges.is_empty() && ranges.len() <= MAX_ACK_RANGES, "{} ranges", ranges.len());
        assert_eq!(ranges[0].end, ack.largest + 1);
        for w in ranges.windows(2) {
            assert!(w[1].end < w[0].start, "ranges {:?} and {:?} touch or are out of order", w[0], w[1]);
        }
        assert!(ranges.iter().all(|r| !r.is_empty()));
    }
    if let Some((h, start)) = f.data {
        assert!(start <= data.len() && data[..start].contains(&FRAME_DATA));
        let len = (data.len() - start) as u64;
        assert!(h.offset + len <= h.total_len, "{h:?} with {len} bytes");
        assert!(len > 0 || h.total_len == 0);
        // Its header, written the way the sender writes it, parses to the same one.
        let mut again = vec![0u8; h.encoded_len() + len as usize];
        let mut pos = 0;
        h.write(&mut again, &mut pos);
        again[pos..].copy_from_slice(&data[start..]);
        let g = frame::parse(&again).expect("a re-written DATA frame parses");
        assert_eq!(g.data, Some((h, pos)));
    }
});
