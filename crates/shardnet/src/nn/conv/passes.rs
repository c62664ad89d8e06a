//! The CPU kernel's passes: how the images are cut into chunks (and one
//! large image into bands of output rows, as [`Geom`] sizes them) and run,
//! and the forward, input-, weight- and bias-gradient passes as GEMMs on
//! the `gemm` crate over `im2col.rs`'s patch matrices.

use super::geom::{Geom, Rows};
use super::im2col::{col2im, im2col};
use crate::kernels::{matmul, matmul_strided, sized, Float};
use candle_core::Layout;

/// Two work buffers per thread and element type, kept between chunks and
/// calls: a chunk's im2col matrix, gathered gradient, GEMM output or dcol
/// reuse them instead of allocating and zeroing their size again (each at
/// most [`super::geom::MAX_COL_BYTES`] or a chunk's output; they live as long as the
/// thread).
pub(super) mod scratch {
    use std::any::Any;
    use std::cell::RefCell;

    thread_local! {
        static KEPT: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
    }

    /// This thread's two kept buffers of T (empty the first time).
    pub(in crate::nn::conv) fn take<T: 'static>() -> [Vec<T>; 2] {
        KEPT.with(|k| {
            let mut k = k.borrow_mut();
            match k.iter().position(|b| b.is::<[Vec<T>; 2]>()) {
                Some(i) => match k.swap_remove(i).downcast::<[Vec<T>; 2]>() {
                    Ok(b) => *b,
                    Err(_) => [Vec::new(), Vec::new()],
                },
                None => [Vec::new(), Vec::new()],
            }
        })
    }

    /// Keep them for the next chunk on this thread.
    pub(in crate::nn::conv) fn give<T: 'static>(bufs: [Vec<T>; 2]) {
        KEPT.with(|k| k.borrow_mut().push(Box::new(bufs)));
    }
}

/// A seeded stream of integers in lo..=hi (a linear congruential
/// generator): the conv tests' random geometries.
#[cfg(test)]
pub(super) fn seeded_ints(seed: u64) -> impl FnMut(usize, usize) -> usize {
    let mut s = seed;
    move |lo, hi| {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        lo + (s >> 33) as usize % (hi - lo + 1)
    }
}

/// The contiguous elements of a layout.
pub(super) fn view<'a, T>(s: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    crate::kernels::view(s, l, "Conv2d")
}

/// G of images b0..b0 + q as (O, q·HoWo): a view of dy when q = 1, else
/// gathered into `buf`.
fn gather_grad<'a, T: Float>(
    g: &Geom,
    dy: &'a [T],
    b0: usize,
    q: usize,
    buf: &'a mut Vec<T>,
) -> &'a [T] {
    let hw = g.hw();
    if q == 1 {
        return &dy[b0 * g.o * hw..][..g.o * hw];
    }
    let buf = sized(buf, g.o * q * hw);
    for b in 0..q {
        for o in 0..g.o {
            buf[o * q * hw + b * hw..][..hw]
                .copy_from_slice(&dy[((b0 + b) * g.o + o) * hw..][..hw]);
        }
    }
    buf
}

/// The patches of images b0..b0 + q under output rows `rows` (all unless
/// q = 1): x itself for a pointwise kernel and one whole image, else built
/// in `col`.
fn patches<'a, T: Float>(
    g: &Geom,
    x: &'a [T],
    b0: usize,
    q: usize,
    rows: Rows,
    col: &'a mut Vec<T>,
) -> &'a [T] {
    if g.pointwise() && q == 1 && rows.len() == g.ho {
        return &x[b0 * g.c * g.h * g.w..][..g.c * g.h * g.w];
    }
    // im2col writes every element.
    let col = sized(col, g.k() * q * rows.len() * g.wo);
    im2col(g, x, b0, q, rows, col);
    col
}

/// How the images are cut and run: `q` images per chunk, and whether the
/// chunks run in parallel (each on one thread, its GEMMs serial) or one
/// after the other (each GEMM on every thread). With T threads and at least
/// T chunks the chunks run in parallel: im2col and col2im then run on every
/// thread too, and small GEMMs do not have to be split.
pub(super) fn plan<T>(g: &Geom) -> (usize, bool) {
    let threads = crate::kernels::threads();
    let q = g.chunk::<T>();
    if threads > 1 && g.n >= threads {
        (q.min(g.n.div_ceil(threads)), true)
    } else {
        (q, false)
    }
}

