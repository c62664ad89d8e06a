//! Activation recomputation ([`recompute`]): y = f(x) without keeping f's
//! intermediate values; backward runs f again from x, then its backward.
//!
//! | pass | does | holds |
//! |------|------|-------|
//! | forward | f(x) with no tape and no graph kept (its communication plain) | x and y |
//! | backward | f(x) again with its graph, on a chain of the tape of its own (its communication recorded and run back at once); backward from y · dL/dy | f's intermediates, only while it runs |
//!
//! f must be a function of x and of parameters that backward does not
//! change (the same values twice: dropout masks drawn from seeds, as
//! shardnet's are). Its parameters' gradients reach them in the second
//! backward, as they would have in the first (layers that compute with
//! [`crate::nn::Param::tracked`] or their own kernels; a `GradStore` entry
//! would be lost).

use super::backward_from::backward_from;
use super::tape::{cuda_of, gpu_fwd, in_chain, metal_of, owned, owned_on, Context, Once};
use crate::Result;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, MetalStorage, Shape, Tensor, Var};
use std::sync::Arc;

/// The tape chain recomputed functions record on: each runs its backward
/// to the end before another begins, so one chain serves them all.
const CHAIN: u64 = u64::MAX;

/// A function of one tensor, run twice.
type Function = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// What runs after each of f's runs: told whether it was backward's.
type After = Arc<dyn Fn(bool) -> Result<()> + Send + Sync>;

/// f(x) whose backward recomputes f from x (see the module doc). `ctx`:
/// the tape f's communication is recorded on.
pub fn recompute(
    ctx: &Context,
    x: &Tensor,
    f: impl Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    recompute_then(ctx, x, f, |_| Ok(()))
}

/// [`recompute`], with `after` run after f's forward (told `false`) and
/// after the backward of f's second run (told `true`: f's parameters have
/// their gradients): a fully sharded layer frees what it gathered for the
/// forward, and hands its gradients on after the backward.
pub fn recompute_then(
    ctx: &Context,
    x: &Tensor,
    f: impl Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
    after: impl Fn(bool) -> Result<()> + Send + Sync + 'static,
) -> Result<Tensor> {
    let y = {
        let _plain = ctx.no_grad();
        f(&x.detach())?.detach()
    };
    after(false)?;
    if !x.track_op() {
        // Nothing to differentiate: no node.
        return Ok(y);
    }
    Ok(x.apply_op1(Recompute {
        f: Arc::new(f),
        after: Arc::new(after),
        y: Once::new(y.contiguous()?),
    })?)
}

struct Recompute {
    f: Function,
    after: After,
    /// The first forward's value.
    y: Once,
}

impl CustomOp1 for Recompute {
    fn name(&self) -> &'static str {
        "shardnet-recompute"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        owned(&self.y.take()?)
    }

    gpu_fwd!(op1, y);

    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let dx = in_chain(CHAIN, || -> Result<Option<Tensor>> {
            let leaf = Var::from_tensor(&x.detach())?;
            let y = (self.f)(leaf.as_tensor())?;
            let grads = backward_from(&y, &grad.to_dtype(y.dtype())?)?;
            let dx = grads.get(leaf.as_tensor()).cloned();
            drop((grads, y));
            (self.after)(true)?;
            Ok(dx)
        })
        .map_err(candle_core::Error::wrap)?;
        let dx = match dx {
            Some(d) => d,
            // f does not depend on x.
            None => x.zeros_like()?,
        };
        Ok(Some(dx))
    }
}
