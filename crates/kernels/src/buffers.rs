//! Work buffers: an output a kernel writes whole (not zeroed), a kept
//! buffer's first n elements (grown and zeroed only past its length),
//! and the same from a 64-byte boundary.

use crate::Float;

/// `n` elements for a kernel that writes every one of them before any is
/// read: its output, allocated without the zeroing pass of `vec![0; n]`
/// (a memset on the calling thread before the parallel pass that fills
/// the output: 3.7% of the samples of a one-core VGG16 step at batch 32,
/// and on two threads the other core idles meanwhile). In unit tests
/// (this crate's, and those of crates that build it with the feature
/// `test-util`) and in debug builds every element starts as `poison` (NaN
/// for floats), so a kernel that leaves one unwritten fails a test that
/// checks its values.
#[allow(clippy::uninit_vec)] // each caller writes every element first
pub fn unfilled<T: Copy>(n: usize, poison: T) -> Vec<T> {
    if cfg!(any(test, debug_assertions, feature = "test-util")) {
        return vec![poison; n];
    }
    let mut v = Vec::with_capacity(n);
    // SAFETY: the capacity holds n elements of a Copy type (nothing to
    // drop); they are uninitialised until the caller writes them, and it
    // writes each before any is read (this function's contract, which the
    // unit tests' poison checks).
    unsafe { v.set_len(n) };
    v
}

/// The first `n` elements of a kept work buffer, grown (zeroed) only past
/// its length: shrinking and growing it again between layers zeroes
/// nothing, so the caller must write every element it reads.
pub fn sized<T: Float>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::ZERO);
    }
    &mut v[..n]
}

/// Floats of slack a buffer holds for [`sized_aligned`]: up to one cache
/// line's worth less one.
const ALIGN_SLACK: usize = 64 / std::mem::size_of::<f32>() - 1;

/// `n` floats of `v` (grown as [`sized`] grows it, with [`ALIGN_SLACK`]
/// more) from its first 64-byte boundary on, so that a microkernel's vector
/// loads and stores never split a cache line. Where the slice starts may
/// move when `v` grows (its contents are scratch); while `v` holds enough,
/// every call gives the same place ([`aligned`] reads it). Measured on the
/// Cascade Lake core (`sgemm` alone, best of 300, GFLOP/s): a Winograd
/// GEMM whose B starts 16 bytes past a line, 64 × 256 × 64 92 against 119
/// aligned, 128 × 64 × 128 103 against 126.
pub fn sized_aligned(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n + ALIGN_SLACK {
        v.resize(n + ALIGN_SLACK, 0.0);
    }
    let skip = v.as_ptr().align_offset(64).min(ALIGN_SLACK);
    &mut v[skip..skip + n]
}

/// The `n` floats [`sized_aligned`] last gave of `v` (which holds them).
pub fn aligned(v: &[f32], n: usize) -> &[f32] {
    let skip = v.as_ptr().align_offset(64).min(ALIGN_SLACK);
    &v[skip..skip + n]
}

#[cfg(test)]
mod tests {
    use super::{aligned, sized_aligned};

    /// Each buffer starts a cache line, holds what it was asked for, and
    /// stays where it is (with what was written there) while big enough.
    #[test]
    fn sized_aligned_starts_a_line_and_stays_put() {
        for n in [1usize, 15, 16, 17, 1000, 4099] {
            let mut v = Vec::new();
            let first = sized_aligned(&mut v, n);
            assert_eq!(first.len(), n);
            assert_eq!(first.as_ptr() as usize % 64, 0, "n = {n}");
            first[n - 1] = 7.0;
            let at = first.as_ptr();
            let again = sized_aligned(&mut v, n / 2 + 1);
            assert_eq!(again.as_ptr(), at, "n = {n}");
            assert_eq!(aligned(&v, n)[n - 1], 7.0, "n = {n}");
            assert_eq!(aligned(&v, n).as_ptr(), at, "n = {n}");
        }
    }
}
