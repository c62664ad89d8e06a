//! A GEMM on bf16 inputs with f32 accumulation: AMX tiles where the CPU
//! has them ([`super::amx`]), else AVX-512 BF16's `vdpbf16ps` where the CPU
//! has it (both detected at run time), the same arithmetic through the f32
//! GEMM elsewhere.
//!
//! dst (m, n) (+)= a (m, k) · b (k, n), every input element first rounded to
//! bf16 (to nearest even, as `half::bf16::from_f32`), products summed in
//! f32. Inputs are f32 or bf16 with any strides; they are converted while
//! being packed into cache-sized panels, never copied whole.
//!
//! | level | size | holds |
//! |---|---|---|
//! | microkernel | 12 rows × 32 columns | 24 zmm accumulators; per k pair: 2 loads of b, 12 broadcasts of a, 24 `vdpbf16ps` (each 16 columns × 2 k) |
//! | A panel | every row × 384 k | bf16 pairs, k pair-major (a broadcast reads one 32-bit pair), packed once per k panel |
//! | B panel | 384 k × 512 columns | bf16 pairs, k pair-major, 32 columns per strip (24 KiB: stays in L1 while A's strips pass) |
//!
//! One thread of an AMD Zen 4 core: 232 GFLOP/s in the microkernel alone,
//! 170–190 in the head's shapes (1.6–1.75× the `gemm` crate's AVX2 f32);
//! of a Zen 5 core: 517 in the microkernel (97% of its 2 × 512-bit
//! `vdpbf16ps` peak), 460–495 in the head's shapes.
//! An Intel core that has AVX-512 BF16 issues one `vdpbf16ps` per cycle
//! against two FMAs, so there this kernel is no faster than the f32 GEMM
//! (its AMX tiles are: [`super::amx`]). `shardnet bench gemm` says which.
//!
//! Packing reads each operand in its own order on AVX-512: rows that run
//! along k are converted 32 k at a time (`vcvtne2ps2bf16`, or bf16 read
//! as is) and turned into pair rows by 16 × 16 transposes; k rows that
//! run across the rows are interleaved two at a time, 16 rows' pairs per
//! store. A strip narrower than 16 (A's 12 rows) is one short run, stored
//! under a mask (a masked store is several times slower on AMD's cores,
//! so a whole run never takes one).
//!
//! A k pair (k, k + 1) is one 32-bit word of two bf16: `vdpbf16ps` adds
//! a_k·b_k + a_{k+1}·b_{k+1} into each f32 lane; an odd k is padded with a
//! zero pair half.

use super::Operand;
use half::bf16;
use std::sync::atomic::{AtomicBool, Ordering};

/// Rows and columns of the microkernel's tile.
const MR: usize = 12;
const NR: usize = 32;
/// k per panel (even), rows per A panel, columns per B panel.
const KC: usize = 384;
const MC: usize = 96;
// A panel's strips start at multiples of MR.
const _: () = assert!(MC.is_multiple_of(MR) && KC.is_multiple_of(2));
const NC: usize = 512;

static FORCE_FALLBACK: AtomicBool = AtomicBool::new(false);

/// Whether this CPU runs AVX-512 BF16 (`vdpbf16ps`), checked once; false
/// under [`set_force_fallback`].
pub fn has_avx512_bf16() -> bool {
    if FORCE_FALLBACK.load(Ordering::Relaxed) {
        return false;
    }
    detected()
}

#[cfg(target_arch = "x86_64")]
fn detected() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f")
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn detected() -> bool {
    false
}

thread_local! {
    /// Memory to bring into cache while this thread's next GEMMs compute:
    /// (next byte, end), see [`prefetch_during_gemms`].
    static PREFETCH: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 0)) };
}

/// Cache lines prefetched per microkernel call.
const PREFETCH_LINES: usize = 24;

/// Bring `next` into cache a few lines at a time while this thread's next
/// bf16 GEMMs compute (a hint: the sharded head passes the next class
/// block of W, which it would otherwise wait on when it packs it). Replaces
/// the previous hint.
pub fn prefetch_during_gemms(next: &[f32]) {
    let start = next.as_ptr() as usize;
    PREFETCH.with(|p| p.set((start, start + std::mem::size_of_val(next))));
}

/// Issue the next few prefetches of the hint.
#[cfg(target_arch = "x86_64")]
fn prefetch_some() {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    PREFETCH.with(|p| {
        let (mut at, end) = p.get();
        for _ in 0..PREFETCH_LINES {
            if at >= end {
                break;
            }
            // SAFETY: a prefetch is a hint and never faults; the address
            // lies in a slice the caller handed over.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(at as *const i8) };
            at += 64;
        }
        p.set((at, end));
    });
}

/// Take the f32 fallback even where the CPU has AVX-512 BF16 (tests and
/// benchmarks compare the two).
pub fn set_force_fallback(on: bool) {
    FORCE_FALLBACK.store(on, Ordering::Relaxed);
}

/// An input element: f32 (rounded to bf16 when packed) or bf16.
pub trait Input: Copy + Send + Sync + 'static {
    /// The bf16 bits of each element of `src` into `dst` (one length).
    fn convert(src: &[Self], dst: &mut [u16]);
    /// One element's bf16 bits.
    fn bits(self) -> u16;
    /// The elements, where they are f32 (the packers' vector paths read
    /// each kind its own way).
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    /// The elements' bits, where they are bf16.
    fn as_bits(_: &[Self]) -> Option<&[u16]> {
        None
    }
}

