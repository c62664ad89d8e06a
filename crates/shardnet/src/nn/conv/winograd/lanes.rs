//! The input and output transforms on 16 tiles at a time, as fixed arrays
//! of lanes compiled for the CPU's widest vectors ([`dispatch!`]); where
//! the CPU has AVX-512, each block of 16 tiles runs on the intrinsics of
//! `x86/mod.rs` (the same operations in the same order: the same bits).

#![allow(clippy::needless_range_loop)] // indices mirror the transforms' matrices

use super::super::geom::Geom;
use super::planes::{split, unsplit, Planes, SplitChunk};
use super::{avx512, Span, Tiles, L, XI};
use crate::kernels::dispatch;
#[cfg(target_arch = "x86_64")]
use crate::kernels::winograd::runs::{bits, Run};
#[cfg(target_arch = "x86_64")]
use crate::kernels::winograd::x86;

/// One value per tile (or kernel) of a block.
pub(super) type Lanes = [f32; L];

/// `src[at..at + n]` (n ≤ L) as lanes, zero past n: a fixed-size copy
/// when whole (a short `copy_from_slice` calls `memcpy`).
#[inline(always)]
pub(super) fn load(src: &[f32], at: usize, n: usize) -> Lanes {
    let mut v = [0f32; L];
    if n == L {
        v.copy_from_slice(&src[at..at + L]);
    } else {
        for (d, s) in v.iter_mut().zip(&src[at..at + n]) {
            *d = *s;
        }
    }
    v
}

/// `dst[at..at + n]` = the first n lanes of `v`.
#[inline(always)]
fn store(dst: &mut [f32], at: usize, v: &Lanes, n: usize) {
    if n == L {
        dst[at..at + L].copy_from_slice(v);
    } else {
        for (d, s) in dst[at..at + n].iter_mut().zip(v) {
            *d = *s;
        }
    }
}

#[inline(always)]
fn add(a: &Lanes, b: &Lanes) -> Lanes {
    let mut v = [0f32; L];
    for i in 0..L {
        v[i] = a[i] + b[i];
    }
    v
}

#[inline(always)]
fn sub(a: &Lanes, b: &Lanes) -> Lanes {
    let mut v = [0f32; L];
    for i in 0..L {
        v[i] = a[i] - b[i];
    }
    v
}

#[inline(always)]
fn neg(a: &Lanes) -> Lanes {
    let mut v = [0f32; L];
    for i in 0..L {
        v[i] = -a[i];
    }
    v
}

/// Bᵀ v for four lane vectors: (v0 − v2, v1 + v2, v2 − v1, v1 − v3).
#[inline(always)]
fn tr_bt(v: [&Lanes; 4]) -> [Lanes; 4] {
    [
        sub(v[0], v[2]),
        add(v[1], v[2]),
        sub(v[2], v[1]),
        sub(v[1], v[3]),
    ]
}

/// B v (the transpose of [`tr_bt`]): (v0, v1 − v2 + v3, v1 + v2 − v0, −v3).
#[inline(always)]
fn tr_b(v: [&Lanes; 4]) -> [Lanes; 4] {
    [
        *v[0],
        add(&sub(v[1], v[2]), v[3]),
        sub(&add(v[1], v[2]), v[0]),
        neg(v[3]),
    ]
}

/// Aᵀ v: (v0 + v1 + v2, v1 − v2 − v3).
#[inline(always)]
fn tr_at(v: [&Lanes; 4]) -> [Lanes; 2] {
    [add(&add(v[0], v[1]), v[2]), sub(&sub(v[1], v[2]), v[3])]
}

/// A v (the transpose of [`tr_at`]): (v0, v0 + v1, v0 − v1, −v1).
#[inline(always)]
fn tr_a(v: [&Lanes; 2]) -> [Lanes; 4] {
    [*v[0], add(v[0], v[1]), sub(v[0], v[1]), neg(v[1])]
}

