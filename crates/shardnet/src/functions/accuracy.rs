//! Top-1 accuracy, one rule for every model and both head paths.
//!
//! A sample is a hit when the logit of its label is **strictly** greater
//! than every other logit of its row, and the row holds no NaN. A tie is not
//! a hit (a head whose logits are all equal, e.g. at scale 0, scores 0, not
//! 100%); NaN is never a hit.

use crate::Result;
use candle_core::{DType, Tensor, D};

/// Whether a sample is a hit, from its target logit, the best of its other
/// logits and its loss (NaN or infinite when the row held a NaN): `target >
/// best_other` with a finite loss. NaN compares false, so it is never a hit.
pub fn is_hit(target: f32, best_other: f32, loss: f32) -> bool {
    target > best_other && loss.is_finite()
}

/// The hits among the rows of `logits` (B × C) for `labels` (B, u32).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let logits = Tensor::new(&[[2f32, 1.0], [1.0, 1.0], [f32::NAN, 3.0]], &Device::Cpu)?;
/// let labels = Tensor::new(&[0u32, 0, 1], &Device::Cpu)?;
/// // Row 1 is a tie, row 2 holds a NaN: one hit.
/// assert_eq!(shardnet::functions::top1_hits(&logits, &labels)?, 1);
/// # Ok::<(), shardnet::Error>(())
/// ```
pub fn top1_hits(logits: &Tensor, labels: &Tensor) -> Result<usize> {
    let (n, c) = logits.dims2()?;
    if n == 0 {
        // No rows (a replica the epoch's last batch left without images):
        // nothing to count, and candle's max has nothing to reduce.
        return Ok(0);
    }
    let z = logits.to_dtype(DType::F32)?.contiguous()?;
    let labels = labels.to_dtype(DType::U32)?.contiguous()?;
    let target = z.gather(&labels.unsqueeze(1)?, 1)?;
    // Every other class: the target's column pushed to −∞.
    let classes = Tensor::arange(0u32, c as u32, z.device())?.unsqueeze(0)?;
    let is_target = classes.broadcast_eq(&labels.unsqueeze(1)?)?;
    let others =
        is_target.where_cond(&Tensor::full(f32::NEG_INFINITY, z.shape(), z.device())?, &z)?;
    let best_other = others.max_keepdim(D::Minus1)?;
    let beats = target.gt(&best_other)?;
    // A NaN anywhere in the row: x ≠ x.
    let nan = z.ne(&z)?.to_dtype(DType::U32)?.max_keepdim(D::Minus1)?;
    let hit = beats.to_dtype(DType::U32)?.gt(&nan)?;
    Ok(hit.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>()? as usize)
}
