//! Max pooling's planes for `nn::max_pool2d` and batch norm's fused
//! pooling: the one winner rule ([`pool_plane`]), its AVX-512 form for
//! 2×2 windows after an affine map ([`pool2_affine`]), and the passes over
//! every plane, split over the threads ([`pool`], [`by_parts`]).

/// One plane's k×k windows (stride k, ⌊h/k⌋ × ⌊w/k⌋ of them):
/// y[i·wo + j] = the window's maximum of `value(offset in the plane)`, and
/// win[i·wo + j] = that offset. NaN wins and stays; otherwise strictly
/// greater, so ties go to the first in row-major order. The one home of
/// the winner rule: `nn::max_pool2d` and batch norm's fused pooling.
#[inline(always)]
pub fn pool_plane<T: Copy + PartialOrd>(
    value: impl Fn(usize) -> T,
    (h, w, k): (usize, usize, usize),
    y: &mut [T],
    win: &mut [u32],
) {
    let (ho, wo) = (h / k, w / k);
    for i in 0..ho {
        for j in 0..wo {
            let mut best = i * k * w + j * k;
            let mut m = value(best);
            for a in 0..k {
                for b in 0..k {
                    let at = (i * k + a) * w + j * k + b;
                    let v = value(at);
                    #[allow(clippy::eq_op)]
                    let v_nan = v != v;
                    #[allow(clippy::eq_op)]
                    let m_nan = m != m;
                    if !m_nan && (v_nan || v > m) {
                        best = at;
                        m = v;
                    }
                }
            }
            y[i * wo + j] = m;
            win[i * wo + j] = best as u32;
        }
    }
}

/// [`pool_plane`] for 2×2 windows of an f32 plane whose values are
/// `v·a + b` (then ReLU's `max(·, 0)` where `relu`), 16 windows a vector
/// on AVX-512: the same values, winners and ties, bit for bit. `false`
/// (nothing written) where the CPU lacks AVX-512.
pub fn pool2_affine(
    plane: &[f32],
    (a, b): (f32, f32),
    relu: bool,
    (h, w): (usize, usize),
    y: &mut [f32],
    win: &mut [u32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if crate::simd_level() == crate::SimdLevel::Avx512 {
        let (ho, wo) = (h / 2, w / 2);
        assert!(plane.len() >= h * w && y.len() >= ho * wo && win.len() >= ho * wo);
        assert!(i32::try_from(h * w).is_ok());
        // SAFETY: AVX-512F is present (simd_level); every read lies in
        // rows 0..2·ho, columns 0..2·wo of the plane, every write in
        // y[..ho·wo] and win[..ho·wo] (asserted).
        unsafe { x86::pool2(plane, (a, b), relu, (w, ho, wo), y, win) };
        return true;
    }
    let _ = (plane, a, b, relu, h, w, y, win);
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::avx512::{idx, mask, EVEN, ODD};
    use std::arch::x86_64::*;

    /// [`super::pool2_affine`]'s windows: output rows 0..ho, 16 columns a
    /// step; the window's four values in `pool_plane`'s order, each taking
    /// the lead where the leader is not NaN and it is NaN or greater.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pool2(
        plane: &[f32],
        (a, b): (f32, f32),
        relu: bool,
        (w, ho, wo): (usize, usize, usize),
        y: &mut [f32],
        win: &mut [u32],
    ) {
        let (ev, od) = (idx(&EVEN), idx(&ODD));
        let (va, vb, zero) = (_mm512_set1_ps(a), _mm512_set1_ps(b), _mm512_setzero_ps());
        let value = |v: __m512| {
            let t = _mm512_add_ps(_mm512_mul_ps(v, va), vb);
            // max(t, 0) returns its second operand for NaN and for −0:
            // f32::max(t, 0.0)'s results.
            if relu {
                _mm512_max_ps(t, zero)
            } else {
                t
            }
        };
        let two = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(2),
        );
        for i in 0..ho {
            let mut j0 = 0;
            while j0 < wo {
                let n = 16.min(wo - j0);
                // Columns 2·j0 .. 2·j0 + 2n of rows 2i and 2i + 1.
                let (lo_n, hi_n) = (mask((2 * n).min(16)), mask((2 * n).saturating_sub(16)));
                let mut m = zero;
                let mut best = _mm512_setzero_si512();
                for r in 0..2 {
                    let row = (2 * i + r) * w + 2 * j0;
                    let src = plane.as_ptr().add(row);
                    let lo = _mm512_maskz_loadu_ps(lo_n, src);
                    let hi = _mm512_maskz_loadu_ps(hi_n, src.wrapping_add(16));
                    let pair = [
                        value(_mm512_permutex2var_ps(lo, ev, hi)),
                        value(_mm512_permutex2var_ps(lo, od, hi)),
                    ];
                    for (c, v) in pair.into_iter().enumerate() {
                        let at = _mm512_add_epi32(two, _mm512_set1_epi32((row + c) as i32));
                        if r == 0 && c == 0 {
                            (m, best) = (v, at);
                            continue;
                        }
                        let lead_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(m, m);
                        let take = !lead_nan
                            & (_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v)
                                | _mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, m));
                        m = _mm512_mask_mov_ps(m, take, v);
                        best = _mm512_mask_mov_epi32(best, take, at);
                    }
                }
                let k = mask(n);
                _mm512_mask_storeu_ps(y.as_mut_ptr().add(i * wo + j0), k, m);
                _mm512_mask_storeu_epi32(win.as_mut_ptr().add(i * wo + j0) as *mut _, k, best);
                j0 += 16;
            }
        }
    }
}

