//! 3 × 3, stride 1 convolutions in f32 by Winograd's minimal filtering
//! F(2 × 2, 3 × 3) (Lavin and Gray, 2015): each 2 × 2 block of output
//! pixels from a 4 × 4 tile of input in 16 products instead of 36, so every
//! pass's GEMM does 16/36 of im2col's multiplications.
//!
//! | pass | per 4 × 4 input tile d, per 2 × 2 output tile | GEMMs (one per ξ of the 16 tile positions) |
//! |------|------|------|
//! | weights | U = G w Gᵀ (4 × 4 per kernel), written straight into `sgemm`'s packed A | |
//! | forward | V = Bᵀ d B; y = Aᵀ M A + bias | M[ξ] (O × T) = U[ξ] (O × C) · V[ξ] (C × T) on `sgemm`, U packed once per forward ([`pack`]; the convolution op keeps it for its backward) |
//! | input gradient | dM = A dy Aᵀ; dd = B dV Bᵀ, added into dx where tiles overlap | dV[ξ] (C × T) = U[ξ]ᵀ · dM[ξ], the forward's U read across (`sgemm::gemm_transposed`) |
//! | weight gradient | dM as above, V as the forward | dU[ξ] (O × C) += dM[ξ] · V[ξ]ᵀ on `sgemm`, dM read where it lies (`sgemm::gemm_rows`); then dW = Gᵀ dU G |
//!
//! with T the tiles of a chunk of images (⌈Ho/2⌉·⌈Wo/2⌉ each) and
//!
//! | matrix | rows |
//! |--------|------|
//! | Bᵀ | (1, 0, −1, 0), (0, 1, 1, 0), (0, −1, 1, 0), (0, 1, 0, −1) |
//! | G | (1, 0, 0), (½, ½, ½), (½, −½, ½), (0, 0, 1) |
//! | Aᵀ | (1, 1, 1, 0), (0, 1, −1, −1) |
//!
//! Where both gradients are wanted, [`backward`] takes them in one pass
//! over the chunks: each chunk's dM is transformed once, dV scattered into
//! dx, then V transformed into dV's buffer for dU.
//!
//! Where a chunk is one image whose V and M would overflow a core's L2
//! and U fits beside a band ([`band_rows`]: VGG16's 64-channel layers at
//! 32 × 32, and any large image at 64 channels), every pass runs in bands
//! of tile rows: the image's planes split once into every channel's split
//! planes ([`planes::SplitChunk`]), each band's V, M and GEMMs within L2,
//! and dx's tiles summed into split planes until every band is in.
//!
//! The backward passes are the chain rule through these same linear maps,
//! so the gradients are exactly those of the forward's algorithm. The
//! rounding differs from im2col's: each product's inputs are sums of up to
//! four inputs (V) and nine weights (U), and each output a sum of nine
//! products' sums, so the error is bounded by a few units of f32 rounding
//! times Σ |U|·|V| over a tile rather than Σ |w|·|x| per pixel (measured in
//! the tests against f64).
//!
//! U's transform and dW's are in `weights.rs`. The input and output
//! transforms run 16 tiles at a time (`lanes.rs`): a plane is first
//! split, zero-padded, into its even and odd columns, so that a run of
//! tiles along a row of tiles loads contiguously. On AVX-512 each block of
//! 16 tiles runs in registers as masked loads and stores per run
//! (`x86/`); elsewhere as fixed arrays of 16 lanes compiled for the
//! CPU's widest vectors ([`crate::kernels::dispatch!`]): the same
//! operations in the same order, so the same bits (tested).
//!
//! Measured on one Sapphire Rapids core, VGG16 at batch 32:
//! 0.61–0.92× im2col's forward + backward time on its 3 × 3 layers, and
//! one-core training 1.25–1.3× faster.

mod lanes;
mod plan;
mod planes;
#[cfg(test)]
mod tests;
mod weights;

use super::geom::Geom;
use super::passes::{chunks, scratch};
use crate::kernels::sgemm::{self, Layout, Matrix, Micro, Out, PackedA, Place};
use crate::kernels::{aligned, simd_level, sized, sized_aligned, SimdLevel};
use lanes::{grad_transform, input_scatter, input_transform, output_transform};
use plan::{band_rows, plan, Span, Tiles};
use planes::SplitChunk;
use std::sync::atomic::{AtomicU8, Ordering};
use weights::{pack_weights, weights_back, Targets};

