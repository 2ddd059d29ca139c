//! Element-wise reduction kernels for the QUIC ring allreduce.
//!
//! Buffers are plain little-endian byte slices (what arrives from the wire and what is
//! copied from the GPU), so nothing here needs alignment or `unsafe`. Each call dispatches
//! once on `(dtype, op)` to a monomorphic loop over `chunks_exact`, with loads and stores
//! through `from_le_bytes`/`to_le_bytes`; LLVM turns those loops into SIMD code, which
//! matters because these kernels run on the hot path of small (2-core) machines.
//!
//! Semantics, chosen to match torch / NCCL where they define them:
//! - `Sum` of integers wraps on overflow (two's complement), as NCCL and torch do on GPU.
//! - `Avg` accumulates exactly as `Sum`; [`finish_avg`] divides once at the end. For
//!   integers the division truncates toward zero (Rust's and C's `/`); torch leaves
//!   integer averaging undefined, so this is our choice, made to be simple and symmetric.
//! - `Min`/`Max` propagate NaN (like `torch.minimum`/`torch.maximum`): if either input is
//!   NaN, the result is NaN. Which of two NaN payloads survives, and the sign of a zero
//!   result of `Min(-0.0, +0.0)`, depend on argument order.
//! - `F16`/`BF16` are widened to `f32`, combined, and rounded back (round to nearest, ties
//!   to even) at every step, as a GPU kernel doing `__hadd` would. Rounding at each step
//!   makes the result depend on the reduction order; the ring still ends bitwise identical
//!   on every rank because each chunk is reduced in one fixed order (along the ring) and
//!   every other rank then *copies* the owner's final bytes in the all-gather instead of
//!   recomputing them (see [`crate::ring`]).

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of a buffer being reduced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary64.
    F64,
    /// IEEE binary16 (`half`).
    F16,
    /// bfloat16: the top 16 bits of a binary32.
    BF16,
    /// Two's-complement 32-bit integer.
    I32,
    /// Two's-complement 64-bit integer.
    I64,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 6] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The canonical (numpy/torch) name: `float32`, `float64`, `float16`, `bfloat16`,
    /// `int32`, `int64`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I32 => "int32",
            DType::I64 => "int64",
        }
    }

    /// Parses a canonical name or a common numpy/torch spelling (`float`, `double`, `half`,
    /// `int`, `long`, `f32`, `fp16`, `bf16`...), case-insensitive, with an optional
    /// `torch.` prefix (so `str(tensor.dtype)` works).
    pub fn parse(s: &str) -> Result<DType, ReduceError> {
        let lower = s.trim().to_ascii_lowercase();
        let name = lower.strip_prefix("torch.").unwrap_or(&lower);
        Ok(match name {
            "float32" | "float" | "f32" | "fp32" => DType::F32,
            "float64" | "double" | "f64" | "fp64" => DType::F64,
            "float16" | "half" | "f16" | "fp16" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            "int32" | "int" | "i32" => DType::I32,
            "int64" | "long" | "i64" => DType::I64,
            _ => return Err(ReduceError::UnknownDType(s.to_owned())),
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The reduction applied element-wise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// Sum (integers wrap).
    Sum,
    /// Mean: accumulated as `Sum`, then divided once by [`finish_avg`].
    Avg,
    /// Minimum, NaN-propagating.
    Min,
    /// Maximum, NaN-propagating.
    Max,
}

impl ReduceOp {
    /// Every op, in declaration order.
    pub const ALL: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max];

    /// Lower-case name: `sum`, `avg`, `min`, `max`.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }

    /// Parses `sum`, `avg` (or `mean`, `average`), `min`, `max`, case-insensitive, with an
    /// optional `ReduceOp.` prefix (so torch's `ReduceOp.SUM` works).
    pub fn parse(s: &str) -> Result<ReduceOp, ReduceError> {
        let lower = s.trim().to_ascii_lowercase();
        let name = lower.strip_prefix("reduceop.").unwrap_or(&lower);
        Ok(match name {
            "sum" => ReduceOp::Sum,
            "avg" | "mean" | "average" => ReduceOp::Avg,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            _ => return Err(ReduceError::UnknownOp(s.to_owned())),
        })
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a reduction was refused. Nothing is modified when an error is returned.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReduceError {
    /// The two buffers differ in length.
    #[error("buffer lengths differ: {acc} vs {other} bytes")]
    LengthMismatch {
        /// Length of the accumulator.
        acc: usize,
        /// Length of the incoming buffer.
        other: usize,
    },
    /// The length is not a whole number of elements.
    #[error("{len} bytes is not a multiple of the {size}-byte {dtype} element")]
    NotMultiple {
        /// Length in bytes.
        len: usize,
        /// Element size.
        size: usize,
        /// Element type.
        dtype: DType,
    },
    /// [`finish_avg`] with a count of zero.
    #[error("cannot average over zero participants")]
    ZeroCount,
    /// [`DType::parse`] did not recognise the name.
    #[error("unknown dtype {0:?}")]
    UnknownDType(String),
    /// [`ReduceOp::parse`] did not recognise the name.
    #[error("unknown reduce op {0:?}")]
    UnknownOp(String),
}

/// `acc[i] = op(acc[i], other[i])` for every element, on little-endian bytes.
///
/// Both slices must have the same length, a multiple of `dtype.size()`; otherwise an error
/// is returned and `acc` is left untouched. `Avg` accumulates as `Sum` (call
/// [`finish_avg`] once at the end). See the module docs for NaN, overflow and rounding.
pub fn reduce_into(dtype: DType, op: ReduceOp, acc: &mut [u8], other: &[u8]) -> Result<(), ReduceError> {
    if acc.len() != other.len() {
        return Err(ReduceError::LengthMismatch { acc: acc.len(), other: other.len() });
    }
    check_multiple(dtype, acc.len())?;
    match dtype {
        DType::F32 => float_op::<F32>(op, acc, other),
        DType::F64 => float_op::<F64>(op, acc, other),
        DType::F16 => {
            #[cfg(target_arch = "x86_64")]
            if f16c::available() {
                // SAFETY: the CPU has AVX and F16C, checked just above.
                let done = unsafe { f16c::reduce(op, acc, other) };
                float_op::<F16>(op, &mut acc[done..], &other[done..]);
                return Ok(());
            }
            float_op::<F16>(op, acc, other)
        }
        DType::BF16 => float_op::<BF16>(op, acc, other),
        DType::I32 => int_op::<I32>(op, acc, other),
        DType::I64 => int_op::<I64>(op, acc, other),
    }
    Ok(())
}

/// Divides every element of `buf` by `n`, completing an `Avg` reduction over `n` ranks.
///
/// Floats divide (f16/bf16 in f32, rounded back once). Integers truncate toward zero
/// (`-7 / 2 == -3`), our documented choice since torch does not define integer averaging.
/// Errors: `n == 0`, or a length that is not a whole number of elements.
pub fn finish_avg(dtype: DType, buf: &mut [u8], n: u32) -> Result<(), ReduceError> {
    if n == 0 {
        return Err(ReduceError::ZeroCount);
    }
    check_multiple(dtype, buf.len())?;
    match dtype {
        DType::F32 => map::<F32>(buf, |x| x / n as f32),
        DType::F64 => map::<F64>(buf, |x| x / f64::from(n)),
        DType::F16 => {
            #[cfg(target_arch = "x86_64")]
            if f16c::available() {
                // SAFETY: the CPU has AVX and F16C, checked just above.
                let done = unsafe { f16c::divide(buf, n as f32) };
                map::<F16>(&mut buf[done..], |x| x / n as f32);
                return Ok(());
            }
            map::<F16>(buf, |x| x / n as f32)
        }
        DType::BF16 => map::<BF16>(buf, |x| x / n as f32),
        // i32 / n with n up to u32::MAX: divide in i64 so large n gives 0, not a wrap.
        DType::I32 => map::<I32>(buf, |x| (i64::from(x) / i64::from(n)) as i32),
        DType::I64 => map::<I64>(buf, |x| x / i64::from(n)),
    }
    Ok(())
}

fn check_multiple(dtype: DType, len: usize) -> Result<(), ReduceError> {
    if len % dtype.size() != 0 {
        return Err(ReduceError::NotMultiple { len, size: dtype.size(), dtype });
    }
    Ok(())
}

/// How one element is read from and written to little-endian bytes, and the type the
/// arithmetic happens in (`f32` for the 16-bit floats).
trait Codec {
    type V: Copy;
    const SIZE: usize;
    fn load(b: &[u8]) -> Self::V;
    fn store(v: Self::V, b: &mut [u8]);
}

/// `b` as a fixed-size array. The chunks come from `chunks_exact(N)`, so the fallback is
/// dead code that LLVM removes; it exists so that no panic path is compiled in.
#[inline(always)]
fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
    <[u8; N]>::try_from(b).unwrap_or([0; N])
}

macro_rules! plain_codec {
    ($name:ident, $t:ty, $n:literal) => {
        struct $name;
        impl Codec for $name {
            type V = $t;
            const SIZE: usize = $n;
            #[inline(always)]
            fn load(b: &[u8]) -> $t {
                <$t>::from_le_bytes(arr::<$n>(b))
            }
            #[inline(always)]
            fn store(v: $t, b: &mut [u8]) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        }
    };
}

plain_codec!(F32, f32, 4);
plain_codec!(F64, f64, 8);
plain_codec!(I32, i32, 4);
plain_codec!(I64, i64, 8);

struct F16;
impl Codec for F16 {
    type V = f32;
    const SIZE: usize = 2;
    #[inline(always)]
    fn load(b: &[u8]) -> f32 {
        f16_to_f32(u16::from_le_bytes(arr::<2>(b)))
    }
    #[inline(always)]
    fn store(v: f32, b: &mut [u8]) {
        b.copy_from_slice(&f32_to_f16(v).to_le_bytes());
    }
}

struct BF16;
impl Codec for BF16 {
    type V = f32;
    const SIZE: usize = 2;
    #[inline(always)]
    fn load(b: &[u8]) -> f32 {
        bf16_to_f32(u16::from_le_bytes(arr::<2>(b)))
    }
    #[inline(always)]
    fn store(v: f32, b: &mut [u8]) {
        b.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
    }
}

/// The one loop every kernel is an instance of. `inline(always)` so each `(codec, op)`
/// pair becomes its own branch-free loop that LLVM vectorizes.
#[inline(never)]
fn zip_apply<C: Codec>(acc: &mut [u8], other: &[u8], f: impl Fn(C::V, C::V) -> C::V) {
    for (a, b) in acc.chunks_exact_mut(C::SIZE).zip(other.chunks_exact(C::SIZE)) {
        let r = f(C::load(a), C::load(b));
        C::store(r, a);
    }
}

#[inline(never)]
fn map<C: Codec>(buf: &mut [u8], f: impl Fn(C::V) -> C::V) {
    for a in buf.chunks_exact_mut(C::SIZE) {
        let r = f(C::load(a));
        C::store(r, a);
    }
}

// `a < b || a.is_nan()` picks `a` when it is the smaller or NaN, else `b` (which is then
// the smaller, equal, or NaN): NaN in either input propagates, with two compares and a
// select per element, no branch.
fn float_op<C>(op: ReduceOp, acc: &mut [u8], other: &[u8])
where
    C: Codec,
    C::V: std::ops::Add<Output = C::V> + PartialOrd,
{
    #[allow(clippy::eq_op)] // `a != a` is the generic NaN test
    match op {
        ReduceOp::Sum | ReduceOp::Avg => zip_apply::<C>(acc, other, |a, b| a + b),
        ReduceOp::Min => zip_apply::<C>(acc, other, |a, b| if a < b || a != a { a } else { b }),
        ReduceOp::Max => zip_apply::<C>(acc, other, |a, b| if a > b || a != a { a } else { b }),
    }
}

trait WrappingInt: Copy + Ord {
    fn wrapping_add(self, other: Self) -> Self;
}
impl WrappingInt for i32 {
    #[inline(always)]
    fn wrapping_add(self, other: i32) -> i32 {
        i32::wrapping_add(self, other)
    }
}
impl WrappingInt for i64 {
    #[inline(always)]
    fn wrapping_add(self, other: i64) -> i64 {
        i64::wrapping_add(self, other)
    }
}

fn int_op<C>(op: ReduceOp, acc: &mut [u8], other: &[u8])
where
    C: Codec,
    C::V: WrappingInt,
{
    match op {
        ReduceOp::Sum | ReduceOp::Avg => zip_apply::<C>(acc, other, |a, b| a.wrapping_add(b)),
        ReduceOp::Min => zip_apply::<C>(acc, other, |a, b| a.min(b)),
        ReduceOp::Max => zip_apply::<C>(acc, other, |a, b| a.max(b)),
    }
}

// ---- 16-bit float conversions -------------------------------------------------------
//
// Written without branches (selects only) so the f16/bf16 loops vectorize too. The f16
// pair follows Fabian Giesen's well-known `half_to_float` / `float_to_half_fast3_rtne`.

/// IEEE binary16 bits to `f32` (exact: every half is representable). NaN stays NaN
/// (payload kept), infinities and subnormals are exact.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    const MAGIC: f32 = f32::from_bits(113 << 23); // 2^-14, the smallest normal half
    const SHIFTED_EXP: u32 = 0x7c00 << 13;
    let h = u32::from(h);
    let mut o = (h & 0x7fff) << 13; // exponent and mantissa, in place for an f32
    let exp = o & SHIFTED_EXP;
    o += (127 - 15) << 23; // rebias the exponent
    // Inf/NaN: push the exponent to all ones.
    let inf_nan = o + ((128 - 16) << 23);
    // Zero/subnormal: bump the exponent once more and subtract the implicit one as a
    // float, which renormalizes exactly.
    let sub = f32::from_bits(o + (1 << 23)) - MAGIC;
    let o = if exp == SHIFTED_EXP {
        inf_nan
    } else if exp == 0 {
        sub.to_bits()
    } else {
        o
    };
    f32::from_bits(o | ((h & 0x8000) << 16))
}

/// `f32` to IEEE binary16 bits, rounding to nearest, ties to even. Overflow gives
/// infinity, tiny values round into the subnormals or to (signed) zero, NaN gives the
/// quiet NaN `0x7e00` with the sign kept.
#[inline(always)]
pub fn f32_to_f16(f: f32) -> u16 {
    const F32_INF: u32 = 255 << 23;
    const F16_MAX: u32 = (127 + 16) << 23; // 65536.0: anything at or above overflows
    const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23; // 0.5
    let bits = f.to_bits();
    let sign = bits & 0x8000_0000;
    let u = bits ^ sign;

    let special = if u > F32_INF { 0x7e00 } else { 0x7c00 };
    // Subnormal result: adding 0.5 aligns the 10 mantissa bits at the bottom of the f32,
    // and the FPU's own round-to-nearest-even does the rounding.
    let denorm = (f32::from_bits(u) + f32::from_bits(DENORM_MAGIC)).to_bits().wrapping_sub(DENORM_MAGIC);
    // Normal result: rebias, add 0x0fff plus the lowest kept bit (ties to even), truncate.
    // A carry out of the mantissa correctly bumps the exponent (up to infinity).
    let mant_odd = (u >> 13) & 1;
    const REBIAS: u32 = ((15i32 - 127) << 23) as u32;
    let normal = u.wrapping_add(REBIAS).wrapping_add(0xfff + mant_odd) >> 13;

    let o = if u >= F16_MAX {
        special
    } else if u < (113 << 23) {
        denorm
    } else {
        normal
    };
    (o | (sign >> 16)) as u16
}

/// bfloat16 bits to `f32` (exact: a bfloat16 is the top half of an f32).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// `f32` to bfloat16 bits, rounding to nearest, ties to even. Overflow gives infinity
/// (by the carry into the exponent); NaN stays NaN (quiet bit set, sign and top payload
/// bits kept, so a NaN can never round into an infinity).
#[inline(always)]
pub fn f32_to_bf16(f: f32) -> u16 {
    let bits = f.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let nan = (bits >> 16) | 0x0040;
    (if f.is_nan() { nan } else { rounded }) as u16
}

/// f16 through the F16C conversion instructions, 8 lanes at a time: about 5x the
/// portable path, which (with only SSE2 guaranteed) spends ~20 instructions per element on
/// the two conversions. Results are bitwise those of the portable path: same rounding
/// (nearest, ties to even), same operand selection in min/max, and NaN results are
/// canonicalised to the portable path's quiet NaN (sign kept) before narrowing. Only the
/// sign of a NaN produced from two NaN inputs may differ, as it may between compilers.
/// This is the crate's only `unsafe`: the vector loads and stores, and calling into code
/// compiled for AVX after checking the CPU has it.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use super::ReduceOp;
    use std::arch::x86_64::*;

    /// Whether the CPU can run this module's functions (checked once by std, then cached).
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c")
    }

    /// Eight halves from 16 bytes, widened to f32.
    ///
    /// # Safety
    /// AVX and F16C; `src` is at least 16 bytes long.
    #[inline]
    #[target_feature(enable = "avx,f16c")]
    unsafe fn load(src: &[u8]) -> __m256 {
        debug_assert!(src.len() >= 16);
        // SAFETY: 16 readable bytes (caller); the load has no alignment requirement.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().cast())) }
    }

    /// Narrows eight f32 to halves (nearest, ties to even) into 16 bytes; a NaN becomes
    /// the portable path's quiet NaN (`0x7e00` with the sign), not F16C's payload copy.
    ///
    /// # Safety
    /// AVX and F16C; `dst` is at least 16 bytes long.
    #[inline]
    #[target_feature(enable = "avx,f16c")]
    unsafe fn store(dst: &mut [u8], r: __m256) {
        debug_assert!(dst.len() >= 16);
        // SAFETY: 16 writable bytes (caller); the store has no alignment requirement.
        unsafe {
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(r, r);
            let quiet = _mm256_or_ps(
                _mm256_and_ps(r, _mm256_set1_ps(-0.0)),
                _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0_0000)),
            );
            let r = _mm256_blendv_ps(r, quiet, nan);
            _mm_storeu_si128(dst.as_mut_ptr().cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r));
        }
    }

    /// One pass over whole 16-byte blocks (8 halves) of `acc` and `other`, evaluating to
    /// the bytes processed. `$body` maps the widened lanes `$a`, `$b` to result lanes.
    macro_rules! blocks {
        ($acc:expr, $other:expr, |$a:ident, $b:ident| $body:expr) => {{
            let mut ai = $acc.chunks_exact_mut(16);
            for (pa, pb) in (&mut ai).zip($other.chunks_exact(16)) {
                // SAFETY: both chunks are 16 bytes; the caller guarantees AVX and F16C.
                unsafe {
                    let ($a, $b) = (load(pa), load(pb));
                    store(pa, $body);
                }
            }
            let rest = ai.into_remainder().len();
            $acc.len() - rest
        }};
    }

    /// `acc = op(acc, other)` on the longest prefix of whole 8-element blocks; returns
    /// its length in bytes (the caller finishes the tail with the portable loop).
    ///
    /// # Safety
    /// The CPU must support AVX and F16C ([`available`]).
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn reduce(op: ReduceOp, acc: &mut [u8], other: &[u8]) -> usize {
        let len = acc.len().min(other.len());
        let acc = &mut acc[..len];
        match op {
            ReduceOp::Sum | ReduceOp::Avg => blocks!(acc, other, |a, b| _mm256_add_ps(a, b)),
            // As the portable path: pick `a` when `a < b` or `a` is NaN, else `b`.
            ReduceOp::Min => blocks!(acc, other, |a, b| {
                let pick_a =
                    _mm256_or_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(a, b), _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a));
                _mm256_blendv_ps(b, a, pick_a)
            }),
            ReduceOp::Max => blocks!(acc, other, |a, b| {
                let pick_a =
                    _mm256_or_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(a, b), _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a));
                _mm256_blendv_ps(b, a, pick_a)
            }),
        }
    }

    /// `buf /= n` on the longest prefix of whole 8-element blocks; returns its length.
    ///
    /// # Safety
    /// The CPU must support AVX and F16C ([`available`]).
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn divide(buf: &mut [u8], n: f32) -> usize {
        let mut ai = buf.chunks_exact_mut(16);
        for pa in &mut ai {
            // SAFETY: the chunk is 16 bytes; the caller guarantees AVX and F16C.
            unsafe { store(pa, _mm256_div_ps(load(pa), _mm256_set1_ps(n))) };
        }
        let rest = ai.into_remainder().len();
        buf.len() - rest
    }
}

#[cfg(test)]
mod tests;
