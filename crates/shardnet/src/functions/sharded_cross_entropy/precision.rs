//! The precision the logits are kept in (f32, bf16 or f16): the [`Elem`]
//! element types and their rounding, and the bf16 GEMMs (AVX-512 BF16)
//! that the head runs with bf16 logits: x̂ and ∂L/∂z rounded to bf16 once,
//! the next class block's weight rows prefetched.

use super::common::CLASS_BLOCK;
use crate::kernels::bf16::has_avx512_bf16;
use candle_core::DType;
use half::{bf16, f16};

/// A logits element type.
pub(super) trait Elem: Copy + Send + Sync + 'static {
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
    /// Whether the buffer is f32 itself (worked on in place).
    const IN_PLACE: bool = false;
    /// The buffer as f32, where it is f32: then work happens in place.
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
    /// v ← T(exp(v − m)) (as f32); returns Σ v of the rounded values.
    fn exp_sub_round_sum(row: &mut [f32], m: f32) -> f32 {
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = Self::from_f32(crate::kernels::vector::exp(*v - m)).to_f32();
            sum += *v;
        }
        sum
    }
    /// dst ← src rounded to T (one length).
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, v)| *d = Self::from_f32(*v));
    }
    /// dst ← src as f32 (dst cleared first).
    fn load(src: &[Self], dst: &mut Vec<f32>) {
        dst.clear();
        dst.extend(src.iter().map(|v| v.to_f32()));
    }
}
impl Elem for f32 {
    const IN_PLACE: bool = true;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }
}
impl Elem for bf16 {
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn exp_sub_round_sum(row: &mut [f32], m: f32) -> f32 {
        crate::kernels::vector::exp_sub_bf16_sum(row, m)
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        crate::kernels::vector::to_bf16(src, dst.reinterpret_cast_mut());
    }
    fn load(src: &[Self], dst: &mut Vec<f32>) {
        use half::slice::HalfFloatSliceExt;
        dst.resize(src.len(), 0.0);
        crate::kernels::vector::from_bf16(src.reinterpret_cast(), dst);
    }
}
impl Elem for f16 {
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// Whether the head's three GEMMs take bf16 inputs (f32 sums): with bf16
/// logits on a CPU with AVX-512 BF16; the f32 GEMMs elsewhere.
pub(super) fn bf16_gemms(logits: DType) -> bool {
    logits == DType::BF16 && has_avx512_bf16()
}

/// Let the bf16 GEMMs of class block `range` bring the next block's rows
/// of `w` into cache while they compute.
pub(super) fn prefetch_next_block(
    w: &[f32],
    range: &std::ops::Range<usize>,
    cols: usize,
    d: usize,
) {
    let next = range.end..(range.end + CLASS_BLOCK).min(cols);
    crate::kernels::bf16::prefetch_during_gemms(&w[next.start * d..next.end * d]);
}

/// `out` ← `v` rounded to bf16 (resized to match; its memory reused).
pub(super) fn to_bf16(v: &[f32], out: &mut Vec<bf16>) {
    use crate::kernels::bf16::Input;
    use half::slice::HalfFloatSliceExt;
    out.resize(v.len(), bf16::ZERO);
    <f32 as Input>::convert(v, out.reinterpret_cast_mut());
}

thread_local! {
    /// The last step's logits buffer, handed back by backward
    /// ([`give_back_logits`]) and reused by the next forward on this thread
    /// ([`logits_buffer`]): at a million classes it is hundreds of MiB, which
    /// a fresh allocation would have the kernel fault in and zero, page by
    /// page, every step.
    static SPARE: std::cell::RefCell<Option<Box<dyn std::any::Any>>> =
        const { std::cell::RefCell::new(None) };
}

/// A buffer of `n` logits: this thread's spare one where it holds
/// T, resized (what it held is left: forward overwrites every element it
/// keeps), else a new one.
pub(super) fn logits_buffer<T: Elem>(n: usize) -> Vec<T> {
    let spare = SPARE.with(|s| s.borrow_mut().take());
    let mut v = spare
        .and_then(|b| b.downcast::<Vec<T>>().ok())
        .map_or_else(Vec::new, |b| *b);
    if v.capacity() < n {
        // Growing would copy the old contents: start afresh instead.
        v = Vec::new();
    }
    v.truncate(n);
    v.resize(n, T::from_f32(0.0));
    v
}

/// Keep `v` as this thread's spare logits buffer (replacing any other).
pub(super) fn give_back_logits<T: Elem>(v: Vec<T>) {
    SPARE.with(|s| *s.borrow_mut() = Some(Box::new(v)));
}
