//! A plane's split form, which the input transform reads and the input
//! gradient's scatter adds into: zero-padded and cut into its even and odd
//! columns, so that a run of tiles along a row of tiles loads contiguously
//! (`lanes.rs`); the planes of one channel or, where a chunk runs in bands,
//! of every channel ([`SplitChunk`]); their buffers, kept per thread.

use super::super::geom::Geom;
use super::{avx512, Tiles, L};
#[cfg(target_arch = "x86_64")]
use crate::kernels::winograd::x86;

/// One plane (H × W) zero-padded by p and split into even and odd columns:
/// padded row yp at `eo[yp·2(tw+1)..]`, even columns first.
#[inline(always)]
pub(super) fn split(g: &Geom, t: &Tiles, plane: &[f32], eo: &mut [f32], row: &mut [f32]) {
    let half = t.tw + 1;
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        let eo = &mut eo[..t.rows() * 2 * half];
        // SAFETY: AVX-512F is present (avx512()).
        unsafe { x86::split_plane(&plane[..g.h * g.w], g.w, g.p, half, eo) };
        return;
    }
    for (yp, out) in eo.chunks_exact_mut(2 * half).enumerate().take(t.rows()) {
        let (e, o) = out.split_at_mut(half);
        let y = yp.wrapping_sub(g.p);
        if y >= g.h {
            e.fill(0.0);
            o.fill(0.0);
            continue;
        }
        row.fill(0.0);
        row[g.p..g.p + g.w].copy_from_slice(&plane[y * g.w..][..g.w]);
        for ((e, o), pair) in e.iter_mut().zip(o.iter_mut()).zip(row.chunks_exact(2)) {
            *e = pair[0];
            *o = pair[1];
        }
    }
}

/// The split planes back into (H × W) planes: the inverse of [`split`]
/// on the image's own pixels.
#[inline(always)]
pub(super) fn unsplit(g: &Geom, t: &Tiles, eo: &[f32], plane: &mut [f32], row: &mut [f32]) {
    let half = t.tw + 1;
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: AVX-512F is present (avx512()).
        unsafe { x86::unsplit_plane(eo, g.w, g.p, half, &mut plane[..g.h * g.w]) };
        return;
    }
    for y in 0..g.h {
        let (e, o) = eo[(y + g.p) * 2 * half..][..2 * half].split_at(half);
        for ((pair, e), o) in row.chunks_exact_mut(2).zip(e).zip(o) {
            pair[0] = *e;
            pair[1] = *o;
        }
        plane[y * g.w..][..g.w].copy_from_slice(&row[g.p..g.p + g.w]);
    }
}

/// A chunk's split planes (q images of one channel, or of every channel:
/// [`SplitChunk`]), a padded row, and where the span's tiles lie: what the
/// input transform reads and the input gradient's scatter writes.
pub(super) struct Planes {
    /// q split planes per channel held, `plane` floats each, rows `r`
    /// apart, channels `stride` apart (and a vector of slack:
    /// `x86::scatter_block` reads and writes whole vectors).
    pub(super) eo: Aligned,
    /// One zero-padded row.
    pub(super) row: Vec<f32>,
    pub(super) plane: usize,
    pub(super) r: usize,
    /// From one channel's planes to the next: q planes, up to whole
    /// vectors (each channel's start 64-byte aligned, as
    /// `x86::scatter_block` wants).
    pub(super) stride: usize,
    /// A tile's four columns in a split row ([`offsets`]).
    pub(super) off: [usize; 4],
}

impl Planes {
    /// Planes of q images of `channels` channels: zero, or `scratch` (the
    /// caller writes every element it reads).
    pub(super) fn new(t: &Tiles, q: usize, channels: usize, scratch: bool) -> Self {
        let (plane, r) = (t.rows() * t.split_row(), t.split_row());
        let stride = (q * plane).next_multiple_of(L);
        let len = channels * stride + L;
        Planes {
            eo: if scratch {
                Aligned::scratch(len)
            } else {
                Aligned::zeros(len)
            },
            row: vec![0f32; r],
            plane,
            r,
            stride,
            off: offsets(t),
        }
    }
}

