//! A GEMM on bf16 inputs with f32 accumulation: AMX tiles where the CPU
//! has them ([`amx`]), else AVX-512 BF16's `vdpbf16ps` where the CPU
//! has it (both detected at run time), the same arithmetic through the f32
//! GEMM elsewhere.
//!
//! dst (m, n) (+)= a (m, k) · b (k, n), every input element first rounded to
//! bf16 (to nearest even, as `half::bf16::from_f32`), products summed in
//! f32. Inputs are f32 or bf16 with any strides; they are converted while
//! being packed into cache-sized panels, never copied whole.
//!
//! | level | size | holds |
//! |---|---|---|
//! | microkernel | 12 rows × 32 columns | 24 zmm accumulators; per k pair: 2 loads of b, 12 broadcasts of a, 24 `vdpbf16ps` (each 16 columns × 2 k) |
//! | A panel | every row × 384 k | bf16 pairs, k pair-major (a broadcast reads one 32-bit pair), packed once per k panel |
//! | B panel | 384 k × 512 columns | bf16 pairs, k pair-major, 32 columns per strip (24 KiB: stays in L1 while A's strips pass) |
//!
//! One thread of an AMD Zen 4 core: 232 GFLOP/s in the microkernel alone,
//! 170–190 in the head's shapes (1.6–1.75× the `gemm` crate's AVX2 f32);
//! of a Zen 5 core: 517 in the microkernel (97% of its 2 × 512-bit
//! `vdpbf16ps` peak), 460–495 in the head's shapes.
//! An Intel core that has AVX-512 BF16 issues one `vdpbf16ps` per cycle
//! against two FMAs, so there this kernel is no faster than the f32 GEMM
//! (its AMX tiles are: [`amx`]). `shardnet bench gemm` says which.
//!
//! Packing reads each operand in its own order on AVX-512: rows that run
//! along k are converted 32 k at a time (`vcvtne2ps2bf16`, or bf16 read
//! as is) and turned into pair rows by 16 × 16 transposes; k rows that
//! run across the rows are interleaved two at a time, 16 rows' pairs per
//! store. A strip narrower than 16 (A's 12 rows) is one short run, stored
//! under a mask (a masked store is several times slower on AMD's cores,
//! so a whole run never takes one).
//!
//! A k pair (k, k + 1) is one 32-bit word of two bf16: `vdpbf16ps` adds
//! a_k·b_k + a_{k+1}·b_{k+1} into each f32 lane; an odd k is padded with a
//! zero pair half.

pub mod amx;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod blocked;
mod detect;
mod input;
mod pack;
mod prefetch;

pub use detect::{has_avx512_bf16, set_force_fallback};
pub use input::Input;
pub use prefetch::prefetch_during_gemms;

use crate::Operand;

/// dst (m, n) (+)= a (m, k) · b (k, n) with bf16-rounded inputs and f32
/// sums (see the module doc); dst with its own strides (row, column).
/// `accumulate` adds to dst instead of overwriting it.
pub fn matmul_bf16<A: Input, B: Input>(
    m: usize,
    n: usize,
    k: usize,
    dst: (&mut [f32], usize, usize),
    accumulate: bool,
    a: Operand<'_, A>,
    b: Operand<'_, B>,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        let (dst, drs, dcs) = dst;
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    dst[r * drs + c * dcs] = 0.0;
                }
            }
        }
        return;
    }
    if has_avx512_bf16() {
        #[cfg(target_arch = "x86_64")]
        {
            if amx::has_amx_bf16() {
                amx::gemm((m, n, k), dst, accumulate, a, b);
            } else {
                blocked::blocked::<avx512::Avx512Bf16, _, _>((m, n, k), dst, accumulate, a, b);
            }
            return;
        }
    }
    fallback(m, n, k, dst, accumulate, a, b);
}

/// [`matmul_bf16`] with dst's rows split over this pass's threads
/// ([`crate::threads_here`]), each thread packing its own rows of a and
/// all of b: the same sums, element for element, on any number of
/// threads. dst row-major (column stride 1) for the split; one thread
/// otherwise.
pub fn matmul_bf16_threaded<A: Input, B: Input>(
    m: usize,
    n: usize,
    k: usize,
    (dst, drs, dcs): (&mut [f32], usize, usize),
    accumulate: bool,
    (a, ars, acs): Operand<'_, A>,
    b: Operand<'_, B>,
) {
    use rayon::prelude::*;
    let threads = crate::threads_here();
    // Below about 32 rows a thread, packing b twice costs more than it saves.
    let parts = threads.min(m / 32).max(1);
    if parts == 1 || dcs != 1 || drs < n {
        return matmul_bf16(m, n, k, (dst, drs, dcs), accumulate, (a, ars, acs), b);
    }
    // Row blocks of whole microkernel strips (12 rows).
    let per = m.div_ceil(parts).div_ceil(12) * 12;
    let blocks: Vec<(usize, &mut [f32])> = dst
        .chunks_mut(per * drs)
        .enumerate()
        .map(|(i, d)| (i * per, d))
        .filter(|(r0, _)| *r0 < m)
        .collect();
    blocks.into_par_iter().for_each(|(r0, d)| {
        let rows = per.min(m - r0);
        crate::serial(|| {
            matmul_bf16(
                rows,
                n,
                k,
                (d, drs, 1),
                accumulate,
                (&a[r0 * ars..], ars, acs),
                b,
            )
        })
    });
}

