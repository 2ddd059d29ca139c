//! The plane's ACK frame (after its type byte), which any member may send: `AckFrame::parse`
//! and its ranges, and the receiver's own encoder (`AckState`) on the numbers they name.
//!
//! Checks:
//! - nothing allocates while parsing; what parses advances the position within the input;
//! - the ranges: `count + 1` of them, highest first, non-empty, disjoint and not touching,
//!   the first ending at `largest`; none reaches below 0 (they would have been refused);
//! - the same numbers given to an `AckState` (when there are few) produce a frame whose
//!   length `frame_len` predicted and that parses back to the same ranges.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshd_fuzz::measure;
use meshd_proto::plane::ack::{AckFrame, AckState, MAX_ACK_FRAME_LEN, MAX_ACK_RANGES};
use std::time::{Duration, Instant};

fuzz_target!(|data: &[u8]| {
    let mut pos = 0;
    let (res, heap) = measure(|| AckFrame::parse(data, &mut pos));
    assert_eq!(heap.allocs, 0, "parsing an ACK allocated");
    let Ok(ack) = res else { return };
    assert!(pos <= data.len());
    let ranges: Vec<_> = ack.ranges().collect();
    assert!(!ranges.is_empty() && ranges.len() <= MAX_ACK_RANGES);
    assert_eq!(ranges[0].end, ack.largest + 1);
    for w in ranges.windows(2) {
        assert!(w[1].end < w[0].start, "{:?} then {:?}", w[0], w[1]);
    }
    let numbers: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    if numbers > 4096 {
        return;
    }
    // The receiver's encoder, fed the same numbers, says the same.
    let now = Instant::now();
    let mut st = AckState::default();
    for r in ranges.iter().rev() {
        for pn in r.clone() {
            st.on_packet(pn, true, now, Duration::from_millis(1));
        }
    }
    let mut out = vec![0u8; MAX_ACK_FRAME_LEN];
    let mut n = 0;
    let predicted = st.frame_len(now);
    st.write(now, &mut out, &mut n);
    assert_eq!(n, predicted, "frame_len disagrees with write");
    let mut p = 1;
    let again = AckFrame::parse(&out[..n], &mut p).expect("our own ACK parses");
    assert_eq!(p, n);
    assert_eq!(again.ranges().collect::<Vec<_>>(), ranges);
});
