use super::*;
use crate::reduce::{self, DType, ReduceOp, finish_avg, reduce_into};
use crate::rng::Rng;
use std::collections::{BTreeMap, VecDeque};

// ---- plan arithmetic -----------------------------------------------------------------

#[test]
fn plan_validation_errors_instead_of_panics() {
    assert_eq!(RingPlan::new(0, 0, 10, 4, 64), Err(RingError::EmptyWorld));
    assert_eq!(RingPlan::new(3, 3, 10, 4, 64), Err(RingError::RankOutOfRange { rank: 3, n: 3 }));
    assert_eq!(RingPlan::new(3, 0, 10, 0, 64), Err(RingError::ZeroElemSize));
    assert_eq!(RingPlan::new(3, 0, 10, 8, 7), Err(RingError::ChunkTooSmall { chunk_bytes: 7, elem_size: 8 }));
    assert_eq!(
        RingPlan::new(2, 0, usize::MAX, 2, 64),
        Err(RingError::BufferTooLarge { len_elems: usize::MAX })
    );
    assert_eq!(RingPlan::new(MAX_WORLD + 1, 0, 1, 1, 1), Err(RingError::WorldTooLarge(MAX_WORLD + 1)));
    let p = RingPlan::new(3, 2, 10, 4, 10).expect("valid");
    assert_eq!(p.chunk_bytes(), 8); // rounded down to whole elements
}

#[test]
fn segments_tile_the_buffer_evenly_and_chunks_tile_segments() {
    for n in 1..=9 {
        for len in [0, 1, 2, 5, 7, 8, 9, 10, 1023] {
            for elem in [1, 2, 4, 8] {
                for chunk in [elem, 3 * elem, 5 * elem + 1, 64] {
                    let p = RingPlan::new(n, n - 1, len, elem, chunk).expect("valid");
                    let mut at = 0;
                    for i in 0..n {
                        let s = p.segment(i);
                        assert_eq!(s.start, at);
                        assert_eq!(s.len() % elem, 0);
                        let elems = s.len() / elem;
                        assert!(elems == len / n || elems == len / n + 1, "n={n} len={len} seg {i}");
                        at = s.end;
                        let chunks: Vec<_> = p.chunks(i).collect();
                        assert_eq!(chunks.len(), p.chunk_count(i));
                        let mut c_at = s.start;
                        for (c, r) in chunks.iter().enumerate() {
                            assert_eq!(r.start, c_at);
                            assert!(!r.is_empty() && r.len() <= p.chunk_bytes() && r.len() % elem == 0);
                            assert_eq!(p.chunk(i, c), Some(r.clone()));
                            c_at = r.end;
                        }
                        assert_eq!(c_at, s.end);
                        assert_eq!(p.chunk(i, chunks.len()), None);
                        assert!(p.chunk_count(i) <= p.chunk_count(0));
                    }
                    assert_eq!(at, len * elem);
                    assert!(p.segment(n).is_empty());
                    assert_eq!(p.chunk_count(n), 0);
                }
            }
        }
    }
}

#[test]
fn schedule_follows_the_ring_formulas() {
    for n in 1..=7 {
        for rank in 0..n {
            let p = RingPlan::new(n, rank, 100, 4, 16).expect("valid");
            let steps: Vec<Step> = p.steps().collect();
            assert_eq!(steps.len(), 2 * (n - 1));
            let m = |x: isize| x.rem_euclid(n as isize) as usize;
            let r = rank as isize;
            for (g, st) in steps.iter().enumerate() {
                let s = st.step as isize;
                if g < n - 1 {
                    assert_eq!((st.phase, st.step), (Phase::ReduceScatter, g));
                    assert_eq!(st.send_segment, m(r - s));
                    assert_eq!(st.recv_segment, m(r - s - 1));
                } else {
                    assert_eq!((st.phase, st.step), (Phase::AllGather, g - (n - 1)));
                    assert_eq!(st.send_segment, m(r + 1 - s));
                    assert_eq!(st.recv_segment, m(r - s));
                }
                assert_eq!(p.step(st.phase, st.step), Some(*st));
                // What rank r receives is what r - 1 sends in the same step.
                let prev = RingPlan::new(n, m(r - 1), 100, 4, 16).expect("valid");
                let ps = prev.step(st.phase, st.step).expect("same steps");
                assert_eq!(ps.send_segment, st.recv_segment);
                let ids: Vec<u64> = prev.sends(&ps).map(|t| t.id()).collect();
                assert_eq!(ids, p.recvs(st).map(|t| t.id()).collect::<Vec<_>>());
            }
            assert_eq!(p.step(Phase::AllGather, n.saturating_sub(1)), None);
            if n > 1 {
                assert_eq!(steps[n - 2].recv_segment, p.owned_segment());
            }
        }
    }
}

