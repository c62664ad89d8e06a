//! Where a matrix's elements lie: [`Layout`], C as a GEMM writes it
//! ([`Out`]), and C shared by the threads that write its columns (`Dst`).

/// Where a matrix's element (i, j) lies: `i·rs + (j / seg)·seg_stride +
/// j % seg`. A strided matrix is one segment (`seg` = usize::MAX) with
/// column stride `cs`; an images layout has `cs` = 1.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub(super) rs: usize,
    pub(super) cs: usize,
    pub(super) seg: usize,
    pub(super) seg_stride: usize,
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
    pub(super) fn at(&self, i: usize, j: usize) -> usize {
        if self.seg == usize::MAX {
            i * self.rs + j * self.cs
        } else {
            i * self.rs + (j / self.seg) * self.seg_stride + j % self.seg
        }
    }

    /// The length a slice needs to hold an m × n matrix of this layout.
    pub(super) fn span(&self, m: usize, n: usize) -> usize {
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
    pub(super) fn injective(&self, m: usize, n: usize) -> bool {
        if self.cs != 1 {
            return false;
        }
        let run = n.min(self.seg);
        let rows_apart = m <= 1 || self.rs >= run;
        let segs_apart = n <= self.seg || self.seg_stride >= (m.max(1) - 1) * self.rs + self.seg;
        rows_apart && segs_apart
    }

    /// How many of the columns j..j + most lie in j's segment.
    pub(super) fn run(&self, j: usize, most: usize) -> usize {
        if self.seg == usize::MAX {
            most
        } else {
            (self.seg - j % self.seg).min(most)
        }
    }

    /// Columns j..j + len lie contiguous (unit stride, one segment).
    pub(super) fn contiguous(&self, j: usize, len: usize) -> bool {
        self.cs == 1 && (self.seg == usize::MAX || j / self.seg == (j + len - 1) / self.seg)
    }
}

/// C: its elements and layout.
pub struct Out<'a> {
    pub(super) c: &'a mut [f32],
    pub(super) layout: Layout,
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
pub(super) struct Dst {
    pub(super) ptr: *mut f32,
    pub(super) layout: Layout,
}
// SAFETY: threads write disjoint columns of a layout `gemm` checked to be
// injective, so no element is written by two.
unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}