/// Tile positions ξ = 4a + b.
const XI: usize = 16;
/// Tiles per lane block.
const L: usize = 16;
/// Fewest input channels that take this path: the GEMMs' depth (C in the
/// forward) under it leaves the transforms to dominate (VGG16's first
/// layer has 3).
pub(crate) const MIN_CHANNELS: usize = 16;
/// Fewest tiles in a call (images × tiles per image) that take this path:
/// its fixed cost, U's transform and packing (16/9 of W, 16 MB at
/// 512 → 512), is repaid by the GEMMs' savings only over enough tiles
/// (measured, one thread, forward and backward against im2col's: 512 →
/// 512 at 4 × 4, batch 16, 64 tiles, 0.69×; at 2 × 2, batch 32, 32 tiles,
/// 1.01×, and 16 tiles 1.8×; at 2 × 2, batch 128, 0.65×).
pub(super) const MIN_CALL_TILES: usize = 64;
/// This path takes `g`: a 3 × 3 kernel at stride 1, enough input
/// channels and tiles, a CPU with an `sgemm` microkernel, and not turned
/// off ([`set_enabled`]).
pub(super) fn applies(g: &Geom) -> bool {
    g.kh == 3
        && g.kw == 3
        && g.s == 1
        && g.c >= MIN_CHANNELS
        && g.ho > 0
        && g.wo > 0
        && g.n * Tiles::of(g).per_image() >= MIN_CALL_TILES
        && enabled()
        && Micro::now().is_some()
}

/// Whole blocks on one row of tiles run on `x86`'s AVX-512 code.
#[inline(always)]
fn avx512() -> bool {
    cfg!(target_arch = "x86_64") && simd_level() == SimdLevel::Avx512
}

/// Whether the path is on: unset (read `SHARDNET_WINOGRAD` on first use),
/// on or off ([`set_enabled`]).
static STATE: AtomicU8 = AtomicU8::new(0);
const ON: u8 = 1;
const OFF: u8 = 2;

/// Whether 3 × 3 convolutions run by Winograd's algorithm: on unless
/// `SHARDNET_WINOGRAD=0` or [`set_enabled`] turned it off.
pub fn enabled() -> bool {
    match STATE.load(Ordering::Acquire) {
        ON => true,
        OFF => false,
        _ => {
            let code = if crate::kernels::winograd_from_env() {
                ON
            } else {
                OFF
            };
            // A concurrent first read decides the same way.
            let _ = STATE.compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
            enabled()
        }
    }
}

/// Turn the Winograd path on or off for the whole process (benchmarks
/// compare it with im2col's in one run; every thread sees the change).
pub fn set_enabled(on: bool) {
    STATE.store(if on { ON } else { OFF }, Ordering::Release);
}

