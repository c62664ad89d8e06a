//! A trainable tensor and its in-place gradient buffer.

use crate::Result;
use candle_core::{CpuStorage, InplaceOp3, Layout, Tensor, Var};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A trainable tensor: its value (a `Var`) and its gradient, which shardnet
/// layers accumulate in place during backward. Clones share both.
#[derive(Clone)]
pub struct Param {
    name: String,
    value: Var,
    grad: Tensor,
    /// No gradient since the last [`Param::take_grad`]: the next accumulation
    /// overwrites instead of adding (so no zeroing pass is needed).
    empty: Arc<AtomicBool>,
}

impl std::fmt::Debug for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Param({}, {:?})", self.name, self.value.dims())
    }
}

impl Param {
    /// A parameter named `name` holding `value` (copied).
    pub fn new(name: impl Into<String>, value: &Tensor) -> Result<Self> {
        let value = Var::from_tensor(&value.contiguous()?)?;
        let grad = value.as_tensor().zeros_like()?.contiguous()?;
        Ok(Param {
            name: name.into(),
            value,
            grad,
            empty: Arc::new(AtomicBool::new(true)),
        })
    }

    /// Its name (for checkpoints and messages).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The value, for use in graphs.
    pub fn value(&self) -> &Tensor {
        self.value.as_tensor()
    }

    /// The value as a `Var`.
    pub fn var(&self) -> &Var {
        &self.value
    }

    /// The gradient accumulated since the last [`Param::take_grad`], if any.
    /// The tensor is the live buffer: copy it to keep it.
    pub fn grad(&self) -> Option<&Tensor> {
        (!self.empty.load(Ordering::Acquire)).then_some(&self.grad)
    }

    /// The gradient (as [`Param::grad`]) and mark the buffer consumed: the
    /// next backward starts from zero.
    pub fn take_grad(&self) -> Option<Tensor> {
        let g = self.grad().cloned();
        self.empty.store(true, Ordering::Release);
        g
    }

    /// Accumulate into the gradient buffer with `op` (srcs `a`, `b`), which
    /// must overwrite when told the buffer is empty.
    pub(crate) fn accumulate<C: Accumulate>(&self, a: &Tensor, b: &Tensor, op: C) -> Result<()> {
        let overwrite = self.empty.swap(false, Ordering::AcqRel);
        self.grad
            .inplace_op3(a, b, &AccumulateOp { op, overwrite })?;
        Ok(())
    }
}

/// An accumulation kernel: `dst (+)= f(a, b)`.
pub(crate) trait Accumulate {
    fn name(&self) -> &'static str;
    fn run(
        &self,
        dst: &mut CpuStorage,
        srcs: [(&CpuStorage, &Layout); 2],
        overwrite: bool,
    ) -> candle_core::Result<()>;
}

struct AccumulateOp<C> {
    op: C,
    overwrite: bool,
}

impl<C: Accumulate> InplaceOp3 for AccumulateOp<C> {
    fn name(&self) -> &'static str {
        self.op.name()
    }
    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        _: &Layout,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<()> {
        self.op.run(dst, [(a, al), (b, bl)], self.overwrite)
    }
}
