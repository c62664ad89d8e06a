//! AVX-512 blocks of 16 tiles on one row of tiles: the same operations in
//! the same order as `lanes.rs`'s arrays (so the same bits), held in
//! registers. Beside them, as the parent lays out its concepts: the split
//! form of the planes by two-source permutes (`planes.rs`) and the
//! weights' transforms (`weights.rs`).
//!
//! Every function needs AVX-512F (the caller checks
//! [`crate::simd_level`]) and reads and writes only the ranges its
//! documentation names.

#![allow(clippy::needless_range_loop)] // indices mirror the transforms' matrices

mod planes;
mod weights;

pub use planes::{split_plane, unsplit_plane};
pub use weights::{pack_column, weights_back_block};

use super::runs::{bits as lanes, Run};
use crate::avx512::{idx, mask, EVEN, ODD};
use std::arch::x86_64::*;

/// (a0, b0, a1, b1, ..) in two halves.
const LO: [i32; 16] = [0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23];
const HI: [i32; 16] = [8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31];

#[inline(always)]
unsafe fn neg(v: __m512) -> __m512 {
    _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(v),
        _mm512_set1_epi32(i32::MIN),
    ))
}

/// Bᵀ v: (v0 − v2, v1 + v2, v2 − v1, v1 − v3).
#[inline(always)]
unsafe fn bt(v: [__m512; 4]) -> [__m512; 4] {
    [
        _mm512_sub_ps(v[0], v[2]),
        _mm512_add_ps(v[1], v[2]),
        _mm512_sub_ps(v[2], v[1]),
        _mm512_sub_ps(v[1], v[3]),
    ]
}

/// B v: (v0, v1 − v2 + v3, v1 + v2 − v0, −v3).
#[inline(always)]
unsafe fn b(v: [__m512; 4]) -> [__m512; 4] {
    [
        v[0],
        _mm512_add_ps(_mm512_sub_ps(v[1], v[2]), v[3]),
        _mm512_sub_ps(_mm512_add_ps(v[1], v[2]), v[0]),
        neg(v[3]),
    ]
}

/// Aᵀ v: (v0 + v1 + v2, v1 − v2 − v3).
#[inline(always)]
unsafe fn at(v: [__m512; 4]) -> [__m512; 2] {
    [
        _mm512_add_ps(_mm512_add_ps(v[0], v[1]), v[2]),
        _mm512_sub_ps(_mm512_sub_ps(v[1], v[2]), v[3]),
    ]
}

/// A v: (v0, v0 + v1, v0 − v1, −v1).
#[inline(always)]
unsafe fn a(v: [__m512; 2]) -> [__m512; 4] {
    [
        v[0],
        _mm512_add_ps(v[0], v[1]),
        _mm512_sub_ps(v[0], v[1]),
        neg(v[1]),
    ]
}

/// A run's lanes.
#[inline(always)]
fn of(run: &Run) -> __mmask16 {
    run.lanes
}

/// V of a block's n tiles (its `runs`) into `v + ξ·xi_stride` (n floats
/// each): each tile's 4 × 4 input is rows `split + i·r`, columns
/// `split + i·r + off[j]`, of the split planes at `eo`.
#[target_feature(enable = "avx512f")]
pub unsafe fn input_block(
    eo: *const f32,
    r: usize,
    off: [usize; 4],
    runs: &[Run],
    v: *mut f32,
    xi_stride: usize,
    n: usize,
) {
    // The tiles' 4 × 4 inputs, run by run (one pass over the runs, every
    // index below constant: the 16 vectors stay in registers).
    let mut d = [[_mm512_setzero_ps(); 4]; 4];
    for run in runs {
        let k = of(run);
        let base = eo.add(run.split).wrapping_sub(run.lane);
        for i in 0..4 {
            for j in 0..4 {
                d[i][j] = _mm512_mask_loadu_ps(d[i][j], k, base.wrapping_add(i * r + off[j]));
            }
        }
    }
    let cols = [
        bt([d[0][0], d[1][0], d[2][0], d[3][0]]),
        bt([d[0][1], d[1][1], d[2][1], d[3][1]]),
        bt([d[0][2], d[1][2], d[2][2], d[3][2]]),
        bt([d[0][3], d[1][3], d[2][3], d[3][3]]),
    ];
    for a_ in 0..4 {
        let row = bt([cols[0][a_], cols[1][a_], cols[2][a_], cols[3][a_]]);
        for (j, lane) in row.iter().enumerate() {
            _mm512_mask_storeu_ps(v.add((4 * a_ + j) * xi_stride), mask(n), *lane);
        }
    }
}

