//! The three GEMMs ([`gemm`], [`gemm_rows`], [`gemm_transposed`]) and
//! their one driver: per block of k, per panel of B, every tile of C on
//! this thread's columns.

use super::blocking::{
    blocking, Blocking, ACROSS_SLACK, FAR_ROWS, IN_PLACE_MAX_K, MAX_NC, MAX_TILE, MR_ACROSS,
};
use super::layout::{Dst, Out};
use super::micro::{kernel, Across, Call, Read};
use super::pack_a::{PackedA, Place};
use super::pack_b::Panels;
use super::Micro;

thread_local! {
    /// This thread's strip of B, kept between calls.
    static STRIP: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// C (m × n) (+)= A · B, A packed, B from its panels; `accumulate` adds to
/// C, else overwrites it. Runs on candle's threads (columns split) unless
/// inside [`crate::serial`].
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

/// Off in tests that compare both ways of reading B.
pub(super) static IN_PLACE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(true);

fn in_place() -> bool {
    IN_PLACE.load(std::sync::atomic::Ordering::Relaxed)
}

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
    if threads > 1 && work >= 1 << 22 && crate::split_work(1 << 15) && n > nr {
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
    let Blocking { kc: depth, nc } = blocking();
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
        // blocks of kc columns (a tile's rows lie in one block), C's k =
        // A's row p (strip p / MR of A, place p % MR in it).
        let strips = k.div_ceil(mr);
        let mut out = Vec::new();
        for q0 in (0..m).step_by(depth) {
            let qc = depth.min(m - q0);
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
        let need = depth * nc + 16;
        if strip.len() < need {
            strip.resize(need, 0.0);
        }
        // 64-byte aligned: the microkernel's loads of B.
        let skip = strip.as_ptr().align_offset(64).min(16);
        let buf = &mut strip[skip..];
        for p0 in (0..k).step_by(depth) {
            let kc = depth.min(k - p0);
            let add = accumulate || p0 > 0;
            let rows_of_c = tiles(p0, kc);
            // Strips are read where they lie when they can be (far rows
            // only when shallow); else packed, a panel at a time where B
            // packs so.
            let shallow = kc <= IN_PLACE_MAX_K && in_place();
            for jp in (0..n).step_by(nc) {
                let width = nc.min(n - jp);
                let panel =
                    !shallow && b.pack_panel(p0, kc, j0 + jp, width, nr, &mut buf[..kc * nc]);
                // Every strip of the panel ready (packed, or where it lies)
                // before any tile, so each strip of A stays in L1 while the
                // panel's strips stream past it from L2. `strips`: (first
                // column, strip, row stride), at most MAX_NC / 16 (NR ≥ 16 on
                // either level). `slots`: each strip's place in the buffer
                // (where a panel put it, or where it is packed), disjoint
                // slices of one borrow, so each pointer taken stays valid
                // through the tiles below.
                let mut strips: [(usize, *const f32, usize); MAX_NC / 16] =
                    [(0, std::ptr::null(), 0); MAX_NC / 16];
                let mut count = 0;
                let slots = buf[..kc * nc].chunks_mut(kc * nr);
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
