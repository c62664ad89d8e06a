//! Max pooling over non-overlapping k×k windows, and dropout.
//!
//! | function | forward | backward |
//! |----------|---------|----------|
//! | [`max_pool2d`] | y[b, c, i, j] = max of the k×k window at (k·i, k·j) (NaN wins) | the gradient goes to the window's first maximum (row-major), as in PyTorch |
//! | [`dropout`] | y = x ⊙ mask / (1 − p), mask seeded | the same mask |
//!
//! Shapes: x (B, C, H, W) → y (B, C, ⌊H/k⌋, ⌊W/k⌋) (trailing rows and
//! columns dropped, as PyTorch does). On the CPU `max_pool2d` is one pass
//! that remembers each window's winner; elsewhere (and with
//! `SHARDNET_KERNELS=generic`) the windows are gathered at their argmax in
//! candle ops, with the same backward.
//!
//! Dropout's mask is a function of a seed alone (a splitmix64 stream), not
//! of the rank: ranks that hold the same activations and pass the same seed
//! drop the same elements, so a replicated classifier stays replicated.

use crate::rng::splitmix64;
use crate::{Error, Result};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use std::sync::Mutex;

/// Max pooling with a k×k window and stride k.
pub fn max_pool2d(x: &Tensor, k: usize) -> Result<Tensor> {
    let [_, _, h, w] = x.dims()[..] else {
        return Err(Error::Usage(format!(
            "max_pool2d: input of shape {:?}, expected (batch, channels, height, width)",
            x.dims()
        )));
    };
    check_window(h, w, k)?;
    if !crate::kernels::fast(x.device()) {
        return max_pool2d_generic(x, k);
    }
    Ok(x.contiguous()?.apply_op1(MaxPool {
        k,
        winners: Mutex::new(Vec::new()),
    })?)
}

/// A k×k window must fit the h×w input (and k > 0).
pub(crate) fn check_window(h: usize, w: usize, k: usize) -> Result<()> {
    if k == 0 || h < k || w < k {
        return Err(Error::Usage(format!(
            "max_pool2d: a {k}×{k} window does not fit a {h}×{w} input"
        )));
    }
    Ok(())
}