impl Input for f32 {
    fn convert(src: &[f32], dst: &mut [u16]) {
        #[cfg(target_arch = "x86_64")]
        if has_avx512_bf16() {
            // SAFETY: the CPU has AVX-512 BF16 (checked just above).
            unsafe { convert_avx512(src, dst) };
            return;
        }
        super::vector::to_bf16(src, dst);
    }
    fn bits(self) -> u16 {
        super::vector::bf16_bits(self)
    }
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
}

impl Input for bf16 {
    fn convert(src: &[bf16], dst: &mut [u16]) {
        use half::slice::HalfFloatSliceExt;
        dst.copy_from_slice(src.reinterpret_cast());
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn as_bits(s: &[bf16]) -> Option<&[u16]> {
        use half::slice::HalfFloatSliceExt;
        Some(s.reinterpret_cast())
    }
}

/// `src` to bf16 bits with `vcvtneps2bf16` (round to nearest even, NaN
/// quieted: the bits `half::bf16::from_f32` gives), 16 at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512f")]
unsafe fn convert_avx512(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let whole = n / 16 * 16;
    for i in (0..whole).step_by(16) {
        // SAFETY: i + 16 ≤ n elements of both slices; __m256bh and __m256i
        // are both 256 bits.
        unsafe {
            let v = _mm512_loadu_ps(src.as_ptr().add(i));
            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), h);
        }
    }
    for i in whole..n {
        dst[i] = super::vector::bf16_bits(src[i]);
    }
}

/// dst (m, n) (+)= a (m, k) · b (k, n) with bf16-rounded inputs and f32
/// sums (see the module doc); dst with its own strides (row, column).
/// `accumulate` adds to dst instead of overwriting it.
pub fn matmul_bf16<A: Input, B: Input>(
    m: usize,
    n: usize,
    k: usize,
    dst: (&mut [f32], usize, usize),
    accumulate: bool,
    a: Operand<'_, A>,
    b: Operand<'_, B>,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        let (dst, drs, dcs) = dst;
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    dst[r * drs + c * dcs] = 0.0;
                }
            }
        }
        return;
    }
    if has_avx512_bf16() {
        #[cfg(target_arch = "x86_64")]
        {
            if super::amx::has_amx_bf16() {
                super::amx::gemm((m, n, k), dst, accumulate, a, b);
            } else {
                blocked::<Avx512Bf16, _, _>((m, n, k), dst, accumulate, a, b);
            }
            return;
        }
    }
    fallback(m, n, k, dst, accumulate, a, b);
}

/// The fallback: each operand rounded to bf16 and widened back to f32 (a
/// copy of each), then the f32 GEMM.
fn fallback<A: Input, B: Input>(
    m: usize,
    n: usize,
    k: usize,
    dst: (&mut [f32], usize, usize),
    accumulate: bool,
    (a, ars, acs): Operand<'_, A>,
    (b, brs, bcs): Operand<'_, B>,
) {
    let widen = |bits: u16| f32::from_bits(u32::from(bits) << 16);
    let ra: Vec<f32> = (0..m * k)
        .map(|e| widen(a[(e / k) * ars + (e % k) * acs].bits()))
        .collect();
    let rb: Vec<f32> = (0..k * n)
        .map(|e| widen(b[(e / n) * brs + (e % n) * bcs].bits()))
        .collect();
    super::matmul_strided(m, n, k, dst, accumulate, (&ra, k, 1), (&rb, n, 1));
}

