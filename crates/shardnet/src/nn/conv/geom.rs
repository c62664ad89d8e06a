//! The sizes of one convolution call ([`Geom`]) and how its work is cut:
//! images per chunk, output rows per band of one large image.

/// A band of output rows.
pub(super) type Rows = std::ops::Range<usize>;

/// A chunk's GEMMs get at least this many columns (images × output pixels)
/// when the batch has them.
pub const MIN_COLUMNS: usize = 256;

/// The most bytes of im2col matrix one chunk builds (unless one image needs
/// more).
pub const MAX_COL_BYTES: usize = 8 << 20;

/// The most bytes of im2col matrix one band of an image builds when a
/// whole image's would not fit a core's L2 next to the GEMM's packed
/// panels (a 32 × 32 image of 64 channels: 2.4 MB).
pub const MAX_BAND_BYTES: usize = 512 << 10;

/// The sizes of one convolution call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Geom {
    pub(super) n: usize,
    pub(super) c: usize,
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) o: usize,
    pub(super) kh: usize,
    pub(super) kw: usize,
    pub(super) s: usize,
    pub(super) p: usize,
    pub(super) ho: usize,
    pub(super) wo: usize,
}

impl Geom {
    /// Rows of `col`: C·kh·kw.
    pub(super) fn k(&self) -> usize {
        self.c * self.kh * self.kw
    }
    /// Output pixels per image.
    pub(super) fn hw(&self) -> usize {
        self.ho * self.wo
    }
    /// Images per chunk.
    pub(super) fn chunk<T>(&self) -> usize {
        let per_image = self.k() * self.hw() * std::mem::size_of::<T>();
        let want = MIN_COLUMNS.div_ceil(self.hw().max(1));
        let fit = (MAX_COL_BYTES / per_image.max(1)).max(1);
        want.min(fit).clamp(1, self.n.max(1))
    }
    /// Output rows per band when a chunk is one image: all of them unless
    /// its im2col matrix passes [`MAX_BAND_BYTES`], else as many as fit
    /// (at least [`MIN_COLUMNS`] pixels), the bands evened out.
    pub(super) fn band<T>(&self) -> usize {
        let per_row = self.k() * self.wo * std::mem::size_of::<T>();
        if self.pointwise() || per_row * self.ho <= MAX_BAND_BYTES || self.wo == 0 {
            return self.ho;
        }
        let rows = (MAX_BAND_BYTES / per_row.max(1))
            .max(MIN_COLUMNS.div_ceil(self.wo))
            .clamp(1, self.ho);
        self.ho.div_ceil(self.ho.div_ceil(rows))
    }
    /// One image's bands of output rows ([`Geom::band`]), or `None` when
    /// it runs whole.
    pub(super) fn bands<T>(&self) -> Option<impl Iterator<Item = Rows>> {
        let (band, ho) = (self.band::<T>(), self.ho);
        (band < ho).then(|| {
            (0..ho)
                .step_by(band)
                .map(move |oy0| oy0..(oy0 + band).min(ho))
        })
    }
    /// x is its own im2col matrix (per image).
    pub(super) fn pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.s == 1 && self.p == 0
    }
}
