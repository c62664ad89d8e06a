//! Deferred weight gradients: a backward that computes only what flows to
//! the layer's input now (dL/dx) and keeps the weight-gradient GEMMs for
//! later — the split behind zero-bubble pipeline schedules (the W pass).
//!
//! | pass | what runs | inputs kept until it runs |
//! |------|-----------|---------------------------|
//! | backward inside [`defer_weight_grads`] | dx = g W (each [`Linear`](super::Linear) on the CPU kernels) | g and x of every layer |
//! | [`WeightGrads::run`] | dW (+)= gᵀ x, db (+)= Σ g, in the order recorded | — |
//!
//! Running the deferred work adds exactly what the undeferred backward would
//! have added, with the same GEMM calls: a parameter that receives its
//! micro-batches' contributions in the same order ends bit-identical. On the
//! generic path candle's matmul backward computes dW together with dx, so
//! nothing is deferred there ([`WeightGrads::is_empty`]).
//!
//! ```
//! use candle_core::{Tensor, Var};
//! use shardnet::comm::HOST;
//! use shardnet::nn::{defer_weight_grads, Linear, Param};
//!
//! let w = Param::new("w", &Tensor::new(&[[1f32, 2.], [3., 4.]], &HOST)?)?;
//! let layer = Linear::new(w.clone(), None);
//! let x = Var::new(&[[1f32, 1.]], &HOST)?;
//! let y = layer.forward(x.as_tensor())?;
//! let (grads, work) = defer_weight_grads(|| Ok(y.sum_all()?.backward()?))?;
//! assert_eq!(grads.get(x.as_tensor()).unwrap().to_vec2::<f32>()?, [[4., 6.]]);
//! if shardnet::kernels::fast(&HOST) {
//!     assert!(w.grad().is_none()); // dW waits for the W pass
//! }
//! work.run()?;
//! assert_eq!(w.grad().unwrap().to_vec2::<f32>()?, [[1., 1.], [1., 1.]]);
//! # Ok::<(), shardnet::Error>(())
//! ```

use crate::{Error, Result};
use std::cell::RefCell;

type Work = Box<dyn FnOnce() -> Result<()>>;

thread_local! {
    /// The queue of the [`defer_weight_grads`] running on this thread
    /// (candle's backward calls the layers' backward on the caller's thread).
    static QUEUE: RefCell<Option<Vec<Work>>> = const { RefCell::new(None) };
}

/// The weight-gradient work a deferred backward left, in the order its
/// layers recorded it.
#[must_use = "the weight gradients are added only when the work runs"]
pub struct WeightGrads {
    work: Vec<Work>,
}

impl WeightGrads {
    /// Add every deferred gradient into its parameter.
    pub fn run(self) -> Result<()> {
        for w in self.work {
            w()?;
        }
        Ok(())
    }

    /// Nothing was deferred (no layer on the CPU kernels took part).
    pub fn is_empty(&self) -> bool {
        self.work.is_empty()
    }
}

/// Run `f` (a backward) with the weight-gradient GEMMs of the layers it
/// reaches kept for later; returns `f`'s result and the kept work. Not
/// nested.
pub fn defer_weight_grads<R>(f: impl FnOnce() -> Result<R>) -> Result<(R, WeightGrads)> {
    let nested = QUEUE.with_borrow_mut(|q| {
        if q.is_some() {
            return true;
        }
        *q = Some(Vec::new());
        false
    });
    if nested {
        return Err(Error::Usage(
            "defer_weight_grads inside defer_weight_grads: run the inner backward first".into(),
        ));
    }
    let out = f();
    let work = QUEUE.with_borrow_mut(|q| q.take()).unwrap_or_default();
    Ok((out?, WeightGrads { work }))
}

/// A layer's weight-gradient work: kept when a [`defer_weight_grads`] runs
/// on this thread, else run now.
pub(crate) fn weight_grad(work: impl FnOnce() -> Result<()> + 'static) -> Result<()> {
    let mut work = Some(work);
    QUEUE.with_borrow_mut(|q| {
        if let Some(q) = q.as_mut() {
            if let Some(w) = work.take() {
                q.push(Box::new(w));
            }
        }
    });
    match work {
        Some(w) => w(),
        None => Ok(()),
    }
}

/// Run `f` (a backward) with its weight gradients added now, even inside a
/// [`defer_weight_grads`]: what a layer that hands its gradient on at once
/// (reduce-scattered over replicas) needs.
pub(crate) fn now<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    let queue = QUEUE.with_borrow_mut(|q| q.take());
    let out = f();
    QUEUE.with_borrow_mut(|q| *q = queue);
    out
}