/// Pack rows `r0 .. r0 + rows` of a matrix whose element (r, kk) is at
/// `r·rs + kk·ks` of `src`, k `k0 .. k0 + kc`, into strips of `width` rows
/// as k pairs: strip s holds `out[s·kps·width + p·width + r]` =
/// bits(k0 + 2p) | bits(k0 + 2p + 1) << 16 of its row r (p < kps, the
/// strip's pairs: at least ⌈kc/2⌉), zero where the row or the k is beyond
/// the matrix. The source is read in
/// its own order (rows along k, or k rows across the rows), whole rows at a
/// time, so a large operand streams from memory instead of being walked
/// strip by strip.
#[allow(clippy::too_many_arguments)]
pub(super) fn pack<E: Input>(
    (src, rs, ks): Operand<'_, E>,
    r0: usize,
    rows: usize,
    width: usize,
    (k0, kc, kps): (usize, usize, usize),
    out: &mut [u32],
    tmp: &mut Vec<u16>,
) {
    let kp = kc.div_ceil(2);
    debug_assert!(kps >= kp);
    // Pairs beyond kp are strip padding (zero), counted in the stride.
    let strips = rows.div_ceil(width);
    let out = &mut out[..strips * kps * width];
    if !rows.is_multiple_of(width) || kc % 2 == 1 || kps > kp {
        out.fill(0);
    }
    // Where row r's pair p goes.
    let at = |r: usize, p: usize| (r / width) * kps * width + p * width + r % width;
    #[cfg(target_arch = "x86_64")]
    if let Some(v) = Vector::of(src) {
        let whole_pairs = kc == 2 * kps && kps.is_multiple_of(GROUP);
        // Whole strips, so that the rows left over start one of their own.
        let whole = rows / width * width;
        if ks == 1 && whole_pairs && whole > 0 {
            // Rows along k, whole 16 × 16 blocks of pairs: converted and
            // turned straight from the source; the rows left over below.
            // SAFETY: Vector::of checked the CPU; rows r0 .. r0 + whole
            // hold k0 + kc elements each from r·rs (the caller's operand),
            // and out holds every strip's kps·width words.
            unsafe { v.rows_along_k((rs, r0, whole, width), (k0, kps), out) };
            if whole == rows {
                return;
            }
            let rest = &mut out[(whole / width) * kps * width..];
            return pack(
                (src, rs, ks),
                r0 + whole,
                rows - whole,
                width,
                (k0, kc, kps),
                rest,
                tmp,
            );
        }
        if rs == 1 {
            // k rows across the rows: two k rows at a time, up to 16
            // rows' pairs per store.
            // SAFETY: as above; k rows k0 .. k0 + kc hold r0 + rows
            // elements from kk·ks.
            unsafe { v.rows_across((ks, r0, rows, width), (k0, kc, kps), out) };
            return;
        }
    }
    if ks == 1 {
        // Rows contiguous along k: convert 16 rows, then turn each 16 × 16
        // block of their pairs into 16 pair rows of the strip (AVX-512);
        // the rows left over one by one: convert, then spread the pairs.
        let whole = if width.is_multiple_of(GROUP)
            && kps.is_multiple_of(GROUP)
            && super::simd_level() == super::SimdLevel::Avx512
        {
            rows / GROUP * GROUP
        } else {
            0
        };
        tmp.resize((GROUP * 2 * kps).max(kp * 2), 0);
        #[cfg(target_arch = "x86_64")]
        for g in (0..whole).step_by(GROUP) {
            for (i, t) in tmp.chunks_exact_mut(2 * kps).take(GROUP).enumerate() {
                let start = (r0 + g + i) * rs + k0;
                E::convert(&src[start..start + kc], &mut t[..kc]);
                t[kc..].fill(0);
            }
            let strip = &mut out[(g / width) * kps * width + g % width..];
            for p0 in (0..kps).step_by(GROUP) {
                // SAFETY: the CPU has AVX-512 F and BW (simd_level); tmp
                // holds 16 rows of 2·kps, and the strip kps rows of width
                // ≥ 16 words from g % width (a multiple of 16).
                unsafe { pairs_block(tmp, kps, p0, &mut strip[p0 * width..], width) };
            }
        }
        tmp.resize(kp * 2, 0);
        for r in whole..rows {
            let start = (r0 + r) * rs + k0;
            E::convert(&src[start..start + kc], &mut tmp[..kc]);
            if kc % 2 == 1 {
                tmp[kc] = 0;
            }
            for (p, pair) in tmp.chunks_exact(2).enumerate() {
                out[at(r, p)] = u32::from(pair[0]) | (u32::from(pair[1]) << 16);
            }
        }
    } else if rs == 1 {
        // k rows contiguous across the rows: convert two whole k rows,
        // interleave them into every strip.
        tmp.resize(2 * rows, 0);
        for p in 0..kp {
            let (lo, hi) = tmp.split_at_mut(rows);
            let row = |kk: usize| (k0 + kk) * ks + r0;
            E::convert(&src[row(2 * p)..row(2 * p) + rows], lo);
            if 2 * p + 1 < kc {
                E::convert(&src[row(2 * p + 1)..row(2 * p + 1) + rows], hi);
            } else {
                hi.fill(0);
            }
            for (s, (l, h)) in lo.chunks(width).zip(hi.chunks(width)).enumerate() {
                let o = &mut out[s * kps * width + p * width..][..l.len()];
                for ((o, l), h) in o.iter_mut().zip(l).zip(h) {
                    *o = u32::from(*l) | (u32::from(*h) << 16);
                }
            }
        }
    } else {
        for p in 0..kp {
            for r in 0..rows {
                let bits = |kk: usize| src[(r0 + r) * rs + (k0 + kk) * ks].bits();
                let hi = if 2 * p + 1 < kc { bits(2 * p + 1) } else { 0 };
                out[at(r, p)] = u32::from(bits(2 * p)) | (u32::from(hi) << 16);
            }
        }
    }
}

/// Pairs per block of the 16 × 16 transposes
/// ([`super::transpose::transpose16_words`]).
pub(super) const GROUP: usize = 16;

/// 16 rows' pairs `p0 .. p0 + 16` (row i's bf16 at `tmp[i·2·kps ..]`, two
/// per pair) into pair rows `out[q·width ..][..16]`, q < 16.
///
/// # Safety
/// The CPU has AVX-512 F; `tmp` holds 16·2·kps elements, p0 + 16 ≤ kps,
/// and `out` holds 15·width + 16 words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pairs_block(tmp: &[u16], kps: usize, p0: usize, out: &mut [u32], width: usize) {
    use std::arch::x86_64::*;
    assert!(tmp.len() >= GROUP * 2 * kps && p0 + GROUP <= kps && out.len() >= 15 * width + GROUP);
    let mut v = [_mm512_setzero_si512(); GROUP];
    for (i, v) in v.iter_mut().enumerate() {
        // SAFETY: 32 bf16 of row i from pair p0 (asserted).
        *v = unsafe { _mm512_loadu_si512(tmp.as_ptr().add(i * 2 * kps + 2 * p0).cast()) };
    }
    // SAFETY: the CPU has AVX-512 F (the caller's contract).
    unsafe { super::transpose::transpose16_words(&mut v) };
    for (q, v) in v.iter().enumerate() {
        // SAFETY: q·width + 16 ≤ out.len() (asserted).
        unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(q * width).cast(), *v) };
    }
}