/// X (4 × 4 per lane) → Mᵀ X M, applying `f` (4 → 4) over the rows of
/// each column and then over the columns of each row: the 2-D transform
/// of the 1-D one.
#[inline(always)]
fn both4(x: &[[Lanes; 4]; 4], f: impl Fn([&Lanes; 4]) -> [Lanes; 4]) -> [[Lanes; 4]; 4] {
    let mut cols = [[[0f32; L]; 4]; 4];
    for j in 0..4 {
        cols[j] = f([&x[0][j], &x[1][j], &x[2][j], &x[3][j]]);
    }
    let mut out = [[[0f32; L]; 4]; 4];
    for a in 0..4 {
        out[a] = f([&cols[0][a], &cols[1][a], &cols[2][a], &cols[3][a]]);
    }
    out
}

/// A span's blocks of 16 tiles (in V's column order: image, tile row,
/// tile column) as runs: the same for every channel.
struct Spots {
    runs: Vec<Run>,
    /// Block k's runs: `runs[blocks[k]..blocks[k + 1]]`.
    blocks: Vec<usize>,
}

impl Spots {
    fn of(g: &Geom, t: &Tiles, span: &Span, channels: usize) -> Self {
        let (cols, per) = (span.cols(t), span.per_image(t));
        let (plane, r, hw) = (t.rows() * t.split_row(), t.split_row(), g.ho * g.wo);
        let mut s = Spots {
            runs: Vec::new(),
            blocks: vec![0],
        };
        let mut c0 = 0;
        while c0 < cols {
            let n = L.min(cols - c0);
            let mut lane = 0;
            while lane < n {
                let col = c0 + lane;
                let (b, j) = (col / per, col % per);
                let (ty, tx) = (span.rows.start + j / t.tw, j % t.tw);
                let len = (n - lane).min(t.tw - tx);
                let pixels = (2 * len).min(g.wo - 2 * tx);
                let (a, b_) = (2 * lane, 2 * lane + pixels);
                s.runs.push(Run {
                    lane,
                    len,
                    split: b * plane + 2 * ty * r + tx,
                    pixel: b * channels * hw + 2 * ty * g.wo + 2 * tx,
                    rows: if 2 * ty + 1 < g.ho { 2 } else { 1 },
                    pixels,
                    lanes: bits(lane, lane + len),
                    pixel_lanes: [
                        bits(a, b_),
                        bits(a.saturating_sub(16), b_.saturating_sub(16)),
                    ],
                });
                lane += len;
            }
            s.blocks.push(s.runs.len());
            c0 += n;
        }
        s
    }

    /// Block k's runs.
    #[inline(always)]
    fn block(&self, k: usize) -> &[Run] {
        &self.runs[self.range(k)]
    }

    /// Where block k's runs lie in `runs`.
    #[inline(always)]
    fn range(&self, k: usize) -> std::ops::Range<usize> {
        self.blocks[k]..self.blocks[k + 1]
    }
}

/// V (as [16][C][cols], the planes `xi_stride` apart) of the span's
/// tiles of x: from `split` when given (the span's images split already),
/// else split here channel by channel.
pub(super) fn input_transform(
    g: &Geom,
    t: &Tiles,
    x: &[f32],
    span: &Span,
    v: &mut [f32],
    split: Option<&mut SplitChunk>,
) {
    let spots = Spots::of(g, t, span, g.c);
    match split {
        Some(s) => {
            assert_eq!(s.q, span.q, "winograd: the split planes' images");
            dispatch!(|| input_planes(g, t, x, span, v, &mut s.p, &spots, false))
        }
        None => {
            // Each channel's planes are split into them before they are read.
            let mut p = Planes::new(t, span.q, 1, true);
            dispatch!(|| input_planes(g, t, x, span, v, &mut p, &spots, true))
        }
    }
}

