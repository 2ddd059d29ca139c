use super::*;
use crate::rng::Rng;

// ---- straightforward references ------------------------------------------------------

/// Textbook binary16 -> f32, branch by branch.
fn ref_f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((h >> 10) & 0x1f);
    let man = f32::from(h & 0x3ff);
    match exp {
        0 => sign * man * 2f32.powi(-24),
        0x1f if man == 0.0 => sign * f32::INFINITY,
        0x1f => f32::NAN,
        _ => sign * (1.0 + man / 1024.0) * 2f32.powi(exp - 15),
    }
}

/// Textbook f32 -> binary16 with round-to-nearest-even done in integers.
fn ref_f32_to_f16(f: f32) -> u16 {
    let bits = f.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    if exp == 0xff {
        return if man == 0 { sign | 0x7c00 } else { sign | 0x7e00 };
    }
    if exp == 0 {
        return sign; // f32 subnormals are far below half the smallest f16 subnormal
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    let full = man | 0x80_0000; // 24 significant bits
    // Number of low bits dropped: 13 for normals, more for subnormals.
    let shift = if e >= 1 { 13 } else { (14 - e) as u32 };
    if shift > 24 {
        return sign;
    }
    let mut q = full >> shift;
    let rem = full & ((1u32 << shift) - 1);
    let half = 1u32 << (shift - 1);
    if rem > half || (rem == half && q & 1 == 1) {
        q += 1;
    }
    let h = if e >= 1 {
        // q holds the implicit bit at position 10; fold the exponent in. A rounding carry
        // (q == 0x800) moves into the exponent by the addition.
        ((e as u32) << 10) + (q - 0x400)
    } else {
        q // subnormal (or the smallest normal after a carry)
    };
    if h >= 0x7c00 {
        return sign | 0x7c00;
    }
    sign | h as u16
}

fn ref_f32_to_bf16(f: f32) -> u16 {
    if f.is_nan() {
        return 0x7fc0 | ((f.to_bits() >> 16) as u16 & 0x8000);
    }
    let bits = f.to_bits();
    let keep = bits >> 16;
    let rem = bits & 0xffff;
    let up = rem > 0x8000 || (rem == 0x8000 && keep & 1 == 1);
    (keep + u32::from(up)) as u16
}

fn nan_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { a.min(b) }
}
fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { a.max(b) }
}

/// Element-wise reference on decoded values. Float results are compared by bits, with any
/// NaN equal to any NaN.
fn reference(dtype: DType, op: ReduceOp, a: &[u8], b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(a.len());
    let s = dtype.size();
    for (x, y) in a.chunks(s).zip(b.chunks(s)) {
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => {
                let dec = |c: &[u8]| -> f32 {
                    match dtype {
                        DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                        DType::F16 => ref_f16_to_f32(u16::from_le_bytes([c[0], c[1]])),
                        _ => f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16),
                    }
                };
                let (p, q) = (dec(x), dec(y));
                let r = match op {
                    ReduceOp::Sum | ReduceOp::Avg => p + q,
                    ReduceOp::Min => nan_min(f64::from(p), f64::from(q)) as f32,
                    ReduceOp::Max => nan_max(f64::from(p), f64::from(q)) as f32,
                };
                match dtype {
                    DType::F32 => out.extend_from_slice(&r.to_le_bytes()),
                    DType::F16 => out.extend_from_slice(&ref_f32_to_f16(r).to_le_bytes()),
                    _ => out.extend_from_slice(&ref_f32_to_bf16(r).to_le_bytes()),
                }
            }
            DType::F64 => {
                let p = f64::from_le_bytes(x.try_into().expect("8"));
                let q = f64::from_le_bytes(y.try_into().expect("8"));
                let r = match op {
                    ReduceOp::Sum | ReduceOp::Avg => p + q,
                    ReduceOp::Min => nan_min(p, q),
                    ReduceOp::Max => nan_max(p, q),
                };
                out.extend_from_slice(&r.to_le_bytes());
            }
            DType::I32 => {
                let p = i32::from_le_bytes(x.try_into().expect("4"));
                let q = i32::from_le_bytes(y.try_into().expect("4"));
                let r = match op {
                    ReduceOp::Sum | ReduceOp::Avg => ((i64::from(p) + i64::from(q)) as u64 as u32) as i32,
                    ReduceOp::Min => p.min(q),
                    ReduceOp::Max => p.max(q),
                };
                out.extend_from_slice(&r.to_le_bytes());
            }
            DType::I64 => {
                let p = i64::from_le_bytes(x.try_into().expect("8"));
                let q = i64::from_le_bytes(y.try_into().expect("8"));
                let r = match op {
                    ReduceOp::Sum | ReduceOp::Avg => (i128::from(p) + i128::from(q)) as i64,
                    ReduceOp::Min => p.min(q),
                    ReduceOp::Max => p.max(q),
                };
                out.extend_from_slice(&r.to_le_bytes());
            }
        }
    }
    out
}

