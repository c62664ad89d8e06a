//! Test helpers for the kernels and the crates above (feature
//! `test-util`): seeded operands, the SIMD level's lock, and the check
//! that a dispatched pass gives the same bits at every level.

use crate::{set_simd_level, simd_level, SimdLevel};

/// Seeded test operands in [-1, 1) (a linear congruential stream: the
/// kernels' tests may not import `rng`, which sits above them).
pub fn test_values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// One test at a time moves the [`SimdLevel`] (tests run in parallel
/// threads): hold this while it is moved.
pub fn level_lock() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` at every [`SimdLevel`] this CPU has (and the baseline), and
/// checks each result equals the baseline's bit for bit (`bits` turns a
/// result into comparable bits). For the tests of dispatched passes.
pub fn assert_same_at_every_level<R, B: PartialEq + std::fmt::Debug>(
    what: &str,
    f: impl Fn() -> R,
    bits: impl Fn(&R) -> B,
) {
    let _one = level_lock();
    let cpu = {
        set_simd_level(SimdLevel::Avx512);
        simd_level()
    };
    set_simd_level(SimdLevel::Baseline);
    let want = bits(&f());
    for level in [SimdLevel::Avx2, SimdLevel::Avx512] {
        if level > cpu {
            continue;
        }
        set_simd_level(level);
        assert_eq!(
            bits(&f()),
            want,
            "{what}: {level:?} differs from the baseline"
        );
    }
    set_simd_level(SimdLevel::Avx512);
}
