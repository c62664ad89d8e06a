//! The CPU kernel's backward, local to the rank: what forward keeps
//! ([`Saved`]), the graph op whose backward it is ([`Op`]), and the walk
//! over the class blocks that turns the kept logits into ∂L/∂z, dx and the
//! weight's gradient (into the parameter's buffer, or straight into the
//! optimizer's fused update of those rows).

use super::common::{block_rows, class_blocks, CrossEntropyConfig};
use super::precision::{give_back_logits, prefetch_next_block, to_bf16, Elem};
use crate::functions::{InPlaceGrad, RowUpdate, Rows};
use crate::kernels::bf16::matmul_bf16;
use crate::kernels::matmul;
use crate::{Error, Result};
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;
use std::sync::{Arc, Mutex};

/// Everything backward needs, kept from forward.
pub(super) struct Saved<T> {
    pub(super) weight: Arc<dyn InPlaceGrad>,
    pub(super) cfg: CrossEntropyConfig,
    pub(super) b: usize,
    pub(super) d: usize,
    /// Normalised (or plain) features, f32 (B, d), and 1/‖x_i‖.
    pub(super) xhat: Vec<f32>,
    pub(super) xinv: Vec<f32>,
    /// x̂ rounded to bf16, where the GEMMs take bf16 inputs ([`super::precision::bf16_gemms`]).
    pub(super) xhat_bf16: Option<Vec<bf16>>,
    /// The local rows that take part, if a sample (sorted).
    pub(super) sample: Option<Vec<u32>>,
    /// 1/‖w_c‖ of the rows taking part (normalised heads).
    pub(super) winv: Vec<f32>,
    /// Local column of each row's label, if this rank owns it.
    pub(super) target: Vec<Option<usize>>,
    /// cos θ of each owned target, in f64, and its gradients with respect
    /// to x_i and to the target's row (B, d each; zero where not owned;
    /// empty for the plain layer): see [`super::common::target_cosine`].
    pub(super) cos_target: Vec<f64>,
    pub(super) dcos_dx: Vec<f32>,
    pub(super) dcos_dw: Vec<f32>,
    /// The logits, class block after class block, each block (B, its
    /// columns) row-major, holding exp(z − m), m the row's max in the
    /// block, in the logits precision (backward needs no exp); taken by
    /// backward.
    pub(super) logits: Mutex<Option<Vec<T>>>,
    /// Each block's row maxima (blocks × B), and each row's global max.
    pub(super) block_max: Vec<f32>,
    pub(super) max: Vec<f32>,
    /// Σ exp(z − global max) of each row.
    pub(super) sum: Vec<f32>,
    /// The per-sample loss, the op's output.
    pub(super) loss: Tensor,
}

/// The op in the graph: forward returns the loss computed by
/// [`super::forward::forward`]; backward is local.
pub(super) struct Op<T>(pub(super) Arc<Saved<T>>);

impl<T: Elem> CustomOp2 for Op<T> {
    fn name(&self) -> &'static str {
        "shardnet-sharded-cross-entropy"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let v = self.0.loss.to_vec1::<f32>()?;
        Ok((CpuStorage::F32(v), Shape::from(self.0.b)))
    }
    fn bwd(
        &self,
        x: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let dx = backward(&self.0, &g)?;
        let dx = Tensor::from_vec(dx, (self.0.b, self.0.d), x.device())?.to_dtype(x.dtype())?;
        Ok((x.track_op().then_some(dx), None))
    }
}

/// Where each class block's weight gradient goes.
enum Sink {
    /// Into the weight's gradient buffer (overwriting where `fresh`).
    Grad { fresh: bool },
    /// Into the optimizer's update of those rows, at once (the fused step).
    Fused(Arc<dyn RowUpdate>),
}

