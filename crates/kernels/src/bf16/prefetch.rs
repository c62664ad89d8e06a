//! A hint the bf16 GEMMs carry out between microkernels: memory the caller
//! reads next, brought into cache a few lines per tile.

thread_local! {
    /// Memory to bring into cache while this thread's next GEMMs compute:
    /// (next byte, end), see [`prefetch_during_gemms`].
    static PREFETCH: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 0)) };
}

/// Cache lines prefetched per microkernel call.
const PREFETCH_LINES: usize = 24;

/// Bring `next` into cache a few lines at a time while this thread's next
/// bf16 GEMMs compute (a hint: the sharded head passes the next class
/// block of W, which it would otherwise wait on when it packs it). Replaces
/// the previous hint.
pub fn prefetch_during_gemms(next: &[f32]) {
    let start = next.as_ptr() as usize;
    PREFETCH.with(|p| p.set((start, start + std::mem::size_of_val(next))));
}

/// Issue the next few prefetches of the hint.
#[cfg(target_arch = "x86_64")]
pub(super) fn prefetch_some() {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    PREFETCH.with(|p| {
        let (mut at, end) = p.get();
        for _ in 0..PREFETCH_LINES {
            if at >= end {
                break;
            }
            // SAFETY: a prefetch is a hint and never faults; the address
            // lies in a slice the caller handed over.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(at as *const i8) };
            at += 64;
        }
        p.set((at, end));
    });
}