#[test]
fn transfer_ids_round_trip_and_are_distinct() {
    let mut seen = std::collections::BTreeSet::new();
    for phase in [Phase::ReduceScatter, Phase::AllGather] {
        for step in [0, 1, 7, (1 << 31) - 1] {
            for c in [0, 1, 99, u32::MAX as usize] {
                let id = transfer_id(phase, step, c);
                assert_eq!(decode_transfer_id(id), (phase, step, c));
                assert!(seen.insert(id));
            }
        }
    }
}

// ---- state machine -------------------------------------------------------------------

#[test]
fn world_of_one_is_done_at_once() {
    let mut s = RingState::new(RingPlan::new(1, 0, 1000, 4, 64).expect("valid"));
    assert!(s.is_done());
    assert_eq!(s.poll_send(), None);
    assert_eq!(s.on_received(0, 64), Err(RingError::UnknownTransfer(0)));
    assert_eq!(RingPlan::new(1, 0, 1000, 4, 64).expect("valid").steps().count(), 0);
}

#[test]
fn a_chunk_of_the_next_step_is_sendable_once_its_predecessor_arrived() {
    // n = 3, 2 chunks per segment.
    let p = RingPlan::new(3, 1, 12, 4, 8).expect("valid");
    let mut s = RingState::new(p.clone());
    let first: Vec<Transfer> = std::iter::from_fn(|| s.poll_send()).collect();
    assert_eq!(first.len(), 2);
    assert!(first.iter().all(|t| t.phase == Phase::ReduceScatter && t.step == 0 && t.segment == 1));
    // Chunk 1 of step 0 arrives: chunk 1 (only) of step 1 becomes sendable.
    let a = s.on_received(transfer_id(Phase::ReduceScatter, 0, 1), 8).expect("valid");
    assert_eq!(a, Action::Reduce { transfer: p.transfer(0, 0, 1).expect("chunk"), last: false });
    let t = s.poll_send().expect("pipelined send");
    assert_eq!((t.phase, t.step, t.segment, t.chunk_index), (Phase::ReduceScatter, 1, 0, 1));
    assert_eq!(s.poll_send(), None);
    // The last reduce-scatter step marks the owned segment's chunk final.
    let a = s.on_received(transfer_id(Phase::ReduceScatter, 1, 0), 8).expect("valid");
    assert!(matches!(a, Action::Reduce { last: true, .. }));
    assert_eq!(a.transfer().segment, p.owned_segment());
    // ... and makes its all-gather step 0 sendable, from the owned segment.
    let t = s.poll_send().expect("all-gather send");
    assert_eq!((t.phase, t.step, t.segment, t.chunk_index), (Phase::AllGather, 0, 2, 0));
}

