//! The split form of a plane (`super::super::planes`) on AVX-512: each
//! padded row's even and odd columns by two-source permutes, and back.
//! Needs AVX-512F, as the parent's blocks.

use super::super::runs::bits as lanes;
use super::{HI, LO};
use crate::avx512::{idx, mask, EVEN, ODD};
use std::arch::x86_64::*;

/// Blocks of 16 split columns whose masks are worked out once for every
/// row of a plane: the masks' arithmetic, done row by row, had cost more
/// than the loads, permutes and stores (about 80 cycles a padded row of
/// 32 × 32 against 18). A plane of one block (padded widths to 32) takes
/// it alone, with no array of blocks to set up: planes of 4 × 4 are a few
/// rows each.
const GROUP: usize = 8;

/// One block of a split row: split columns j0..j0 + 16 (`keep` of them
/// inside the row), from padded columns 2·j0 .. 2·j0 + 32, which are the
/// image row's columns `start..start + 32` (`lo` and `hi` the lanes of
/// each half that lie inside it).
#[derive(Clone, Copy)]
struct SplitBlock {
    j0: usize,
    start: isize,
    lo: __mmask16,
    hi: __mmask16,
    keep: __mmask16,
}

impl SplitBlock {
    /// Split columns j0.. of a padded row (`half` split columns each
    /// way) of an image row w long, padded by p.
    #[inline(always)]
    fn at(j0: usize, w: usize, p: usize, half: usize) -> Self {
        let valid = |first: isize| -> __mmask16 {
            let lo = (-first).clamp(0, 16) as usize;
            let hi = (w as isize - first).clamp(0, 16) as usize;
            lanes(lo, hi)
        };
        let start = (2 * j0) as isize - p as isize;
        SplitBlock {
            j0,
            start,
            lo: valid(start),
            hi: valid(start + 16),
            keep: mask(half - j0),
        }
    }
}

/// A plane (`plane`, rows of w) zero-padded by p into its split form `eo`:
/// padded row yp at `eo[yp·2·half..]`, its even columns then its odd
/// (`half` each), padded column k being `plane[y][k − p]` inside the
/// image, else 0. Every element of `eo`'s whole rows is written.
#[target_feature(enable = "avx512f")]
pub unsafe fn split_plane(plane: &[f32], w: usize, p: usize, half: usize, eo: &mut [f32]) {
    in_groups(
        half,
        16,
        |j0| SplitBlock::at(j0, w, p, half),
        |blocks| split_rows(plane, w, p, half, eo, blocks),
    );
}

/// `rows` over blocks of `step` columns covering `len`, each block set up
/// by `at` (its first column) once: a group of up to [`GROUP`] at a time,
/// or one block alone where it covers them all.
#[inline(always)]
fn in_groups<B: Copy>(
    len: usize,
    step: usize,
    at: impl Fn(usize) -> B,
    mut rows: impl FnMut(&[B]),
) {
    if len <= step {
        rows(&[at(0)]);
        return;
    }
    let mut g0 = 0;
    while g0 < len {
        let nb = (len - g0).div_ceil(step).min(GROUP);
        // Blocks past nb (not used) start inside the row too.
        let blocks: [B; GROUP] = std::array::from_fn(|i| at((g0 + step * i).min(len - 1)));
        rows(&blocks[..nb]);
        g0 += step * nb;
    }
}

