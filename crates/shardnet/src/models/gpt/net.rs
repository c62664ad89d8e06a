//! This rank's part of the GPT's network ([`Net`]): the embeddings (first
//! stage), its blocks, `ln_f` and the tied LM head on the sharded
//! cross-entropy (last stage); the next token's logits for sampling.
//!
//! Under sequence parallelism the embeddings' sum is cut along the
//! sequence (split-to: each rank its positions, backward an allgather),
//! the blocks keep it cut between their tensor-parallel regions, and
//! `ln_f`'s output is allgathered before the head (backward: the
//! reduce-scatter that sums the head's shares of dx, as copy-to's
//! allreduce does without it).
//!
//! Under pipeline parallelism the last stage holds its own copy of `wte`
//! for the head (Megatron's way): the same initial values, its gradient
//! summed with the first stage's after backward, so the two stay equal.

use super::fsdp::ShardedBlock;
use super::{Config, Recompute};
use crate::comm::chunk_range;
use crate::functions::{
    allgather, copy_to_shards, sharded_softmax_cross_entropy, split_to_shards, Context,
    CrossEntropyConfig, Margin,
};
use crate::links::{BlockDropout, GptBlock, VocabParallelEmbedding, INIT_STD, LN_EPS};
use crate::nn::{dropout_rows, Init, LayerNorm, Param, ParamStore, ShardedParam};
use crate::{Error, Result};
use candle_core::{DType, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

/// This rank's part of the network: a tensor-parallel rank of one
/// pipeline stage.
pub(super) struct Net {
    tc: Context,
    /// The token table: on the first stage (the embedding) and the last
    /// (the head).
    wte: Option<VocabParallelEmbedding>,
    /// The positions' table, on the first stage.
    wpe: Option<Param>,
    /// This rank's blocks, by index.
    blocks: BTreeMap<usize, GptBlock>,
    /// Or, fully sharded over the replicas (`--shard-state parameters`),
    /// this replica's shares of them.
    sharded: BTreeMap<usize, ShardedBlock>,
    /// The shares' names, each with whether its parameter is whole on
    /// every rank of the tensor-parallel group.
    share_names: HashMap<String, bool>,
    /// On the last stage.
    ln_f: Option<LayerNorm>,
    sequence_parallel: bool,
    /// Each block run again in backward from its input.
    recompute: bool,
    /// The head's logits: F32, or BF16 (its GEMMs on bf16 inputs).
    logits: DType,
    /// Whether this stage is the first and the last.
    first: bool,
    last: bool,
}

/// A micro-batch's dropout: probability, the step's seed, and the global
/// index of the micro-batch's first batch row.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dropout {
    pub(super) p: f64,
    pub(super) seed: u64,
    pub(super) first_row: usize,
}

/// One micro-batch's loss on this group: the sum over its tokens (f64),
/// the tokens whose target is the top logit, and the loss to
/// differentiate (the sum ÷ the global batch's tokens).
pub(super) struct Loss {
    pub(super) sum: f64,
    pub(super) hits: usize,
    pub(super) scaled: Tensor,
}

impl Net {
    /// The blocks `blocks` of `cfg`, with the embeddings if `first` and the
    /// head if `last`, over the tensor-parallel group `tc`; the blocks
    /// fully sharded over the replicas of `fsdp` where given.
    pub(super) fn new(
        tc: &Context,
        store: &ParamStore,
        cfg: &Config,
        blocks: &[usize],
        (first, last): (bool, bool),
        fsdp: Option<&crate::comm::Communicator>,
    ) -> Result<Self> {
        let root = store.pp("transformer");
        let wte = (first || last)
            .then(|| {
                VocabParallelEmbedding::with_init(
                    tc,
                    &root.pp("wte"),
                    cfg.vocab(),
                    cfg.dim,
                    Init::std(0, INIT_STD),
                )
            })
            .transpose()?;
        let wpe = first
            .then(|| {
                ShardedParam::new("weight", &[cfg.seq, cfg.dim], Init::std(1, INIT_STD))
                    .build(&root.pp("wpe"))
            })
            .transpose()?;
        let h = root.pp("h");
        let (mut whole, mut sharded) = (BTreeMap::new(), BTreeMap::new());
        for &i in blocks {
            match fsdp {
                Some(dp) => {
                    let sp = cfg.sequence_parallel && tc.size() > 1;
                    let block = ShardedBlock::new(tc, dp, store, &cfg.block(i), i, sp)?;
                    sharded.insert(i, block);
                }
                None => {
                    whole.insert(i, GptBlock::new(tc, &h.pp(&i.to_string()), &cfg.block(i))?);
                }
            }
        }
        let share_names = sharded
            .values()
            .flat_map(ShardedBlock::shares)
            .map(|(p, whole)| (p.name().to_string(), whole))
            .collect();
        let ln_f = last
            .then(|| LayerNorm::new(&root.pp("ln_f"), cfg.dim, LN_EPS))
            .transpose()?;
        Ok(Net {
            tc: tc.clone(),
            wte,
            wpe,
            blocks: whole,
            sharded,
            share_names,
            ln_f,
            sequence_parallel: cfg.sequence_parallel && tc.size() > 1,
            recompute: cfg.recompute == Recompute::Full,
            logits: cfg.precision,
            first,
            last,
        })
    }

