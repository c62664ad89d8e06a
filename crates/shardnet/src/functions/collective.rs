//! Differentiable collectives: each forward with the backward that mirrors it.
//!
//! The ops that concatenate or split (`allgather`, `reduce_scatter`,
//! `gather`, `scatter`, `alltoall`) work along a dimension `dim` (the table
//! says "rows" for it): 0 for batches, 1 for the channels of a convolution's
//! (N, C, H, W), the last for a tensor-parallel linear's features. Along
//! `dim` ≠ 0 the op runs on the tensor with `dim` moved to the front (one
//! transposing copy before, one after; their backward is candle's), except
//! the allgathers, whose blocks travel flat and are put in place by one
//! concatenation along `dim`. With n ranks, rank r's input x_r of b_r
//! bytes, and B = Σ b_r:
//!
//! | op | forward | backward (dL/dx_r) | bytes per rank, fwd / bwd |
//! |----|---------|--------------------|---------------------------|
//! | [`allgather`] | y = cat(x_0..x_n) | Σ_s rows r of dL_s/dy (reduce-scatter) | B−b_r / ≈B·(n−1)/n |
//! | [`allgather_replicated`] | same | rows r of dL/dy (split) | B−b_r / 0 |
//! | [`allreduce`] sum, mean | y = Σ x_s (÷ n) | Σ_s dL_s/dy (÷ n) (allreduce) | ≈2b(n−1)/n each |
//! | [`allreduce_replicated`] | same | dL/dy (÷ n) | ≈2b(n−1)/n / 0 |
//! | [`copy_to_shards`] | y = x (replicated) | Σ_s dL_s/dy (allreduce) | 0 / ≈2b(n−1)/n |
//! | [`split_to_shards`] | y_r = chunk r of x (replicated) | cat_s dL/dy_s (allgather) | 0 / ≈b(n−1)/n |
//! | [`reduce_scatter`] | y_r = chunk r of Σ x_s | cat_s dL_s/dy_s (allgather) | ≈b(n−1)/n each |
//! | [`reduce_scatter_of`] | y_r = chunk r of Σ f(x_s), f's output kept nowhere | f's backward of cat_s dL_s/dy_s | ≈f(x)(n−1)/n each |
//! | [`bcast`] | y = x_root | root: Σ_s dL_s/dy (gather + sum) | root sends b(n−1) / receives b(n−1) |
//! | [`bcast_replicated`] | same | root: dL/dy | root sends b(n−1) / 0 |
//! | [`gather`] | root: cat(x_0..x_n), others: 0 rows | scatter of dL/dy | root receives B−b_root / sends it |
//! | [`scatter`] | y_r = chunk r of x_root | gather of dL_s/dy_s to root | mirror of gather |
//! | [`alltoall`] | y_r = cat_s (piece r of x_s) | alltoall of dL/dy back | what leaves x_r, each way |
//!
//! **Which form.** After an op whose output is the same on every rank
//! (allgather, allreduce, bcast), the right backward depends on what follows.
//! If each rank computes its own loss from it (the total loss is the sum of
//! the ranks' losses, e.g. each rank owns part of a sharded head), use the
//! plain name: backward sums the ranks' gradients. If every rank computes the
//! *same* loss from it (the computation after the op is replicated, and the
//! loss counts once), use the `_replicated` form: backward takes this rank's
//! part without communication. Using the plain form on a replicated loss
//! multiplies gradients by n; using the replicated form on distinct losses
//! drops the other ranks' contributions. The tests check both failures.

use super::tape::{backward, record, Context, Op};
use crate::comm::{chunk_offsets, chunk_sizes, fold, split_rows, ReduceOp};
use crate::{Error, Result};
use candle_core::Tensor;

fn op<'a>(ctx: &'a Context, name: &'static str, x: Option<&'a Tensor>) -> Op<'a> {
    Op {
        ctx,
        name,
        x,
        delegate: None,
    }
}

fn need(x: Option<&Tensor>) -> Result<&Tensor> {
    x.ok_or_else(|| Error::Usage("a collective lost its input".into()))
}

