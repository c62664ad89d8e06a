//! The CPU kernel's arithmetic: the sizes of one call ([`Geom`]), im2col
//! and col2im, how the images are cut into chunks and run, and the forward,
//! input-, weight- and bias-gradient passes as GEMMs on the `gemm` crate.

use crate::kernels::{matmul, Float};
use candle_core::Layout;

/// A chunk's GEMMs get at least this many columns (images × output pixels)
/// when the batch has them.
pub const MIN_COLUMNS: usize = 256;

/// The most bytes of im2col matrix one chunk builds (unless one image needs
/// more).
pub const MAX_COL_BYTES: usize = 8 << 20;

/// The sizes of one convolution call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Geom {
    pub(super) n: usize,
    pub(super) c: usize,
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) o: usize,
    pub(super) kh: usize,
    pub(super) kw: usize,
    pub(super) s: usize,
    pub(super) p: usize,
    pub(super) ho: usize,
    pub(super) wo: usize,
}

impl Geom {
    /// Rows of `col`: C·kh·kw.
    fn k(&self) -> usize {
        self.c * self.kh * self.kw
    }
    /// Output pixels per image.
    fn hw(&self) -> usize {
        self.ho * self.wo
    }
    /// Images per chunk.
    fn chunk<T>(&self) -> usize {
        let per_image = self.k() * self.hw() * std::mem::size_of::<T>();
        let want = MIN_COLUMNS.div_ceil(self.hw().max(1));
        let fit = (MAX_COL_BYTES / per_image.max(1)).max(1);
        want.min(fit).clamp(1, self.n.max(1))
    }
    /// x is its own im2col matrix (per image).
    fn pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.s == 1 && self.p == 0
    }
}

/// Two work buffers per thread and element type, kept between chunks and
/// calls: a chunk's im2col matrix, gathered gradient, GEMM output or dcol
/// reuse them instead of allocating and zeroing their size again (each at
/// most [`MAX_COL_BYTES`] or a chunk's output; they live as long as the
/// thread).
mod scratch {
    use std::any::Any;
    use std::cell::RefCell;

    thread_local! {
        static KEPT: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
    }

    /// This thread's two kept buffers of T (empty the first time).
    pub(super) fn take<T: 'static>() -> [Vec<T>; 2] {
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
    pub(super) fn give<T: 'static>(bufs: [Vec<T>; 2]) {
        KEPT.with(|k| k.borrow_mut().push(Box::new(bufs)));
    }
}

/// The contiguous elements of a layout.
pub(super) fn view<'a, T>(s: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    crate::kernels::view(s, l, "Conv2d")
}

/// Fill `col` (CKK, q·HoWo) with the patches of images `b0..b0 + q`.
fn im2col<T: Float>(g: &Geom, x: &[T], b0: usize, q: usize, col: &mut [T]) {
    let (hw, cols) = (g.hw(), q * g.hw());
    let image = g.c * g.h * g.w;
    for c in 0..g.c {
        for i in 0..g.kh {
            for j in 0..g.kw {
                let row = &mut col[((c * g.kh + i) * g.kw + j) * cols..][..cols];
                for b in 0..q {
                    let plane = &x[(b0 + b) * image + c * g.h * g.w..][..g.h * g.w];
                    let out = &mut row[b * hw..][..hw];
                    fill_patch_row(g, plane, i, j, out);
                }
            }
        }
    }
}

/// The valid output columns [lo, hi) of kernel column `j`: those whose
/// input column ox·s − p + j lies inside the image.
fn valid_columns(g: &Geom, j: usize) -> (usize, usize) {
    // ix = ox·s + j − p ≥ 0  ⇔  ox ≥ ceil((p − j) / s)
    let lo = if g.p > j { (g.p - j).div_ceil(g.s) } else { 0 };
    // ix ≤ w − 1  ⇔  ox ≤ (w + p − 1 − j) / s
    let hi = if g.w + g.p > j {
        ((g.w + g.p - 1 - j) / g.s + 1).min(g.wo)
    } else {
        0
    };
    (lo.min(hi), hi)
}

/// Row (i, j) of one image's patches: out[oy·Wo + ox] = plane[iy, ix].
fn fill_patch_row<T: Float>(g: &Geom, plane: &[T], i: usize, j: usize, out: &mut [T]) {
    let (lo, hi) = valid_columns(g, j);
    for oy in 0..g.ho {
        let line = &mut out[oy * g.wo..][..g.wo];
        let iy = (oy * g.s + i) as isize - g.p as isize;
        if iy < 0 || iy >= g.h as isize || lo >= hi {
            line.fill(T::ZERO);
            continue;
        }
        let src = &plane[iy as usize * g.w..][..g.w];
        line[..lo].fill(T::ZERO);
        line[hi..].fill(T::ZERO);
        let start = lo * g.s + j - g.p;
        if g.s == 1 {
            line[lo..hi].copy_from_slice(&src[start..start + (hi - lo)]);
        } else {
            for (k, v) in line[lo..hi].iter_mut().enumerate() {
                *v = src[start + k * g.s];
            }
        }
    }
}

