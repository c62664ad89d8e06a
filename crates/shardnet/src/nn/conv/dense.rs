//! 3 × 3 convolutions at stride 1 with padding 1 on 2 × 2 images (VGG16's
//! last block at 32 × 32 inputs) as one dense GEMM per pass: with that
//! padding every output pixel of a 2 × 2 image sees every input pixel, so
//! the layer is a matrix W (4O × 4C) of the kernels' taps, and an image
//! (C, 2, 2) is a row of 4C values as it lies in memory.
//!
//! | pass | GEMM (`kernels::sgemm`) | A | B |
//! |------|------|---|---|
//! | forward | y (N × 4O) = x (N × 4C) · Wᵀ | x as it lies | B[(c, q)][(o, p)] = w[o, c, tap(q, p)], packed strip by strip from w |
//! | input gradient | dx (N × 4C) = dy (N × 4O) · W | dy as it lies | B[(o, p)][(c, q)] = w[o, c, tap(q, p)], likewise |
//! | weight gradient | dT (4C × 4O) = xᵀ · dy, then dW[o, c, tap(q, p)] += dT[(c, q)][(o, p)] | x, packed column by column | dy as it lies (read in place up to 128 images) |
//!
//! tap(q, p) = (qy − py + 1, qx − px + 1): input pixel q as output pixel p
//! sees it. 16 products per (o, c) pair and image, against im2col's 36
//! (whose columns are 5/9 padding here), in full strips of 64 columns
//! (Winograd's GEMMs at this size have one column per image).

use super::geom::Geom;
use super::passes::scratch;
use crate::kernels::conv_taps::{Taps, TAP};
use crate::kernels::sgemm::{self, Layout, Matrix, Micro, Out, PackedA};
use std::sync::atomic::{AtomicBool, Ordering};

/// Off only for `bench conv`'s im2col column ([`set_enabled`]).
static OFF: AtomicBool = AtomicBool::new(false);

/// This path on or off (`bench conv` times im2col's path beside ours).
pub fn set_enabled(on: bool) {
    OFF.store(!on, Ordering::Relaxed);
}

/// This path takes `g`: 3 × 3, stride 1, padding 1, 2 × 2 images, f32 on
/// a CPU with an `sgemm` microkernel.
pub(super) fn applies(g: &Geom) -> bool {
    (g.kh, g.kw, g.s, g.p, g.h, g.w) == (3, 3, 1, 1, 2, 2)
        && Micro::now().is_some()
        && !OFF.load(Ordering::Relaxed)
}

/// One pass's GEMM: `a` (N rows as they lie) times the taps' B, the
/// forward's Wᵀ or the input gradient's W.
fn pass(g: &Geom, a: &[f32], w: &[f32], input_grad: bool) -> Vec<f32> {
    let micro = Micro::now().expect("applies() checked for a microkernel");
    let (k, n) = if input_grad {
        (4 * g.o, 4 * g.c)
    } else {
        (4 * g.c, 4 * g.o)
    };
    let a = PackedA::new(micro, g.n, k, a, Layout::strided(k, 1));
    let b = Taps {
        w,
        c: g.c,
        o: g.o,
        input_grad,
    };
    let mut out = vec![0f32; g.n * n];
    sgemm::gemm(&a, &b, Out::rows(&mut out, n), false);
    out
}

/// y (N, O, 2, 2) = conv(x, W) + b. The caller checked [`applies`].
pub(super) fn forward(g: &Geom, x: &[f32], w: &[f32], bias: &[f32]) -> Vec<f32> {
    let mut y = pass(g, x, w, false);
    if !bias.is_empty() {
        for row in y.chunks_mut(4 * g.o) {
            for (px, bo) in row.chunks_mut(4).zip(bias) {
                for v in px {
                    *v += *bo;
                }
            }
        }
    }
    y
}

/// dx (N, C, 2, 2) from G (N, O, 2, 2). The caller checked [`applies`].
pub(super) fn input_grad(g: &Geom, dy: &[f32], w: &[f32]) -> Vec<f32> {
    pass(g, dy, w, true)
}

/// Output channels per block of the weight gradient: the block's dT (4C ×
/// 64, 512 KiB at C = 512) stays in L2 between the GEMM that writes it
/// and the fold that reads it. Unblocked, dT (16 MiB at 512 → 512) went
/// to memory and back: the layer's weight gradient took 10–12 ms at batch
/// 32 against im2col's 6.
const OUT_BLOCK: usize = 16;

