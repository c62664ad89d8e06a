//! `Linear`: y = x Wᵀ + b on our CPU kernels (the forward on `kernels::sgemm`
//! where it beats the `gemm` crate, the gradients on the crate), with
//! in-place gradients.
//!
//! Shapes: x (B, I), W (O, I), b (O), y (B, O); f32 or f64. A weight of
//! more dimensions (…, I) is taken as (O, I) with O the product of the
//! leading ones, its bias as O values of any shape (a transformer's fused
//! q, k, v projection, (3, D, D), is one such layer).
//! Backward: dx = g W (a new tensor, into candle's graph); dW += gᵀ x and
//! db += Σ_rows g straight into the [`Param`] buffers (one GEMM with
//! accumulate, no temporaries), so M micro-batches cost M GEMMs and nothing
//! more. On other devices (and with `SHARDNET_KERNELS=generic`) it is
//! candle's matmul on [`Param::tracked`] values: the gradients reach the
//! `Param`s in backward just the same.
//!
//! ```
//! use candle_core::Tensor;
//! use shardnet::comm::HOST;
//! use shardnet::nn::{Linear, Param};
//!
//! let w = Param::new("w", &Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &HOST)?)?;
//! let b = Param::new("b", &Tensor::new(&[0f32, 1., 2.], &HOST)?)?;
//! let layer = Linear::new(w.clone(), Some(b.clone()));
//! let x = Tensor::new(&[[1f32, 1.]], &HOST)?;
//! let y = layer.forward(&x)?;
//! assert_eq!(y.to_vec2::<f32>()?, vec![vec![3., 8., 13.]]);
//! y.sum_all()?.backward()?;
//! assert_eq!(w.grad().unwrap().to_vec2::<f32>()?, vec![vec![1., 1.]; 3]);
//! assert_eq!(b.grad().unwrap().to_vec1::<f32>()?, vec![1., 1., 1.]);
//! # Ok::<(), shardnet::Error>(())
//! ```

use super::param::{Accumulate, Param};
use crate::kernels::dot::Abt;
use crate::kernels::{matmul, Float};
use crate::{Error, Result};
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

/// A fully connected layer of [`Param`]s.
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Param,
    bias: Option<Param>,
}

impl Linear {
    /// W, (out, in).
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// b, (out), if any.
    pub fn bias(&self) -> Option<&Param> {
        self.bias.as_ref()
    }

    /// A layer from ready parameters.
    pub fn new(weight: Param, bias: Option<Param>) -> Self {
        Linear { weight, bias }
    }

    /// Its parameters, weight first.
    pub fn params(&self) -> Vec<Param> {
        std::iter::once(self.weight.clone())
            .chain(self.bias.clone())
            .collect()
    }

    /// y = x Wᵀ + b for x of shape (B, in).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight.value();
        let (o, i) = out_in(w.dims())?;
        match x.dims() {
            [_, k] if *k == i => {}
            other => {
                return Err(Error::Usage(format!(
                    "Linear({i} -> {o}): input of shape {other:?}, expected (batch, {i})"
                )))
            }
        }
        if !crate::kernels::fast(w.device()) {
            // The generic path: candle's ops; dW and db reach the Params
            // in backward, as the kernel's do (`Param::tracked`).
            let y = x.matmul(&self.weight.tracked()?.reshape((o, i))?.t()?)?;
            return Ok(match &self.bias {
                Some(b) => y.broadcast_add(&b.tracked()?.reshape(o)?)?,
                None => y,
            });
        }
        let b = super::param::bias_or_empty(self.bias.as_ref(), w)?;
        Ok(x.contiguous()?.apply_op3(
            w,
            &b,
            LinearOp {
                weight: self.weight.clone(),
                bias: self.bias.clone(),
            },
        )?)
    }
}

/// (O, I) of a weight of shape (…, I): O the product of the leading
/// dimensions.
fn out_in(dims: &[usize]) -> Result<(usize, usize)> {
    match dims.split_last() {
        Some((&i, rest)) if !rest.is_empty() => Ok((rest.iter().product(), i)),
        _ => Err(Error::Usage(format!(
            "Linear: a weight of shape {dims:?}; give (out, in), or (…, in)"
        ))),
    }
}

/// The contiguous elements of a layout.
fn view<'a, T>(s: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    crate::kernels::view(s, l, "Linear")
}

/// y (B, O) = x (B, I) Wᵀ + b.
fn forward<T: Float>(x: &[T], w: &[T], b: &[T], rows: usize, i: usize, o: usize) -> Vec<T> {
    let mut y = vec![T::ZERO; rows * o];
    let with_bias = !b.is_empty();
    if with_bias {
        for row in y.chunks_mut(o) {
            row.copy_from_slice(b);
        }
    }
    // x · Wᵀ: both run along I (our sgemm where it beats the crate there).
    let p = Abt {
        m: rows,
        n: o,
        k: i,
        a: x,
        lda: i,
        b: w,
        ldb: i,
    };
    T::matmul_abt(p, &mut y, o, with_bias);
    y
}