/// Run `f(b0, q, part)` for every chunk of images, `part` being the chunk's
/// rows of `out` (`per_image` elements per image): in parallel when `par`.
pub(super) fn chunks<T: Float + Send + Sync>(
    g: &Geom,
    out: &mut [T],
    per_image: usize,
    (q, par): (usize, bool),
    f: impl Fn(usize, usize, &mut [T]) + Sync,
) {
    use rayon::prelude::*;
    let step = q * per_image;
    if per_image == 0 || g.n == 0 {
        return;
    }
    if par {
        out.par_chunks_mut(step).enumerate().for_each(|(i, part)| {
            crate::kernels::serial(|| f(i * q, part.len() / per_image, part))
        });
    } else {
        for (i, part) in out.chunks_mut(step).enumerate() {
            f(i * q, part.len() / per_image, part);
        }
    }
}

/// y (B, O, Ho, Wo) = conv(x, W) + b.
pub(super) fn forward<T: Float + Send + Sync>(g: &Geom, x: &[T], w: &[T], bias: &[T]) -> Vec<T> {
    let (hw, k) = (g.hw(), g.k());
    // Each chunk's GEMM writes all of its rows (zeros where k = 0).
    let mut y = crate::kernels::unfilled(g.n * g.o * hw, T::NAN);
    chunks(g, &mut y, g.o * hw, plan::<T>(g), |b0, q, part| {
        let cols = q * hw;
        let [mut col, mut tmp] = scratch::take();
        if let (1, Some(bands)) = (q, g.bands::<T>()) {
            // Band by band of output rows, each im2col matrix within L2;
            // each band's Y rows straight into y (rows Ho·Wo apart).
            for rows in bands {
                let (oy0, n) = (rows.start, rows.len() * g.wo);
                let patches = patches(g, x, b0, 1, rows, &mut col);
                let y = (&mut part[oy0 * g.wo..], hw, 1);
                matmul_strided(g.o, n, k, y, false, (w, k, 1), (patches, n, 1));
            }
        } else if q == 1 {
            let patches = patches(g, x, b0, q, 0..g.ho, &mut col);
            matmul(g.o, cols, k, part, false, (w, k, 1), (patches, cols, 1));
        } else {
            let patches = patches(g, x, b0, q, 0..g.ho, &mut col);
            let tmp = sized(&mut tmp, g.o * cols);
            matmul(g.o, cols, k, tmp, false, (w, k, 1), (patches, cols, 1));
            for b in 0..q {
                for o in 0..g.o {
                    part[(b * g.o + o) * hw..][..hw]
                        .copy_from_slice(&tmp[o * cols + b * hw..][..hw]);
                }
            }
        }
        scratch::give([col, tmp]);
        if !bias.is_empty() {
            for (plane, bo) in part.chunks_mut(hw.max(1)).zip(bias.iter().cycle()) {
                for v in plane {
                    *v = *v + *bo;
                }
            }
        }
    });
    y
}

/// dx (B, C, H, W) = the input gradient of G (B, O, Ho, Wo).
pub(super) fn input_grad<T: Float + Send + Sync>(g: &Geom, dy: &[T], w: &[T]) -> Vec<T> {
    let (hw, k) = (g.hw(), g.k());
    let mut dx = vec![T::ZERO; g.n * g.c * g.h * g.w];
    chunks(g, &mut dx, g.c * g.h * g.w, plan::<T>(g), |b0, q, part| {
        let cols = q * hw;
        let [mut buf, mut dcol] = scratch::take();
        if let (1, Some(bands)) = (q, g.bands::<T>()) {
            // Band by band of output rows (as the forward): G's rows read
            // in place (Ho·Wo apart), each band's dcol within L2.
            for rows in bands {
                let (oy0, n) = (rows.start, rows.len() * g.wo);
                let dcol = sized(&mut dcol, k * n);
                let gb = &dy[b0 * g.o * hw + oy0 * g.wo..];
                // lhs = Wᵀ: element (m, kk) is W[kk, m].
                matmul(k, n, g.o, dcol, false, (w, 1, k), (gb, hw, 1));
                col2im(g, dcol, 0, 1, rows, part);
            }
        } else {
            let gq = gather_grad(g, dy, b0, q, &mut buf);
            if g.pointwise() && q == 1 {
                matmul(k, cols, g.o, part, false, (w, 1, k), (gq, cols, 1));
            } else {
                let dcol = sized(&mut dcol, k * cols);
                // lhs = Wᵀ: element (m, kk) is W[kk, m].
                matmul(k, cols, g.o, dcol, false, (w, 1, k), (gq, cols, 1));
                col2im(g, dcol, 0, q, 0..g.ho, part);
            }
        }
        scratch::give([buf, dcol]);
    });
    dx
}

