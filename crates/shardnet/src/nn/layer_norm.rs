//! `LayerNorm` over the last dimension, one fused pass forward and one
//! backward on the CPU, with in-place gradients for γ and β.
//!
//! Each row r of x (any leading shape, D features): μ_r and σ²_r summed in
//! f64 (the biased variance, as PyTorch's), rstd_r = 1/√(σ²_r + ε) rounded
//! to f32 and kept for backward, x̂ = (x − μ_r)·rstd_r, y = x̂·γ + β.
//! Backward, with g = dL/dy: dx = rstd_r·(g·γ − mean(g·γ) − x̂·mean(g·γ·x̂))
//! (the row means in f64; blocks of 64 rows over the threads, their
//! sums added in order); dγ += Σ_rows g·x̂, dβ += Σ_rows g into the
//! [`Param`]s (now, or in a zero-bubble pipeline's W pass). On other
//! devices (and with `SHARDNET_KERNELS=generic`) it is the same formula in
//! candle ops on [`Param::tracked`] values.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use shardnet::nn::{LayerNorm, ParamStore};
//! let store = ParamStore::new(&Device::Cpu, 0);
//! let ln = LayerNorm::new(&store.pp("ln_1"), 4, 1e-5)?;
//! let y = ln.forward(&Tensor::new(&[[1f32, 2., 3., 4.]], &Device::Cpu)?)?;
//! let row = y.to_vec2::<f32>()?.remove(0);
//! assert!((row.iter().sum::<f32>()).abs() < 1e-5); // mean 0, γ = 1, β = 0
//! assert_eq!(ln.params()[0].name(), "ln_1.weight");
//! # Ok::<(), shardnet::Error>(())
//! ```

use super::param::Param;
use super::sharded::{Init, ShardedParam};
use super::store::ParamStore;
use crate::kernels::Float;
use crate::{Error, Result};
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor, D};
use std::sync::{Arc, Mutex};

/// Layer normalisation over the last dimension, with a learned scale γ
/// (`weight`) and shift β (`bias`), GPT-2's `ln_1`, `ln_2`, `ln_f`.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    weight: Param,
    bias: Param,
    eps: f64,
}

impl LayerNorm {
    /// Over `dim` features, γ = 1 and β = 0, as `weight` and `bias` in
    /// `store` (scope it: `store.pp("ln_1")`); `eps` inside the square
    /// root (GPT-2: 1e-5).
    pub fn new(store: &ParamStore, dim: usize, eps: f64) -> Result<Self> {
        let weight = ShardedParam::new("weight", &[dim], Init::Constant(1.0)).build(store)?;
        let bias = ShardedParam::new("bias", &[dim], Init::Constant(0.0)).build(store)?;
        Self::from_params(weight, bias, eps)
    }

    /// From ready γ and β, both (D).
    pub fn from_params(weight: Param, bias: Param, eps: f64) -> Result<Self> {
        if weight.value().dims().len() != 1 || weight.value().dims() != bias.value().dims() {
            return Err(Error::Usage(format!(
                "LayerNorm: γ of shape {:?} and β of shape {:?}; both (features)",
                weight.value().dims(),
                bias.value().dims()
            )));
        }
        if !(eps.is_finite() && eps > 0.0) {
            return Err(Error::Usage(format!(
                "LayerNorm: eps {eps}; give a finite number > 0"
            )));
        }
        Ok(LayerNorm { weight, bias, eps })
    }

    /// γ then β.
    pub fn params(&self) -> Vec<Param> {
        vec![self.weight.clone(), self.bias.clone()]
    }

    /// y, shaped as x (…, D).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let d = self.weight.value().elem_count();
        if x.dims().last() != Some(&d) {
            return Err(Error::Usage(format!(
                "LayerNorm({d}): input of shape {:?}, expected (…, {d})",
                x.dims()
            )));
        }
        if !crate::kernels::fast(x.device()) {
            let mean = x.mean_keepdim(D::Minus1)?;
            let xc = x.broadcast_sub(&mean)?;
            let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
            let xhat = xc.broadcast_div(&(var + self.eps)?.sqrt()?)?;
            return Ok(xhat
                .broadcast_mul(&self.weight.tracked()?)?
                .broadcast_add(&self.bias.tracked()?)?);
        }
        let op = LayerNormOp {
            weight: self.weight.clone(),
            bias: self.bias.clone(),
            eps: self.eps,
            stats: Arc::new(Mutex::new(Vec::new())),
        };
        Ok(x.contiguous()?
            .apply_op3(self.weight.value(), self.bias.value(), op)?)
    }
}

