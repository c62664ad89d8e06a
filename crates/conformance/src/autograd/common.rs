//! What the differentiable suites share: seeded inputs and parameters
//! ([`seeded`], [`values`]), the weighted loss, the relative-error checks
//! ([`close`], [`close_in`]), and the finite-difference check of every
//! rank's gradient against the global loss ([`check_fd`]).

use crate::{miss, within};
use candle_core::{DType, Tensor, Var};
use shardnet::comm::ReduceOp;
use shardnet::functions::Context;
use shardnet::{Error, Result};

pub(super) const COLS: usize = 3;
pub(super) const IN: usize = 4;
const FD_H: f64 = 1e-5;
const FD_TOL: f64 = 1e-6;
/// Up to this many ranks, finite differences move one element at a time;
/// beyond, they check [`DIRECTIONS`] seeded directions (the cost of one
/// element at a time grows with the square of the rank count).
const PER_ELEMENT_RANKS: usize = 4;
const DIRECTIONS: usize = 3;
pub(super) const NET_TOL: f64 = 1e-5;

pub(super) fn fail(what: String) -> Error {
    Error::Usage(format!("autograd conformance: {what}"))
}

pub(super) fn tape_is_empty(c: &Context) -> Result<()> {
    match c.pending_backward() {
        0 => Ok(()),
        k => Err(fail(format!("{k} ops still wait for backward"))),
    }
}

/// Deterministic values in [-1, 1) from a seed.
pub(crate) fn values(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x2545_F491_4F6C_DD1D;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect()
}

/// A seeded tensor of `dims` (values in [−1, 1)), the inputs of every case.
pub fn seeded(seed: u64, dims: &[usize], dtype: DType) -> Result<Tensor> {
    let n = dims.iter().product();
    Ok(Tensor::from_vec(values(seed, n), dims, &shardnet::comm::HOST)?.to_dtype(dtype)?)
}

pub(super) fn var(seed: u64, dims: &[usize], dtype: DType) -> Result<Var> {
    Ok(Var::from_tensor(&seeded(seed, dims, dtype)?)?)
}

/// sum(tanh(y) ⊙ w), w seeded by `seed` and shaped like y.
pub(crate) fn weighted(y: &Tensor, seed: u64) -> Result<Tensor> {
    let w = seeded(seed, y.dims(), y.dtype())?;
    Ok(y.tanh()?.mul(&w)?.sum_all()?)
}

/// max |got − want| / max |want| ≤ tol (both flattened; equal shapes).
pub(crate) fn close(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> Result<()> {
    close_in(what, got, want, want, tol)
}

/// max |got − want| / max |of| ≤ tol: `want` judged against the scale of
/// `of` (the whole tensor a slice `want` was cut from, or `want` itself).
pub(crate) fn close_in(
    what: &str,
    got: &Tensor,
    want: &Tensor,
    of: &Tensor,
    tol: f64,
) -> Result<()> {
    if got.dims() != want.dims() {
        miss(format!(
            "{what}: shape {:?}, want {:?}",
            got.dims(),
            want.dims()
        ));
        return Ok(());
    }
    let g = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let w = want.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let o = of.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let scale = o.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = g
        .iter()
        .zip(&w)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    if !(err <= tol * scale.max(1e-30) || err <= 1e-30) {
        miss(format!(
            "{what}: relative error {:.2e} (max |want| {scale:.3e}), over {tol:e}",
            err / scale.max(1e-30)
        ));
    }
    Ok(())
}

pub(super) fn grad_of(grads: &candle_core::backprop::GradStore, v: &Var) -> Result<Tensor> {
    match grads.get(v.as_tensor()) {
        Some(g) => Ok(g.clone()),
        None => Ok(v.as_tensor().zeros_like()?),
    }
}

/// Check every rank's analytic gradient of `loss` against central
/// differences of the global loss. `shapes(s)` are rank s's parameters.
pub(super) fn check_fd(
    c: &Context,
    shapes: &dyn Fn(usize) -> Vec<Vec<usize>>,
    replicated: bool,
    loss: &dyn Fn(&Context, &[Tensor]) -> Result<Tensor>,
) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let mine: Vec<Var> = shapes(r)
        .iter()
        .enumerate()
        .map(|(i, d)| var((r * 10 + i) as u64 + 1000, d, DType::F64))
        .collect::<Result<_>>()?;
    let params: Vec<Tensor> = mine.iter().map(|v| v.as_tensor().clone()).collect();
    let grads = loss(c, &params)?.backward()?;
    tape_is_empty(c)?;
    let analytic: Vec<Vec<f64>> = mine
        .iter()
        .map(|v| Ok(grad_of(&grads, v)?.flatten_all()?.to_vec1::<f64>()?))
        .collect::<Result<_>>()?;

    let _plain = c.no_grad();
    let base: Vec<Tensor> = mine.iter().map(|v| v.as_tensor().detach()).collect();
    let global = |params: &[Tensor]| -> Result<f64> {
        let l = loss(c, params)?.reshape(1)?;
        let op = if replicated {
            ReduceOp::Mean
        } else {
            ReduceOp::Sum
        };
        Ok(c.allreduce(&l, op)?.to_vec1::<f64>()?[0])
    };
    if n > PER_ELEMENT_RANKS {
        // Directional derivatives: every rank moves all its elements at once
        // along a seeded direction v; d/dh L(θ + h·v) = Σ_ranks ∇L·v.
        for k in 0..DIRECTIONS {
            let dirs: Vec<Vec<f64>> = base
                .iter()
                .enumerate()
                .map(|(p, b)| values(7919 * (k as u64 + 1) + (r * 10 + p) as u64, b.elem_count()))
                .collect();
            let at = |delta: f64| -> Result<f64> {
                let moved = base
                    .iter()
                    .zip(&dirs)
                    .map(|(b, v)| {
                        let dv = Tensor::from_vec(v.clone(), b.dims(), &shardnet::comm::HOST)?;
                        Ok((b + (dv * delta)?)?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                global(&moved)
            };
            let fd = (at(FD_H)? - at(-FD_H)?) / (2.0 * FD_H);
            let mine: f64 = analytic
                .iter()
                .zip(&dirs)
                .map(|(a, v)| a.iter().zip(v).map(|(a, v)| a * v).sum::<f64>())
                .sum();
            let a = c.allreduce_obj(&mine, |x, y| x + y)?;
            if !within((a - fd).abs(), FD_TOL * fd.abs().max(1.0)) {
                miss(format!(
                    "direction {k} (all ranks moved at once): gradient·v {a}, finite difference {fd}"
                ));
            }
        }
        return Ok(());
    }
    for s in 0..n {
        for (p, dims) in shapes(s).iter().enumerate() {
            for e in 0..dims.iter().product::<usize>() {
                let at = |delta: f64| -> Result<f64> {
                    if s != r {
                        return global(&base);
                    }
                    let mut moved = base.clone();
                    let mut v = base[p].flatten_all()?.to_vec1::<f64>()?;
                    v[e] += delta;
                    moved[p] = Tensor::from_vec(v, dims.as_slice(), &shardnet::comm::HOST)?;
                    global(&moved)
                };
                let fd = (at(FD_H)? - at(-FD_H)?) / (2.0 * FD_H);
                if s == r {
                    let a = analytic[p][e];
                    if !within((a - fd).abs(), FD_TOL * fd.abs().max(1.0)) {
                        miss(format!(
                            "rank {r}, parameter {p}, element {e}: gradient {a}, finite difference {fd}"
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}
