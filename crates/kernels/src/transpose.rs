//! f32 transposes in registers, 8 × 8 (AVX2) and 16 × 16 (AVX-512): the
//! strips `sgemm` packs from a B whose columns lie contiguous along k (Vᵀ
//! in a Winograd convolution's weight gradient), a row-major A's strips,
//! and U's packing in `nn::conv::winograd`.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The 8 × 8 transpose: lane k of `r[i]` to lane i of the result's k.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    let s = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    [
        _mm256_permute2f128_ps::<0x20>(s[0], s[4]),
        _mm256_permute2f128_ps::<0x20>(s[1], s[5]),
        _mm256_permute2f128_ps::<0x20>(s[2], s[6]),
        _mm256_permute2f128_ps::<0x20>(s[3], s[7]),
        _mm256_permute2f128_ps::<0x31>(s[0], s[4]),
        _mm256_permute2f128_ps::<0x31>(s[1], s[5]),
        _mm256_permute2f128_ps::<0x31>(s[2], s[6]),
        _mm256_permute2f128_ps::<0x31>(s[3], s[7]),
    ]
}

/// The 16 × 16 transpose (AVX-512): lane k of `r[i]` to lane i of the
/// result's k. Pairs of rows interleaved, then fours within each 128-bit
/// lane, then the 128-bit lanes of four vectors transposed in two steps:
/// 64 shuffles for 256 floats, against 96 for the four 8 × 8 transposes of
/// [`transpose8`].
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // t[2k], t[2k + 1]: rows 2k and 2k + 1 interleaved, per 128-bit lane.
    let t: [__m512; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    // s[4g + c], 128-bit lane L: rows 4g..4g + 4 of column 4L + c.
    let s: [__m512; 16] = std::array::from_fn(|i| {
        let (g, c) = (i / 4, i % 4);
        let (a, b) = (t[4 * g + c / 2], t[4 * g + 2 + c / 2]);
        if c % 2 == 0 {
            _mm512_shuffle_ps::<0x44>(a, b)
        } else {
            _mm512_shuffle_ps::<0xEE>(a, b)
        }
    });
    // Column 4L + c: lane L of s[c], s[4 + c], s[8 + c], s[12 + c].
    let mut out = [_mm512_setzero_ps(); 16];
    for c in 0..4 {
        let p0 = _mm512_shuffle_f32x4::<0x88>(s[c], s[4 + c]);
        let p1 = _mm512_shuffle_f32x4::<0xDD>(s[c], s[4 + c]);
        let p2 = _mm512_shuffle_f32x4::<0x88>(s[8 + c], s[12 + c]);
        let p3 = _mm512_shuffle_f32x4::<0xDD>(s[8 + c], s[12 + c]);
        out[c] = _mm512_shuffle_f32x4::<0x88>(p0, p2);
        out[4 + c] = _mm512_shuffle_f32x4::<0x88>(p1, p3);
        out[8 + c] = _mm512_shuffle_f32x4::<0xDD>(p0, p2);
        out[12 + c] = _mm512_shuffle_f32x4::<0xDD>(p1, p3);
    }
    out
}

/// [`transpose16`] on 32-bit words of any kind (the bf16 GEMM's k pairs):
/// word k of `v[i]` to word i of `v[k]`, in place.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn transpose16_words(v: &mut [__m512i; 16]) {
    // SAFETY: __m512i and __m512 are both 512 bits (a bit cast).
    let t = transpose16(unsafe { std::mem::transmute::<[__m512i; 16], [__m512; 16]>(*v) });
    *v = unsafe { std::mem::transmute::<[__m512; 16], [__m512i; 16]>(t) };
}

