//! C (+)= A · Bᵀ where A's and B's rows both run along the sum: a
//! convolution's weight gradient, dW (O × CKK) = G (O × pixels) · colᵀ,
//! whose two operands are contiguous along the pixels. A GEMM that packs
//! panels (the `gemm` crate) must transpose both there; this kernel sums
//! along the rows as they lie instead.
//!
//! | piece | what |
//! |-------|------|
//! | tile | 4 rows of A × 4 rows of B: 16 `zmm` accumulators, each 16 partial sums along k; per 16 k, 8 loads and 16 FMAs |
//! | reduction | the 16 accumulators to one vector of the 16 sums (a shuffle tree, 45 instructions) |
//! | blocking | the sgemm's kc of k at a time (`sgemm::blocking`, from the CPU's caches); B's 16 rows of one block stay in L1 or L2, A's 4 rows in L1 |
//! | edges | k % 16 by masked loads; rows past m or n repeat the last row and are not stored |
//!
//! AVX-512F only, chosen at run time, and only for the shapes where it
//! beats the `gemm` crate ([`dot_pays`]: long sums, few rows of A, as the
//! weight gradient of VGG16's 32 × 32 layers) on a thread that runs alone
//! or where `sgemm` does not pay. Elsewhere [`matmul_abt`] is our `sgemm`
//! where it beats the crate ([`sgemm_pays`]: a `Linear`'s forward, the
//! head's logits), else the `gemm` crate's strided GEMM. The sums are
//! taken in other orders than the `gemm` crate's (here 16 lanes, then the
//! tree; `sgemm` along k, block after block): equal to f32 rounding.

use super::matmul_strided;

/// B rows per block (kept in L2 while every 4 rows of A pass).
const NB: usize = 16;

/// The operands of one C (+)= A · Bᵀ: A is m × k with rows `lda` apart,
/// B is n × k with rows `ldb` apart, both contiguous along k.
#[derive(Clone, Copy)]
pub struct Abt<'a, T> {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: &'a [T],
    pub lda: usize,
    pub b: &'a [T],
    pub ldb: usize,
}

/// C (m × n, rows `ldc` apart) (+)= A · Bᵀ; `accumulate`: add to C, else
/// overwrite it.
pub fn matmul_abt(p: Abt<f32>, c: &mut [f32], ldc: usize, accumulate: bool) {
    let Abt {
        m,
        n,
        k,
        a,
        lda,
        b,
        ldb,
    } = p;
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.len() >= (m - 1) * lda + k && b.len() >= (n - 1) * ldb + k);
    assert!(c.len() >= (m - 1) * ldc + n);
    let wide = sgemm_pays(m, n, k);
    // The dot kernel runs on this thread alone: where `sgemm` could split
    // the columns over several, it takes them.
    #[cfg(target_arch = "x86_64")]
    if dot_pays(m, k) && avx512() && (wide.is_none() || super::threads_here() == 1) {
        // SAFETY: AVX-512F is present; the slices hold every row read or
        // written (checked above).
        unsafe { blocked(p, c, ldc, accumulate) };
        return;
    }
    match wide {
        Some(micro) => sgemm_abt(micro, p, c, ldc, accumulate),
        None => gemm_abt(p, c, ldc, accumulate),
    }
}

/// The same on our `sgemm`: A's rows interleaved by transposes as it is
/// packed, B (Bᵀ's columns contiguous) packed strip by strip by 16 × 16
/// transposes.
fn sgemm_abt(micro: super::sgemm::Micro, p: Abt<f32>, c: &mut [f32], ldc: usize, accumulate: bool) {
    use super::sgemm::{gemm, Layout, Matrix, Out, PackedA};
    let a = PackedA::new(micro, p.m, p.k, p.a, Layout::strided(p.lda, 1));
    let b = Matrix {
        b: p.b,
        k: p.k,
        n: p.n,
        layout: Layout::strided(1, p.ldb),
    };
    gemm(&a, &b, Out::rows(c, ldc), accumulate);
}