crate::nn::candle_module!(LayerNorm);

/// Per row: (μ, rstd), kept from the forward for the backward.
type Stats = Arc<Mutex<Vec<(f64, f64)>>>;

/// One row of the forward: (x's row, y's row), its (μ, rstd).
type Row<'a, T> = ((&'a [T], &'a mut [T]), &'a mut (f64, f64));

struct LayerNormOp {
    weight: Param,
    bias: Param,
    eps: f64,
    stats: Stats,
}

fn view<'a, T>(s: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    crate::kernels::view(s, l, "LayerNorm")
}

/// (μ, rstd) of one row: rstd rounded to the row's dtype, as kept.
fn row_stats<T: Float + Send + Sync>(row: &[T], eps: f64) -> (f64, f64) {
    let n = row.len().max(1) as f64;
    let mean = row.iter().map(|v| v.to_f64()).sum::<f64>() / n;
    let var = row.iter().map(|v| (v.to_f64() - mean).powi(2)).sum::<f64>() / n;
    (mean, T::from_f64(1.0 / (var + eps).sqrt()).to_f64())
}

fn forward<T: Float + Send + Sync>(x: &[T], g: &[T], b: &[T], eps: f64, stats: &Stats) -> Vec<T> {
    use rayon::prelude::*;
    let d = g.len();
    let rows = x.len().checked_div(d).unwrap_or(0);
    // Every element written (rows of d > 0; none when d = 0).
    let mut y = crate::kernels::unfilled(x.len(), T::NAN);
    let mut st = vec![(0.0, 0.0); rows];
    let one = |((xr, yr), s): Row<T>| {
        *s = row_stats(xr, eps);
        let (m, r) = *s;
        for ((v, o), (gg, bb)) in xr.iter().zip(yr.iter_mut()).zip(g.iter().zip(b)) {
            *o = T::from_f64((v.to_f64() - m) * r * gg.to_f64() + bb.to_f64());
        }
    };
    if d > 0 {
        if crate::kernels::split_work(x.len()) {
            x.par_chunks(d)
                .zip(y.par_chunks_mut(d))
                .zip(st.par_iter_mut())
                .for_each(one);
        } else {
            x.chunks(d)
                .zip(y.chunks_mut(d))
                .zip(st.iter_mut())
                .for_each(one);
        }
    }
    *stats.lock().unwrap_or_else(|e| e.into_inner()) = st;
    y
}

/// Rows per task of the backward: fixed, so that dγ and dβ are summed in
/// the same order on any number of threads.
const BACKWARD_ROWS: usize = 64;

