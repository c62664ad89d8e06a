//! A parameter's value as a graph input whose gradient goes straight into
//! the parameter's own buffer during backward, on any device: what makes
//! the device-generic path (candle's ops, the path a GPU runs) deliver
//! gradients exactly as the CPU kernels do, which write them in place.
//!
//! | op | forward | backward |
//! |----|---------|----------|
//! | [`tracked`] (p) | a copy of p's value | p.grad += dL/dy; nothing flows to the value's `Var` |
//! | [`tracked_rows`] (p, rows, update) | a copy of p's rows `rows` | `update` steps those rows of p and their optimizer state with dL/dy, in place (the fused step); no gradient is kept |
//!
//! So after `loss.backward()` a layer's `Param::grad` holds its gradient on
//! either path, with no `GradStore` entry left to move by hand; a parameter
//! the loss never reached has none on either path. A weight whose
//! optimizer step is fused into backward (the sharded head's) is stepped
//! there instead, on either path, and holds no gradient. The copy costs one
//! parameter-sized memcpy per use (the rows' size for [`tracked_rows`]), on
//! the generic path only.

use super::row_update::{InPlaceGrad, RowUpdate, Rows};
use super::tape::{cuda_of, gpu_fwd, metal_of, owned, owned_on, Once};
use crate::Result;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, MetalStorage, Shape, Tensor};
use std::sync::Arc;

/// `p`'s value in the graph; backward adds dL/d(value) to `p`'s gradient.
/// A value that is not a `Var` (nothing to train) is returned as it is.
pub fn tracked(p: &dyn InPlaceGrad) -> Result<Tensor> {
    let v = p.value();
    if !v.is_variable() {
        return Ok(v.clone());
    }
    Ok(v.apply_op1(Tap {
        value: Once::new(v.contiguous()?),
        target: p.handle(),
    })?)
}

/// Rows `rows` of `p`'s value in the graph (every row where `None`), for a
/// weight whose optimizer step is fused into backward: backward hands their
/// gradient to `update` ([`RowUpdate::update_rows_on_device`]), which steps
/// those rows of `p` and their optimizer state in place, on `p`'s device.
/// No gradient is accumulated, and the other rows and their state are not
/// touched. A value that is not a `Var` (nothing to train): its rows, as
/// they are.
pub(crate) fn tracked_rows(
    p: &dyn InPlaceGrad,
    rows: Option<&[u32]>,
    update: Arc<dyn RowUpdate>,
) -> Result<Tensor> {
    let v = p.value();
    let value = match rows {
        Some(idx) => v.detach().index_select(&Tensor::new(idx, v.device())?, 0)?,
        None => v.detach().contiguous()?,
    };
    if !v.is_variable() {
        return Ok(value);
    }
    Ok(v.apply_op1(StepRows {
        count: value.dim(0)?,
        value: Once::new(value),
        weight: v.clone(),
        rows: rows.map(<[u32]>::to_vec),
        update,
    })?)
}

/// A scalar 0 that keeps `t` in the graph (t's gradient through it: zeros,
/// of t's shape, even with no elements): what a rank with an empty shard
/// adds so that its backward reaches everything its peers' does. (candle
/// prunes `t * 0.0`, an affine op with factor 0, from backward.)
pub(crate) fn zero_of(t: &Tensor) -> Result<Tensor> {
    let zero = Tensor::zeros((), t.dtype(), t.device())?;
    Ok(t.sum_all()?.mul(&zero)?)
}

struct Tap {
    value: Once,
    target: Arc<dyn InPlaceGrad>,
}

impl CustomOp1 for Tap {
    fn name(&self) -> &'static str {
        "shardnet-param-grad"
    }
    gpu_fwd!(op1, value);
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        owned(&self.value.take()?)
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.target.add_grad(grad)?;
        Ok(None)
    }
}

/// The op of [`tracked_rows`].
struct StepRows {
    /// The rows taking part (a copy: the weight changes in backward).
    value: Once,
    /// How many.
    count: usize,
    /// The whole weight, stepped in place in backward.
    weight: Tensor,
    /// Which rows (`None`: all, in order).
    rows: Option<Vec<u32>>,
    update: Arc<dyn RowUpdate>,
}

impl CustomOp1 for StepRows {
    fn name(&self) -> &'static str {
        "shardnet-fused-rows"
    }
    gpu_fwd!(op1, value);
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        owned(&self.value.take()?)
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let rows = match &self.rows {
            Some(list) => Rows::List(list),
            None => Rows::Range(0..self.count),
        };
        self.update
            .update_rows_on_device(rows, &self.weight, grad)?;
        Ok(None)
    }
}