#[test]
fn hostile_inputs_are_refused_without_changing_state() {
    let p = RingPlan::new(4, 2, 10, 4, 8).expect("valid"); // segments of 3,3,2,2 elements
    let mut s = RingState::new(p.clone());
    let before = format!("{s:?}");
    let rs0 = transfer_id(Phase::ReduceScatter, 0, 0);
    // recv segment of step 0 is 1 (3 elements: chunks of 8 and 4 bytes).
    assert_eq!(s.expect(rs0).map(|t| t.range), Ok(12..20));
    for bad in [
        transfer_id(Phase::ReduceScatter, 3, 0), // no such step
        transfer_id(Phase::AllGather, 3, 0),
        transfer_id(Phase::ReduceScatter, 0, 2), // no such chunk
        transfer_id(Phase::ReduceScatter, 1, 1 << 31),
        u64::MAX,
        0x7fff_ffff_0000_0000,
    ] {
        assert_eq!(s.on_received(bad, 8), Err(RingError::UnknownTransfer(bad)), "{bad:#x}");
    }
    assert_eq!(s.on_received(rs0, 7), Err(RingError::WrongLength { id: rs0, expected: 8, got: 7 }));
    assert_eq!(
        s.on_received(rs0, usize::MAX),
        Err(RingError::WrongLength { id: rs0, expected: 8, got: usize::MAX })
    );
    assert_eq!(format!("{s:?}"), before);
    s.on_received(rs0, 8).expect("valid");
    let after = format!("{s:?}");
    assert_eq!(s.on_received(rs0, 8), Err(RingError::DuplicateTransfer(rs0)));
    assert_eq!(s.expect(rs0), Err(RingError::DuplicateTransfer(rs0)));
    assert_eq!(format!("{s:?}"), after);
    // A random flood of ids never panics and never grows the state.
    let mut rng = Rng::new(3);
    let size = (s.received.len(), s.ready.capacity());
    for _ in 0..10_000 {
        let _ = s.on_received(rng.next_u64(), rng.below(64));
        let _ = s.on_received(rng.next_u64() & 0x8000_0003_0000_0003, 8);
    }
    assert_eq!(s.received.len(), size.0);
    assert!(s.ready.len() <= 2 * (p.world() - 1) * p.chunk_count(0));
    // Applying an action checks its buffer and payload.
    let a = Action::Copy { transfer: p.transfer(4, 0, 0).expect("chunk"), last: false };
    assert!(matches!(
        a.apply(&mut [0; 4], &[0; 8], Reduction { dtype: DType::F32, op: ReduceOp::Sum, divisor: 4 }),
        Err(RingError::BufferTooSmall { .. })
    ));
    assert!(
        a.apply(&mut [0; 40], &[0; 4], Reduction { dtype: DType::F32, op: ReduceOp::Sum, divisor: 4 })
            .is_err()
    );
}

// ---- in-process simulation -----------------------------------------------------------

struct Msg {
    id: u64,
    payload: Vec<u8>,
}

/// Counts of what happened to each (segment, chunk index) across all ranks.
#[derive(Default)]
struct Counts {
    reduced: BTreeMap<(usize, usize), usize>,
    copied: BTreeMap<(usize, usize), usize>,
}

fn random_data(dtype: DType, elems: usize, rng: &mut Rng) -> Vec<u8> {
    let mut v = Vec::with_capacity(elems * dtype.size());
    for _ in 0..elems {
        match dtype {
            // Fractions of varied magnitude, so the order of summation shows in the bits.
            DType::F32 => v.extend_from_slice(&(((rng.unit() - 0.5) * 1e4) as f32 / 3.0).to_le_bytes()),
            DType::I64 => v.extend_from_slice(&(rng.next_u64() as i64).to_le_bytes()),
            DType::F16 => {
                v.extend_from_slice(&reduce::f32_to_f16(((rng.unit() - 0.5) * 100.0) as f32).to_le_bytes())
            }
            _ => unreachable!("not simulated"),
        }
    }
    v
}

/// The reduction of each segment in ring order: segment `x` starts as rank `x`'s data and
/// rank `x + k` reduces what arrives into its own (`acc = own op incoming`).
fn reference(plan: &RingPlan, data: &[Vec<u8>], dtype: DType, op: ReduceOp) -> Vec<u8> {
    let n = plan.world();
    let mut out = vec![0u8; plan.len_bytes()];
    for x in 0..n {
        let seg = plan.segment(x);
        let mut v = data[x][seg.clone()].to_vec();
        for k in 1..n {
            let mut own = data[(x + k) % n][seg.clone()].to_vec();
            reduce_into(dtype, op, &mut own, &v).expect("same lengths");
            v = own;
        }
        if op == ReduceOp::Avg {
            finish_avg(dtype, &mut v, n as u32).expect("whole elements");
        }
        out[seg].copy_from_slice(&v);
    }
    out
}