/// Every channel's split planes of a chunk's q images, where the chunk is
/// cut into bands: x's, split once for all bands ([`input_transform`](super::lanes::input_transform)'s
/// `split`; each band then reads its rows from here rather than x's, whose
/// rows of one band lie in short runs a plane apart), or dx's, which each
/// band's scatter adds into ([`input_scatter`](super::lanes::input_scatter)'s `sums`) and
/// [`SplitChunk::unsplit`] writes out once all bands are in.
pub(super) struct SplitChunk {
    pub(super) p: Planes,
    /// Images held.
    pub(super) q: usize,
}

impl SplitChunk {
    /// The split planes of images b0..b0 + q of x.
    pub(super) fn of(g: &Geom, t: &Tiles, x: &[f32], b0: usize, q: usize) -> Self {
        // Every element the bands read is split below.
        let mut p = Planes::new(t, q, g.c, true);
        let hw = g.h * g.w;
        let (plane, stride) = (p.plane, p.stride);
        for c in 0..g.c {
            for b in 0..q {
                let src = &x[((b0 + b) * g.c + c) * hw..][..hw];
                let eo = &mut p.eo[c * stride + b * plane..][..plane];
                split(g, t, src, eo, &mut p.row);
            }
        }
        SplitChunk { p, q }
    }

    /// q images' planes of every channel, zero.
    pub(super) fn zeros(g: &Geom, t: &Tiles, q: usize) -> Self {
        SplitChunk {
            p: Planes::new(t, q, g.c, false),
            q,
        }
    }

    /// The planes back into the chunk's q images of C planes (`part`).
    pub(super) fn unsplit(&mut self, g: &Geom, t: &Tiles, part: &mut [f32]) {
        let p = &mut self.p;
        let (hw, plane, stride) = (g.h * g.w, p.plane, p.stride);
        for c in 0..g.c {
            for b in 0..self.q {
                let dst = &mut part[(b * g.c + c) * hw..][..hw];
                unsplit(
                    g,
                    t,
                    &p.eo[c * stride + b * plane..][..plane],
                    dst,
                    &mut p.row,
                );
            }
        }
    }
}

/// `len` floats whose first is 64-byte aligned.
pub(super) struct Aligned {
    buf: Vec<f32>,
    at: usize,
    len: usize,
}

thread_local! {
    /// This thread's buffers of dropped [`Aligned`], taken again by the
    /// next (at most [`KEPT`]): a chunk's split planes of every channel
    /// (300 KB at 64 channels of 32 × 32) allocated afresh each chunk took
    /// as long as splitting them.
    static POOL: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Buffers a thread keeps for [`Aligned`].
const KEPT: usize = 8;

impl Aligned {
    /// `len` floats, zero.
    fn zeros(len: usize) -> Self {
        let mut a = Self::scratch(len);
        a.fill(0.0);
        a
    }

    /// `len` floats, as a kept buffer left them (the caller writes every
    /// one it reads).
    fn scratch(len: usize) -> Self {
        let mut buf = POOL
            .with(|p| {
                let mut p = p.borrow_mut();
                // The largest kept buffer, so that small ones are not grown.
                let i = (0..p.len()).max_by_key(|&i| p[i].capacity())?;
                Some(p.swap_remove(i))
            })
            .unwrap_or_default();
        if buf.len() < len + L {
            buf.resize(len + L, 0.0);
        }
        let at = buf.as_ptr().align_offset(64).min(L);
        Aligned { buf, at, len }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        POOL.with(|p| {
            let mut p = p.borrow_mut();
            if p.len() < KEPT {
                p.push(buf);
            }
        });
    }
}

impl std::ops::Deref for Aligned {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[self.at..][..self.len]
    }
}

impl std::ops::DerefMut for Aligned {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.at..][..self.len]
    }
}

/// Column j of a tile in a split row: even (j = 0, 2) or odd (1, 3), then
/// one further.
#[inline(always)]
fn offsets(t: &Tiles) -> [usize; 4] {
    let half = t.tw + 1;
    [0, half, 1, half + 1]
}