/// V of the span from `p`'s planes: each channel's split into them first
/// (`split_here`; they hold one channel), or all split already.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn input_planes(
    g: &Geom,
    t: &Tiles,
    x: &[f32],
    span: &Span,
    v: &mut [f32],
    p: &mut Planes,
    spots: &Spots,
    split_here: bool,
) {
    let (cols, hw, plane, r, off) = (span.cols(t), g.h * g.w, p.plane, p.r, p.off);
    let (b0, q) = (span.b0, span.q);
    let xi_stride = super::xi_stride(g.c, cols);
    let wide = avx512();
    let channels = if split_here { 1 } else { g.c };
    // Every run's reads lie inside the chunk's split planes, every block's
    // writes inside V.
    assert!(p.eo.len() >= (channels - 1) * p.stride + q * plane && v.len() >= XI * xi_stride);
    // Whole images where each channel's planes are split here.
    assert!(
        !split_here || span.rows == (0..t.th),
        "winograd: the input transform splits whole images"
    );
    for c in 0..g.c {
        let base = if split_here {
            for b in 0..q {
                let src = &x[((b0 + b) * g.c + c) * hw..][..hw];
                split(g, t, src, &mut p.eo[b * plane..][..plane], &mut p.row);
            }
            0
        } else {
            c * p.stride
        };
        for (k, c0) in (0..cols).step_by(L).enumerate() {
            let (n, runs, at) = (L.min(cols - c0), spots.block(k), c * cols + c0);
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: AVX-512F is present; the runs lie inside eo's
                // planes of channel c and the block's n columns of each
                // V[ξ] inside v (asserted).
                unsafe {
                    x86::input_block(
                        p.eo.as_ptr().add(base),
                        r,
                        off,
                        runs,
                        v.as_mut_ptr().add(at),
                        xi_stride,
                        n,
                    )
                };
                continue;
            }
            let mut d = [[[0f32; L]; 4]; 4];
            for run in runs {
                for (i, di) in d.iter_mut().enumerate() {
                    for (j, dij) in di.iter_mut().enumerate() {
                        let src = &p.eo[base + run.split + i * r + off[j]..][..run.len];
                        dij[run.lane..run.lane + run.len].copy_from_slice(src);
                    }
                }
            }
            let vv = both4(&d, tr_bt);
            for a in 0..4 {
                for (j, lane) in vv[a].iter().enumerate() {
                    store(v, (4 * a + j) * xi_stride + at, lane, n);
                }
            }
        }
    }
}

/// The span's pixels of y's planes (`part`, the span's q images of O
/// planes) from M (as [16][O][cols], the planes `xi_stride` apart):
/// Aᵀ M A + bias.
pub(super) fn output_transform(
    g: &Geom,
    t: &Tiles,
    m: &[f32],
    span: &Span,
    bias: &[f32],
    part: &mut [f32],
) {
    let spots = Spots::of(g, t, span, g.o);
    dispatch!(|| output_planes(g, t, m, span, bias, part, &spots))
}

