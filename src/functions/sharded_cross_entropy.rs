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
use crate::kernels::bf16::{has_avx512_bf16, matmul_bf16};
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
    /// The optimizer's update to apply to rows in place as their gradient
    /// is produced (the fused step), if one is set: then no gradient is
    /// accumulated.
    fn fused_update(&self) -> Option<Arc<dyn RowUpdate>> {
        None
    }
    /// Run `f` on the f32 value, in place (for the fused step).
    fn update_value(&self, f: &mut (dyn FnMut(&mut [f32]) -> Result<()> + Send)) -> Result<()>;
    /// Add `g` (shaped like the value, any device and dtype) to the
    /// gradient: what the generic path's backward delivers
    /// ([`crate::functions::tracked`]).
    fn add_grad(&self, g: &Tensor) -> Result<()>;
}

/// The rows of a weight (C_r, d) that one call of [`RowUpdate::update_rows`]
/// updates.
#[derive(Clone, Debug)]
pub enum Rows<'a> {
    /// Rows `start .. end`.
    Range(std::ops::Range<usize>),
    /// These rows, sorted (a class sample's).
    List(&'a [u32]),
}

impl Rows<'_> {
    /// How many rows.
    pub fn len(&self) -> usize {
        match self {
            Rows::Range(r) => r.len(),
            Rows::List(l) => l.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The row indices, in order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        let (range, list) = match self {
            Rows::Range(r) => (r.clone(), &[][..]),
            Rows::List(l) => (0..0, *l),
        };
        range.chain(list.iter().map(|&r| r as usize))
    }
}

/// An optimizer's step applied to some rows of a weight, given their
/// gradient: what the sharded head's backward calls block by block, so that
/// no gradient of the whole shard is ever held (the fused step). Rows not
/// passed are not touched (their optimizer state included).
pub trait RowUpdate: Send + Sync {
    /// Update rows `rows` of `weight` (the whole shard, (C_r, d) row-major)
    /// and their optimizer state, from `grad` ((rows.len(), d), in the order
    /// of `rows`).
    fn update_rows(&self, rows: Rows<'_>, weight: &mut [f32], grad: &[f32], d: usize)
        -> Result<()>;
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
    /// Whether the buffer is f32 itself (worked on in place).
    const IN_PLACE: bool = false;
    /// The buffer as f32, where it is f32: then work happens in place.
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
    /// v ← T(exp(v − m)) (as f32); returns Σ v of the rounded values.
    fn exp_sub_round_sum(row: &mut [f32], m: f32) -> f32 {
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = Self::from_f32(crate::kernels::vector::exp(*v - m)).to_f32();
            sum += *v;
        }
        sum
    }
    /// dst ← src rounded to T (one length).
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, v)| *d = Self::from_f32(*v));
    }
    /// dst ← src as f32 (dst cleared first).
    fn load(src: &[Self], dst: &mut Vec<f32>) {
        dst.clear();
        dst.extend(src.iter().map(|v| v.to_f32()));
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
    fn exp_sub_round_sum(row: &mut [f32], m: f32) -> f32 {
        crate::kernels::vector::exp_sub_bf16_sum(row, m)
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        crate::kernels::vector::to_bf16(src, dst.reinterpret_cast_mut());
    }
    fn load(src: &[Self], dst: &mut Vec<f32>) {
        use half::slice::HalfFloatSliceExt;
        dst.resize(src.len(), 0.0);
        crate::kernels::vector::from_bf16(src.reinterpret_cast(), dst);
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

/// Classes per block: forward and backward walk the shard's classes in
/// blocks of this many rows of W_r, so that a block of W_r (CLASS_BLOCK × d),
/// its logits (B × CLASS_BLOCK) and its gradient stay in cache while the
/// GEMMs, the softmax and the update use them: W_r is read from memory
/// once per phase.
pub const CLASS_BLOCK: usize = 1024;

/// The class blocks of `cols` columns: (block index, columns).
fn class_blocks(cols: usize) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> {
    (0..cols.div_ceil(CLASS_BLOCK)).map(move |k| {
        let c0 = k * CLASS_BLOCK;
        (k, c0..(c0 + CLASS_BLOCK).min(cols))
    })
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
    /// x̂ rounded to bf16, where the GEMMs take bf16 inputs ([`bf16_gemms`]).
    xhat_bf16: Option<Vec<bf16>>,
    /// The local rows that take part, if a sample (sorted).
    sample: Option<Vec<u32>>,
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
    /// The logits, class block after class block, each block (B, its
    /// columns) row-major, holding exp(z − m), m the row's max in the
    /// block, in the logits precision (backward needs no exp); taken by
    /// backward.
    logits: Mutex<Option<Vec<T>>>,
    /// Each block's row maxima (blocks × B), and each row's global max.
    block_max: Vec<f32>,
    max: Vec<f32>,
    /// Σ exp(z − global max) of each row.
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

/// The weight rows of class block `cols`: a slice of W (the full head), or
/// the sample's rows gathered into `scratch` (one block, not the sample).
fn block_rows<'a>(
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

/// The local row of column `c` (the sample's, or c itself).
fn row_of(sample: Option<&[u32]>, c: usize) -> usize {
    sample.map_or(c, |idx| idx[c] as usize)
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
    let mut logits: Vec<T> = vec![T::from_f32(0.0); b * kept];
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
                None => matmul(b, width, d, z, false, (&xhat, d, 1), (wb, 1, d)),
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
        logits: Mutex::new(cfg.backward.then_some(logits)),
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
    drop(logits);
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

/// Whether the head's three GEMMs take bf16 inputs (f32 sums): with bf16
/// logits on a CPU with AVX-512 BF16; the f32 GEMMs elsewhere.
fn bf16_gemms(logits: DType) -> bool {
    logits == DType::BF16 && has_avx512_bf16()
}

/// Let the bf16 GEMMs of class block `range` bring the next block's rows
/// of `w` into cache while they compute.
fn prefetch_next_block(w: &[f32], range: &std::ops::Range<usize>, cols: usize, d: usize) {
    let next = range.end..(range.end + CLASS_BLOCK).min(cols);
    crate::kernels::bf16::prefetch_during_gemms(&w[next.start * d..next.end * d]);
}

/// `out` ← `v` rounded to bf16 (resized to match; its memory reused).
fn to_bf16(v: &[f32], out: &mut Vec<bf16>) {
    use crate::kernels::bf16::Input;
    use half::slice::HalfFloatSliceExt;
    out.resize(v.len(), bf16::ZERO);
    <f32 as Input>::convert(v, out.reinterpret_cast_mut());
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
