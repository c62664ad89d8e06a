//! An f32 GEMM of our own: C (+)= A · B on register-tiled microkernels
//! (AVX-512 or AVX2 + FMA, chosen at run time by [`super::simd_level`]),
//! with A packed once per call ([`PackedA`]) and B's strips packed by its
//! owner ([`Panels`]) straight from where B lies: a convolution's output
//! gradient, image by image, is read in place (no gathered copy).
//!
//! | level | AVX-512 | AVX2 + FMA | holds |
//! |-------|---------|------------|-------|
//! | microkernel | 6 rows × 64 columns (a strip's last tile of 1–4 rows: 2 or 4 × 64) | 6 × 16 | 24 (12) vector accumulators; per k: 4 (2) vector loads of B, 6 broadcasts of A, 24 (12) FMAs |
//! | A ([`PackedA`]) | every row × [`KC`] per block | the same | packed once per call, MR rows per strip, k-major (a broadcast reads one float; a row-major A's 6 rows interleaved by 8 × 8 transposes); or read where it lies, MR rows of it per tile ([`gemm_rows`]) |
//! | B strip | [`KC`] × 64 | [`KC`] × 16 | packed per strip, k-major, 64-byte aligned (a B whose columns are contiguous, Vᵀ, by 16 × 16 transposes on AVX-512, 8 × 8 beside them and on AVX2), or read where it lies when its rows are contiguous and at most [`IN_PLACE_MAX_K`] deep |
//! | B panel | [`KC`] × [`NC`] | the same | every strip of NC columns ready before the first tile; where B's rows lie [`FAR_ROWS`] or more apart its strips are packed together, each row of B read across them |
//!
//! The loops: per block of KC of k, per panel of NC columns of B (its
//! strips packed, or found where they lie), per strip of A (MR × KC: it
//! stays in L1), every strip of the panel (streamed from L2): the
//! broadcast operand held in L1 and the vector operand streamed past it,
//! as BLIS's Skylake-X kernels run. Each C element is the sum over
//! its k in order, block after block (each block's sum added to C in
//! turn): the same result for any thread count (threads split the
//! columns) and any layout of C.
//!
//! Measured on one Sapphire Rapids core: the 6 × 64 microkernel alone, its strips in L1, at 203–207
//! GFLOP/s (86–87% of a 237 peak; a 12 × 32 tile 211–214), 181 once its
//! B strip outgrows L1; in a whole GEMM 140–185, the `gemm` crate's
//! 160–210 alongside. It wins where its packing does: a convolution's input
//! gradient on small images (A = Wᵀ packed once per call instead of once
//! per chunk, G read in place), which is where `nn::conv` uses it, and
//! at A · Bᵀ with Bᵀ's columns contiguous (a `Linear`'s x · Wᵀ, the head's
//! logits: [`super::dot::matmul_abt`]), where the crate gathers Bᵀ at the
//! stride of W's rows.
//!
//! On one Cascade Lake core (L1 32 KiB, L2 1 MiB, a
//! 140–152 GFLOP/s peak), A's strips kept in L1 with B's strips streamed
//! past them, against B's strip kept and A streamed: 1024³ 101–102 →
//! 106–108 GFLOP/s, the conv shape 84–88 → 87–92, Winograd's shapes
//! unchanged (`shardnet bench gemm`, alternated); one-core VGG16 even (3
//! of 6 pairs each way).
//!
//! [`gemm_transposed`] multiplies by Aᵀ with the same packed A, read in
//! place across its strips (per k, the tile's MR rows MR floats apart
//! within one strip of A; strip after strip): a Winograd convolution's
//! input gradient reads the forward's U that way instead of packing Uᵀ,
//! whose transposed writes cost 1.6× U's. The sums are the same, in the
//! same order, as [`gemm`] on Aᵀ packed: the same bits. A tile read across
//! takes MR × MR floats from each strip of A, the strips kc·MR floats
//! apart (12 KiB at kc = 512: the same L1 set each time, and no run that a
//! prefetcher follows), so the microkernel prefetches them 4 strips
//! ahead. Measured on the Cascade Lake core (`bench
//! gemm`'s across column against the forward in the same run,
//! alternated): at 512 × 64 × 512 0.66–0.73 of the forward's rate →
//! 0.87–0.91, at 256 × 128 × 256 0.78–0.83 → 0.88–0.96; in one-core VGG16
//! at batch 32 the sgemm's share of the samples 28.4–28.8% → 26.0–26.2%.
//!
//! [`gemm_rows`] reads A where it lies: each tile's MR rows, k after k,
//! from their own places (a broadcast per row, as from a packed strip).
//! It is for an A that only few tiles of C use, a Winograd convolution's
//! weight gradient dU\[ξ\] = dM\[ξ\] · V\[ξ\]ᵀ chunk by chunk (O × C × the
//! chunk's tiles, 64 to 256 deep), where packing A cost as much as a good
//! part of its use. Measured there on the Cascade Lake core (16 GEMMs per shape, best of 15, GFLOP/s, the `gemm` crate's
//! strided GEMM / ours with A packed / ours with A in place, one run):
//! 64 × 64 × 256 62 / 74 / 87, 128 × 128 × 64 87 / 77 / 84, 128 × 128 ×
//! 512 73 / 80 / 93, 512 × 512 × 64 81 / 76 / 77. Row-major A packed
//! element by element had cost as much as the tiles: 128 × 64 × 64 at 59
//! GFLOP/s, 80 with the 8 × 8 transposes.
//!
//! C's layout ([`Out`]): rows `ldc` apart, and its columns in segments of
//! `seg` contiguous elements `seg_stride` apart: a row-major matrix has one
//! segment, a convolution's planes one per image. A tile whose columns lie
//! in one segment is stored straight; one across segments (or cut at an
//! edge) goes through a tile buffer.

use super::{simd_level, SimdLevel};

/// k per block (the depth of every microkernel call). 512 rather than
/// 256: C's tiles are loaded and stored half as often, which outweighs a
/// B strip (512 × 64 floats, 128 KiB) read from L2 rather than L1 —
/// `bench gemm`'s conv shape 142 → 156–161 GFLOP/s, one-core VGG16 at
/// batch 32 0–4% faster in 6 alternated pairs (a Sapphire Rapids core);
/// 128 was slower (117–128).
pub const KC: usize = 512;
/// Columns of B packed together per block of k (a panel of strips): each
/// row of B read in runs of 256 floats rather than one strip's width (64
/// on AVX-512). The panel, KC × NC floats (512 KiB), stays in L2 while
/// its strips are used.
const NC: usize = 256;
/// B's rows at least this many floats apart (2 KiB) are packed a panel at
/// a time ([`Panels::pack_panel`]); nearer rows (Winograd's chunks, rows
/// of at most 128 columns) strip by strip into the panel's buffer. Packed
/// as panels there, one-core VGG16 ran 1.6% slower over 6 alternated
/// pairs (a Sapphire Rapids core, with each strip used as soon as it was
/// packed).
const FAR_ROWS: usize = 512;
/// Rows of every microkernel's tile (either level).
const MR: usize = 6;
/// The widest tile (AVX-512): the local tile buffer's size.
const MAX_TILE: usize = MR * 64;

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

