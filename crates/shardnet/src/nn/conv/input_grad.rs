//! The f32 input gradient on our own GEMM ([`crate::kernels::sgemm`]) for
//! small images, where it beats im2col's path on the `gemm` crate:
//!
//! | step | here | im2col's path |
//! |------|------|---------------|
//! | A = Wᵀ (CKK × O) | packed once per call | packed by the crate once per chunk of images |
//! | B = G (O × q·HoWo) | its strips packed straight from dy, image by image | gathered into a copy first (q > 1), then packed |
//! | dcol = Wᵀ · G | 6 × 64 AVX-512 (6 × 16 AVX2) microkernel | the crate's |
//! | dx | col2im of dcol (dcol is dx itself for a pointwise kernel) | the same col2im |
//!
//! Measured one thread, VGG16's shapes at batch 32 (a Sapphire Rapids
//! core): 0.82–0.97× im2col's time up to 16 × 16 output pixels, 1.09×
//! at 32 × 32, so [`MAX_PIXELS`] draws the line. The sums are the same
//! products in another order: equal to f32 rounding, and the same for any
//! thread count.

use super::geom::Geom;
use super::im2col::col2im;
use super::passes::{chunks, plan};
use crate::kernels::sgemm::{self, Layout, Matrix, Micro, Out, PackedA};

/// The most output pixels per image (Ho·Wo) this path takes.
pub(super) const MAX_PIXELS: usize = 256;

