//! A rank's training state as checkpoints see it: every tensor that a run
//! needs to continue (parameters, optimizer moments, batch norm's running
//! statistics), by name, with its place in the global tensor, read and
//! written in place where it lives.
//!
//! | what | name in a checkpoint | where it lives ([`Slot`]) |
//! |---|---|---|
//! | a parameter | `param/{name}` | its `Var` |
//! | Adam's first / second moment | `adam.m/{name}`, `adam.v/{name}` | host vectors (CPU), `Var`s (elsewhere) |
//! | SGD's momentum | `sgd.momentum/{name}` | a host vector (CPU), a `Var` (elsewhere) |
//! | running mean / variance | `buffer/{layer}.running_mean`, `…running_var` | a batch norm's locked pair |
//!
//! Values are f32 (master weights, moments and statistics are f32 in every
//! model shardnet trains). Reading hands out the live values without a copy
//! on the CPU; writing replaces them.

use super::Shard;
use crate::{Error, Result};

/// The prefix of a buffer's name in a checkpoint (batch norm's running
/// statistics: `buffer/{layer}.running_mean`); without it, the name a
/// single-device file gives it (PyTorch's `state_dict` name).
pub const BUFFER_PREFIX: &str = "buffer/";
use candle_core::{DType, Storage, Tensor, Var};
use std::sync::{Arc, Mutex};

/// Which of a pair a [`Slot`] names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    /// The first (Adam's m, the running mean).
    First,
    /// The second (Adam's v, the running variance).
    Second,
}

/// Where a state tensor's values live.
#[derive(Clone)]
pub enum Slot {
    /// A variable (a parameter, a moment on a device).
    Var(Var),
    /// A host vector behind a lock (SGD's momentum on the CPU).
    Host(Arc<Mutex<Vec<f32>>>),
    /// One of two host vectors behind one lock (Adam's moments on the CPU).
    HostPair(Arc<Mutex<(Vec<f32>, Vec<f32>)>>, Half),
    /// One of two tensors behind one lock (batch norm's running statistics).
    TensorPair(Arc<Mutex<(Tensor, Tensor)>>, Half),
}

/// One tensor of a rank's training state.
#[derive(Clone)]
pub struct StateTensor {
    /// Its name in a checkpoint (`param/…`, `adam.m/…`, `buffer/…`).
    pub name: String,
    /// This rank's shape of it.
    pub shape: Vec<usize>,
    /// Where it lies in the global tensor, if this rank holds a shard.
    pub shard: Option<Shard>,
    /// Where its values live.
    pub slot: Slot,
}

impl std::fmt::Debug for StateTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StateTensor({}, {:?}, {:?})",
            self.name, self.shape, self.shard
        )
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `f` on the f32 values of `t` in row-major order: the live storage for a
/// contiguous CPU tensor, a host copy otherwise.
fn with_tensor<R>(t: &Tensor, what: &str, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    if t.dtype() != DType::F32 {
        return Err(Error::Usage(format!(
            "{what} is {:?}: checkpoints hold f32 state",
            t.dtype()
        )));
    }
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            return f(&v[a..b]);
        }
    }
    let host = t
        .to_device(&crate::comm::HOST)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    f(&host)
}

impl StateTensor {
    /// The state tensor `name` that is `var` (its shape).
    pub fn var(name: impl Into<String>, var: &Var, shard: Option<Shard>) -> Self {
        StateTensor {
            name: name.into(),
            shape: var.dims().to_vec(),
            shard,
            slot: Slot::Var(var.clone()),
        }
    }

    /// Elements on this rank.
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// `f` on this rank's values (f32, row-major), without a copy where
    /// they are on the host.
    pub fn with_values<R>(&self, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
        match &self.slot {
            Slot::Var(v) => with_tensor(v.as_tensor(), &self.name, f),
            Slot::Host(v) => f(&lock(v)),
            Slot::HostPair(pair, half) => {
                let g = lock(pair);
                f(match half {
                    Half::First => &g.0,
                    Half::Second => &g.1,
                })
            }
            Slot::TensorPair(pair, half) => {
                let t = {
                    let g = lock(pair);
                    match half {
                        Half::First => g.0.clone(),
                        Half::Second => g.1.clone(),
                    }
                };
                with_tensor(&t, &self.name, f)
            }
        }
    }

