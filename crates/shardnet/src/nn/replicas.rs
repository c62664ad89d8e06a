//! A layer's weight shared out over data-parallel replicas (ZeRO stages 2
//! and 3, FSDP's design): each replica keeps its chunk
//! ([`chunk_range`](crate::comm::chunk_range)) along one dimension, and so
//! only that chunk's gradient and optimizer state.
//!
//! | when | what moves over the replicas | held whole |
//! |------|------------------------------|------------|
//! | a pass needs the weight ([`ReplicaShares::gather`]) | the shares allgathered | the weight, while the pass runs (`parameters`), or until [`ReplicaShares::forget`] (`gradients`) |
//! | a pass's weight gradient is ready ([`ReplicaShares::scatter_grad`]) | the whole gradient reduce-scattered (summed) | nothing after |
//!
//! Every replica runs every pass, so the gathers and reduce-scatters pair
//! up; the layer that uses this records them on the tape
//! (`functions::communicating`), which orders them the same way on every
//! replica. [`Conv2d`](super::Conv2d) and [`Linear`](super::Linear) use it.

use super::param::Param;
use crate::functions::Context;
use crate::{Error, Result};
use candle_core::Var;
use std::sync::{Arc, Mutex};

/// How a layer's weight is shared out: over the replicas of `dp`, along
/// `dim`.
#[derive(Clone, Debug)]
pub(crate) struct ReplicaShares {
    dp: Context,
    dim: usize,
    /// The whole weight's dimensions.
    whole: Vec<usize>,
    /// With the gradients alone sharded: the whole weight, gathered once
    /// and kept until [`ReplicaShares::forget`].
    kept: Option<Arc<Mutex<Option<Var>>>>,
}

impl ReplicaShares {
    /// Shares over the replicas of `dp` along `dim` of `weight`, the whole
    /// weight of a `kind` layer (`Linear`) sharded `now` or not (an error
    /// if it is); `share` must be this replica's chunk. With `keep_whole`
    /// the weight, once gathered, is kept until [`ReplicaShares::forget`].
    pub(crate) fn new(
        kind: &str,
        now: Option<&ReplicaShares>,
        dp: &Context,
        (weight, share): (&Param, &Param),
        dim: usize,
        keep_whole: bool,
    ) -> Result<Self> {
        let layer = format!("{kind} {}", weight.name());
        if now.is_some() {
            return Err(Error::Usage(format!("{layer}: sharded already")));
        }
        let whole = weight.value().dims();
        let own =
            crate::comm::chunk_range(whole.get(dim).copied().unwrap_or(0), dp.size(), dp.rank());
        let mut want = whole.to_vec();
        if dim < want.len() {
            want[dim] = own.len();
        }
        if dim >= whole.len() || share.value().dims() != want {
            return Err(Error::Usage(format!(
                "{layer}: a share of shape {:?}, expected {want:?} (chunk {} of {} along \
                 dimension {dim} of {whole:?})",
                share.value().dims(),
                dp.rank(),
                dp.size()
            )));
        }
        Ok(ReplicaShares {
            dp: dp.clone(),
            dim,
            whole: whole.to_vec(),
            kept: keep_whole.then(Default::default),
        })
    }

    /// The replicas (the context the layer records its passes on).
    pub(crate) fn dp(&self) -> &Context {
        &self.dp
    }

    /// The dimension the weight is shared out along.
    pub(crate) fn dim(&self) -> usize {
        self.dim
    }

    /// The whole weight from `share`: gathered now, or the one kept since
    /// the last [`ReplicaShares::forget`]. Collective over the replicas
    /// whenever it gathers.
    pub(crate) fn gather(&self, share: &Param) -> Result<Var> {
        let gather = || -> Result<Var> {
            if let Some(w) = self.gather_rows(share)? {
                return Ok(w);
            }
            let whole = crate::functions::allgather_along(&self.dp, share.value(), self.dim)?;
            // A copy (candle's variables own their storage).
            Ok(Var::from_tensor(&whole)?)
        };
        match &self.kept {
            Some(kept) => {
                let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
                match &*kept {
                    Some(w) => Ok(w.clone()),
                    None => {
                        // Kept from pass to pass: a parameter, not a step's buffer.
                        let _held = crate::heap::counting_as(crate::heap::Part::Parameters);
                        Ok(kept.insert(gather()?).clone())
                    }
                }
            }
            None => gather(),
        }
    }