fn rows(name: &str, x: &Tensor) -> Result<usize> {
    x.dims().first().copied().ok_or_else(|| {
        Error::Usage(format!(
            "{name}: needs a tensor of at least one dimension (rows are dimension 0)"
        ))
    })
}

/// Run `f`, an op along dimension 0, along `dim` of `x`: `dim` moved to the
/// front before, and back after.
fn along(
    name: &str,
    x: Option<&Tensor>,
    dim: usize,
    f: impl FnOnce(Option<&Tensor>) -> Result<Tensor>,
) -> Result<Tensor> {
    if let Some(x) = x {
        if dim >= x.rank() {
            return Err(Error::Usage(format!(
                "{name}: dimension {dim} is out of range for a tensor of shape {:?}",
                x.dims()
            )));
        }
    }
    if dim == 0 {
        return f(x);
    }
    let moved = x.map(|x| x.transpose(0, dim)?.contiguous()).transpose()?;
    Ok(f(moved.as_ref())?.transpose(0, dim)?.contiguous()?)
}

/// Every rank's `x`, concatenated along `dim`; backward gives each rank
/// the sum over ranks of the gradient of its own rows (slices along `dim`) (a reduce-scatter).
/// For a loss computed identically on every rank, use [`allgather_replicated`].
pub fn allgather(ctx: &Context, x: &Tensor, dim: usize) -> Result<Tensor> {
    if let Some(y) = allgather_inner_dim(ctx, x, dim, false)? {
        return Ok(y);
    }
    along("allgather", Some(x), dim, |x| {
        allgather_with(ctx, need(x)?, false)
    })
}

/// Like [`allgather`], for when every rank then computes the same loss:
/// backward is this rank's rows of the gradient, with no communication.
pub fn allgather_replicated(ctx: &Context, x: &Tensor, dim: usize) -> Result<Tensor> {
    if let Some(y) = allgather_inner_dim(ctx, x, dim, true)? {
        return Ok(y);
    }
    along("allgather_replicated", Some(x), dim, |x| {
        allgather_with(ctx, need(x)?, true)
    })
}

/// Allgather along `dim` ≠ 0 without moving it to the front: each rank's
/// block travels flat, and one concatenation along `dim` puts the blocks in
/// place (two passes over y instead of four). Backward: this rank's block
/// of dL/dy (replicated), or every rank's view of this rank's block summed
/// (an alltoall of the blocks, then a fold in rank order). `None` where the
/// blocks' sizes along `dim` cannot be told from their element counts (a
/// zero-sized other dimension): the caller takes the general path, as
/// every rank does (the other dimensions agree across ranks).
fn allgather_inner_dim(
    ctx: &Context,
    x: &Tensor,
    dim: usize,
    replicated: bool,
) -> Result<Option<Tensor>> {
    let dims = x.dims().to_vec();
    if dim == 0 || dim >= dims.len() {
        return Ok(None);
    }
    let other: usize = dims
        .iter()
        .enumerate()
        .filter(|(k, _)| *k != dim)
        .map(|(_, d)| *d)
        .product();
    if other == 0 {
        return Ok(None);
    }
    let name = if replicated {
        "allgather_replicated"
    } else {
        "allgather"
    };
    // The flat blocks carry no shape: the ranks compare the other
    // dimensions first (one small collective), as the general path's
    // descriptor check would, so a mismatch is an error, never a wrong
    // reshape.
    let mine: Vec<usize> = dims
        .iter()
        .enumerate()
        .map(|(k, d)| if k == dim { usize::MAX } else { *d })
        .collect();
    let all_dims = ctx.comm().allgather_obj(&mine)?;
    if all_dims.iter().any(|d| d != &mine) {
        let details = all_dims
            .iter()
            .enumerate()
            .map(|(r, d)| {
                let shown: Vec<String> = d
                    .iter()
                    .map(|v| {
                        if *v == usize::MAX {
                            "·".into()
                        } else {
                            v.to_string()
                        }
                    })
                    .collect();
                format!("  rank {r}: ({}) along dimension {dim}", shown.join(", "))
            })
            .collect::<Vec<_>>()
            .join("\n");
        return Err(Error::Mismatch {
            op: name.into(),
            details,
        });
    }
    let c = ctx.clone();
    record(op(ctx, name, Some(x)), || {
        let flat = x.contiguous()?.flatten_all()?;
        let (all, counts) = ctx.allgather_counts(&flat)?;
        let sizes: Vec<usize> = counts.iter().map(|n| n / other).collect();
        let blocks = counts
            .iter()
            .zip(chunk_offsets(&counts))
            .zip(&sizes)
            .map(|((n, at), size)| {
                let mut shape = dims.clone();
                shape[dim] = *size;
                Ok(all.narrow(0, at, *n)?.reshape(shape)?)
            })
            .collect::<Result<Vec<_>>>()?;
        let y = Tensor::cat(&blocks, dim)?;
        let rank = c.rank();
        let offsets = chunk_offsets(&sizes);
        Ok((
            y,
            backward(move |g| {
                let block = |s: usize| -> Result<Tensor> {
                    Ok(g.narrow(dim, offsets[s], sizes[s])?.contiguous()?)
                };
                if replicated {
                    // Mirror: this rank's block; the loss counted once.
                    return Ok(Some(block(rank)?));
                }
                // Mirror: every rank's gradient of this rank's block, summed.
                let mine = c.alltoall(&(0..sizes.len()).map(block).collect::<Result<Vec<_>>>()?)?;
                Ok(Some(fold(&mine, ReduceOp::Sum)?))
            }),
        ))
    })
    .map(Some)
}

