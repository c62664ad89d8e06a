//! Softmax cross-entropy over a classifier sharded by classes (the memory-balanced sharded classifier),
//! with the margin applied on the shard that owns the label.
//!
//! Every rank holds the same features x (B, d) — allgathered from a
//! data-parallel backbone, or replicated — and its own rows W_r (C_r, d) of
//! the classifier, classes `offset .. offset + C_r`. Per call:
//!
//! | step | forward | backward |
//! |------|---------|----------|
//! | logits | z_r = s·x̂ Ŵ_rᵀ (B, C_r), target's ψ applied locally | dz = g·(softmax − one-hot), local |
//! | target | cos θ_y = x̂_i·ŵ_y and its gradients in f64 (B·d), on the rank owning the label | its term s·ψ′·dz_y·∂cos θ_y in f64, added to dx and dW_r |
//! | stats | one allreduce-max of 4B values: row max, best non-target logit, target logit, target raw logit; one allreduce-sum of B values: Σ exp(z − max) | none |
//! | weights | | dW_r from dz and x, local, into the `Param`'s buffer |
//! | features | | dx = dz·W_r: this rank's share; the op that delivered x sums the shares (allgather's reduce-scatter, or `copy_to_shards`' allreduce) |
//!
//! The target's cosine is not taken from the f32 GEMM: near θ = π, where
//! ψ′ grows as 1/sin θ (the combined margin) and the normalisations'
//! backward subtracts nearly opposite unit vectors, f32 would lose digits
//! (relative gradient errors to 4e-3 at π − θ = 0.004, d = 128), so it
//! comes from x_i and w_y in f64 (`target_cosine`), as does its term of
//! the gradient.
//!
//! Bytes per call: 5B floats allreduced (f32), whatever C is. No rank holds
//! more than B × C_r logits, and those once: kept from forward to backward in
//! the logits precision (f32, bf16 or f16) and turned into the gradient in
//! place. Loss and top-1 accuracy come from the reduced statistics; no
//! logits are gathered. The output is the per-sample loss (B), the same on
//! every rank.
//!
//! With a sample (Partial FC), only the listed local classes take part: the
//! softmax runs over the union of every rank's sample, and the other rows of
//! dW_r are zero.

use super::margin::Margin;
use crate::comm::Communicator;
use crate::kernels::matmul;
use crate::{Error, ReduceOp, Result};
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;
use std::sync::{Arc, Mutex};

/// A weight shard whose gradient the op accumulates in place, as the GEMM
/// produces it (no B × C_r gradient tensor is made). `nn::Param` is one.
pub trait InPlaceGrad: Send + Sync {
    /// The value, a contiguous f32 tensor.
    fn value(&self) -> &Tensor;
    /// Whether a gradient has been accumulated since it was last consumed.
    fn has_grad(&self) -> bool;
    /// Run `f` on the f32 gradient buffer, told whether it is empty (then
    /// `f` must overwrite what it does not mean to leave stale).
    fn update_grad(&self, f: &mut (dyn FnMut(&mut [f32], bool) -> Result<()> + Send))
        -> Result<()>;
    /// A shared handle on the same weight and buffer, kept for backward.
    fn handle(&self) -> Arc<dyn InPlaceGrad>;
}

/// What one call of [`sharded_softmax_cross_entropy`] computes with.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyConfig {
    /// ψ for the target logit (and whether to normalise).
    pub margin: Margin,
    /// s, the logit scale of normalised heads.
    pub scale: f64,
    /// The precision logits are kept in: F32, BF16 or F16.
    pub logits: DType,
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