/// The fallback: each operand rounded to bf16 and widened back to f32 (a
/// copy of each), then the f32 GEMM.
fn fallback<A: Input, B: Input>(
    m: usize,
    n: usize,
    k: usize,
    dst: (&mut [f32], usize, usize),
    accumulate: bool,
    (a, ars, acs): Operand<'_, A>,
    (b, brs, bcs): Operand<'_, B>,
) {
    let widen = |bits: u16| f32::from_bits(u32::from(bits) << 16);
    let ra: Vec<f32> = (0..m * k)
        .map(|e| widen(a[(e / k) * ars + (e % k) * acs].bits()))
        .collect();
    let rb: Vec<f32> = (0..k * n)
        .map(|e| widen(b[(e / n) * brs + (e % n) * bcs].bits()))
        .collect();
    crate::matmul_strided(m, n, k, dst, accumulate, (&ra, k, 1), (&rb, n, 1));
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Seeded values in [−1, 1).
    use crate::test_values as values;

    fn round(v: f32) -> f64 {
        f64::from(bf16::from_f32(v).to_f32())
    }

    /// Every case: (m, n, k, a transposed, b transposed, accumulate).
    fn check(m: usize, n: usize, k: usize, at: bool, bt: bool, acc: bool) {
        let a = values(1, m * k);
        let b = values(2, k * n);
        let (ars, acs) = if at { (1, m) } else { (k, 1) };
        let (brs, bcs) = if bt { (1, k) } else { (n, 1) };
        let init = values(3, m * n);
        let mut want = vec![0f64; m * n];
        let mut scale = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = if acc { f64::from(init[i * n + j]) } else { 0.0 };
                let mut mag = s.abs();
                for kk in 0..k {
                    let p = round(a[i * ars + kk * acs]) * round(b[kk * brs + j * bcs]);
                    s += p;
                    mag += p.abs();
                }
                want[i * n + j] = s;
                scale[i * n + j] = mag.max(1e-30);
            }
        }
        for (force, no_amx) in [(false, false), (false, true), (true, false)] {
            set_force_fallback(force);
            amx::set_force_off(no_amx);
            let mut got = if acc {
                init.clone()
            } else {
                vec![f32::NAN; m * n]
            };
            matmul_bf16(
                m,
                n,
                k,
                (&mut got, n, 1),
                acc,
                (&a, ars, acs),
                (&b, brs, bcs),
            );
            for e in 0..m * n {
                let err = (f64::from(got[e]) - want[e]).abs() / scale[e];
                assert!(
                    err <= 1e-5,
                    "{m}×{n}×{k} at {at} bt {bt} acc {acc} fallback {force} no AMX {no_amx}: \
                     element {e}: {} vs {} ({err:e})",
                    got[e],
                    want[e]
                );
            }
        }
        set_force_fallback(false);
        amx::set_force_off(false);
    }

    #[test]
    fn matches_the_rounded_product_in_every_layout_and_size() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (3, 5, 7),
            (12, 32, 2),
            (13, 33, 3),
            (25, 70, 515),
            (97, 513, 1025),
            // Whole AMX blocks (32 × 32), k a multiple of its 32 and not.
            (64, 96, 64),
            (64, 64, 544),
        ] {
            for (at, bt) in [(false, false), (false, true), (true, false), (true, true)] {
                for acc in [false, true] {
                    check(m, n, k, at, bt, acc);
                }
            }
        }
        check(300, 700, 515, false, true, false);
    }

    #[test]
    fn k_zero_writes_zeros_and_empty_does_nothing() {
        let mut d = vec![5f32; 6];
        matmul_bf16::<f32, f32>(2, 3, 0, (&mut d, 3, 1), false, (&[], 0, 1), (&[], 3, 1));
        assert!(d.iter().all(|v| *v == 0.0));
        let mut d = vec![5f32; 6];
        matmul_bf16::<f32, f32>(2, 3, 0, (&mut d, 3, 1), true, (&[], 0, 1), (&[], 3, 1));
        assert!(d.iter().all(|v| *v == 5.0));
        matmul_bf16::<f32, f32>(
            0,
            3,
            4,
            (&mut [], 3, 1),
            false,
            (&[], 4, 1),
            (&[0.0; 12], 3, 1),
        );
    }

    #[test]
    fn bf16_inputs_equal_f32_inputs_rounded() {
        let (m, n, k) = (20, 40, 37);
        let a = values(7, m * k);
        let b = values(8, k * n);
        let ah: Vec<bf16> = a.iter().map(|v| bf16::from_f32(*v)).collect();
        let mut d1 = vec![0f32; m * n];
        let mut d2 = vec![0f32; m * n];
        matmul_bf16(m, n, k, (&mut d1, n, 1), false, (&a, k, 1), (&b, n, 1));
        matmul_bf16(m, n, k, (&mut d2, n, 1), false, (&ah, k, 1), (&b, n, 1));
        // Equal up to the summation order (another test may switch the
        // fallback on between the two calls).
        for (x, y) in d1.iter().zip(&d2) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} {y}");
        }
    }
}
