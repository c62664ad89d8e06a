//! What the bf16 GEMM multiplies: f32 (rounded to bf16 as it is packed)
//! or bf16 elements ([`Input`]).

use super::detect::has_avx512_bf16;
use half::bf16;

/// An input element: f32 (rounded to bf16 when packed) or bf16.
pub trait Input: Copy + Send + Sync + 'static {
    /// The bf16 bits of each element of `src` into `dst` (one length).
    fn convert(src: &[Self], dst: &mut [u16]);
    /// One element's bf16 bits.
    fn bits(self) -> u16;
    /// The elements, where they are f32 (the packers' vector paths read
    /// each kind its own way).
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    /// The elements' bits, where they are bf16.
    fn as_bits(_: &[Self]) -> Option<&[u16]> {
        None
    }
}

impl Input for f32 {
    fn convert(src: &[f32], dst: &mut [u16]) {
        #[cfg(target_arch = "x86_64")]
        if has_avx512_bf16() {
            // SAFETY: the CPU has AVX-512 BF16 (checked just above).
            unsafe { convert_avx512(src, dst) };
            return;
        }
        crate::vector::to_bf16(src, dst);
    }
    fn bits(self) -> u16 {
        crate::vector::bf16_bits(self)
    }
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
}

impl Input for bf16 {
    fn convert(src: &[bf16], dst: &mut [u16]) {
        use half::slice::HalfFloatSliceExt;
        dst.copy_from_slice(src.reinterpret_cast());
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn as_bits(s: &[bf16]) -> Option<&[u16]> {
        use half::slice::HalfFloatSliceExt;
        Some(s.reinterpret_cast())
    }
}

/// `src` to bf16 bits with `vcvtneps2bf16` (round to nearest even, NaN
/// quieted: the bits `half::bf16::from_f32` gives), 16 at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512f")]
unsafe fn convert_avx512(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let whole = n / 16 * 16;
    for i in (0..whole).step_by(16) {
        // SAFETY: i + 16 ≤ n elements of both slices; __m256bh and __m256i
        // are both 256 bits.
        unsafe {
            let v = _mm512_loadu_ps(src.as_ptr().add(i));
            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), h);
        }
    }
    for i in whole..n {
        dst[i] = crate::vector::bf16_bits(src[i]);
    }
}
