//! Fully sharded blocks (`--shard-state parameters`: PyTorch FSDP's
//! design, ZeRO stage 3): each data-parallel replica keeps a 1/d share of
//! every block parameter, along the parameter's largest dimension, and so
//! of its gradient and its optimizer state.
//!
//! | when | what moves over the replicas | held whole, for how long |
//! |------|------------------------------|--------------------------|
//! | a block's forward | its parameters allgathered | its parameters, while the block runs (no graph is kept) |
//! | backward reaches it | its parameters allgathered again; the block recomputed from its input and run back | its parameters, activations and gradients, until its backward is done |
//! | its backward is done | its gradients reduce-scattered into the shares' | nothing |
//!
//! So a replica holds its shares and one block whole at a time, as FSDP
//! with activation checkpointing does. The optimizer steps the shares
//! where they are: no parameter moves after the step. The sums are the
//! unsharded run's (a reduce-scatter adds the replicas' gradients in the
//! allreduce's order).

use crate::comm::{chunk_range, Communicator};
use crate::functions::{recompute_then, Context};
use crate::links::{BlockConfig, BlockDropout, GptBlock};
use crate::nn::{Param, ParamStore, Shard};
use crate::{ReduceOp, Result};
use candle_core::{Device, Tensor};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// One block, fully sharded over the replicas of `dp`.
#[derive(Clone)]
pub(super) struct ShardedBlock {
    /// This replica's share of each parameter, in the block's order.
    shares: Arc<Vec<Share>>,
    dp: Communicator,
    tc: Context,
    cfg: BlockConfig,
    /// The block's scope in the store (`transformer.h.3`).
    scope: String,
    /// The parameters whose gradients each rank of the tensor-parallel
    /// group holds a part of under sequence parallelism (summed over the
    /// group before they are handed on); empty without it.
    partial: Arc<std::collections::HashSet<String>>,
    device: Device,
    seed: u64,
    /// The parameters of the block built for the run under way (forward:
    /// dropped when it ends; backward: once their gradients are handed on).
    live: Arc<Mutex<Option<Vec<Param>>>>,
}

/// A replica's share of one parameter, along `dim`; `tp_whole`: the
/// parameter is whole on every rank of its tensor-parallel group (a layer
/// norm's, an output projection's bias), not a shard of it.
struct Share {
    param: Param,
    dim: usize,
    tp_whole: bool,
}

impl ShardedBlock {
    /// Block `i` of `cfg`, made whole once (its initial values are the
    /// unsharded model's), this replica's share of each parameter
    /// registered in `store` under its usual name with its [`Shard`].
    /// A tensor-parallel shard is shared out along its own dimension (its
    /// shares are then shards of the global tensor, as checkpoints keep
    /// them); a whole parameter along its largest.
    pub(super) fn new(
        tc: &Context,
        dp: &Communicator,
        store: &ParamStore,
        cfg: &BlockConfig,
        i: usize,
        sequence_parallel: bool,
    ) -> Result<Self> {
        let scope = format!("transformer.h.{i}");
        let whole = ParamStore::new(store.device(), store.seed());
        let block = GptBlock::new(tc, &scoped(&whole, &scope), cfg)?;
        let partial = if sequence_parallel {
            block
                .sequence_partial()
                .iter()
                .map(|p| p.name().to_string())
                .collect()
        } else {
            Default::default()
        };
        let (d, r) = (dp.size(), dp.rank());
        let mut shares = Vec::new();
        for p in whole.params() {
            let dims = p.value().dims().to_vec();
            // A shard of more than one rank: along its dimension, offset
            // into the global tensor. Else the largest dimension (the
            // first of equals): the most even shares.
            let tp = p.shard().filter(|s| dims.get(s.dim) != Some(&s.global));
            let dim = match tp {
                Some(s) => s.dim,
                None => (0..dims.len()).fold(0, |a, k| if dims[k] > dims[a] { k } else { a }),
            };
            let rows = chunk_range(dims[dim], d, r);
            let shard = match tp {
                Some(s) => {
                    Shard::along(dim, &(s.offset + rows.start..s.offset + rows.end), s.global)
                }
                None => Shard::along(dim, &rows, dims[dim]),
            };
            let value = p
                .value()
                .narrow(dim, rows.start, rows.len())?
                .contiguous()?;
            let param = Param::new(p.name(), &value)?.with_shard(shard);
            store.register(param.clone())?;
            shares.push(Share {
                param,
                dim,
                tp_whole: p.shard().is_none(),
            });
        }
        Ok(ShardedBlock {
            shares: Arc::new(shares),
            dp: dp.clone(),
            tc: tc.clone(),
            cfg: *cfg,
            scope,
            partial: Arc::new(partial),
            device: store.device().clone(),
            seed: store.seed(),
            live: Arc::new(Mutex::new(None)),
        })
    }

