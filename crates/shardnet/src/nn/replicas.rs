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
//! A layer may move its weight in rounds instead ([`ReplicaShares::rounds`],
//! `Linear`'s fully sharded weights shared out by rows): round t gathers a
//! block of rows, a piece of every replica's share, and reduce-scatters
//! that block's gradient, so a pass holds one block of the weight and one
//! of its gradient at a time, not the whole of either.
//!
//! Every replica runs every pass, so the gathers and reduce-scatters pair
//! up; the layer that uses this records them on the tape
//! (`functions::communicating`), which orders them the same way on every
//! replica. [`Conv2d`](super::Conv2d) and [`Linear`](super::Linear) use it.

use super::param::Param;
use crate::functions::Context;
use crate::{Error, Result};
use candle_core::Var;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// The most bytes of a weight a fully sharded pass gathers at a time by
/// default ([`Linear::with_gather_block`](super::Linear::with_gather_block)):
/// 8 MiB, a 2048 × 1024 block of f32, large enough for the GEMMs on a
/// block to run near the whole layer's speed.
pub const BLOCK_BYTES: usize = 8 << 20;

/// One round of a weight moved in blocks of rows ([`ReplicaShares::rounds`]):
/// a piece of each replica's share, replica by replica.
#[derive(Clone, Debug)]
pub(crate) struct Round {
    /// The whole weight's rows (along dimension 0) of each replica's
    /// piece, in replica order: the block's rows in this order.
    pub(crate) pieces: Vec<Range<usize>>,
    /// This replica's piece, as rows of its share.
    own: Range<usize>,
}

impl Round {
    /// The block's rows.
    pub(crate) fn rows(&self) -> usize {
        self.pieces.iter().map(|p| p.len()).sum()
    }

