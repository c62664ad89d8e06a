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
//!
//! **On the CPU, class block by class block.** `CLASS_BLOCK` = 1024 rows of
//! W_r, so a block of W_r, its B × 1024 logits and their gradient stay in
//! cache through every pass over them. The logits' GEMM is
//! `kernels::dot::matmul_abt` (our `sgemm` on this A · Bᵀ, where the `gemm`
//! crate's packing of Wᵀ is slow); each block's rows are kept as z − the
//! row's max in the block, rounded to the logits precision, and the row's
//! running max and Σ exp are rescaled block by block (online softmax); the
//! element-wise passes are `kernels::vector`'s, with a polynomial exp. Each
//! rank's thread keeps the logits buffer from step to step and through an
//! evaluation (a fresh one of hundreds of MiB would be faulted in and
//! zeroed every step); evaluation keeps one block. In backward each block
//! becomes its gradient in place (half-precision blocks through an f32
//! scratch), and dW_r's rows go into the `Param`'s buffer
//! (`--unfused-update`) or, by default, straight into the optimizer's update
//! of those rows (`RowUpdate`, set by `Optimizer::fuse`): the fused step
//! holds no gradient of the shard. Partial FC's sampled rows are gathered a
//! class block at a time into one block's scratch, never all at once.
//! Megatron uses three allreduces; here the max, target and accuracy terms
//! share one.
//!
//! The files: `common` holds the call's types and the definitions
//! both paths share (the target's f64 cosine, the loss and hit count from
//! the reduced statistics, the targets' columns); `forward` and `backward`
//! the CPU kernel; `precision` the logits element types (f32, bf16, f16)
//! and the bf16 GEMMs; `generic` the device-generic path in candle ops.

mod backward;
mod common;
mod forward;
mod generic;
mod precision;

pub use common::{CrossEntropyConfig, CrossEntropyOutput, CLASS_BLOCK};

use crate::comm::Communicator;
use crate::functions::InPlaceGrad;
use crate::{Error, Result};
use candle_core::{DType, Tensor};
use common::Call;
use half::{bf16, f16};

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
        return generic::forward(call);
    }
    match cfg.logits {
        DType::F32 => forward::forward::<f32>(call),
        DType::BF16 => forward::forward::<bf16>(call),
        _ => forward::forward::<f16>(call),
    }
}