    /// The names of this replica's shares of its fully sharded blocks'
    /// parameters (empty unless `--shard-state parameters`), each with
    /// whether its parameter is whole on every rank of the tensor-parallel
    /// group.
    pub(super) fn share_names(&self) -> &HashMap<String, bool> {
        &self.share_names
    }

    /// The token table's copy on the last stage, whose gradient is summed
    /// with the first stage's (`None` on one stage, or on a middle one).
    pub(super) fn tied_copy(&self) -> Option<&Param> {
        match (self.first, self.last) {
            (true, true) | (false, false) => None,
            _ => self.wte.as_ref().map(|w| &w.weight),
        }
    }

    /// Whether this stage's `wte` is the last stage's copy (counted once,
    /// by the first stage, in the gradients' norm).
    pub(super) fn is_tied_copy(&self, p: &Param) -> bool {
        !self.first && self.tied_copy().is_some_and(|w| w.name() == p.name())
    }

    /// The whole parameters whose gradient each rank holds only its
    /// positions' part of under sequence parallelism (the layer norms, the
    /// biases added after a reduce-scatter): summed over the group after
    /// backward. Empty without it.
    pub(super) fn sequence_partial(&self) -> Vec<Param> {
        if !self.sequence_parallel {
            return Vec::new();
        }
        let mut p: Vec<Param> = self
            .blocks
            .values()
            .flat_map(|b| b.sequence_partial())
            .collect();
        if let Some(ln) = &self.ln_f {
            p.extend(ln.params());
        }
        p
    }

    /// The positions this rank holds between the regions, of `t`.
    fn positions(&self, t: usize) -> Range<usize> {
        if self.sequence_parallel {
            chunk_range(t, self.tc.size(), self.tc.rank())
        } else {
            0..t
        }
    }

    /// The blocks' dropout for rows `b` × positions of `t`.
    fn block_dropout(&self, d: Option<Dropout>, b: usize, t: usize) -> Option<BlockDropout> {
        let mine = self.positions(t);
        d.filter(|d| d.p > 0.0).map(|d| {
            // Row (i, j) of the global batch: key i·T + j.
            let keys = (0..b)
                .flat_map(|i| {
                    mine.clone()
                        .map(move |j| ((d.first_row + i) * t + j) as u64)
                })
                .collect();
            BlockDropout {
                p: d.p,
                seed: d.seed,
                keys,
            }
        })
    }

    /// The first stage's input to its blocks: tokens and positions of `ids`
    /// (B, T) embedded, dropped out, and (sequence parallel) cut to this
    /// rank's positions.
    pub(super) fn embed(&self, ids: &Tensor, dropout: Option<Dropout>) -> Result<Tensor> {
        let (Some(wte), Some(wpe)) = (&self.wte, &self.wpe) else {
            return Err(Error::Usage(
                "gpt: the embeddings are on the first pipeline stage".into(),
            ));
        };
        let (b, t) = ids.dims2()?;
        let pos = wpe.tracked()?.narrow(0, 0, t)?;
        let mut h = wte.forward(ids)?.broadcast_add(&pos)?;
        if self.sequence_parallel {
            h = split_to_shards(&self.tc, &h, 1)?;
        }
        if let Some(d) = self.block_dropout(dropout, b, t) {
            // GPT-2's embd_pdrop: keyed as the blocks' rows, its own seed.
            let mut s = d.seed;
            h = dropout_rows(&h, d.p, crate::rng::splitmix64(&mut s), &d.keys)?;
        }
        Ok(h)
    }