fn is_nan_elem(dtype: DType, c: &[u8]) -> bool {
    match dtype {
        DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_nan(),
        DType::F64 => f64::from_le_bytes(c.try_into().expect("8")).is_nan(),
        DType::F16 => f16_to_f32(u16::from_le_bytes([c[0], c[1]])).is_nan(),
        DType::BF16 => bf16_to_f32(u16::from_le_bytes([c[0], c[1]])).is_nan(),
        DType::I32 | DType::I64 => false,
    }
}

fn assert_same(dtype: DType, got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let s = dtype.size();
    for (i, (g, w)) in got.chunks(s).zip(want.chunks(s)).enumerate() {
        if is_nan_elem(dtype, g) && is_nan_elem(dtype, w) {
            continue;
        }
        assert_eq!(g, w, "{what}: element {i}");
    }
}

/// Random element bytes: mostly ordinary values (so sums neither overflow nor drown),
/// with a sprinkle of raw bit patterns (NaN, Inf, subnormals, extremes).
fn random_elems(dtype: DType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut v = Vec::with_capacity(n * dtype.size());
    for _ in 0..n {
        let raw = rng.below(16) == 0;
        let x = (rng.unit() - 0.5) * 2000.0;
        match dtype {
            DType::F32 => {
                let f = if raw { f32::from_bits(rng.next_u64() as u32) } else { x as f32 };
                v.extend_from_slice(&f.to_le_bytes());
            }
            DType::F64 => {
                let f = if raw { f64::from_bits(rng.next_u64()) } else { x };
                v.extend_from_slice(&f.to_le_bytes());
            }
            DType::F16 => {
                let h = if raw { rng.next_u64() as u16 } else { ref_f32_to_f16(x as f32) };
                v.extend_from_slice(&h.to_le_bytes());
            }
            DType::BF16 => {
                let h = if raw { rng.next_u64() as u16 } else { ref_f32_to_bf16(x as f32) };
                v.extend_from_slice(&h.to_le_bytes());
            }
            DType::I32 => {
                let i = if raw { rng.next_u64() as i32 } else { x as i32 };
                v.extend_from_slice(&i.to_le_bytes());
            }
            DType::I64 => {
                let i = if raw { rng.next_u64() as i64 } else { x as i64 };
                v.extend_from_slice(&i.to_le_bytes());
            }
        }
    }
    v
}

// ---- names ---------------------------------------------------------------------------

#[test]
fn dtype_names_round_trip_and_spellings() {
    for d in DType::ALL {
        assert_eq!(DType::parse(d.name()), Ok(d));
        assert_eq!(d.to_string(), d.name());
    }
    for (s, d) in [
        ("float", DType::F32),
        ("torch.float32", DType::F32),
        ("double", DType::F64),
        ("half", DType::F16),
        ("torch.float16", DType::F16),
        ("BF16", DType::BF16),
        ("torch.bfloat16", DType::BF16),
        ("int", DType::I32),
        ("long", DType::I64),
        (" int64 ", DType::I64),
    ] {
        assert_eq!(DType::parse(s), Ok(d), "{s}");
    }
    assert_eq!(DType::parse("uint8"), Err(ReduceError::UnknownDType("uint8".into())));
    assert_eq!(
        [2, 2, 4, 4, 8, 8],
        [DType::F16, DType::BF16, DType::F32, DType::I32, DType::F64, DType::I64].map(DType::size)
    );
}

#[test]
fn op_names_round_trip_and_spellings() {
    for op in ReduceOp::ALL {
        assert_eq!(ReduceOp::parse(op.name()), Ok(op));
    }
    assert_eq!(ReduceOp::parse("ReduceOp.SUM"), Ok(ReduceOp::Sum));
    assert_eq!(ReduceOp::parse("mean"), Ok(ReduceOp::Avg));
    assert_eq!(ReduceOp::parse("MAX"), Ok(ReduceOp::Max));
    assert!(ReduceOp::parse("prod").is_err());
}

