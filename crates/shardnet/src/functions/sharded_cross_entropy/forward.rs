//! The CPU kernel's forward: class block by class block, the logits
//! z = s·x̂ Ŵ_rᵀ, the margin at the target, each row's statistics and the
//! kept exp(z − m) in the logits precision; then the two allreduces and the
//! loss, put in the graph as the op of `backward`.

use super::backward::{Op, Saved};
use super::common::{
    block_rows, class_blocks, loss_and_correct, target_cosine, targets, Call, CrossEntropyOutput,
    CLASS_BLOCK,
};
use super::precision::{
    bf16_gemms, give_back_logits, logits_buffer, prefetch_next_block, to_bf16, Elem,
};
use crate::functions::Margin;
use crate::kernels::bf16::matmul_bf16;
use crate::kernels::dot::{matmul_abt, Abt};
use crate::{Error, ReduceOp, Result};
use candle_core::{CpuStorage, DType, Storage, Tensor};
use rayon::prelude::*;
use std::sync::{Arc, Mutex};

/// The local row of column `c` (the sample's, or c itself).
fn row_of(sample: Option<&[u32]>, c: usize) -> usize {
    sample.map_or(c, |idx| idx[c] as usize)
}

pub(super) fn forward<T: Elem>(call: Call<'_>) -> Result<CrossEntropyOutput> {
    let Call {
        comm,
        x,
        weight,
        offset,
        labels,
        sample,
        cfg,
    } = call;
    let (b, d) = x.dims2()?;
    let normalize = cfg.margin.normalizes();
    let s = if normalize { cfg.scale as f32 } else { 1.0 };
    let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let w = weight.value();
    let cr = w.dims2()?.0;
    let cols = sample.map_or(cr, |i| i.len());
    let target = targets(labels, offset, cr, sample)?;
    // The owned targets' cos θ and its gradients, in f64 from x and w.
    let mut cos_target = vec![0f64; b];
    let (mut dcos_dx, mut dcos_dw) = (Vec::new(), Vec::new());
    if normalize {
        (dcos_dx, dcos_dw) = (vec![0f32; b * d], vec![0f32; b * d]);
        with_f32(w, |w| {
            cos_target
                .par_iter_mut()
                .zip(dcos_dx.par_chunks_mut(d.max(1)))
                .zip(dcos_dw.par_chunks_mut(d.max(1)))
                .zip(xs.par_chunks(d.max(1)))
                .zip(&target)
                .for_each(|((((c, gx), gw), x), t)| {
                    if let Some(t) = *t {
                        let r = row_of(sample, t);
                        *c = target_cosine(x, &w[r * d..(r + 1) * d], gx, gw);
                    }
                });
        })?;
    }
    let (xhat, xinv) = if normalize {
        normalize_rows(xs, d)
    } else {
        (xs, vec![1.0; b])
    };
    let xhat_bf16 = bf16_gemms(cfg.logits).then(|| {
        let mut out = Vec::new();
        to_bf16(&xhat, &mut out);
        out
    });
    // Class block by class block: logits z = s·x̂ Ŵᵀ (B, block), the margin
    // at the target, each row's block max m, and the running statistics
    // [max, best non-target, target, raw target] and Σ exp(z − max).
    // Kept for backward: every block's; for evaluation, one block's, reused.
    let kept = if cfg.backward {
        cols
    } else {
        cols.min(CLASS_BLOCK)
    };
    let mut logits: Vec<T> = logits_buffer(b * kept);
    let blocks = cols.div_ceil(CLASS_BLOCK);
    let mut block_max = vec![f32::NEG_INFINITY; blocks * b];
    let mut stats = vec![f32::NEG_INFINITY; 4 * b];
    let mut sum = vec![0f32; b];
    let mut winv = vec![0f32; if normalize { cols } else { 0 }];
    let (mut rows_scratch, mut z_scratch) = (Vec::new(), Vec::new());
    with_f32(w, |w| -> Result<()> {
        for (k, range) in class_blocks(cols) {
            let width = range.len();
            let wb = block_rows(w, sample, &range, d, &mut rows_scratch);
            if normalize {
                winv[range.clone()].copy_from_slice(&inv_norms(wb, d));
            }
            let place = if cfg.backward {
                b * range.start..b * range.end
            } else {
                0..b * width
            };
            let out = &mut logits[place.clone()];
            let z: &mut [f32] = match T::as_f32_mut(out) {
                Some(z) => z,
                None => {
                    z_scratch.resize(b * width, 0f32);
                    &mut z_scratch[..]
                }
            };
            // z (B, width) = x̂ (B, d) · W_blockᵀ.
            match &xhat_bf16 {
                Some(xh) => {
                    if sample.is_none() {
                        prefetch_next_block(w, &range, cols, d);
                    }
                    matmul_bf16(b, width, d, (z, width, 1), false, (xh, d, 1), (wb, 1, d))
                }
                None => {
                    let p = Abt {
                        m: b,
                        n: width,
                        k: d,
                        a: &xhat,
                        lda: d,
                        b: wb,
                        ldb: d,
                    };
                    matmul_abt(p, z, width, false)
                }
            }
            let winv_b = if normalize {
                &winv[range.clone()]
            } else {
                &[][..]
            };
            let row_stats: Vec<[f32; 5]> = z
                .par_chunks_mut(width)
                .zip(&target)
                .zip(&cos_target)
                .map(|((row, &t), &cos_t)| {
                    let t = t.filter(|t| range.contains(t)).map(|t| t - range.start);
                    finish_row::<T>(row, t, cos_t, winv_b, s, normalize, cfg.margin)
                })
                .collect();
            for (i, st) in row_stats.into_iter().enumerate() {
                let [m, other, zt, raw, part] = st;
                block_max[k * b + i] = m;
                let old = stats[i];
                let new = old.max(m);
                // Σ exp(z − max), rescaled to the new max.
                let keep = if old == f32::NEG_INFINITY {
                    0.0
                } else {
                    (old - new).exp()
                };
                sum[i] = sum[i] * keep + part * (m - new).exp();
                stats[i] = new;
                stats[b + i] = stats[b + i].max(other);
                stats[2 * b + i] = stats[2 * b + i].max(zt);
                stats[3 * b + i] = stats[3 * b + i].max(raw);
            }
            if !T::IN_PLACE {
                T::store(&z_scratch[..b * width], &mut logits[place]);
            }
        }
        Ok(())
    })??;
    // Kept for backward, or back to the spare at once (an evaluation
    // between training steps keeps the training buffer for the next one).
    let logits = if cfg.backward {
        Some(logits)
    } else {
        give_back_logits(logits);
        None
    };
    let local_max = stats[..b].to_vec();
    let dev = x.device().clone();
    let stats = comm
        .allreduce(&Tensor::from_vec(stats, 4 * b, &dev)?, ReduceOp::Max)?
        .to_vec1::<f32>()?;
    let max = stats[..b].to_vec();
    // A shard with no classes (C < n) contributes zeros.
    let local_sum: Vec<f32> = sum
        .iter()
        .zip(&local_max)
        .zip(&max)
        .map(|((s, l), m)| if cols == 0 { 0.0 } else { s * (l - m).exp() })
        .collect();
    let sum = comm
        .allreduce(&Tensor::from_vec(local_sum, b, &dev)?, ReduceOp::Sum)?
        .to_vec1::<f32>()?;
    let (loss, correct) = loss_and_correct(b, &stats, &sum);
    let loss = Tensor::from_vec(loss, b, &dev)?;
    let saved = Arc::new(Saved {
        weight: weight.handle(),
        cfg,
        b,
        d,
        xhat,
        xinv,
        xhat_bf16,
        sample: sample.map(<[u32]>::to_vec),
        winv,
        target,
        cos_target,
        dcos_dx,
        dcos_dw,
        logits: Mutex::new(logits),
        block_max,
        max,
        sum,
        loss,
    });
    let loss = x.apply_op2(w, Op(saved))?;
    Ok(CrossEntropyOutput { loss, correct })
}