    /// Blocks `range` of this rank (all of them here) on `h`, the
    /// activations of B rows and T positions.
    pub(super) fn blocks(
        &self,
        mut h: Tensor,
        range: Range<usize>,
        t: usize,
        dropout: Option<Dropout>,
    ) -> Result<Tensor> {
        let d = self.block_dropout(dropout, h.dim(0)?, t);
        for i in range {
            if let Some(block) = self.sharded.get(&i) {
                h = block.forward(&h, d.clone())?;
                continue;
            }
            let block = self.blocks.get(&i).ok_or_else(|| {
                Error::Usage(format!("gpt: block {i} is not on this pipeline stage"))
            })?;
            h = if self.recompute {
                let (block, d) = (block.clone(), d.clone());
                crate::functions::recompute(&self.tc, &h, move |x| {
                    block.forward_with(x, d.as_ref())
                })?
            } else {
                block.forward_with(&h, d.as_ref())?
            };
        }
        Ok(h)
    }

    /// `ln_f` on the last block's output, whole on every rank of the group
    /// (B, T, D).
    fn head_input(&self, h: &Tensor) -> Result<Tensor> {
        let ln = self.ln_f.as_ref().ok_or_else(|| {
            Error::Usage("gpt: ln_f and the head are on the last pipeline stage".into())
        })?;
        let h = ln.forward(h)?;
        Ok(if self.sequence_parallel {
            allgather(&self.tc, &h, 1)?
        } else {
            copy_to_shards(&self.tc, &h)?
        })
    }

    /// The last stage's loss of its blocks' output `h` against `targets`
    /// (B, T), the differentiable part scaled by 1 / `tokens` (the global
    /// batch's); `train`: backward will run.
    pub(super) fn head_loss(
        &self,
        h: &Tensor,
        targets: &Tensor,
        tokens: usize,
        train: bool,
    ) -> Result<Loss> {
        let (b, t) = targets.dims2()?;
        let h = self.head_input(h)?;
        let d = h.dim(2)?;
        let wte = self
            .wte
            .as_ref()
            .ok_or_else(|| Error::Usage("gpt: the head is on the last pipeline stage".into()))?;
        let labels = targets.flatten_all()?.to_vec1::<u32>()?;
        let (offset, vocab) = wte.rows();
        let out = sharded_softmax_cross_entropy(
            self.tc.comm(),
            &h.reshape((b * t, d))?,
            &wte.weight,
            offset,
            vocab,
            &labels,
            None,
            CrossEntropyConfig {
                margin: Margin::None,
                scale: 1.0,
                logits: self.logits,
                backward: train,
            },
        )?;
        let sum = out.loss.sum_all()?;
        Ok(Loss {
            sum: sum.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            hits: out.correct,
            scaled: (sum / tokens as f64)?,
        })
    }

    /// The logits of the token after `ids` (B, T): (B, V), on one rank
    /// holding the whole model.
    pub(super) fn next_logits(&self, ids: &Tensor) -> Result<Tensor> {
        let t = ids.dim(1)?;
        let h = self.embed(ids, None)?;
        let h = self.blocks(h, 0..self.blocks.len() + self.sharded.len(), t, None)?;
        let h = self.head_input(&h)?;
        let last = h.narrow(1, t - 1, 1)?.squeeze(1)?;
        let wte = self.wte.as_ref().ok_or_else(|| {
            Error::Usage("gpt: sampling needs the whole model on one rank".into())
        })?;
        Ok(last
            .matmul(&wte.weight.value().t()?)?
            .to_dtype(DType::F32)?)
    }

    /// The longest context (T, the positions `wpe` holds).
    pub(super) fn max_seq(&self) -> Result<usize> {
        let wpe = self
            .wpe
            .as_ref()
            .ok_or_else(|| Error::Usage("gpt: wpe is on the first pipeline stage".into()))?;
        Ok(wpe.value().dim(0)?)
    }
}