/// [`split_plane`]'s `blocks` of every row.
#[target_feature(enable = "avx512f")]
unsafe fn split_rows(
    plane: &[f32],
    w: usize,
    p: usize,
    half: usize,
    eo: &mut [f32],
    blocks: &[SplitBlock],
) {
    let (ev, od) = (idx(&EVEN), idx(&ODD));
    let h = plane.len() / w.max(1);
    for (yp, out) in eo.chunks_exact_mut(2 * half).enumerate() {
        let y = yp.wrapping_sub(p);
        let dst = out.as_mut_ptr();
        for b in blocks {
            let (lo, hi) = if y < h {
                let base = plane.as_ptr().wrapping_add(y * w).wrapping_offset(b.start);
                (
                    _mm512_maskz_loadu_ps(b.lo, base),
                    _mm512_maskz_loadu_ps(b.hi, base.wrapping_add(16)),
                )
            } else {
                (_mm512_setzero_ps(), _mm512_setzero_ps())
            };
            let e = _mm512_permutex2var_ps(lo, ev, hi);
            let o = _mm512_permutex2var_ps(lo, od, hi);
            _mm512_mask_storeu_ps(dst.add(b.j0), b.keep, e);
            _mm512_mask_storeu_ps(dst.add(half + b.j0), b.keep, o);
        }
    }
}

/// One block of an image row's 32 columns x0..x0 + 32 (`lo`/`hi` the
/// lanes of each half inside the row) from its padded row's split
/// columns: (even, odd) from j when x0 + p is even, (odd, even) from
/// (j, j1 = j + 1) when odd; `first`/`second` the lanes of each run
/// inside the split row.
#[derive(Clone, Copy)]
struct UnsplitBlock {
    x0: usize,
    odd: bool,
    j: usize,
    j1: usize,
    first: __mmask16,
    second: __mmask16,
    lo: __mmask16,
    hi: __mmask16,
}

impl UnsplitBlock {
    /// Columns x0.. of an image row w long, padded by p (`half` split
    /// columns each way).
    #[inline(always)]
    fn at(x0: usize, w: usize, p: usize, half: usize) -> Self {
        let k0 = x0 + p;
        let (j, odd) = (k0 / 2, k0 % 2 == 1);
        let j1 = j + odd as usize;
        let n = w.saturating_sub(x0).min(32);
        UnsplitBlock {
            x0,
            odd,
            j,
            j1,
            first: mask(half.saturating_sub(j)),
            second: mask(half.saturating_sub(j1)),
            lo: mask(n),
            hi: mask(n.saturating_sub(16)),
        }
    }
}

/// The image's rows (`plane`, rows of w) from the split form `eo` (as
/// [`split_plane`] writes it): plane\[y\]\[x\] is padded column x + p of
/// padded row y + p.
#[target_feature(enable = "avx512f")]
pub unsafe fn unsplit_plane(eo: &[f32], w: usize, p: usize, half: usize, plane: &mut [f32]) {
    in_groups(
        w,
        32,
        |x0| UnsplitBlock::at(x0, w, p, half),
        |blocks| unsplit_rows(eo, w, p, half, plane, blocks),
    );
}

/// [`unsplit_plane`]'s `blocks` of every row.
#[target_feature(enable = "avx512f")]
unsafe fn unsplit_rows(
    eo: &[f32],
    w: usize,
    p: usize,
    half: usize,
    plane: &mut [f32],
    blocks: &[UnsplitBlock],
) {
    let (lo_i, hi_i) = (idx(&LO), idx(&HI));
    let h = plane.len() / w.max(1);
    for y in 0..h {
        let row = eo[(y + p) * 2 * half..][..2 * half].as_ptr();
        let (e, o) = (row, row.wrapping_add(half));
        let dst = plane.as_mut_ptr().add(y * w);
        for b in blocks {
            let (first, second) = if b.odd { (o, e) } else { (e, o) };
            let f = _mm512_maskz_loadu_ps(b.first, first.wrapping_add(b.j));
            let s = _mm512_maskz_loadu_ps(b.second, second.wrapping_add(b.j1));
            let d = dst.add(b.x0);
            _mm512_mask_storeu_ps(d, b.lo, _mm512_permutex2var_ps(f, lo_i, s));
            if b.hi != 0 {
                _mm512_mask_storeu_ps(d.add(16), b.hi, _mm512_permutex2var_ps(f, hi_i, s));
            }
        }
    }
}