/// Where a matrix's element (i, j) lies: `i·rs + (j / seg)·seg_stride +
/// j % seg`. A strided matrix is one segment (`seg` = usize::MAX) with
/// column stride `cs`; an images layout has `cs` = 1.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    rs: usize,
    cs: usize,
    seg: usize,
    seg_stride: usize,
}

impl Layout {
    /// Row stride `rs`, column stride `cs`.
    pub fn strided(rs: usize, cs: usize) -> Self {
        Layout {
            rs,
            cs,
            seg: usize::MAX,
            seg_stride: 0,
        }
    }

    /// `rows` × (images · `hw`) stored as images of `rows` planes of `hw`
    /// (NCHW): element (r, b·hw + t) at (b·rows + r)·hw + t.
    pub fn images(rows: usize, hw: usize) -> Self {
        Layout {
            rs: hw,
            cs: 1,
            seg: hw.max(1),
            seg_stride: rows * hw,
        }
    }

    #[inline(always)]
    fn at(&self, i: usize, j: usize) -> usize {
        if self.seg == usize::MAX {
            i * self.rs + j * self.cs
        } else {
            i * self.rs + (j / self.seg) * self.seg_stride + j % self.seg
        }
    }

    /// The length a slice needs to hold an m × n matrix of this layout.
    fn span(&self, m: usize, n: usize) -> usize {
        if m == 0 || n == 0 {
            return 0;
        }
        let last_col = if self.seg == usize::MAX {
            (n - 1) * self.cs
        } else {
            // The last segment's last column, or a full earlier segment's.
            let full = n / self.seg;
            let tail = n % self.seg;
            if tail > 0 {
                full * self.seg_stride + tail - 1
            } else {
                (full - 1) * self.seg_stride + self.seg - 1
            }
        };
        (m - 1) * self.rs + last_col + 1
    }

    /// No two elements of an m × n matrix share a place (what lets
    /// threads write disjoint columns at once): unit column stride, rows
    /// at least a row's run apart, segments at least all rows apart.
    fn injective(&self, m: usize, n: usize) -> bool {
        if self.cs != 1 {
            return false;
        }
        let run = n.min(self.seg);
        let rows_apart = m <= 1 || self.rs >= run;
        let segs_apart = n <= self.seg || self.seg_stride >= (m.max(1) - 1) * self.rs + self.seg;
        rows_apart && segs_apart
    }

    /// How many of the columns j..j + most lie in j's segment.
    fn run(&self, j: usize, most: usize) -> usize {
        if self.seg == usize::MAX {
            most
        } else {
            (self.seg - j % self.seg).min(most)
        }
    }

    /// Columns j..j + len lie contiguous (unit stride, one segment).
    fn contiguous(&self, j: usize, len: usize) -> bool {
        self.cs == 1 && (self.seg == usize::MAX || j / self.seg == (j + len - 1) / self.seg)
    }
}

/// A: every row, packed once per call into the microkernel's strips:
/// block by block of [`KC`], strip by strip of MR rows, k-major (rows past
/// m zero).
pub struct PackedA {
    data: Vec<f32>,
    m: usize,
    k: usize,
    micro: Micro,
}

/// Where a packed A's elements lie (what [`PackedA::new`] writes): block
/// by block of [`KC`] of k, strip by strip of MR rows, k-major. A caller
/// that computes A's elements writes them here itself
/// ([`PackedA::from_filled`]).
#[derive(Clone, Copy, Debug)]
pub struct Place {
    /// Rows per strip.
    pub mr: usize,
    /// Strips (rows past m are zero padding).
    pub strips: usize,
    k: usize,
}

impl Place {
    /// The places of an m × k A on `micro`.
    pub fn of(micro: Micro, m: usize, k: usize) -> Self {
        let mr = micro.mr();
        Place {
            mr,
            strips: m.div_ceil(mr),
            k,
        }
    }

    /// Floats of the packed A.
    pub fn len(&self) -> usize {
        self.strips * self.mr * self.k
    }

    /// Whether the packed A holds no float.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `s·mr + r`, column p: rows of one strip at one column lie
    /// together, and columns p, p + 1 of a block `mr` apart.
    #[inline(always)]
    pub fn at(&self, s: usize, r: usize, p: usize) -> usize {
        let p0 = p - p % KC;
        let kc = KC.min(self.k - p0);
        p0 * self.strips * self.mr + s * kc * self.mr + (p - p0) * self.mr + r
    }
}

impl PackedA {
    /// A (m × k) of `a` laid out as `layout`.
    pub fn new(micro: Micro, m: usize, k: usize, a: &[f32], layout: Layout) -> Self {
        let len = Place::of(micro, m, k).len();
        Self::new_in(Self::spare(len), micro, m, k, a, layout)
    }

    /// This A with the slack that [`gemm_transposed`] reads past it (zero
    /// where the buffer had none).
    pub fn with_across_slack(mut self) -> Self {
        let len = Place::of(self.micro, self.m, self.k).len() + ACROSS_SLACK;
        if self.data.len() < len {
            self.data.resize(len, 0.0);
        }
        self
    }

    /// This thread's smallest spare buffer from the last calls that holds
    /// `len` floats, else its largest (empty when none): a caller that
    /// fills A on other threads takes its buffers here
    /// ([`PackedA::from_filled`]), so that they come back to it when the
    /// packed A are dropped.
    pub fn spare(len: usize) -> Vec<f32> {
        SPARE_A.with(|s| {
            let mut s = s.borrow_mut();
            let at = s.partition_point(|v| v.len() < len);
            if at < s.len() {
                s.remove(at)
            } else {
                s.pop().unwrap_or_default()
            }
        })
    }