#[inline(always)]
fn output_planes(
    g: &Geom,
    t: &Tiles,
    m: &[f32],
    span: &Span,
    bias: &[f32],
    part: &mut [f32],
    spots: &Spots,
) {
    let (cols, hw, q) = (span.cols(t), g.ho * g.wo, span.q);
    let xi_stride = super::xi_stride(g.o, cols);
    let wide = avx512();
    assert!(part.len() >= q * g.o * hw && m.len() >= XI * xi_stride);
    for o in 0..g.o {
        let bo = bias.get(o).copied().unwrap_or(0.0);
        for (k, c0) in (0..cols).step_by(L).enumerate() {
            let (n, runs, from) = (L.min(cols - c0), spots.block(k), o * cols + c0);
            let y0 = o * hw;
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: AVX-512F is present; the block's n columns of each
                // M[ξ] lie inside m, the runs' pixels inside part (asserted).
                unsafe {
                    x86::output_block(
                        m.as_ptr().add(from),
                        xi_stride,
                        n,
                        bo,
                        runs,
                        part.as_mut_ptr().add(y0),
                        g.wo,
                    )
                };
                continue;
            }
            let mut mv = [[[0f32; L]; 4]; 4];
            for a in 0..4 {
                for j in 0..4 {
                    mv[a][j] = load(m, (4 * a + j) * xi_stride + from, n);
                }
            }
            // Aᵀ over the rows a for each column, then over the columns.
            let mut cols_ = [[[0f32; L]; 2]; 4];
            for j in 0..4 {
                cols_[j] = tr_at([&mv[0][j], &mv[1][j], &mv[2][j], &mv[3][j]]);
            }
            let mut y = [[[0f32; L]; 2]; 2];
            for i in 0..2 {
                y[i] = tr_at([&cols_[0][i], &cols_[1][i], &cols_[2][i], &cols_[3][i]]);
                for j in 0..2 {
                    for l in 0..L {
                        y[i][j][l] += bo;
                    }
                }
            }
            for run in runs {
                for (i, yi) in y.iter().enumerate().take(run.rows) {
                    let out = &mut part[y0 + run.pixel + i * g.wo..][..run.pixels];
                    for (x, px) in out.iter_mut().enumerate() {
                        *px = yi[x % 2][run.lane + x / 2];
                    }
                }
            }
        }
    }
}

/// dM (as [16][O][cols], the planes `xi_stride` apart) of the span's
/// tiles of dy: A dy Aᵀ per tile (pixels past Ho or Wo count as zero).
pub(super) fn grad_transform(g: &Geom, t: &Tiles, dy: &[f32], span: &Span, dm: &mut [f32]) {
    let spots = Spots::of(g, t, span, g.o);
    let chunk = &dy[span.b0 * g.o * g.ho * g.wo..][..span.q * g.o * g.ho * g.wo];
    dispatch!(|| grad_planes(g, t, chunk, span, dm, &spots))
}

#[inline(always)]
fn grad_planes(g: &Geom, t: &Tiles, dy: &[f32], span: &Span, dm: &mut [f32], spots: &Spots) {
    let (cols, hw, q) = (span.cols(t), g.ho * g.wo, span.q);
    let xi_stride = super::xi_stride(g.o, cols);
    let wide = avx512();
    assert!(dy.len() >= q * g.o * hw && dm.len() >= XI * xi_stride);
    for o in 0..g.o {
        for (k, c0) in (0..cols).step_by(L).enumerate() {
            let (n, runs, to) = (L.min(cols - c0), spots.block(k), o * cols + c0);
            let y0 = o * hw;
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: AVX-512F is present; the runs' pixels lie inside
                // dy, the block's n columns of each dM[ξ] inside dm
                // (asserted).
                unsafe {
                    x86::grad_block(
                        dy.as_ptr().add(y0),
                        g.wo,
                        runs,
                        dm.as_mut_ptr().add(to),
                        xi_stride,
                        n,
                    )
                };
                continue;
            }
            // dy's 2 × 2 per tile: rows i, columns j.
            let mut d = [[[0f32; L]; 2]; 2];
            for run in runs {
                for (i, di) in d.iter_mut().enumerate().take(run.rows) {
                    let src = &dy[y0 + run.pixel + i * g.wo..][..run.pixels];
                    for (x, px) in src.iter().enumerate() {
                        di[x % 2][run.lane + x / 2] = *px;
                    }
                }
            }
            // A over the rows i for each column j, then over j.
            let mut cols_ = [[[0f32; L]; 4]; 2];
            for j in 0..2 {
                cols_[j] = tr_a([&d[0][j], &d[1][j]]);
            }
            for a in 0..4 {
                let m4 = tr_a([&cols_[0][a], &cols_[1][a]]);
                for (j, lane) in m4.iter().enumerate() {
                    store(dm, (4 * a + j) * xi_stride + to, lane, n);
                }
            }
        }
    }
}

