//! A parameter's value as a graph input whose gradient goes straight into
//! the parameter's own buffer during backward, on any device: what makes
//! the device-generic path (candle's ops, the path a GPU runs) deliver
//! gradients exactly as the CPU kernels do, which write them in place.
//!
//! | op | forward | backward |
//! |----|---------|----------|
//! | [`tracked`] (p) | a copy of p's value | p.grad += dL/dy; nothing flows to the value's `Var` |
//!
//! So after `loss.backward()` a layer's `Param::grad` holds its gradient on
//! either path, with no `GradStore` entry left to move by hand; a parameter
//! the loss never reached has none on either path. The copy costs one
//! parameter-sized memcpy per use, on the generic path only.

use super::row_update::InPlaceGrad;
use super::tape::{cuda_of, gpu_fwd, metal_of, owned, owned_on};
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
        value: v.contiguous()?,
        target: p.handle(),
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
    value: Tensor,
    target: Arc<dyn InPlaceGrad>,
}

impl CustomOp1 for Tap {
    fn name(&self) -> &'static str {
        "shardnet-param-grad"
    }
    gpu_fwd!(op1, value);
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        owned(&self.value)
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.target.add_grad(grad)?;
        Ok(None)
    }
}