/// A source the packers' vector paths read: f32 (rounded by
/// `vcvtne2ps2bf16`, which needs AVX-512 BF16) or bf16 bits (AVX-512 F and
/// BW), at the AVX-512 level of [`super::simd_level`].
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum Vector<'a> {
    F32(&'a [f32]),
    Bits(&'a [u16]),
}

#[cfg(target_arch = "x86_64")]
impl<'a> Vector<'a> {
    /// `src` where this CPU runs its vector paths.
    fn of<E: Input>(src: &'a [E]) -> Option<Self> {
        if super::simd_level() != super::SimdLevel::Avx512 {
            return None;
        }
        match (E::as_f32(src), E::as_bits(src)) {
            (Some(f), _) if detected() => Some(Vector::F32(f)),
            (_, Some(b)) => Some(Vector::Bits(b)),
            _ => None,
        }
    }

    /// Elements in the source.
    fn len(self) -> usize {
        match self {
            Vector::F32(s) => s.len(),
            Vector::Bits(s) => s.len(),
        }
    }

    /// [`pack`] for rows contiguous along k, whole strips (`rows` a
    /// multiple of `width`), no padding pairs (kc = 2·kps, kps a multiple
    /// of 16): up to 16 rows' 32 k at a time converted to 16 pair words
    /// per row, turned by 16 × 16 transposes into 16 pair rows.
    ///
    /// # Safety
    /// As [`pack`]'s vector path says at the call.
    unsafe fn rows_along_k(
        self,
        (rs, r0, rows, width): (usize, usize, usize, usize),
        (k0, kps): (usize, usize),
        out: &mut [u32],
    ) {
        assert!(width > 0 && rows.is_multiple_of(width) && kps.is_multiple_of(GROUP));
        assert!(out.len() >= rows.div_ceil(width) * kps * width);
        assert!(rows == 0 || (r0 + rows - 1) * rs + k0 + 2 * kps <= self.len());
        // SAFETY: the CPU runs each (Vector::of); the asserts above bound
        // every read and write.
        unsafe {
            match self {
                Vector::F32(s) => rows_along_k_f32(s, (rs, r0, rows, width), (k0, kps), out),
                Vector::Bits(s) => rows_along_k_bits(s, (rs, r0, rows, width), (k0, kps), out),
            }
        }
    }

    /// [`pack`] for k rows contiguous across the rows: for each k pair,
    /// the two k rows' bf16 bits interleaved into pair words, up to 16
    /// rows of a strip at a time.
    ///
    /// # Safety
    /// As [`pack`]'s vector path says at the call.
    unsafe fn rows_across(
        self,
        (ks, r0, rows, width): (usize, usize, usize, usize),
        (k0, kc, kps): (usize, usize, usize),
        out: &mut [u32],
    ) {
        assert!(width > 0 && kps >= kc.div_ceil(2));
        assert!(out.len() >= rows.div_ceil(width) * kps * width);
        assert!(rows == 0 || kc == 0 || (k0 + kc - 1) * ks + r0 + rows <= self.len());
        // SAFETY: as in rows_along_k.
        unsafe {
            match self {
                Vector::F32(s) => rows_across_f32(s, (ks, r0, rows, width), (k0, kc, kps), out),
                Vector::Bits(s) => rows_across_bits(s, (ks, r0, rows, width), (k0, kc, kps), out),
            }
        }
    }
}

/// 16 bf16 of a source as 16-bit lanes.
#[cfg(target_arch = "x86_64")]
trait Lanes: Copy {
    /// Elements `at .. at + 16` of `s` as bf16 bits, those whose bit is
    /// set in `mask` (the others zero, not read).
    ///
    /// # Safety
    /// The CPU runs the load; `at + i < s.len()` for each lane i in `mask`.
    unsafe fn load16(s: &[Self], at: usize, mask: u16) -> std::arch::x86_64::__m256i;
    /// Elements `at .. at + 32` as 16 pair words (k even low).
    ///
    /// # Safety
    /// As `load16`, with `at + 32 ≤ s.len()`.
    unsafe fn load32(s: &[Self], at: usize) -> std::arch::x86_64::__m512i;
}

#[cfg(target_arch = "x86_64")]
impl Lanes for f32 {
    #[inline(always)]
    unsafe fn load16(s: &[f32], at: usize, mask: u16) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (masked lanes are not read);
        // __m256bh and __m256i are both 256 bits.
        unsafe {
            let p = s.as_ptr().wrapping_add(at);
            let v = if mask == u16::MAX {
                _mm512_loadu_ps(p)
            } else {
                _mm512_maskz_loadu_ps(mask, p)
            };
            std::mem::transmute(_mm512_cvtneps_pbh(v))
        }
    }
    #[inline(always)]
    unsafe fn load32(s: &[f32], at: usize) -> std::arch::x86_64::__m512i {
        use std::arch::x86_64::*;
        // SAFETY: as load16; the second operand fills the low half.
        unsafe {
            let p = s.as_ptr().add(at);
            std::mem::transmute(_mm512_cvtne2ps_pbh(
                _mm512_loadu_ps(p.add(16)),
                _mm512_loadu_ps(p),
            ))
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for u16 {
    #[inline(always)]
    unsafe fn load16(s: &[u16], at: usize, mask: u16) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller's contract (masked lanes are not read).
        unsafe {
            use std::arch::x86_64::*;
            let p = s.as_ptr().wrapping_add(at);
            if mask == u16::MAX {
                _mm256_loadu_si256(p.cast())
            } else {
                _mm256_maskz_loadu_epi16(mask, p.cast())
            }
        }
    }
    #[inline(always)]
    unsafe fn load32(s: &[u16], at: usize) -> std::arch::x86_64::__m512i {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_si512(s.as_ptr().add(at).cast()) }
    }
}

/// The loop of [`Vector::rows_along_k`], inlined into each instruction
/// set's copy: each strip in runs of up to 16 rows (a strip of 12 is one
/// run of 12, a strip of 32 two of 16), the rows past a run's end zero in
/// the transpose and left out of its stores.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_along_k_body<L: Lanes>(
    s: &[L],
    (rs, r0, rows, width): (usize, usize, usize, usize),
    (k0, kps): (usize, usize),
    out: &mut [u32],
) {
    use std::arch::x86_64::*;
    for s0 in (0..rows).step_by(width) {
        let strip = (s0 / width) * kps * width;
        for c0 in (0..width).step_by(GROUP) {
            let n = (width - c0).min(GROUP);
            let mask = run_mask(n);
            for p0 in (0..kps).step_by(GROUP) {
                let mut v = [_mm512_setzero_si512(); GROUP];
                for (i, v) in v.iter_mut().enumerate().take(n) {
                    // SAFETY: row r0 + s0 + c0 + i < r0 + rows holds k0 +
                    // 2·kps elements (the caller asserted), and 2·p0 + 32
                    // ≤ 2·kps.
                    *v = unsafe { L::load32(s, (r0 + s0 + c0 + i) * rs + k0 + 2 * p0) };
                }
                // SAFETY: the CPU has AVX-512 F (each copy's features).
                unsafe { super::transpose::transpose16_words(&mut v) };
                for (q, v) in v.iter().enumerate() {
                    let at = strip + (p0 + q) * width + c0;
                    debug_assert!(at + n <= out.len());
                    // SAFETY: the n words from `at` lie in the strip's pair
                    // row p0 + q (c0 + n ≤ width), within the strips the
                    // caller asserted.
                    unsafe { store_run(out.as_mut_ptr().add(at), n, mask, *v) };
                }
            }
        }
    }
}