/// Runs an allreduce of `n` ranks in one process. Messages go from rank r to r + 1 and
/// are delivered in a seeded random order: per link FIFO (one QUIC stream) or any order
/// (many streams, datagram-like).
///
/// Runs twice: applying each chunk with [`Action::apply`] and sending copies out of the
/// buffer, then as the QUIC driver does, with [`Action::apply_forward`] on the payload cut
/// into random pieces and sending the bytes it returns (the buffer is then never read for
/// a forwarded chunk, and partial sums never land in it).
fn simulate(n: usize, len: usize, chunk: usize, dtype: DType, op: ReduceOp, fifo: bool, seed: u64) {
    simulate_mode(n, len, chunk, dtype, op, fifo, seed, false);
    simulate_mode(n, len, chunk, dtype, op, fifo, seed, true);
}

#[allow(clippy::too_many_arguments)]
fn simulate_mode(
    n: usize,
    len: usize,
    chunk: usize,
    dtype: DType,
    op: ReduceOp,
    fifo: bool,
    seed: u64,
    forward: bool,
) {
    let what =
        format!("n={n} len={len} chunk={chunk} {dtype} {op} fifo={fifo} seed={seed} forward={forward}");
    let mut rng = Rng::new(seed);
    let data: Vec<Vec<u8>> = (0..n).map(|_| random_data(dtype, len, &mut rng)).collect();
    let mut bufs = data.clone();
    let mut states: Vec<RingState> = (0..n)
        .map(|r| RingState::new(RingPlan::new(n, r, len, dtype.size(), chunk).expect("valid")))
        .collect();
    let plan = states[0].plan().clone();
    if n == 1 {
        assert!(states[0].is_done(), "{what}");
    }
    // links[r]: in flight from r to r + 1.
    let mut links: Vec<VecDeque<Msg>> = (0..n).map(|_| VecDeque::new()).collect();
    // What apply_forward returned, per rank: the next send of that chunk.
    let mut prepared: Vec<Option<(std::ops::Range<usize>, Vec<u8>)>> = vec![None; n];
    let drain = |r: usize,
                 states: &mut [RingState],
                 bufs: &[Vec<u8>],
                 links: &mut [VecDeque<Msg>],
                 prepared: &mut [Option<(std::ops::Range<usize>, Vec<u8>)>]| {
        while let Some(t) = states[r].poll_send() {
            let payload = match prepared[r].take() {
                Some((range, bytes)) => {
                    assert_eq!(range, t.range, "the forwarded chunk is the next one sent");
                    bytes
                }
                None => {
                    // Only a rank's own data (step 0) is sent from its buffer.
                    assert!(!forward || (t.phase == Phase::ReduceScatter && t.step == 0), "{t:?}");
                    bufs[r][t.range.clone()].to_vec()
                }
            };
            links[r].push_back(Msg { id: t.id(), payload });
        }
    };
    for r in 0..n {
        drain(r, &mut states, &bufs, &mut links, &mut prepared);
    }
    let mut counts = Counts::default();
    let mut max_in_flight = 0;
    loop {
        let busy: Vec<usize> = (0..n).filter(|&r| !links[r].is_empty()).collect();
        if busy.is_empty() {
            break;
        }
        max_in_flight = max_in_flight.max(links.iter().map(VecDeque::len).sum::<usize>());
        let from = busy[rng.below(busy.len())];
        let at = if fifo { 0 } else { rng.below(links[from].len()) };
        let msg = links[from].remove(at).expect("index in range");
        let to = (from + 1) % n;
        let action = states[to].on_received(msg.id, msg.payload.len()).expect(&what);
        let key = (action.transfer().segment, action.transfer().chunk_index);
        match action {
            Action::Reduce { .. } => *counts.reduced.entry(key).or_default() += 1,
            Action::Copy { .. } => *counts.copied.entry(key).or_default() += 1,
        }
        if forward {
            let p = &msg.payload;
            let mut cuts: Vec<usize> = (0..rng.below(5)).map(|_| rng.below(p.len() + 1)).collect();
            cuts.extend([0, p.len()]);
            cuts.sort_unstable();
            let parts: Vec<&[u8]> = cuts.windows(2).map(|w| &p[w[0]..w[1]]).collect();
            let out = action
                .apply_forward(&mut bufs[to], &parts, Reduction { dtype, op, divisor: n })
                .expect(&what);
            let last_copy = matches!(action, Action::Copy { last: true, .. });
            assert_eq!(out.is_none(), last_copy, "{what}: only the last all-gather step is not sent on");
            prepared[to] = out.map(|o| (action.range(), o));
        } else {
            action.apply(&mut bufs[to], &msg.payload, Reduction { dtype, op, divisor: n }).expect(&what);
        }
        drain(to, &mut states, &bufs, &mut links, &mut prepared);
    }
    for (r, s) in states.iter().enumerate() {
        assert!(
            s.is_done(),
            "{what}: rank {r} stuck with {} to receive, {} to send",
            s.recvs_left(),
            s.sends_left()
        );
    }
    for r in 1..n {
        assert!(bufs[r] == bufs[0], "{what}: rank {r} differs from rank 0");
    }
    let want =
        if n == 1 && op == ReduceOp::Avg { data[0].clone() } else { reference(&plan, &data, dtype, op) };
    assert!(bufs[0] == want, "{what}: result differs from the ring-order reference");
    // Every chunk of every segment reduced exactly n - 1 times, and copied n - 1 times.
    for seg in 0..n {
        for c in 0..plan.chunk_count(seg) {
            let k = (seg, c);
            assert_eq!(counts.reduced.get(&k).copied().unwrap_or(0), n - 1, "{what}: reduced {k:?}");
            assert_eq!(counts.copied.get(&k).copied().unwrap_or(0), n - 1, "{what}: copied {k:?}");
        }
    }
    let chunks: usize = (0..n).map(|s| plan.chunk_count(s)).sum();
    assert_eq!(counts.reduced.len(), if n > 1 { chunks } else { 0 }, "{what}");
    assert_eq!(counts.copied.len(), counts.reduced.len(), "{what}");
    // Flow control is the driver's; the schedule itself never has more than every
    // chunk of every link in flight.
    assert!(max_in_flight <= n * plan.chunk_count(0).max(1) * 2, "{what}");
}