/// dW (O, CKK) (+)= Σ_chunks G · colᵀ; chunks run in parallel each sum
/// into their own dW, added at the end.
pub(super) fn weight_grad<T: Float + Send + Sync>(
    g: &Geom,
    dw: &mut [T],
    dy: &[T],
    x: &[T],
    overwrite: bool,
) {
    use rayon::prelude::*;
    let (hw, k) = (g.hw(), g.k());
    if g.n == 0 || hw == 0 {
        if overwrite {
            dw.fill(T::ZERO);
        }
        return;
    }
    let (q, par) = plan::<T>(g);
    // dW (+)= the chunk's G · colᵀ.
    let chunk = |b0: usize, dst: &mut [T], accumulate: bool| {
        let q = q.min(g.n - b0);
        let cols = q * hw;
        let [mut buf, mut col] = scratch::take();
        let gq = gather_grad(g, dy, b0, q, &mut buf);
        let patches = patches(g, x, b0, q, 0..g.ho, &mut col);
        // dW (O, CKK) (+)= G · colᵀ: both operands run along the pixels,
        // which kernels::dot sums as they lie where that beats the GEMM's
        // transposing packs (f32, AVX-512, long chunks and few channels).
        let p = crate::kernels::dot::Abt {
            m: g.o,
            n: k,
            k: cols,
            a: gq,
            lda: cols,
            b: patches,
            ldb: cols,
        };
        T::matmul_abt(p, dst, k, accumulate);
        scratch::give([buf, col]);
    };
    let starts: Vec<usize> = (0..g.n).step_by(q).collect();
    if par {
        // T fixed runs of chunks, each into its own dW, summed in order:
        // deterministic, and T dW-sized buffers at most.
        let threads = crate::kernels::threads();
        let run = starts.len().div_ceil(threads);
        let partials: Vec<Vec<T>> = starts
            .par_chunks(run)
            .map(|mine| {
                let mut acc = vec![T::ZERO; dw.len()];
                crate::kernels::serial(|| {
                    for &b0 in mine {
                        chunk(b0, &mut acc, true);
                    }
                });
                acc
            })
            .collect();
        // Summed in the same order on every element, split over the
        // threads by element (dW is up to 9 MiB: a serial pass cost each
        // step about as much as a small layer).
        let piece = dw.len().div_ceil(threads).max(1 << 12);
        dw.par_chunks_mut(piece).enumerate().for_each(|(c, out)| {
            let at = c * piece;
            for (i, part) in partials.iter().enumerate() {
                for (d, s) in out.iter_mut().zip(&part[at..]) {
                    *d = if overwrite && i == 0 { *s } else { *d + *s };
                }
            }
        });
    } else {
        for (i, &b0) in starts.iter().enumerate() {
            chunk(b0, dw, !(overwrite && i == 0));
        }
    }
}

/// db (O) (+)= Σ_{b, pixels} G.
/// Per channel: each image's plane summed over [`LANES`] interleaved
/// partial sums, compiled for the CPU's widest vectors (the same bits at
/// every level), the images' sums in blocks ([`crate::kernels::sum`]); the channels split over the threads
/// when large (each channel summed the same way either way). Over 8
/// partial sums on baseline vectors the pass waited on the adds' latency:
/// measured on a Zen 5 core, 8% of `bench conv`'s
/// 3 → 64 @ 32 forward + backward on 2 threads.
pub(super) fn bias_grad<T: Float + Send + Sync>(g: &Geom, db: &mut [T], dy: &[T], overwrite: bool) {
    use rayon::prelude::*;
    let hw = g.hw();
    let channel = |(o, d): (usize, &mut T)| {
        // The images' sums in blocks (a long batch as a blocked BLAS).
        let s = crate::kernels::sum::sum(g.n, |b| plane_sum(&dy[(b * g.o + o) * hw..][..hw]));
        *d = if overwrite { s } else { *d + s };
    };
    if crate::kernels::split_work(dy.len()) {
        db.par_iter_mut().enumerate().for_each(channel);
    } else {
        db.iter_mut().enumerate().for_each(channel);
    }
}

/// Partial sums of [`plane_sum`]: enough independent adds in flight to
/// hide their latency at every vector width (4 AVX-512 vectors of f32).
const LANES: usize = 64;