fn allgather_with(ctx: &Context, x: &Tensor, replicated: bool) -> Result<Tensor> {
    let name = if replicated {
        "allgather_replicated"
    } else {
        "allgather"
    };
    rows(name, x)?;
    let c = ctx.clone();
    record(op(ctx, name, Some(x)), || {
        let (y, counts) = ctx.allgather_counts(x)?;
        let (rank, total) = (ctx.rank(), counts.iter().sum::<usize>());
        let offset = counts[..rank].iter().sum::<usize>();
        Ok((
            y,
            backward(move |g| {
                if replicated {
                    // Mirror: this rank's rows; the loss counted once.
                    return Ok(Some(g.narrow(0, offset, counts[rank])?));
                }
                // Mirror: reduce-scatter of the gradient by the forward's counts.
                if counts == chunk_sizes(total, c.size()) {
                    return Ok(Some(c.reduce_scatter(g, ReduceOp::Sum)?));
                }
                let mine = c.alltoall(&split_rows(g, &counts)?)?;
                Ok(Some(fold(&mine, ReduceOp::Sum)?))
            }),
        ))
    })
}

fn differentiable_reduce(name: &str, op: ReduceOp) -> Result<()> {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => Ok(()),
        other => Err(Error::Usage(format!(
            "{name}: '{}' has no gradient here; use sum or mean, or communicate a detached \
             tensor with Communicator::{name}",
            other.name()
        ))),
    }
}

/// Sum (or mean) over ranks, on every rank; backward is the allreduce of the
/// ranks' gradients. For a loss computed identically on every rank, use
/// [`allreduce_replicated`].
pub fn allreduce(ctx: &Context, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
    allreduce_with(ctx, x, op, false)
}

/// Like [`allreduce`], for when every rank then computes the same loss:
/// backward is dL/dy itself (÷ n for mean), with no communication.
pub fn allreduce_replicated(ctx: &Context, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
    allreduce_with(ctx, x, op, true)
}

fn allreduce_with(ctx: &Context, x: &Tensor, reduce: ReduceOp, replicated: bool) -> Result<Tensor> {
    let name = if replicated {
        "allreduce_replicated"
    } else {
        "allreduce"
    };
    differentiable_reduce(name, reduce)?;
    let c = ctx.clone();
    record(op(ctx, name, Some(x)), || {
        let y = ctx.allreduce(x, reduce)?;
        let n = ctx.size() as f64;
        Ok((
            y,
            backward(move |g| {
                Ok(Some(match (replicated, reduce) {
                    // Mirror: the same reduction of the gradients.
                    (false, _) => c.allreduce(g, reduce)?,
                    (true, ReduceOp::Mean) => (g / n)?,
                    (true, _) => g.clone(),
                }))
            }),
        ))
    })
}