/// A block's n tiles' outputs Aᵀ M A + `bias` from M\[ξ\] at `m + ξ·xi_stride`
/// into the plane at `y` (rows `wo` apart): each run's `rows` × `pixels`
/// from `pixel`.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn output_block(
    m: *const f32,
    xi_stride: usize,
    n: usize,
    bias: f32,
    runs: &[Run],
    y: *mut f32,
    wo: usize,
) {
    let ld = |xi: usize| _mm512_maskz_loadu_ps(mask(n), m.add(xi * xi_stride));
    let mut cols = [[_mm512_setzero_ps(); 2]; 4];
    for (j, col) in cols.iter_mut().enumerate() {
        *col = at([ld(j), ld(4 + j), ld(8 + j), ld(12 + j)]);
    }
    let bo = _mm512_set1_ps(bias);
    let (lo_i, hi_i) = (idx(&LO), idx(&HI));
    for i in 0..2 {
        let yi = at([cols[0][i], cols[1][i], cols[2][i], cols[3][i]]);
        let (y0, y1) = (_mm512_add_ps(yi[0], bo), _mm512_add_ps(yi[1], bo));
        let (lo, hi) = (
            _mm512_permutex2var_ps(y0, lo_i, y1),
            _mm512_permutex2var_ps(y0, hi_i, y1),
        );
        for run in runs.iter().filter(|run| i < run.rows) {
            // The run's pixels are lanes 2·lane .. 2·lane + pixels of (lo, hi).
            let a_ = 2 * run.lane;
            let dst = y.add(run.pixel + i * wo).wrapping_sub(a_);
            _mm512_mask_storeu_ps(dst, run.pixel_lanes[0], lo);
            _mm512_mask_storeu_ps(dst.wrapping_add(16), run.pixel_lanes[1], hi);
        }
    }
}

/// dM\[ξ\] of a block's n tiles into `dm + ξ·xi_stride` from dy's plane at
/// `dy` (rows `wo` apart; each run's `rows` × `pixels` from `pixel`, the
/// rest zero): A dy Aᵀ.
#[target_feature(enable = "avx512f")]
pub unsafe fn grad_block(
    dy: *const f32,
    wo: usize,
    runs: &[Run],
    dm: *mut f32,
    xi_stride: usize,
    n: usize,
) {
    let (ev, od) = (idx(&EVEN), idx(&ODD));
    // One pass over the runs, every index below constant (the vectors
    // stay in registers).
    let (mut lo, mut hi) = ([_mm512_setzero_ps(); 2], [_mm512_setzero_ps(); 2]);
    for run in runs {
        let a_ = 2 * run.lane;
        let [kl, kh] = run.pixel_lanes;
        for i in 0..2 {
            if i < run.rows {
                let src = dy.add(run.pixel + i * wo).wrapping_sub(a_);
                lo[i] = _mm512_mask_loadu_ps(lo[i], kl, src);
                hi[i] = _mm512_mask_loadu_ps(hi[i], kh, src.wrapping_add(16));
            }
        }
    }
    let d = [
        [
            _mm512_permutex2var_ps(lo[0], ev, hi[0]),
            _mm512_permutex2var_ps(lo[0], od, hi[0]),
        ],
        [
            _mm512_permutex2var_ps(lo[1], ev, hi[1]),
            _mm512_permutex2var_ps(lo[1], od, hi[1]),
        ],
    ];
    let cols = [a([d[0][0], d[1][0]]), a([d[0][1], d[1][1]])];
    for a_ in 0..4 {
        let m4 = a([cols[0][a_], cols[1][a_]]);
        for (j, lane) in m4.iter().enumerate() {
            _mm512_mask_storeu_ps(dm.add((4 * a_ + j) * xi_stride), mask(n), *lane);
        }
    }
}