/// Σ v: lane l sums the elements l, l + LANES, … in order, the lanes are
/// combined by halving (lane l + h into lane l, h = LANES/2, …, 1), the
/// tail after, in order. Compiled for the CPU's widest vectors
/// ([`crate::kernels::dispatch`]); the same operations in the same order
/// at every level, so the same bits.
fn plane_sum<T: Float>(v: &[T]) -> T {
    #[inline(always)]
    fn go<T: Float>(v: &[T]) -> T {
        let mut acc = [T::ZERO; LANES];
        let chunks = v.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for l in 0..LANES {
                acc[l] = acc[l] + c[l];
            }
        }
        let mut h = LANES / 2;
        while h > 0 {
            for l in 0..h {
                acc[l] = acc[l] + acc[l + h];
            }
            h /= 2;
        }
        let mut s = acc[0];
        for x in tail {
            s = s + *x;
        }
        s
    }
    crate::kernels::dispatch!(|| go(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values;

    /// A plane's sum: the same bits at every vector level, within f32
    /// rounding of the f64 sum, at lengths with and without a tail (the
    /// bias gradient's planes run from 2 × 2 to 224 × 224).
    #[test]
    fn plane_sum_is_the_same_at_every_level() {
        for len in [0, 1, 4, 63, 64, 65, 200, 1024, 4099] {
            let v = test_values(len as u64 + 7, len);
            crate::kernels::assert_same_at_every_level(
                &format!("plane_sum over {len}"),
                || plane_sum(&v),
                |s| s.to_bits(),
            );
            let want: f64 = v.iter().map(|x| *x as f64).sum();
            let mag: f64 = v.iter().map(|x| x.abs() as f64).sum();
            let got = plane_sum(&v) as f64;
            assert!(
                (got - want).abs() <= 1e-6 * mag.max(1.0),
                "plane_sum over {len}: {got} against {want}"
            );
        }
    }

    /// y and dx from the definition in f64, and the same sums of the
    /// terms' magnitudes (the accuracy bound of any f32 sum of them).
    fn reference(g: &Geom, x: &[f32], w: &[f32], dy: &[f32]) -> [Vec<f64>; 4] {
        let (mut y, mut ys) = (
            vec![0f64; g.n * g.o * g.hw()],
            vec![0f64; g.n * g.o * g.hw()],
        );
        let (mut dx, mut dxs) = (vec![0f64; x.len()], vec![0f64; x.len()]);
        for b in 0..g.n {
            for o in 0..g.o {
                for oy in 0..g.ho {
                    for ox in 0..g.wo {
                        let yi = ((b * g.o + o) * g.ho + oy) * g.wo + ox;
                        for c in 0..g.c {
                            for i in 0..g.kh {
                                for j in 0..g.kw {
                                    let iy = (oy * g.s + i) as isize - g.p as isize;
                                    let ix = (ox * g.s + j) as isize - g.p as isize;
                                    if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize
                                    {
                                        continue;
                                    }
                                    let xi =
                                        ((b * g.c + c) * g.h + iy as usize) * g.w + ix as usize;
                                    let wv = w[((o * g.c + c) * g.kh + i) * g.kw + j] as f64;
                                    y[yi] += wv * x[xi] as f64;
                                    ys[yi] += (wv * x[xi] as f64).abs();
                                    dx[xi] += wv * dy[yi] as f64;
                                    dxs[xi] += (wv * dy[yi] as f64).abs();
                                }
                            }
                        }
                    }
                }
            }
        }
        [y, ys, dx, dxs]
    }

    fn assert_close(what: &str, got: &[f32], want: &[f64], scale: &[f64]) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
            assert!(
                (*g as f64 - w).abs() <= 1e-5 * s + 1e-30,
                "{what}[{i}] = {g}, want {w} (Σ|terms| {s})"
            );
        }
    }

    /// Images whose im2col matrix passes [`super::geom::MAX_BAND_BYTES`] run band by
    /// band of output rows: y and dx equal the definition, with bands of
    /// unequal height, stride 2 and a non-square kernel, one image and
    /// several.
    #[test]
    fn banded_images_equal_the_definition() {
        let geoms = [
            (1, 64, 32, 32, 5, 3, 3, 1, 1),
            (2, 40, 61, 50, 3, 3, 5, 2, 2),
        ];
        for (n, c, h, w, o, kh, kw, s, p) in geoms {
            let (ho, wo) = ((h + 2 * p - kh) / s + 1, (w + 2 * p - kw) / s + 1);
            let g = Geom {
                n,
                c,
                h,
                w,
                o,
                kh,
                kw,
                s,
                p,
                ho,
                wo,
            };
            let band = g.band::<f32>();
            assert!(band < ho, "{g:?}: band {band}");
            let x = test_values(1, n * c * h * w);
            let wt = test_values(2, o * c * kh * kw);
            let dy = test_values(3, n * o * ho * wo);
            let [y, ys, dx, dxs] = reference(&g, &x, &wt, &dy);
            assert_close("y", &forward(&g, &x, &wt, &[]), &y, &ys);
            assert_close("dx", &input_grad(&g, &dy, &wt), &dx, &dxs);
        }
    }
}
