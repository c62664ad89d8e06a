//! A sharded layer's whole tensors: its weight and bias as one device would
//! hold them, and their gradients, gathered from every rank's shard.
//!
//! | call | every rank passes | root (or every rank, with `None`) gets |
//! |------|-------------------|----------------------------------------|
//! | [`gather_shard`] | its shard, placed by a [`Shard`] | the shards concatenated along its dimension, in offset order |
//! | [`gather_grad`] | its gradient, if any | the same; `None` when no rank has one; an error on every rank, naming the ranks without, when only some have (an empty shard counts as having one) |
//!
//! A tensor without a placement is replicated: root gets its own copy.
//! Collective: every rank of the communicator calls it, with the same root.

use super::{Param, Shard};
use crate::comm::Communicator;
use crate::{Error, Result};
use candle_core::Tensor;

/// A layer's whole weight and bias and their gradients, gathered on one
/// rank (see the module doc). The gradients are `None` where no rank has
/// one (before backward, or after a step consumed them).
#[derive(Clone, Debug)]
pub struct Whole {
    /// The whole weight, as on one device.
    pub weight: Tensor,
    /// The whole bias, if the layer has one.
    pub bias: Option<Tensor>,
    /// The whole weight's gradient.
    pub weight_grad: Option<Tensor>,
    /// The whole bias's gradient.
    pub bias_grad: Option<Tensor>,
}

impl Whole {
    /// Gather `weight` and `bias` (each placed by its own [`Shard`], if
    /// any) and their gradients.
    pub fn gather(
        comm: &Communicator,
        weight: &Param,
        bias: Option<&Param>,
        root: Option<usize>,
    ) -> Result<Option<Whole>> {
        let w = gather_shard(comm, weight.value(), weight.shard(), root)?;
        let wg = gather_grad(
            comm,
            weight.name(),
            weight.grad(),
            weight.value(),
            weight.shard(),
            root,
        )?;
        let (b, bg) = match bias {
            Some(b) => (
                gather_shard(comm, b.value(), b.shard(), root)?,
                gather_grad(comm, b.name(), b.grad(), b.value(), b.shard(), root)?,
            ),
            None => (None, None),
        };
        Ok(w.map(|weight| Whole {
            weight,
            bias: b,
            weight_grad: wg,
            bias_grad: bg,
        }))
    }
}

/// A user's whole bias for a layer of `rows` outputs: (rows) or none;
/// else an error naming `name`.
pub(crate) fn check_bias(name: &str, bias: Option<&Tensor>, rows: usize) -> Result<()> {
    match bias {
        Some(b) if b.dims() != [rows] => Err(Error::Usage(format!(
            "{name}: a whole bias of shape {:?} for a weight of {rows} output rows",
            b.dims()
        ))),
        _ => Ok(()),
    }
}

/// The whole tensor of which every rank passes its shard `t`, placed by
/// `shard` (`None`: replicated, root's own), on rank `root` (`None`: on
/// every rank); `None` on the other ranks.
pub fn gather_shard(
    comm: &Communicator,
    t: &Tensor,
    shard: Option<Shard>,
    root: Option<usize>,
) -> Result<Option<Tensor>> {
    let here = root.is_none_or(|r| r == comm.rank());
    let Some(s) = shard else {
        return Ok(here.then(|| t.clone()));
    };
    if t.dims().get(s.dim).is_none() {
        return Err(Error::Usage(format!(
            "gather: a shard along dimension {} of a tensor of shape {:?}",
            s.dim,
            t.dims()
        )));
    }
    // Along dimension 0, where every rank's part may have its own length.
    let moved = t.transpose(0, s.dim)?.contiguous()?;
    let offsets: Vec<usize> = comm.allgather_obj(&s.offset)?;
    let parts = match root {
        Some(r) => comm.gather(&moved, r)?,
        None => {
            let (all, counts) = comm.allgather_counts(&moved)?;
            let mut at = 0;
            let mut parts = Vec::with_capacity(counts.len());
            for c in counts {
                parts.push(all.narrow(0, at, c)?);
                at += c;
            }
            Some(parts)
        }
    };
    let Some(parts) = parts else {
        return Ok(None);
    };
    let mut order: Vec<usize> = (0..parts.len()).collect();
    order.sort_by_key(|&k| offsets[k]);
    let sorted: Vec<Tensor> = order.into_iter().map(|k| parts[k].clone()).collect();
    let whole = Tensor::cat(&sorted, 0)?.transpose(0, s.dim)?.contiguous()?;
    if whole.dims()[s.dim] != s.global {
        return Err(Error::Usage(format!(
            "gather: the shards cover {} of {} along dimension {}",
            whole.dims()[s.dim],
            s.global,
            s.dim
        )));
    }
    Ok(Some(whole))
}

/// [`gather_shard`] of the gradients `g` of the parameter `name` whose
/// value on this rank is `value`: `None` when no rank has one, an error on
/// every rank when only some have. A rank whose shard has no elements
/// counts as having its (empty) gradient, whatever backward did there.
pub fn gather_grad(
    comm: &Communicator,
    name: &str,
    g: Option<&Tensor>,
    value: &Tensor,
    shard: Option<Shard>,
    root: Option<usize>,
) -> Result<Option<Tensor>> {
    let empty = value.elem_count() == 0;
    // Per rank: Some(has a gradient), None for an empty shard.
    let has: Vec<Option<bool>> = comm.allgather_obj(&(!empty).then_some(g.is_some()))?;
    if has.iter().all(|h| *h != Some(true)) {
        return Ok(None);
    }
    let without: Vec<usize> = (0..has.len()).filter(|&r| has[r] == Some(false)).collect();
    if !without.is_empty() {
        return Err(Error::Usage(format!(
            "gather {name}: rank(s) {without:?} have no gradient while the others do: \
             gather after every rank's backward and before the step"
        )));
    }
    let mine = match g {
        Some(g) => g.clone(),
        None => value.zeros_like()?,
    };
    gather_shard(comm, &mine, shard, root)
}