/// Backward, class block by class block: for each block, G = ∂L/∂z from
/// the kept logits, dx̂ += G·W_block, A = Gᵀx̂ (the block's weight
/// gradient, through the normalisation and the targets' terms), then A goes
/// to the gradient buffer or straight into the fused update of those rows
/// (after the block's last use of W). The shard's whole gradient is never
/// held by the fused step.
fn backward<T: Elem>(sv: &Saved<T>, g: &[f32]) -> Result<Vec<f32>> {
    let Some(mut logits) = sv.logits.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return Err(Error::Usage(
            "sharded_softmax_cross_entropy: no logits kept for this backward (a second \
             backward through one forward, or one through a forward with backward: false)"
                .into(),
        ));
    };
    let (b, d) = (sv.b, sv.d);
    let normalize = sv.cfg.margin.normalizes();
    let s = if normalize { sv.cfg.scale as f32 } else { 1.0 };
    let sample = sv.sample.as_deref();
    let cr = sv.weight.value().dims2()?.0;
    let cols = sample.map_or(cr, |i| i.len());
    let sink = match sv.weight.fused_update() {
        Some(u) => Sink::Fused(u),
        None => Sink::Grad {
            fresh: !sv.weight.has_grad(),
        },
    };
    if matches!(sink, Sink::Grad { fresh: true }) && (sample.is_some() || cols == 0) {
        // Rows outside the sample get a zero gradient (and an empty shard
        // an empty one).
        sv.weight.update_grad(&mut |dw, _| {
            dw.fill(0.0);
            Ok(())
        })?;
    }
    let mut dxhat = vec![0f32; b * d];
    let mut target_beta = vec![0f64; b];
    let (mut rows_scratch, mut gz_scratch, mut a) = (Vec::new(), Vec::new(), Vec::new());
    let mut gz_bf16: Vec<bf16> = Vec::new();
    sv.weight.update_value(&mut |w: &mut [f32]| -> Result<()> {
        for (k, range) in class_blocks(cols) {
            let width = range.len();
            let buf = &mut logits[b * range.start..b * range.end];
            let gz: &mut [f32] = match T::as_f32_mut(buf) {
                Some(z) => z,
                None => {
                    T::load(buf, &mut gz_scratch);
                    &mut gz_scratch[..]
                }
            };
            let winv_b = if normalize {
                &sv.winv[range.clone()]
            } else {
                &[][..]
            };
            // z → G: ∂L/∂z = g·(softmax − one-hot), then through s and
            // 1/‖w_c‖; the normalised target's s·ψ′·∂L/∂z is kept aside (its
            // term is added below, in f64) and its G left at zero.
            gz.par_chunks_mut(width)
                .zip(target_beta.par_iter_mut())
                .enumerate()
                .for_each(|(i, (row, beta))| {
                    use crate::kernels::vector;
                    // The block holds e = exp(z − m): p = e·exp(m − max)/Σ.
                    let gi = g[i];
                    let off = sv.block_max[k * b + i] - sv.max[i];
                    vector::scale(row, gi * vector::exp(off) / sv.sum[i]);
                    let t = sv.target[i]
                        .filter(|t| range.contains(t))
                        .map(|t| t - range.start);
                    let dz_t = t.map(|t| row[t] - gi);
                    if normalize {
                        vector::scale_each(row, winv_b, s);
                    }
                    if let (Some(t), Some(dz)) = (t, dz_t) {
                        row[t] = if normalize {
                            let (_, dpsi) = sv.cfg.margin.psi_and_derivative(sv.cos_target[i]);
                            *beta = f64::from(s * dz) * dpsi;
                            0.0
                        } else {
                            dz
                        };
                    }
                });
            let gz: &[f32] = gz;
            let wb = block_rows(w, sample, &range, d, &mut rows_scratch);
            // dx̂ (B, d) += G · W_block; A (width, d) = Gᵀ · x̂.
            a.resize(width * d, 0f32);
            match &sv.xhat_bf16 {
                Some(xh) => {
                    if sample.is_none() {
                        prefetch_next_block(w, &range, cols, d);
                    }
                    // G rounded once for both GEMMs.
                    to_bf16(gz, &mut gz_bf16);
                    let g16 = &gz_bf16[..];
                    let dst = (&mut dxhat[..], d, 1);
                    matmul_bf16(b, d, width, dst, k > 0, (g16, width, 1), (wb, d, 1));
                    let dst = (&mut a[..], d, 1);
                    matmul_bf16(width, d, b, dst, false, (g16, 1, width), (xh, d, 1));
                }
                None => {
                    matmul(b, d, width, &mut dxhat, k > 0, (gz, width, 1), (wb, d, 1));
                    matmul(width, d, b, &mut a, false, (gz, 1, width), (&sv.xhat, d, 1));
                }
            }
            // Through ŵ_c = w_c/‖w_c‖: A_c minus its component along w_c
            // (A already carries one 1/‖w_c‖); then the targets' terms
            // β_i·∂cos/∂w.
            if normalize {
                project_out(&mut a, wb, winv_b, d);
                for ((t, beta), dc) in sv
                    .target
                    .iter()
                    .zip(&target_beta)
                    .zip(sv.dcos_dw.chunks(d.max(1)))
                {
                    if let Some(t) = t.filter(|t| range.contains(t)) {
                        let row = &mut a[(t - range.start) * d..(t - range.start + 1) * d];
                        for (o, v) in row.iter_mut().zip(dc) {
                            *o = (f64::from(*o) + beta * f64::from(*v)) as f32;
                        }
                    }
                }
            }
            let rows = match sample {
                Some(idx) => Rows::List(&idx[range.clone()]),
                None => Rows::Range(range.clone()),
            };
            match &sink {
                Sink::Fused(u) => u.update_rows(rows, w, &a, d)?,
                Sink::Grad { fresh } => sv.weight.update_grad(&mut |dw, _| {
                    for (r, src) in rows.iter().zip(a.chunks(d.max(1))) {
                        let dst = &mut dw[r * d..(r + 1) * d];
                        if *fresh && sample.is_none() {
                            dst.copy_from_slice(src);
                        } else {
                            dst.iter_mut().zip(src).for_each(|(o, v)| *o += v);
                        }
                    }
                    Ok(())
                })?,
            }
        }
        Ok(())
    })?;
    give_back_logits(logits);
    // Through x̂ = x/‖x‖: dx = (dx̂ − (dx̂·x̂) x̂)/‖x‖; then the target's
    // term β_i·∂cos/∂x.
    if normalize {
        dxhat
            .par_chunks_mut(d.max(1))
            .zip(sv.xhat.par_chunks(d.max(1)))
            .zip(&sv.xinv)
            .zip(sv.dcos_dx.par_chunks(d.max(1)))
            .zip(&target_beta)
            .for_each(|((((g, xh), inv), dc), beta)| {
                let dot: f32 = g.iter().zip(xh).map(|(a, b)| a * b).sum();
                for ((gv, xv), dcv) in g.iter_mut().zip(xh).zip(dc) {
                    let v = (*gv - dot * xv) * inv;
                    *gv = (f64::from(v) + beta * f64::from(*dcv)) as f32;
                }
            });
    }
    Ok(dxhat)
}

/// a_c −= (a_c·w_c)/‖w_c‖² · w_c for each row c (the backward of w/‖w‖,
/// with a already divided by ‖w_c‖ once).
fn project_out(a: &mut [f32], w: &[f32], winv: &[f32], d: usize) {
    a.par_chunks_mut(d.max(1))
        .zip(w.par_chunks(d.max(1)))
        .zip(winv)
        .for_each(|((a, w), inv)| {
            let k = a.iter().zip(w).map(|(x, y)| x * y).sum::<f32>() * inv * inv;
            a.iter_mut().zip(w).for_each(|(x, y)| *x -= k * y);
        });
}
