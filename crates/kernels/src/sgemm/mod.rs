//! An f32 GEMM of our own: C (+)= A · B on register-tiled microkernels
//! (AVX-512 or AVX2 + FMA, chosen at run time by [`super::simd_level`]),
//! with A packed once per call ([`PackedA`]) and B's strips packed by its
//! owner ([`Panels`]) straight from where B lies: a convolution's output
//! gradient, image by image, is read in place (no gathered copy).
//!
//! | level | AVX-512 | AVX2 + FMA | holds |
//! |-------|---------|------------|-------|
//! | microkernel (`micro`) | 6 rows × 64 columns (a strip's last tile of 1–4 rows: 2 or 4 × 64) | 6 × 16 | 24 (12) vector accumulators; per k: 4 (2) vector loads of B, 6 broadcasts of A, 24 (12) FMAs |
//! | A (`pack_a`) | every row × KC per block | the same | packed once per call (its strips over the threads when large), MR rows per strip, k-major; or read where it lies, MR rows of it per tile ([`gemm_rows`]) |
//! | B strip (`pack_b`) | KC × 64 | KC × 16 | packed per strip, k-major, 64-byte aligned, or read where it lies when its rows are contiguous and shallow |
//! | B panel (`pack_b`) | KC × NC | the same | every strip of NC columns ready before the first tile |
//!
//! The loops (`driver`): per block of KC of k, per panel of NC columns of
//! B (its strips packed, or found where they lie), per strip of A (MR ×
//! KC: it stays in L1), every strip of the panel (streamed from L2), as
//! BLIS's Skylake-X kernels run. KC and NC come from the cache sizes the
//! CPU reports (`blocking`). Each C element is the sum over its k in
//! order, block after block: the same result for any thread count
//! (threads split the columns) and any layout of C ([`Out`]: rows `ldc`
//! apart, columns in segments, so a convolution's planes are written in
//! place).
//!
//! It is used where its packing wins over the `gemm` crate's: a
//! convolution's input gradient on small images (A = Wᵀ packed once per
//! call, G read in place), A · Bᵀ with Bᵀ's columns contiguous (a
//! `Linear`'s x · Wᵀ, the head's logits: [`super::dot::matmul_abt`]), and
//! Winograd's transforms: [`gemm_transposed`] multiplies by Aᵀ reading the
//! same packed A across its strips (the same sums in the same order as
//! [`gemm`] on Aᵀ packed: the same bits), and [`gemm_rows`] reads an A that
//! few tiles use where it lies (a weight gradient dU\[ξ\] = dM\[ξ\] ·
//! V\[ξ\]ᵀ, chunk by chunk). `shardnet bench gemm` measures each form
//! against the FMA peak and the `gemm` crate.

mod blocking;
mod driver;
mod layout;
mod micro;
mod pack_a;
mod pack_b;
#[cfg(test)]
mod tests;

pub use blocking::{blocking, Blocking, ACROSS_SLACK};
pub use driver::{gemm, gemm_rows, gemm_transposed, Rows};
pub use layout::{Layout, Out};
pub use pack_a::{PackedA, Place};
pub use pack_b::{Matrix, Panels};

use super::{simd_level, SimdLevel};
use blocking::MR;

/// The microkernel in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Micro {
    /// 6 × 64 on zmm registers.
    Avx512,
    /// 6 × 16 on ymm registers.
    Avx2,
}

impl Micro {
    /// This CPU's widest microkernel under [`super::set_simd_level`]'s
    /// cap; `None` on baseline vectors (the caller takes the `gemm` crate).
    pub fn now() -> Option<Micro> {
        if !cfg!(target_arch = "x86_64") {
            return None;
        }
        match simd_level() {
            SimdLevel::Avx512 => Some(Micro::Avx512),
            SimdLevel::Avx2 => Some(Micro::Avx2),
            SimdLevel::Baseline => None,
        }
    }

    /// Rows of the tile ([`MR`] on either level).
    pub fn mr(self) -> usize {
        MR
    }

    /// Columns of the tile.
    pub fn nr(self) -> usize {
        match self {
            Micro::Avx512 => 64,
            Micro::Avx2 => 16,
        }
    }
}

/// Every microkernel this CPU runs (one at least on x86-64): what the
/// tests force in turn.
#[cfg(test)]
pub fn micros() -> Vec<Micro> {
    let micros: Vec<Micro> = [Micro::Avx512, Micro::Avx2]
        .into_iter()
        .filter(|m| match m {
            Micro::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            Micro::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
        })
        .collect();
    assert!(!micros.is_empty() || !cfg!(target_arch = "x86_64"));
    micros
}