thread_local! {
    /// This thread's dcol, kept between chunks and calls.
    static DCOL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// dx (B, C, H, W) from G (B, O, Ho, Wo) on our GEMM; `None` where the CPU
/// has no microkernel or the images are larger than [`MAX_PIXELS`] (the
/// caller then takes im2col's path).
pub(super) fn on_sgemm(g: &Geom, dy: &[f32], w: &[f32]) -> Option<Vec<f32>> {
    let (hw, k) = (g.ho * g.wo, g.c * g.kh * g.kw);
    if hw > MAX_PIXELS {
        return None;
    }
    let micro = Micro::now()?;
    let mut dx = vec![0f32; g.n * g.c * g.h * g.w];
    // Wᵀ: element (kk, o) at W[o, kk].
    let a = PackedA::new(micro, k, g.o, w, Layout::strided(1, k));
    let pointwise = g.kh == 1 && g.kw == 1 && g.s == 1 && g.p == 0;
    chunks(
        g,
        &mut dx,
        g.c * g.h * g.w,
        plan::<f32>(g),
        |b0, q, part| {
            let cols = q * hw;
            let b = Matrix {
                b: &dy[b0 * g.o * hw..][..q * g.o * hw],
                k: g.o,
                n: cols,
                layout: Layout::images(g.o, hw),
            };
            if pointwise {
                // dx is dcol itself, image by image.
                sgemm::gemm(&a, &b, Out::images(part, k, hw), false);
                return;
            }
            DCOL.with(|d| {
                let mut d = d.borrow_mut();
                if d.len() < k * cols {
                    d.resize(k * cols, 0.0);
                }
                // The GEMM writes every element of dcol it reads back.
                let dcol = &mut d[..k * cols];
                sgemm::gemm(&a, &b, Out::rows(dcol, cols), false);
                col2im(g, dcol, 0, q, 0..g.ho, part);
            });
        },
    );
    Some(dx)
}

#[cfg(test)]
mod tests {
    use super::super::passes::input_grad;
    use super::*;
    use crate::kernels::{level_lock, set_simd_level, test_values, SimdLevel};

    /// A seeded stream of geometries with at most [`MAX_PIXELS`] output
    /// pixels: kernels 1–5 × 1–5, strides 1–3, paddings 0–2, batches 1–5,
    /// 1–9 input and 1–70 output channels (strips of A cut at 6, of B at
    /// 16 and 64), odd sizes.
    fn geometries(count: usize) -> Vec<Geom> {
        let mut next = super::super::passes::seeded_ints(0x5eed);
        let mut out = Vec::new();
        while out.len() < count {
            let (kh, kw, st, p) = (next(1, 5), next(1, 5), next(1, 3), next(0, 2));
            let (h, w) = (next(1, 20), next(1, 20));
            if h + 2 * p < kh || w + 2 * p < kw {
                continue;
            }
            let (ho, wo) = ((h + 2 * p - kh) / st + 1, (w + 2 * p - kw) / st + 1);
            if ho * wo > MAX_PIXELS {
                continue;
            }
            let (n, c, o) = (next(1, 5), next(1, 9), next(1, 70));
            out.push(Geom {
                n,
                c,
                h,
                w,
                o,
                kh,
                kw,
                s: st,
                p,
                ho,
                wo,
            });
        }
        // The pointwise case (dx is dcol itself), a 3 × 3 VGG16 layer, and
        // one image large enough for the GEMM to split its columns over
        // the threads.
        out.push(Geom {
            n: 3,
            c: 7,
            h: 5,
            w: 6,
            o: 13,
            kh: 1,
            kw: 1,
            s: 1,
            p: 0,
            ho: 5,
            wo: 6,
        });
        out.push(Geom {
            n: 4,
            c: 16,
            h: 8,
            w: 8,
            o: 70,
            kh: 3,
            kw: 3,
            s: 1,
            p: 1,
            ho: 8,
            wo: 8,
        });
        out.push(Geom {
            n: 1,
            c: 64,
            h: 16,
            w: 16,
            o: 64,
            kh: 3,
            kw: 3,
            s: 1,
            p: 1,
            ho: 16,
            wo: 16,
        });
        out
    }

    /// Every microkernel this CPU has against im2col's path in f64: each
    /// entry of dx within 1e-5 of the sum of its terms' magnitudes, and the
    /// microkernels equal bit for bit (each sums its k in the same order).
    #[test]
    fn equals_the_f64_gradient_on_every_microkernel() {
        let _one = level_lock();
        let levels: Vec<SimdLevel> = [SimdLevel::Avx512, SimdLevel::Avx2]
            .into_iter()
            .filter(|&l| {
                set_simd_level(l);
                Micro::now().is_some() && crate::kernels::simd_level() == l
            })
            .collect();
        for g in geometries(60) {
            let dy = test_values(1, g.n * g.o * g.ho * g.wo);
            let w = test_values(2, g.o * g.c * g.kh * g.kw);
            let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
            let want = input_grad(&g, &wide(&dy), &wide(&w));
            let abs = |v: &[f32]| v.iter().map(|&x| (x as f64).abs()).collect::<Vec<f64>>();
            let scale = input_grad(&g, &abs(&dy), &abs(&w));
            let mut first: Option<Vec<f32>> = None;
            for &level in &levels {
                set_simd_level(level);
                let got = on_sgemm(&g, &dy, &w).expect("a microkernel and small images");
                for (i, ((x, y), s)) in got.iter().zip(&want).zip(&scale).enumerate() {
                    assert!(
                        (*x as f64 - y).abs() <= 1e-5 * s + 1e-30,
                        "{g:?} at {level:?}: dx[{i}] = {x}, want {y} (Σ|terms| {s})"
                    );
                }
                match &first {
                    None => first = Some(got),
                    Some(f) => assert!(
                        f.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{g:?}: {level:?} differs from {:?}",
                        levels[0]
                    ),
                }
            }
        }
        set_simd_level(SimdLevel::Avx512);
    }

    /// Larger images go to im2col's path.
    #[test]
    fn takes_no_image_past_max_pixels() {
        let g = Geom {
            n: 1,
            c: 1,
            h: 17,
            w: 16,
            o: 1,
            kh: 1,
            kw: 1,
            s: 1,
            p: 0,
            ho: 17,
            wo: 16,
        };
        assert!(on_sgemm(&g, &[0.0; 272], &[1.0]).is_none());
    }
}
