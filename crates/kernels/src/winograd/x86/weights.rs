//! The weights' transforms (`super::super::weights`) on AVX2 and AVX-512:
//! U = G W Gᵀ written packed for the GEMMs, and dW = Gᵀ dU G.

use crate::avx512::mask;
use crate::transpose::transpose8;
use std::arch::x86_64::*;

/// G v for three vectors of kernels: (v0, (v0 + v1 + v2)/2, (v0 − v1 + v2)/2,
/// v2), in `lanes.rs`'s order.
#[inline(always)]
unsafe fn g8(v0: __m256, v1: __m256, v2: __m256) -> [__m256; 4] {
    let half = _mm256_set1_ps(0.5);
    let s = _mm256_add_ps(v0, v2);
    [
        v0,
        _mm256_mul_ps(_mm256_add_ps(s, v1), half),
        _mm256_mul_ps(_mm256_sub_ps(s, v1), half),
        v2,
    ]
}

/// One column of a strip of packed U: the kernels of the strip's `live`
/// rows (≤ 6; kernel r's 9 taps at `w + at[r]`) transformed, U = G w Gᵀ,
/// and each U\[ξ\]'s 6 floats (MR on both microkernels; zero past `live`)
/// stored at `out[ξ] + base`. AVX2 (8 kernels a vector), which every CPU
/// with an `sgemm` microkernel has.
///
/// Each kernel's taps 0–7 are one load, turned into a vector per tap by an
/// 8 × 8 transpose in registers; tap 8 is put together from scalars. Nine
/// gathers (`vgatherdps`) in its place took twice as long: measured on a
/// Cascade Lake core, U of 256 → 512 (8 MB) 5.0–5.8 ms against 3.2–3.6,
/// of 128 → 128 (1 MB) 0.55–0.76 against 0.19–0.37; in one-core VGG16 at
/// batch 32 the packing fell from 6.2% of the samples to 3.7%.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn pack_column(
    w: *const f32,
    at: [usize; 6],
    live: usize,
    out: &[*mut f32; 16],
    base: usize,
) {
    let zero = _mm256_setzero_ps();
    let row = |r: usize| {
        if r < live {
            _mm256_loadu_ps(w.add(at[r]))
        } else {
            zero
        }
    };
    let last = |r: usize| if r < live { *w.add(at[r] + 8) } else { 0.0 };
    let t = transpose8([row(0), row(1), row(2), row(3), row(4), row(5), zero, zero]);
    let t8 = _mm256_set_ps(
        0.0,
        0.0,
        last(5),
        last(4),
        last(3),
        last(2),
        last(1),
        last(0),
    );
    // G over the rows (for each column j), then over the columns.
    let cols = [
        g8(t[0], t[3], t[6]),
        g8(t[1], t[4], t[7]),
        g8(t[2], t[5], t8),
    ];
    for a_ in 0..4 {
        let row = g8(cols[0][a_], cols[1][a_], cols[2][a_]);
        for (b_, v) in row.iter().enumerate() {
            let at = out[4 * a_ + b_].add(base);
            _mm_storeu_ps(at, _mm256_castps256_ps128(*v));
            let hi = _mm_castps_si128(_mm256_extractf128_ps::<1>(*v));
            _mm_storel_epi64(at.add(4) as *mut __m128i, hi);
        }
    }
}

/// Gᵀ v for 16 kernels a vector, in `weights.rs`'s order (`tr_gt`):
/// (v0 + (v1 + v2)/2, (v1 − v2)/2, (v1 + v2)/2 + v3).
#[inline(always)]
unsafe fn tr_gt16(v: [__m512; 4]) -> [__m512; 3] {
    let half = _mm512_set1_ps(0.5);
    let h = _mm512_mul_ps(_mm512_add_ps(v[1], v[2]), half);
    [
        _mm512_add_ps(v[0], h),
        _mm512_mul_ps(_mm512_sub_ps(v[1], v[2]), half),
        _mm512_add_ps(h, v[3]),
    ]
}

/// dW (+)= Gᵀ dU G for `n` (≤ 16) kernels: dU\[ξ\] of kernel l at
/// `du + ξ·oc + l`, its 9 taps at `dw + 9·l`. In registers, the 9 taps of
/// the 16 kernels scattered (gathered first to add).
#[target_feature(enable = "avx512f")]
pub unsafe fn weights_back_block(
    du: *const f32,
    oc: usize,
    n: usize,
    dw: *mut f32,
    overwrite: bool,
) {
    let k = mask(n);
    let m: [__m512; 16] = std::array::from_fn(|xi| _mm512_maskz_loadu_ps(k, du.add(xi * oc)));
    // Gᵀ over the rows a (for each column b), then over the columns.
    let cols: [[__m512; 3]; 4] =
        std::array::from_fn(|b_| tr_gt16([m[b_], m[4 + b_], m[8 + b_], m[12 + b_]]));
    let nine = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(9),
    );
    for i in 0..3 {
        let row = tr_gt16([cols[0][i], cols[1][i], cols[2][i], cols[3][i]]);
        for (j, v) in row.iter().enumerate() {
            let at = dw.add(3 * i + j);
            let v = if overwrite {
                *v
            } else {
                _mm512_add_ps(
                    _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), k, nine, at),
                    *v,
                )
            };
            _mm512_mask_i32scatter_ps::<4>(at, k, nine, v);
        }
    }
}
