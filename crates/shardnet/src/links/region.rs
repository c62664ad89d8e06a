//! A tensor-parallel region's entry and exit fused with its first and last
//! GEMM, so that backward keeps what Megatron-LM keeps: [`enter_linear`],
//! [`exit_linear`].
//!
//! Composed of the region ops ([`crate::functions`]), a region keeps more:
//! the allgather's whole output or copy-to's copy (the first layer's
//! input) and the partial sums before the allreduce or reduce-scatter
//! (that op's input) stay in candle's graph until backward. Fused, each is one recorded op whose
//! backward does the layer's GEMMs by hand ([`Linear`]'s own kernels):
//!
//! | op | forward | backward (dL/dy = g) | kept for backward |
//! |---|---|---|---|
//! | [`enter_linear`], sequence parallel | X = allgather of the ranks' positions x_r; y = X W_rᵀ + b_r | X = allgather of x_r again; dX = g W_r, dW_r += gᵀ X; dx_r = reduce-scatter of dX | x_r: 1/t of X |
//! | [`enter_linear`], otherwise | y = x W_rᵀ + b_r (x whole on every rank) | dx = allreduce of g W_r (copy-to's), dW_r += gᵀ x | x (no copy of it) |
//! | [`exit_linear`], sequence parallel | y_r = reduce-scatter of h W_rᵀ along the sequence | G = allgather of g; dh = G W_r, dW_r += Gᵀ h | h (not the partial sum) |
//! | [`exit_linear`], otherwise | y = allreduce of h W_rᵀ | dh = g W_r, dW_r += gᵀ h | h (not the partial sum) |
//!
//! The bytes on the wire are the composed ops' (Megatron's: one allgather
//! more in the entry's backward, in place of keeping X). On one rank each
//! is the layer alone. The sequence is dimension 1 of (B, T, ·).

use crate::functions::{allgather_along, backward, communicating, reduce_scatter_along, Context};
use crate::nn::Linear;
use crate::{ReduceOp, Result};
use candle_core::Tensor;

/// Every rank's positions (B, T_r, ·), concatenated along the sequence.
fn gather_sequence(ctx: &Context, x: &Tensor) -> Result<Tensor> {
    allgather_along(ctx, x, 1)
}

/// The ranks' (B, T, ·) summed, rank r keeping its positions.
fn reduce_scatter_sequence(ctx: &Context, x: &Tensor) -> Result<Tensor> {
    reduce_scatter_along(ctx, x, ReduceOp::Sum, 1)
}

/// Into a region through its first layer: `linear` (a column-parallel
/// layer's shard) on the whole sequence, from each rank's positions
/// (`sequence_parallel`: x is (B, T_r, D)) or from x whole on every rank.
/// The table in the module doc says what backward keeps.
pub fn enter_linear(
    ctx: &Context,
    x: &Tensor,
    linear: &Linear,
    sequence_parallel: bool,
) -> Result<Tensor> {
    if ctx.size() == 1 {
        return linear.forward(x);
    }
    let (c, layer, kept) = (ctx.clone(), linear.clone(), x.detach());
    let name = if sequence_parallel {
        "sequence-parallel linear (entry)"
    } else {
        "column-parallel linear (entry)"
    };
    communicating(ctx, name, x, || {
        let y = if sequence_parallel {
            linear.forward_detached(&gather_sequence(ctx, x)?)?
        } else {
            linear.forward_detached(x)?
        };
        Ok((
            y,
            backward(move |g| {
                if !sequence_parallel {
                    // Mirror: the layer's backward, dx summed over the
                    // group (copy-to's allreduce).
                    let dx = layer.backward_detached(&kept, g)?;
                    return Ok(Some(c.allreduce(&dx, ReduceOp::Sum)?));
                }
                // Mirror: the input gathered again, the layer's backward,
                // dX's positions summed back to their ranks.
                let whole = gather_sequence(&c, &kept)?;
                let dx = layer.backward_detached(&whole, g)?;
                drop(whole);
                Ok(Some(reduce_scatter_sequence(&c, &dx)?))
            }),
        ))
    })
}

/// Out of a region through its last layer: `linear` (a row-parallel
/// layer's shard, its bias added by the caller) on this rank's features
/// `h`, the ranks' partial sums added: whole on every rank, or each rank
/// its positions (`sequence_parallel`). The table in the module doc says
/// what backward keeps.
pub fn exit_linear(
    ctx: &Context,
    h: &Tensor,
    linear: &Linear,
    sequence_parallel: bool,
) -> Result<Tensor> {
    if ctx.size() == 1 {
        return linear.forward(h);
    }
    let (c, layer, kept) = (ctx.clone(), linear.clone(), h.detach());
    let name = if sequence_parallel {
        "sequence-parallel linear (exit)"
    } else {
        "row-parallel linear (exit)"
    };
    communicating(ctx, name, h, || {
        let partial = linear.forward_detached(h)?;
        let y = if sequence_parallel {
            reduce_scatter_sequence(ctx, &partial)?
        } else {
            ctx.allreduce(&partial, ReduceOp::Sum)?
        };
        drop(partial);
        Ok((
            y,
            backward(move |g| {
                // Mirror: the gradient of the whole sum (allgathered from
                // the ranks' positions), through the layer.
                let g = if sequence_parallel {
                    gather_sequence(&c, g)?
                } else {
                    g.clone()
                };
                Ok(Some(layer.backward_detached(&kept, &g)?))
            }),
        ))
    })
}