#[test]
fn simulated_ring_small_buffers_every_world() {
    let mut seed = 1;
    for n in 1..=9 {
        for len in [0, 1, 2, 7, 8, 9, 1023] {
            for chunk_elems in [1, 3, 100] {
                for fifo in [true, false] {
                    for (dtype, op) in [
                        (DType::F32, ReduceOp::Sum),
                        (DType::I64, ReduceOp::Sum),
                        (DType::I64, ReduceOp::Max),
                    ] {
                        // A chunk size that is not a whole number of elements, too.
                        let chunk = chunk_elems * dtype.size() + dtype.size() / 2;
                        simulate(n, len, chunk, dtype, op, fifo, seed);
                        seed += 1;
                    }
                }
            }
        }
    }
}

#[test]
fn simulated_ring_large_odd_buffer() {
    for n in [1, 2, 3, 5, 8, 9] {
        for fifo in [true, false] {
            simulate(n, 100_003, 4000 + 3, DType::F32, ReduceOp::Sum, fifo, 77 + n as u64);
            simulate(n, 100_003, 3 * 8192 + 8, DType::I64, ReduceOp::Max, fifo, 99 + n as u64);
        }
    }
}

#[test]
fn simulated_ring_average_divides_once_at_the_owner() {
    for n in 1..=6 {
        for fifo in [true, false] {
            simulate(n, 1001, 64, DType::F16, ReduceOp::Avg, fifo, 500 + n as u64);
            simulate(n, 1001, 64, DType::I64, ReduceOp::Avg, fifo, 600 + n as u64);
        }
    }
}

#[test]
fn chunk_headers_round_trip_and_refuse_long_chunks() {
    let head = encode_chunk_header(0x8000_0003_0000_0007, 4096);
    assert_eq!(decode_chunk_header(&head, 4096), Ok((0x8000_0003_0000_0007, 4096)));
    assert_eq!(decode_chunk_header(&head, 4095), Err(RingError::ChunkTooLong { len: 4096, max: 4095 }));
    let max = encode_chunk_header(u64::MAX, u32::MAX);
    assert_eq!(decode_chunk_header(&max, usize::MAX), Ok((u64::MAX, u32::MAX as usize)));
}

