//! This rank's part of the GPT's network ([`Net`]): the embeddings, the
//! blocks, the final layer norm and the tied LM head on the sharded
//! cross-entropy; the next token's logits for sampling.
//!
//! Under sequence parallelism the embeddings' sum is cut along the
//! sequence (split-to: each rank its positions, backward an allgather),
//! the blocks keep it cut between their tensor-parallel regions, and
//! `ln_f`'s output is allgathered before the head (backward: the
//! reduce-scatter that sums the head's shares of dx, as copy-to's
//! allreduce does without it).

use super::Config;
use crate::comm::chunk_range;
use crate::data::BYTE_VOCAB;
use crate::functions::{
    allgather, copy_to_shards, sharded_softmax_cross_entropy, split_to_shards, Context,
    CrossEntropyConfig, Margin,
};
use crate::links::{BlockDropout, GptBlock, VocabParallelEmbedding, INIT_STD, LN_EPS};
use crate::nn::{dropout_rows, Init, LayerNorm, Param, ParamStore, ShardedParam};
use crate::Result;
use candle_core::{DType, Tensor, D};

/// This rank's part of the network.
pub(super) struct Net {
    tc: Context,
    wte: VocabParallelEmbedding,
    wpe: Param,
    blocks: Vec<GptBlock>,
    ln_f: LayerNorm,
    sequence_parallel: bool,
}

/// A training step's dropout: probability, the step's seed, and the
/// global index of this group's first batch row.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dropout {
    pub(super) p: f64,
    pub(super) seed: u64,
    pub(super) first_row: usize,
}

/// One batch's loss on this group: the sum over its tokens (f64), the
/// tokens whose target is the top logit, and the loss to differentiate
/// (the sum ÷ the global batch's tokens).
pub(super) struct Loss {
    pub(super) sum: f64,
    pub(super) hits: usize,
    pub(super) scaled: Tensor,
}

impl Net {
    pub(super) fn new(tc: &Context, store: &ParamStore, cfg: &Config) -> Result<Self> {
        let root = store.pp("transformer");
        let wte = VocabParallelEmbedding::with_init(
            tc,
            &root.pp("wte"),
            BYTE_VOCAB,
            cfg.dim,
            Init::std(0, INIT_STD),
        )?;
        let wpe = ShardedParam::new("weight", &[cfg.seq, cfg.dim], Init::std(1, INIT_STD))
            .build(&root.pp("wpe"))?;
        let h = root.pp("h");
        let blocks = (0..cfg.layers)
            .map(|i| GptBlock::new(tc, &h.pp(&i.to_string()), &cfg.block(i)))
            .collect::<Result<_>>()?;
        let ln_f = LayerNorm::new(&root.pp("ln_f"), cfg.dim, LN_EPS)?;
        Ok(Net {
            tc: tc.clone(),
            wte,
            wpe,
            blocks,
            ln_f,
            sequence_parallel: cfg.sequence_parallel && tc.size() > 1,
        })
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
            .iter()
            .flat_map(|b| b.sequence_partial())
            .collect();
        p.extend(self.ln_f.params());
        p
    }

    /// `ln_f`'s output for `ids` (B, T): (B, T, D), whole on every rank;
    /// with `dropout` after the embeddings and on every residual branch.
    fn hidden(&self, ids: &Tensor, dropout: Option<Dropout>) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let pos = self.wpe.tracked()?.narrow(0, 0, t)?;
        let mut h = self.wte.forward(ids)?.broadcast_add(&pos)?;
        // The positions this rank holds between the regions.
        let mine = if self.sequence_parallel {
            h = split_to_shards(&self.tc, &h, 1)?;
            chunk_range(t, self.tc.size(), self.tc.rank())
        } else {
            0..t
        };
        let dropout = dropout.filter(|d| d.p > 0.0).map(|d| {
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
        });
        if let Some(d) = &dropout {
            // GPT-2's embd_pdrop: the embeddings' sum, keyed as a block's.
            let mut s = d.seed;
            h = dropout_rows(&h, d.p, crate::rng::splitmix64(&mut s), &d.keys)?;
        }
        for block in &self.blocks {
            h = block.forward_with(&h, dropout.as_ref())?;
        }
        let h = self.ln_f.forward(&h)?;
        Ok(if self.sequence_parallel {
            allgather(&self.tc, &h, 1)?
        } else {
            copy_to_shards(&self.tc, &h)?
        })
    }

    /// The loss of `ids` against `targets`, both (B, T) token ids, the
    /// differentiable part scaled by 1 / `tokens` (the global batch's);
    /// `train`: for backward, with its dropout (`None`: evaluation).
    pub(super) fn loss(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        tokens: usize,
        train: Option<Dropout>,
    ) -> Result<Loss> {
        let (b, t) = ids.dims2()?;
        let h = self.hidden(ids, train)?;
        let d = h.dim(2)?;
        let labels = targets.flatten_all()?.to_vec1::<u32>()?;
        let (offset, vocab) = self.wte.rows();
        let out = sharded_softmax_cross_entropy(
            self.tc.comm(),
            &h.reshape((b * t, d))?,
            &self.wte.weight,
            offset,
            vocab,
            &labels,
            None,
            CrossEntropyConfig {
                margin: Margin::None,
                scale: 1.0,
                logits: DType::F32,
                backward: train.is_some(),
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
    /// (the whole vocabulary).
    pub(super) fn next_logits(&self, ids: &Tensor) -> Result<Tensor> {
        let h = self.hidden(ids, None)?;
        let last = h.narrow(1, h.dim(1)? - 1, 1)?.squeeze(1)?;
        Ok(last
            .matmul(&self.wte.weight.value().t()?)?
            .to_dtype(DType::F32)?)
    }

    /// The longest context (T, the positions `wpe` holds).
    pub(super) fn max_seq(&self) -> Result<usize> {
        Ok(self.wpe.value().dim(D::Minus2)?)
    }
}