// ---- kernels -------------------------------------------------------------------------

#[test]
fn every_dtype_and_op_matches_the_reference() {
    let mut rng = Rng::new(0x5eed);
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            for n in [0, 1, 2, 3, 7, 31, 1023, 4097] {
                let a = random_elems(dtype, n, &mut rng);
                let b = random_elems(dtype, n, &mut rng);
                let want = reference(dtype, op, &a, &b);
                let mut got = a.clone();
                reduce_into(dtype, op, &mut got, &b).expect("valid lengths");
                assert_same(dtype, &got, &want, &format!("{dtype} {op} n={n}"));
            }
        }
    }
}

#[test]
fn bad_lengths_are_errors_and_leave_acc_untouched() {
    for dtype in DType::ALL {
        let s = dtype.size();
        for op in ReduceOp::ALL {
            let mut acc = vec![7u8; 3 * s];
            let other = vec![1u8; 2 * s];
            assert_eq!(
                reduce_into(dtype, op, &mut acc, &other),
                Err(ReduceError::LengthMismatch { acc: 3 * s, other: 2 * s })
            );
            assert_eq!(acc, vec![7u8; 3 * s]);
            if s > 1 {
                let mut acc = vec![7u8; 2 * s + 1];
                let other = vec![1u8; 2 * s + 1];
                assert_eq!(
                    reduce_into(dtype, op, &mut acc, &other),
                    Err(ReduceError::NotMultiple { len: 2 * s + 1, size: s, dtype })
                );
                assert_eq!(acc, vec![7u8; 2 * s + 1]);
                assert!(finish_avg(dtype, &mut acc, 2).is_err());
            }
        }
    }
}

#[test]
fn min_max_propagate_nan_from_either_side() {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let enc = |x: f32| -> Vec<u8> {
            match dtype {
                DType::F32 => x.to_le_bytes().to_vec(),
                DType::F64 => f64::from(x).to_le_bytes().to_vec(),
                DType::F16 => f32_to_f16(x).to_le_bytes().to_vec(),
                _ => f32_to_bf16(x).to_le_bytes().to_vec(),
            }
        };
        for op in [ReduceOp::Min, ReduceOp::Max] {
            for (a, b) in [(f32::NAN, 1.0), (1.0, f32::NAN), (f32::NAN, f32::NAN), (-f32::NAN, f32::INFINITY)]
            {
                let mut acc = enc(a);
                reduce_into(dtype, op, &mut acc, &enc(b)).expect("ok");
                assert!(is_nan_elem(dtype, &acc), "{dtype} {op} {a} {b}");
            }
            let mut acc = enc(2.0);
            reduce_into(dtype, op, &mut acc, &enc(-3.0)).expect("ok");
            let want = if op == ReduceOp::Min { -3.0 } else { 2.0 };
            assert_eq!(acc, enc(want), "{dtype} {op}");
        }
    }
}

#[test]
fn integer_sum_wraps() {
    let mut acc = i32::MAX.to_le_bytes().to_vec();
    reduce_into(DType::I32, ReduceOp::Sum, &mut acc, &1i32.to_le_bytes()).expect("ok");
    assert_eq!(acc, i32::MIN.to_le_bytes());
    let mut acc = i64::MIN.to_le_bytes().to_vec();
    reduce_into(DType::I64, ReduceOp::Avg, &mut acc, &(-1i64).to_le_bytes()).expect("ok");
    assert_eq!(acc, i64::MAX.to_le_bytes());
}

#[test]
fn finish_avg_divides_floats_and_truncates_integers_toward_zero() {
    let mut b: Vec<u8> = [-7i32, 7, 5, i32::MIN].iter().flat_map(|x| x.to_le_bytes()).collect();
    finish_avg(DType::I32, &mut b, 2).expect("ok");
    let want: Vec<u8> = [-3i32, 3, 2, i32::MIN / 2].iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(b, want);

    let mut b: Vec<u8> = [-9i64, 9].iter().flat_map(|x| x.to_le_bytes()).collect();
    finish_avg(DType::I64, &mut b, 4).expect("ok");
    assert_eq!(b, [-2i64, 2].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());

    let mut b = 1i32.to_le_bytes().to_vec();
    finish_avg(DType::I32, &mut b, u32::MAX).expect("ok");
    assert_eq!(b, 0i32.to_le_bytes());

    let mut b: Vec<u8> = [3.0f32, -1.5].iter().flat_map(|x| x.to_le_bytes()).collect();
    finish_avg(DType::F32, &mut b, 3).expect("ok");
    assert_eq!(b, [1.0f32, -0.5].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());

    let mut b = 6.0f64.to_le_bytes().to_vec();
    finish_avg(DType::F64, &mut b, 4).expect("ok");
    assert_eq!(b, 1.5f64.to_le_bytes());

    let mut b = f32_to_f16(3.0).to_le_bytes().to_vec();
    finish_avg(DType::F16, &mut b, 2).expect("ok");
    assert_eq!(b, f32_to_f16(1.5).to_le_bytes());

    let mut b = f32_to_bf16(3.0).to_le_bytes().to_vec();
    finish_avg(DType::BF16, &mut b, 2).expect("ok");
    assert_eq!(b, f32_to_bf16(1.5).to_le_bytes());

    assert_eq!(finish_avg(DType::F32, &mut [0; 4], 0), Err(ReduceError::ZeroCount));
}