/// Cross-entropy of `x` (B, d) against the head sharded over `comm`, whose
/// local rows are `weight` (C_r, d), global classes `offset ..`; `labels`
/// are global class indices (B), the same on every rank. `sample`: sorted
/// local row indices taking part (it must include every local label), or
/// `None` for all. Every rank must call it with the same B, labels and
/// config.
#[allow(clippy::too_many_arguments)]
pub fn sharded_softmax_cross_entropy(
    comm: &Communicator,
    x: &Tensor,
    weight: &dyn InPlaceGrad,
    offset: usize,
    classes: usize,
    labels: &[u32],
    sample: Option<&[u32]>,
    cfg: CrossEntropyConfig,
) -> Result<CrossEntropyOutput> {
    let (b, d) = x.dims2().map_err(|_| {
        Error::Usage(format!(
            "sharded_softmax_cross_entropy: features of shape {:?}, expected (batch, dim)",
            x.dims()
        ))
    })?;
    let (cr, wd) = weight.value().dims2()?;
    if d == 0 {
        return Err(Error::Usage(
            "sharded_softmax_cross_entropy: features of dimension 0 (the feature dimension must be at least 1)".into(),
        ));
    }
    if wd != d || labels.len() != b {
        return Err(Error::Usage(format!(
            "sharded_softmax_cross_entropy on rank {}: features {:?}, {} labels, weight shard \
             ({cr}, {wd}); expected (B, {wd}) features and B labels",
            comm.rank(),
            x.dims(),
            labels.len()
        )));
    }
    if let Some(bad) = labels.iter().find(|&&l| l as usize >= classes) {
        return Err(Error::Usage(format!(
            "sharded_softmax_cross_entropy: label {bad} is out of range for {classes} classes"
        )));
    }
    let call = Call {
        comm,
        x,
        weight,
        offset,
        labels,
        sample,
        cfg,
    };
    if !matches!(cfg.logits, DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::Usage(format!(
            "sharded_softmax_cross_entropy: logits in f32, bf16 or f16, not {}",
            cfg.logits.as_str()
        )));
    }
    if !crate::kernels::fast(x.device()) {
        return super::sharded_cross_entropy_generic::forward(call);
    }
    match cfg.logits {
        DType::F32 => forward::<f32>(call),
        DType::BF16 => forward::<bf16>(call),
        _ => forward::<f16>(call),
    }
}