/// dx[b0..b0 + q] += col2im(dcol): the mirror of [`im2col`]. Built for
/// the baseline vectors on purpose: its rows are short (31, 15, 7 or 3
/// adds at a 3 × 3 kernel's border), and wider vectors left more of them
/// to scalar tails (measured 10–35% slower with AVX2 or AVX-512).
pub(super) fn col2im<T: Float>(g: &Geom, dcol: &[T], b0: usize, q: usize, dx: &mut [T]) {
    let (hw, cols) = (g.hw(), q * g.hw());
    let image = g.c * g.h * g.w;
    for b in 0..q {
        for c in 0..g.c {
            let plane = &mut dx[(b0 + b) * image + c * g.h * g.w..][..g.h * g.w];
            for i in 0..g.kh {
                for j in 0..g.kw {
                    let row = &dcol[((c * g.kh + i) * g.kw + j) * cols + b * hw..][..hw];
                    add_patch_row(g, row, i, j, plane);
                }
            }
        }
    }
}

/// plane[iy, ix] += row[oy·Wo + ox] for the valid pixels.
fn add_patch_row<T: Float>(g: &Geom, row: &[T], i: usize, j: usize, plane: &mut [T]) {
    let (lo, hi) = valid_columns(g, j);
    if lo >= hi {
        return;
    }
    for oy in 0..g.ho {
        let iy = (oy * g.s + i) as isize - g.p as isize;
        if iy < 0 || iy >= g.h as isize {
            continue;
        }
        let dst = &mut plane[iy as usize * g.w..][..g.w];
        let line = &row[oy * g.wo..][..g.wo];
        let start = lo * g.s + j - g.p;
        if g.s == 1 {
            // Contiguous on both sides: the adds vectorise.
            for (d, v) in dst[start..start + (hi - lo)].iter_mut().zip(&line[lo..hi]) {
                *d = *d + *v;
            }
        } else {
            for (k, v) in line[lo..hi].iter().enumerate() {
                let d = &mut dst[start + k * g.s];
                *d = *d + *v;
            }
        }
    }
}

/// The first `n` elements of a kept work buffer, grown (zeroed) only past
/// its length: shrinking and growing it again between layers zeroes
/// nothing, so the caller must write every element it reads.
fn sized<T: Float>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::ZERO);
    }
    &mut v[..n]
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

/// The patches of images b0..b0 + q: x itself for a pointwise kernel and
/// one image, else built in `col`.
fn patches<'a, T: Float>(
    g: &Geom,
    x: &'a [T],
    b0: usize,
    q: usize,
    col: &'a mut Vec<T>,
) -> &'a [T] {
    if g.pointwise() && q == 1 {
        return &x[b0 * g.c * g.h * g.w..][..g.c * g.h * g.w];
    }
    // im2col writes every element.
    let col = sized(col, g.k() * q * g.hw());
    im2col(g, x, b0, q, col);
    col
}

/// How the images are cut and run: `q` images per chunk, and whether the
/// chunks run in parallel (each on one thread, its GEMMs serial) or one
/// after the other (each GEMM on every thread). With T threads and at least
/// T chunks the chunks run in parallel: im2col and col2im then run on every
/// thread too, and small GEMMs do not have to be split.
pub(super) fn plan<T>(g: &Geom) -> (usize, bool) {
    let threads = candle_core::utils::get_num_threads().max(1);
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
    let mut y = vec![T::ZERO; g.n * g.o * hw];
    chunks(g, &mut y, g.o * hw, plan::<T>(g), |b0, q, part| {
        let cols = q * hw;
        let [mut col, mut tmp] = scratch::take();
        let patches = patches(g, x, b0, q, &mut col);
        if q == 1 {
            matmul(g.o, cols, k, part, false, (w, k, 1), (patches, cols, 1));
        } else {
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
        let gq = gather_grad(g, dy, b0, q, &mut buf);
        if g.pointwise() && q == 1 {
            matmul(k, cols, g.o, part, false, (w, 1, k), (gq, cols, 1));
        } else {
            let dcol = sized(&mut dcol, k * cols);
            // lhs = Wᵀ: element (m, kk) is W[kk, m].
            matmul(k, cols, g.o, dcol, false, (w, 1, k), (gq, cols, 1));
            col2im(g, dcol, 0, q, part);
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
        let patches = patches(g, x, b0, q, &mut col);
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
        let threads = candle_core::utils::get_num_threads().max(1);
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
/// Per channel: each image's plane summed over 8 interleaved partial sums
/// (one running sum waited on every add's latency: 2% of a VGG16 step),
/// the images in order; the channels split over the threads when large
/// (each channel summed the same way either way).
pub(super) fn bias_grad<T: Float + Send + Sync>(g: &Geom, db: &mut [T], dy: &[T], overwrite: bool) {
    use rayon::prelude::*;
    let hw = g.hw();
    let channel = |(o, d): (usize, &mut T)| {
        let s = (0..g.n).fold(T::ZERO, |acc, b| {
            acc + sum8(&dy[(b * g.o + o) * hw..][..hw])
        });
        *d = if overwrite { s } else { *d + s };
    };
    if crate::kernels::split_work(dy.len()) {
        db.par_iter_mut().enumerate().for_each(channel);
    } else {
        db.iter_mut().enumerate().for_each(channel);
    }
}

/// Σ v over 8 interleaved partial sums, combined in a fixed order, the tail
/// after.
fn sum8<T: Float>(v: &[T]) -> T {
    let mut acc = [T::ZERO; 8];
    let chunks = v.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] = acc[l] + c[l];
        }
    }
    let mut s = crate::kernels::tree8(acc);
    for x in tail {
        s = s + *x;
    }
    s
}