thread_local! {
    /// This thread's dU, one per part of the weight gradient, kept between
    /// calls.
    static DU: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Every U[ξ] = G w Gᵀ of one layer's weights w (O, C, 3, 3), packed for
/// `sgemm` ([`pack`]): the forward's A, and its backward's read across. The
/// convolution op keeps the forward's for its backward, which then packs
/// nothing (16/9 of the weights held between the two).
pub(in crate::nn::conv) struct PackedU(Vec<PackedA>);

/// U of `w` for the layer `g`. The caller checked [`applies`].
pub(in crate::nn::conv) fn pack(g: &Geom, w: &[f32]) -> PackedU {
    let micro = Micro::now().expect("applies() checked for a microkernel");
    PackedU(packed(micro, g, w))
}

/// Every U[ξ] = G w Gᵀ (of w (O, C, 3, 3)) packed for `sgemm` (O × C),
/// with the slack that reading it across as Uᵀ needs
/// (`sgemm::gemm_transposed`): the forward's A, and the input gradient's
/// read across.
fn packed(micro: Micro, g: &Geom, w: &[f32]) -> Vec<PackedA> {
    use rayon::prelude::*;
    let place = Place::of(micro, g.o, g.c);
    let len = place.len() + sgemm::ACROSS_SLACK;
    // This thread's spare buffers (they come back here when the packed A
    // are dropped), every element written below.
    let mut bufs: Vec<Vec<f32>> = (0..XI).map(|_| PackedA::spare(len)).collect();
    for b in &mut bufs {
        // The slack is read (into rows never stored), never used: zero.
        sized(b, len)[place.len()..].fill(0.0);
    }
    let out = Targets {
        at: std::array::from_fn(|xi| bufs[xi].as_mut_ptr()),
        len: place.len(),
    };
    // The strips split over the threads (on this one when it is alone).
    let threads = crate::kernels::threads_here();
    if threads == 1 {
        pack_weights(g, w, place, 0..place.strips, &out);
    } else {
        let per = place.strips.div_ceil(threads).max(1);
        (0..place.strips.div_ceil(per))
            .into_par_iter()
            .for_each(|t| {
                let strips = t * per..((t + 1) * per).min(place.strips);
                pack_weights(g, w, place, strips, &out);
            });
    }
    bufs.into_iter()
        .map(|data| PackedA::from_filled(data, micro, g.o, g.c))
        .collect()
}

/// Kernels per task when the weight transforms split over the threads
/// (whole lane blocks; one task on one thread).
fn kernels_per_task(oc: usize) -> usize {
    let threads = crate::kernels::threads();
    oc.div_ceil(threads).next_multiple_of(L).max(L)
}

/// Floats from V[ξ] (or M[ξ], dV[ξ], dM[ξ]: `rows` × `cols`) to V[ξ + 1]:
/// whole 64-byte lines, an odd number of them, so that a block's 16
/// vectors (one per ξ, at the same place in each) fall in 16 different
/// sets of L1. At a power-of-two stride (64 → 64 @ 32: 64 KiB) they shared
/// one 12-way set: measured there, one thread, a chunk's input transform
/// took 0.120 ms and its gradient's 0.087, against 0.073 and 0.044 now.
pub(super) fn xi_stride(rows: usize, cols: usize) -> usize {
    ((rows * cols).div_ceil(16) | 1) * 16
}

/// C[ξ] (m × cols) = A[ξ] · B[ξ] (k × cols) for the 16 tile positions, or
/// A[ξ]ᵀ · B[ξ] when `transposed` (A[ξ] then k × m, read across:
/// `sgemm::gemm_transposed`), B and C as [16][rows][cols], the planes
/// [`xi_stride`] apart.
fn gemms(
    a: &[PackedA],
    transposed: bool,
    b: &[f32],
    k: usize,
    c: &mut [f32],
    m: usize,
    cols: usize,
) {
    let gemm = if transposed {
        sgemm::gemm_transposed
    } else {
        sgemm::gemm
    };
    for (xi, a) in a.iter().enumerate() {
        let b = Matrix {
            b: &b[xi * xi_stride(k, cols)..][..k * cols],
            k,
            n: cols,
            layout: Layout::strided(cols, 1),
        };
        gemm(
            a,
            &b,
            Out::rows(&mut c[xi * xi_stride(m, cols)..][..m * cols], cols),
            false,
        );
    }
}

/// y (B, O, Ho, Wo) = conv(x, W) + b, with W's U ([`pack`]). The caller
/// checked [`applies`].
///
/// Where a chunk is one image whose V and M would overflow a core's L2
/// between the transforms and the GEMMs ([`band_rows`]), it runs in bands
/// of tile rows, each band's V, M and U within L2; the image's planes are
/// split once for all its bands. Measured on one Cascade Lake core, 64 →
/// 64 @ 32 at batch 32 (bands of 4 of its 16 tile rows), alternated in one
/// process: GEMMs 11.2 → 9.3 ms, output transform 2.3 → 2.0, input
/// transform 4.5 → 4.6, the forward 19.2 → 17.1. Split band by band
/// instead, the input transform took 6.2–6.6 ms: one band's rows of x lie
/// in short runs a plane (here a 4 KiB page) apart.
pub(super) fn forward(g: &Geom, x: &[f32], u: &PackedU, bias: &[f32]) -> Vec<f32> {
    let t = Tiles::of(g);
    let (q, par) = plan(g, &t);
    forward_in_bands(g, x, u, bias, (q, par), band_rows(g, &t, q))
}

/// [`forward`] with chunks of `plan` and bands of `band` tile rows.
fn forward_in_bands(
    g: &Geom,
    x: &[f32],
    u: &PackedU,
    bias: &[f32],
    plan: (usize, bool),
    band: usize,
) -> Vec<f32> {
    let t = Tiles::of(g);
    let u = &u.0;
    let hw = g.ho * g.wo;
    // Every pixel is in one tile, whose output transform writes it.
    let mut y = crate::kernels::unfilled(g.n * g.o * hw, f32::NAN);
    chunks(g, &mut y, g.o * hw, plan, |b0, q, part| {
        let [mut vb, mut mb] = scratch::take::<f32>();
        let mut split = (band < t.th).then(|| SplitChunk::of(g, &t, x, b0, q));
        for span in Span::bands(&t, b0, q, band) {
            let cols = span.cols(&t);
            let v = sized_aligned(&mut vb, XI * xi_stride(g.c, cols));
            input_transform(g, &t, x, &span, v, split.as_mut());
            let m = sized_aligned(&mut mb, XI * xi_stride(g.o, cols));
            gemms(u, false, v, g.c, m, g.o, cols);
            output_transform(g, &t, m, &span, bias, part);
        }
        scratch::give([vb, mb]);
    });
    y
}

/// dx (B, C, H, W) from G (B, O, Ho, Wo): dV[ξ] = U[ξ]ᵀ · dM[ξ], U
/// packed as the forward packs it and read across
/// (`sgemm::gemm_transposed`). Measured on VGG16 at batch 32, one core,
/// against packing Uᵀ for `sgemm::gemm`: backward 299 → 268 ms a step
/// (512 → 512 @ 4: 47 → 35 ms forward + backward). Keeping the forward's
/// U for this instead saved nothing more: the forward, whose U no longer
/// went back to the same spare buffers, slowed by as much as packing it
/// again costs. The caller checked [`applies`].
pub(super) fn input_grad(g: &Geom, dy: &[f32], w: &[f32]) -> Vec<f32> {
    let micro = Micro::now().expect("applies() checked for a microkernel");
    let t = Tiles::of(g);
    let u = packed(micro, g, w);
    // Every plane written whole by input_scatter (the tiles are added
    // into its own zeroed buffer first).
    let mut dx = crate::kernels::unfilled(g.n * g.c * g.h * g.w, f32::NAN);
    let (q, par) = plan(g, &t);
    let band = band_rows(g, &t, q);
    chunks(g, &mut dx, g.c * g.h * g.w, (q, par), |b0, q, part| {
        // Band by band as [`backward`]: the same bits.
        let mut sums = (band < t.th).then(|| SplitChunk::zeros(g, &t, q));
        let [mut mb, mut vb] = scratch::take::<f32>();
        for span in Span::bands(&t, b0, q, band) {
            let cols = span.cols(&t);
            let dm = sized_aligned(&mut mb, XI * xi_stride(g.o, cols));
            grad_transform(g, &t, dy, &span, dm);
            let dv = sized_aligned(&mut vb, XI * xi_stride(g.c, cols));
            gemms(&u, true, dm, g.o, dv, g.c, cols);
            input_scatter(g, &t, dv, &span, part, sums.as_mut());
        }
        if let Some(sums) = sums.as_mut() {
            sums.unsplit(g, &t, part);
        }
        scratch::give([mb, vb]);
    });
    dx
}

/// dW (O, C, 3, 3) (+)= the weight gradient of G (B, O, Ho, Wo) and x
/// ([`backward`] without dx). The caller checked [`applies`].
pub(super) fn weight_grad(g: &Geom, dw: &mut [f32], dy: &[f32], x: &[f32], overwrite: bool) {
    backward(g, dy, x, None, dw, overwrite);
}

/// dW (O, C, 3, 3) (+)= the weight gradient of G (B, O, Ho, Wo) and x, and
/// with W's U ([`pack`]) also dx (B, C, H, W), returned: in one pass over the chunks,
/// each chunk's dM transformed once for both. The same bits as
/// [`input_grad`] and dW alone: each chunk's sums are the same, and dx's
/// chunks are disjoint. Chunks in parallel each sum into their own dU,
/// added in order at the end (the same result on every run). The caller
/// checked [`applies`].
///
/// dU[ξ] += dM[ξ] · V[ξ]ᵀ runs on `sgemm` with dM read where it lies
/// (`sgemm::gemm_rows`). Measured on one Cascade Lake core, VGG16's
/// Winograd layers at batch 32, alternated in one process against the
/// `gemm` crate's strided GEMM: the GEMMs of 64 → 64
/// @ 32 17.9 → 11.9 ms, 128 → 128 @ 16 13.2 → 11.5, 512 → 512 @ 4 13.8 →
/// 14.9; the seven layers' weight gradients 112 → 103 ms a step. In a
/// one-core step's profile the weight gradient's GEMM and its packing
/// went from 16.6% to about 14%.
///
/// Both gradients in one pass, against [`input_grad`] and then dW alone
/// (the same core, alternated in one process, the
/// seven layers' backward at batch 32): one thread 219.5 → 210.0 ms,
/// 64 → 64 @ 32 46.5 → 43.3; two threads 122.8 → 121.4 in a quiet hour,
/// 161.4 → 153.6 in a noisy one.
pub(super) fn backward(
    g: &Geom,
    dy: &[f32],
    x: &[f32],
    u: Option<&PackedU>,
    dw: &mut [f32],
    overwrite: bool,
) -> Option<Vec<f32>> {
    let t = Tiles::of(g);
    let band = band_rows(g, &t, plan(g, &t).0);
    backward_in_bands(g, dy, x, u, dw, overwrite, band)
}

/// [`backward`] in bands of `band` tile rows where its chunks are one
/// image.
fn backward_in_bands(
    g: &Geom,
    dy: &[f32],
    x: &[f32],
    u: Option<&PackedU>,
    dw: &mut [f32],
    overwrite: bool,
    band: usize,
) -> Option<Vec<f32>> {
    use rayon::prelude::*;
    let t = Tiles::of(g);
    let oc = g.o * g.c;
    let per_dx = (g.c * g.h * g.w).max(1);
    // Every plane written whole by input_scatter (the tiles are added into
    // its own zeroed buffer first).
    let mut dx = u.map(|_| crate::kernels::unfilled(g.n * g.c * g.h * g.w, f32::NAN));
    if g.n == 0 {
        if overwrite {
            dw.fill(0.0);
        }
        return dx;
    }
    let micro = Micro::now().expect("applies() checked for a microkernel");
    let u = u.map(|u| &u.0);
    let (q, par) = plan(g, &t);
    // dU (+)= the chunk's dM · Vᵀ, per ξ; with U, the chunk's dx first.
    // Band by band of tile rows as the forward, x split once for the
    // bands and dx's tiles summed in split planes until all are in.
    let chunk = |b0: usize, mut dx: Option<&mut [f32]>, du: &mut [f32], accumulate: bool| {
        let q = q.min(g.n - b0);
        let banded = band < t.th;
        let mut split = banded.then(|| SplitChunk::of(g, &t, x, b0, q));
        let mut sums = (banded && dx.is_some()).then(|| SplitChunk::zeros(g, &t, q));
        let [mut mb, mut vb] = scratch::take::<f32>();
        for span in Span::bands(&t, b0, q, band) {
            let cols = span.cols(&t);
            let dm = sized_aligned(&mut mb, XI * xi_stride(g.o, cols));
            grad_transform(g, &t, dy, &span, dm);
            let v = sized_aligned(&mut vb, XI * xi_stride(g.c, cols));
            if let (Some(u), Some(part)) = (u, dx.as_deref_mut()) {
                // dV[ξ] = U[ξ]ᵀ · dM[ξ] into V's buffer, scattered into dx
                // before V is transformed there.
                gemms(u, true, dm, g.o, v, g.c, cols);
                input_scatter(g, &t, v, &span, part, sums.as_mut());
            }
            input_transform(g, &t, x, &span, v, split.as_mut());
            for xi in 0..XI {
                // dM[ξ] read where it lies; Vᵀ[ξ] (cols × C) has its
                // columns contiguous, packed by 8 × 8 transposes.
                let dm = sgemm::Rows {
                    a: &dm[xi * xi_stride(g.o, cols)..][..g.o * cols],
                    m: g.o,
                    k: cols,
                    lda: cols,
                };
                let vt = Matrix {
                    b: &v[xi * xi_stride(g.c, cols)..][..g.c * cols],
                    k: cols,
                    n: g.c,
                    layout: Layout::strided(1, cols),
                };
                let du = Out::rows(&mut du[xi * oc..][..oc], g.c);
                sgemm::gemm_rows(micro, dm, &vt, du, accumulate || span.rows.start > 0);
            }
        }
        if let (Some(sums), Some(part)) = (sums.as_mut(), dx) {
            sums.unsplit(g, &t, part);
        }
        scratch::give([mb, vb]);
    };
    let starts: Vec<usize> = (0..g.n).step_by(q).collect();
    // One dU per part (a fixed run of chunks on one thread; one part when
    // serial), kept on this thread between calls (16 MB each at
    // 512 → 512), summed in order into the first.
    let threads = crate::kernels::threads();
    let run = if par {
        starts.len().div_ceil(threads)
    } else {
        starts.len()
    };
    let parts = starts.len().div_ceil(run.max(1));
    let mut bufs = DU.with(|d| std::mem::take(&mut *d.borrow_mut()));
    bufs.resize_with(parts.max(bufs.len()), Vec::new);
    for b in &mut bufs[..parts] {
        // Every element is written by its part's first chunk; each dU
        // starts a cache line (the GEMMs' stores of C), at the same place
        // in its buffer from here on (`aligned`).
        sized_aligned(b, XI * oc);
    }
    // Each part's images of dx (none without W).
    let mut dx_parts: Vec<Option<&mut [f32]>> = match dx.as_mut() {
        Some(dx) => dx.chunks_mut(run * q * per_dx).map(Some).collect(),
        None => (0..parts).map(|_| None).collect(),
    };
    // One run of dx's images per part (the zips below would drop the rest).
    assert_eq!(dx_parts.len(), parts, "winograd: dx's parts");
    let part = |mine: &[usize], dx: Option<&mut [f32]>, acc: &mut Vec<f32>| {
        let mut dx = dx.map(|d| d.chunks_mut(q * per_dx));
        for (i, &b0) in mine.iter().enumerate() {
            let part = dx.as_mut().and_then(|d| d.next());
            chunk(b0, part, sized_aligned(acc, XI * oc), i > 0);
        }
    };
    if par {
        starts
            .par_chunks(run)
            .zip(dx_parts.par_iter_mut())
            .zip(bufs[..parts].par_iter_mut())
            .for_each(|((mine, dx), acc)| {
                crate::kernels::serial(|| part(mine, dx.as_deref_mut(), acc))
            });
    } else {
        part(&starts, dx_parts[0].as_deref_mut(), &mut bufs[0]);
    }
    drop(dx_parts);
    let (first, rest) = bufs.split_at_mut(1);
    let du = sized_aligned(&mut first[0], XI * oc);
    if parts > 1 {
        let piece = (XI * oc).div_ceil(threads).max(1 << 12);
        du.par_chunks_mut(piece).enumerate().for_each(|(i, out)| {
            for p in &rest[..parts - 1] {
                for (d, s) in out.iter_mut().zip(&aligned(p, XI * oc)[i * piece..]) {
                    *d += *s;
                }
            }
        });
    }
    // dW from dU, the kernels split over the threads (on this one when it
    // is alone).
    let du = &*du;
    if crate::kernels::threads_here() == 1 {
        weights_back(du, oc, 0, &mut dw[..oc * 9], overwrite);
    } else {
        let piece = kernels_per_task(oc);
        dw[..oc * 9]
            .par_chunks_mut(piece * 9)
            .enumerate()
            .for_each(|(i, dw)| weights_back(du, oc, i * piece, dw, overwrite));
    }
    DU.with(|d| *d.borrow_mut() = bufs);
    dx
}
