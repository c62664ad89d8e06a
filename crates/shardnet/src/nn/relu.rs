//! ReLU as one pass forward and one backward on the CPU.
//!
//! y = max(x, 0); dL/dx = dL/dy where y > 0, else 0 (0 at x = 0, as
//! candle and PyTorch). candle's own relu backward builds a mask tensor, a
//! dtype conversion and a product: three passes and two temporaries over
//! activations that dominate a CNN's memory traffic. Elsewhere (and with
//! `SHARDNET_KERNELS=generic`) it is candle's `relu`.
//!
//! ```
//! use candle_core::Tensor;
//! let x = Tensor::new(&[-1f32, 0., 2.], &shardnet::comm::HOST)?;
//! assert_eq!(shardnet::nn::relu(&x)?.to_vec1::<f32>()?, vec![0., 0., 2.]);
//! # Ok::<(), shardnet::Error>(())
//! ```

use crate::kernels::zip_map;
use crate::Result;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

/// max(x, 0), elementwise.
pub fn relu(x: &Tensor) -> Result<Tensor> {
    if !crate::kernels::fast(x.device()) {
        return Ok(x.relu()?);
    }
    Ok(x.contiguous()?.apply_op1(Relu)?)
}

struct Relu;

fn elements<'a, T>(v: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    crate::kernels::view(v, l, "relu")
}

impl CustomOp1 for Relu {
    fn name(&self) -> &'static str {
        "shardnet-relu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = match s {
            CpuStorage::F32(v) => CpuStorage::F32({
                let x = elements(v, l)?;
                zip_map(x, x, |x, _| x.max(0.0))
            }),
            CpuStorage::F64(v) => CpuStorage::F64({
                let x = elements(v, l)?;
                zip_map(x, x, |x, _| x.max(0.0))
            }),
            _ => candle_core::bail!("shardnet relu: f32 or f64"),
        };
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op2_no_bwd(y, &ReluGrad)?))
    }
}

/// dL/dy where y > 0.
struct ReluGrad;

impl candle_core::CustomOp2 for ReluGrad {
    fn name(&self) -> &'static str {
        "shardnet-relu-grad"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        ys: &CpuStorage,
        yl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let dx = match (gs, ys) {
            (CpuStorage::F32(g), CpuStorage::F32(y)) => {
                let y = elements(y, yl)?;
                CpuStorage::F32(zip_map(
                    elements(g, gl)?,
                    y,
                    |g, y| {
                        if y > 0.0 {
                            g
                        } else {
                            0.0
                        }
                    },
                ))
            }
            (CpuStorage::F64(g), CpuStorage::F64(y)) => {
                let y = elements(y, yl)?;
                CpuStorage::F64(zip_map(
                    elements(g, gl)?,
                    y,
                    |g, y| {
                        if y > 0.0 {
                            g
                        } else {
                            0.0
                        }
                    },
                ))
            }
            _ => candle_core::bail!("shardnet relu: gradient dtypes differ"),
        };
        Ok((dx, gl.shape().clone()))
    }
}