/// Where `sgemm` beats the `gemm` crate at A · Bᵀ (both contiguous along
/// k, as a `Linear`'s x · Wᵀ and the head's logits x̂ · Wᵀ): on AVX-512,
/// where every dimension fills at least one tile (MR rows, a strip of NR
/// columns) and a depth of 128. The crate's AVX-512 kernels gather Bᵀ's
/// columns at stride `ldb` when they pack; at a stride of 512 or more
/// floats that collapses (one thread, Zen 5, GFLOP/s, crate / `sgemm`):
/// 256 × 1024 × 512 187 / 233, 100 × 4096 × 4096 79 / 177, 32 × 1024 ×
/// 512 63 / 144, 100 × 4096 × 784 173 / 193 (on a Cascade Lake core the
/// first shape read 1.15–1.21× the crate's rate). Under the bounds the
/// crate wins: 256 × 32 × 512 227 / 112, 1 × 1024 × 512 60 / 11, 200 ×
/// 300 × 100 237 / 217. On AVX2 the crate ran that first shape at 90% of
/// the FMA peak (a Zen 3 core, no AVX-512), so it keeps it there.
fn sgemm_pays(m: usize, n: usize, k: usize) -> Option<super::sgemm::Micro> {
    let micro = super::sgemm::Micro::now().filter(|m| *m == super::sgemm::Micro::Avx512)?;
    (m >= micro.mr() && n >= micro.nr() && k >= 128).then_some(micro)
}

/// The same on the `gemm` crate.
pub fn gemm_abt<T: super::Float>(p: Abt<T>, c: &mut [T], ldc: usize, accumulate: bool) {
    let Abt {
        m,
        n,
        k,
        a,
        lda,
        b,
        ldb,
    } = p;
    matmul_strided(m, n, k, (c, ldc, 1), accumulate, (a, lda, 1), (b, 1, ldb));
}

