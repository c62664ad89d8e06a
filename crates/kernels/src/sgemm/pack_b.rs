//! B as its owner packs it ([`Panels`]): strip by strip or a panel at a
//! time, or read where it lies; [`Matrix`], a strided B.

use super::blocking::FAR_ROWS;
use super::layout::Layout;
use crate::{simd_level, SimdLevel};

/// B as its owner packs it: rows `p0..p0 + kc` of columns `j0..j0 + nr`
/// into `out`, row p at `out[(p − p0)·width..][..width]`, columns past `nr`
/// zero (`nr ≤ width`, the microkernel's NR).
pub trait Panels: Sync {
    /// B's columns.
    fn cols(&self) -> usize;
    /// Pack one strip.
    fn pack(&self, p0: usize, kc: usize, j0: usize, nr: usize, width: usize, out: &mut [f32]);
    /// Rows `p0..p0 + kc` of columns `j0..j0 + nr` where they lie, when
    /// the microkernel can read them there instead of a packed strip: the
    /// first row's first element and the floats from one row to the next
    /// (each row's `nr` floats contiguous, all `kc` rows inside B).
    fn in_place(
        &self,
        _p0: usize,
        _kc: usize,
        _j0: usize,
        _nr: usize,
    ) -> Option<(*const f32, usize)> {
        None
    }
    /// Pack the strips of columns `j0..j0 + n` one after another, strip s
    /// at `out[s·kc·width..]` as [`Panels::pack`] lays it out (the last
    /// strip cut short when `n` is not a multiple of `width`), where that
    /// pays; `false` (nothing written) where strip by strip is as good:
    /// the default.
    fn pack_panel(
        &self,
        _p0: usize,
        _kc: usize,
        _j0: usize,
        _n: usize,
        _width: usize,
        _out: &mut [f32],
    ) -> bool {
        false
    }
}

/// B as a matrix in memory.
pub struct Matrix<'a> {
    pub b: &'a [f32],
    pub k: usize,
    pub n: usize,
    pub layout: Layout,
}

impl Panels for Matrix<'_> {
    fn cols(&self) -> usize {
        self.n
    }

    fn pack(&self, p0: usize, kc: usize, j0: usize, nr: usize, width: usize, out: &mut [f32]) {
        debug_assert!(p0 + kc <= self.k && j0 + nr <= self.n);
        crate::dispatch!(|| self.pack_rows(p0, kc, j0, nr, width, out))
    }

    fn in_place(&self, p0: usize, kc: usize, j0: usize, nr: usize) -> Option<(*const f32, usize)> {
        let l = &self.layout;
        if kc == 0 || !l.contiguous(j0, nr) {
            return None;
        }
        let first = l.at(p0, j0);
        // Every row's run inside b (the last row's end bounds them all).
        assert!(
            p0 + kc <= self.k && j0 + nr <= self.n && l.at(p0 + kc - 1, j0) + nr <= self.b.len(),
            "sgemm: B too small"
        );
        Some((self.b[first..].as_ptr(), l.rs))
    }

    /// Rows at least [`FAR_ROWS`] apart whose columns lie contiguous are
    /// read row by row across every strip of the panel: one run of `n`
    /// floats a row, which the prefetchers follow, rather than `width`
    /// floats a row apart strip after strip (`bench gemm`'s conv shape,
    /// rows 8 KiB apart, spent a third of its time packing B strip by
    /// strip).
    fn pack_panel(
        &self,
        p0: usize,
        kc: usize,
        j0: usize,
        n: usize,
        width: usize,
        out: &mut [f32],
    ) -> bool {
        let whole = n / width * width;
        let l = &self.layout;
        if whole == 0 || l.rs < FAR_ROWS || !l.contiguous(j0, n) || !matches!(width, 16 | 64) {
            return false;
        }
        debug_assert!(p0 + kc <= self.k && j0 + n <= self.n);
        self.copy_panel(p0, kc, j0, whole, width, out);
        if whole < n {
            let strip = &mut out[whole / width * kc * width..][..kc * width];
            self.pack(p0, kc, j0 + whole, n - whole, width, strip);
        }
        true
    }
}

