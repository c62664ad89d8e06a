//! A trainable tensor and its in-place gradient buffer.

use crate::functions::RowUpdate;
use crate::Result;
use candle_core::{CpuStorage, InplaceOp3, Layout, Tensor, Var};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Where a shard lies in its global tensor: along dimension `dim`, elements
/// `offset .. offset + len` of `global` (len: the shard's own size there).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Shard {
    /// The dimension the global tensor is split along.
    pub dim: usize,
    /// Where this shard starts along `dim`.
    pub offset: usize,
    /// The global tensor's size along `dim`.
    pub global: usize,
}

impl Shard {
    /// The shard covering `own` of a global tensor of `global` along `dim`.
    pub fn along(dim: usize, own: &std::ops::Range<usize>, global: usize) -> Shard {
        Shard {
            dim,
            offset: own.start,
            global,
        }
    }

    /// Rank `rank`'s balanced share of a global tensor of `global` along
    /// `dim` over `ranks` ([`chunk_range`](crate::comm::chunk_range), the
    /// split every sharded layer uses): its placement and the range it
    /// covers.
    pub fn balanced(
        dim: usize,
        global: usize,
        ranks: usize,
        rank: usize,
    ) -> (Shard, std::ops::Range<usize>) {
        let own = crate::comm::chunk_range(global, ranks, rank);
        (Shard::along(dim, &own, global), own)
    }
}