pub fn pool<T: Copy + PartialOrd + Default + Send + Sync>(
    x: &[T],
    planes: usize,
    h: usize,
    w: usize,
    k: usize,
) -> (Vec<T>, Vec<u32>) {
    let (ho, wo) = (h / k, w / k);
    let per = ho * wo;
    let mut y = vec![T::default(); planes * per];
    let mut win = vec![0u32; planes * per];
    if per == 0 {
        return (y, win);
    }
    // One plane: each output's window, its maximum and where it is.
    let one = |(p, (y, win)): (usize, (&mut [T], &mut [u32]))| {
        let plane = &x[p * h * w..][..h * w];
        pool_plane(|at| plane[at], (h, w, k), y, win);
    };
    by_parts((&mut y, &mut win), per, x.len(), one);
    (y, win)
}

/// `one((i, (y part, winners part)))` for each part of `per` outputs (a
/// plane, or an image's planes), split over the threads when the input's
/// `len` is large (each part computed the same way either way).
pub fn by_parts<T: Send>(
    (y, win): (&mut [T], &mut [u32]),
    per: usize,
    len: usize,
    one: impl Fn((usize, (&mut [T], &mut [u32]))) + Sync + Send,
) {
    use rayon::prelude::*;
    if crate::split_work(len) {
        y.par_chunks_mut(per)
            .zip(win.par_chunks_mut(per))
            .enumerate()
            .for_each(one);
    } else {
        y.chunks_mut(per)
            .zip(win.chunks_mut(per))
            .enumerate()
            .for_each(one);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_values;

    /// The vector 2×2 pooling against `pool_plane` on planes with ties,
    /// NaNs, ±0 and every size from 2 × 2 to 9 × 41 (odd rows and
    /// columns dropped, rows past one vector of windows): the same values
    /// to the bit and the same winners.
    #[test]
    fn vector_pooling_equals_pool_plane() {
        let _level = crate::level_lock();
        for (h, w) in [(2, 2), (3, 5), (4, 4), (8, 33), (9, 41), (6, 64), (2, 70)] {
            for (seed, relu) in [(1, true), (2, false), (3, true)] {
                // Values on a coarse grid (ties), some NaN and −0.
                let mut plane: Vec<f32> = test_values(seed * 97 + (h * w) as u64, h * w)
                    .into_iter()
                    .map(|v| (v * 4.0).round() / 4.0)
                    .collect();
                for (i, v) in plane.iter_mut().enumerate() {
                    match (i * 7 + seed as usize) % 23 {
                        0 => *v = f32::NAN,
                        1 => *v = -0.0,
                        _ => {}
                    }
                }
                let (a, b) = (if seed == 2 { -1.5 } else { 0.75 }, 0.25);
                let per = (h / 2) * (w / 2);
                let (mut y, mut win) = (vec![7f32; per], vec![7u32; per]);
                if !pool2_affine(&plane, (a, b), relu, (h, w), &mut y, &mut win) {
                    return; // no AVX-512 here: nothing to compare
                }
                let value = |at: usize| {
                    let t = plane[at] * a + b;
                    if relu {
                        t.max(0.0)
                    } else {
                        t
                    }
                };
                let (mut y0, mut win0) = (vec![0f32; per], vec![0u32; per]);
                pool_plane(value, (h, w, 2), &mut y0, &mut win0);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&y), bits(&y0), "{h}×{w}, relu {relu}: values");
                assert_eq!(win, win0, "{h}×{w}, relu {relu}: winners");
            }
        }
    }
}