/// dW (O, C, 3, 3) (+)= the weight gradient of G (N, O, 2, 2) and x (N, C,
/// 2, 2), [`OUT_BLOCK`] output channels at a time (over the threads): the
/// taps' gradient dT (4C × 4·block) = xᵀ · G's block of columns in one
/// GEMM, then each kernel's 16 entries added onto the taps they came
/// from. Each dW element is summed by one thread in one order: the same
/// result for any thread count. The caller checked [`applies`].
pub(super) fn weight_grad(g: &Geom, dw: &mut [f32], dy: &[f32], x: &[f32], overwrite: bool) {
    use rayon::prelude::*;
    let micro = Micro::now().expect("applies() checked for a microkernel");
    let (m, n, k) = (4 * g.c, 4 * g.o, g.n);
    assert!(dw.len() == g.o * g.c * 9 && x.len() >= k * m && dy.len() >= k * n);
    if k == 0 || m == 0 || n == 0 {
        if overwrite {
            dw.fill(0.0);
        }
        return;
    }
    // xᵀ: element ((c, q), image) at image·4C + (c, q); packed once.
    let a = PackedA::new(micro, m, k, x, Layout::strided(1, m));
    let block = |b: usize, rows: &mut [f32]| {
        let (o0, ob) = (b * OUT_BLOCK, rows.len() / (g.c * 9));
        let cols = 4 * ob;
        let src = Matrix {
            b: &dy[4 * o0..],
            k,
            n: cols,
            layout: Layout::strided(n, 1),
        };
        let [mut kept, other] = scratch::take::<f32>();
        // Every element of the block's dT is written by the GEMM.
        let dt = crate::kernels::sized(&mut kept, m * cols);
        sgemm::gemm(&a, &src, Out::rows(dt, cols), false);
        for (o, row) in rows.chunks_exact_mut(g.c * 9).enumerate() {
            for (c, taps) in row.chunks_exact_mut(9).enumerate() {
                let mut sum = [0f32; 9];
                for (q, tap) in TAP.iter().enumerate() {
                    let at = (4 * c + q) * cols + 4 * o;
                    for (p, v) in dt[at..at + 4].iter().enumerate() {
                        sum[tap[p]] += *v;
                    }
                }
                for (d, s) in taps.iter_mut().zip(sum) {
                    *d = if overwrite { s } else { *d + s };
                }
            }
        }
        scratch::give([kept, other]);
    };
    let rows = OUT_BLOCK * g.c * 9;
    if crate::kernels::split_work(dw.len()) && g.o > OUT_BLOCK {
        dw.par_chunks_mut(rows)
            .enumerate()
            .for_each(|(b, r)| crate::kernels::serial(|| block(b, r)));
    } else {
        for (b, r) in dw.chunks_mut(rows).enumerate() {
            block(b, r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::passes;
    use super::*;
    use crate::kernels::{level_lock, set_simd_level, test_values, SimdLevel};

    fn geom(n: usize, c: usize, o: usize) -> Geom {
        Geom {
            n,
            c,
            h: 2,
            w: 2,
            o,
            kh: 3,
            kw: 3,
            s: 1,
            p: 1,
            ho: 2,
            wo: 2,
        }
    }

    /// y, dx and dW (overwritten and accumulated) against im2col's passes
    /// in f64 (batches 1–33 and 130, past the 128 images read in place;
    /// channels 1–70 and VGG16's 512, strips cut at odd widths), at every
    /// SIMD level: each entry within 1e-5 of the sum of its terms'
    /// magnitudes.
    #[test]
    fn equals_the_f64_convolution_on_every_level() {
        let _level = level_lock();
        let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let abs = |v: &[f32]| v.iter().map(|&x| (x as f64).abs()).collect::<Vec<_>>();
        let shapes = [
            (1, 1, 1),
            (3, 5, 7),
            (2, 17, 33),
            (33, 16, 16),
            (5, 70, 40),
            (4, 512, 512),
            (7, 40, 65),
            (130, 9, 20),
        ];
        for level in [SimdLevel::Avx512, SimdLevel::Avx2] {
            set_simd_level(level);
            if Micro::now().is_none() {
                continue;
            }
            for (i, &(n, c, o)) in shapes.iter().enumerate() {
                let g = geom(n, c, o);
                assert!(applies(&g));
                let x = test_values(10 + i as u64, n * c * 4);
                let w = test_values(20 + i as u64, o * c * 9);
                let bias = test_values(30 + i as u64, o);
                let dy = test_values(40 + i as u64, n * o * 4);
                let close = |what: &str, got: &[f32], want: &[f64], scale: &[f64]| {
                    assert_eq!(got.len(), want.len());
                    for (j, ((a, b), s)) in got.iter().zip(want).zip(scale).enumerate() {
                        assert!(
                            (*a as f64 - b).abs() <= 1e-5 * s + 1e-30,
                            "{what} {level:?} {g:?} [{j}]: {a} against {b}"
                        );
                    }
                };
                let y = forward(&g, &x, &w, &bias);
                let want = passes::forward(&g, &wide(&x), &wide(&w), &wide(&bias));
                let scale = passes::forward(&g, &abs(&x), &abs(&w), &abs(&bias));
                close("y", &y, &want, &scale);
                let dx = input_grad(&g, &dy, &w);
                let want = passes::input_grad(&g, &wide(&dy), &wide(&w));
                let scale = passes::input_grad(&g, &abs(&dy), &abs(&w));
                close("dx", &dx, &want, &scale);
                // dW overwritten, then added onto what is there.
                let mut want = vec![0f64; w.len()];
                passes::weight_grad(&g, &mut want, &wide(&dy), &wide(&x), true);
                let mut scale = vec![0f64; w.len()];
                passes::weight_grad(&g, &mut scale, &abs(&dy), &abs(&x), true);
                let mut dw = vec![f32::NAN; w.len()];
                weight_grad(&g, &mut dw, &dy, &x, true);
                close("dW", &dw, &want, &scale);
                let mut dw = vec![1f32; w.len()];
                weight_grad(&g, &mut dw, &dy, &x, false);
                let want: Vec<f64> = want.iter().map(|v| v + 1.0).collect();
                let scale: Vec<f64> = scale.iter().map(|v| v + 1.0).collect();
                close("dW + 1", &dw, &want, &scale);
            }
        }
        set_simd_level(SimdLevel::Avx512);
    }
}
