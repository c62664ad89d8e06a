//! Lane helpers the AVX-512 code of the layers above shares: masks of the
//! first n lanes, and the permutes that split 32 floats (two vectors) into
//! their even and odd elements.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Lanes 0, 2, .., 30 of (a, b) (a two-source permute's indices), and
/// lanes 1, 3, .., 31.
pub const EVEN: [i32; 16] = [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30];
pub const ODD: [i32; 16] = [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31];

/// Indices as a vector.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn idx(v: &[i32; 16]) -> __m512i {
    _mm512_loadu_si512(v.as_ptr() as *const _)
}

/// The first `n` lanes of 16 (all for n ≥ 16).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn mask(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}