/// A trainable tensor: its value (a `Var`) and its gradient, which shardnet
/// layers accumulate in place during backward. Clones share both.
#[derive(Clone)]
pub struct Param {
    name: String,
    /// Where this tensor lies in the global one, if it is a shard.
    shard: Option<Shard>,
    value: Var,
    /// The gradient buffer, on the value's device: written in place by the
    /// CPU kernels, through [`Var::set`] by the generic path. Allocated on
    /// the first gradient, so a weight that an optimizer updates in place as
    /// its gradient is produced ([`Param::set_fused`]) never has one.
    grad: Arc<OnceLock<Var>>,
    /// The optimizer's in-place row update, where backward applies it
    /// directly (the fused head step).
    fused: Arc<Mutex<Option<Arc<dyn RowUpdate>>>>,
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
        Self::from_var(name, Var::from_tensor(&value.contiguous()?)?)
    }

    /// A parameter named `name` that is `var` itself (not a copy): a `Var`
    /// a candle-nn layer or user code already computes with, registered so
    /// that optimizers step it. Its gradient arrives through candle's
    /// `GradStore` ([`Param::absorb`]).
    pub fn from_var(name: impl Into<String>, value: Var) -> Result<Self> {
        Ok(Param {
            name: name.into(),
            shard: None,
            value,
            grad: Arc::new(OnceLock::new()),
            fused: Arc::new(Mutex::new(None)),
            empty: Arc::new(AtomicBool::new(true)),
        })
    }

    /// The same number for a parameter and its clones (which share their
    /// value and gradient), different for any other live parameter.
    pub(crate) fn identity(&self) -> usize {
        Arc::as_ptr(&self.grad) as usize
    }

    /// The gradient buffer, allocated (zeros) on first use.
    fn grad_buf(&self) -> Result<&Var> {
        if let Some(g) = self.grad.get() {
            return Ok(g);
        }
        let zeros = {
            let _grads = crate::heap::counting_as(crate::heap::Part::Gradients);
            Var::zeros(self.value.shape(), self.value.dtype(), self.value.device())?
        };
        // A concurrent first use keeps one of the two (both zeros).
        let _ = self.grad.set(zeros);
        self.grad
            .get()
            .ok_or_else(|| crate::Error::Usage(format!("{}: no gradient buffer", self.name)))
    }

    /// Let backward apply `update` to this weight's rows in place as their
    /// gradient is produced, instead of accumulating the gradient (kernels
    /// that support it: the sharded head's); `None` turns it off. Set by an
    /// optimizer ([`crate::optim::Optimizer::fuse`]).
    pub fn set_fused(&self, update: Option<Arc<dyn RowUpdate>>) {
        *self.fused.lock().unwrap_or_else(|e| e.into_inner()) = update;
    }

    /// The fused update, if one is set.
    pub fn fused(&self) -> Option<Arc<dyn RowUpdate>> {
        self.fused.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Run `f` on the value's f32 elements, in place (CPU).
    pub(crate) fn update_value(
        &self,
        f: impl FnOnce(&mut [f32]) -> Result<()> + Send,
    ) -> Result<()> {
        if self.value.elem_count() == 0 {
            return Ok(());
        }
        let mut f = Some(f);
        let op = UpdateOp {
            f: Mutex::new(Some(move |buf: &mut [f32], _: bool| match f.take() {
                Some(f) => f(buf),
                None => Ok(()),
            })),
            empty: false,
            result: Mutex::new(None),
        };
        self.value.as_tensor().inplace_op1(&op)?;
        let result = op.result.lock().unwrap_or_else(|e| e.into_inner()).take();
        result.unwrap_or(Ok(()))
    }

    /// Its name (for checkpoints and messages).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This parameter, marked as the shard `shard` of a global tensor.
    pub fn with_shard(mut self, shard: Shard) -> Self {
        self.shard = Some(shard);
        self
    }

    /// Where it lies in the global tensor, if it is a shard (`None`: it is
    /// the whole tensor).
    pub fn shard(&self) -> Option<Shard> {
        self.shard
    }

    /// The value, for use in graphs.
    pub fn value(&self) -> &Tensor {
        self.value.as_tensor()
    }

    /// The value as a graph input whose gradient backward adds to this
    /// parameter's own ([`crate::functions::tracked`]): what a layer's
    /// candle-op path computes with, so that no `GradStore` entry is left
    /// to move by hand. (Computing with [`Param::value`] instead leaves the
    /// gradient in candle's `GradStore`: see [`Param::absorb`].)
    pub fn tracked(&self) -> Result<Tensor> {
        crate::functions::tracked(self)
    }

    /// The value as a `Var`.
    pub fn var(&self) -> &Var {
        &self.value
    }

    /// The gradient accumulated since the last [`Param::take_grad`], if any
    /// (`None`: backward did not reach this parameter since, on either
    /// path). A shard with no elements (more ranks than rows) always has
    /// its empty gradient: nothing can be missing from it. The tensor is
    /// the live buffer: copy it to keep it.
    pub fn grad(&self) -> Option<&Tensor> {
        if self.value.elem_count() == 0 {
            return self.grad_buf().ok().map(|g| g.as_tensor());
        }
        if self.empty.load(Ordering::Acquire) {
            return None;
        }
        // Allocated by the accumulation that cleared `empty`, except for an
        // empty shard's (no elements: nothing was written).
        self.grad_buf().ok().map(|g| g.as_tensor())
    }

    /// Add `g` (shaped like the value) to the gradient, on any device.
    pub fn add_grad(&self, g: &Tensor) -> Result<()> {
        if g.dims() != self.value.dims() {
            return Err(crate::Error::Usage(format!(
                "{}: a gradient of shape {:?} for a parameter of shape {:?}",
                self.name,
                g.dims(),
                self.value.dims()
            )));
        }
        if self.value.elem_count() == 0 {
            // A shard with no elements: it has a gradient, with nothing in it.
            self.empty.store(false, Ordering::Release);
            let _ = self.grad_buf()?;
            return Ok(());
        }
        let g = g.to_dtype(self.value.dtype())?;
        let buf = self.grad_buf()?;
        if self.empty.swap(false, Ordering::AcqRel) {
            buf.set(&g)?;
        } else {
            buf.set(&(buf.as_tensor() + g)?)?;
        }
        Ok(())
    }

    /// Replace the gradient by `g` (shaped like the value), on any device.
    pub fn set_grad(&self, g: &Tensor) -> Result<()> {
        self.empty.store(true, Ordering::Release);
        self.add_grad(g)
    }

    /// Move this parameter's entry of candle's `GradStore` (what candle's own
    /// backward computed for it: the generic path, candle-nn layers, plain
    /// tensor ops) into its gradient. Returns whether there was one. Call it
    /// after every `backward()` whose graph may use the parameter outside
    /// shardnet's in-place kernels; [`crate::nn::ParamStore::absorb`] does it
    /// for all.
    pub fn absorb(&self, grads: &mut candle_core::backprop::GradStore) -> Result<bool> {
        match grads.remove(self.value.as_tensor()) {
            Some(g) => self.add_grad(&g).map(|_| true),
            None => Ok(false),
        }
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
        if self.value.elem_count() == 0 {
            // A shard with no elements (more ranks than rows): nothing to add.
            return Ok(());
        }
        self.grad_buf()?
            .as_tensor()
            .inplace_op3(a, b, &AccumulateOp { op, overwrite })?;
        Ok(())
    }
}

/// The value of an optional bias, or an empty tensor like `like` (what the
/// fused ops take for "no bias").
pub(crate) fn bias_or_empty(bias: Option<&Param>, like: &Tensor) -> Result<Tensor> {
    Ok(match bias {
        Some(b) => b.value().clone(),
        None => Tensor::zeros(0, like.dtype(), like.device())?,
    })
}

/// Elements per block of [`Param::grad_squares`]: fixed, so that the sum
/// is the same on any number of threads.
const SQUARES_BLOCK: usize = 1 << 14;

