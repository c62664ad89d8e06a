//! A dense 3 × 3 convolution's kernel taps on 2 × 2 images as the `sgemm`
//! B operand ([`Taps`]): W (4O × 4C) of the taps, or its transpose, packed
//! strip by strip straight from w (AVX-512: 16 kernels to a strip by
//! permutes). `nn::Conv2d`'s dense path runs its passes on it.

use crate::sgemm::Panels;

/// `TAP[q][p]`: the tap (of 9) joining input pixel q to output pixel p
/// (pixels of the 2 × 2 image row-major).
pub const TAP: [[usize; 4]; 4] = {
    let mut t = [[0; 4]; 4];
    let mut q = 0;
    while q < 4 {
        let mut p = 0;
        while p < 4 {
            t[q][p] = (q / 2 + 1 - p / 2) * 3 + (q % 2 + 1 - p % 2);
            p += 1;
        }
        q += 1;
    }
    t
};

/// W's taps as B, strip by strip: the forward's Wᵀ (rows (c, q), columns
/// (o, p)) or the input gradient's W (rows (o, p), columns (c, q)).
pub struct Taps<'a> {
    /// The kernels, (O, C, 3, 3) row-major.
    pub w: &'a [f32],
    /// Input channels.
    pub c: usize,
    /// Output channels.
    pub o: usize,
    /// The input gradient's W (rows (o, p)), else the forward's Wᵀ.
    pub input_grad: bool,
}

impl Taps<'_> {
    /// B[k][j].
    #[inline(always)]
    pub fn at(&self, k: usize, j: usize) -> f32 {
        let ((o, p), (c, q)) = if self.input_grad {
            ((k / 4, k % 4), (j / 4, j % 4))
        } else {
            ((j / 4, j % 4), (k / 4, k % 4))
        };
        self.w[(o * self.c + c) * 9 + TAP[q][p]]
    }
}

impl Panels for Taps<'_> {
    fn cols(&self) -> usize {
        4 * if self.input_grad { self.c } else { self.o }
    }

    fn pack(&self, p0: usize, kc: usize, j0: usize, nr: usize, width: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if nr == 64 && width == 64 && crate::simd_level() == crate::SimdLevel::Avx512 {
            assert!(self.w.len() >= self.o * self.c * 9 && out.len() >= kc * 64);
            assert!(p0 + kc <= 4 * if self.input_grad { self.o } else { self.c });
            assert!(
                p0.is_multiple_of(4) && kc.is_multiple_of(4),
                "whole kernels of rows"
            );
            assert!(j0 + 64 <= self.cols() && j0.is_multiple_of(4));
            // SAFETY: AVX-512F is present (simd_level); every kernel read
            // lies in w (its row and its 16 columns' kernels inside B:
            // asserted), every write in out's kc rows of 64.
            unsafe { x86::pack64(self, p0, kc, j0, out) };
            return;
        }
        for p in 0..kc {
            let row = &mut out[p * width..][..width];
            for (t, v) in row[..nr].iter_mut().enumerate() {
                *v = self.at(p0 + p, j0 + t);
            }
            row[nr..].fill(0.0);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Taps, TAP};
    use std::arch::x86_64::*;

    /// Rows p0..p0 + kc of columns j0..j0 + 64 of B, a kernel row (4 rows
    /// of B: one input channel of the forward's Wᵀ, one output channel of
    /// W) at a time: the 16 kernels the strip's columns take in it (9 taps
    /// each, one masked load) give its 4 × 64 values by permutes, four
    /// kernels to a vector. Lane l of a row is column j0 + l: the (l/4)-th
    /// kernel, pixel l % 4. Replaces four 16-lane gathers a row, which
    /// took 3.4% of a one-core VGG16 step at batch 32 (a Sapphire Rapids
    /// core).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack64(b: &Taps<'_>, p0: usize, kc: usize, j0: usize, out: &mut [f32]) {
        let w = b.w.as_ptr();
        // Row r of a kernel row, place s of a kernel's four columns: tap
        // TAP[q][p] with (q, p) = (r, s) in the forward (rows (c, q),
        // columns (o, p)), (s, r) in the input gradient (rows (o, p),
        // columns (c, q)). Lanes 0–3 from the first source, 4–7 (16 + t)
        // from the second; lanes 8–15 unused.
        let pick: [__m512i; 4] = std::array::from_fn(|r| {
            let lanes: [i32; 16] = std::array::from_fn(|l| {
                let s = l % 4;
                let t = if b.input_grad { TAP[s][r] } else { TAP[r][s] } as i32;
                match l {
                    0..4 => t,
                    4..8 => 16 + t,
                    _ => 0,
                }
            });
            _mm512_loadu_si512(lanes.as_ptr() as *const _)
        });
        let first = j0 / 4;
        for g in 0..kc / 4 {
            let k0 = p0 / 4 + g;
            // The strip's 16 kernels in kernel row k0: (first's taps, floats
            // from one kernel's taps to the next).
            let (start, stride) = if b.input_grad {
                ((k0 * b.c + first) * 9, 9)
            } else {
                ((first * b.c + k0) * 9, b.c * 9)
            };
            let taps: [__m512; 16] =
                std::array::from_fn(|i| _mm512_maskz_loadu_ps(0x1ff, w.add(start + i * stride)));
            for (r, pick) in pick.iter().enumerate() {
                let row = out.as_mut_ptr().add((4 * g + r) * 64);
                for q in 0..4 {
                    let ab = _mm512_permutex2var_ps(taps[4 * q], *pick, taps[4 * q + 1]);
                    let cd = _mm512_permutex2var_ps(taps[4 * q + 2], *pick, taps[4 * q + 3]);
                    // Lanes 0–7 of each: kernels 4q, 4q + 1, then 4q + 2, 4q + 3.
                    _mm512_storeu_ps(row.add(16 * q), _mm512_shuffle_f32x4::<0x44>(ab, cd));
                }
            }
        }
    }
}
