//! The AVX-512 BF16 kernel (`vdpbf16ps`): 12 × 32 tiles, A packed
//! pair-major.

use super::blocked::Tiles;
use super::input::Input;
use super::pack::pack;
use super::prefetch::prefetch_some;
use crate::Operand;

/// Rows and columns of the microkernel's tile.
pub(super) const MR: usize = 12;
pub(super) const NR: usize = 32;
/// k per panel (even), rows per A panel, columns per B panel.
const KC: usize = 384;
const MC: usize = 96;
// A panel's strips start at multiples of MR.
const _: () = assert!(MC.is_multiple_of(MR) && KC.is_multiple_of(2));
const NC: usize = 512;

/// The AVX-512 BF16 kernel's tiles: 12 × 32, A packed pair-major.
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx512Bf16;

#[cfg(target_arch = "x86_64")]
impl Tiles for Avx512Bf16 {
    const MR: usize = MR;
    const NR: usize = NR;
    const KC: usize = KC;
    const MC: usize = MC;
    const NC: usize = NC;
    fn pairs(kc: usize) -> usize {
        kc.div_ceil(2)
    }
    fn pack_a<E: Input>(
        a: Operand<'_, E>,
        m: usize,
        k: (usize, usize, usize),
        out: &mut [u32],
        tmp: &mut Vec<u16>,
    ) {
        pack(a, 0, m, MR, k, out, tmp);
    }
    fn before_tile() {
        prefetch_some();
    }
    unsafe fn micro(kps: usize, a: &[u32], b: &[u32], c: *mut f32, rs: usize, add: bool) {
        // SAFETY: the caller's contract (Tiles::micro), and the CPU has
        // AVX-512 BF16 (matmul_bf16 checked).
        unsafe { micro_into(kps, a, b, c, rs, add) }
    }
}

/// One MR × NR tile over kp k pairs (Σ_p a_p ⊗ b_p) into a row-major block
/// at `c` (row stride `rs`), added to it where `add`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512f")]
pub(super) unsafe fn micro_into(
    kp: usize,
    a: &[u32],
    b: &[u32],
    c: *mut f32,
    rs: usize,
    add: bool,
) {
    use std::arch::x86_64::*;
    let acc = unsafe { accumulate(kp, a, b) };
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: the caller guarantees MR rows of NR floats at c, rs apart.
        unsafe {
            let p = c.add(r * rs);
            let (mut lo, mut hi) = (acc[0], acc[1]);
            if add {
                lo = _mm512_add_ps(lo, _mm512_loadu_ps(p));
                hi = _mm512_add_ps(hi, _mm512_loadu_ps(p.add(16)));
            }
            _mm512_storeu_ps(p, lo);
            _mm512_storeu_ps(p.add(16), hi);
        }
    }
}

/// The MR × NR accumulators of kp k pairs (two zmm of 16 f32 per row).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512f")]
#[inline]
unsafe fn accumulate(kp: usize, a: &[u32], b: &[u32]) -> [[std::arch::x86_64::__m512; 2]; MR] {
    use std::arch::x86_64::*;
    assert!(
        a.len() >= kp * MR && b.len() >= kp * NR,
        "bf16 GEMM: short panel"
    );
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    for p in 0..kp {
        // SAFETY: p < kp, and the panels hold kp·MR and kp·NR words
        // (asserted above); __m512i and __m512bh are both 512 bits.
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(pb.add(p * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(pb.add(p * NR + 16).cast()));
            for (r, acc) in acc.iter_mut().enumerate() {
                let pair = *pa.add(p * MR + r) as i32;
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
            }
        }
    }
    acc
}

#[cfg(test)]
mod peak {
    #[test]
    #[ignore]
    fn micro_rate() {
        let kp = 256;
        let a = vec![0x3F80_3F80u32; kp * super::MR];
        let b = vec![0x3F80_3F80u32; kp * super::NR];
        let mut tile = [0f32; super::NR * super::MR];
        let iters = 20000;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            unsafe { super::micro_into(kp, &a, &b, tile.as_mut_ptr(), super::NR, false) };
            std::hint::black_box(&tile);
        }
        let s = t.elapsed().as_secs_f64();
        let flops = 2.0 * (super::MR * super::NR * 2 * kp * iters) as f64;
        println!("micro: {:.1} GFLOP/s", flops / s / 1e9);
    }
}