/// B dV Bᵀ per tile of the span, from dV (as [16][C][cols], the planes
/// `xi_stride` apart), the overlapping tiles' entries added: into `sums`
/// when given (the span a band of its images; written out by
/// [`SplitChunk::unsplit`]), else into dx's planes of the chunk (`part`,
/// the span's q whole images of C planes).
pub(super) fn input_scatter(
    g: &Geom,
    t: &Tiles,
    dv: &[f32],
    span: &Span,
    part: &mut [f32],
    sums: Option<&mut SplitChunk>,
) {
    let spots = Spots::of(g, t, span, g.c);
    match sums {
        Some(s) => {
            assert_eq!(s.q, span.q, "winograd: the summed planes' images");
            dispatch!(|| scatter_planes(g, t, dv, span, part, &mut s.p, &spots, false))
        }
        None => {
            // Zeroed for each channel.
            let mut p = Planes::new(t, span.q, 1, true);
            dispatch!(|| scatter_planes(g, t, dv, span, part, &mut p, &spots, true))
        }
    }
}

/// The scatter into `p`: one channel at a time, each written into `part`
/// once its tiles are in (`write_here`; the span whole images), or into
/// every channel's planes.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn scatter_planes(
    g: &Geom,
    t: &Tiles,
    dv: &[f32],
    span: &Span,
    part: &mut [f32],
    p: &mut Planes,
    spots: &Spots,
    write_here: bool,
) {
    let (cols, hw, plane, r, off) = (span.cols(t), g.h * g.w, p.plane, p.r, p.off);
    let q = span.q;
    // Whole images where each plane is written once its tiles are added.
    assert!(
        !write_here || span.rows == (0..t.th),
        "winograd: the input scatter into dx takes whole images"
    );
    let channels = if write_here { 1 } else { g.c };
    let xi_stride = super::xi_stride(g.c, cols);
    let wide = avx512();
    assert!(p.eo.len() >= (channels - 1) * p.stride + q * plane + L && dv.len() >= XI * xi_stride);
    #[cfg(target_arch = "x86_64")]
    let short = if wide {
        x86::short_adds(&spots.runs, r, off)
    } else {
        Vec::new()
    };
    for c in 0..g.c {
        let base = if write_here {
            p.eo.fill(0.0);
            0
        } else {
            c * p.stride
        };
        for (k, c0) in (0..cols).step_by(L).enumerate() {
            let (n, runs, from) = (L.min(cols - c0), spots.block(k), c * cols + c0);
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: AVX-512F is present; the block's n columns of
                // each dV[ξ] lie inside dv, the runs inside eo's q planes
                // of channel c and so every whole vector holding one of
                // their elements inside eo (one vector of slack past the
                // last channel's: asserted).
                unsafe {
                    x86::scatter_block(
                        dv.as_ptr().add(from),
                        xi_stride,
                        n,
                        p.eo.as_mut_ptr().add(base),
                        r,
                        off,
                        runs,
                        &short[spots.range(k)],
                    )
                };
                continue;
            }
            let mut vv = [[[0f32; L]; 4]; 4];
            for a in 0..4 {
                for j in 0..4 {
                    vv[a][j] = load(dv, (4 * a + j) * xi_stride + from, n);
                }
            }
            let dd = both4(&vv, tr_b);
            // Run by run; in each, row by row, columns 0 to 3: a tile's
            // columns 2 and 3 land on the next tile's 0 and 1, added after.
            for run in runs {
                for (i, ddi) in dd.iter().enumerate() {
                    for (j, ddij) in ddi.iter().enumerate() {
                        let at = base + run.split + i * r + off[j];
                        for (e, v) in p.eo[at..at + run.len].iter_mut().zip(&ddij[run.lane..]) {
                            *e += *v;
                        }
                    }
                }
            }
        }
        if write_here {
            for b in 0..q {
                let dst = &mut part[(b * g.c + c) * hw..][..hw];
                unsplit(g, t, &p.eo[b * plane..][..plane], dst, &mut p.row);
            }
        }
    }
}
