//! im2col and col2im: the patch matrix of a chunk of images (or of one
//! image's band of output rows), and its mirror that adds a patch
//! matrix's gradient back into the images.

use super::geom::{Geom, Rows};
use crate::kernels::Float;

/// Fill `col` (CKK, q·|rows|·Wo) with the patches of images `b0..b0 + q`
/// under output rows `rows` (all of them unless q = 1).
pub(super) fn im2col<T: Float>(g: &Geom, x: &[T], b0: usize, q: usize, rows: Rows, col: &mut [T]) {
    let hw = rows.len() * g.wo;
    let cols = q * hw;
    let image = g.c * g.h * g.w;
    for c in 0..g.c {
        for i in 0..g.kh {
            for j in 0..g.kw {
                let row = &mut col[((c * g.kh + i) * g.kw + j) * cols..][..cols];
                for b in 0..q {
                    let plane = &x[(b0 + b) * image + c * g.h * g.w..][..g.h * g.w];
                    let out = &mut row[b * hw..][..hw];
                    fill_patch_row(g, plane, i, j, rows.clone(), out);
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

/// Row (i, j) of one image's patches under output rows `rows`:
/// out[(oy − rows.start)·Wo + ox] = plane[iy, ix].
fn fill_patch_row<T: Float>(g: &Geom, plane: &[T], i: usize, j: usize, rows: Rows, out: &mut [T]) {
    let (lo, hi) = valid_columns(g, j);
    let first = rows.start;
    for oy in rows {
        let line = &mut out[(oy - first) * g.wo..][..g.wo];
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
pub(super) fn col2im<T: Float>(
    g: &Geom,
    dcol: &[T],
    b0: usize,
    q: usize,
    rows: Rows,
    dx: &mut [T],
) {
    let hw = rows.len() * g.wo;
    let cols = q * hw;
    let image = g.c * g.h * g.w;
    for b in 0..q {
        for c in 0..g.c {
            let plane = &mut dx[(b0 + b) * image + c * g.h * g.w..][..g.h * g.w];
            for i in 0..g.kh {
                for j in 0..g.kw {
                    let row = &dcol[((c * g.kh + i) * g.kw + j) * cols + b * hw..][..hw];
                    add_patch_row(g, row, i, j, rows.clone(), plane);
                }
            }
        }
    }
}

/// plane[iy, ix] += row[(oy − rows.start)·Wo + ox] for the valid pixels
/// under output rows `rows`.
fn add_patch_row<T: Float>(g: &Geom, row: &[T], i: usize, j: usize, rows: Rows, plane: &mut [T]) {
    let (lo, hi) = valid_columns(g, j);
    if lo >= hi {
        return;
    }
    let first = rows.start;
    for oy in rows {
        let iy = (oy * g.s + i) as isize - g.p as isize;
        if iy < 0 || iy >= g.h as isize {
            continue;
        }
        let dst = &mut plane[iy as usize * g.w..][..g.w];
        let line = &row[(oy - first) * g.wo..][..g.wo];
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
