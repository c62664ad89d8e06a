//! The vector code of `nn::Conv2d`'s Winograd F(2×2, 3×3) path: a
//! block's tiles as runs along a row of tiles ([`runs`]), and the AVX-512
//! transforms of 16 tiles at a time, of the split planes and of the
//! weights (`x86`). The portable form of every transform, and the choice
//! between the two, stay with the convolution: these give the same bits.

pub mod runs;
#[cfg(target_arch = "x86_64")]
pub mod x86;
