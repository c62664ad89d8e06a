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
//! the number of ranks — the mistake of a published implementation of the
//! sharded head's scheme, which `tests/face_head.rs` shows.
//!
//! [`LossScaler`]: dynamic loss scaling for half-precision gradients.

use super::Optimizer;
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

/// One data-parallel step of `opt`, whose state is sharded over the
/// replicas `comm` joins ([`Optimizer::shard_state`]`(comm.size(),
/// comm.rank())` before the first step): the gradients of every parameter
/// are reduce-scattered with `op` (each rank gets the combination of its
/// rows; a parameter that stays whole is allreduced), `opt` updates this
/// rank's rows, and every rank's rows are allgathered into every rank's
/// parameters. The parameters come out the same bits as with
/// [`allreduce_grads`] and a step of an unsharded optimizer (the sums are
/// combined in the same order, and the update is element by element), while
/// each rank reads and writes a 1 / `comm.size()` share of the state and
/// keeps only that. Collective over `comm`.
///
/// ```
/// use candle_core::{DType, Tensor};
/// use shardnet::comm::{launch, ReduceOp};
/// use shardnet::nn::Param;
/// use shardnet::optim::{sharded_step, Adam, Optimizer};
///
/// let values = launch(2, |comm| {
///     let w = Param::new("w", &Tensor::ones((4, 3), DType::F32, comm.device())?)?;
///     let mut opt = Optimizer::Adam(Adam::new(vec![w.clone()], 0.1)?);
///     opt.shard_state(comm.size(), comm.rank())?;
///     // Each rank's own gradient; the step uses their sum.
///     w.set_grad(&Tensor::full(comm.rank() as f32 + 1.0, (4, 3), comm.device())?)?;
///     sharded_step(&comm, &mut opt, ReduceOp::Sum)?;
///     Ok(w.value().to_vec2::<f32>()?)
/// })?;
/// assert_eq!(values[0], values[1]);
/// assert!((values[0][3][2] - 0.9).abs() < 1e-6);
/// # Ok::<(), shardnet::Error>(())
/// ```
pub fn sharded_step(comm: &Communicator, opt: &mut Optimizer, op: ReduceOp) -> Result<()> {
    reduce_scatter_grads(comm, opt, op)?;
    opt.step()?;
    allgather_params(comm, opt)
}

/// The first third of [`sharded_step`]: every parameter's gradient
/// reduce-scattered with `op` over the replicas `comm` joins (each rank
/// gets the combination of the rows its sharded state updates; a parameter
/// that stays whole is allreduced). Between it and [`Optimizer::step`] a
/// caller may read or scale the gradients of its rows (a global norm's
/// clip: [`Optimizer::shares`] says which). Collective over `comm`.
pub fn reduce_scatter_grads(comm: &Communicator, opt: &Optimizer, op: ReduceOp) -> Result<()> {
    let rows = ShardedRows::of(comm, opt)?;
    let Some(first) = opt.params().first() else {
        return Ok(());
    };
    let split: Vec<&Param> = rows.split.iter().map(|(p, _)| p).collect();
    if crate::kernels::fast(first.value().device()) {
        if let Some(p) = split
            .iter()
            .copied()
            .chain(rows.whole.iter())
            .find(|p| p.grad().is_none())
        {
            return Err(missing(comm, p));
        }
        let mut reduce =
            |bufs: &mut [&mut [f32]]| comm.reduce_scatter_slices(bufs, &rows.units, op);
        with_grads(&split, Vec::new(), &mut reduce)?;
        if !rows.whole.is_empty() {
            let whole: Vec<&Param> = rows.whole.iter().collect();
            let mut reduce = |bufs: &mut [&mut [f32]]| comm.allreduce_slices(bufs, op);
            with_grads(&whole, Vec::new(), &mut reduce)?;
        }
        Ok(())
    } else {
        let all: Vec<Param> = split
            .iter()
            .map(|p| (*p).clone())
            .chain(rows.whole.iter().cloned())
            .collect();
        allreduce_grads_generic(comm, &all, op)
    }
}

/// The last third of [`sharded_step`]: every rank's updated rows of each
/// sharded parameter, to every rank of `comm`. Collective over `comm`.
pub fn allgather_params(comm: &Communicator, opt: &Optimizer) -> Result<()> {
    let rows = ShardedRows::of(comm, opt)?;
    let Some(first) = opt.params().first() else {
        return Ok(());
    };
    if crate::kernels::fast(first.value().device()) {
        let split: Vec<&Param> = rows.split.iter().map(|(p, _)| p).collect();
        let mut gather = |bufs: &mut [&mut [f32]]| comm.allgather_slices(bufs, &rows.units);
        with_bufs(&split, Buffer::Value, Vec::new(), &mut gather)
    } else {
        let split: Vec<(&Param, usize)> = rows.split.iter().map(|(p, r)| (p, *r)).collect();
        allgather_rows_generic(comm, &split)
    }
}

