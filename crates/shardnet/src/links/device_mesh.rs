//! One model spanning the devices of several ranks, written as one program
//! (Chainer's multi-GPU style: `to_gpu(1)`, `F.copy(x, 1)`), with no
//! communicator in user code.
//!
//! Every rank runs the same program. A value lives on one rank: a
//! [`Placed`] holds it there and nothing elsewhere. [`DeviceMesh::on`]
//! builds a sub-module on a named rank (with that rank's device),
//! [`DeviceMesh::run`] applies it, copying its input there first if it lies
//! elsewhere, [`DeviceMesh::add`] sums two values on the first one's rank,
//! and [`DeviceMesh::backward`] starts backward on every rank. Copies are
//! differentiable sends and receives; the mesh joins each send's delegate
//! into what follows on that rank, so backward reaches every copy.
//! Placements are taken modulo the ranks: the same program runs on one
//! device or on several (the tests compare them).
//!
//! | Chainer (one process, two GPUs) | here |
//! |---|---|
//! | `first1 = MnistMLP(…).to_gpu(1)` | `let first1 = mesh.on(1, \|store\| …)?` |
//! | `x1 = F.copy(x, 1); z1 = first1(x1)` | `let z1 = mesh.run(&first1, &x, \|m, x\| m.forward(x))?` |
//! | `h0 = z0 + F.copy(z1, 0)` | `let h0 = mesh.add(&z0, &z1)?` |
//! | `loss.backward()` | `mesh.backward(&loss)?` |

use crate::functions::{pseudo_connect, recv, send, Context};
use crate::nn::ParamStore;
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::Tensor;
use std::cell::RefCell;

/// A value that lives on one rank of a [`DeviceMesh`]: `Some` there, `None`
/// on every other rank.
#[derive(Clone, Debug)]
pub struct Placed<T> {
    /// The rank holding it.
    pub rank: usize,
    /// The value, on that rank only.
    pub value: Option<T>,
}

impl<T> Placed<T> {
    /// The value on its rank; an error on the others, naming both.
    pub fn get(&self) -> Result<&T> {
        self.value.as_ref().ok_or_else(|| {
            Error::Usage(format!(
                "this value lives on rank {}: use it through the mesh there",
                self.rank
            ))
        })
    }
}

/// The ranks of a communicator seen as the devices of one model (see the
/// module doc).
pub struct DeviceMesh {
    ctx: Context,
    store: ParamStore,
    /// This rank's delegate of its sends not yet joined into what follows.
    pending: RefCell<Option<Tensor>>,
}

impl DeviceMesh {
    /// A mesh over `ctx`'s ranks; parameters go into `store` (this rank's).
    pub fn new(ctx: &Context, store: &ParamStore) -> Self {
        DeviceMesh {
            ctx: ctx.clone(),
            store: store.clone(),
            pending: RefCell::new(None),
        }
    }

    /// The rank placement `place` names (taken modulo the ranks).
    pub fn rank_of(&self, place: usize) -> usize {
        place % self.ctx.size()
    }

    /// Build something on placement `place`: `build` runs on that rank only,
    /// with this rank's parameter store (its device).
    pub fn on<T>(
        &self,
        place: usize,
        build: impl FnOnce(&ParamStore) -> Result<T>,
    ) -> Result<Placed<T>> {
        let rank = self.rank_of(place);
        let value = if rank == self.ctx.rank() {
            Some(build(&self.store)?)
        } else {
            None
        };
        Ok(Placed { rank, value })
    }

    /// A tensor entering the model on placement `place` (the others pass
    /// `None`, or anything: only that rank's is kept).
    pub fn input(&self, place: usize, x: Option<&Tensor>) -> Result<Placed<Tensor>> {
        let rank = self.rank_of(place);
        let value = if rank == self.ctx.rank() {
            Some(
                x.ok_or_else(|| {
                    Error::Usage(format!("DeviceMesh::input: rank {rank} has no input"))
                })?
                .to_device(self.ctx.device())?,
            )
        } else {
            None
        };
        Ok(Placed { rank, value })
    }

    /// `x` copied to placement `place` (Chainer's `F.copy`): a
    /// differentiable send and receive between the two ranks, nothing where
    /// they are the same.
    pub fn copy(&self, x: &Placed<Tensor>, place: usize) -> Result<Placed<Tensor>> {
        let (me, to) = (self.ctx.rank(), self.rank_of(place));
        if x.rank == to {
            return Ok(x.clone());
        }
        let mut value = None;
        if me == x.rank {
            let d = send(x.get()?, &self.ctx, to)?;
            let mut pending = self.pending.borrow_mut();
            *pending = Some(match pending.take() {
                Some(old) => pseudo_connect(&old, &d)?,
                None => d,
            });
        } else if me == to {
            let pending = self.pending.borrow_mut().take();
            value = Some(recv(&self.ctx, x.rank, pending.as_ref())?);
        }
        Ok(Placed { rank: to, value })
    }

    /// `f(module, x)` on the module's rank, `x` copied there first if it
    /// lies elsewhere.
    pub fn run<M>(
        &self,
        module: &Placed<M>,
        x: &Placed<Tensor>,
        f: impl FnOnce(&M, &Tensor) -> Result<Tensor>,
    ) -> Result<Placed<Tensor>> {
        let x = self.copy(x, module.rank)?;
        self.map(&x, |x| f(module.get()?, x))
    }

    /// `f(x)` on `x`'s rank.
    pub fn map(
        &self,
        x: &Placed<Tensor>,
        f: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Placed<Tensor>> {
        let value = match &x.value {
            Some(v) if x.rank == self.ctx.rank() => Some(f(v)?),
            _ => None,
        };
        Ok(Placed {
            rank: x.rank,
            value,
        })
    }

    /// `a + b` on `a`'s rank, `b` copied there first (Chainer's
    /// `a + F.copy(b, a's device)`).
    pub fn add(&self, a: &Placed<Tensor>, b: &Placed<Tensor>) -> Result<Placed<Tensor>> {
        let b = self.copy(b, a.rank)?;
        let value = match (&a.value, &b.value) {
            (Some(a), Some(b)) => Some((a + b)?),
            _ => None,
        };
        Ok(Placed {
            rank: a.rank,
            value,
        })
    }

    /// Backward on every rank: from `loss` where it lives, from this rank's
    /// copies elsewhere. Call on every rank; this rank's gradients, or
    /// `None` on a rank that took no part.
    pub fn backward(&self, loss: &Placed<Tensor>) -> Result<Option<GradStore>> {
        let pending = self.pending.borrow_mut().take();
        let root = match (&loss.value, pending) {
            (Some(l), Some(d)) if loss.rank == self.ctx.rank() => pseudo_connect(&d, l)?,
            (Some(l), None) if loss.rank == self.ctx.rank() => l.clone(),
            (_, Some(d)) => d,
            _ => return Ok(None),
        };
        Ok(Some(root.backward()?))
    }
}