    /// This replica's shares (the parameters the optimizer steps), each
    /// with whether it is a share of a parameter whole on every rank of the
    /// tensor-parallel group.
    pub(super) fn shares(&self) -> Vec<(Param, bool)> {
        self.shares
            .iter()
            .map(|s| (s.param.clone(), s.tp_whole))
            .collect()
    }

    /// Every parameter whole, by name: each replica's shares allgathered.
    /// Collective over the replicas.
    fn gather(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut whole = BTreeMap::new();
        for s in self.shares.iter() {
            let mine = front(s.param.value(), s.dim)?;
            let (all, _) = self.dp.allgather_counts(&mine)?;
            whole.insert(s.param.name().to_string(), front(&all, s.dim)?);
        }
        Ok(whole)
    }

    /// The block on `x`: its parameters gathered for the forward and freed
    /// after it, gathered again when backward recomputes it, and their
    /// gradients reduce-scattered into the shares when its backward is
    /// done (see the module doc). Collective over the replicas.
    pub(super) fn forward(&self, x: &Tensor, dropout: Option<BlockDropout>) -> Result<Tensor> {
        let run = self.clone();
        let done = self.clone();
        recompute_then(
            &self.tc,
            x,
            move |x| {
                let store = ParamStore::with_values(&run.device, run.seed, run.gather()?);
                let block = GptBlock::new(&run.tc, &scoped(&store, &run.scope), &run.cfg)?;
                *lock(&run.live) = Some(store.params());
                // The gathered values, copied into the block's parameters:
                // one whole copy while the block runs.
                drop(store);
                block.forward_with(x, dropout.as_ref())
            },
            move |backward| {
                let live = lock(&done.live).take();
                match (backward, live) {
                    (true, Some(params)) => done.hand_on(&params),
                    _ => Ok(()),
                }
            },
        )
    }

    /// The whole gradients of the block built for backward, reduce-
    /// scattered over the replicas and added to the shares'. Collective.
    fn hand_on(&self, params: &[Param]) -> Result<()> {
        // Under sequence parallelism first the group's parts summed, as
        // the unsharded blocks' are after backward.
        let partial: Vec<Param> = params
            .iter()
            .filter(|p| self.partial.contains(p.name()))
            .cloned()
            .collect();
        if !partial.is_empty() {
            crate::optim::allreduce_grads(self.tc.comm(), &partial, ReduceOp::Sum)?;
        }
        for (p, s) in params.iter().zip(self.shares.iter()) {
            debug_assert_eq!(p.name(), s.param.name());
            // Every replica calls every collective: a missing gradient is
            // zeros.
            let g = match p.grad() {
                Some(g) => front(g, s.dim)?,
                None => front(&p.value().zeros_like()?, s.dim)?,
            };
            let mine = self.dp.reduce_scatter(&g, ReduceOp::Sum)?;
            s.param.add_grad(&front(&mine, s.dim)?)?;
        }
        Ok(())
    }
}

/// `t` with dimension `dim` and 0 swapped, contiguous (its own inverse).
fn front(t: &Tensor, dim: usize) -> Result<Tensor> {
    Ok(if dim == 0 {
        t.contiguous()?
    } else {
        t.transpose(0, dim)?.contiguous()?
    })
}

/// `store` scoped to `scope` (`a.b.c`).
fn scoped(store: &ParamStore, scope: &str) -> ParamStore {
    scope.split('.').fold(store.clone(), |s, part| s.pp(part))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
