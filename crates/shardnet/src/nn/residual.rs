//! A residual connection with its branch's bias: [`add_residual`]`(x, y,
//! b)` = x + y + b, b broadcast over the rows (the last dimension).
//!
//! | pass | candle ops (`x + y.broadcast_add(b)`) | this op (CPU kernels) |
//! |---|---|---|
//! | forward | y + b written, then x + (y + b) | one pass |
//! | backward | dL/d(y + b) summed into a zeroed tensor; db by candle's reduction | db (+)= Σ_rows g into the [`Param`]'s buffer (the bias kernel of [`Linear`](super::Linear)) |
//!
//! dL/dx = dL/dy = g either way. On other devices (and with
//! `SHARDNET_KERNELS=generic`) it is the candle ops.
//!
//! ```
//! use candle_core::Tensor;
//! use shardnet::comm::HOST;
//! use shardnet::nn::{add_residual, Param};
//!
//! let b = Param::new("b", &Tensor::new(&[10f32, 20.], &HOST)?)?;
//! let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &HOST)?;
//! let y = Tensor::new(&[[0.5f32, 0.5], [1., 1.]], &HOST)?;
//! let out = add_residual(&x, &y, Some(&b))?;
//! assert_eq!(out.to_vec2::<f32>()?, [[11.5, 22.5], [14., 25.]]);
//! out.sum_all()?.backward()?;
//! assert_eq!(b.grad().unwrap().to_vec1::<f32>()?, [2., 2.]);
//! # Ok::<(), shardnet::Error>(())
//! ```

use super::linear::BiasGrad;
use super::param::Param;
use crate::{Error, Result};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

/// x + y + b: x and y of one shape (…, D), b (D) (none: x + y).
pub fn add_residual(x: &Tensor, y: &Tensor, bias: Option<&Param>) -> Result<Tensor> {
    if x.dims() != y.dims() {
        return Err(Error::Usage(format!(
            "add_residual: x {:?} and its branch y {:?} must have one shape",
            x.dims(),
            y.dims()
        )));
    }
    let Some(bias) = bias else {
        return Ok((x + y)?);
    };
    let width = x.dims().last().copied().unwrap_or(0);
    if bias.value().dims() != [width] {
        return Err(Error::Usage(format!(
            "add_residual: a bias of shape {:?} for rows of {width}",
            bias.value().dims()
        )));
    }
    let fused = crate::kernels::fast(x.device())
        && x.dtype() == DType::F32
        && y.dtype() == DType::F32
        && bias.value().dtype() == DType::F32;
    if !fused {
        return Ok((x + y.broadcast_add(&bias.tracked()?)?)?);
    }
    Ok(x.contiguous()?.apply_op3(
        &y.contiguous()?,
        bias.value(),
        Residual { bias: bias.clone() },
    )?)
}

struct Residual {
    bias: Param,
}

impl CustomOp3 for Residual {
    fn name(&self) -> &'static str {
        "shardnet-residual"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ys: &CpuStorage,
        yl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(x), CpuStorage::F32(y), CpuStorage::F32(b)) = (xs, ys, bs) else {
            candle_core::bail!("shardnet add_residual: f32 on the CPU kernels")
        };
        let what = "add_residual";
        let (x, y, b) = (
            crate::kernels::view(x, xl, what)?,
            crate::kernels::view(y, yl, what)?,
            crate::kernels::view(b, bl, what)?,
        );
        let d = b.len().max(1);
        let mut out = crate::kernels::unfilled(x.len(), f32::NAN);
        // Rows in chunks of about 64 KiB each way.
        let rows = (16384 / d).max(1) * d;
        crate::kernels::for_chunks_mut(&mut out, rows, |i, o| {
            let at = i * rows..i * rows + o.len();
            let (x, y) = (&x[at.clone()], &y[at]);
            for ((o, x), y) in o.chunks_mut(d).zip(x.chunks(d)).zip(y.chunks(d)) {
                for (((o, x), y), b) in o.iter_mut().zip(x).zip(y).zip(b) {
                    *o = x + (y + b);
                }
            }
        });
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }

    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?;
        // The bias kernel takes the leading dimensions as rows.
        let (bias, gb) = (self.bias.clone(), g.clone());
        // With the layers' weight gradients: now, or in a zero-bubble
        // pipeline's W pass.
        super::deferred::weight_grad(move || bias.accumulate(&gb, &gb, BiasGrad))?;
        // The bias is a Var: candle needs no gradient entry for it.
        Ok((Some(g.clone()), Some(g), None))
    }
}