/// dx of every row; dγ and dβ summed over the rows (f64): in blocks of
/// [`BACKWARD_ROWS`] rows, over the threads where the pass is large, the
/// blocks' sums then added in order.
fn backward<T: Float + Send + Sync>(
    x: &[T],
    gy: &[T],
    gamma: &[T],
    st: &[(f64, f64)],
) -> (Vec<T>, Vec<f64>, Vec<f64>) {
    use rayon::prelude::*;
    let d = gamma.len();
    // Every element written (rows of d > 0; none when d = 0).
    let mut dx = crate::kernels::unfilled(x.len(), T::NAN);
    let (mut dg, mut db) = (vec![0f64; d], vec![0f64; d]);
    if d == 0 {
        return (dx, dg, db);
    }
    let n = d as f64;
    let span = BACKWARD_ROWS * d;
    let block = |(i, dxb): (usize, &mut [T])| -> (Vec<f64>, Vec<f64>) {
        let (mut dg, mut db) = (vec![0f64; d], vec![0f64; d]);
        let at = i * span;
        let (xb, gb) = (&x[at..at + dxb.len()], &gy[at..at + dxb.len()]);
        let sb = &st[i * BACKWARD_ROWS..];
        for (((xr, gr), dr), &(m, r)) in xb
            .chunks(d)
            .zip(gb.chunks(d))
            .zip(dxb.chunks_mut(d))
            .zip(sb)
        {
            let (mut a, mut b) = (0f64, 0f64);
            for ((v, g), w) in xr.iter().zip(gr).zip(gamma) {
                let xh = (v.to_f64() - m) * r;
                let gw = g.to_f64() * w.to_f64();
                a += gw;
                b += gw * xh;
            }
            let (a, b) = (a / n, b / n);
            for (k, ((v, g), w)) in xr.iter().zip(gr).zip(gamma).enumerate() {
                let xh = (v.to_f64() - m) * r;
                dr[k] = T::from_f64(r * (g.to_f64() * w.to_f64() - a - xh * b));
                dg[k] += g.to_f64() * xh;
                db[k] += g.to_f64();
            }
        }
        (dg, db)
    };
    let sums: Vec<(Vec<f64>, Vec<f64>)> = if crate::kernels::split_work(x.len()) {
        dx.par_chunks_mut(span).enumerate().map(block).collect()
    } else {
        dx.chunks_mut(span).enumerate().map(block).collect()
    };
    for (g, b) in sums {
        dg.iter_mut().zip(&g).for_each(|(s, v)| *s += v);
        db.iter_mut().zip(&b).for_each(|(s, v)| *s += v);
    }
    (dx, dg, db)
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "shardnet-layer-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = match (xs, gs, bs) {
            (CpuStorage::F32(x), CpuStorage::F32(g), CpuStorage::F32(b)) => {
                CpuStorage::F32(forward(
                    view(x, xl)?,
                    view(g, gl)?,
                    view(b, bl)?,
                    self.eps,
                    &self.stats,
                ))
            }
            (CpuStorage::F64(x), CpuStorage::F64(g), CpuStorage::F64(b)) => {
                CpuStorage::F64(forward(
                    view(x, xl)?,
                    view(g, gl)?,
                    view(b, bl)?,
                    self.eps,
                    &self.stats,
                ))
            }
            _ => candle_core::bail!("shardnet LayerNorm: f32 or f64, one dtype for x, γ and β"),
        };
        Ok((y, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let st = self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let (xf, gf, wf) = (
            x.flatten_all()?,
            grad.contiguous()?.flatten_all()?,
            gamma.detach(),
        );
        let (dx, dg, db) = match x.dtype() {
            candle_core::DType::F32 => {
                // x, g and γ read where they lie.
                let what = "LayerNorm";
                let (dx, dg, db) = crate::kernels::with_f32s(&xf, what, |xv| {
                    crate::kernels::with_f32s(&gf, what, |gv| {
                        crate::kernels::with_f32s(&wf, what, |wv| {
                            Ok::<_, candle_core::Error>(backward(xv, gv, wv, &st))
                        })
                    })
                })?;
                (Tensor::from_vec(dx, x.shape(), x.device())?, dg, db)
            }
            candle_core::DType::F64 => {
                let (dx, dg, db) = backward(
                    &xf.to_vec1::<f64>()?,
                    &gf.to_vec1::<f64>()?,
                    &wf.to_vec1::<f64>()?,
                    &st,
                );
                (Tensor::from_vec(dx, x.shape(), x.device())?, dg, db)
            }
            other => candle_core::bail!("shardnet LayerNorm: {other:?}; f32 or f64"),
        };
        let (weight, bias, dtype, device) = (
            self.weight.clone(),
            self.bias.clone(),
            x.dtype(),
            x.device().clone(),
        );
        super::deferred::weight_grad(move || {
            weight.add_grad(&Tensor::new(dg.as_slice(), &device)?.to_dtype(dtype)?)?;
            bias.add_grad(&Tensor::new(db.as_slice(), &device)?.to_dtype(dtype)?)?;
            Ok(())
        })?;
        Ok((x.track_op().then_some(dx), None, None))
    }
}
