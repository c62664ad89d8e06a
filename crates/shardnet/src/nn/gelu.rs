//! GELU in GPT-2's tanh form, one pass forward and one backward on the CPU.
//!
//! y = ½·x·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³);
//! dy/dx = ½·(1 + tanh u) + ½·x·(1 − tanh² u)·√(2/π)·(1 + 3·0.044715·x²).
//! In f32 as the same function in its logistic form, ½(1 + tanh u) =
//! σ(2u) = 1/(1 + e^(−2u)) (no cancellation where tanh u nears −1):
//! `kernels::vector::gelu` and `gelu_grad`, vectorised; in f64 with
//! libm's tanh. Elsewhere (and with `SHARDNET_KERNELS=generic`)
//! it is candle's `gelu`, the same tanh form.
//!
//! ```
//! use candle_core::Tensor;
//! let x = Tensor::new(&[-3f32, 0., 3.], &shardnet::comm::HOST)?;
//! let y = shardnet::nn::gelu(&x)?.to_vec1::<f32>()?;
//! assert!(y[0].abs() < 0.01 && y[1] == 0.0 && (y[2] - 2.996).abs() < 1e-3);
//! # Ok::<(), shardnet::Error>(())
//! ```

use crate::kernels::zip_map;
use crate::Result;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

/// √(2/π).
const K: f64 = 0.797_884_560_802_865_4;
/// The cubic term's coefficient.
const C: f64 = 0.044_715;

/// GELU (tanh form), elementwise.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if !crate::kernels::fast(x.device()) {
        return Ok(x.gelu()?);
    }
    Ok(x.contiguous()?.apply_op1(Gelu)?)
}

/// y(x).
fn value(x: f64) -> f64 {
    0.5 * x * (1.0 + (K * (x + C * x * x * x)).tanh())
}

/// dy/dx at x.
fn slope(x: f64) -> f64 {
    let t = (K * (x + C * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * K * (1.0 + 3.0 * C * x * x)
}

/// `pass` over `n` f32 outputs in chunks, split over the threads when
/// the work pays ([`crate::kernels::split_work`]).
fn chunked(n: usize, pass: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync) -> Vec<f32> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 14;
    let mut out = vec![0f32; n];
    if crate::kernels::split_work(n) {
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, o)| pass(c * CHUNK..c * CHUNK + o.len(), o));
    } else {
        pass(0..n, &mut out);
    }
    out
}

fn elements<'a, T>(v: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    crate::kernels::view(v, l, "gelu")
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "shardnet-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = match s {
            CpuStorage::F32(v) => {
                let x = elements(v, l)?;
                CpuStorage::F32(chunked(x.len(), |r, y| {
                    crate::kernels::vector::gelu(&x[r], y)
                }))
            }
            CpuStorage::F64(v) => {
                let x = elements(v, l)?;
                CpuStorage::F64(zip_map(x, x, |x, _| value(x)))
            }
            _ => candle_core::bail!("shardnet gelu: f32 or f64"),
        };
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(
            grad.contiguous()?
                .apply_op2_no_bwd(&x.contiguous()?, &GeluGrad)?,
        ))
    }
}

/// dL/dy · dy/dx.
struct GeluGrad;

impl candle_core::CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "shardnet-gelu-grad"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        xs: &CpuStorage,
        xl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let dx = match (gs, xs) {
            (CpuStorage::F32(g), CpuStorage::F32(x)) => {
                let (g, x) = (elements(g, gl)?, elements(x, xl)?);
                CpuStorage::F32(chunked(x.len(), |r, dx| {
                    crate::kernels::vector::gelu_grad(&g[r.clone()], &x[r], dx)
                }))
            }
            (CpuStorage::F64(g), CpuStorage::F64(x)) => {
                CpuStorage::F64(zip_map(elements(g, gl)?, elements(x, xl)?, |g, x| {
                    g * slope(x)
                }))
            }
            _ => candle_core::bail!("shardnet gelu: gradient dtypes differ"),
        };
        Ok((dx, gl.shape().clone()))
    }
}
