//! Differentiable copy between devices (Chainer's `F.copy`): a model split
//! over the devices of one process moves activations forward and their
//! gradients back.
//!
//! | op | forward | backward | bytes |
//! |----|---------|----------|-------|
//! | [`copy_to`] | y = x on `device` | dL/dx = dL/dy moved back to x's device | b each way |

use crate::Result;
use candle_core::{Device, Tensor};

/// `x` on `device`; backward moves the gradient back to `x`'s device. On the
/// same device, `x` itself.
///
/// ```
/// use candle_core::{DType, Var};
/// use shardnet::comm::HOST;
/// let x = Var::ones(3, DType::F32, &HOST)?;
/// let y = shardnet::functions::copy_to(x.as_tensor(), &HOST)?;
/// let grads = (y * 2.0)?.sum_all()?.backward()?;
/// assert_eq!(grads.get(x.as_tensor()).map(|g| g.to_vec1::<f32>()).transpose()?, Some(vec![2.0; 3]));
/// # Ok::<(), shardnet::Error>(())
/// ```
pub fn copy_to(x: &Tensor, device: &Device) -> Result<Tensor> {
    // candle records the move (Op::ToDevice) and moves the gradient back.
    Ok(x.to_device(device)?)
}