    /// [`PackedA::new`] into `data` (any contents; resized).
    fn new_in(
        mut data: Vec<f32>,
        micro: Micro,
        m: usize,
        k: usize,
        a: &[f32],
        layout: Layout,
    ) -> Self {
        assert!(a.len() >= layout.span(m, k), "sgemm: A too small");
        let mr = micro.mr();
        let strips = m.div_ceil(mr);
        // Every element below is written (the buffer grown only past its
        // length: a spare last sized for a smaller A, regrown, had its
        // new part zeroed first).
        let filled = super::sized(&mut data, strips * mr * k);
        for p0 in (0..k).step_by(KC) {
            let kc = KC.min(k - p0);
            let block = &mut filled[p0 * strips * mr..][..strips * mr * kc];
            for (s, strip) in block.chunks_exact_mut(kc * mr).enumerate() {
                let (i0, rows) = (s * mr, mr.min(m - s * mr));
                if layout.rs == 1 && layout.seg == usize::MAX {
                    // Column-major (Wᵀ of a row-major W): each k is `rows`
                    // contiguous floats (a whole strip's copied at a fixed
                    // size: a short `copy_from_slice` calls `memcpy`).
                    for (p, out) in strip.chunks_exact_mut(mr).enumerate() {
                        let at = (p0 + p) * layout.cs + i0;
                        match (<&mut [f32; 6]>::try_from(&mut *out), rows) {
                            (Ok(out), 6) => out.copy_from_slice(&a[at..at + 6]),
                            _ => {
                                for (o, v) in out.iter_mut().zip(&a[at..at + rows]) {
                                    *o = *v;
                                }
                                out[rows..].fill(0.0);
                            }
                        }
                    }
                } else if layout.cs == 1 && layout.seg == usize::MAX {
                    // Row-major: row by row of the strip, each run of k
                    // contiguous.
                    #[cfg(target_arch = "x86_64")]
                    if mr == 6 && simd_level() >= SimdLevel::Avx2 {
                        let at: [*const f32; 6] = std::array::from_fn(|r| {
                            a[(i0 + r.min(rows - 1)) * layout.rs + p0..][..kc].as_ptr()
                        });
                        // SAFETY: AVX2 is present; each of the `rows`
                        // rows holds kc floats from p0 (sliced above), and
                        // the strip 6·kc.
                        unsafe { super::transpose::interleave6(at, rows, kc, strip.as_mut_ptr()) };
                        continue;
                    }
                    if rows < mr {
                        strip.fill(0.0);
                    }
                    for r in 0..rows {
                        let row = &a[(i0 + r) * layout.rs + p0..][..kc];
                        for (out, v) in strip[r..].iter_mut().step_by(mr).zip(row) {
                            *out = *v;
                        }
                    }
                } else {
                    for (p, out) in strip.chunks_exact_mut(mr).enumerate() {
                        for (r, v) in out.iter_mut().enumerate() {
                            *v = if r < rows {
                                a[layout.at(i0 + r, p0 + p)]
                            } else {
                                0.0
                            };
                        }
                    }
                }
            }
        }
        PackedA { data, m, k, micro }
    }

    /// An A whose every element (rows past m zero) its caller wrote into
    /// `data` at [`Place::of`]`(micro, m, k)`.
    pub fn from_filled(data: Vec<f32>, micro: Micro, m: usize, k: usize) -> Self {
        assert!(
            data.len() >= Place::of(micro, m, k).len(),
            "sgemm: packed A too small"
        );
        PackedA { data, m, k, micro }
    }
}

