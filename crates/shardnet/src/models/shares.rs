//! A model's `Linear` layers shared out over data-parallel replicas
//! (`--shard-state gradients` and `parameters`): [`share_out`], what the
//! MLP's stages and the face head's backbone do with each layer.

use crate::functions::Context;
use crate::nn::{Linear, Param, ParamStore, Shard};
use crate::optim::ShardState;
use crate::Result;

/// `layer` (whole: the unsharded model's values) with its weight shared
/// out over the replicas of `dp` along its larger dimension: this
/// replica's chunk registered in `store` under the weight's name with its
/// [`Shard`], the whole bias beside it. Under `gradients` the weight is
/// gathered once a step ([`Linear::gradient_sharded`]), under `parameters`
/// for each pass, `block` bytes at a time ([`Linear::fully_sharded`],
/// [`Linear::with_gather_block`]).
pub(crate) fn share_out(
    layer: &Linear,
    dp: &Context,
    state: ShardState,
    store: &ParamStore,
    block: usize,
) -> Result<Linear> {
    let w = layer.weight();
    let dims = w.value().dims();
    let dim = usize::from(dims[1] > dims[0]);
    let (shard, own) = Shard::balanced(dim, dims[dim], dp.size(), dp.rank());
    // A copy: the whole weight goes with its layer.
    let value = w.value().narrow(dim, own.start, own.len())?.copy()?;
    let share = Param::new(w.name(), &value)?.with_shard(shard);
    store.register(share.clone())?;
    if let Some(b) = layer.bias() {
        store.register(b.clone())?;
    }
    Ok(if state == ShardState::Gradients {
        layer.gradient_sharded(dp, share, dim)?
    } else {
        layer
            .fully_sharded(dp, share, dim)?
            .with_gather_block(block)
    })
}
