//! What the conv and dense chains share: the seed and the tolerance,
//! and the checks of a rank's gradients against its slice of the
//! one-device gradient.

use crate::autograd::close_in;
use crate::miss;
use candle_core::{backprop::GradStore, Tensor, Var};
use shardnet::nn::Param;
use shardnet::Result;

pub(super) const SEED: u64 = 47;
pub(super) const TOL: f64 = 1e-5;

/// A rank's slice of a one-device gradient against its own: the error
/// relative to the whole gradient's largest value (a slice of one small
/// channel says little relative to itself in f32).
pub(super) fn close_slice(what: &str, got: &Tensor, want: &Tensor, whole: &Tensor) -> Result<()> {
    close_in(what, got, want, whole, TOL)
}

pub(super) fn grad_of(grads: &GradStore, v: &Var) -> Result<Tensor> {
    Ok(grads
        .get(v.as_tensor())
        .cloned()
        .unwrap_or(v.as_tensor().zeros_like()?))
}

pub(super) fn param_grad(p: &Param) -> Result<Tensor> {
    match p.grad() {
        Some(g) => Ok(g.clone()),
        None => {
            miss(format!("{}: no gradient", p.name()));
            Ok(p.value().zeros_like()?)
        }
    }
}
