//! What both paths of the sharded cross-entropy share: the call's
//! configuration and result, its checked arguments ([`Call`]), the class
//! blocks the CPU kernel walks, and the one definition of the target's f64
//! cosine, of the targets' local columns and of the loss and hit count
//! from the reduced statistics.

use crate::comm::Communicator;
use crate::functions::{InPlaceGrad, Margin};
use crate::{Error, Result};
use candle_core::{DType, Tensor};

/// What one call of [`sharded_softmax_cross_entropy`](super::sharded_softmax_cross_entropy)
/// computes with.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyConfig {
    /// ψ for the target logit (and whether to normalise).
    pub margin: Margin,
    /// s, the logit scale of normalised heads.
    pub scale: f64,
    /// The precision logits are kept in: F32, BF16 or F16.
    pub logits: DType,
    /// Whether backward will run: `false` (evaluation) keeps no logits,
    /// only one class block's at a time, and a backward is an error.
    pub backward: bool,
}

/// The result of one call.
#[derive(Debug)]
pub struct CrossEntropyOutput {
    /// Per-sample loss (B), f32, identical on every rank; differentiable.
    pub loss: Tensor,
    /// How many of the B samples have their label as the best raw logit
    /// (over the classes that took part).
    pub correct: usize,
}

/// Classes per block: forward and backward walk the shard's classes in
/// blocks of this many rows of W_r, so that a block of W_r (CLASS_BLOCK × d),
/// its logits (B × CLASS_BLOCK) and its gradient stay in cache while the
/// GEMMs, the softmax and the update use them: W_r is read from memory
/// once per phase.
pub const CLASS_BLOCK: usize = 1024;

/// The class blocks of `cols` columns: (block index, columns).
pub(super) fn class_blocks(cols: usize) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> {
    (0..cols.div_ceil(CLASS_BLOCK)).map(move |k| {
        let c0 = k * CLASS_BLOCK;
        (k, c0..(c0 + CLASS_BLOCK).min(cols))
    })
}

/// The arguments of one call, checked.
#[derive(Clone, Copy)]
pub(super) struct Call<'a> {
    pub comm: &'a Communicator,
    pub x: &'a Tensor,
    pub weight: &'a dyn InPlaceGrad,
    pub offset: usize,
    pub labels: &'a [u32],
    pub sample: Option<&'a [u32]>,
    pub cfg: CrossEntropyConfig,
}

/// The weight rows of class block `cols`: a slice of W (the full head), or
/// the sample's rows gathered into `scratch` (one block, not the sample).
pub(super) fn block_rows<'a>(
    w: &'a [f32],
    sample: Option<&[u32]>,
    cols: &std::ops::Range<usize>,
    d: usize,
    scratch: &'a mut Vec<f32>,
) -> &'a [f32] {
    match sample {
        None => &w[cols.start * d..cols.end * d],
        Some(idx) => {
            scratch.clear();
            for &r in &idx[cols.clone()] {
                scratch.extend_from_slice(&w[r as usize * d..(r as usize + 1) * d]);
            }
            scratch
        }
    }
}

/// cos θ between a feature row `x` and its target's weight row `w`, each
/// normalised in f64 (norms held at 1e-12 or more), clamped to [−1, 1];
/// and its gradients ∂cos/∂x = (ŵ − cos·x̂)/‖x‖ into `dx` and ∂cos/∂w =
/// (x̂ − cos·ŵ)/‖w‖ into `dw`, rounded to f32 only once computed. Near
/// θ = π, ψ′ ∝ 1/sin θ magnifies the cosine's last digits and these
/// gradients are differences of nearly opposite unit vectors: in f32 both
/// would lose digits. Both paths' one definition of the target's term.
pub(super) fn target_cosine(x: &[f32], w: &[f32], dx: &mut [f32], dw: &mut [f32]) -> f64 {
    let norm = |v: &[f32]| {
        v.iter()
            .map(|&a| f64::from(a) * f64::from(a))
            .sum::<f64>()
            .sqrt()
            .max(1e-12)
    };
    let (nx, nw) = (norm(x), norm(w));
    let unit = |a: f32, n: f64| f64::from(a) / n;
    let cos = x
        .iter()
        .zip(w)
        .map(|(&a, &b)| unit(a, nx) * unit(b, nw))
        .sum::<f64>()
        .clamp(-1.0, 1.0);
    for (((&a, &b), gx), gw) in x.iter().zip(w).zip(dx).zip(dw) {
        let (xh, wh) = (unit(a, nx), unit(b, nw));
        *gx = ((wh - cos * xh) / nx) as f32;
        *gw = ((xh - cos * wh) / nw) as f32;
    }
    cos
}

/// The per-sample loss ln Σ + max − z_t and the count of hits
/// ([`crate::functions::is_hit`]: the target's raw logit strictly the best, no NaN), from the reduced statistics ([max, best
/// non-target, target, raw target] × B, and Σ exp(z − max)): both paths'
/// one definition.
pub(super) fn loss_and_correct(b: usize, stats: &[f32], sum: &[f32]) -> (Vec<f32>, usize) {
    let mut correct = 0;
    let loss = (0..b)
        .map(|i| {
            let (best_other, zt, raw_t) = (stats[b + i], stats[2 * b + i], stats[3 * b + i]);
            let loss = sum[i].ln() + stats[i] - zt;
            correct += usize::from(crate::functions::is_hit(raw_t, best_other, loss));
            loss
        })
        .collect();
    (loss, correct)
}

/// Each sample's local column (in the sample, if one) of its label, if this
/// shard owns it; an error if the sample leaves out an owned label.
pub(super) fn targets(
    labels: &[u32],
    offset: usize,
    cr: usize,
    sample: Option<&[u32]>,
) -> Result<Vec<Option<usize>>> {
    let target: Vec<Option<usize>> = labels
        .iter()
        .map(|&l| {
            let local = (l as usize).checked_sub(offset).filter(|&c| c < cr)?;
            match sample {
                Some(idx) => idx.binary_search(&(local as u32)).ok(),
                None => Some(local),
            }
        })
        .collect();
    if let Some(idx) = sample {
        let owned = |l: u32| (l as usize) >= offset && (l as usize) < offset + cr;
        if let Some((_, l)) = target
            .iter()
            .zip(labels)
            .find(|(t, &l)| t.is_none() && owned(l))
        {
            return Err(Error::Usage(format!(
                "sharded_softmax_cross_entropy: the class sample ({} rows) leaves out label {l} \
                 of this shard: a sample must keep every positive class",
                idx.len()
            )));
        }
    }
    Ok(target)
}