impl Param {
    /// Σ g² over the gradient, in f64 (0 without one): on the CPU read in
    /// place, blocks of 16 Ki elements over the threads, their sums added
    /// in order; elsewhere in candle ops.
    pub fn grad_squares(&self) -> Result<f64> {
        self.grad_squares_of(None)
    }

    /// [`Param::grad_squares`] over rows `rows` of the gradient (along
    /// dimension 0; `None`: all of it): a data-parallel rank's share where
    /// the optimizer's state is sharded.
    pub fn grad_squares_of(&self, rows: Option<std::ops::Range<usize>>) -> Result<f64> {
        let Some(g) = self.grad() else {
            return Ok(0.0);
        };
        let g = match rows {
            Some(r) => &g.narrow(0, r.start, r.len())?,
            None => g,
        };
        if g.device().is_cpu() && g.dtype() == candle_core::DType::F32 {
            return crate::kernels::with_f32s(g, "grad_squares", |v| {
                use rayon::prelude::*;
                let square = |c: &[f32]| c.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>();
                let blocks: Vec<f64> = if crate::kernels::split_work(v.len()) {
                    v.par_chunks(SQUARES_BLOCK).map(square).collect()
                } else {
                    v.chunks(SQUARES_BLOCK).map(square).collect()
                };
                Ok::<_, crate::Error>(blocks.iter().sum())
            });
        }
        Ok(g.to_dtype(candle_core::DType::F64)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f64>()?)
    }

    /// The gradient times `c` (nothing without one): in place on the CPU,
    /// over the threads.
    pub fn scale_grad(&self, c: f64) -> Result<()> {
        let Some(g) = self.grad() else {
            return Ok(());
        };
        if !(g.device().is_cpu() && g.dtype() == candle_core::DType::F32) {
            let scaled = (g * c)?;
            return self.set_grad(&scaled);
        }
        let c = c as f32;
        self.update_grad(move |v, _| {
            crate::kernels::for_chunks_mut(v, SQUARES_BLOCK, |_, b| {
                b.iter_mut().for_each(|x| *x *= c)
            });
            Ok(())
        })
    }

    /// Run `f` on the f32 gradient buffer, told whether it is empty (then
    /// `f` must overwrite every element it does not mean to leave at a stale
    /// value: the buffer is not zeroed); the buffer is non-empty afterwards.
    pub(crate) fn update_grad(
        &self,
        f: impl FnOnce(&mut [f32], bool) -> Result<()> + Send,
    ) -> Result<()> {
        let empty = self.empty.swap(false, Ordering::AcqRel);
        if self.value.elem_count() == 0 {
            return Ok(());
        }
        let op = UpdateOp {
            f: Mutex::new(Some(f)),
            empty,
            result: Mutex::new(None),
        };
        self.grad_buf()?.as_tensor().inplace_op1(&op)?;
        let result = op.result.lock().unwrap_or_else(|e| e.into_inner()).take();
        result.unwrap_or(Ok(()))
    }
}

struct UpdateOp<F> {
    f: Mutex<Option<F>>,
    empty: bool,
    result: Mutex<Option<Result<()>>>,
}

impl<F: FnOnce(&mut [f32], bool) -> Result<()> + Send> candle_core::InplaceOp1 for UpdateOp<F> {
    fn name(&self) -> &'static str {
        "shardnet-update-grad"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(v) = s else {
            candle_core::bail!("shardnet: this in-place update needs an f32 parameter");
        };
        let n = l.shape().elem_count();
        let buf = &mut v[l.start_offset()..l.start_offset() + n];
        if let Some(f) = self.f.lock().unwrap_or_else(|e| e.into_inner()).take() {
            *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(f(buf, self.empty));
        }
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

impl crate::functions::InPlaceGrad for Param {
    fn value(&self) -> &Tensor {
        Param::value(self)
    }
    fn has_grad(&self) -> bool {
        self.grad().is_some()
    }
    fn update_grad(
        &self,
        f: &mut (dyn FnMut(&mut [f32], bool) -> Result<()> + Send),
    ) -> Result<()> {
        Param::update_grad(self, f)
    }
    fn handle(&self) -> Arc<dyn crate::functions::InPlaceGrad> {
        Arc::new(self.clone())
    }
    fn fused_update(&self) -> Option<Arc<dyn RowUpdate>> {
        self.fused()
    }
    fn update_value(&self, f: &mut (dyn FnMut(&mut [f32]) -> Result<()> + Send)) -> Result<()> {
        Param::update_value(self, f)
    }
    fn add_grad(&self, g: &Tensor) -> Result<()> {
        Param::add_grad(self, g)
    }
}