/// `x` itself, entering a layer sharded over the ranks (a sharded head): the
/// input is replicated (the same on every rank), each rank's shard sends back
/// its share of the gradient, and backward sums the shares (allreduce). The
/// mirror of [`allreduce_replicated`]; Megatron's copy-to-region.
pub fn copy_to_shards(ctx: &Context, x: &Tensor) -> Result<Tensor> {
    let c = ctx.clone();
    record(op(ctx, "copy_to_shards", Some(x)), || {
        Ok((
            x.clone(),
            backward(move |g| Ok(Some(c.allreduce(g, ReduceOp::Sum)?))),
        ))
    })
}

/// This rank's chunk of `x` along `dim` ([`chunk_sizes`]), for a layer
/// sharded over the ranks whose input is replicated but which takes only
/// its slice (a row-parallel linear's features); backward allgathers the
/// chunks' gradients, so every rank has dL/dx whole. Megatron's
/// scatter-to-region; the mirror of [`allgather_replicated`].
pub fn split_to_shards(ctx: &Context, x: &Tensor, dim: usize) -> Result<Tensor> {
    along("split_to_shards", Some(x), dim, |x| {
        let x = need(x)?;
        let rows = rows("split_to_shards", x)?;
        let mine = crate::comm::chunk_range(rows, ctx.size(), ctx.rank());
        let c = ctx.clone();
        record(op(ctx, "split_to_shards", Some(x)), || {
            Ok((
                x.narrow(0, mine.start, mine.len())?.contiguous()?,
                // Mirror: every rank's chunk of the gradient, concatenated.
                backward(move |g| Ok(Some(c.allgather(g)?))),
            ))
        })
    })
}

/// Sum (or mean) over ranks, rank r keeping the r-th chunk along `dim`
/// ([`chunk_sizes`]); backward allgathers the chunks' gradients.
pub fn reduce_scatter(ctx: &Context, x: &Tensor, op_: ReduceOp, dim: usize) -> Result<Tensor> {
    if dim == 0 || dim >= x.rank() {
        return along("reduce_scatter", Some(x), dim, |x| {
            reduce_scatter0(ctx, need(x)?, op_)
        });
    }
    // Along an inner dimension: the moves to and from dimension 0 inside
    // the op, so that the graph holds x alone, not a moved copy of it too
    // (sequence parallelism's exit from each region: a whole (B, T, D)).
    differentiable_reduce("reduce_scatter", op_)?;
    let c = ctx.clone();
    record(op(ctx, "reduce_scatter", Some(x)), || {
        let y = reduce_scatter_along(ctx, &x.detach(), op_, dim)?;
        let n = ctx.size() as f64;
        Ok((
            y,
            backward(move |g| {
                // Mirror: allgather of the chunks' gradients along `dim`.
                let all = allgather_along(&c, g, dim)?;
                Ok(Some(match op_ {
                    ReduceOp::Mean => (all / n)?,
                    _ => all,
                }))
            }),
        ))
    })
}

/// [`reduce_scatter`] of a local map's output, the map's output never in
/// the graph: `partial` computes f(x) outside the graph and returns it with
/// its backward (dL/df ↦ dL/dx, `None` when x needs none), and only x is
/// kept for backward. A reduce-scatter's input is whole-sized (a
/// convolution's partial sums over its input channels: every output
/// channel), its output 1/n of that; `reduce_scatter` keeps the whole input
/// in the graph until backward, this keeps nothing of it.
pub fn reduce_scatter_of<B>(
    ctx: &Context,
    x: &Tensor,
    op_: ReduceOp,
    dim: usize,
    partial: impl FnOnce(&Tensor) -> Result<(Tensor, B)>,
) -> Result<Tensor>
where
    B: Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
{
    differentiable_reduce("reduce_scatter_of", op_)?;
    let c = ctx.clone();
    record(op(ctx, "reduce_scatter_of", Some(x)), || {
        let (f, f_backward) = partial(x)?;
        if dim >= f.rank() {
            return Err(Error::Usage(format!(
                "reduce_scatter_of: dimension {dim} is out of range for a tensor of shape {:?}",
                f.dims()
            )));
        }
        let y = reduce_scatter_along(ctx, &f, op_, dim)?;
        let n = ctx.size() as f64;
        Ok((
            y,
            backward(move |g| {
                // Mirror: allgather of the chunks' gradients along `dim`,
                // then the map's own backward.
                let all = allgather_along(&c, g, dim)?;
                f_backward(&match op_ {
                    ReduceOp::Mean => (all / n)?,
                    _ => all,
                })
            }),
        ))
    })
}

