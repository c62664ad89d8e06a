//! Data-parallel gradients and loss scaling across ranks.
//!
//! [`allreduce_grads`] is the multi-node optimizer's communication: one
//! allreduce of every listed parameter's gradient (flattened into a single
//! buffer: one call, not one per tensor), before the optimizer steps.
//!
//! **Sum or mean.** Which one is right depends on what each rank's loss is.
//! In plain data parallelism each rank's loss is the mean over its own batch,
//! and the global loss is the mean of those: average the gradients
//! ([`ReduceOp::Mean`]). Behind a sharded head the loss every rank holds is
//! already the mean over the *global* batch (the features were allgathered),
//! and each rank's backbone received only its own samples' share of it: sum
//! ([`ReduceOp::Sum`]). Averaging there divides the backbone's gradient by
//! the number of ranks — the mistake of a published implementation of seed
//! 003's scheme, which `tests/face_head.rs` shows.
//!
//! [`LossScaler`]: dynamic loss scaling for half-precision gradients.

use crate::comm::Communicator;
use crate::nn::Param;
use crate::{Error, ReduceOp, Result};
use candle_core::Tensor;

/// Allreduce the gradients of `params` (every rank lists the same
/// parameters, each with a gradient) with `op`, in place.
pub fn allreduce_grads(comm: &Communicator, params: &[Param], op: ReduceOp) -> Result<()> {
    let Some(first) = params.first() else {
        return Ok(());
    };
    // A parameter listed twice would have its gradient summed twice (and
    // the CPU path, which borrows every buffer at once, wait on itself).
    let mut seen = std::collections::HashSet::new();
    for p in params {
        if !seen.insert(p.identity()) {
            return Err(Error::Usage(format!(
                "allreduce_grads on rank {}: {} is listed twice (list each parameter once)",
                comm.rank(),
                p.name()
            )));
        }
    }
    if !crate::kernels::fast(first.value().device()) {
        return allreduce_grads_generic(comm, params, op);
    }
    if let Some(p) = params.iter().find(|p| p.grad().is_none()) {
        return Err(missing(comm, p));
    }
    // Every gradient buffer at once, reduced in place: on thread ranks
    // straight between the ranks' buffers, elsewhere through one copy in
    // and one copy out.
    let mut reduce = |bufs: &mut [&mut [f32]]| comm.allreduce_slices(bufs, op);
    let nonempty: Vec<&Param> = params
        .iter()
        .filter(|p| p.value().elem_count() > 0)
        .collect();
    with_grads(&nonempty, Vec::new(), &mut reduce)
}

/// Run `f` on the gradient buffers of `params` (each non-empty, with a
/// gradient), all borrowed at once, after `held`.
fn with_grads<'a>(
    params: &[&Param],
    held: Vec<&'a mut [f32]>,
    f: &mut (dyn FnMut(&mut [&mut [f32]]) -> Result<()> + Send),
) -> Result<()> {
    let Some((p, rest)) = params.split_first() else {
        let mut held = held;
        return f(&mut held);
    };
    let mut ran = false;
    p.update_grad(|g, _| {
        ran = true;
        let mut h: Vec<&mut [f32]> = held.into_iter().map(|b| b as &mut [f32]).collect();
        h.push(g);
        with_grads(rest, h, f)
    })?;
    if ran {
        Ok(())
    } else {
        Err(Error::Usage(format!(
            "allreduce_grads: {} has no f32 host gradient buffer",
            p.name()
        )))
    }
}

fn missing(comm: &Communicator, p: &Param) -> Error {
    Error::Usage(format!(
        "allreduce_grads on rank {}: {} has no gradient (did backward reach it?)",
        comm.rank(),
        p.name()
    ))
}

/// [`allreduce_grads`] in tensor ops on the parameters' device.
fn allreduce_grads_generic(comm: &Communicator, params: &[Param], op: ReduceOp) -> Result<()> {
    let flat = params
        .iter()
        .map(|p| Ok(p.grad().ok_or_else(|| missing(comm, p))?.flatten_all()?))
        .collect::<Result<Vec<_>>>()?;
    let sum = comm.allreduce(&Tensor::cat(&flat, 0)?, op)?;
    let mut at = 0;
    for p in params {
        let k = p.value().elem_count();
        p.set_grad(&sum.narrow(0, at, k)?.reshape(p.value().shape())?)?;
        at += k;
    }
    Ok(())
}

/// Dynamic loss scaling: backward runs on loss × scale so that small
/// gradients survive half precision; before the step, gradients are divided
/// by the scale and checked. A step with an inf or NaN gradient on any rank
/// is skipped on every rank and the scale halves; after `growth_interval`
/// good steps in a row it doubles. Its state (serde) is what checkpoints
/// keep.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    /// The current scale.
    pub scale: f64,
    /// Good steps before the scale doubles.
    pub growth_interval: usize,
    good: usize,
    /// Steps skipped so far.
    pub skipped: usize,
}

impl LossScaler {
    /// A scaler starting at `scale` (2^16 is PyTorch's default), doubling
    /// after 2000 good steps.
    pub fn new(scale: f64) -> Self {
        LossScaler {
            scale,
            growth_interval: 2000,
            good: 0,
            skipped: 0,
        }
    }

    /// Unscale the gradients of `params` in place; `Ok(true)` if every
    /// rank's are finite (step), `Ok(false)` if not (the gradients are
    /// dropped: skip the step). Collective: every rank calls it.
    pub fn unscale(&mut self, comm: &Communicator, params: &[Param]) -> Result<bool> {
        let inv = (1.0 / self.scale) as f32;
        let mut bad = false;
        for p in params {
            let Some(g) = p.grad() else { continue };
            if !crate::kernels::fast(g.device()) {
                let scaled = (g * inv as f64)?;
                // In f64, so that a sum of finite values cannot overflow.
                let total = scaled.to_dtype(candle_core::DType::F64)?.abs()?.sum_all()?;
                bad |= !total.to_scalar::<f64>()?.is_finite();
                p.set_grad(&scaled)?;
                continue;
            }
            p.update_grad(|g, _| {
                for v in g.iter_mut() {
                    *v *= inv;
                    bad |= !v.is_finite();
                }
                Ok(())
            })?;
        }
        let flag = Tensor::new(&[f32::from(u8::from(bad))], comm.device())?;
        let any_bad = comm.allreduce(&flag, ReduceOp::Max)?.to_vec1::<f32>()?[0] > 0.0;
        if any_bad {
            for p in params {
                p.take_grad();
            }
            self.scale /= 2.0;
            self.good = 0;
            self.skipped += 1;
            return Ok(false);
        }
        self.good += 1;
        if self.good >= self.growth_interval {
            self.scale *= 2.0;
            self.good = 0;
        }
        Ok(true)
    }
}
