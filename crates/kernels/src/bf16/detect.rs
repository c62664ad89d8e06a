//! Whether this CPU runs AVX-512 BF16, detected once; a switch that takes
//! the f32 fallback anyway (tests and benchmarks compare the two).

use std::sync::atomic::{AtomicBool, Ordering};

static FORCE_FALLBACK: AtomicBool = AtomicBool::new(false);

/// Whether this CPU runs AVX-512 BF16 (`vdpbf16ps`), checked once; false
/// under [`set_force_fallback`].
pub fn has_avx512_bf16() -> bool {
    if FORCE_FALLBACK.load(Ordering::Relaxed) {
        return false;
    }
    detected()
}

/// Whether the CPU has AVX-512 BF16, whatever the switch says.
#[cfg(target_arch = "x86_64")]
pub(super) fn detected() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f")
    })
}

/// Whether the CPU has AVX-512 BF16: never, off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn detected() -> bool {
    false
}

/// Take the f32 fallback even where the CPU has AVX-512 BF16 (tests and
/// benchmarks compare the two).
pub fn set_force_fallback(on: bool) {
    FORCE_FALLBACK.store(on, Ordering::Relaxed);
}
