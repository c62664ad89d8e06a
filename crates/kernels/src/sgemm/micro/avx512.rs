//! The AVX-512 microkernel: MR × 64, four zmm of B per k.

use super::x86::{offsets, prefetch_across, prefetch_c, walk};
use super::Call;
use std::arch::x86_64::*;

/// MR × 64: per k four zmm of B, a broadcast of A per row. A's k-th
/// value of row r at `a + k·TS + r·RS` within a strip (packed: TS =
/// MR, RS = 1; read across a packed Aᵀ: TS = 1, RS = MR, strip by
/// strip, [`Across`]; in place: TS = 1, RS = 0 for the rows' own
/// places, [`offsets`]); every row sums over k in order either way.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile_avx512<const MR: usize, const TS: usize, const RS: usize>(call: Call) {
    let (kc, c, ldc, rows, add) = (call.kc, call.c, call.ldc, call.rows, call.add);
    let mut acc = [[_mm512_setzero_ps(); 4]; MR];
    let offs = offsets::<MR, RS>(&call);
    let (per, mut t0, stride) = walk(&call, TS);
    let (mut s, mut b) = (call.a, call.b);
    if add {
        prefetch_c(c, ldc, rows.min(MR), 4);
    }
    let mut k = 0;
    while k < kc {
        let n = (per - t0).min(kc - k);
        if TS == 1 && RS != 0 {
            prefetch_across(s, stride, MR * RS);
        }
        for t in t0..t0 + n {
            let a = s.add(t * TS);
            let bv = [
                _mm512_loadu_ps(b),
                _mm512_loadu_ps(b.add(16)),
                _mm512_loadu_ps(b.add(32)),
                _mm512_loadu_ps(b.add(48)),
            ];
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(offs[r]));
                for (v, b) in row.iter_mut().zip(&bv) {
                    *v = _mm512_fmadd_ps(av, *b, *v);
                }
            }
            b = b.add(call.ldb);
        }
        k += n;
        t0 = 0;
        s = s.add(stride);
    }
    for (r, vs) in acc.iter().enumerate().take(rows.min(MR)) {
        let row = c.add(r * ldc);
        for (q, &v) in vs.iter().enumerate() {
            let dst = row.add(16 * q);
            let v = if add {
                _mm512_add_ps(_mm512_loadu_ps(dst), v)
            } else {
                v
            };
            _mm512_storeu_ps(dst, v);
        }
    }
}
