//! Packing an operand into k-pair strips: each operand read in its own
//! order (rows along k converted 32 k at a time and turned by 16 × 16
//! transposes; k rows across interleaved 16 rows a store), a strip
//! narrower than 16 one short run under a mask.

use super::detect::detected;
use super::input::Input;
use crate::Operand;

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
            && crate::simd_level() == crate::SimdLevel::Avx512
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
/// ([`crate::transpose::transpose16_words`]).
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
    unsafe { crate::transpose::transpose16_words(&mut v) };
    for (q, v) in v.iter().enumerate() {
        // SAFETY: q·width + 16 ≤ out.len() (asserted).
        unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(q * width).cast(), *v) };
    }
}

/// A source the packers' vector paths read: f32 (rounded by
/// `vcvtne2ps2bf16`, which needs AVX-512 BF16) or bf16 bits (AVX-512 F and
/// BW), at the AVX-512 level of [`crate::simd_level`].
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
        if crate::simd_level() != crate::SimdLevel::Avx512 {
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
                unsafe { crate::transpose::transpose16_words(&mut v) };
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

#[cfg(test)]
mod tests {
    use super::pack;
    use half::bf16;

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
                let f = crate::test_values(12, n * k);
                let h: Vec<bf16> = f.iter().map(|v| bf16::from_f32(*v)).collect();
                // Element (r, kk) at r·rs + kk·ks.
                let (rs, ks) = if along_k { (k, 1) } else { (1, n) };
                let words = rows.div_ceil(width) * kps * width;
                crate::assert_same_at_every_level(
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
}
