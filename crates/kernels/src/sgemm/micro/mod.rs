//! The microkernels: one call multiplies a tile of MR rows of A by a
//! strip of B into a tile of C, on AVX-512 (`avx512`) or AVX2 + FMA
//! (`avx2`); `x86` holds what both read A and C with.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod x86;

use super::blocking::MR;
use super::Micro;

/// One microkernel call: `kc` steps of A and of B's strip `b` (NR per
/// k), the first `rows` rows of the tile into `c` (rows `ldc` apart, NR
/// contiguous columns each), added to what is there when `add`. A is read
/// as `read` says: from its packed strip `a` (MR per k), in place from a
/// packed A of its transpose, or in place from A's rows.
#[derive(Clone, Copy)]
pub(super) struct Call {
    pub(super) kc: usize,
    pub(super) a: *const f32,
    pub(super) b: *const f32,
    /// Floats from one k's NR values of B to the next (NR when packed).
    pub(super) ldb: usize,
    pub(super) c: *mut f32,
    pub(super) ldc: usize,
    pub(super) rows: usize,
    pub(super) add: bool,
    pub(super) read: Read,
}

/// How a microkernel reads its A.
#[derive(Clone, Copy)]
pub(super) enum Read {
    /// A packed strip: k-major, MR floats per k.
    Packed,
    /// Across a packed A of Aᵀ ([`Across`]).
    Across(Across),
    /// A's rows where they lie, each contiguous along k: row r at
    /// `offs[r]` floats from the tile's first.
    Rows([usize; MR]),
}

/// Where the k-th column of a tile's MR rows lies when A is read in place
/// from a packed A of Aᵀ ([`gemm_transposed`]): that packed A's k-th row
/// holds them, MR floats apart, and its rows run in strips of MR (one
/// float apart within a strip, `stride` floats from one strip to the
/// next). `a` points at the first k's strip start; the first k is row
/// `phase` of that strip.
#[derive(Clone, Copy)]
pub(super) struct Across {
    pub(super) phase: usize,
    pub(super) stride: usize,
}

/// The microkernel of `micro`.
#[inline(always)]
pub(super) unsafe fn kernel(micro: Micro, call: Call) {
    #[cfg(target_arch = "x86_64")]
    match (micro, call.read, call.rows) {
        // A strip's last tile of 1–4 rows (64 = 10 · 6 + 4 rows, 128 =
        // 21 · 6 + 2) runs those rows only, not six.
        (Micro::Avx512, Read::Packed, 0..=2) => avx512::tile_avx512::<2, 6, 1>(call),
        (Micro::Avx512, Read::Packed, 3..=4) => avx512::tile_avx512::<4, 6, 1>(call),
        (Micro::Avx512, Read::Packed, _) => avx512::tile_avx512::<6, 6, 1>(call),
        (Micro::Avx512, Read::Across(_), 0..=2) => avx512::tile_avx512::<2, 1, 6>(call),
        (Micro::Avx512, Read::Across(_), 3..=4) => avx512::tile_avx512::<4, 1, 6>(call),
        (Micro::Avx512, Read::Across(_), _) => avx512::tile_avx512::<6, 1, 6>(call),
        (Micro::Avx512, Read::Rows(_), 0..=2) => avx512::tile_avx512::<2, 1, 0>(call),
        (Micro::Avx512, Read::Rows(_), 3..=4) => avx512::tile_avx512::<4, 1, 0>(call),
        (Micro::Avx512, Read::Rows(_), _) => avx512::tile_avx512::<6, 1, 0>(call),
        (Micro::Avx2, Read::Packed, _) => avx2::tile_avx2::<6, 1>(call),
        (Micro::Avx2, Read::Across(_), _) => avx2::tile_avx2::<1, 6>(call),
        (Micro::Avx2, Read::Rows(_), _) => avx2::tile_avx2::<1, 0>(call),
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (micro, call);
        unreachable!("sgemm: no microkernel off x86-64 (Micro::now is None)")
    }
}
