//! The weights' transforms: U = G w Gᵀ written straight into `sgemm`'s
//! packed A, and dW = Gᵀ dU G back from the GEMMs' dU.

#![allow(clippy::needless_range_loop)] // indices mirror the transforms' matrices

use super::super::geom::Geom;
use super::avx512;
use super::lanes::{load, Lanes};
use super::{L, XI};
use crate::kernels::dispatch;
use crate::kernels::sgemm::Place;

/// Gᵀ v (the transpose of G, whose rows are (1, 0, 0), (½, ½, ½),
/// (½, −½, ½), (0, 0, 1)): (v0 + (v1 + v2)/2, (v1 − v2)/2,
/// (v1 + v2)/2 + v3).
#[inline(always)]
fn tr_gt(v: [&Lanes; 4]) -> [Lanes; 3] {
    let mut out = [[0f32; L]; 3];
    for l in 0..L {
        let h = (v[1][l] + v[2][l]) * 0.5;
        out[0][l] = v[0][l] + h;
        out[1][l] = (v[1][l] - v[2][l]) * 0.5;
        out[2][l] = h + v[3][l];
    }
    out
}

/// The 16 packed U[ξ] that several threads write at once,
/// each thread its own strips ([`pack_weights`]); `len` floats each.
pub(super) struct Targets {
    pub(super) at: [*mut f32; XI],
    pub(super) len: usize,
}

// SAFETY: the threads write disjoint strips of each buffer (pack_weights'
// caller gives each a disjoint range), and the buffers outlive the writes.
unsafe impl Sync for Targets {}

/// U[ξ] = G w Gᵀ of strips `strips` written straight into their packed A
/// (`place`): A = U[ξ] (rows o, depth c), which the forward reads as A and
/// the input gradient across as Uᵀ (`sgemm::gemm_transposed`). Column by
/// column of each strip, the strip's MR kernels at once
/// (`x86::pack_column`); w read in order, each strip's MR rows along c.
pub(super) fn pack_weights(
    g: &Geom,
    w: &[f32],
    place: Place,
    strips: std::ops::Range<usize>,
    out: &Targets,
) {
    let mr = place.mr;
    assert!(mr == 6 && w.len() >= g.o * g.c * 9 && place.len() <= out.len);
    assert!(strips.end <= place.strips);
    // Kernel (row i0 + r, depth j) lies at w[(i0 + r)·C·9 + j·9].
    let at: [usize; 6] = std::array::from_fn(|r| r * g.c * 9);
    for s in strips {
        let i0 = s * mr;
        let live = mr.min(g.o - i0);
        for j in 0..g.c {
            let from = i0 * g.c * 9 + j * 9;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 is present (the sgemm microkernel this path
            // needs); the live kernels' taps lie inside w (rows < O, j <
            // C), and place.at(s, 5, j) < place.len() ≤ out.len (asserted,
            // MR = 6); this strip's places are written by this call
            // alone.
            unsafe {
                crate::kernels::winograd::x86::pack_column(
                    w.as_ptr().add(from),
                    at,
                    live,
                    &out.at,
                    place.at(s, 0, j),
                )
            };
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!(
                "Winograd's path runs only where sgemm has a microkernel ({from}, {live})"
            );
        }
    }
}

/// dW (+)= Gᵀ dU G for the kernels of `dw` (9 taps each), the first at
/// `k0` of dU (as [16][`oc`]).
pub(super) fn weights_back(du: &[f32], oc: usize, k0: usize, dw: &mut [f32], overwrite: bool) {
    dispatch!(|| weights_back_lanes(du, oc, k0, dw, overwrite))
}

/// [`weights_back`], 16 kernels a time.
#[inline(always)]
fn weights_back_lanes(du: &[f32], oc: usize, first: usize, dw: &mut [f32], overwrite: bool) {
    let kernels = dw.len() / 9;
    assert!(du.len() >= XI * oc && first + kernels <= oc);
    let wide = avx512();
    let mut k0 = 0;
    while k0 < kernels {
        let n = L.min(kernels - k0);
        #[cfg(target_arch = "x86_64")]
        if wide {
            // SAFETY: AVX-512F is present (avx512()); dU[ξ] of kernels
            // first + k0 .. + n lie inside du (asserted: first + kernels ≤
            // oc, 16·oc floats), and their 9·n taps inside dw.
            unsafe {
                crate::kernels::winograd::x86::weights_back_block(
                    du.as_ptr().add(first + k0),
                    oc,
                    n,
                    dw.as_mut_ptr().add(k0 * 9),
                    overwrite,
                )
            };
            k0 += n;
            continue;
        }
        let mut m = [[[0f32; L]; 4]; 4];
        for a in 0..4 {
            for b in 0..4 {
                m[a][b] = load(du, (4 * a + b) * oc + first + k0, n);
            }
        }
        // Gᵀ over the rows a (for each column b), then over the columns.
        let mut cols = [[[0f32; L]; 3]; 4];
        for (b, col) in cols.iter_mut().enumerate() {
            *col = tr_gt([&m[0][b], &m[1][b], &m[2][b], &m[3][b]]);
        }
        for i in 0..3 {
            let row = tr_gt([&cols[0][i], &cols[1][i], &cols[2][i], &cols[3][i]]);
            for l in 0..n {
                let out = &mut dw[(k0 + l) * 9 + 3 * i..][..3];
                for (j, d) in out.iter_mut().enumerate() {
                    *d = if overwrite { row[j][l] } else { *d + row[j][l] };
                }
            }
        }
        k0 += n;
    }
}