/// An optimizer's parameters as a sharded step moves them: those whose
/// state is sharded by rows (with their rows), those that stay whole, and
/// the elements per row of each sharded one.
struct ShardedRows {
    split: Vec<(Param, usize)>,
    whole: Vec<Param>,
    units: Vec<usize>,
}

impl ShardedRows {
    /// `opt`'s, checked against `comm`: a state sharded for another group
    /// would update rows nobody sends.
    fn of(comm: &Communicator, opt: &Optimizer) -> Result<Self> {
        let (n, me) = (comm.size(), comm.rank());
        let mut split = Vec::new();
        let mut whole = Vec::new();
        for (p, share) in opt.params().iter().zip(opt.shares()) {
            if p.value().elem_count() == 0 {
                continue;
            }
            match share {
                Some(rows) => {
                    let all = p.value().dims()[0];
                    if *rows != crate::comm::chunk_range(all, n, me) {
                        return Err(Error::Usage(format!(
                            "sharded_step on rank {me} of {n}: {}'s state holds rows {rows:?} \
                             of {all}, not this rank's share (call shard_state({n}, {me}) for \
                             this communicator)",
                            p.name()
                        )));
                    }
                    split.push((p.clone(), all));
                }
                None => whole.push(p.clone()),
            }
        }
        let units = split
            .iter()
            .map(|(p, rows)| p.value().elem_count() / rows)
            .collect();
        Ok(ShardedRows {
            split,
            whole,
            units,
        })
    }
}

/// The rows of each of `params` (with its number of rows) that every rank
/// updated, to every rank, in tensor ops on the parameters' device.
fn allgather_rows_generic(comm: &Communicator, params: &[(&Param, usize)]) -> Result<()> {
    let (n, me) = (comm.size(), comm.rank());
    let mine = params
        .iter()
        .map(|(p, rows)| {
            let r = crate::comm::chunk_range(*rows, n, me);
            Ok(p.value().narrow(0, r.start, r.len())?.flatten_all()?)
        })
        .collect::<Result<Vec<_>>>()?;
    if mine.is_empty() {
        return Ok(());
    }
    let (all, _) = comm.allgather_counts(&joined(&mine)?)?;
    let mut pieces: Vec<Vec<Tensor>> = vec![Vec::with_capacity(n); params.len()];
    let mut at = 0;
    for r in 0..n {
        for ((p, rows), out) in params.iter().zip(pieces.iter_mut()) {
            let mut shape = p.value().dims().to_vec();
            shape[0] = crate::comm::chunk_range(*rows, n, r).len();
            let len: usize = shape.iter().product();
            out.push(all.narrow(0, at, len)?.reshape(shape)?);
            at += len;
        }
    }
    for ((p, _), rows) in params.iter().zip(&pieces) {
        p.var().set(&Tensor::cat(rows, 0)?)?;
    }
    Ok(())
}

/// `ts` (flattened) in one new tensor. candle's `cat` of one tensor
/// returns it as it is: here a view of a parameter's own buffer, which
/// thread ranks hand each other without a copy. A rank that finished the
/// collective first would then overwrite it (its new gradient or value)
/// while another still reads it.
fn joined(ts: &[Tensor]) -> Result<Tensor> {
    Ok(match ts {
        [one] => one.copy()?,
        _ => Tensor::cat(ts, 0)?,
    })
}

/// Which of a parameter's buffers [`with_bufs`] lends.
#[derive(Clone, Copy)]
enum Buffer {
    Grad,
    Value,
}

/// Run `f` on the gradient buffers of `params` (each non-empty, with a
/// gradient), all borrowed at once, after `held`.
fn with_grads<'a>(
    params: &[&Param],
    held: Vec<&'a mut [f32]>,
    f: &mut (dyn FnMut(&mut [&mut [f32]]) -> Result<()> + Send),
) -> Result<()> {
    with_bufs(params, Buffer::Grad, held, f)
}

/// Run `f` on the `which` buffers of `params` (each non-empty; with a
/// gradient for [`Buffer::Grad`]), all borrowed at once, after `held`.
fn with_bufs<'a>(
    params: &[&Param],
    which: Buffer,
    held: Vec<&'a mut [f32]>,
    f: &mut (dyn FnMut(&mut [&mut [f32]]) -> Result<()> + Send),
) -> Result<()> {
    let Some((p, rest)) = params.split_first() else {
        let mut held = held;
        return f(&mut held);
    };
    let mut ran = false;
    let go = |b: &mut [f32]| {
        ran = true;
        let mut h: Vec<&mut [f32]> = held.into_iter().map(|b| b as &mut [f32]).collect();
        h.push(b);
        with_bufs(rest, which, h, f)
    };
    match which {
        Buffer::Grad => p.update_grad(|g, _| go(g))?,
        Buffer::Value => p.update_value(go)?,
    }
    if ran {
        Ok(())
    } else {
        let what = match which {
            Buffer::Grad => "gradient",
            Buffer::Value => "value",
        };
        Err(Error::Usage(format!(
            "data-parallel step: {} has no f32 host {what} buffer",
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
    let sum = comm.allreduce(&joined(&flat)?, op)?;
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