/// One plane's k×k windows (stride k, ⌊h/k⌋ × ⌊w/k⌋ of them):
/// y[i·wo + j] = the window's maximum of `value(offset in the plane)`, and
/// win[i·wo + j] = that offset. NaN wins and stays; otherwise strictly
/// greater, so ties go to the first in row-major order. The one home of
/// the winner rule: [`max_pool2d`] and batch norm's fused pooling.
#[inline(always)]
pub(crate) fn pool_plane<T: Copy + PartialOrd>(
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
pub(crate) fn pool2_affine(
    plane: &[f32],
    (a, b): (f32, f32),
    relu: bool,
    (h, w): (usize, usize),
    y: &mut [f32],
    win: &mut [u32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::simd_level() == crate::kernels::SimdLevel::Avx512 {
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
    use crate::kernels::avx512::{idx, mask, EVEN, ODD};
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

/// The generic path in candle ops: each window laid out along a last axis,
/// its (first) argmax gathered, so the backward (gather's scatter-add)
/// sends the gradient to that element alone. (candle's own `max_pool2d`
/// backward scales the gradient by the window size, and shares it among
/// ties.)
fn max_pool2d_generic(x: &Tensor, k: usize) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let (ho, wo) = (h / k, w / k);
    if b * c == 0 {
        // No planes: candle's max cannot reduce an empty tensor; the
        // (empty) output of the right shape, still in the graph.
        return Ok(x.narrow(2, 0, ho)?.narrow(3, 0, wo)?);
    }
    let windows = x
        .narrow(2, 0, ho * k)?
        .narrow(3, 0, wo * k)?
        .reshape((b, c, ho, k, wo, k))?
        .permute((0, 1, 2, 4, 3, 5))?
        .reshape((b, c, ho, wo, k * k))?;
    // NaN wins its window, as on the CPU: a window holding one takes its
    // first NaN (candle's argmax skips NaN).
    let nan = windows.ne(&windows)?;
    let has_nan = nan.max_keepdim(4)?;
    let best = has_nan.where_cond(&nan.argmax_keepdim(4)?, &windows.argmax_keepdim(4)?)?;
    Ok(windows.gather(&best, 4)?.squeeze(4)?)
}

/// The forward op; it keeps, per output, the offset of its window's winner
/// within the input plane, for the backward.
struct MaxPool {
    k: usize,
    winners: Mutex<Vec<u32>>,
}

fn pool<T: Copy + PartialOrd + Default + Send + Sync>(
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
pub(crate) fn by_parts<T: Send>(
    (y, win): (&mut [T], &mut [u32]),
    per: usize,
    len: usize,
    one: impl Fn((usize, (&mut [T], &mut [u32]))) + Sync + Send,
) {
    use rayon::prelude::*;
    if crate::kernels::split_work(len) {
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

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        "shardnet-max-pool2d"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, c, h, w) = l.shape().dims4()?;
        if !l.is_contiguous() {
            candle_core::bail!("shardnet max_pool2d: expected a contiguous tensor");
        }
        let range = l.start_offset()..l.start_offset() + l.shape().elem_count();
        let k = self.k;
        let (y, win) = match s {
            CpuStorage::F32(v) => {
                let (y, win) = pool(&v[range], b * c, h, w, k);
                (CpuStorage::F32(y), win)
            }
            CpuStorage::F64(v) => {
                let (y, win) = pool(&v[range], b * c, h, w, k);
                (CpuStorage::F64(y), win)
            }
            _ => candle_core::bail!("shardnet max_pool2d: f32 or f64"),
        };
        *self.winners.lock().unwrap_or_else(|e| e.into_inner()) = win;
        Ok((y, Shape::from((b, c, h / k, w / k))))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (b, c, h, w) = x.dims4()?;
        let (ho, wo) = (h / self.k, w / self.k);
        let win = self.winners.lock().unwrap_or_else(|e| e.into_inner());
        if win.len() != b * c * ho * wo {
            candle_core::bail!("shardnet max_pool2d: backward before forward");
        }
        let g = grad.contiguous()?.flatten_all()?;
        let dims = (b, c, h, w);
        // Each output's gradient to its window's winner (windows do not overlap).
        fn scatter<T: Copy + Default + Send + Sync>(
            g: &[T],
            win: &[u32],
            per: usize,
            plane: usize,
            n: usize,
        ) -> Vec<T> {
            use rayon::prelude::*;
            let mut dx = vec![T::default(); n];
            if per == 0 {
                return dx;
            }
            let one = |((dx, g), win): ((&mut [T], &[T]), &[u32])| {
                for (gv, at) in g.iter().zip(win) {
                    dx[*at as usize] = *gv;
                }
            };
            if crate::kernels::split_work(n) {
                dx.par_chunks_mut(plane)
                    .zip(g.par_chunks(per))
                    .zip(win.par_chunks(per))
                    .for_each(one);
            } else {
                dx.chunks_mut(plane)
                    .zip(g.chunks(per))
                    .zip(win.chunks(per))
                    .for_each(one);
            }
            dx
        }
        let (per, plane, n) = (ho * wo, h * w, b * c * h * w);
        Ok(Some(match g.dtype() {
            candle_core::DType::F32 => Tensor::from_vec(
                scatter(&g.to_vec1::<f32>()?, &win, per, plane, n),
                dims,
                x.device(),
            )?,
            _ => Tensor::from_vec(
                scatter(&g.to_vec1::<f64>()?, &win, per, plane, n),
                dims,
                x.device(),
            )?,
        }))
    }
}

/// Dropout: each element kept with probability 1 − p and scaled by
/// 1/(1 − p), the mask drawn from `seed` alone. `p = 0` is the identity;
/// `p` must lie in [0, 1).
pub fn dropout(x: &Tensor, p: f64, seed: u64) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        return Err(Error::Usage(format!(
            "dropout: probability {p} must lie in [0, 1)"
        )));
    }
    if p == 0.0 {
        return Ok(x.clone());
    }
    let keep = 1.0 / (1.0 - p);
    let threshold = (p * (1u64 << 53) as f64) as u64;
    let mut s = seed ^ 0xD1B5_4A32_D192_ED03;
    let mask: Vec<f32> = (0..x.elem_count())
        .map(|_| {
            if splitmix64(&mut s) >> 11 < threshold {
                0.0
            } else {
                keep as f32
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
    Ok(x.mul(&mask)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values;

    /// The vector 2×2 pooling against `pool_plane` on planes with ties,
    /// NaNs, ±0 and every size from 2 × 2 to 9 × 41 (odd rows and
    /// columns dropped, rows past one vector of windows): the same values
    /// to the bit and the same winners.
    #[test]
    fn vector_pooling_equals_pool_plane() {
        let _level = crate::kernels::level_lock();
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
