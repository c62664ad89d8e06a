//! A packed once per call into the microkernel's strips ([`PackedA`]),
//! where its elements lie ([`Place`]), and the spare buffers it reuses.

use super::blocking::{blocking, ACROSS_SLACK};
use super::layout::Layout;
use super::Micro;
use crate::{simd_level, SimdLevel};

/// A: every row, packed once per call into the microkernel's strips:
/// block by block of kc (`blocking`), strip by strip of MR rows, k-major (rows past
/// m zero).
pub struct PackedA {
    pub(super) data: Vec<f32>,
    pub(super) m: usize,
    pub(super) k: usize,
    pub(super) micro: Micro,
}

/// Where a packed A's elements lie (what [`PackedA::new`] writes): block
/// by block of kc (`blocking`) of k, strip by strip of MR rows, k-major. A caller
/// that computes A's elements writes them here itself
/// ([`PackedA::from_filled`]).
#[derive(Clone, Copy, Debug)]
pub struct Place {
    /// Rows per strip.
    pub mr: usize,
    /// Strips (rows past m are zero padding).
    pub strips: usize,
    pub(super) k: usize,
    /// k per block ([`blocking`]).
    pub(super) depth: usize,
}

impl Place {
    /// The places of an m × k A on `micro`.
    pub fn of(micro: Micro, m: usize, k: usize) -> Self {
        let mr = micro.mr();
        Place {
            mr,
            strips: m.div_ceil(mr),
            k,
            depth: blocking().kc,
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
        let p0 = p - p % self.depth;
        let kc = self.depth.min(self.k - p0);
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
    pub(super) fn new_in(
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
        let filled = crate::sized(&mut data, strips * mr * k);
        let depth = blocking().kc;
        for p0 in (0..k).step_by(depth) {
            let kc = depth.min(k - p0);
            let block = &mut filled[p0 * strips * mr..][..strips * mr * kc];
            // Each strip on its own: over the threads for a large A.
            let pack = |s: usize, strip: &mut [f32]| {
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
                        unsafe { crate::transpose::interleave6(at, rows, kc, strip.as_mut_ptr()) };
                        return;
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
            };
            crate::for_chunks_mut(block, kc * mr, pack);
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

/// Spare [`PackedA`] buffers kept per thread: one per A that callers hold
/// at once. A Winograd convolution packs 16, which its op keeps from the
/// forward to the backward: 144 for VGG16's nine Winograd layers, back in
/// the spares after the backward and taken again, each by the layer whose
/// size it fits, by the next forward. The spares never hold more than the most
/// packed A alive at once.
pub(super) const SPARES: usize = 1024;

thread_local! {
    /// This thread's spare buffers for [`PackedA`], smallest first.
    static SPARE_A: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}
