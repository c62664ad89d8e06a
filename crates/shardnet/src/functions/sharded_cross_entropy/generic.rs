//! The sharded softmax cross-entropy on any device, in candle's tensor ops:
//! the same forward statistics and communication as the CPU kernel (one
//! allreduce-max of 4B values, one allreduce-sum of B), with backward left
//! to candle's autograd.
//!
//! Each term that crosses ranks enters the graph as its value (a constant
//! from the reduced statistics) plus the local part's first-order change,
//! `v + (t − detach(t))`: the value is the global one, the gradient is the
//! local one, which is exactly the sharded backward (dz = softmax − one-hot
//! on this shard's columns). ψ of the margin enters the same way, as
//! ψ(c) + ψ′(c)·(ℓ − detach(ℓ)) with ℓ = x·∂c/∂x + w_y·∂c/∂w_y: the owned
//! targets' cosines c, their gradients and ψ, ψ′ come from the CPU kernel's
//! f64 definition (`target_cosine`, on the host: B·d values each way), so
//! both paths keep the digits that ψ′ ∝ 1/sin θ magnifies near θ = π.
//! Logits kept in half precision are rounded the same way (straight
//! through). The weight enters as [`crate::functions::tracked`]: its gradient reaches
//! the parameter in backward, as the CPU kernel's does. Where the
//! optimizer's step is fused into backward (`Optimizer::fuse`), the rows
//! taking part enter as `tracked_rows` instead: backward steps those rows
//! and their optimizer state in candle's ops, and leaves every other row
//! and its state as it is, as the CPU kernel's fused step does (under
//! Partial FC, InsightFace's lazy update).

use super::common::{loss_and_correct, target_cosine, targets, Call, CrossEntropyOutput};
use crate::functions::Margin;
use crate::{ReduceOp, Result};
use candle_core::{DType, Tensor};

/// A value whose gradient is that of the local term `t`.
fn value_with_grad_of(value: &Tensor, t: &Tensor) -> Result<Tensor> {
    Ok((value + (t - t.detach())?)?)
}

/// Rows scaled to unit length (norms held at 1e-12 or more).
fn unit_rows(t: &Tensor) -> Result<Tensor> {
    let norm = t.sqr()?.sum_keepdim(1)?.sqrt()?.maximum(1e-12)?;
    Ok(t.broadcast_div(&norm)?)
}

pub(super) fn forward(call: Call<'_>) -> Result<CrossEntropyOutput> {
    let Call {
        comm,
        x,
        weight,
        offset,
        labels,
        sample,
        cfg,
    } = call;
    let (b, _) = x.dims2()?;
    let dev = x.device();
    let normalize = cfg.margin.normalizes();
    let s = if normalize { cfg.scale } else { 1.0 };
    let cr = weight.value().dims2()?.0;
    let target = targets(labels, offset, cr, sample)?;
    // The rows taking part, in the graph: fused, backward steps them and
    // their optimizer state (and no other row); else their gradient
    // reaches the parameter (zero on the rows outside the sample).
    let w = match weight.fused_update() {
        Some(update) => crate::functions::tracked_rows(weight, sample, update)?,
        None => {
            let w = crate::functions::tracked(weight)?;
            match sample {
                Some(idx) => w.index_select(&Tensor::new(idx, dev)?, 0)?,
                None => w,
            }
        }
    };
    let cols = w.dims2()?.0;
    let xf = x.to_dtype(DType::F32)?;
    let to_host = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.to_vec1::<f32>()?) };
    let neg = f32::NEG_INFINITY;
    if cols == 0 {
        // A shard with no classes: no statistics, a zero gradient for x.
        let stats = vec![neg; 4 * b];
        let stats =
            to_host(&comm.allreduce(&Tensor::from_vec(stats, 4 * b, dev)?, ReduceOp::Max)?)?;
        let sum = to_host(&comm.allreduce(&Tensor::zeros(b, DType::F32, dev)?, ReduceOp::Sum)?)?;
        // The shard still takes part: its (zero-size or unsampled) weight
        // gets a zero gradient (fused: no row is stepped), as the CPU
        // kernel gives it.
        let zero = (crate::functions::zero_of(&xf)? + crate::functions::zero_of(&w)?)?;
        return finish(b, dev, &stats, &sum, &zero.broadcast_as(b)?);
    }
    let (xh, wh) = if normalize {
        (unit_rows(&xf)?, unit_rows(&w)?)
    } else {
        (xf.clone(), w.clone())
    };
    // cos θ (B, cols), or plain logits.
    let cos = xh.matmul(&wh.t()?)?;
    let mut mask = vec![0f32; b * cols];
    for (i, t) in target.iter().enumerate() {
        if let Some(t) = t {
            mask[i * cols + t] = 1.0;
        }
    }
    let mask = Tensor::from_vec(mask, (b, cols), dev)?;
    let (z, raw_t) = if normalize {
        // The targets' entries replaced by ψ(c_t), value and gradient from f64.
        let (psi_t, cos_t) = target_psi(&xf, &w, &target, cfg.margin)?;
        let others = (&cos * mask.affine(-1.0, 1.0)?)?;
        let z = ((others + mask.broadcast_mul(&psi_t.unsqueeze(1)?)?)? * s)?;
        (z, cos_t.iter().map(|c| (s * c) as f32).collect())
    } else {
        let raw_t = to_host(&(&cos * &mask)?.sum(1)?)?;
        (cos, raw_t)
    };
    // Local statistics: row max, best non-target logit, target logit, raw target.
    let local_max = z.max_keepdim(1)?.detach();
    let other = (&z + (&mask * -1e30)?)?.max(1)?;
    let z_t = (&z * &mask)?.sum(1)?;
    let owned: Vec<bool> = target.iter().map(Option::is_some).collect();
    let pick = |v: Vec<f32>| -> Vec<f32> {
        v.into_iter()
            .zip(&owned)
            .map(|(v, &o)| if o { v } else { neg })
            .collect()
    };
    let mut stats = to_host(&local_max.squeeze(1)?)?;
    stats.extend(to_host(&other)?);
    stats.extend(pick(to_host(&z_t)?));
    stats.extend(pick(raw_t));
    let stats = to_host(&comm.allreduce(&Tensor::from_vec(stats, 4 * b, dev)?, ReduceOp::Max)?)?;
    // Logits as kept: z − local max, rounded to the logits precision
    // (straight through).
    let zq = if cfg.logits == DType::F32 {
        z
    } else {
        let shifted = z.broadcast_sub(&local_max)?;
        let rounded = shifted.to_dtype(cfg.logits)?.to_dtype(DType::F32)?;
        (&z + (rounded.broadcast_add(&local_max)? - &z)?.detach())?
    };
    let max = Tensor::from_slice(&stats[..b], (b, 1), dev)?;
    let local_sum = zq.broadcast_sub(&max)?.exp()?.sum(1)?;
    let sum = to_host(&comm.allreduce(&local_sum.detach(), ReduceOp::Sum)?)?;
    // Gradient of ln Σ_global: local Σ / global Σ; of −z_t: −(z_t here).
    let sum_t = Tensor::from_slice(&sum, b, dev)?;
    let z_t_local = (&zq * &mask)?.sum(1)?;
    let local =
        ((&local_sum - local_sum.detach())?.div(&sum_t)? - (&z_t_local - z_t_local.detach())?)?;
    finish(b, dev, &stats, &sum, &local)
}