impl Drop for PackedA {
    /// The buffer back to this thread's spares, for the next call (a
    /// fresh one cost its page faults on every call: a few % of a large
    /// layer's gradient). Up to [`SPARES`] are kept, the largest last.
    fn drop(&mut self) {
        let data = std::mem::take(&mut self.data);
        SPARE_A.with(|s| {
            let mut s = s.borrow_mut();
            let at = s.partition_point(|v| v.len() <= data.len());
            s.insert(at, data);
            if s.len() > SPARES {
                s.remove(0);
            }
        });
    }
}

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
        super::dispatch!(|| self.pack_rows(p0, kc, j0, nr, width, out))
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
    fn pack_rows(&self, p0: usize, kc: usize, j0: usize, nr: usize, width: usize, out: &mut [f32]) {
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
    /// ([`super::transpose::transpose_blocks`]), the edges element by
    /// element, columns past `nr` zero. The 16 × 16 blocks take a third
    /// fewer shuffles and load and store whole lines: measured on the
    /// Cascade Lake core (`bench gemm`'s dU = dM·Vᵀ,
    /// 3 alternated runs, GFLOP/s) 64 × 64 × 256 97–101 → 105–115, 128 ×
    /// 128 × 64 109–113 → 114–118, 256 × 256 × 128 122–124 → 126–132,
    /// 512 × 512 × 64 115–118 → 117–122.
    #[inline(always)]
    fn pack_columns(
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
                super::transpose::transpose_blocks(
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
    fn copy_panel(&self, p0: usize, kc: usize, j0: usize, n: usize, width: usize, out: &mut [f32]) {
        super::dispatch!(|| match width {
            64 => self.copy_strips::<64>(p0, kc, j0, n, out),
            _ => self.copy_strips::<16>(p0, kc, j0, n, out),
        })
    }

    /// Strips of W of columns `j0..j0 + n` (n a multiple of W, contiguous
    /// in each row), strip s at `out[s·kc·W..]`, row by row of B: one strip
    /// when n = W.
    #[inline(always)]
    fn copy_strips<const W: usize>(
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
fn copy_short(dst: &mut [f32], src: &[f32]) {
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
fn zero_short(dst: &mut [f32]) {
    let mut d = dst.chunks_exact_mut(8);
    for d in &mut d {
        d.copy_from_slice(&[0.0; 8]);
    }
    for d in d.into_remainder() {
        *d = 0.0;
    }
}

/// C: its elements and layout.
pub struct Out<'a> {
    c: &'a mut [f32],
    layout: Layout,
}

impl<'a> Out<'a> {
    /// Row-major with rows `ldc` apart (≥ the columns, so no two elements
    /// share a place).
    pub fn rows(c: &'a mut [f32], ldc: usize) -> Self {
        Out {
            c,
            layout: Layout::strided(ldc, 1),
        }
    }

    /// [`Layout::images`]: `rows` planes of `hw` per image.
    pub fn images(c: &'a mut [f32], rows: usize, hw: usize) -> Self {
        Out {
            c,
            layout: Layout::images(rows, hw),
        }
    }
}

/// A raw C shared by the threads that write its disjoint columns.
#[derive(Clone, Copy)]
struct Dst {
    ptr: *mut f32,
    layout: Layout,
}
// SAFETY: threads write disjoint columns of a layout `gemm` checked to be
// injective, so no element is written by two.
unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}

/// Spare [`PackedA`] buffers kept per thread: one per A that callers hold
/// at once. A Winograd convolution packs 16, which its op keeps from the
/// forward to the backward: 144 for VGG16's nine Winograd layers, back in
/// the spares after the backward and taken again, each by the layer whose
/// size it fits, by the next forward. With 16 kept, most layers' U went
/// to buffers grown and zeroed every step: in a one-core VGG16 step's
/// samples (Cascade Lake, batch 32) memset 3.1% → 2.2% and U's packing
/// 2.7% → 2.0% with them kept. The spares never hold more than the most
/// packed A alive at once.
const SPARES: usize = 1024;

thread_local! {
    /// This thread's spare buffers for [`PackedA`], smallest first.
    static SPARE_A: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
    /// This thread's strip of B, kept between calls.
    static STRIP: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// C (m × n) (+)= A · B, A packed, B from its panels; `accumulate` adds to
/// C, else overwrites it. Runs on candle's threads (columns split) unless
/// inside [`super::serial`].
pub fn gemm(a: &PackedA, b: &dyn Panels, out: Out<'_>, accumulate: bool) {
    drive(Source::Packed(a), b, out, accumulate);
}

/// A (m × k) read where it lies by the microkernel: rows `lda` apart, each
/// contiguous along k ([`gemm_rows`]).
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub a: &'a [f32],
    pub m: usize,
    pub k: usize,
    pub lda: usize,
}

/// [`gemm`] with A not packed: each tile reads its MR rows of A where they
/// lie, k after k (MR streams a prefetcher follows), the same sums in the
/// same order as [`gemm`] on A packed: the same bits. For an A used by few
/// tiles of C, whose packing would cost a good part of its use: a Winograd
/// convolution's weight gradient, dU = dM · Vᵀ, chunk by chunk.
pub fn gemm_rows(micro: Micro, a: Rows<'_>, b: &dyn Panels, out: Out<'_>, accumulate: bool) {
    assert!(
        a.m == 0 || a.k == 0 || a.a.len() >= (a.m - 1) * a.lda + a.k,
        "sgemm: A too small"
    );
    drive(Source::Rows(a, micro), b, out, accumulate);
}

/// A as one GEMM reads it.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// Packed, C = A · B.
    Packed(&'a PackedA),
    /// Packed, C = Aᵀ · B, read across ([`gemm_transposed`]).
    Across(&'a PackedA),
    /// Where it lies ([`gemm_rows`]).
    Rows(Rows<'a>, Micro),
}

impl Source<'_> {
    /// C's rows, the sum's length, and the microkernel.
    fn dims(&self) -> (usize, usize, Micro) {
        match *self {
            Source::Packed(a) => (a.m, a.k, a.micro),
            Source::Across(a) => (a.k, a.m, a.micro),
            Source::Rows(a, micro) => (a.m, a.k, micro),
        }
    }

    /// Where A's places count from.
    fn base(&self) -> *const f32 {
        match *self {
            Source::Packed(a) | Source::Across(a) => a.data.as_ptr(),
            Source::Rows(a, _) => a.a.as_ptr(),
        }
    }
}

/// The deepest strip of B read in place (where it lies, by
/// [`Panels::in_place`]) rather than packed, where B's rows lie
/// [`FAR_ROWS`] or more apart; nearer rows are read in place at any depth.
/// Measured on one core at batch 32, forward: Winograd's GEMMs over 64 and
/// 128 input channels 5–15% faster in place (the packing of a shallow
/// strip cost a good part of its use). Over 256 and 512 (strips of 256
/// rows) in place was 5–15% slower while the chunks' buffers could start
/// anywhere in a cache line; with them aligned (`kernels::sized_aligned`)
/// it is faster (Cascade Lake, `bench gemm`, 3
/// alternated runs: 256 × 128 × 256 121–126 → 135–143 GFLOP/s, 512 × 64
/// × 512 128–135 → 136–145; `bench conv`, one thread, forward + backward,
/// medians of 3 alternated: 256 → 256 @ 8 54.4 → 50.2 ms, 256 → 512 @ 4
/// 34.0 → 32.0, 512 → 512 @ 4 64.0 → 60.2).
const IN_PLACE_MAX_K: usize = 128;

/// Off in tests that compare both ways of reading B.
static IN_PLACE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

fn in_place() -> bool {
    IN_PLACE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Rows of a strip of the A that [`gemm_transposed`] reads across.
const MR_ACROSS: usize = 6;

/// Floats a [`PackedA`] needs past its last strip for [`gemm_transposed`]:
/// a tile cut short at a block's end still reads MR rows (the rows it does
/// not store).
pub const ACROSS_SLACK: usize = MR_ACROSS * MR_ACROSS;

/// C (k × n) (+)= Aᵀ · B for the packed A (m × k) of a GEMM that ran or
/// will run as A · B: Aᵀ is read in place, strip by strip of A across
/// (no second packing). Each C element is the same sum, in the same order,
/// as [`gemm`] on Aᵀ packed gives: the same bits. A's buffer must hold
/// [`ACROSS_SLACK`] floats past its packed length.
pub fn gemm_transposed(a: &PackedA, b: &dyn Panels, out: Out<'_>, accumulate: bool) {
    assert!(
        a.micro.mr() == MR_ACROSS && a.data.len() >= Place::of(a.micro, a.m, a.k).len() + ACROSS_SLACK,
        "sgemm: a packed A read across needs {MR_ACROSS} rows per strip and {ACROSS_SLACK} floats of slack"
    );
    drive(Source::Across(a), b, out, accumulate);
}

/// [`gemm`], [`gemm_transposed`] or [`gemm_rows`], as `a` says.
fn drive(a: Source<'_>, b: &dyn Panels, out: Out<'_>, accumulate: bool) {
    let (m, k, micro) = a.dims();
    let n = b.cols();
    if m == 0 || n == 0 {
        return;
    }
    assert!(out.c.len() >= out.layout.span(m, n), "sgemm: C too small");
    assert!(
        out.layout.injective(m, n),
        "sgemm: C's layout puts two elements in one place"
    );
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    out.c[out.layout.at(i, j)] = 0.0;
                }
            }
        }
        return;
    }
    let dst = Dst {
        ptr: out.c.as_mut_ptr(),
        layout: out.layout,
    };
    let nr = micro.nr();
    let threads = crate::threads();
    let work = m * n * k;
    if threads > 1 && work >= 1 << 22 && super::split_work(1 << 15) && n > nr {
        use rayon::prelude::*;
        // Column ranges of whole strips, one per thread.
        let per = n.div_ceil(threads).div_ceil(nr) * nr;
        (0..n.div_ceil(per)).into_par_iter().for_each(|t| {
            let j0 = t * per;
            run(a, b, dst, j0, per.min(n - j0), accumulate);
        });
    } else {
        run(a, b, dst, 0, n, accumulate);
    }
}

/// Columns j0..j0 + n of C on this thread.
fn run(a: Source<'_>, b: &dyn Panels, dst: Dst, j0: usize, n: usize, accumulate: bool) {
    let (m, k, micro) = a.dims();
    let (mr, nr) = (micro.mr(), micro.nr());
    // The tiles of C's rows with their A: (first row, rows, A's place
    // from a.base() at k = p0, how it is read).
    let tiles = |p0: usize, kc: usize| -> Vec<(usize, usize, usize, Read)> {
        let strips = m.div_ceil(mr);
        match a {
            Source::Packed(_) => {
                return (0..strips)
                    .map(|s| {
                        let at = p0 * strips * mr + s * kc * mr;
                        (s * mr, mr.min(m - s * mr), at, Read::Packed)
                    })
                    .collect();
            }
            Source::Rows(rows_of_a, _) => {
                let lda = rows_of_a.lda;
                return (0..strips)
                    .map(|s| {
                        let rows = mr.min(m - s * mr);
                        // Rows past m read the last row again (never
                        // stored).
                        let offs = std::array::from_fn(|r| r.min(rows - 1) * lda);
                        (s * mr, rows, s * mr * lda + p0, Read::Rows(offs))
                    })
                    .collect();
            }
            Source::Across(_) => {}
        }
        // C's row i is A's column i: rows tile by tile within each of A's
        // blocks of KC columns (a tile's rows lie in one block), C's k =
        // A's row p (strip p / MR of A, place p % MR in it).
        let strips = k.div_ceil(mr);
        let mut out = Vec::new();
        for q0 in (0..m).step_by(KC) {
            let qc = KC.min(m - q0);
            let block = q0 * strips * mr;
            let stride = qc * mr;
            for t in (0..qc).step_by(mr) {
                let at = block + (p0 / mr) * stride + t * mr;
                let read = Read::Across(Across {
                    phase: p0 % mr,
                    stride,
                });
                out.push((q0 + t, mr.min(qc - t), at, read));
            }
        }
        out
    };
    STRIP.with(|strip| {
        let mut strip = strip.borrow_mut();
        let need = KC * NC + 16;
        if strip.len() < need {
            strip.resize(need, 0.0);
        }
        // 64-byte aligned: the microkernel's loads of B.
        let skip = strip.as_ptr().align_offset(64).min(16);
        let buf = &mut strip[skip..];
        for p0 in (0..k).step_by(KC) {
            let kc = KC.min(k - p0);
            let add = accumulate || p0 > 0;
            let rows_of_c = tiles(p0, kc);
            // Strips are read where they lie when they can be (far rows
            // only when shallow); else packed, a panel at a time where B
            // packs so.
            let shallow = kc <= IN_PLACE_MAX_K && in_place();
            for jp in (0..n).step_by(NC) {
                let width = NC.min(n - jp);
                let panel =
                    !shallow && b.pack_panel(p0, kc, j0 + jp, width, nr, &mut buf[..kc * NC]);
                // Every strip of the panel ready (packed, or where it lies)
                // before any tile, so each strip of A stays in L1 while the
                // panel's strips stream past it from L2. `strips`: (first
                // column, strip, row stride), at most NC / 16 (NR ≥ 16 on
                // either level). `slots`: each strip's place in the buffer
                // (where a panel put it, or where it is packed), disjoint
                // slices of one borrow, so each pointer taken stays valid
                // through the tiles below.
                let mut strips: [(usize, *const f32, usize); NC / 16] =
                    [(0, std::ptr::null(), 0); NC / 16];
                let mut count = 0;
                let slots = buf[..kc * NC].chunks_mut(kc * nr);
                for (j, slot) in (jp..jp + width).step_by(nr).zip(slots) {
                    let cols = nr.min(n - j);
                    let (bstrip, ldb) = if panel {
                        (slot.as_ptr(), nr)
                    } else {
                        match b.in_place(p0, kc, j0 + j, cols) {
                            // Near rows at any depth, far ones when shallow.
                            Some(at)
                                if cols == nr
                                    && in_place()
                                    && (kc <= IN_PLACE_MAX_K || at.1 < FAR_ROWS) =>
                            {
                                at
                            }
                            _ => {
                                b.pack(p0, kc, j0 + j, cols, nr, slot);
                                (slot.as_ptr(), nr)
                            }
                        }
                    };
                    strips[count] = (j, bstrip, ldb);
                    count += 1;
                }
                for &(r0, rows, at, read) in &rows_of_c {
                    for &(j, bstrip, ldb) in &strips[..count] {
                        let cols = nr.min(n - j);
                        // SAFETY: A's places for kc steps lie in A (a
                        // packed strip of kc × MR; read across, its MR rows
                        // within the block or the slack `gemm_transposed`
                        // checked; in place, MR rows of A's, each kc
                        // floats from p0, `gemm_rows` checked); B's strip holds kc × NR floats; the
                        // tile's elements of C lie in the slice (`drive`
                        // checked the span) and only this thread writes these
                        // columns.
                        unsafe {
                            tile(
                                micro,
                                kc,
                                (a.base().add(at), read),
                                (bstrip, ldb),
                                dst,
                                (r0, rows),
                                (j0 + j, cols),
                                add,
                            )
                        };
                    }
                }
            }
        }
    });
}

/// One tile of C: rows r0..r0 + rows, columns c0..c0 + cols.
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    micro: Micro,
    kc: usize,
    (a, read): (*const f32, Read),
    (b, ldb): (*const f32, usize),
    dst: Dst,
    (r0, rows): (usize, usize),
    (c0, cols): (usize, usize),
    add: bool,
) {
    let nr = micro.nr();
    let l = dst.layout;
    let call = Call {
        kc,
        a,
        b,
        ldb,
        c: dst.ptr,
        ldc: l.rs,
        rows,
        add,
        read,
    };
    if cols == nr && l.contiguous(c0, cols) {
        let c = dst.ptr.add(l.at(r0, c0));
        kernel(micro, Call { c, ..call });
        return;
    }
    let mut t = [0f32; MAX_TILE];
    let c = t.as_mut_ptr();
    kernel(
        micro,
        Call {
            c,
            ldc: nr,
            add: false,
            ..call
        },
    );
    // Run by run of columns within one segment.
    let mut j = 0;
    while j < cols {
        let at = c0 + j;
        // `gemm` checked the unit column stride.
        let run = l.run(at, cols - j);
        for r in 0..rows {
            let c = dst.ptr.add(l.at(r0 + r, at));
            let v = &t[r * nr + j..][..run];
            for (e, v) in v.iter().enumerate() {
                let c = c.add(e);
                *c = if add { *c + *v } else { *v };
            }
        }
        j += run;
    }
}