    /// Where replica `r`'s piece starts among the block's rows.
    pub(crate) fn offset(&self, r: usize) -> usize {
        self.pieces[..r].iter().map(|p| p.len()).sum()
    }
}

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
    /// The most bytes a pass gathers at a time ([`ReplicaShares::rounds`]).
    block: usize,
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
            block: BLOCK_BYTES,
        })
    }

    /// Gather at most `bytes` of the weight at a time where the layer moves
    /// it in rounds ([`ReplicaShares::rounds`]); 0: the whole weight at once.
    pub(crate) fn with_block(mut self, bytes: usize) -> Self {
        self.block = bytes;
        self
    }

    /// The whole weight's dimensions.
    pub(crate) fn whole(&self) -> &[usize] {
        &self.whole
    }

    /// The rounds that move this weight in blocks of at most the block's
    /// bytes ([`ReplicaShares::with_block`]): round t holds rows
    /// `chunk_range(n, rounds, t)` of each replica's share of n rows. `None`
    /// where it moves whole: a weight that fits one block, one kept whole
    /// (`gradients`), or one the in-place collectives do not move (not
    /// shared out by rows, not f32 on the host).
    pub(crate) fn rounds(&self, share: &Param) -> Option<Vec<Round>> {
        let unit = self.host_rows(share.value())?;
        let rows = self.whole.first().copied().unwrap_or(0);
        let bytes = rows * unit * std::mem::size_of::<f32>();
        let widest = crate::comm::chunk_range(rows, self.dp.size(), 0).len();
        let n = bytes.div_ceil(self.block.max(1)).min(widest);
        if self.kept.is_some() || self.block == 0 || n < 2 {
            return None;
        }
        Some((0..n).map(|t| self.round(t, n)).collect())
    }

    /// Round `t` of `n` (`n` = 1: the whole weight).
    fn round(&self, t: usize, n: usize) -> Round {
        let (size, me) = (self.dp.size(), self.dp.rank());
        let rows = self.whole.first().copied().unwrap_or(0);
        let piece = |r: usize| {
            let share = crate::comm::chunk_range(rows, size, r);
            let within = crate::comm::chunk_range(share.len(), n, t);
            (share.start + within.start..share.start + within.end, within)
        };
        Round {
            pieces: (0..size).map(|r| piece(r).0).collect(),
            own: piece(me).1,
        }
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
        if self.host_rows(share.value()).is_none() {
            return Ok(None);
        }
        self.gather_round(share, &self.round(0, 1)).map(Some)
    }

    /// The block of `round` (its rows, replica by replica), gathered in
    /// place into the buffer that becomes its variable. Collective over the
    /// replicas; for an f32 host weight shared out by rows.
    pub(crate) fn gather_round(&self, share: &Param, round: &Round) -> Result<Var> {
        let v = share.value();
        let unit = self.rows_unit(v)?;
        let len = unit * round.rows();
        let own = self.own_in_block(round, unit)?;
        let mut buf = vec![0f32; len];
        crate::kernels::with_f32s(&v.contiguous()?, "a weight's share", |mine| {
            buf[own].copy_from_slice(&mine[round.own.start * unit..round.own.end * unit]);
            Ok::<_, candle_core::Error>(())
        })?;
        self.dp.allgather_slices(&mut [&mut buf[..]], &[unit])?;
        let mut dims = self.whole.clone();
        dims[0] = round.rows();
        Ok(Var::from_vec(buf, dims, v.device())?)
    }

    /// The elements per row of `t`, an f32 host weight shared out by rows;
    /// an error for any other (a bug: its layer checked [`Self::rounds`]).
    fn rows_unit(&self, t: &candle_core::Tensor) -> Result<usize> {
        self.host_rows(t).ok_or_else(|| {
            Error::Usage("a weight moved in blocks that is not f32 rows on the host; a bug".into())
        })
    }

    /// This replica's piece of `round` as elements of its block: where the
    /// in-place collectives put its rows (checked to be its piece).
    fn own_in_block(&self, round: &Round, unit: usize) -> Result<Range<usize>> {
        let me = self.dp.rank();
        let own = crate::comm::row_share(round.rows() * unit, unit, self.dp.size(), me);
        let start = round.offset(me) * unit;
        if own != (start..start + round.own.len() * unit) {
            return Err(Error::Usage(format!(
                "replica {me}: its piece of a block is not its share of the block's rows; a bug"
            )));
        }
        Ok(own)
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
        if self.host_rows(whole.value()).is_some() {
            return self.scatter_round_grad(whole, &self.round(0, 1), share);
        }
        let dw = match whole.take_grad() {
            Some(dw) => dw,
            None => whole.value().zeros_like()?,
        };
        let mine =
            crate::functions::reduce_scatter_along(&self.dp, &dw, crate::ReduceOp::Sum, self.dim)?;
        share.add_grad(&mine)
    }

    /// The gradient `block` (the weight of `round`'s block) received,
    /// summed over the replicas in place in its buffer, and this replica's
    /// rows of it added into `share`'s. Every replica calls it, whatever its
    /// backward reached (zeros where it reached nothing). Collective over
    /// the replicas; for an f32 host weight shared out by rows.
    pub(crate) fn scatter_round_grad(
        &self,
        block: &Param,
        round: &Round,
        share: &Param,
    ) -> Result<()> {
        let unit = self.rows_unit(block.value())?;
        let own = self.own_in_block(round, unit)?;
        if block.grad().is_none() {
            block.set_grad(&block.value().zeros_like()?)?;
        }
        let into = round.own.start * unit..round.own.end * unit;
        let dp = &self.dp;
        block.update_grad(|dw, _| {
            dp.reduce_scatter_slices(&mut [dw], &[unit], crate::ReduceOp::Sum)?;
            let mine = &dw[own];
            share.update_grad(|s, empty| {
                if empty {
                    // The rest of the share's gradient comes in other rounds.
                    s[..into.start].fill(0.0);
                    s[into.end..].fill(0.0);
                    s[into].copy_from_slice(mine);
                } else {
                    s[into].iter_mut().zip(mine).for_each(|(a, b)| *a += *b);
                }
                Ok(())
            })
        })?;
        // The block's gradient goes with its parameter.
        let _ = block.take_grad();
        Ok(())
    }
}