// ---- 16-bit conversions --------------------------------------------------------------

#[test]
fn f16_all_bit_patterns_round_trip() {
    for h in 0..=u16::MAX {
        let f = f16_to_f32(h);
        let r = ref_f16_to_f32(h);
        if r.is_nan() {
            assert!(f.is_nan(), "{h:#06x}");
            assert!(f32_to_f16(f) & 0x7fff > 0x7c00, "{h:#06x} stays NaN");
            assert_eq!(f32_to_f16(f) & 0x8000, h & 0x8000, "{h:#06x} keeps its sign");
        } else {
            assert_eq!(f.to_bits(), r.to_bits(), "{h:#06x}");
            assert_eq!(f32_to_f16(f), h, "{h:#06x}");
        }
    }
}

#[test]
fn bf16_all_bit_patterns_round_trip() {
    for h in 0..=u16::MAX {
        let f = bf16_to_f32(h);
        if f.is_nan() {
            let back = f32_to_bf16(f);
            assert!(bf16_to_f32(back).is_nan(), "{h:#06x}");
            assert_eq!(back & 0x8000, h & 0x8000);
        } else {
            assert_eq!(f32_to_bf16(f), h, "{h:#06x}");
        }
    }
}

#[test]
fn f16_known_values() {
    assert_eq!(f32_to_f16(1.0), 0x3c00);
    assert_eq!(f32_to_f16(-2.0), 0xc000);
    assert_eq!(f32_to_f16(65504.0), 0x7bff);
    assert_eq!(f16_to_f32(0x7bff), 65504.0);
    assert_eq!(f32_to_f16(65519.0), 0x7bff); // below the halfway point to 65536
    assert_eq!(f32_to_f16(65520.0), 0x7c00); // tie between 65504 and 2^16: even is Inf
    assert_eq!(f32_to_f16(1e10), 0x7c00);
    assert_eq!(f32_to_f16(f32::NEG_INFINITY), 0xfc00);
    assert_eq!(f32_to_f16(0.0), 0x0000);
    assert_eq!(f32_to_f16(-0.0), 0x8000);
    let tiny = 2f32.powi(-24); // smallest subnormal
    assert_eq!(f32_to_f16(tiny), 0x0001);
    assert_eq!(f16_to_f32(0x0001), tiny);
    assert_eq!(f32_to_f16(tiny / 2.0), 0x0000); // tie between 0 and 1 ulp: even is 0
    assert_eq!(f32_to_f16(tiny * 1.5), 0x0002); // tie between 1 and 2 ulp: even is 2
    assert_eq!(f32_to_f16(tiny * 2.5), 0x0002); // tie between 2 and 3 ulp: even is 2
    assert_eq!(f32_to_f16(tiny * 0.5001), 0x0001);
    assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14)); // smallest normal
    assert_eq!(f32_to_f16(2f32.powi(-14) - tiny / 2.0), 0x0400); // tie 0x3ff/0x400: even
    // Ties in the normal range: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
    assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00);
    assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02);
    assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11) + 2f32.powi(-20)), 0x3c01);
    assert!(f16_to_f32(0x7e00).is_nan());
    assert!(f16_to_f32(0x7c01).is_nan());
    assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
}

