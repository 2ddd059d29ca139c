//! The ring allreduce's data path: the chunk headers a neighbour sends on a data stream
//! (`[transfer id u64 BE][length u32 BE]`, decoded with the receiver's chunk size as the
//! bound) and the transfer ids inside them, fed to a real `RingState`.
//!
//! Input: 6 bytes of plan (n - 1, rank, elements as u16 BE, element size code, chunk
//! bytes), then 13-byte records: a kind byte and a 12-byte header. Kind 0 takes the header
//! as it is; kind 1 replaces its id by the (len % expected)-th id this rank expects and
//! keeps its length; kind 2 sends that expected id with its exact length.
//!
//! Checks:
//! - every u64 is a transfer id that decodes and re-encodes to itself; every plan
//!   transfer's id decodes to its (phase, step, chunk);
//! - a header round-trips through encode/decode, and one announcing more than the chunk
//!   size is refused (the reader then allocates nothing);
//! - the state accepts a transfer exactly when it is expected, not yet received and of
//!   the chunk's length; a refusal changes nothing; an accepted chunk lies inside the
//!   buffer and fits the chunk size, and applying it succeeds;
//! - whatever arrived before, delivering the remaining expected chunks completes the
//!   operation: every send polled, every receive accepted, `is_done`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshd_proto::reduce::{DType, ReduceOp};
use meshd_proto::ring::{
    CHUNK_HEADER_LEN, Reduction, RingError, RingPlan, RingState, Transfer, decode_chunk_header,
    decode_transfer_id, encode_chunk_header, transfer_id,
};
use std::collections::BTreeSet;

const DTYPES: [DType; 4] = [DType::F16, DType::F16, DType::F32, DType::F64];
const ELEM: [usize; 4] = [1, 2, 4, 8];

fn drain_sends(state: &mut RingState, len_bytes: usize, chunk: usize, sent: &mut usize) {
    while let Some(t) = state.poll_send() {
        assert!(t.range.end <= len_bytes && t.range.len() <= chunk && !t.range.is_empty(), "{t:?}");
        *sent += 1;
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((plan_bytes, records)) = data.split_first_chunk::<6>() else { return };
    let n = usize::from(plan_bytes[0] % 8) + 1;
    let rank = usize::from(plan_bytes[1]) % n;
    let len_elems = usize::from(u16::from_be_bytes([plan_bytes[2], plan_bytes[3]]) % 1024);
    let code = usize::from(plan_bytes[4] % 4);
    let elem = ELEM[code];
    let chunk_bytes = usize::from(plan_bytes[5]);
    let plan = match RingPlan::new(n, rank, len_elems, elem, chunk_bytes) {
        Ok(p) => p,
        Err(e) => {
            assert_eq!(e, RingError::ChunkTooSmall { chunk_bytes, elem_size: elem });
            return;
        }
    };
    let len_bytes = plan.len_bytes();
    let chunk = plan.chunk_bytes();
    assert!(chunk > 0 && chunk <= chunk_bytes && chunk % elem == 0);
    // Everything this rank should receive, by id.
    let expected: Vec<Transfer> = plan.steps().flat_map(|s| plan.recvs(&s)).collect();
    for t in &expected {
        assert_eq!(decode_transfer_id(t.id()), (t.phase, t.step, t.chunk_index));
    }
    let ids: BTreeSet<u64> = expected.iter().map(Transfer::id).collect();
    assert_eq!(ids.len(), expected.len(), "two expected transfers share an id");

    // 1-byte elements have no dtype: their chunks are applied as f16 when of even length.
    let dtype = DTYPES[code];
    let mut buf = vec![0u8; len_bytes];
    let mut state = RingState::new(plan.clone());
    let mut sent = 0usize;
    let mut got: BTreeSet<u64> = BTreeSet::new();
    drain_sends(&mut state, len_bytes, chunk, &mut sent);

    for rec in records.chunks_exact(1 + CHUNK_HEADER_LEN) {
        let mut head = [0u8; CHUNK_HEADER_LEN];
        head.copy_from_slice(&rec[1..]);
        let (raw_id, raw_len) = (
            u64::from_be_bytes(head[..8].try_into().expect("8")),
            u32::from_be_bytes(head[8..].try_into().expect("4")),
        );
        // Every u64 is an id that decodes and re-encodes to itself.
        let (phase, step, c) = decode_transfer_id(raw_id);
        assert_eq!(transfer_id(phase, step, c), raw_id);
        let (id, len) = match (rec[0] % 3, expected.is_empty()) {
            (1, false) => {
                let t = &expected[raw_len as usize % expected.len()];
                (t.id(), raw_len)
            }
            (2, false) => {
                let t = &expected[raw_len as usize % expected.len()];
                (t.id(), t.range.len() as u32)
            }
            _ => (raw_id, raw_len),
        };
        head = encode_chunk_header(id, len);
        // What the stream reader does with the header.
        let len = match decode_chunk_header(&head, chunk) {
            Ok((i, l)) => {
                assert_eq!((i, l), (id, len as usize));
                l
            }
            Err(e) => {
                assert!(len as usize > chunk);
                assert_eq!(e, RingError::ChunkTooLong { len: len as usize, max: chunk });
                continue;
            }
        };
        let before = (state.recvs_left(), state.sends_left(), state.expect(id));
        match state.on_received(id, len) {
            Ok(action) => {
                assert!(ids.contains(&id) && got.insert(id), "accepted {id:#x} twice or unexpected");
                let t = action.transfer();
                assert_eq!(before.2.as_ref(), Ok(t));
                assert!(t.range.len() == len && t.range.end <= len_bytes && len <= chunk);
                assert_eq!(state.recvs_left() + 1, before.0);
                if len % dtype.size() == 0 {
                    let payload = vec![0x3cu8; len];
                    action
                        .apply(&mut buf, &payload, Reduction { dtype, op: ReduceOp::Avg, divisor: n })
                        .expect("apply");
                }
            }
            Err(e) => {
                let after = (state.recvs_left(), state.sends_left(), state.expect(id));
                assert_eq!(after, before, "a refused {id:#x} changed the state");
                match e {
                    RingError::UnknownTransfer(_) => assert!(!ids.contains(&id)),
                    RingError::DuplicateTransfer(_) => assert!(got.contains(&id)),
                    RingError::WrongLength { expected, got: l, .. } => assert!(expected != l && l == len),
                    other => panic!("unexpected refusal {other}"),
                }
            }
        }
        drain_sends(&mut state, len_bytes, chunk, &mut sent);
    }

    // Whatever came before, the rest of the expected chunks complete the operation.
    for t in &expected {
        if !got.contains(&t.id()) {
            state.on_received(t.id(), t.range.len()).expect("an expected chunk is accepted");
            got.insert(t.id());
        }
        drain_sends(&mut state, len_bytes, chunk, &mut sent);
    }
    assert!(state.is_done(), "not done: {} sends, {} receives left", state.sends_left(), state.recvs_left());
    assert_eq!(got.len(), expected.len());
    let sends: usize = plan.steps().map(|s| plan.sends(&s).count()).sum();
    assert_eq!(sent, sends);
});