/// `out[p·width + j] = src[j·ld + p]` for p < `rows`, j < `cols`, both
/// multiples of 8: 16 × 16 blocks in registers where `wide` (AVX-512: a
/// third fewer shuffles than four 8 × 8 ones, and whole-line loads and
/// stores where `src`'s columns and `out`'s rows start one), 8 × 8 blocks
/// beside and below them and elsewhere; a block row of `out` at a time, so
/// its stores run contiguous and each column of `src` is read in runs.
///
/// # Safety
/// The CPU has AVX2, and AVX-512F where `wide`; `src` holds `(cols −
/// 1)·ld + rows` floats and `out` `(rows − 1)·width + cols`.
#[cfg(target_arch = "x86_64")]
pub unsafe fn transpose_blocks(
    (src, ld): (*const f32, usize),
    (rows, cols): (usize, usize),
    (out, width): (*mut f32, usize),
    wide: bool,
) {
    debug_assert!(rows.is_multiple_of(8) && cols.is_multiple_of(8));
    let a = Area {
        src,
        ld,
        out,
        width,
    };
    let (r16, c16) = (rows / 16 * 16, cols / 16 * 16);
    if !wide || r16 == 0 || c16 == 0 {
        return by8(a, rows, cols);
    }
    by16(a, r16, c16);
    by8(a.from(0, c16), r16, cols - c16);
    by8(a.from(r16, 0), rows - r16, cols);
}

/// Where a block transpose reads (columns `ld` apart) and writes (rows
/// `width` apart).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Area {
    src: *const f32,
    ld: usize,
    out: *mut f32,
    width: usize,
}

#[cfg(target_arch = "x86_64")]
impl Area {
    /// The area from row p, column j of `out` on (wrapping: only blocks
    /// inside the caller's area are read or written).
    fn from(self, p: usize, j: usize) -> Area {
        Area {
            src: self.src.wrapping_add(j * self.ld + p),
            out: self.out.wrapping_add(p * self.width + j),
            ..self
        }
    }

    /// `block` on every N × N block of `rows` × `cols` (each block's own
    /// area), a block row of `out` at a time.
    #[inline(always)]
    fn each<const N: usize>(self, rows: usize, cols: usize, block: impl Fn(Area)) {
        for p in (0..rows).step_by(N) {
            for j in (0..cols).step_by(N) {
                block(self.from(p, j));
            }
        }
    }
}

/// The 8 × 8 blocks of `rows` × `cols` of `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn by8(a: Area, rows: usize, cols: usize) {
    a.each::<8>(rows, cols, |b| {
        let r: [__m256; 8] = std::array::from_fn(|t| _mm256_loadu_ps(b.src.add(t * b.ld)));
        for (q, v) in transpose8(r).into_iter().enumerate() {
            _mm256_storeu_ps(b.out.add(q * b.width), v);
        }
    })
}

/// The 16 × 16 blocks of `rows` × `cols` of `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn by16(a: Area, rows: usize, cols: usize) {
    a.each::<16>(rows, cols, |b| {
        let r: [__m512; 16] = std::array::from_fn(|t| _mm512_loadu_ps(b.src.add(t * b.ld)));
        for (q, v) in transpose16(r).into_iter().enumerate() {
            _mm512_storeu_ps(b.out.add(q * b.width), v);
        }
    })
}

/// `out[p·6 + r] = rows[r][p]` for p < `kc`, r < 6 (rows at or past
/// `live` read as zero, never dereferenced): 6 rows interleaved into
/// `sgemm`'s k-major strip of a packed A, 8 columns at a time by
/// [`transpose8`], each column's 6 floats one 4-float and one 2-float store.
///
/// # Safety
/// The CPU has AVX2; `rows[r]` holds `kc` floats for r < `live` ≤ 6, and
/// `out` holds 6·`kc`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub unsafe fn interleave6(rows: [*const f32; 6], live: usize, kc: usize, out: *mut f32) {
    let zero = _mm256_setzero_ps();
    let whole = kc / 8 * 8;
    for p in (0..whole).step_by(8) {
        let r: [__m256; 8] = std::array::from_fn(|i| {
            if i < live.min(6) {
                _mm256_loadu_ps(rows[i].add(p))
            } else {
                zero
            }
        });
        for (q, v) in transpose8(r).into_iter().enumerate() {
            let o = out.add((p + q) * 6);
            _mm_storeu_ps(o, _mm256_castps256_ps128(v));
            let hi = _mm_castps_si128(_mm256_extractf128_ps::<1>(v));
            _mm_storel_epi64(o.add(4).cast(), hi);
        }
    }
    for p in whole..kc {
        for (r, row) in rows.iter().enumerate() {
            *out.add(p * 6 + r) = if r < live { *row.add(p) } else { 0.0 };
        }
    }
}
