//! A block's tiles as runs along one row of tiles ([`Run`]), and lanes as
//! mask bits: what the portable lanes and the x86 code both read.

/// Tiles of one block lying side by side on one row of tiles of one image:
/// lanes `lane..lane + len` of the block, `split` the first tile's 4 × 4
/// input in the chunk's split planes of one channel, `pixel` its 2 × 2
/// output in the chunk's planes of channel 0; `rows` (1 or 2) and `pixels`
/// (≤ 2·len) of the output lie inside Ho and Wo.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub lane: usize,
    pub len: usize,
    pub split: usize,
    pub pixel: usize,
    pub rows: usize,
    pub pixels: usize,
    /// The run's lanes of its block, lane..lane + len, as bits.
    pub lanes: u16,
    /// Its output pixels on a row as lanes of two vectors, 2·lane ..
    /// 2·lane + pixels, as bits of each. Both worked out once per call
    /// with the runs rather than for every channel: at small images a
    /// block holds many runs.
    pub pixel_lanes: [u16; 2],
}

/// Lanes lo..hi of 16 (clamped), as bits.
#[inline(always)]
pub fn bits(lo: usize, hi: usize) -> u16 {
    let first = |n: usize| {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as u16
        }
    };
    first(hi.min(16)) & !first(lo.min(16))
}
