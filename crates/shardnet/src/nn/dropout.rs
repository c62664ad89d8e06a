//! Dropout: y = x ⊙ mask / (1 − p), the mask drawn from seeds, not from
//! the rank, so ranks that hold the same activations drop the same
//! elements (a replicated classifier stays replicated), and a split of
//! one tensor over ranks drops what the whole would.
//!
//! | function | the mask of | keyed by |
//! |----------|-------------|----------|
//! | [`dropout`] | every element, in order | one seed |
//! | [`dropout_rows`] | each row of (N, F) | the seed and the row's own key (its global index: a batch row, a position), so any rows of a global tensor, on any rank, get the whole's mask |
//!
//! Backward multiplies by the same mask (a product in candle's ops, on any
//! device).

use crate::rng::splitmix64;
use crate::{Error, Result};
use candle_core::Tensor;

fn check(p: f64) -> Result<()> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(Error::Usage(format!(
            "dropout: probability {p} must lie in [0, 1)"
        )))
    }
}

/// 1/(1 − p) where a draw from `state` keeps the element, else 0.
fn draw(state: &mut u64, threshold: u64, keep: f32) -> f32 {
    if splitmix64(state) >> 11 < threshold {
        0.0
    } else {
        keep
    }
}

fn threshold(p: f64) -> u64 {
    (p * (1u64 << 53) as f64) as u64
}

/// Dropout: each element kept with probability 1 − p and scaled by
/// 1/(1 − p), the mask drawn from `seed` alone. `p = 0` is the identity;
/// `p` must lie in [0, 1).
pub fn dropout(x: &Tensor, p: f64, seed: u64) -> Result<Tensor> {
    check(p)?;
    if p == 0.0 {
        return Ok(x.clone());
    }
    let (keep, threshold) = ((1.0 / (1.0 - p)) as f32, threshold(p));
    let mut s = seed ^ 0xD1B5_4A32_D192_ED03;
    let mask: Vec<f32> = (0..x.elem_count())
        .map(|_| draw(&mut s, threshold, keep))
        .collect();
    let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
    Ok(x.mul(&mask)?)
}

/// Dropout of `x` seen as rows (N, F) (the last dimension F, the others
/// flattened into N = `keys.len()`): row i's mask drawn from (`seed`,
/// `keys[i]`) alone. `p = 0` is the identity; `p` must lie in [0, 1).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::ones((3, 4), candle_core::DType::F32, &Device::Cpu)?;
/// let whole = shardnet::nn::dropout_rows(&x, 0.5, 7, &[0, 1, 2])?;
/// // Rows 1 and 2 alone, keyed by their global index: the whole's rows.
/// let part = shardnet::nn::dropout_rows(&x.narrow(0, 1, 2)?, 0.5, 7, &[1, 2])?;
/// assert_eq!(part.to_vec2::<f32>()?, whole.narrow(0, 1, 2)?.to_vec2::<f32>()?);
/// # Ok::<(), shardnet::Error>(())
/// ```
pub fn dropout_rows(x: &Tensor, p: f64, seed: u64, keys: &[u64]) -> Result<Tensor> {
    check(p)?;
    if p == 0.0 {
        return Ok(x.clone());
    }
    let f = x.dims().last().copied().unwrap_or(1);
    if keys.len() * f != x.elem_count() {
        return Err(Error::Usage(format!(
            "dropout_rows: {} keys for a tensor of shape {:?} ({} rows of its last dimension)",
            keys.len(),
            x.dims(),
            x.elem_count() / f.max(1)
        )));
    }
    let (keep, threshold) = ((1.0 / (1.0 - p)) as f32, threshold(p));
    let mut mask = Vec::with_capacity(x.elem_count());
    for &k in keys {
        let mut s = seed ^ 0xD1B5_4A32_D192_ED03;
        let mut s = splitmix64(&mut s) ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        mask.extend((0..f).map(|_| draw(&mut s, threshold, keep)));
    }
    let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
    Ok(x.mul(&mask)?)
}