/// Lane `l` of `v`.
#[inline(always)]
unsafe fn lane(v: __m512, l: usize) -> f32 {
    _mm_cvtss_f32(_mm512_castps512_ps128(_mm512_permutexvar_ps(
        _mm512_set1_epi32(l as i32),
        v,
    )))
}

/// B dV Bᵀ of a block's n tiles (dV\[ξ\] at `dv + ξ·xi_stride`) added into
/// the split planes at `eo` (64-byte aligned, and a vector of slack past
/// the runs' last element): run by run, row by row
/// (`split + i·r`), each tile's columns 0 and 1 at E\[t\], O\[t\] and then 2
/// and 3 at E[t + 1], O[t + 1] (`off`): the order `lanes.rs` adds them in.
///
/// A shorter run (planes of fewer than 32 columns) adds by whole aligned
/// vectors of `eo`, its terms moved to their lanes by permutes: there a
/// masked load overlapped the masked or scalar store just before it (rows
/// of a few floats) and waited for that store to reach the cache, where a
/// whole vector stored and loaded again is forwarded. Measured, one
/// thread, a chunk's scatter: 512 → 512 @ 4 1.87 → 0.72 ms, 256 → 256 @ 8
/// 0.83 → 0.40; at 32 × 32 the masked way's 0.052 against 0.093. Where
/// each short run's terms land (`short`, one entry per run) is worked
/// out once per call ([`short_adds`]): one thread, batch 32, the
/// scatters of 128 → 128 @ 16 4.0–4.2 → 2.7 ms, 256 → 256 @ 8 3.3–3.4 →
/// 2.5, 512 → 512 @ 4 3.1–3.3 → 2.4.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn scatter_block(
    dv: *const f32,
    xi_stride: usize,
    n: usize,
    eo: *mut f32,
    r: usize,
    off: [usize; 4],
    runs: &[Run],
    short: &[[ShortAdd; 8]],
) {
    let ld = |xi: usize| _mm512_maskz_loadu_ps(mask(n), dv.add(xi * xi_stride));
    let mut cols = [[_mm512_setzero_ps(); 4]; 4];
    for (j, col) in cols.iter_mut().enumerate() {
        *col = b([ld(j), ld(4 + j), ld(8 + j), ld(12 + j)]);
    }
    let dd = [
        b([cols[0][0], cols[1][0], cols[2][0], cols[3][0]]),
        b([cols[0][1], cols[1][1], cols[2][1], cols[3][1]]),
        b([cols[0][2], cols[1][2], cols[2][2], cols[3][2]]),
        b([cols[0][3], cols[1][3], cols[2][3], cols[3][3]]),
    ];
    let iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    // Up by one lane: lane l + 1 ← lane l.
    let up = _mm512_set_epi32(14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0);
    for (run, adds) in runs.iter().zip(short) {
        if run.len == 16 {
            // A whole block on one row of tiles (planes of 32 columns and
            // more): masked, and the far term's last lane after.
            let (m, rest) = (of(run), of(run) & !lanes(run.lane, run.lane + 1));
            for (i, ddi) in dd.iter().enumerate() {
                for (near, far, k) in [(ddi[0], ddi[2], off[0]), (ddi[1], ddi[3], off[1])] {
                    let at = eo.add(run.split + i * r + k);
                    let base = at.wrapping_sub(run.lane);
                    let t = _mm512_add_ps(_mm512_maskz_loadu_ps(m, base), near);
                    let t = _mm512_mask_add_ps(t, rest, t, _mm512_permutexvar_ps(up, far));
                    _mm512_mask_storeu_ps(base, m, t);
                    *at.add(run.len) += lane(far, run.lane + run.len - 1);
                }
            }
            continue;
        }
        for (i, ddi) in dd.iter().enumerate() {
            for (pair, (near, far)) in [(ddi[0], ddi[2]), (ddi[1], ddi[3])].into_iter().enumerate()
            {
                let s = &adds[2 * i + pair];
                let to = |d: i32| _mm512_sub_epi32(iota, _mm512_set1_epi32(d));
                let at = eo.add(s.at);
                let t = _mm512_loadu_ps(at);
                let t = _mm512_mask_add_ps(t, s.near, t, _mm512_permutexvar_ps(to(s.shift), near));
                let t =
                    _mm512_mask_add_ps(t, s.far, t, _mm512_permutexvar_ps(to(s.shift + 1), far));
                _mm512_storeu_ps(at, t);
                if s.near_hi | s.far_hi != 0 {
                    // The rest in the next vector: lanes 0.. of it.
                    let at = at.add(16);
                    let t = _mm512_loadu_ps(at);
                    let t = _mm512_mask_add_ps(
                        t,
                        s.near_hi,
                        t,
                        _mm512_permutexvar_ps(to(s.shift - 16), near),
                    );
                    let t = _mm512_mask_add_ps(
                        t,
                        s.far_hi,
                        t,
                        _mm512_permutexvar_ps(to(s.shift - 15), far),
                    );
                    _mm512_storeu_ps(at, t);
                }
            }
        }
    }
}