/// A logits element type.
trait Elem: Copy + Send + Sync + 'static {
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
    /// Whether the buffer is f32 itself (worked on in place, one block).
    const IN_PLACE: bool = false;
    /// The buffer as f32, where it is f32: then work happens in place.
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}
impl Elem for f32 {
    const IN_PLACE: bool = true;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }
}
impl Elem for bf16 {
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}
impl Elem for f16 {
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// Rows per block where logits are half precision: each block goes through
/// an f32 scratch of ROWS × C_r.
const HALF_BLOCK_ROWS: usize = 64;

/// Rows per block: all B where logits are f32 (worked on in place), else
/// [`HALF_BLOCK_ROWS`].
fn block_rows<T: Elem>(b: usize) -> usize {
    if T::IN_PLACE {
        b.max(1)
    } else {
        HALF_BLOCK_ROWS
    }
}

/// Everything backward needs, kept from forward.
struct Saved<T> {
    weight: Arc<dyn InPlaceGrad>,
    cfg: CrossEntropyConfig,
    b: usize,
    d: usize,
    /// Normalised (or plain) features, f32 (B, d), and 1/‖x_i‖.
    xhat: Vec<f32>,
    xinv: Vec<f32>,
    /// The rows that take part, if a sample: their indices and copy (S, d).
    sample: Option<(Vec<u32>, Vec<f32>)>,
    /// 1/‖w_c‖ of the rows taking part (normalised heads).
    winv: Vec<f32>,
    /// Local column of each row's label, if this rank owns it.
    target: Vec<Option<usize>>,
    /// cos θ of each owned target, in f64, and its gradients with respect
    /// to x_i and to the target's row (B, d each; zero where not owned;
    /// empty for the plain layer): see [`target_cosine`].
    cos_target: Vec<f64>,
    dcos_dx: Vec<f32>,
    dcos_dw: Vec<f32>,
    /// Logits minus their local row max (B, S) in the logits precision;
    /// taken by backward.
    logits: Mutex<Option<Vec<T>>>,
    /// Local row max − global row max, and Σ exp(z − global max).
    shift: Vec<f32>,
    sum: Vec<f32>,
    /// The per-sample loss, the op's output.
    loss: Tensor,
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

fn forward<T: Elem>(call: Call<'_>) -> Result<CrossEntropyOutput> {
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
    let sample = match sample {
        Some(idx) => Some((idx.to_vec(), with_f32(w, |w| gather_rows(w, idx, d))?)),
        None => None,
    };
    let cols = sample.as_ref().map_or(cr, |(i, _)| i.len());
    let winv = if normalize {
        match &sample {
            Some((_, ws)) => inv_norms(ws, d),
            None => with_f32(w, |w| inv_norms(w, d))?,
        }
    } else {
        Vec::new()
    };
    let target = targets(labels, offset, cr, sample.as_ref().map(|(i, _)| &i[..]))?;
    // The owned targets' cos θ and its gradients, in f64 from x and w.
    let mut cos_target = vec![0f64; b];
    let (mut dcos_dx, mut dcos_dw) = (Vec::new(), Vec::new());
    if normalize {
        (dcos_dx, dcos_dw) = (vec![0f32; b * d], vec![0f32; b * d]);
        with_weight_rows(&sample, w, |w| {
            cos_target
                .par_iter_mut()
                .zip(dcos_dx.par_chunks_mut(d.max(1)))
                .zip(dcos_dw.par_chunks_mut(d.max(1)))
                .zip(xs.par_chunks(d.max(1)))
                .zip(&target)
                .for_each(|((((c, gx), gw), x), t)| {
                    if let Some(t) = *t {
                        *c = target_cosine(x, &w[t * d..(t + 1) * d], gx, gw);
                    }
                });
        })?;
    }
    let (xhat, xinv) = if normalize {
        normalize_rows(xs, d)
    } else {
        (xs, vec![1.0; b])
    };
    // Logits, block by block, with each row's local statistics.
    let mut logits: Vec<T> = vec![T::from_f32(0.0); b * cols];
    let mut stats = vec![f32::NEG_INFINITY; 4 * b];
    let mut local_max = vec![f32::NEG_INFINITY; b];
    let block = block_rows::<T>(b);
    let mut scratch = Vec::new();
    for i0 in (0..b).step_by(block) {
        let rows = block.min(b - i0);
        let out = &mut logits[i0 * cols..(i0 + rows) * cols];
        let z: &mut [f32] = match T::as_f32_mut(out) {
            Some(z) => z,
            None => {
                scratch.resize(rows * cols, 0f32);
                &mut scratch[..rows * cols]
            }
        };
        // z (rows, cols) = x̂ (rows, d) · Wᵀ.
        with_weight_rows(&sample, w, |w| {
            matmul(rows, cols, d, z, false, (&xhat[i0 * d..], d, 1), (w, 1, d))
        })?;
        let row_stats: Vec<[f32; 4]> = z
            .par_chunks_mut(cols.max(1))
            .zip(&target[i0..i0 + rows])
            .zip(&cos_target[i0..i0 + rows])
            .map(|((row, &t), &cos_t)| {
                finish_row::<T>(row, t, cos_t, &winv, s, normalize, cfg.margin)
            })
            .collect();
        for (k, st) in row_stats.into_iter().enumerate() {
            local_max[i0 + k] = st[0];
            for (j, v) in st.into_iter().enumerate() {
                stats[j * b + i0 + k] = v;
            }
        }
        if !T::IN_PLACE {
            let out = &mut logits[i0 * cols..(i0 + rows) * cols];
            for (o, v) in out.iter_mut().zip(&scratch[..rows * cols]) {
                *o = T::from_f32(*v);
            }
        }
    }
    let dev = x.device().clone();
    let stats = comm
        .allreduce(&Tensor::from_vec(stats, 4 * b, &dev)?, ReduceOp::Max)?
        .to_vec1::<f32>()?;
    let max = stats[..b].to_vec();
    // Each row holds z − (local max); shift[i] = local max − global max.
    let shift: Vec<f32> = local_max.iter().zip(&max).map(|(l, m)| l - m).collect();
    // A shard with no classes (C < n) contributes zeros.
    let local_sum: Vec<f32> = if cols == 0 {
        vec![0.0; b]
    } else {
        logits
            .par_chunks(cols)
            .zip(&shift)
            .map(|(row, &sh)| row.iter().map(|v| (v.to_f32() + sh).exp()).sum())
            .collect()
    };
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
        sample,
        winv,
        target,
        cos_target,
        dcos_dx,
        dcos_dw,
        logits: Mutex::new(Some(logits)),
        shift,
        sum,
        loss,
    });
    let loss = x.apply_op2(w, Op(saved))?;
    Ok(CrossEntropyOutput { loss, correct })
}