impl Matrix<'_> {
    #[inline(always)]
    pub(super) fn pack_rows(
        &self,
        p0: usize,
        kc: usize,
        j0: usize,
        nr: usize,
        width: usize,
        out: &mut [f32],
    ) {
        let l = &self.layout;
        if nr == width && l.contiguous(j0, nr) {
            // Whole rows of one segment: fixed-width copies.
            match width {
                64 => return self.copy_strips::<64>(p0, kc, j0, 64, out),
                32 => return self.copy_strips::<32>(p0, kc, j0, 32, out),
                16 => return self.copy_strips::<16>(p0, kc, j0, 16, out),
                _ => {}
            }
        }
        if l.rs == 1 && l.seg == usize::MAX && l.cs != 1 {
            return self.pack_columns(p0, kc, j0, nr, width, out);
        }
        // The strip's runs of columns within one segment: (first column
        // in the strip, offset of its first element from its row's, length).
        let mut runs = [(0usize, 0usize, 0usize); 64];
        let mut count = 0;
        let mut j = 0;
        while j < nr && count < runs.len() {
            let at = j0 + j;
            let run = if l.cs != 1 { 1 } else { l.run(at, nr - j) };
            runs[count] = (j, l.at(0, at), run);
            count += 1;
            j += run;
        }
        if j < nr {
            // Too many runs for the table (a strided B wider than 64):
            // element by element.
            for p in 0..kc {
                let row = &mut out[p * width..][..width];
                for (t, v) in row[..nr].iter_mut().enumerate() {
                    *v = self.b[l.at(p0 + p, j0 + t)];
                }
                zero_short(&mut row[nr..]);
            }
            return;
        }
        for p in 0..kc {
            let row = &mut out[p * width..][..width];
            let base = (p0 + p) * l.rs;
            for &(j, off, len) in &runs[..count] {
                copy_short(&mut row[j..j + len], &self.b[base + off..][..len]);
            }
            zero_short(&mut row[nr..]);
        }
    }

    /// A strip of a B whose columns lie contiguous along k (`rs` = 1: Vᵀ
    /// of a row-major V): its 16 × 16 blocks transposed in registers on
    /// AVX-512, 8 × 8 blocks elsewhere and beside them
    /// ([`crate::transpose::transpose_blocks`]), the edges element by
    /// element, columns past `nr` zero. The 16 × 16 blocks take a third
    /// fewer shuffles and load and store whole lines.
    #[inline(always)]
    pub(super) fn pack_columns(
        &self,
        p0: usize,
        kc: usize,
        j0: usize,
        nr: usize,
        width: usize,
        out: &mut [f32],
    ) {
        let cs = self.layout.cs;
        assert!(
            (j0 + nr - 1) * cs + p0 + kc <= self.b.len() && out.len() >= kc * width,
            "sgemm: B too small"
        );
        // The rows and columns done by whole blocks.
        #[cfg(not(target_arch = "x86_64"))]
        let (rows, cols) = (0, 0);
        #[cfg(target_arch = "x86_64")]
        let (rows, cols) = if simd_level() >= SimdLevel::Avx2 {
            (kc / 8 * 8, nr / 8 * 8)
        } else {
            (0, 0)
        };
        #[cfg(target_arch = "x86_64")]
        if rows > 0 && cols > 0 {
            let src = self.b[j0 * cs + p0..].as_ptr();
            let wide = simd_level() == SimdLevel::Avx512;
            // SAFETY: AVX2 is present (rows > 0 only then), AVX-512F where
            // `wide`; the last block reads up to (j0 + cols − 1)·cs + p0 +
            // rows ≤ b.len() and writes up to (rows − 1)·width + cols ≤
            // out.len() (asserted).
            unsafe {
                crate::transpose::transpose_blocks(
                    (src, cs),
                    (rows, cols),
                    (out.as_mut_ptr(), width),
                    wide,
                )
            };
        }
        for p in 0..kc {
            let row = &mut out[p * width..][..width];
            let first = if p < rows { cols } else { 0 };
            for (j, v) in row.iter_mut().enumerate().take(nr).skip(first) {
                *v = self.b[(j0 + j) * cs + p0 + p];
            }
            zero_short(&mut row[nr..]);
        }
    }

    /// Whole strips of `width` (16 or 64) of columns `j0..j0 + n`
    /// (contiguous in each row), row by row across the strips
    /// ([`Matrix::copy_strips`]).
    pub(super) fn copy_panel(
        &self,
        p0: usize,
        kc: usize,
        j0: usize,
        n: usize,
        width: usize,
        out: &mut [f32],
    ) {
        crate::dispatch!(|| match width {
            64 => self.copy_strips::<64>(p0, kc, j0, n, out),
            _ => self.copy_strips::<16>(p0, kc, j0, n, out),
        })
    }

    /// Strips of W of columns `j0..j0 + n` (n a multiple of W, contiguous
    /// in each row), strip s at `out[s·kc·W..]`, row by row of B: one strip
    /// when n = W.
    #[inline(always)]
    pub(super) fn copy_strips<const W: usize>(
        &self,
        p0: usize,
        kc: usize,
        j0: usize,
        n: usize,
        out: &mut [f32],
    ) {
        let first = self.layout.at(p0, j0);
        let out = &mut out[..n / W * kc * W];
        for p in 0..kc {
            let src = &self.b[first + p * self.layout.rs..][..n];
            for (s, src) in src.chunks_exact(W).enumerate() {
                let row = &mut out[(s * kc + p) * W..][..W];
                for (d, v) in row.iter_mut().zip(src) {
                    *d = *v;
                }
            }
        }
    }
}

/// dst = src for runs of a strip's width at most: in chunks of 8 (a
/// `copy_from_slice` calls `memcpy`, whose call costs more than these few
/// floats).
#[inline(always)]
pub(super) fn copy_short(dst: &mut [f32], src: &[f32]) {
    let mut d = dst.chunks_exact_mut(8);
    let mut s = src.chunks_exact(8);
    for (d, s) in (&mut d).zip(&mut s) {
        let v: [f32; 8] = std::array::from_fn(|t| s[t]);
        d.copy_from_slice(&v);
    }
    for (d, s) in d.into_remainder().iter_mut().zip(s.remainder()) {
        *d = *s;
    }
}

/// dst = 0, likewise.
#[inline(always)]
pub(super) fn zero_short(dst: &mut [f32]) {
    let mut d = dst.chunks_exact_mut(8);
    for d in &mut d {
        d.copy_from_slice(&[0.0; 8]);
    }
    for d in d.into_remainder() {
        *d = 0.0;
    }
}