/// A run's `n` words at `at`: a plain store for 16 (a masked one is
/// several times slower on AMD's cores, even with every lane set), else a
/// store under `mask`.
///
/// # Safety
/// The CPU has AVX-512 F; `n` words from `at` are writable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store_run(at: *mut u32, n: usize, mask: u16, v: std::arch::x86_64::__m512i) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        if n == GROUP {
            _mm512_storeu_si512(at.cast(), v);
        } else {
            _mm512_mask_storeu_epi32(at.cast(), mask, v);
        }
    }
}

/// The lanes of a run of `n` ≤ 16 rows.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn run_mask(n: usize) -> u16 {
    if n >= GROUP {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn rows_along_k_f32(
    s: &[f32],
    rows: (usize, usize, usize, usize),
    k: (usize, usize),
    out: &mut [u32],
) {
    // SAFETY: the caller's contract (Vector::rows_along_k).
    unsafe { rows_along_k_body(s, rows, k, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn rows_along_k_bits(
    s: &[u16],
    rows: (usize, usize, usize, usize),
    k: (usize, usize),
    out: &mut [u32],
) {
    // SAFETY: the caller's contract (Vector::rows_along_k).
    unsafe { rows_along_k_body(s, rows, k, out) }
}

/// The loop of [`Vector::rows_across`], inlined into each instruction
/// set's copy: for each k pair, each strip in runs of up to 16 rows, read
/// and stored under a mask where a run is shorter (a strip of 12, the last
/// rows).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_across_body<L: Lanes>(
    s: &[L],
    (ks, r0, rows, width): (usize, usize, usize, usize),
    (k0, kc, kps): (usize, usize, usize),
    out: &mut [u32],
) {
    use std::arch::x86_64::*;
    for p in 0..kc.div_ceil(2) {
        let lo = (k0 + 2 * p) * ks + r0;
        let hi = (2 * p + 1 < kc).then_some(lo + ks);
        for s0 in (0..rows).step_by(width) {
            let row = (s0 / width) * kps * width + p * width;
            for c0 in (0..width).step_by(GROUP) {
                let r = s0 + c0;
                if r >= rows {
                    break;
                }
                let n = (width - c0).min(GROUP).min(rows - r);
                let mask = run_mask(n);
                // SAFETY: both k rows hold r0 + rows elements (asserted by
                // the caller) and r + n ≤ rows; the lanes past n are
                // neither read nor written.
                unsafe {
                    let l = _mm512_cvtepu16_epi32(L::load16(s, lo + r, mask));
                    let word = match hi {
                        Some(hi) => {
                            let h = _mm512_cvtepu16_epi32(L::load16(s, hi + r, mask));
                            _mm512_or_si512(l, _mm512_slli_epi32::<16>(h))
                        }
                        None => l,
                    };
                    store_run(out.as_mut_ptr().add(row + c0), n, mask, word);
                }
            }
        }
    }
    // Pairs past ⌈kc/2⌉ and rows past `rows` are padding, zeroed by pack.
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn rows_across_f32(
    s: &[f32],
    rows: (usize, usize, usize, usize),
    k: (usize, usize, usize),
    out: &mut [u32],
) {
    // SAFETY: the caller's contract (Vector::rows_across).
    unsafe { rows_across_body(s, rows, k, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn rows_across_bits(
    s: &[u16],
    rows: (usize, usize, usize, usize),
    k: (usize, usize, usize),
    out: &mut [u32],
) {
    // SAFETY: the caller's contract (Vector::rows_across).
    unsafe { rows_across_body(s, rows, k, out) }
}

/// One bf16 kernel's tiles, for [`blocked`]: the sizes of its blocks, how
/// its A panel is packed and its microkernel. B is always packed by
/// [`pack`] in strips of `NR` columns with `pairs(kc)` k pairs each.
#[cfg(target_arch = "x86_64")]
pub(super) trait Tiles {
    /// Rows and columns of the microkernel's block of C (MR·NR ≤ 1024).
    const MR: usize;
    const NR: usize;
    /// k per panel, rows per A block, columns per B panel.
    const KC: usize;
    const MC: usize;
    const NC: usize;
    /// k pairs per strip for a panel of `kc` (at least ⌈kc/2⌉).
    fn pairs(kc: usize) -> usize;
    /// Pack rows 0..m of A, k `k0 .. k0 + kc`, into strips of `MR` rows
    /// of `kps` pairs each (`MR·kps` words a strip).
    fn pack_a<E: Input>(
        a: Operand<'_, E>,
        m: usize,
        k: (usize, usize, usize),
        out: &mut [u32],
        tmp: &mut Vec<u16>,
    );
    /// Called before each microkernel (a prefetch hook).
    fn before_tile() {}
    /// C (+)= A strip · B strip for one MR × NR block at `c`, `rs` floats
    /// between rows.
    ///
    /// # Safety
    /// The CPU runs the kernel; `a` holds MR·kps and `b` kps·NR words; MR
    /// rows of NR floats at `c`, `rs` apart, are writable.
    unsafe fn micro(kps: usize, a: &[u32], b: &[u32], c: *mut f32, rs: usize, add: bool);
}

/// The blocked GEMM shared by the bf16 kernels (the caller checked the
/// CPU and k > 0): A packed once per k panel, B once per column panel, a
/// microkernel per MR × NR block of C, straight into dst where the block
/// is whole and row-major, through a local block at the edges.
#[cfg(target_arch = "x86_64")]
pub(super) fn blocked<T: Tiles, A: Input, B: Input>(
    (m, n, k): (usize, usize, usize),
    (dst, drs, dcs): (&mut [f32], usize, usize),
    accumulate: bool,
    (a, ars, acs): Operand<'_, A>,
    (b, brs, bcs): Operand<'_, B>,
) {
    // The panels, kept by the thread from call to call (a head step makes
    // three calls per class block: fresh buffers would be zeroed and
    // faulted in every time).
    thread_local! {
        static PANELS: std::cell::RefCell<(Vec<u32>, Vec<u32>, Vec<u16>)> =
            const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
    }
    const { assert!(T::MR * T::NR <= EDGE) };
    let (mr, nr) = (T::MR, T::NR);
    PANELS.with(|p| {
        let mut guard = p.borrow_mut();
        let (ap, bp, tmp) = &mut *guard;
        for pc in (0..k).step_by(T::KC) {
            let kc = T::KC.min(k - pc);
            let kps = T::pairs(kc);
            // Grown to the largest shape seen; the packers overwrite (or
            // zero-fill) what they use.
            ap.resize(ap.len().max(m.div_ceil(mr) * mr * kps), 0);
            bp.resize(bp.len().max(T::NC.div_ceil(nr) * nr * kps), 0);
            T::pack_a((a, ars, acs), m, (pc, kc, kps), ap, tmp);
            let add = accumulate || pc > 0;
            for jc in (0..n).step_by(T::NC) {
                let nc = T::NC.min(n - jc);
                // B (k, n) as rows of n along k: element (j, kk) at kk·brs + j·bcs.
                pack((b, bcs, brs), jc, nc, nr, (pc, kc, kps), bp, tmp);
                for ic in (0..m).step_by(T::MC) {
                    let mc = T::MC.min(m - ic);
                    for (sj, j0) in (0..nc).step_by(nr).enumerate() {
                        let cols = nr.min(nc - j0);
                        let bs = &bp[sj * kps * nr..(sj + 1) * kps * nr];
                        for i0 in (ic..ic + mc).step_by(mr) {
                            let rows = mr.min(m - i0);
                            let si = i0 / mr;
                            let as_ = &ap[si * mr * kps..(si + 1) * mr * kps];
                            let (r0, c0) = (i0, jc + j0);
                            let last = (r0 + rows - 1) * drs + (c0 + cols - 1) * dcs;
                            T::before_tile();
                            if dcs == 1 && rows == mr && cols == nr && last < dst.len() {
                                // SAFETY: the caller checked the CPU; the
                                // strips hold MR·kps and kps·NR words; the MR
                                // rows of NR floats at r0·drs + c0 lie in dst
                                // (checked: `last`).
                                unsafe {
                                    T::micro(
                                        kps,
                                        as_,
                                        bs,
                                        dst.as_mut_ptr().add(r0 * drs + c0),
                                        drs,
                                        add,
                                    )
                                };
                                continue;
                            }
                            let mut block = [0f32; EDGE];
                            // SAFETY: as above, into a local block of MR
                            // rows of NR floats (MR·NR ≤ EDGE, asserted).
                            unsafe { T::micro(kps, as_, bs, block.as_mut_ptr(), nr, false) };
                            for r in 0..rows {
                                let base = (r0 + r) * drs + c0 * dcs;
                                for (c, v) in block[r * nr..][..cols].iter().enumerate() {
                                    let d = &mut dst[base + c * dcs];
                                    *d = if add { *d + v } else { *v };
                                }
                            }
                        }
                    }
                }
            }
        }
    })
}

/// The largest MR·NR of a [`Tiles`] (its edge blocks are computed aside).
#[cfg(target_arch = "x86_64")]
const EDGE: usize = 32 * 32;

/// The AVX-512 BF16 kernel's tiles: 12 × 32, A packed pair-major.
#[cfg(target_arch = "x86_64")]
struct Avx512Bf16;

#[cfg(target_arch = "x86_64")]
impl Tiles for Avx512Bf16 {
    const MR: usize = MR;
    const NR: usize = NR;
    const KC: usize = KC;
    const MC: usize = MC;
    const NC: usize = NC;
    fn pairs(kc: usize) -> usize {
        kc.div_ceil(2)
    }
    fn pack_a<E: Input>(
        a: Operand<'_, E>,
        m: usize,
        k: (usize, usize, usize),
        out: &mut [u32],
        tmp: &mut Vec<u16>,
    ) {
        pack(a, 0, m, MR, k, out, tmp);
    }
    fn before_tile() {
        prefetch_some();
    }
    unsafe fn micro(kps: usize, a: &[u32], b: &[u32], c: *mut f32, rs: usize, add: bool) {
        // SAFETY: the caller's contract (Tiles::micro), and the CPU has
        // AVX-512 BF16 (matmul_bf16 checked).
        unsafe { micro_into(kps, a, b, c, rs, add) }
    }
}

/// One MR × NR tile over kp k pairs (Σ_p a_p ⊗ b_p) into a row-major block
/// at `c` (row stride `rs`), added to it where `add`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512f")]
unsafe fn micro_into(kp: usize, a: &[u32], b: &[u32], c: *mut f32, rs: usize, add: bool) {
    use std::arch::x86_64::*;
    let acc = unsafe { accumulate(kp, a, b) };
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: the caller guarantees MR rows of NR floats at c, rs apart.
        unsafe {
            let p = c.add(r * rs);
            let (mut lo, mut hi) = (acc[0], acc[1]);
            if add {
                lo = _mm512_add_ps(lo, _mm512_loadu_ps(p));
                hi = _mm512_add_ps(hi, _mm512_loadu_ps(p.add(16)));
            }
            _mm512_storeu_ps(p, lo);
            _mm512_storeu_ps(p.add(16), hi);
        }
    }
}

/// The MR × NR accumulators of kp k pairs (two zmm of 16 f32 per row).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512f")]
#[inline]
unsafe fn accumulate(kp: usize, a: &[u32], b: &[u32]) -> [[std::arch::x86_64::__m512; 2]; MR] {
    use std::arch::x86_64::*;
    assert!(
        a.len() >= kp * MR && b.len() >= kp * NR,
        "bf16 GEMM: short panel"
    );
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    for p in 0..kp {
        // SAFETY: p < kp, and the panels hold kp·MR and kp·NR words
        // (asserted above); __m512i and __m512bh are both 512 bits.
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(pb.add(p * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(pb.add(p * NR + 16).cast()));
            for (r, acc) in acc.iter_mut().enumerate() {
                let pair = *pa.add(p * MR + r) as i32;
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
            }
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeded values in [−1, 1).
    use crate::kernels::test_values as values;

    fn round(v: f32) -> f64 {
        f64::from(bf16::from_f32(v).to_f32())
    }

    /// Every case: (m, n, k, a transposed, b transposed, accumulate).
    fn check(m: usize, n: usize, k: usize, at: bool, bt: bool, acc: bool) {
        let a = values(1, m * k);
        let b = values(2, k * n);
        let (ars, acs) = if at { (1, m) } else { (k, 1) };
        let (brs, bcs) = if bt { (1, k) } else { (n, 1) };
        let init = values(3, m * n);
        let mut want = vec![0f64; m * n];
        let mut scale = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = if acc { f64::from(init[i * n + j]) } else { 0.0 };
                let mut mag = s.abs();
                for kk in 0..k {
                    let p = round(a[i * ars + kk * acs]) * round(b[kk * brs + j * bcs]);
                    s += p;
                    mag += p.abs();
                }
                want[i * n + j] = s;
                scale[i * n + j] = mag.max(1e-30);
            }
        }
        for (force, no_amx) in [(false, false), (false, true), (true, false)] {
            set_force_fallback(force);
            super::super::amx::set_force_off(no_amx);
            let mut got = if acc {
                init.clone()
            } else {
                vec![f32::NAN; m * n]
            };
            matmul_bf16(
                m,
                n,
                k,
                (&mut got, n, 1),
                acc,
                (&a, ars, acs),
                (&b, brs, bcs),
            );
            for e in 0..m * n {
                let err = (f64::from(got[e]) - want[e]).abs() / scale[e];
                assert!(
                    err <= 1e-5,
                    "{m}×{n}×{k} at {at} bt {bt} acc {acc} fallback {force} no AMX {no_amx}: \
                     element {e}: {} vs {} ({err:e})",
                    got[e],
                    want[e]
                );
            }
        }
        set_force_fallback(false);
        super::super::amx::set_force_off(false);
    }

    #[test]
    fn matches_the_rounded_product_in_every_layout_and_size() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (3, 5, 7),
            (12, 32, 2),
            (13, 33, 3),
            (25, 70, 515),
            (97, 513, 1025),
            // Whole AMX blocks (32 × 32), k a multiple of its 32 and not.
            (64, 96, 64),
            (64, 64, 544),
        ] {
            for (at, bt) in [(false, false), (false, true), (true, false), (true, true)] {
                for acc in [false, true] {
                    check(m, n, k, at, bt, acc);
                }
            }
        }
        check(300, 700, 515, false, true, false);
    }

    /// Packing gives the same words at every vector width (16 × 16 blocks
    /// and 16-row stores on AVX-512), rows along k and k rows across the
    /// rows: rows a multiple of 16 and of the strip width and not (whole
    /// strips with a few rows left over), odd k, padded pairs, from f32
    /// and bf16, at offsets, strips of 12 (A's), 16 and 32 (B's) rows.
    #[test]
    fn packing_is_the_same_at_every_level() {
        for (rows, k, r0, k0, kc, kps, width) in [
            (32, 64, 0, 0, 64, 32, 32),
            (40, 70, 3, 1, 67, 48, 32),
            (16, 32, 0, 0, 32, 16, 16),
            (50, 40, 2, 5, 30, 16, 32),
            (83, 96, 1, 32, 64, 32, 32),
            (70, 64, 0, 0, 64, 32, 16),
            (30, 33, 2, 0, 33, 17, 12),
            (24, 40, 0, 3, 32, 16, 12),
            (30, 40, 1, 0, 32, 16, 12),
        ] {
            for along_k in [true, false] {
                let n = r0 + rows;
                let f = crate::kernels::test_values(12, n * k);
                let h: Vec<bf16> = f.iter().map(|v| bf16::from_f32(*v)).collect();
                // Element (r, kk) at r·rs + kk·ks.
                let (rs, ks) = if along_k { (k, 1) } else { (1, n) };
                let words = rows.div_ceil(width) * kps * width;
                crate::kernels::assert_same_at_every_level(
                    &format!(
                        "pack {rows} rows from {r0}, k {kc} from {k0}, {kps} pairs, \
                     strips of {width}, along k {along_k}"
                    ),
                    || {
                        let (mut o1, mut o2) = (vec![7u32; words], vec![7u32; words]);
                        let mut tmp = Vec::new();
                        pack(
                            (&f[..], rs, ks),
                            r0,
                            rows,
                            width,
                            (k0, kc, kps),
                            &mut o1,
                            &mut tmp,
                        );
                        pack(
                            (&h[..], rs, ks),
                            r0,
                            rows,
                            width,
                            (k0, kc, kps),
                            &mut o2,
                            &mut tmp,
                        );
                        (o1, o2)
                    },
                    |(o1, o2)| {
                        let bits = |r: usize, kk: usize| {
                            if r < rows && kk < kc {
                                u32::from(h[(r0 + r) * rs + (k0 + kk) * ks].to_bits())
                            } else {
                                0
                            }
                        };
                        for r in 0..rows.div_ceil(width) * width {
                            for p in 0..kps {
                                let at = (r / width) * kps * width + p * width + r % width;
                                let want = bits(r, 2 * p) | (bits(r, 2 * p + 1) << 16);
                                assert_eq!(o1[at], want, "row {r}, pair {p}");
                            }
                        }
                        assert_eq!(o1, o2, "f32 and bf16 sources");
                        o1.clone()
                    },
                );
            }
        }
    }

    #[test]
    fn k_zero_writes_zeros_and_empty_does_nothing() {
        let mut d = vec![5f32; 6];
        matmul_bf16::<f32, f32>(2, 3, 0, (&mut d, 3, 1), false, (&[], 0, 1), (&[], 3, 1));
        assert!(d.iter().all(|v| *v == 0.0));
        let mut d = vec![5f32; 6];
        matmul_bf16::<f32, f32>(2, 3, 0, (&mut d, 3, 1), true, (&[], 0, 1), (&[], 3, 1));
        assert!(d.iter().all(|v| *v == 5.0));
        matmul_bf16::<f32, f32>(
            0,
            3,
            4,
            (&mut [], 3, 1),
            false,
            (&[], 4, 1),
            (&[0.0; 12], 3, 1),
        );
    }

    #[test]
    fn bf16_inputs_equal_f32_inputs_rounded() {
        let (m, n, k) = (20, 40, 37);
        let a = values(7, m * k);
        let b = values(8, k * n);
        let ah: Vec<bf16> = a.iter().map(|v| bf16::from_f32(*v)).collect();
        let mut d1 = vec![0f32; m * n];
        let mut d2 = vec![0f32; m * n];
        matmul_bf16(m, n, k, (&mut d1, n, 1), false, (&a, k, 1), (&b, n, 1));
        matmul_bf16(m, n, k, (&mut d2, n, 1), false, (&ah, k, 1), (&b, n, 1));
        // Equal up to the summation order (another test may switch the
        // fallback on between the two calls).
        for (x, y) in d1.iter().zip(&d2) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} {y}");
        }
    }
}
#[cfg(test)]
mod peak {
    #[test]
    #[ignore]
    fn micro_rate() {
        let kp = 256;
        let a = vec![0x3F80_3F80u32; kp * super::MR];
        let b = vec![0x3F80_3F80u32; kp * super::NR];
        let mut tile = [0f32; super::NR * super::MR];
        let iters = 20000;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            unsafe { super::micro_into(kp, &a, &b, tile.as_mut_ptr(), super::NR, false) };
            std::hint::black_box(&tile);
        }
        let s = t.elapsed().as_secs_f64();
        let flops = 2.0 * (super::MR * super::NR * 2 * kp * iters) as f64;
        println!("micro: {:.1} GFLOP/s", flops / s / 1e9);
    }
}