/// Scale a row of a block of cosines (or plain logits) into logits z, apply
/// the margin at the target (column `target` of the block), whose cos θ is
/// `cos_t` (from [`target_cosine`], normalised heads), and leave exp(z − m)
/// rounded to T in the row, m the row's max in the block: a probability up
/// to a factor per row, which half precision keeps to its relative
/// precision whatever the logit (a rounded z − m would lose |z − m|·2⁻⁹ in
/// bf16), and backward then needs no exp. Returns [m, best non-target
/// logit, target logit, target raw logit, Σ of the rounded exp(z − m)], −∞
/// for what the block lacks.
fn finish_row<T: Elem>(
    row: &mut [f32],
    target: Option<usize>,
    cos_t: f64,
    winv: &[f32],
    s: f32,
    normalize: bool,
    margin: Margin,
) -> [f32; 5] {
    use crate::kernels::vector;
    // z = (cos·s), or the plain logit (s = 1: nothing to scale).
    if normalize {
        vector::scale_each(row, winv, s);
    } else if s != 1.0 {
        vector::scale(row, s);
    }
    let (mut raw_t, mut z_t) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    if let Some(t) = target {
        if normalize {
            raw_t = (f64::from(s) * cos_t) as f32;
            row[t] = margin.psi(cos_t) as f32 * s;
        } else {
            raw_t = row[t];
        }
    }
    let (max, other) = match target {
        Some(t) => {
            z_t = row[t];
            row[t] = f32::NEG_INFINITY;
            let other = vector::max(row);
            row[t] = z_t;
            (if z_t > other { z_t } else { other }, other)
        }
        None => {
            let m = vector::max(row);
            (m, m)
        }
    };
    let sum = if T::IN_PLACE {
        vector::exp_sub_sum(row, max)
    } else {
        T::exp_sub_round_sum(row, max)
    };
    [max, other, z_t, raw_t, sum]
}

/// Rows of x (·, d) scaled to unit length, and the inverse norms.
fn normalize_rows(mut x: Vec<f32>, d: usize) -> (Vec<f32>, Vec<f32>) {
    let inv: Vec<f32> = x
        .par_chunks_mut(d.max(1))
        .map(|row| {
            let inv = 1.0 / row.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
            row.iter_mut().for_each(|v| *v *= inv);
            inv
        })
        .collect();
    (x, inv)
}

/// 1/‖row‖ of each row of w (·, d).
fn inv_norms(w: &[f32], d: usize) -> Vec<f32> {
    w.par_chunks(d.max(1))
        .map(|row| 1.0 / row.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12))
        .collect()
}

/// Run `f` on the contiguous f32 elements of `t` (no copy).
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(v)), true) = (&*storage, layout.is_contiguous()) else {
        return Err(Error::Usage(
            "sharded classifier: the weight must be a contiguous f32 CPU tensor".into(),
        ));
    };
    let n = layout.shape().elem_count();
    Ok(f(&v[layout.start_offset()..layout.start_offset() + n]))
}
