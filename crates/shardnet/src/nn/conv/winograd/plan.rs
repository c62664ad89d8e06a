//! How a Winograd call is cut: the tiles of an image ([`Tiles`]), images
//! into chunks ([`plan`]: V and M within a budget, whole strips of the
//! GEMMs' columns, chunks over the threads), and a chunk of one large image
//! into bands of tile rows ([`band_rows`], [`Span`]).

use super::super::geom::Geom;
use super::XI;
use crate::kernels::sgemm::Micro;

/// The tiles a chunk's GEMMs get at least, when the batch has them.
const MIN_TILES: usize = 256;
/// The bytes of V and M one chunk holds (unless one image needs more):
/// U's size, between [`MIN_CHUNK_BYTES`] and [`MAX_CHUNK_BYTES`]. Small layers keep V and M within a
/// core's L2 (two threads at 4 MiB: 64 → 128 @ 16's backward did not scale
/// at all; at 1 MiB, 1.5–1.7×); large ones need long GEMMs, U being read
/// once per chunk (512 → 512 @ 4's input gradient: 17.7 ms at 4 MiB,
/// 40.8 at 1 MiB).
const MIN_CHUNK_BYTES: usize = 1 << 20;
/// The most bytes of V and M per chunk (see [`MIN_CHUNK_BYTES`]).
const MAX_CHUNK_BYTES: usize = 4 << 20;

/// The tiles of one image: `th` rows of `tw`.
#[derive(Clone, Copy)]
pub(super) struct Tiles {
    pub(super) th: usize,
    pub(super) tw: usize,
}

impl Tiles {
    pub(super) fn of(g: &Geom) -> Self {
        Tiles {
            th: g.ho.div_ceil(2),
            tw: g.wo.div_ceil(2),
        }
    }
    pub(super) fn per_image(&self) -> usize {
        self.th * self.tw
    }
    /// Length of one row of the split plane: even columns then odd, each
    /// tw + 1 (the padded width is 2·tw + 2).
    pub(super) fn split_row(&self) -> usize {
        2 * (self.tw + 1)
    }
    /// Rows of the padded plane: 2·th + 2.
    pub(super) fn rows(&self) -> usize {
        2 * self.th + 2
    }
}

/// The tiles one pass of the transforms and GEMMs covers: of images
/// b0..b0 + q, the tile rows `rows` of each (all of them unless an image
/// is cut into bands, [`band_rows`]). V's columns run image by image, row
/// by row.
#[derive(Clone, Debug)]
pub(super) struct Span {
    pub(super) b0: usize,
    pub(super) q: usize,
    pub(super) rows: std::ops::Range<usize>,
}

impl Span {
    /// Images b0..b0 + q in bands of `band` tile rows (one band when
    /// `band` is all of them).
    pub(super) fn bands(t: &Tiles, b0: usize, q: usize, band: usize) -> impl Iterator<Item = Span> {
        let th = t.th;
        (0..th).step_by(band.max(1)).map(move |ty| Span {
            b0,
            q,
            rows: ty..(ty + band).min(th),
        })
    }
    /// Tiles per image in the span.
    pub(super) fn per_image(&self, t: &Tiles) -> usize {
        self.rows.len() * t.tw
    }
    /// The span's tiles: the GEMMs' columns.
    pub(super) fn cols(&self, t: &Tiles) -> usize {
        self.q * self.per_image(t)
    }
}

/// Tile rows per band where a chunk is one image whose V and M pass
/// [`BAND_BYTES`] and U is within it (so that a band's V, M and U share
/// L2): as many as fit, at least one strip of the GEMMs' columns, the
/// bands evened out; all of them otherwise.
///
/// Measured on one Cascade Lake core, forward / backward, whole images →
/// bands: 64 → 64 @ 32, batch 32, 18.5 → 16.6 / 34.0 → 34.4 ms; @ 112,
/// batch 4, 69.0 → 51.1 / 121.9 → 98.3; @ 224, batch 2, 134.5 → 105.7 /
/// 234.7 → 202.0. Where U fills L2 it does not pay: 128 → 128 @ 56, batch
/// 8, bands of 3 rows, 67.1 → 73.9 / 116.9 → 133.1.
pub(super) fn band_rows(g: &Geom, t: &Tiles, q: usize) -> usize {
    let per_row = XI * (g.c + g.o) * t.tw * 4;
    let u = XI * g.o * g.c * 4;
    if q > 1 || per_row * t.th <= BAND_BYTES || u > BAND_BYTES || t.tw == 0 {
        return t.th;
    }
    let nr = Micro::now().map_or(1, Micro::nr);
    let rows = (BAND_BYTES / per_row.max(1))
        .max(nr.div_ceil(t.tw))
        .clamp(1, t.th);
    t.th.div_ceil(t.th.div_ceil(rows))
}

/// The most bytes of V and M one band of an image holds when a whole
/// image's pass [`MIN_CHUNK_BYTES`]: within a core's L2 beside U.
const BAND_BYTES: usize = 512 << 10;

/// Images per chunk, and whether chunks run in parallel (each on one
/// thread): as `passes::plan`, with this path's sizes.
pub(super) fn plan(g: &Geom, t: &Tiles) -> (usize, bool) {
    let per = t.per_image().max(1);
    let bytes = XI * (g.c + g.o) * per * 4;
    let want = MIN_TILES.div_ceil(per);
    let budget = (XI * g.o * g.c * 4).clamp(MIN_CHUNK_BYTES, MAX_CHUNK_BYTES);
    let fit = (budget / bytes.max(1)).max(1);
    let q = whole_strips(want.min(fit).clamp(1, g.n.max(1)), per);
    let threads = crate::kernels::threads();
    if threads > 1 && g.n >= threads {
        // Every thread the same number of chunks, as even as they come.
        let per_thread = g.n.div_ceil(threads);
        (
            whole_strips(per_thread.div_ceil(per_thread.div_ceil(q)), per),
            true,
        )
    } else {
        (q, false)
    }
}

/// `q` images, down to a multiple of those whose tiles (`per` each) fill
/// whole strips of the GEMMs' B (NR columns) where q holds one. Measured
/// at batch 32, one thread: 128 → 256 @ 8's chunks of 5 images (80
/// columns: a second strip of 64 a quarter full) took 0.67 ms a forward
/// GEMM pass, 4 images (64 columns) 0.37; its forward went from 5.9 to 4.4
/// ms, 256 → 512 @ 4's (21 images, now 16) from 6.4 to 4.6.
fn whole_strips(q: usize, per: usize) -> usize {
    let nr = Micro::now().map_or(1, Micro::nr);
    let step = nr / gcd(per, nr);
    if q > step {
        q - q % step
    } else {
        q
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