/// Scale a row of cosines (or plain logits) into logits z, apply the margin
/// at the target, whose cos θ is `cos_t` (from [`target_cosine`], normalised
/// heads), and leave z − max(row) rounded to T in the row: near the
/// maximum, where the probabilities are, that keeps bf16's 8 bits for the
/// digits that matter. Returns [row max, best non-target logit, target
/// logit, target raw logit], −∞ for what this rank does not own.
fn finish_row<T: Elem>(
    row: &mut [f32],
    target: Option<usize>,
    cos_t: f64,
    winv: &[f32],
    s: f32,
    normalize: bool,
    margin: Margin,
) -> [f32; 4] {
    if normalize {
        for (v, inv) in row.iter_mut().zip(winv) {
            *v *= inv;
        }
    }
    let (mut raw_t, mut z_t) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    if let Some(t) = target {
        if normalize {
            raw_t = (f64::from(s) * cos_t) as f32;
            row[t] = margin.psi(cos_t) as f32;
        } else {
            raw_t = row[t];
        }
    }
    let (mut max, mut other) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for (c, v) in row.iter_mut().enumerate() {
        *v *= s;
        max = max.max(*v);
        if Some(c) == target {
            z_t = *v;
        } else {
            other = other.max(*v);
        }
    }
    for v in row.iter_mut() {
        *v = T::from_f32(*v - max).to_f32();
    }
    [max, other, z_t, raw_t]
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

/// The op in the graph: forward returns the loss computed above; backward
/// is local.
struct Op<T>(Arc<Saved<T>>);

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

fn backward<T: Elem>(sv: &Saved<T>, g: &[f32]) -> Result<Vec<f32>> {
    let Some(mut logits) = sv.logits.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return Err(Error::Usage(
            "sharded_softmax_cross_entropy: backward ran twice through one forward".into(),
        ));
    };
    let (b, d) = (sv.b, sv.d);
    let normalize = sv.cfg.margin.normalizes();
    let s = if normalize { sv.cfg.scale as f32 } else { 1.0 };
    let w = sv.weight.value();
    let cr = w.dims2()?.0;
    let cols = sv.sample.as_ref().map_or(cr, |(i, _)| i.len());
    // A = Gᵀ x̂ goes straight into the Param's buffer when that is fresh and
    // covers exactly these rows; otherwise into a copy, added at the end.
    let fresh = !sv.weight.has_grad();
    let mut dw_tmp = (sv.sample.is_some() || (normalize && !fresh)).then(|| vec![0f32; cols * d]);
    let mut dxhat = vec![0f32; b * d];
    let mut target_beta = vec![0f64; b];
    let block = block_rows::<T>(b);
    let mut scratch = Vec::new();
    for i0 in (0..b).step_by(block) {
        let rows = block.min(b - i0);
        let buf = &mut logits[i0 * cols..(i0 + rows) * cols];
        let gz: &mut [f32] = match T::as_f32_mut(buf) {
            Some(z) => z,
            None => {
                scratch.clear();
                scratch.extend(buf.iter().map(|v| v.to_f32()));
                &mut scratch[..]
            }
        };
        // z → G: ∂L/∂z = g·(softmax − one-hot), then through s and 1/‖w_c‖;
        // the normalised target's s·ψ′·∂L/∂z is kept aside (its term is
        // added below, in f64) and its G left at zero.
        gz.par_chunks_mut(cols.max(1))
            .zip(target_beta[i0..i0 + rows].par_iter_mut())
            .enumerate()
            .for_each(|(k, (row, beta))| {
                let i = i0 + k;
                let (sh, inv_sum, gi, t) = (sv.shift[i], 1.0 / sv.sum[i], g[i], sv.target[i]);
                for (c, v) in row.iter_mut().enumerate() {
                    let mut dz = gi * (*v + sh).exp() * inv_sum;
                    if Some(c) == t {
                        dz -= gi;
                    }
                    *v = if !normalize {
                        dz
                    } else if Some(c) == t {
                        let (_, dpsi) = sv.cfg.margin.psi_and_derivative(sv.cos_target[i]);
                        *beta = f64::from(s * dz) * dpsi;
                        0.0
                    } else {
                        s * dz * sv.winv[c]
                    };
                }
            });
        let gz: &[f32] = gz;
        // dx̂ (rows, d) = G · W; A (cols, d) += Gᵀ · x̂.
        let xblk = &sv.xhat[i0 * d..(i0 + rows) * d];
        let dxblk = &mut dxhat[i0 * d..(i0 + rows) * d];
        with_weight_rows(&sv.sample, w, |w| {
            matmul(rows, d, cols, dxblk, false, (gz, cols, 1), (w, d, 1))
        })?;
        match &mut dw_tmp {
            Some(a) => matmul(cols, d, rows, a, i0 > 0, (gz, 1, cols), (xblk, d, 1)),
            None => sv.weight.update_grad(&mut |dw, empty| {
                matmul(cols, d, rows, dw, !empty, (gz, 1, cols), (xblk, d, 1));
                Ok(())
            })?,
        }
    }
    drop(logits);
    // Through ŵ_c = w_c/‖w_c‖: dW_c = A_c − (ŵ_c·A_c) ŵ_c / ‖w_c‖ · … , i.e.
    // A_c minus its component along w_c (A already carries one 1/‖w_c‖);
    // then the targets' terms β_i·∂cos/∂w.
    let add_targets = |dw: &mut [f32]| {
        for ((t, beta), dc) in sv
            .target
            .iter()
            .zip(&target_beta)
            .zip(sv.dcos_dw.chunks(d.max(1)))
        {
            if let Some(t) = *t {
                for (o, v) in dw[t * d..(t + 1) * d].iter_mut().zip(dc) {
                    *o = (f64::from(*o) + beta * f64::from(*v)) as f32;
                }
            }
        }
    };
    match dw_tmp {
        Some(mut a) => {
            if normalize {
                with_weight_rows(&sv.sample, w, |w| project_out(&mut a, w, &sv.winv, d))?;
                add_targets(&mut a);
            }
            sv.weight.update_grad(&mut |dw, empty| {
                if empty && sv.sample.is_some() {
                    dw.fill(0.0);
                }
                let rows: Box<dyn Iterator<Item = usize>> = match &sv.sample {
                    Some((idx, _)) => Box::new(idx.iter().map(|&r| r as usize)),
                    None => Box::new(0..cols),
                };
                for (k, r) in rows.enumerate() {
                    let dst = &mut dw[r * d..(r + 1) * d];
                    let src = &a[k * d..(k + 1) * d];
                    if empty && sv.sample.is_none() {
                        dst.copy_from_slice(src);
                    } else {
                        dst.iter_mut().zip(src).for_each(|(o, v)| *o += v);
                    }
                }
                Ok(())
            })?;
        }
        None if normalize => with_weight_rows(&sv.sample, w, |w| {
            sv.weight.update_grad(&mut |dw, _| {
                project_out(dw, w, &sv.winv, d);
                add_targets(dw);
                Ok(())
            })
        })??,
        None => {}
    }
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

/// The rows `idx` of w (·, d), copied.
fn gather_rows(w: &[f32], idx: &[u32], d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(idx.len() * d);
    for &r in idx {
        out.extend_from_slice(&w[r as usize * d..(r as usize + 1) * d]);
    }
    out
}

/// The per-sample loss ln Σ + max − z_t and the count of hits
/// ([`super::is_hit`]: the target's raw logit strictly the best, no NaN), from the reduced statistics ([max, best
/// non-target, target, raw target] × B, and Σ exp(z − max)): both paths'
/// one definition.
pub(super) fn loss_and_correct(b: usize, stats: &[f32], sum: &[f32]) -> (Vec<f32>, usize) {
    let mut correct = 0;
    let loss = (0..b)
        .map(|i| {
            let (best_other, zt, raw_t) = (stats[b + i], stats[2 * b + i], stats[3 * b + i]);
            let loss = sum[i].ln() + stats[i] - zt;
            correct += usize::from(super::is_hit(raw_t, best_other, loss));
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

/// Run `f` on the weight rows taking part: the sample's copy, or all of W.
fn with_weight_rows<R>(
    sample: &Option<(Vec<u32>, Vec<f32>)>,
    w: &Tensor,
    f: impl FnOnce(&[f32]) -> R,
) -> Result<R> {
    match sample {
        Some((_, ws)) => Ok(f(ws)),
        None => with_f32(w, f),
    }
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