#[test]
fn bf16_known_values() {
    assert_eq!(f32_to_bf16(1.0), 0x3f80);
    assert_eq!(bf16_to_f32(0x3f80), 1.0);
    assert_eq!(f32_to_bf16(f32::MAX), 0x7f80); // rounds up into infinity
    assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie, even stays
    assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie, odd rounds up
    assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
    assert_eq!(f32_to_bf16(f32::from_bits(0x0000_0001)), 0x0000); // smallest f32 subnormal
    assert_eq!(f32_to_bf16(f32::from_bits(0x0000_8001)), 0x0001);
    assert_eq!(bf16_to_f32(0x0001), f32::from_bits(0x0001_0000)); // smallest bf16 subnormal
    // A NaN whose payload lives only in the low bits must not become infinity.
    assert!(bf16_to_f32(f32_to_bf16(f32::from_bits(0x7f80_0001))).is_nan());
    assert!(bf16_to_f32(f32_to_bf16(f32::from_bits(0xff80_0001))).is_nan());
}

/// The branch-free conversions against the textbook ones: a stride through all f32 bit
/// patterns, plus each halfway point between neighbouring halves and its neighbours.
#[test]
fn fast_narrowing_matches_reference() {
    let mut bits = 0u32;
    loop {
        let f = f32::from_bits(bits);
        let (h, r) = (f32_to_f16(f), ref_f32_to_f16(f));
        if f.is_nan() {
            assert!(h & 0x7fff > 0x7c00, "{bits:#010x}");
        } else {
            assert_eq!(h, r, "f16 {bits:#010x}");
        }
        let (h, r) = (f32_to_bf16(f), ref_f32_to_bf16(f));
        if f.is_nan() {
            assert!(bf16_to_f32(h).is_nan(), "{bits:#010x}");
        } else {
            assert_eq!(h, r, "bf16 {bits:#010x}");
        }
        match bits.checked_add(4093) {
            Some(b) => bits = b,
            None => break,
        }
    }
    for h in 0..0x7c00u16 {
        let lo = f64::from(ref_f16_to_f32(h));
        let hi = f64::from(ref_f16_to_f32(h + 1));
        let mid = ((lo + hi) / 2.0) as f32; // exact: the midpoint has 12 significant bits
        for f in [mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
            for f in [f, -f] {
                assert_eq!(f32_to_f16(f), ref_f32_to_f16(f), "{:#010x}", f.to_bits());
            }
        }
    }
}

/// The F16C path against the portable one: every half as the accumulator, against
/// shuffled partners (so NaN, Inf, subnormal and ordinary values meet each other), with a
/// length that leaves a tail for the portable loop.
#[cfg(target_arch = "x86_64")]
#[test]
fn f16c_path_matches_portable_path() {
    if !f16c::available() {
        eprintln!("CPU without F16C: only the portable path runs here");
        return;
    }
    let mut rng = Rng::new(42);
    let halves: Vec<u16> = (0..=u16::MAX).collect();
    let all: Vec<u8> = halves.iter().flat_map(|h| h.to_le_bytes()).collect();
    let len = all.len() - 6; // 3 elements of tail after the 8-element blocks
    let check = |fast: &[u8], slow: &[u8], what: &str| {
        for (i, (f, s)) in fast.chunks(2).zip(slow.chunks(2)).enumerate() {
            let (f, s) = (u16::from_le_bytes([f[0], f[1]]), u16::from_le_bytes([s[0], s[1]]));
            if f16_to_f32(s).is_nan() {
                // Canonical quiet NaN on both paths; only the sign may differ (see f16c).
                assert_eq!(f & 0x7fff, 0x7e00, "{what}: element {i}");
                assert_eq!(s & 0x7fff, 0x7e00, "{what}: element {i}");
            } else {
                assert_eq!(f, s, "{what}: element {i}");
            }
        }
    };
    for round in 0..4 {
        let mut partners = halves.clone();
        rng.shuffle(&mut partners);
        let other: Vec<u8> = partners.iter().flat_map(|h| h.to_le_bytes()).collect();
        for op in ReduceOp::ALL {
            let mut fast = all[..len].to_vec();
            reduce_into(DType::F16, op, &mut fast, &other[..len]).expect("ok");
            let mut slow = all[..len].to_vec();
            float_op::<F16>(op, &mut slow, &other[..len]);
            check(&fast, &slow, &format!("{op} round {round}"));
        }
    }
    for n in [1, 2, 3, 7, 1000, u32::MAX] {
        let mut fast = all[..len].to_vec();
        finish_avg(DType::F16, &mut fast, n).expect("ok");
        let mut slow = all[..len].to_vec();
        map::<F16>(&mut slow, |x| x / n as f32);
        check(&fast, &slow, &format!("finish_avg {n}"));
    }
}
