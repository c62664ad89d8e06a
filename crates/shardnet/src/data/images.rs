//! Image datasets made or reshaped in memory: a seeded synthetic set for
//! benchmarks ([`synthetic_images`]) and zero padding of one-channel images
//! ([`pad_images`], e.g. MNIST's 28×28 to the 32×32 of a CIFAR-sized CNN).
//!
//! Rows hold images flattened channel-major (NCHW): channel `c`, row `y`,
//! column `x` of a `side`×`side` image is feature `(c * side + y) * side + x`.

use super::dataset::TensorDataset;
use crate::rng::splitmix64;
use crate::{Error, Result};
use candle_core::Tensor;

/// Nodes per axis of the coarse grid a class pattern is interpolated from.
const GRID: usize = 4;

/// Half-width of the uniform noise added to each pixel.
const NOISE: f32 = 1.0;

/// A uniform f32 in [-1, 1) from 16 random bits.
fn unit(bits: u64) -> f32 {
    (bits & 0xFFFF) as f32 / 32768.0 - 1.0
}

/// The smooth pattern of one class: for each channel, a [`GRID`]×[`GRID`]
/// grid of values in [-1, 1) drawn from `state`, interpolated bilinearly
/// over the `side`×`side` image (channel-major, as the rows).
fn pattern(channels: usize, side: usize, state: &mut u64) -> Vec<f32> {
    // Where each pixel falls on the grid: the node before it and the
    // fraction of the way to the next.
    let at: Vec<(usize, f32)> = (0..side)
        .map(|p| {
            let u = if side > 1 {
                (p * (GRID - 1)) as f32 / (side - 1) as f32
            } else {
                0.0
            };
            let i = (u as usize).min(GRID - 2);
            (i, u - i as f32)
        })
        .collect();
    let mut out = Vec::with_capacity(channels * side * side);
    for _ in 0..channels {
        let grid: Vec<f32> = (0..GRID * GRID).map(|_| unit(splitmix64(state))).collect();
        let g = |r: usize, c: usize| grid[r * GRID + c];
        for &(iy, fy) in &at {
            for &(ix, fx) in &at {
                let top = (1.0 - fx) * g(iy, ix) + fx * g(iy, ix + 1);
                let bottom = (1.0 - fx) * g(iy + 1, ix) + fx * g(iy + 1, ix + 1);
                out.push((1.0 - fy) * top + fy * bottom);
            }
        }
    }
    out
}

/// `n` synthetic `channels`×`side`×`side` images in `classes` classes, for
/// benchmarks: features `n × (channels * side * side)` f32 (channel-major),
/// labels u32 drawn uniformly from `0..classes`.
///
/// Each class has a smooth pattern (per channel, a random 4×4 grid of
/// values in [-1, 1) interpolated bilinearly over the image); an example is
/// its class's pattern times a random contrast in [0.5, 1.5), plus uniform
/// noise in [-1, 1) on every pixel. The classes are learnable (a nearest
/// class-mean rule separates them well) yet not identical images.
///
/// Everything comes from `seed` through splitmix64 and basic f32
/// arithmetic only, so a seed gives the same dataset on every machine; a
/// different seed gives different patterns, labels and noise. Fast enough
/// for CIFAR-10's size (50,000 × 3 × 32 × 32) in about a second (release).
///
/// Refuses `channels`, `side` or `classes` of 0, and sizes that overflow.
pub fn synthetic_images(
    n: usize,
    channels: usize,
    side: usize,
    classes: usize,
    seed: u64,
) -> Result<TensorDataset> {
    let _data = crate::heap::counting_as(crate::heap::Part::Data);
    if channels == 0 || side == 0 || classes == 0 {
        return Err(Error::Usage(format!(
            "synthetic_images: needs at least one channel, pixel and class (got {channels} \
             channels, side {side}, {classes} classes)"
        )));
    }
    let features = side
        .checked_mul(side)
        .and_then(|p| p.checked_mul(channels))
        .filter(|f| f.checked_mul(n).is_some())
        .ok_or_else(|| {
            Error::Usage(format!(
                "synthetic_images: {n} images of {channels}×{side}×{side} are too many values"
            ))
        })?;
    let mut state = seed;
    let patterns: Vec<Vec<f32>> = (0..classes)
        .map(|_| pattern(channels, side, &mut state))
        .collect();
    let mut x = Vec::with_capacity(n * features);
    let mut t = Vec::with_capacity(n);
    for _ in 0..n {
        let label = (splitmix64(&mut state) % classes as u64) as usize;
        let contrast = 1.0 + 0.5 * unit(splitmix64(&mut state));
        t.push(label as u32);
        // Four 16-bit noise values per draw.
        let mut chunks = patterns[label].chunks_exact(4);
        for c in &mut chunks {
            let r = splitmix64(&mut state);
            for (k, p) in c.iter().enumerate() {
                x.push(contrast * p + NOISE * unit(r >> (16 * k)));
            }
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let r = splitmix64(&mut state);
            for (k, p) in rest.iter().enumerate() {
                x.push(contrast * p + NOISE * unit(r >> (16 * k)));
            }
        }
    }
    let x = Tensor::from_vec(x, (n, features), &crate::comm::HOST)?;
    let t = Tensor::from_vec(t, n, &crate::comm::HOST)?;
    TensorDataset::new(x, t)
}

/// `ds` with each row, a `side`×`side` one-channel image, padded with `pad`
/// zero pixels on every side: rows of `(side + 2 * pad)²` features, labels
/// unchanged, values as they were (no normalisation). MNIST or
/// Fashion-MNIST (`side` 28, `pad` 2) becomes 32×32, to feed a CNN sized for
/// CIFAR-10.
///
/// Refuses (Error::Usage) features that are not a matrix with rows of
/// `side * side` values.
pub fn pad_images(ds: &TensorDataset, side: usize, pad: usize) -> Result<TensorDataset> {
    let _data = crate::heap::counting_as(crate::heap::Part::Data);
    let dims = ds.x.dims();
    let pixels = side.checked_mul(side).filter(|p| *p > 0);
    let n = match (dims, pixels) {
        (&[n, w], Some(p)) if w == p => n,
        _ => {
            return Err(Error::Usage(format!(
                "pad_images: features {dims:?} are not rows of {side}×{side} one-channel images \
                 (n × {} values)",
                side.saturating_mul(side)
            )))
        }
    };
    let out = pad
        .checked_mul(2)
        .and_then(|p| p.checked_add(side))
        .filter(|o| o.checked_mul(*o).is_some())
        .ok_or_else(|| Error::Usage(format!("pad_images: padding {pad} is too large")))?;
    let x =
        ds.x.reshape((n, side, side))?
            .pad_with_zeros(1, pad, pad)?
            .pad_with_zeros(2, pad, pad)?
            .reshape((n, out * out))?;
    TensorDataset::new(x, ds.t.clone())
}