/// Where the dot-product kernel beats the `gemm` crate (one thread, this
/// machine's AVX-512 core, `kernels::dot::rate`): long sums (k ≥ 1024)
/// and few rows of A (m ≤ 128): 64 × 576 × 1024 at 126 against 61 GFLOP/s,
/// 128 × 576 × 1024 at 155 against 103. With short sums or many rows the
/// crate's packed panels win (256 × 2304 × 256: 133 against 169).
fn dot_pays(m: usize, k: usize) -> bool {
    m <= 128 && k >= 1024
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn blocked(p: Abt<f32>, c: &mut [f32], ldc: usize, accumulate: bool) {
    let Abt {
        m,
        n,
        k,
        a,
        lda,
        b,
        ldb,
    } = p;
    // Each block's rows are copied into buffers whose row stride is not a
    // power of two: rows of 1024 or 256 floats (a convolution's pixels)
    // fall into the same L1 sets and evict each other (measured: half the
    // FMA rate without the copy).
    let depth = super::sgemm::blocking().kc;
    let stride = depth + 16;
    let mut abuf_raw = vec![0f32; m * stride + 16];
    let mut bbuf_raw = vec![0f32; NB * stride + 16];
    // 64-byte aligned: a vector load then never straddles two lines.
    let abuf = aligned(&mut abuf_raw);
    let bbuf = aligned(&mut bbuf_raw);
    let c = c.as_mut_ptr();
    for k0 in (0..k).step_by(depth) {
        let kc = depth.min(k - k0);
        let add = accumulate || k0 > 0;
        copy_rows(a, lda, k0, kc, 0, m, abuf, stride);
        for j0 in (0..n).step_by(NB) {
            let nb = NB.min(n - j0);
            copy_rows(b, ldb, k0, kc, j0, nb, bbuf, stride);
            for i in (0..m).step_by(4) {
                let rows_a = row_ptrs(abuf.as_ptr(), i, m, stride);
                for j in (0..nb).step_by(4) {
                    let rows_b = row_ptrs(bbuf.as_ptr(), j, nb, stride);
                    let sums = tile(kc, rows_a, rows_b);
                    store(
                        sums,
                        c,
                        i,
                        j0 + j,
                        m.min(i + 4) - i,
                        nb.min(j + 4) - j,
                        ldc,
                        add,
                    );
                }
            }
        }
    }
}

/// The part of `buf` from its first 64-byte boundary (`buf` has 16
/// floats to spare).
fn aligned(buf: &mut [f32]) -> &mut [f32] {
    let skip = buf.as_ptr().align_offset(64).min(16);
    &mut buf[skip..]
}

/// Rows r0..r0 + rows, columns k0..k0 + kc of a matrix with rows `ld`
/// apart, into `buf` with rows `stride` apart.
#[allow(clippy::too_many_arguments)]
fn copy_rows(
    src: &[f32],
    ld: usize,
    k0: usize,
    kc: usize,
    r0: usize,
    rows: usize,
    buf: &mut [f32],
    stride: usize,
) {
    for r in 0..rows {
        buf[r * stride..][..kc].copy_from_slice(&src[(r0 + r) * ld + k0..][..kc]);
    }
}

/// Rows r..r + 4 of a matrix with `len` rows (those past the end repeat
/// the last: computed, never stored).
#[cfg(target_arch = "x86_64")]
unsafe fn row_ptrs(base: *const f32, r: usize, len: usize, ld: usize) -> [*const f32; 4] {
    std::array::from_fn(|t| base.add((r + t).min(len - 1) * ld))
}

/// The 16 sums Σ_k a_i[k]·b_j[k] of a 4 × 4 tile, lane 4i + j.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile(kc: usize, a: [*const f32; 4], b: [*const f32; 4]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 16];
    let mut kk = 0;
    while kk + 16 <= kc {
        let av = [
            _mm512_loadu_ps(a[0].add(kk)),
            _mm512_loadu_ps(a[1].add(kk)),
            _mm512_loadu_ps(a[2].add(kk)),
            _mm512_loadu_ps(a[3].add(kk)),
        ];
        let bv = [
            _mm512_loadu_ps(b[0].add(kk)),
            _mm512_loadu_ps(b[1].add(kk)),
            _mm512_loadu_ps(b[2].add(kk)),
            _mm512_loadu_ps(b[3].add(kk)),
        ];
        for i in 0..4 {
            for j in 0..4 {
                acc[4 * i + j] = _mm512_fmadd_ps(av[i], bv[j], acc[4 * i + j]);
            }
        }
        kk += 16;
    }
    if kk < kc {
        let mask: __mmask16 = (1u32 << (kc - kk)) as u16 - 1;
        let av: [__m512; 4] = std::array::from_fn(|i| _mm512_maskz_loadu_ps(mask, a[i].add(kk)));
        let bv: [__m512; 4] = std::array::from_fn(|j| _mm512_maskz_loadu_ps(mask, b[j].add(kk)));
        for i in 0..4 {
            for j in 0..4 {
                acc[4 * i + j] = _mm512_fmadd_ps(av[i], bv[j], acc[4 * i + j]);
            }
        }
    }
    reduce16(&acc)
}

/// Lane t of the result: the sum of the 16 lanes of `v[t]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn reduce16(v: &[std::arch::x86_64::__m512; 16]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // Pairs: per 128-bit lane, [v2p, v2p+1, v2p, v2p+1] partial sums.
    let b: [__m512; 8] = std::array::from_fn(|p| {
        _mm512_add_ps(
            _mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]),
            _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]),
        )
    });
    // Quads: per 128-bit lane, [v4q, v4q+1, v4q+2, v4q+3].
    let c: [__m512; 4] = std::array::from_fn(|q| {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(b[2 * q], b[2 * q + 1]),
            _mm512_shuffle_ps::<0b11_10_11_10>(b[2 * q], b[2 * q + 1]),
        )
    });
    // Across the 128-bit lanes: halves, then wholes.
    let d: [__m512; 2] = std::array::from_fn(|h| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(c[2 * h], c[2 * h + 1]),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(c[2 * h], c[2 * h + 1]),
        )
    });
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(d[0], d[1]),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(d[0], d[1]),
    )
}