/// Where one row of a short run's tiles (fewer than 16: planes of fewer
/// than 32 columns) adds a pair of its columns ((0, 2) or (1, 3)) into
/// the split planes: the whole vector at `at` (floats from the planes'
/// start, a multiple of 16), near's lanes moved up by `shift` into lanes
/// `near`, far's by `shift + 1` into `far`, and the rest into the vector
/// after (`near_hi`, `far_hi`; none when both are empty). The same for
/// every channel (each channel's planes start on a vector), so worked out
/// once per call: their arithmetic, done for each channel, had cost as
/// much as the adds.
#[derive(Clone, Copy, Default)]
pub struct ShortAdd {
    at: usize,
    shift: i32,
    near: __mmask16,
    far: __mmask16,
    near_hi: __mmask16,
    far_hi: __mmask16,
}

/// Each short run's [`ShortAdd`]s, rows i = 0..4 and pairs (0, 2), (1, 3)
/// at 2i + pair (whole runs of 16 get none: [`scatter_block`] adds them
/// its own way), for runs of split planes whose rows are `r` apart, a
/// tile's columns at `off`.
pub fn short_adds(runs: &[Run], r: usize, off: [usize; 4]) -> Vec<[ShortAdd; 8]> {
    runs.iter()
        .map(|run| {
            let mut out = [ShortAdd::default(); 8];
            if run.len == 16 {
                return out;
            }
            for i in 0..4 {
                for (pair, k) in [off[0], off[1]].into_iter().enumerate() {
                    // The run's first element, in vector v0 at lane s0:
                    // near's lanes lane.. go to lanes s0.. (and on into
                    // v0 + 1), far's one further.
                    let e0 = run.split + i * r + k;
                    let (v0, s0) = (e0 / 16, e0 % 16);
                    let end = s0 + run.len;
                    out[2 * i + pair] = ShortAdd {
                        at: 16 * v0,
                        shift: s0 as i32 - run.lane as i32,
                        near: lanes(s0, end),
                        far: lanes(s0 + 1, end + 1),
                        near_hi: lanes(0, end.saturating_sub(16)),
                        far_hi: lanes(0, (end + 1).saturating_sub(16)),
                    };
                }
            }
            out
        })
        .collect()
}