/// The ranks' `x` reduced, rank r keeping chunk r along `dim`: plain
/// communication, outside the tape (`dim` moved to the front and back).
pub(crate) fn reduce_scatter_along(
    ctx: &Context,
    x: &Tensor,
    op_: ReduceOp,
    dim: usize,
) -> Result<Tensor> {
    let moved = x.transpose(0, dim)?.contiguous()?;
    Ok(ctx
        .reduce_scatter(&moved, op_)?
        .transpose(0, dim)?
        .contiguous()?)
}

/// Every rank's `x` concatenated along `dim`: plain communication,
/// outside the tape (`dim` moved to the front and back).
pub(crate) fn allgather_along(ctx: &Context, x: &Tensor, dim: usize) -> Result<Tensor> {
    let moved = x.transpose(0, dim)?.contiguous()?;
    Ok(ctx.allgather(&moved)?.transpose(0, dim)?.contiguous()?)
}

fn reduce_scatter0(ctx: &Context, x: &Tensor, op_: ReduceOp) -> Result<Tensor> {
    differentiable_reduce("reduce_scatter", op_)?;
    rows("reduce_scatter", x)?;
    let c = ctx.clone();
    record(op(ctx, "reduce_scatter", Some(x)), || {
        let y = ctx.reduce_scatter(x, op_)?;
        let n = ctx.size() as f64;
        Ok((
            y,
            backward(move |g| {
                // Mirror: allgather of the chunks' gradients.
                let all = c.allgather(g)?;
                Ok(Some(match op_ {
                    ReduceOp::Mean => (all / n)?,
                    _ => all,
                }))
            }),
        ))
    })
}

/// The root's `x` on every rank (others pass `None`); backward sums the ranks'
/// gradients onto the root. For a loss computed identically on every rank,
/// use [`bcast_replicated`].
pub fn bcast(ctx: &Context, x: Option<&Tensor>, root: usize) -> Result<Tensor> {
    bcast_with(ctx, x, root, false)
}

/// Like [`bcast`], for when every rank then computes the same loss: backward
/// is the root's own gradient, with no communication.
pub fn bcast_replicated(ctx: &Context, x: Option<&Tensor>, root: usize) -> Result<Tensor> {
    bcast_with(ctx, x, root, true)
}

fn bcast_with(ctx: &Context, x: Option<&Tensor>, root: usize, replicated: bool) -> Result<Tensor> {
    let name = if replicated {
        "bcast_replicated"
    } else {
        "bcast"
    };
    let c = ctx.clone();
    let is_root = ctx.rank() == root;
    record(op(ctx, name, x), || {
        let y = ctx.bcast(x, root)?;
        Ok((
            y,
            backward(move |g| {
                if replicated {
                    return Ok(is_root.then(|| g.clone()));
                }
                // Mirror: gradients gathered onto the root and summed there.
                match c.gather(g, root)? {
                    Some(all) => Ok(Some(fold(&all, ReduceOp::Sum)?)),
                    None => Ok(None),
                }
            }),
        ))
    })
}

/// Every rank's `x` concatenated along `dim` on `root`; other ranks get
/// a tensor of 0 rows (which, like a delegate, keeps them in the graph).
/// Backward scatters the root's gradient back by rows.
pub fn gather(ctx: &Context, x: &Tensor, root: usize, dim: usize) -> Result<Tensor> {
    along("gather", Some(x), dim, |x| gather0(ctx, need(x)?, root))
}

