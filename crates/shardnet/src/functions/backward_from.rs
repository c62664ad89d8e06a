//! Backward from a given output gradient: [`backward_from`]`(y, g)` runs
//! y's backward as if a loss had sent g to it (PyTorch's `y.backward(g)`).
//!
//! | | forward | dL/dy | g |
//! |---|---|---|---|
//! | [`backward_from`] (CPU) | nothing: backward's root is a stand-in whose value no one sees | g itself | a constant |
//! | `(y * g).sum_all()?.backward()` (candle) | y·g written, then summed | a broadcast, two products (dL/dg too), zeros + add | a second input |
//!
//! A layer benchmarked forward + backward from an output gradient, or a
//! part of a model trained from the gradient of the part after it, needs
//! only the first row; candle's graph of the second costs more than a small
//! convolution's backward. Elsewhere (and with `SHARDNET_KERNELS=generic`)
//! it is the second, with g detached.
//!
//! ```
//! use candle_core::{Tensor, Var};
//! let dev = &shardnet::comm::HOST;
//! let x = Var::new(&[1f32, 2., 3.], dev)?;
//! let y = (x.as_tensor() * 2.0)?;
//! let g = Tensor::new(&[0.5f32, -1., 2.], dev)?;
//! let grads = shardnet::functions::backward_from(&y, &g)?;
//! assert_eq!(grads.get(&x).unwrap().to_vec1::<f32>()?, vec![1., -2., 4.]);
//! # Ok::<(), shardnet::Error>(())
//! ```

use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

/// The gradients of every variable y depends on, with g as dL/dy (g gets
/// none). y and g must have the same shape, dtype and device.
pub fn backward_from(y: &Tensor, g: &Tensor) -> Result<GradStore> {
    if y.shape() != g.shape() || y.dtype() != g.dtype() || !y.device().same_device(g.device()) {
        return Err(Error::Usage(format!(
            "backward_from: y is {:?} {:?} on {:?} but its gradient g is {:?} {:?} on {:?}; \
             they must match",
            y.dims(),
            y.dtype(),
            y.device().location(),
            g.dims(),
            g.dtype(),
            g.device().location()
        )));
    }
    let g = g.detach();
    if !crate::kernels::fast(y.device()) {
        return Ok(y.mul(&g)?.sum_all()?.backward()?);
    }
    Ok(y.apply_op1(Root(g.contiguous()?))?.backward()?)
}

/// Backward's root: an empty value, g as y's gradient.
struct Root(Tensor);

impl CustomOp1 for Root {
    fn name(&self) -> &'static str {
        "shardnet-backward-from"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(Vec::new()), Shape::from(0)))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, _: &Tensor) -> candle_core::Result<Option<Tensor>> {
        // The root's own gradient is ones (nothing scales it).
        Ok(Some(self.0.clone()))
    }
}