struct LinearOp {
    weight: Param,
    bias: Option<Param>,
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "shardnet-linear"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, i) = xl.shape().dims2()?;
        // From the dimensions: a shard with no inputs (i = 0) still has o.
        let o = wl
            .shape()
            .dims()
            .split_last()
            .map_or(0, |(_, rest)| rest.iter().product());
        let y = match (xs, ws, bs) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) => CpuStorage::F32(
                forward(view(x, xl)?, view(w, wl)?, view(b, bl)?, rows, i, o),
            ),
            (CpuStorage::F64(x), CpuStorage::F64(w), CpuStorage::F64(b)) => CpuStorage::F64(
                forward(view(x, xl)?, view(w, wl)?, view(b, bl)?, rows, i, o),
            ),
            _ => candle_core::bail!("shardnet Linear: f32 or f64, one dtype for x, W and b"),
        };
        Ok((y, Shape::from((rows, o))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?;
        // dW and db now, or in the W pass of a zero-bubble pipeline.
        let (weight, bias, gw, xw) = (self.weight.clone(), self.bias.clone(), g.clone(), x.clone());
        super::deferred::weight_grad(move || {
            weight.accumulate(&gw, &xw, WeightGrad)?;
            if let Some(b) = &bias {
                b.accumulate(&gw, &gw, BiasGrad)?;
            }
            Ok(())
        })?;
        // The parameters are Vars: candle needs no gradient entry for them.
        let dx = if x.track_op() {
            let (o, i) = out_in(w.dims()).map_err(candle_core::Error::wrap)?;
            Some(g.matmul(&w.detach().reshape((o, i))?)?)
        } else {
            None
        };
        Ok((dx, None, None))
    }
}

/// dW (O, I) (+)= gᵀ (O, B) · x (B, I).
struct WeightGrad;

fn weight_grad<T: Float>(
    dw: &mut [T],
    g: &[T],
    x: &[T],
    rows: usize,
    o: usize,
    i: usize,
    overwrite: bool,
) {
    // lhs = gᵀ: element (m, k) is g[k, m].
    matmul(o, i, rows, dw, !overwrite, (g, 1, o), (x, i, 1));
}

impl Accumulate for WeightGrad {
    fn name(&self) -> &'static str {
        "shardnet-linear-weight-grad"
    }
    fn run(
        &self,
        dst: &mut CpuStorage,
        [(g, gl), (x, xl)]: [(&CpuStorage, &Layout); 2],
        overwrite: bool,
    ) -> candle_core::Result<()> {
        let (rows, o) = gl.shape().dims2()?;
        let (_, i) = xl.shape().dims2()?;
        match (dst, g, x) {
            (CpuStorage::F32(d), CpuStorage::F32(g), CpuStorage::F32(x)) => {
                weight_grad(d, view(g, gl)?, view(x, xl)?, rows, o, i, overwrite)
            }
            (CpuStorage::F64(d), CpuStorage::F64(g), CpuStorage::F64(x)) => {
                weight_grad(d, view(g, gl)?, view(x, xl)?, rows, o, i, overwrite)
            }
            _ => candle_core::bail!("shardnet Linear: gradient dtypes differ"),
        }
        Ok(())
    }
}

/// db (O) (+)= Σ_rows g.
struct BiasGrad;

fn bias_grad<T: Float>(db: &mut [T], g: &[T], o: usize, overwrite: bool) {
    debug_assert_eq!(db.len(), o);
    // The batch's rows in blocks: a long batch sums as a blocked BLAS would.
    crate::kernels::sum::rows(db, g, !overwrite);
}

impl Accumulate for BiasGrad {
    fn name(&self) -> &'static str {
        "shardnet-linear-bias-grad"
    }
    fn run(
        &self,
        dst: &mut CpuStorage,
        [(g, gl), _]: [(&CpuStorage, &Layout); 2],
        overwrite: bool,
    ) -> candle_core::Result<()> {
        let (_, o) = gl.shape().dims2()?;
        match (dst, g) {
            (CpuStorage::F32(d), CpuStorage::F32(g)) => bias_grad(d, view(g, gl)?, o, overwrite),
            (CpuStorage::F64(d), CpuStorage::F64(g)) => bias_grad(d, view(g, gl)?, o, overwrite),
            _ => candle_core::bail!("shardnet Linear: gradient dtypes differ"),
        }
        Ok(())
    }
}

super::module::candle_module!(Linear);