fn gather0(ctx: &Context, x: &Tensor, root: usize) -> Result<Tensor> {
    rows("gather", x)?;
    let c = ctx.clone();
    record(op(ctx, "gather", Some(x)), || {
        let (y, counts) = match ctx.gather(x, root)? {
            Some(parts) => {
                let counts: Vec<usize> = parts.iter().map(|p| p.dims()[0]).collect();
                (Tensor::cat(&parts, 0)?, counts)
            }
            None => {
                let mut dims = x.dims().to_vec();
                dims[0] = 0;
                (Tensor::zeros(dims, x.dtype(), x.device())?, Vec::new())
            }
        };
        Ok((
            y,
            backward(move |g| {
                // Mirror: scatter of the root's gradient, by the gathered rows.
                let parts = (c.rank() == root)
                    .then(|| split_rows(g, &counts))
                    .transpose()?;
                Ok(Some(c.scatter(parts.as_deref(), root)?))
            }),
        ))
    })
}

/// The root's `x` cut along `dim` into [`chunk_sizes`] chunks, rank r
/// receiving the r-th (others pass `None`). Backward gathers the chunks'
/// gradients onto the root. Along `dim` ≠ 0, only the root's tensor says how many dimensions there
/// are: every rank passes the same `dim`.
pub fn scatter(ctx: &Context, x: Option<&Tensor>, root: usize, dim: usize) -> Result<Tensor> {
    let mine = x.filter(|_| ctx.rank() == root);
    if dim == 0 || ctx.rank() == root {
        return along("scatter", mine, dim, |x| scatter0(ctx, x, root));
    }
    // A receiver learns the shape with the data: move `dim` back once it
    // has arrived.
    Ok(scatter0(ctx, None, root)?.transpose(0, dim)?.contiguous()?)
}

fn scatter0(ctx: &Context, x: Option<&Tensor>, root: usize) -> Result<Tensor> {
    let c = ctx.clone();
    let is_root = ctx.rank() == root;
    if is_root {
        match x {
            Some(x) => rows("scatter", x).map(|_| ())?,
            None => {
                return Err(Error::Usage(format!(
                    "scatter: rank {root} is the root and must pass a tensor"
                )))
            }
        }
    }
    let x = x.filter(|_| is_root);
    record(op(ctx, "scatter", x), || {
        let parts = x
            .map(|x| split_rows(x, &chunk_sizes(x.dims()[0], ctx.size())))
            .transpose()?;
        let y = ctx.scatter(parts.as_deref(), root)?;
        Ok((
            y,
            backward(move |g| {
                // Mirror: gather of the chunks' gradients onto the root.
                match c.gather(g, root)? {
                    Some(all) => Ok(Some(Tensor::cat(&all, 0)?)),
                    None => Ok(None),
                }
            }),
        ))
    })
}

/// Rank r cuts `x` along `dim` into `send_counts[d]` slices for each rank d, and receives
/// the pieces addressed to it, concatenated in rank order. Backward sends
/// each piece's gradient back where the piece came from.
pub fn alltoall(ctx: &Context, x: &Tensor, send_counts: &[usize], dim: usize) -> Result<Tensor> {
    along("alltoall", Some(x), dim, |x| {
        alltoall0(ctx, need(x)?, send_counts)
    })
}

fn alltoall0(ctx: &Context, x: &Tensor, send_counts: &[usize]) -> Result<Tensor> {
    let n = rows("alltoall", x)?;
    if send_counts.len() != ctx.size() || send_counts.iter().sum::<usize>() != n {
        return Err(Error::Usage(format!(
            "alltoall: send_counts {send_counts:?} must have one entry per rank ({}) summing to \
             the rows of x ({n})",
            ctx.size()
        )));
    }
    let c = ctx.clone();
    let send_counts = send_counts.to_vec();
    record(op(ctx, "alltoall", Some(x)), || {
        let got = ctx.alltoall(&split_rows(x, &send_counts)?)?;
        let recv_counts: Vec<usize> = got.iter().map(|t| t.dims()[0]).collect();
        Ok((
            Tensor::cat(&got, 0)?,
            backward(move |g| {
                // Mirror: each piece's gradient back to the rank it came from.
                let back = c.alltoall(&split_rows(g, &recv_counts)?)?;
                Ok(Some(Tensor::cat(&back, 0)?))
            }),
        ))
    })
}