/// C[i + r, j + s] (+)= lane 4r + s, for the tile's rows < `mi` and
/// columns < `nj`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn store(
    sums: std::arch::x86_64::__m512,
    c: *mut f32,
    i: usize,
    j: usize,
    mi: usize,
    nj: usize,
    ldc: usize,
    add: bool,
) {
    use std::arch::x86_64::*;
    let mut lanes = [0f32; 16];
    _mm512_storeu_ps(lanes.as_mut_ptr(), sums);
    for r in 0..mi {
        let row = c.add((i + r) * ldc + j);
        if nj == 4 {
            let v = _mm_loadu_ps(lanes.as_ptr().add(4 * r));
            let v = if add {
                _mm_add_ps(_mm_loadu_ps(row), v)
            } else {
                v
            };
            _mm_storeu_ps(row, v);
        } else {
            for s in 0..nj {
                let x = lanes[4 * r + s];
                *row.add(s) = if add { *row.add(s) + x } else { x };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_values as values;

    /// Against the sums in f64, every size class: tiles whole and cut,
    /// k below, at and across 16 and a block of k, strided rows.
    #[test]
    fn matches_the_f64_sums() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (4, 4, 16),
            (5, 7, 17),
            (3, 2, 15),
            (8, 65, 513),
            (64, 72, 1024),
            (13, 130, 1100),
            (7, 64, 128),
            (100, 200, 600),
            (2, 3, 0),
        ] {
            for &accumulate in &[false, true] {
                let (lda, ldb, ldc) = (k + 3, k + 1, n + 2);
                let a = values(1, m * lda);
                let b = values(2, n * ldb);
                let c0 = values(3, m * ldc);
                // Both paths: the dispatch, and the AVX-512 kernel itself
                // (the dispatch takes it only for long sums).
                let mut paths = vec![("matmul_abt", c0.clone())];
                let p = Abt {
                    m,
                    n,
                    k,
                    a: &a,
                    lda,
                    b: &b,
                    ldb,
                };
                matmul_abt(p, &mut paths[0].1, ldc, accumulate);
                #[cfg(target_arch = "x86_64")]
                if k > 0 && avx512() {
                    let mut c = c0.clone();
                    // SAFETY: AVX-512F is present; the buffers hold every row.
                    unsafe { blocked(p, &mut c, ldc, accumulate) };
                    paths.push(("the AVX-512 kernel", c));
                }
                // `sgemm` on every shape, those it would not be chosen for
                // included (tiles cut, k = 0).
                for micro in crate::sgemm::micros() {
                    let mut c = c0.clone();
                    sgemm_abt(micro, p, &mut c, ldc, accumulate);
                    paths.push((
                        if micro.nr() == 64 {
                            "sgemm (AVX-512)"
                        } else {
                            "sgemm (AVX2)"
                        },
                        c,
                    ));
                }
                for (path, c) in &paths {
                    for i in 0..m {
                        for j in 0..n {
                            let want: f64 = (0..k)
                                .map(|t| a[i * lda + t] as f64 * b[j * ldb + t] as f64)
                                .sum::<f64>()
                                + if accumulate {
                                    c0[i * ldc + j] as f64
                                } else {
                                    0.0
                                };
                            let got = c[i * ldc + j] as f64;
                            assert!(
                            (got - want).abs() <= 1e-5 * (k as f64).sqrt().max(1.0) * want.abs().max(1.0),
                            "{path}, {m}×{n}×{k} acc {accumulate}: C[{i},{j}] = {got}, want {want}"
                        );
                        }
                        // Past the n columns: untouched.
                        for j in n..ldc {
                            assert_eq!(
                                c[i * ldc + j],
                                c0[i * ldc + j],
                                "{path}, {m}×{n}×{k}: wrote past n"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Sums 60,000 long (a full-batch weight gradient's k): every path sums
/// in blocks of at most 512, within a blocked BLAS's bound of the f64 sum,
/// where the same terms summed in order are 4 times past it.
#[cfg(test)]
mod long_k {
    use super::*;
    use crate::sum::{blocked_bound, drift, drifting};

    #[test]
    fn long_sums_stay_within_a_blocked_bound() {
        let (m, n, k) = (6, 64, 60_000);
        let bound = blocked_bound(k, 512);
        let row = drifting(k);
        let in_order = drift(k, row.iter().fold(0.0, |s, x| s + x));
        assert!(in_order > 4.0 * bound, "in order: {in_order:e}");
        // Every row of A the drifting terms, every row of B ones: each
        // element of C is their sum (the products are exact).
        let a: Vec<f32> = (0..m).flat_map(|_| row.iter().copied()).collect();
        let b = vec![1.0f32; n * k];
        let p = Abt {
            m,
            n,
            k,
            a: &a,
            lda: k,
            b: &b,
            ldb: k,
        };
        let mut paths = Vec::new();
        let mut c = vec![0f32; m * n];
        matmul_abt(p, &mut c, n, false);
        paths.push(("matmul_abt", c));
        let mut c = vec![0f32; m * n];
        gemm_abt(p, &mut c, n, false);
        paths.push(("the gemm crate", c));
        #[cfg(target_arch = "x86_64")]
        if avx512() {
            let mut c = vec![0f32; m * n];
            // SAFETY: AVX-512F is present; the buffers hold every row.
            unsafe { blocked(p, &mut c, n, false) };
            paths.push(("the AVX-512 dot kernel", c));
        }
        for micro in crate::sgemm::micros() {
            let mut c = vec![0f32; m * n];
            sgemm_abt(micro, p, &mut c, n, false);
            paths.push(("sgemm", c));
        }
        for (path, c) in &paths {
            let worst = c.iter().map(|&s| drift(k, s)).fold(0.0, f64::max);
            assert!(
                worst < bound,
                "{path}: {worst:e} from the f64 sum, bound {bound:e}"
            );
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod rate {
    use super::*;

    #[test]
    #[ignore = "a timing, run by hand"]
    fn rate() {
        if !avx512() {
            return;
        }
        for &(m, n, k) in &[
            (64, 576, 1024),
            (64, 27, 1024),
            (128, 1152, 256),
            (128, 1152, 1024),
            (128, 576, 1024),
            (256, 1152, 256),
            (256, 2304, 256),
            (512, 4608, 256),
        ] {
            let a = vec![0.5f32; m * k];
            let b = vec![0.25f32; n * k];
            let flop = 2.0 * (m * n * k) as f64;
            let time = |f: &mut dyn FnMut(&mut [f32])| {
                let mut c = vec![0f32; m * n];
                f(&mut c);
                let t = std::time::Instant::now();
                for _ in 0..5 {
                    f(&mut c);
                }
                flop / (t.elapsed().as_secs_f64() / 5.0) / 1e9
            };
            // SAFETY: AVX-512F checked; the buffers hold every row.
            let p = Abt {
                m,
                n,
                k,
                a: &a,
                lda: k,
                b: &b,
                ldb: k,
            };
            let dot = time(&mut |c| unsafe { blocked(p, c, n, false) });
            let gemm = time(&mut |c| gemm_abt(p, c, n, false));
            eprintln!("{m}x{n}x{k}: dot {dot:.0}, gemm {gemm:.0} GFLOP/s");
        }
    }
}