    /// Write this rank's values in place with `f`, given the live f32
    /// storage where it can be (a CPU variable, host moments): no copy and
    /// no second buffer; elsewhere a host buffer that is then set.
    pub fn fill(&self, f: impl FnOnce(&mut [f32]) -> Result<()> + Send) -> Result<()> {
        let n = self.elem_count();
        match &self.slot {
            Slot::Var(v)
                if v.device().is_cpu()
                    && v.dtype() == DType::F32
                    && v.layout().is_contiguous()
                    && n > 0 =>
            {
                let op = Fill {
                    f: Mutex::new(Some(f)),
                    result: Mutex::new(None),
                    len: n,
                };
                v.as_tensor().inplace_op1(&op)?;
                let r = lock(&op.result).take();
                r.unwrap_or_else(|| Err(Error::Usage(format!("{}: not filled", self.name))))
            }
            Slot::Host(v) => self.fill_host(&mut lock(v), f),
            Slot::HostPair(pair, half) => {
                let mut g = lock(pair);
                self.fill_host(
                    match half {
                        Half::First => &mut g.0,
                        Half::Second => &mut g.1,
                    },
                    f,
                )
            }
            _ => {
                let mut v = vec![0f32; n];
                f(&mut v)?;
                self.set_values(v)
            }
        }
    }

    /// [`StateTensor::fill`] on a host vector, checked to hold this tensor.
    fn fill_host(&self, dst: &mut [f32], f: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<()> {
        if dst.len() != self.elem_count() {
            return Err(Error::Usage(format!(
                "{}: {} values held for shape {:?}",
                self.name,
                dst.len(),
                self.shape
            )));
        }
        f(dst)
    }

    /// Replace this rank's values by `values` (f32, row-major, as many as
    /// [`StateTensor::elem_count`]).
    pub fn set_values(&self, values: Vec<f32>) -> Result<()> {
        if values.len() != self.elem_count() {
            return Err(Error::Usage(format!(
                "{}: {} values for a tensor of shape {:?}",
                self.name,
                values.len(),
                self.shape
            )));
        }
        match &self.slot {
            Slot::Var(v) => {
                let t = Tensor::from_vec(values, self.shape.as_slice(), v.device())?;
                v.set(&t)?;
            }
            Slot::Host(v) => lock(v).copy_from_slice(&values),
            Slot::HostPair(pair, half) => {
                let mut g = lock(pair);
                let dst = match half {
                    Half::First => &mut g.0,
                    Half::Second => &mut g.1,
                };
                dst.copy_from_slice(&values);
            }
            Slot::TensorPair(pair, half) => {
                let mut g = lock(pair);
                let dst = match half {
                    Half::First => &mut g.0,
                    Half::Second => &mut g.1,
                };
                *dst = Tensor::from_vec(values, self.shape.as_slice(), dst.device())?;
            }
        }
        Ok(())
    }
}

/// The in-place op behind [`StateTensor::fill`]: `f` on the storage.
struct Fill<F> {
    f: Mutex<Option<F>>,
    result: Mutex<Option<Result<()>>>,
    len: usize,
}

impl<F: FnOnce(&mut [f32]) -> Result<()> + Send> candle_core::InplaceOp1 for Fill<F> {
    fn name(&self) -> &'static str {
        "shardnet-fill"
    }

    fn cpu_fwd(
        &self,
        s: &mut candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let (candle_core::CpuStorage::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
            candle_core::bail!("fill: a contiguous f32 tensor");
        };
        if b - a != self.len {
            candle_core::bail!("fill: {} values for {}", b - a, self.len);
        }
        if let Some(f) = lock(&self.f).take() {
            *lock(&self.result) = Some(f(&mut v[a..b]));
        }
        Ok(())
    }
}