    /// An f32 host weight shared out by rows (along dimension 0), gathered
    /// in place into the buffer that becomes the whole weight's variable:
    /// the whole weight is allocated once, not gathered and then copied.
    /// `None` for other weights.
    fn gather_rows(&self, share: &Param) -> Result<Option<Var>> {
        let v = share.value();
        let Some(unit) = self.host_rows(v) else {
            return Ok(None);
        };
        let len = unit * self.whole.first().copied().unwrap_or(0);
        let own = crate::comm::row_share(len, unit, self.dp.size(), self.dp.rank());
        let mut buf = vec![0f32; len];
        crate::kernels::with_f32s(&v.contiguous()?, "a weight's share", |mine| {
            buf[own].copy_from_slice(mine);
            Ok::<_, candle_core::Error>(())
        })?;
        self.dp.allgather_slices(&mut [&mut buf[..]], &[unit])?;
        Ok(Some(Var::from_vec(buf, self.whole.clone(), v.device())?))
    }

    /// The elements per row of a weight shared out by rows (along
    /// dimension 0) whose values (like `t`) are f32 on the host, which the
    /// in-place collectives move; `None` for any other.
    fn host_rows(&self, t: &candle_core::Tensor) -> Option<usize> {
        let unit: usize = self.whole.iter().skip(1).product();
        let host = t.dtype() == candle_core::DType::F32 && t.device().is_cpu();
        (self.dim == 0 && unit > 0 && host).then_some(unit)
    }

    /// Drop a kept whole weight: the next pass gathers the shares again
    /// (after a step, or a checkpoint restored). Nothing when none is kept.
    pub(crate) fn forget(&self) {
        if let Some(kept) = &self.kept {
            *kept.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    /// The gradient `whole` (a gathered weight's parameter) received,
    /// summed over the replicas and each replica's chunk added into
    /// `share`'s. Every replica calls it, whatever its backward reached
    /// (zeros where it reached nothing). Collective over the replicas.
    pub(crate) fn scatter_grad(&self, whole: &Param, share: &Param) -> Result<()> {
        if let Some(unit) = self.host_rows(whole.value()) {
            // Every replica takes this path (a collective): zeros where its
            // backward reached nothing (a replica without rows, on candle's
            // ops).
            if whole.grad().is_none() {
                whole.set_grad(&whole.value().zeros_like()?)?;
            }
            // In place in the whole gradient's buffer, the rows of this
            // replica then added into the share's.
            let own = crate::comm::row_share(
                whole.value().elem_count(),
                unit,
                self.dp.size(),
                self.dp.rank(),
            );
            let dp = &self.dp;
            whole.update_grad(|dw, _| {
                dp.reduce_scatter_slices(&mut [dw], &[unit], crate::ReduceOp::Sum)?;
                let mine = &dw[own];
                share.update_grad(|s, empty| {
                    if empty {
                        s.copy_from_slice(mine);
                    } else {
                        s.iter_mut().zip(mine).for_each(|(a, b)| *a += *b);
                    }
                    Ok(())
                })
            })?;
            // The whole gradient goes with its parameter.
            let _ = whole.take_grad();
            return Ok(());
        }
        let dw = match whole.take_grad() {
            Some(dw) => dw,
            None => whole.value().zeros_like()?,
        };
        let mine =
            crate::functions::reduce_scatter_along(&self.dp, &dw, crate::ReduceOp::Sum, self.dim)?;
        share.add_grad(&mine)
    }
}
