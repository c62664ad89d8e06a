//! What both x86 microkernels read A and C with: A's walk and its rows'
//! places, and the prefetches of A read across and of C.

use super::{Across, Call, Read};
use crate::sgemm::blocking::MR_ACROSS;
use std::arch::x86_64::*;

/// How many strips ahead a tile read across prefetches its A.
const ACROSS_AHEAD: usize = 4;

/// A read across (either tile): its `floats` (MR × MR) in the strip
/// [`ACROSS_AHEAD`] strips after `s`, the strips `stride` floats apart,
/// which no prefetcher follows; up to three 64-byte lines and the one
/// its last float falls in. A hint: an address past A is not read.
#[inline(always)]
pub(super) fn prefetch_across(s: *const f32, stride: usize, floats: usize) {
    let f = s.wrapping_add(ACROSS_AHEAD * stride) as *const i8;
    for at in [0, 64, 128, 4 * floats - 4] {
        // SAFETY: SSE is part of x86-64; a prefetch reads nothing.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(f.wrapping_add(at)) };
    }
}

/// A's places for one call, per k: `(s, t)` walks the strips (of
/// `per` k each) and the k within them, the k-th A at `s + t·TS`.
#[inline(always)]
pub(super) fn walk(call: &Call, ts: usize) -> (usize, usize, usize) {
    // (k per strip, first k's place in its strip, floats between strips)
    match call.read {
        Read::Across(Across { phase, stride }) => (MR_ACROSS, phase, stride),
        Read::Packed | Read::Rows(_) => (call.kc, 0, call.kc * ts),
    }
}

/// Row r's place from a k's first (RS = 0: A's rows where they lie,
/// [`Read::Rows`]; else r·RS).
#[inline(always)]
pub(super) fn offsets<const MR: usize, const RS: usize>(call: &Call) -> [usize; MR] {
    match call.read {
        Read::Rows(offs) if RS == 0 => std::array::from_fn(|r| offs[r]),
        _ => std::array::from_fn(|r| r * RS),
    }
}

/// The tile of C that a microkernel adds to (`rows` rows `ldc`
/// apart, `lines` cache lines each) asked for at its start, to be in
/// L1 by its end. Where C is large it comes from L3 or memory: a
/// Winograd weight gradient adds each chunk's dM · Vᵀ into dU, 16 MB
/// at 512 → 512.
#[inline(always)]
pub(super) unsafe fn prefetch_c(c: *const f32, ldc: usize, rows: usize, lines: usize) {
    for r in 0..rows {
        let row = c.wrapping_add(r * ldc) as *const i8;
        for q in 0..lines {
            _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(64 * q));
        }
    }
}