#[test]
fn apply_parts_equals_apply_for_any_split() {
    let mut rng = Rng::new(7);
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max] {
            let es = dtype.size();
            let elems = 1 + rng.below(40);
            let len = elems * es;
            let plan = RingPlan::new(3, 0, elems * 3, es, len).expect("plan");
            let mut state = RingState::new(plan.clone());
            while state.poll_send().is_some() {}
            let step = plan.step(Phase::ReduceScatter, plan.steps_per_phase() - 1).expect("last step");
            let t = plan.recvs(&step).next().expect("a chunk");
            for action in [
                Action::Reduce { transfer: t.clone(), last: true },
                Action::Copy { transfer: t.clone(), last: false },
            ] {
                let base: Vec<u8> = (0..plan.len_bytes()).map(|_| (rng.below(7) as u8) << 2).collect();
                let payload: Vec<u8> = (0..t.range.len()).map(|_| (rng.below(7) as u8) << 2).collect();
                let mut want = base.clone();
                action.apply(&mut want, &payload, Reduction { dtype, op, divisor: 3 }).expect("apply");
                // Random cuts, including cuts inside elements and empty pieces.
                let mut cuts: Vec<usize> = (0..rng.below(6)).map(|_| rng.below(payload.len() + 1)).collect();
                cuts.push(0);
                cuts.push(payload.len());
                cuts.sort_unstable();
                let parts: Vec<&[u8]> = cuts.windows(2).map(|w| &payload[w[0]..w[1]]).collect();
                let mut got = base.clone();
                action
                    .apply_parts(&mut got, &parts, Reduction { dtype, op, divisor: 3 })
                    .expect("apply_parts");
                assert_eq!(got, want, "{dtype:?} {op:?} cuts {cuts:?}");
                let short = &parts[..parts.len() - 1];
                if payload.len() > cuts[cuts.len() - 2] {
                    assert!(
                        action.apply_parts(&mut got, short, Reduction { dtype, op, divisor: 3 }).is_err()
                    );
                }
            }
        }
    }
}

#[test]
fn direct_choice_and_id_never_collide_with_the_ring() {
    assert!(!is_direct(1, 8), "one node has nothing to exchange");
    assert!(is_direct(2, 8) && is_direct(DIRECT_MAX_WORLD, DIRECT_MAX_BYTES));
    assert!(!is_direct(DIRECT_MAX_WORLD + 1, 8));
    assert!(!is_direct(3, DIRECT_MAX_BYTES + 1));
    // The largest world's plan has steps below 2^31 - 1: no ring id is the direct one.
    let (phase, step, _) = decode_transfer_id(DIRECT_TRANSFER_ID);
    assert_eq!((phase, step), (Phase::AllGather, 0x7fff_ffff));
    assert!(step + 1 > MAX_WORLD - 1, "a ring step is at most MAX_WORLD - 2");
}

#[test]
fn direct_reduce_is_rank_order_whatever_the_data() {
    let mut rng = Rng::new(11);
    for dtype in [DType::F32, DType::F16, DType::I64] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max] {
            let n = 2 + rng.below(7);
            let elems = 1 + rng.below(50);
            let data: Vec<Vec<u8>> = (0..n).map(|_| random_data(dtype, elems, &mut rng)).collect();
            let mut want = data[0].clone();
            for d in &data[1..] {
                reduce_into(dtype, op, &mut want, d).expect("reduce");
            }
            if op == ReduceOp::Avg {
                finish_avg(dtype, &mut want, n as u32).expect("avg");
            }
            let mut got = vec![0u8; want.len()];
            direct_reduce(&data, Reduction { dtype, op, divisor: n }, &mut got).expect("direct");
            assert_eq!(got, want, "{dtype:?} {op:?} n={n}");
        }
    }
    let mut out = [0u8; 8];
    assert!(
        direct_reduce(&[[0u8; 4]], Reduction { dtype: DType::I32, op: ReduceOp::Sum, divisor: 1 }, &mut out)
            .is_err(),
        "length mismatch"
    );
    assert!(
        direct_reduce::<[u8; 8]>(
            &[],
            Reduction { dtype: DType::I32, op: ReduceOp::Sum, divisor: 1 },
            &mut out
        )
        .is_err(),
        "nothing to reduce"
    );
}