/// One microkernel call: `kc` steps of A and of B's strip `b` (NR per
/// k), the first `rows` rows of the tile into `c` (rows `ldc` apart, NR
/// contiguous columns each), added to what is there when `add`. A is read
/// as `read` says: from its packed strip `a` (MR per k), in place from a
/// packed A of its transpose, or in place from A's rows.
#[derive(Clone, Copy)]
struct Call {
    kc: usize,
    a: *const f32,
    b: *const f32,
    /// Floats from one k's NR values of B to the next (NR when packed).
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    rows: usize,
    add: bool,
    read: Read,
}

/// How a microkernel reads its A.
#[derive(Clone, Copy)]
enum Read {
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
struct Across {
    phase: usize,
    stride: usize,
}

/// The microkernel of `micro`.
#[inline(always)]
unsafe fn kernel(micro: Micro, call: Call) {
    #[cfg(target_arch = "x86_64")]
    match (micro, call.read, call.rows) {
        // A strip's last tile of 1–4 rows (64 = 10 · 6 + 4 rows, 128 =
        // 21 · 6 + 2) runs those rows only, not six. Measured on the
        // Cascade Lake core (`bench gemm`, 3 alternated runs, GFLOP/s,
        // forward / read across / dU): 64 × 256 × 64 121–123 / 115–117 /
        // 97–98 → 122–126 / 118–119 / 98–100, 128 × 64 × 128 128–130 /
        // 120–121 / 106–111 → 132–134 / 123–124 / 110–114.
        (Micro::Avx512, Read::Packed, 0..=2) => x86::tile_avx512::<2, 6, 1>(call),
        (Micro::Avx512, Read::Packed, 3..=4) => x86::tile_avx512::<4, 6, 1>(call),
        (Micro::Avx512, Read::Packed, _) => x86::tile_avx512::<6, 6, 1>(call),
        (Micro::Avx512, Read::Across(_), 0..=2) => x86::tile_avx512::<2, 1, 6>(call),
        (Micro::Avx512, Read::Across(_), 3..=4) => x86::tile_avx512::<4, 1, 6>(call),
        (Micro::Avx512, Read::Across(_), _) => x86::tile_avx512::<6, 1, 6>(call),
        (Micro::Avx512, Read::Rows(_), 0..=2) => x86::tile_avx512::<2, 1, 0>(call),
        (Micro::Avx512, Read::Rows(_), 3..=4) => x86::tile_avx512::<4, 1, 0>(call),
        (Micro::Avx512, Read::Rows(_), _) => x86::tile_avx512::<6, 1, 0>(call),
        (Micro::Avx2, Read::Packed, _) => x86::tile_avx2::<6, 1>(call),
        (Micro::Avx2, Read::Across(_), _) => x86::tile_avx2::<1, 6>(call),
        (Micro::Avx2, Read::Rows(_), _) => x86::tile_avx2::<1, 0>(call),
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (micro, call);
        unreachable!("sgemm: no microkernel off x86-64 (Micro::now is None)")
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Across, Call, Read};
    use std::arch::x86_64::*;

    /// How many strips ahead a tile read across prefetches its A (2 and 4
    /// alike, 8 a little slower: `bench gemm` on a Cascade Lake core).
    const ACROSS_AHEAD: usize = 4;

    /// A read across (either tile): its `floats` (MR × MR) in the strip
    /// [`ACROSS_AHEAD`] strips after `s`, the strips `stride` floats apart,
    /// which no prefetcher follows; up to three 64-byte lines and the one
    /// its last float falls in. A hint: an address past A is not read.
    #[inline(always)]
    fn prefetch_across(s: *const f32, stride: usize, floats: usize) {
        let f = s.wrapping_add(ACROSS_AHEAD * stride) as *const i8;
        for at in [0, 64, 128, 4 * floats - 4] {
            // SAFETY: SSE is part of x86-64; a prefetch reads nothing.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(f.wrapping_add(at)) };
        }
    }

    /// A's places for one call, per k: `(s, t)` walks the strips (of
    /// `per` k each) and the k within them, the k-th A at `s + t·TS`.
    #[inline(always)]
    fn walk(call: &Call, ts: usize) -> (usize, usize, usize) {
        // (k per strip, first k's place in its strip, floats between strips)
        match call.read {
            Read::Across(Across { phase, stride }) => (super::MR_ACROSS, phase, stride),
            Read::Packed | Read::Rows(_) => (call.kc, 0, call.kc * ts),
        }
    }

    /// Row r's place from a k's first (RS = 0: A's rows where they lie,
    /// [`Read::Rows`]; else r·RS).
    #[inline(always)]
    fn offsets<const MR: usize, const RS: usize>(call: &Call) -> [usize; MR] {
        match call.read {
            Read::Rows(offs) if RS == 0 => std::array::from_fn(|r| offs[r]),
            _ => std::array::from_fn(|r| r * RS),
        }
    }

    /// MR × 64: per k four zmm of B, a broadcast of A per row. A's k-th
    /// value of row r at `a + k·TS + r·RS` within a strip (packed: TS =
    /// MR, RS = 1; read across a packed Aᵀ: TS = 1, RS = MR, strip by
    /// strip, [`Across`]; in place: TS = 1, RS = 0 for the rows' own
    /// places, [`offsets`]); every row sums over k in order either way.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_avx512<const MR: usize, const TS: usize, const RS: usize>(
        call: Call,
    ) {
        let (kc, c, ldc, rows, add) = (call.kc, call.c, call.ldc, call.rows, call.add);
        let mut acc = [[_mm512_setzero_ps(); 4]; MR];
        let offs = offsets::<MR, RS>(&call);
        let (per, mut t0, stride) = walk(&call, TS);
        let (mut s, mut b) = (call.a, call.b);
        if add {
            prefetch_c(c, ldc, rows.min(MR), 4);
        }
        let mut k = 0;
        while k < kc {
            let n = (per - t0).min(kc - k);
            if TS == 1 && RS != 0 {
                prefetch_across(s, stride, MR * RS);
            }
            for t in t0..t0 + n {
                let a = s.add(t * TS);
                let bv = [
                    _mm512_loadu_ps(b),
                    _mm512_loadu_ps(b.add(16)),
                    _mm512_loadu_ps(b.add(32)),
                    _mm512_loadu_ps(b.add(48)),
                ];
                for (r, row) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*a.add(offs[r]));
                    for (v, b) in row.iter_mut().zip(&bv) {
                        *v = _mm512_fmadd_ps(av, *b, *v);
                    }
                }
                b = b.add(call.ldb);
            }
            k += n;
            t0 = 0;
            s = s.add(stride);
        }
        for (r, vs) in acc.iter().enumerate().take(rows.min(MR)) {
            let row = c.add(r * ldc);
            for (q, &v) in vs.iter().enumerate() {
                let dst = row.add(16 * q);
                let v = if add {
                    _mm512_add_ps(_mm512_loadu_ps(dst), v)
                } else {
                    v
                };
                _mm512_storeu_ps(dst, v);
            }
        }
    }

    /// The tile of C that a microkernel adds to (`rows` rows `ldc`
    /// apart, `lines` cache lines each) asked for at its start, to be in
    /// L1 by its end. Where C is large it comes from L3 or memory: a
    /// Winograd weight gradient adds each chunk's dM · Vᵀ into dU, 16 MB
    /// at 512 → 512. Measured on one Cascade Lake core, batch 32, the
    /// layers' dU GEMMs alternated in one process (ms, without → with):
    /// AVX-512 512 → 512 @ 4 14.5–14.9 → 12.9–13.1, 256 → 512 @ 4 6.8–7.0
    /// → 6.2–6.4, 128 → 256 @ 8 6.1–6.5 → 5.6–6.0, 256 → 256 @ 8
    /// 11.5–11.8 → 11.0–11.3; 64 and 128 channels unchanged; AVX2 512 →
    /// 512 @ 4 22.6–24.8 → 21.0–21.7.
    #[inline(always)]
    unsafe fn prefetch_c(c: *const f32, ldc: usize, rows: usize, lines: usize) {
        for r in 0..rows {
            let row = c.wrapping_add(r * ldc) as *const i8;
            for q in 0..lines {
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(64 * q));
            }
        }
    }

    /// 6 × 16: per k two ymm of B, a broadcast of A per row (A's places
    /// as in [`tile_avx512`]). Its k loop is [`steps_avx2`]: written as a
    /// loop over arrays inside the strip walk, LLVM kept the 12
    /// accumulators in 16 ymm registers only by spilling some to the stack
    /// every k; with the loop flat and the accumulators named, none spill.
    /// Measured on a Cascade Lake core held to this kernel (`bench gemm`,
    /// 3 alternated runs): 1024³ 28–33 → 53–56
    /// GFLOP/s, Winograd's shapes 20–48 → 50–68, read across 20–31 →
    /// 47–52, against an AVX2 peak of about 70.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_avx2<const TS: usize, const RS: usize>(call: Call) {
        let Call { kc, c, ldc, .. } = call;
        let (rows, add) = (call.rows, call.add);
        const MR: usize = 6;
        let mut acc = [_mm256_setzero_ps(); 2 * MR];
        let offs = offsets::<MR, RS>(&call);
        let (per, mut t0, stride) = walk(&call, TS);
        let (mut s, mut b) = (call.a, call.b);
        if add {
            prefetch_c(c, ldc, rows.min(MR), 1);
        }
        let mut k = 0;
        while k < kc {
            let n = (per - t0).min(kc - k);
            if TS == 1 && RS != 0 {
                // (On this tile: at 512 × 64 × 512 0.76–0.81 of the
                // forward's rate → 0.83–0.84; at 256 × 128 × 256 no change.)
                prefetch_across(s, stride, MR * RS);
            }
            acc = steps_avx2::<TS>(s.add(t0 * TS), offs, b, call.ldb, n, acc);
            b = b.add(n * call.ldb);
            k += n;
            t0 = 0;
            s = s.add(stride);
        }
        for r in 0..rows.min(MR) {
            let row = c.add(r * ldc);
            let (mut v0, mut v1) = (acc[2 * r], acc[2 * r + 1]);
            if add {
                v0 = _mm256_add_ps(_mm256_loadu_ps(row), v0);
                v1 = _mm256_add_ps(_mm256_loadu_ps(row.add(8)), v1);
            }
            _mm256_storeu_ps(row, v0);
            _mm256_storeu_ps(row.add(8), v1);
        }
    }

    /// `n` steps of k of [`tile_avx2`] from A at `a` (the k-th at `a +
    /// k·TS`, row r `o[r]` on) and B at `b` (rows `ldb` apart), the
    /// accumulators (row r's two halves at 2r, 2r + 1) in and out by
    /// value.
    #[inline(always)]
    unsafe fn steps_avx2<const TS: usize>(
        mut a: *const f32,
        o: [usize; 6],
        mut b: *const f32,
        ldb: usize,
        n: usize,
        acc: [__m256; 12],
    ) -> [__m256; 12] {
        let [mut c0, mut c1, mut c2, mut c3, mut c4, mut c5, mut c6, mut c7, mut c8, mut c9, mut c10, mut c11] =
            acc;
        for _ in 0..n {
            let b0 = _mm256_loadu_ps(b);
            let b1 = _mm256_loadu_ps(b.add(8));
            let av = _mm256_broadcast_ss(&*a.add(o[0]));
            c0 = _mm256_fmadd_ps(av, b0, c0);
            c1 = _mm256_fmadd_ps(av, b1, c1);
            let av = _mm256_broadcast_ss(&*a.add(o[1]));
            c2 = _mm256_fmadd_ps(av, b0, c2);
            c3 = _mm256_fmadd_ps(av, b1, c3);
            let av = _mm256_broadcast_ss(&*a.add(o[2]));
            c4 = _mm256_fmadd_ps(av, b0, c4);
            c5 = _mm256_fmadd_ps(av, b1, c5);
            let av = _mm256_broadcast_ss(&*a.add(o[3]));
            c6 = _mm256_fmadd_ps(av, b0, c6);
            c7 = _mm256_fmadd_ps(av, b1, c7);
            let av = _mm256_broadcast_ss(&*a.add(o[4]));
            c8 = _mm256_fmadd_ps(av, b0, c8);
            c9 = _mm256_fmadd_ps(av, b1, c9);
            let av = _mm256_broadcast_ss(&*a.add(o[5]));
            c10 = _mm256_fmadd_ps(av, b0, c10);
            c11 = _mm256_fmadd_ps(av, b1, c11);
            a = a.add(TS);
            b = b.add(ldb);
        }
        [c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11]
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_values as values;

    /// The sums in f64 of C0 (if accumulating) + A · B.
    fn reference(
        (m, n, k): (usize, usize, usize),
        a: &[f32],
        la: Layout,
        b: &[f32],
        lb: Layout,
    ) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| a[la.at(i, p)] as f64 * b[lb.at(p, j)] as f64)
                    .sum();
            }
        }
        c
    }

    /// Every (microkernel, case, accumulate, images) of `cases`.
    fn runs(
        cases: &[(usize, usize, usize, usize)],
    ) -> impl Iterator<Item = (Micro, (usize, usize, usize, usize), bool, bool)> + '_ {
        micros().into_iter().flat_map(move |micro| {
            cases.iter().flat_map(move |&case| {
                [(false, false), (false, true), (true, false), (true, true)]
                    .map(|(accumulate, images)| (micro, case, accumulate, images))
            })
        })
    }

    /// B (k × n) and C0 (m × n), both strided or both laid out as images
    /// of `hw`: (B's layout, B, C's layout, C0).
    fn operands(
        (m, n, k): (usize, usize, usize),
        hw: usize,
        images: bool,
    ) -> (Layout, Vec<f32>, Layout, Vec<f32>) {
        let (lb, lc) = if images {
            (Layout::images(k, hw), Layout::images(m, hw))
        } else {
            (Layout::strided(n + 3, 1), Layout::strided(n + 1, 1))
        };
        (lb, values(2, lb.span(k, n)), lc, values(3, lc.span(m, n)))
    }

    /// C within 1e-5·√(k + 1) of the f64 sums (plus C0 when `accumulate`).
    fn assert_sums(
        what: &str,
        (m, n, k): (usize, usize, usize),
        (c, c0, lc): (&[f32], &[f32], Layout),
        sums: &[f64],
        accumulate: bool,
    ) {
        for i in 0..m {
            for j in 0..n {
                let w = sums[i * n + j]
                    + if accumulate {
                        c0[lc.at(i, j)] as f64
                    } else {
                        0.0
                    };
                let got = c[lc.at(i, j)] as f64;
                let bound = 1e-5 * (k as f64 + 1.0).sqrt() * (1.0 + w.abs());
                assert!(
                    (got - w).abs() <= bound,
                    "{what} at ({i}, {j}): {got} against {w}"
                );
            }
        }
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
    }

    /// A C whose rows overlap is refused before anything is written (the
    /// threads' disjoint columns rely on it).
    #[test]
    #[should_panic(expected = "two elements in one place")]
    fn refuses_a_c_whose_rows_overlap() {
        let Some(micro) = Micro::now() else {
            panic!("two elements in one place (no microkernel to test)");
        };
        let (m, n, k) = (3, 8, 2);
        let a = values(1, m * k);
        let b = values(2, k * n);
        let mut c = vec![0f32; 64];
        let packed = PackedA::new(micro, m, k, &a, Layout::strided(k, 1));
        let src = Matrix {
            b: &b,
            k,
            n,
            layout: Layout::strided(n, 1),
        };
        gemm(&packed, &src, Out::rows(&mut c, n - 1), false);
    }

    /// Every microkernel against the f64 sums: tiles whole and cut, k
    /// below, at and across KC, columns across NC, strided and images
    /// layouts for B and C, overwrite and accumulate.
    #[test]
    fn matches_the_f64_sums_on_every_microkernel() {
        let cases = [
            (1, 1, 1, 1),
            (12, 32, 16, 32),
            (13, 33, 257, 11),
            (7, 5, 3, 4),
            (25, 600, 300, 64),
            (5, 70, KC, 16),
            (30, 70, KC + 1, 16),
            (6, 40, 2 * KC + 6, 8),
            (3, 1030, 40, 1030),
            // Last tiles of 4 and 2 rows (their own microkernels).
            (4, 64, 64, 64),
            (10, 70, 40, 16),
            (14, 65, KC + 2, 8),
        ];
        for (micro, (m, n, k, hw), accumulate, images) in runs(&cases) {
            let la = Layout::strided(1, m + 2); // A column-major
            let a = values(1, la.span(m, k));
            let (lb, b, lc, c0) = operands((m, n, k), hw, images);
            let mut c = c0.clone();
            let packed = PackedA::new(micro, m, k, &a, la);
            let src = Matrix {
                b: &b,
                k,
                n,
                layout: lb,
            };
            let out = Out {
                c: &mut c,
                layout: lc,
            };
            gemm(&packed, &src, out, accumulate);
            // B packed strip by strip instead of read in place: the same
            // bits.
            IN_PLACE.store(false, std::sync::atomic::Ordering::Relaxed);
            let mut again = c0.clone();
            let out = Out {
                c: &mut again,
                layout: lc,
            };
            gemm(&packed, &src, out, accumulate);
            IN_PLACE.store(true, std::sync::atomic::Ordering::Relaxed);
            let what = format!("{micro:?} {m}×{n}×{k} images {images} accumulate {accumulate}");
            assert!(
                same_bits(&c, &again),
                "{what}: B in place differs from B packed"
            );
            let sums = reference((m, n, k), &a, la, &b, lb);
            assert_sums(&what, (m, n, k), (&c, &c0, lc), &sums, accumulate);
        }
    }

    /// A read where it lies ([`gemm_rows`]): the same bits as [`gemm`] on
    /// A packed, and the f64 sums, on every microkernel: a last strip of
    /// fewer than MR rows (its missing rows must not be read past A), k
    /// below, at and across KC and not a multiple of 8, B with its rows
    /// contiguous and with its columns contiguous (Vᵀ: packed by 8 × 8
    /// transposes and their edges), columns not a multiple of 8.
    #[test]
    fn rows_read_in_place_match_a_packed() {
        let cases = [
            (1, 1, 1, 1),
            (7, 5, 3, 4),
            (6, 64, 64, 64),
            (13, 33, 257, 11),
            (20, 70, KC + 9, 16),
            (64, 130, 64, 8),
            (11, 17, 2 * KC + 3, 5),
            // Vᵀ packed by 16 × 16 blocks with 8 × 8 ones beside and below.
            (9, 40, 56, 8),
        ];
        for (micro, (m, n, k, _), accumulate, columns) in runs(&cases) {
            let lda = k + 3;
            let a = values(1, (m - 1) * lda + k);
            let lb = if columns {
                Layout::strided(1, k + 2)
            } else {
                Layout::strided(n + 3, 1)
            };
            let b = values(2, lb.span(k, n));
            let lc = Layout::strided(n + 1, 1);
            let c0 = values(3, lc.span(m, n));
            let src = Matrix {
                b: &b,
                k,
                n,
                layout: lb,
            };
            let mut c = c0.clone();
            let rows = Rows { a: &a, m, k, lda };
            let out = Out {
                c: &mut c,
                layout: lc,
            };
            gemm_rows(micro, rows, &src, out, accumulate);
            let la = Layout::strided(lda, 1);
            let mut want = c0.clone();
            let out = Out {
                c: &mut want,
                layout: lc,
            };
            gemm(&PackedA::new(micro, m, k, &a, la), &src, out, accumulate);
            let what = format!(
                "{micro:?} {m}×{n}×{k} B's columns contiguous {columns} accumulate {accumulate}"
            );
            assert!(same_bits(&c, &want), "{what}: in place differs from packed");
            let sums = reference((m, n, k), &a, la, &b, lb);
            assert_sums(&what, (m, n, k), (&c, &c0, lc), &sums, accumulate);
        }
    }

    /// Aᵀ · B read across a packed A: the same bits as [`gemm`] on Aᵀ
    /// packed, and the f64 sums, on every microkernel: A's rows within
    /// one strip and across strips, its columns across blocks of KC (a
    /// block of 512 ends in a tile of 2 rows, one of 256 in a tile of 4),
    /// C's k blocks starting inside a strip (512 = 85·6 + 2), B and C in
    /// both layouts. The
    /// slack past A is NaN: a tile's unstored rows must stay unstored.
    #[test]
    fn transposed_reads_across_the_packed_a() {
        // (rows of A, columns of A, columns of B, plane of an image)
        let cases = [
            (1, 1, 1, 1),
            (7, 5, 33, 11),
            (6, 6, 64, 64),
            (12, 260, 70, 16),
            (300, KC + 1, 65, 13),
            (KC + 5, 31, 128, 64),
            (7, 2 * KC + 3, 20, 4),
        ];
        for (micro, (am, ak, n, hw), accumulate, images) in runs(&cases) {
            let la = Layout::strided(ak + 1, 1);
            let a = values(1, la.span(am, ak));
            // C (ak × n) = Aᵀ (ak × am) · B (am × n).
            let (m, k) = (ak, am);
            let lt = Layout::strided(1, ak + 1);
            let (lb, b, lc, c0) = operands((m, n, k), hw, images);
            let src = Matrix {
                b: &b,
                k,
                n,
                layout: lb,
            };
            let mut packed = PackedA::new(micro, am, ak, &a, la);
            let len = Place::of(micro, am, ak).len();
            packed.data.truncate(len);
            packed.data.resize(len + ACROSS_SLACK, f32::NAN);
            let mut c = c0.clone();
            let out = Out {
                c: &mut c,
                layout: lc,
            };
            gemm_transposed(&packed, &src, out, accumulate);
            let mut want = c0.clone();
            let out = Out {
                c: &mut want,
                layout: lc,
            };
            gemm(&PackedA::new(micro, m, k, &a, lt), &src, out, accumulate);
            let what =
                format!("{micro:?} A {am}×{ak}, n {n}, images {images}, accumulate {accumulate}");
            assert!(
                same_bits(&c, &want),
                "{what}: read across differs from Aᵀ packed"
            );
            let sums = reference((m, n, k), &a, lt, &b, lb);
            assert_sums(&what, (m, n, k), (&c, &c0, lc), &sums, accumulate);
        }
    }
}
