//! Every frame a peer can send once authenticated: membership gossip, rendezvous and job
//! lifecycle, store replication. The same bytes arrive as a QUIC datagram or as one
//! length-prefixed frame of a stream; both end in `wire::decode::<Frame>`.
//!
//! Checks `meshd_fuzz::check_wire` (bounded heap, canonical re-encoding, no prefix
//! ambiguity, consistent errors), and that the stream framing (`frame_with_len` /
//! `check_len`) carries any decodable frame unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshd_fuzz::check_wire;
use meshd_proto::wire::{self, Frame, MAX_FRAME};

fuzz_target!(|data: &[u8]| {
    let Some((frame, _)) = check_wire::<Frame>(data) else { return };
    let body = wire::encode(&frame);
    let framed = wire::frame_with_len(&body);
    let mut prefix = [0u8; 4];
    prefix.copy_from_slice(&framed[..4]);
    let n = wire::check_len(prefix).expect("a real frame's length is accepted");
    assert!(n <= MAX_FRAME && n == body.len() && framed.len() == 4 + n);
    // A control stream's first byte is never the data-stream tag (0xD0): frames are
    // far below 2^24 bytes, so the length's top byte is 0.
    assert_eq!(framed[0], 0);
    let back: Frame = wire::decode(&framed[4..]).expect("framed body decodes");
    assert_eq!(back, frame);
});