/// ψ(cos θ_y) of each owned target (B, zero elsewhere), carrying the
/// gradient ψ′·(∂cos/∂x, ∂cos/∂w_y), and the cosines, all from
/// [`target_cosine`] in f64 on the host: x (B, d) and the weight rows
/// taking part (cols, d), both f32.
fn target_psi(
    x: &Tensor,
    w: &Tensor,
    target: &[Option<usize>],
    margin: Margin,
) -> Result<(Tensor, Vec<f64>)> {
    let (b, d) = x.dims2()?;
    let dev = x.device();
    // Each sample's target row (row 0, unused, where not owned).
    let rows: Vec<u32> = target.iter().map(|t| t.unwrap_or(0) as u32).collect();
    let wt = w
        .index_select(&Tensor::from_vec(rows, b, dev)?, 0)?
        .to_dtype(DType::F32)?;
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let ws = wt.flatten_all()?.to_vec1::<f32>()?;
    let (mut gx, mut gw) = (vec![0f32; b * d], vec![0f32; b * d]);
    let (mut cos, mut psi, mut dpsi) = (vec![0f64; b], vec![0f32; b], vec![0f32; b]);
    for (i, t) in target.iter().enumerate() {
        if t.is_some() {
            let r = i * d..(i + 1) * d;
            cos[i] = target_cosine(
                &xs[r.clone()],
                &ws[r.clone()],
                &mut gx[r.clone()],
                &mut gw[r],
            );
            let (p, dp) = margin.psi_and_derivative(cos[i]);
            (psi[i], dpsi[i]) = (p as f32, dp as f32);
        }
    }
    let gx = Tensor::from_vec(gx, (b, d), dev)?;
    let gw = Tensor::from_vec(gw, (b, d), dev)?;
    // ℓ − detach(ℓ): zero, with the gradient (∂cos/∂x, ∂cos/∂w_y).
    let lin = ((x * gx)?.sum(1)? + (wt * gw)?.sum(1)?)?;
    let dc = (&lin - lin.detach())?;
    let psi = Tensor::from_vec(psi, b, dev)?;
    let psi_t = (psi + (dc * Tensor::from_vec(dpsi, b, dev)?)?)?;
    Ok((psi_t, cos))
}

/// The loss (B) from the reduced statistics, carrying `local`'s gradient,
/// and the count of correct samples (as the CPU kernel counts them).
fn finish(
    b: usize,
    dev: &candle_core::Device,
    stats: &[f32],
    sum: &[f32],
    local: &Tensor,
) -> Result<CrossEntropyOutput> {
    let (loss, correct) = loss_and_correct(b, stats, sum);
    let loss = value_with_grad_of(&Tensor::from_vec(loss, b, dev)?, local)?;
    Ok(CrossEntropyOutput { loss, correct })
}
