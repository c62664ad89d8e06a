//! The AVX2 + FMA microkernel: 6 × 16, two ymm of B per k.

use super::x86::{offsets, prefetch_across, prefetch_c, walk};
use super::Call;
use std::arch::x86_64::*;

/// 6 × 16: per k two ymm of B, a broadcast of A per row (A's places
/// as in [`tile_avx512`]). Its k loop is [`steps_avx2`]: written as a
/// loop over arrays inside the strip walk, LLVM kept the 12
/// accumulators in 16 ymm registers only by spilling some to the stack
/// every k; with the loop flat and the accumulators named, none spill.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile_avx2<const TS: usize, const RS: usize>(call: Call) {
    let Call { kc, c, ldc, .. } = call;
    let (rows, add) = (call.rows, call.add);
    const MR: usize = 6;
    let mut acc = [_mm256_setzero_ps(); 2 * MR];
    let offs = offsets::<MR, RS>(&call);
    let (per, mut t0, stride) = walk(&call, TS);
    let (mut s, mut b) = (call.a, call.b);
    if add {
        prefetch_c(c, ldc, rows.min(MR), 1);
    }
    let mut k = 0;
    while k < kc {
        let n = (per - t0).min(kc - k);
        if TS == 1 && RS != 0 {
            prefetch_across(s, stride, MR * RS);
        }
        acc = steps_avx2::<TS>(s.add(t0 * TS), offs, b, call.ldb, n, acc);
        b = b.add(n * call.ldb);
        k += n;
        t0 = 0;
        s = s.add(stride);
    }
    for r in 0..rows.min(MR) {
        let row = c.add(r * ldc);
        let (mut v0, mut v1) = (acc[2 * r], acc[2 * r + 1]);
        if add {
            v0 = _mm256_add_ps(_mm256_loadu_ps(row), v0);
            v1 = _mm256_add_ps(_mm256_loadu_ps(row.add(8)), v1);
        }
        _mm256_storeu_ps(row, v0);
        _mm256_storeu_ps(row.add(8), v1);
    }
}

/// `n` steps of k of [`tile_avx2`] from A at `a` (the k-th at `a +
/// k·TS`, row r `o[r]` on) and B at `b` (rows `ldb` apart), the
/// accumulators (row r's two halves at 2r, 2r + 1) in and out by
/// value.
#[inline(always)]
unsafe fn steps_avx2<const TS: usize>(
    mut a: *const f32,
    o: [usize; 6],
    mut b: *const f32,
    ldb: usize,
    n: usize,
    acc: [__m256; 12],
) -> [__m256; 12] {
    let [mut c0, mut c1, mut c2, mut c3, mut c4, mut c5, mut c6, mut c7, mut c8, mut c9, mut c10, mut c11] =
        acc;
    for _ in 0..n {
        let b0 = _mm256_loadu_ps(b);
        let b1 = _mm256_loadu_ps(b.add(8));
        let av = _mm256_broadcast_ss(&*a.add(o[0]));
        c0 = _mm256_fmadd_ps(av, b0, c0);
        c1 = _mm256_fmadd_ps(av, b1, c1);
        let av = _mm256_broadcast_ss(&*a.add(o[1]));
        c2 = _mm256_fmadd_ps(av, b0, c2);
        c3 = _mm256_fmadd_ps(av, b1, c3);
        let av = _mm256_broadcast_ss(&*a.add(o[2]));
        c4 = _mm256_fmadd_ps(av, b0, c4);
        c5 = _mm256_fmadd_ps(av, b1, c5);
        let av = _mm256_broadcast_ss(&*a.add(o[3]));
        c6 = _mm256_fmadd_ps(av, b0, c6);
        c7 = _mm256_fmadd_ps(av, b1, c7);
        let av = _mm256_broadcast_ss(&*a.add(o[4]));
        c8 = _mm256_fmadd_ps(av, b0, c8);
        c9 = _mm256_fmadd_ps(av, b1, c9);
        let av = _mm256_broadcast_ss(&*a.add(o[5]));
        c10 = _mm256_fmadd_ps(av, b0, c10);
        c11 = _mm256_fmadd_ps(av, b1, c11);
        a = a.add(TS);
        b = b.add(ldb);
    }
    [c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11]
}
