//! A GPT (GPT-2's architecture, pre-LN) trained on text, as `shardnet
//! train gpt`, split over a grid of t × p × d ranks: tensor parallel (t,
//! Megatron's way, optionally sequence parallel) inside a stage, pipelined
//! over p stages, data parallel (d) across the replicas.
//!
//! **The network.** Tokens (bytes, a vocabulary V of 256; or a BPE's V,
//! `--tokenizer bpe --vocab-size V`: [`Tokens`]) and positions
//! 0..T are embedded (`wte`, `wpe`), L [`GptBlock`](crate::links::GptBlock)s follow, then `ln_f`,
//! and the logits are h·wteᵀ (the output layer is the token embedding, as
//! GPT-2's). The loss is the mean next-token cross-entropy over the
//! batch's B·T tokens.
//!
//! **Tensor parallelism** (`--tensor-parallel t`, the ranks of a group):
//! the blocks are split by heads and hidden features
//! ([`GptBlock`](crate::links::GptBlock)'s table); the token embedding is split
//! by vocabulary rows ([`VocabParallelEmbedding`](crate::links::VocabParallelEmbedding)), and the same rows are
//! the LM head's, whose loss is the sharded softmax cross-entropy
//! ([`sharded_softmax_cross_entropy`](crate::functions::sharded_softmax_cross_entropy)): no rank ever holds the B·T × V
//! logits, only its B·T × V_r. `wpe`, the layer norms and the row-parallel
//! biases are whole on every rank of the group, and their gradients are
//! the same there.
//!
//! **Sequence parallelism** (`--sequence-parallel`, Korthikanti et al.
//! 2022): between the tensor-parallel regions each rank of a group holds
//! its positions `chunk_range(T, t, r)` only (the layer norms, residuals
//! and their activations 1/t), allgathered along the sequence into each
//! region and reduce-scattered out of it; the layer norms' and output
//! biases' gradients are summed over the group after backward.
//!
//! **Pipeline parallelism** (`--pipeline p`, `--micro-batches M`,
//! `--schedule`, `--virtual-stages`, `--balance`): the blocks are cut into
//! p·V chunks (by count, or by cost with the embedding and head counted on
//! the end stages), trained by [`Pipeline`](crate::links::Pipeline) under
//! any schedule (GPipe, 1F1B, interleaved, zero-bubble); the first stage
//! embeds, the last holds `ln_f` and the head with its own copy of `wte`,
//! whose gradient is summed with the first stage's (Megatron's tied
//! embeddings). With p = 1, M micro-batches are gradient accumulation.
//!
//! **Activation recomputation** (`--recompute none|selective|full`):
//! attention never keeps its T × T scores (its kernel recomputes the
//! softmax in backward: Korthikanti et al.'s selective recomputation,
//! always); `full` keeps only each block's input and runs the block again
//! in backward ([`recompute`](crate::functions::recompute)).
//!
//! **The optimizer's state sharded** (`--shard-state optimizer`, ZeRO
//! stage 1, with d > 1): each replica holds and updates its rows of every
//! parameter's AdamW moments; the gradients are reduce-scattered over the
//! replicas, the clip's norm summed over each replica's rows, and the
//! updated rows allgathered (the traffic of one allreduce). The parameters
//! are the unsharded run's (within the last bits of the clip's factor,
//! whose f64 sum is grouped by replica). With t > 1 the row-parallel
//! weights (sharded along their inputs) keep their whole state.
//!
//! **Fully sharded blocks** (`--shard-state parameters`, ZeRO stage 3,
//! PyTorch FSDP's design, with `--recompute full`): each replica holds a
//! share of every block's parameters, gradients and moments (a
//! tensor-parallel shard shared out along its own dimension); a
//! block's parameters are allgathered just before its forward and freed
//! after it, gathered again when backward recomputes it, and its
//! gradients reduce-scattered into the shares as soon as its backward is
//! done (`fsdp`; under sequence parallelism the group's parts of the
//! layer norms' gradients summed first). The embeddings and `ln_f` stay
//! whole, their gradients allreduced. The parameters are the unsharded run's (with full
//! recomputation) within the clip's last bits.
//!
//! **Mixed precision** (`--precision bf16`): every linear layer's GEMMs
//! (forward, dx and dW) and the head's logits take bf16 inputs and sum in
//! f32 ([`Linear::with_bf16`](crate::nn::Linear::with_bf16)); parameters,
//! gradients, AdamW's moments, the activations, attention, the layer norms,
//! the loss and all communication stay f32. bf16 needs no loss scale. A
//! split trains the one-device bf16 model to within bf16 rounding (one
//! activation rounded the other way where a split's f32 sums differ).
//!
//! **Data parallelism** (`--data-parallel d`; rank = (replica·p +
//! stage)·t + tensor-parallel position): every rank draws the same global
//! batch of B windows (each rank reads the corpus: a few MB), group g
//! takes rows `chunk_range(B, d, g)` of it, its loss is its tokens' sum
//! over all B·T, and the gradients are summed over the ranks at the same
//! place of each replica. So every grid trains the one-device model.
//!
//! **A step**: forward, backward, the gradients summed across the groups,
//! clipped by their global norm (`--clip-grad-norm`, over every split:
//! each sharded tensor's squares summed over the group, each whole one
//! counted once), the optimizer's step (AdamW by default) at the rate of a
//! warm-up then a cosine (`--lr-warmup`).
//!
//! The loop's throughput counts tokens (the progress line says tokens/s;
//! `--metrics`' `samples_per_s` is tokens per second), and its "test
//! accuracy" is the next-token accuracy on the validation text.
//!
//! **Sampling** ([`sample`], `shardnet sample`): the whole parameters on
//! one rank, one token at a time from the last T.
//!
//! **Tokens.** Bytes, or a BPE ([`crate::data::Tokenizer`]) that rank 0
//! learns from the training text, broadcasts, and writes as
//! `tokenizer.json` into `--checkpoint-dir` and beside `--save-params`
//! (`NAME.tokenizer.json`); a resumed run reads it back from the
//! checkpoint's directory. Bits per byte count the validation text's
//! bytes, whatever the tokens.
//!
//! **Parameters** (GPT-2's and nanoGPT's names; nanoGPT's
//! `torch.nn.Linear` layout (out, in)): `transformer.wte.weight` (V, D),
//! `transformer.wpe.weight` (T, D), per block i `transformer.h.{i}.` +
//! `ln_1.weight`, `ln_1.bias` (D), `attn.c_attn.weight` (3, D, D) — nanoGPT's
//! (3·D, D) with the same bytes, q, k, v in turn —, `attn.c_attn.bias`
//! (3, D), `attn.c_proj.weight` (D, D), `attn.c_proj.bias` (D), `ln_2.*`,
//! `mlp.c_fc.weight` (4D, D), `mlp.c_fc.bias` (4D), `mlp.c_proj.weight`
//! (D, 4D), `mlp.c_proj.bias` (D); `transformer.ln_f.weight`, `.bias`.
//! `lm_head.weight` is `transformer.wte.weight` (tied) and is not stored
//! twice. GELU is GPT-2's tanh form, LayerNorm's ε 1e-5, attention scaled
//! by 1/√d_h.
//!
//! **Dropout** (`--dropout p`, 0 by default as nanoGPT's): after the
//! embeddings and on each block's two residual branches (GPT-2's
//! `embd_pdrop` and `resid_pdrop`; attention's probabilities are not
//! dropped: the blocked attention never holds them). Each mask is drawn
//! from the run's seed, the step, the site and the element's global (batch
//! row, position), so every grid drops what one device would.

mod fsdp;
mod memory;
mod net;
mod sample;
mod training;

pub use sample::{config_of, sample, SampleConfig};
pub use training::GptTraining;

use crate::links::{Balance, BlockConfig, Costs, Plan, Schedule};
use crate::optim::ShardState;
use crate::train::plan::{MemoryPlan, Placement};
use crate::train::{at_least_one, divisors, split_flags, ModelConfig, Options, Size};
use crate::{Error, Result};
use candle_core::DType;
use std::path::PathBuf;

/// What is recomputed in backward rather than kept from forward
/// (`--recompute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    /// Everything backward needs is kept, but attention's scores: the
    /// attention kernel never keeps them (their softmax is recomputed in
    /// its backward from the rows' log-sum-exp), whatever this says.
    None,
    /// Korthikanti et al.'s selective recomputation: attention's softmax
    /// (and its dropout) recomputed. Here that is the attention kernel's
    /// own way, so the same as `None`.
    Selective,
    /// Each block from its input: a block keeps only its input until its
    /// backward, which runs its forward again first.
    Full,
}

impl std::str::FromStr for Recompute {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Recompute::None),
            "selective" => Ok(Recompute::Selective),
            "full" => Ok(Recompute::Full),
            _ => Err(Error::Usage(format!(
                "--recompute {s}: give none, selective (attention's softmax; always so here) \
                 or full (each block from its input)"
            ))),
        }
    }
}

/// How the text becomes tokens (`--tokenizer`, `--vocab-size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokens {
    /// Each byte a token: a vocabulary of 256.
    Bytes,
    /// A byte-level BPE of `vocab` tokens learned from the training text
    /// ([`Tokenizer::train_bpe`](crate::data::Tokenizer::train_bpe)); the
    /// model's vocabulary is `vocab` (rows the text cannot fill are never
    /// drawn as inputs).
    Bpe {
        /// Tokens: the 256 bytes and the merges.
        vocab: usize,
    },
}

/// Settings of one run (the command's flags).
#[derive(Clone, Debug)]
pub struct Config {
    /// Blocks L.
    pub layers: usize,
    /// Width D.
    pub dim: usize,
    /// Attention heads H.
    pub heads: usize,
    /// Tokens per window T (the context).
    pub seq: usize,
    /// Ranks of a tensor-parallel group t.
    pub tensor_parallel: usize,
    /// Data-parallel groups d; `None`: the ranks / t.
    pub data_parallel: Option<usize>,
    /// Megatron's sequence parallelism inside a tensor-parallel group.
    pub sequence_parallel: bool,
    /// Pipeline stages p (the blocks cut into p·V chunks).
    pub pipeline: usize,
    /// Micro-batches per step M: a group's rows split into M, their
    /// gradients accumulated (pipelined over the stages when p > 1).
    pub micro_batches: usize,
    /// The pipeline schedule; `None`: 1F1B with M > 1 (with one stage,
    /// each micro-batch's backward right after its forward, so gradient
    /// accumulation holds one micro-batch's activations), else GPipe (the
    /// same with one micro-batch).
    pub schedule: Option<Schedule>,
    /// Chunks per stage under the interleaved schedule (V); `None`: 2
    /// there, 1 under the others.
    pub virtual_stages: Option<usize>,
    /// How the blocks are cut into chunks.
    pub balance: Balance,
    /// The GEMMs' inputs: `DType::F32`, or `DType::BF16` (mixed
    /// precision: every linear layer's GEMMs and the head's logits on bf16
    /// inputs with f32 sums, see [`Linear::with_bf16`](crate::nn::Linear::with_bf16);
    /// parameters, gradients, optimizer state, activations, attention,
    /// layer norms and the loss in f32).
    pub precision: DType,
    /// What backward recomputes.
    pub recompute: Recompute,
    /// What the data-parallel replicas shard: nothing, or the optimizer's
    /// state (ZeRO stage 1).
    pub shard_state: ShardState,
    /// Windows per step (the global batch B).
    pub batch_size: usize,
    /// Dropout after the embeddings and on every residual branch (GPT-2's
    /// `embd_pdrop`, `resid_pdrop`); attention's probabilities are not
    /// dropped.
    pub dropout: f64,
    /// Clip the gradients to this global norm; `None`: no clipping.
    pub clip_grad_norm: Option<f64>,
    /// The text: a file or a directory (`None`: Debian's fortunes).
    pub corpus: Option<PathBuf>,
    /// Bytes or a BPE (`--tokenizer`, `--vocab-size`).
    pub tokens: Tokens,
    /// Where a BPE's `tokenizer.json` is written besides `--checkpoint-dir`
    /// (the command's `--save-params` sibling).
    pub tokenizer_copies: Vec<PathBuf>,
    /// Seed of the initialisation and the shuffle.
    pub seed: u64,
    /// Epochs, steps, the optimizer and its schedule, evaluation, progress.
    pub train: Options,
}

impl Default for Config {
    /// A small byte-level GPT: L = 4, D = 128, H = 4, T = 64, batch 32,
    /// AdamW (β = (0.9, 0.999), λ = 0.01) at 1e-3 with 100 steps of
    /// warm-up then a cosine, gradients clipped to norm 1, one epoch.
    fn default() -> Self {
        Config {
            layers: 4,
            dim: 128,
            heads: 4,
            seq: 64,
            tensor_parallel: 1,
            data_parallel: None,
            sequence_parallel: false,
            pipeline: 1,
            micro_batches: 1,
            schedule: None,
            virtual_stages: None,
            balance: Balance::Counts,
            recompute: Recompute::None,
            shard_state: ShardState::None,
            precision: DType::F32,
            batch_size: 32,
            dropout: 0.0,
            clip_grad_norm: Some(1.0),
            corpus: None,
            tokens: Tokens::Bytes,
            tokenizer_copies: Vec::new(),
            seed: 0,
            train: Options {
                epochs: 1,
                lr: 1e-3,
                optimizer: crate::optim::OptimizerConfig::adamw(),
                schedule: crate::train::Schedule::WarmupCosine { warmup: 100 },
                ..Options::default()
            },
        }
    }
}

impl Config {
    /// The grid on `ranks` ranks: (d groups, p stages, t ranks each),
    /// t × p × d = ranks.
    pub fn grid(&self, ranks: usize) -> Result<(usize, usize, usize)> {
        let (t, p) = (self.tensor_parallel, self.pipeline);
        let tp = t.saturating_mul(p);
        let d = self.data_parallel.unwrap_or(ranks / tp.max(1));
        if tp == 0 || d == 0 || tp.checked_mul(d) != Some(ranks) {
            let want = tp.max(1) * d.max(1);
            return Err(Error::Usage(format!(
                "--tensor-parallel {t} × --pipeline {p} × --data-parallel {} must be the {ranks} \
                 ranks: give --ranks {want} (or run under mpiexec -n {want}), or other factors",
                self.data_parallel
                    .map_or_else(|| "(ranks / t·p)".to_string(), |d| d.to_string()),
            )));
        }
        Ok((d, p, t))
    }

    /// The model's vocabulary: 256 bytes, or the BPE's tokens.
    pub fn vocab(&self) -> usize {
        match self.tokens {
            Tokens::Bytes => crate::data::BYTE_VOCAB,
            Tokens::Bpe { vocab } => vocab,
        }
    }

    /// The schedule (see [`Config::schedule`]).
    pub fn schedule(&self) -> Schedule {
        match self.schedule {
            Some(s) => s,
            None if self.micro_batches == 1 => Schedule::GPipe,
            None => Schedule::OneFOneB,
        }
    }

    /// Chunks per stage (V).
    pub fn virtual_stages(&self) -> usize {
        match (self.virtual_stages, self.schedule()) {
            (Some(v), _) => v,
            (None, Schedule::Interleaved) => 2,
            (None, _) => 1,
        }
    }

    /// Each block's forward cost per token (multiply-adds; the first with
    /// the embedding, the last with the head's logits).
    fn block_costs(&self) -> Vec<f64> {
        let (d, t) = (self.dim as f64, self.seq as f64);
        let mut c = vec![12.0 * d * d + 2.0 * t * d; self.layers];
        if let Some(last) = c.last_mut() {
            *last += self.vocab() as f64 * d;
        }
        c
    }

    /// The blocks of each global chunk (p·V of them; chunk c on stage
    /// c mod p), by `--balance`.
    pub fn chunks(&self) -> Result<Vec<std::ops::Range<usize>>> {
        let parts = self.pipeline.saturating_mul(self.virtual_stages());
        if parts > self.layers {
            return Err(Error::Usage(format!(
                "--pipeline {} with {} chunk(s) per stage needs at least {parts} blocks \
                 (--layers {}): give more --layers or fewer stages",
                self.pipeline,
                self.virtual_stages(),
                self.layers
            )));
        }
        self.balance.cut(&self.block_costs(), parts)
    }

    /// The chunks' costs for the schedule's plan: forward their blocks'
    /// multiply-adds, backward twice that, half of it the weights'.
    pub fn costs(&self, chunks: &[std::ops::Range<usize>]) -> Costs {
        let per = self.block_costs();
        let f: Vec<f64> = chunks.iter().map(|r| per[r.clone()].iter().sum()).collect();
        Costs {
            backward: f.iter().map(|x| 2.0 * x).collect(),
            weight: f.clone(),
            forward: f,
        }
    }

    /// Block i's shape and seeds.
    pub fn block(&self, i: usize) -> BlockConfig {
        BlockConfig {
            dim: self.dim,
            heads: self.heads,
            layers: self.layers,
            seed_layer: 2 + 4 * i,
            sequence_parallel: self.sequence_parallel && self.tensor_parallel > 1,
            bf16: self.precision == DType::BF16,
        }
    }

    /// Refuse a configuration that cannot train on `ranks` ranks, before
    /// any rank builds anything (every message names its flag).
    pub fn validate(&self, ranks: usize) -> Result<()> {
        at_least_one("--layers", self.layers, "blocks")?;
        at_least_one("--dim", self.dim, "the width")?;
        at_least_one("--heads", self.heads, "attention heads")?;
        at_least_one("--seq", self.seq, "the context")?;
        at_least_one(
            "--tensor-parallel",
            self.tensor_parallel,
            "ranks of a group",
        )?;
        at_least_one("--batch-size", self.batch_size, "the batch")?;
        at_least_one("--pipeline", self.pipeline, "stages")?;
        if !matches!(self.precision, DType::F32 | DType::BF16) {
            return Err(Error::Usage(format!(
                "--precision {:?}: the GPT trains in f32 or bf16",
                self.precision
            )));
        }
        at_least_one("--micro-batches", self.micro_batches, "micro-batches")?;
        if let Some(v) = self.virtual_stages {
            at_least_one("--virtual-stages", v, "chunks per stage")?;
            if v > 1 && self.schedule() != Schedule::Interleaved {
                return Err(Error::Usage(format!(
                    "--virtual-stages {v} gives each stage {v} chunks of blocks: it belongs to \
                     --schedule interleaved"
                )));
            }
        }
        self.block(0).validate()?;
        let (d, p, _) = self.grid(ranks)?;
        let chunks = self.chunks()?;
        Plan::new(
            self.schedule(),
            p,
            self.micro_batches,
            self.virtual_stages(),
            &self.costs(&chunks),
        )?;
        if self.micro_batches > self.batch_size / d {
            return Err(Error::Usage(format!(
                "--micro-batches {}: each of the {d} data-parallel group(s) has {} window(s) of \
                 the batch (--batch-size {}); give at most {}",
                self.micro_batches,
                self.batch_size / d,
                self.batch_size,
                self.batch_size / d
            )));
        }
        if self.batch_size < d {
            return Err(Error::Usage(format!(
                "--batch-size {}: fewer windows than the {d} data-parallel groups; give at \
                 least {d}",
                self.batch_size
            )));
        }
        if self.shard_state == ShardState::Gradients {
            return Err(Error::Usage(
                "--shard-state gradients: the GPT shards the optimizer's state (optimizer) or \
                 its blocks whole (parameters, with --recompute full)"
                    .into(),
            ));
        }
        if self.shard_state == ShardState::Parameters {
            if self.recompute != Recompute::Full {
                return Err(Error::Usage(
                    "--shard-state parameters gathers a block's parameters again when backward \
                     recomputes it: add --recompute full"
                        .into(),
                ));
            }
            if self.schedule() == Schedule::ZeroBubble {
                return Err(Error::Usage(
                    "--shard-state parameters hands a block's gradients on when its backward \
                     is done, which --schedule zero-bubble defers: give gpipe, 1f1b or \
                     interleaved"
                        .into(),
                ));
            }
        }
        if self.sequence_parallel {
            if self.tensor_parallel == 1 {
                return Err(Error::Usage(
                    "--sequence-parallel splits the sequence over a tensor-parallel group: it \
                     needs --tensor-parallel 2 or more"
                        .into(),
                ));
            }
            if self.seq < self.tensor_parallel {
                return Err(Error::Usage(format!(
                    "--sequence-parallel with --seq {} over --tensor-parallel {}: each rank \
                     needs a position; give --seq {} or more",
                    self.seq, self.tensor_parallel, self.tensor_parallel
                )));
            }
        }
        if let Tokens::Bpe { vocab } = self.tokens {
            if !(crate::data::BYTE_VOCAB + 1..=MAX_VOCAB).contains(&vocab) {
                return Err(Error::Usage(format!(
                    "--vocab-size {vocab}: a BPE holds the {} bytes and its merges; give {} to \
                     {MAX_VOCAB}",
                    crate::data::BYTE_VOCAB,
                    crate::data::BYTE_VOCAB + 1
                )));
            }
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::Usage(format!(
                "--dropout {}: a probability in [0, 1)",
                self.dropout
            )));
        }
        if let Some(c) = self.clip_grad_norm {
            crate::train::positive("--clip-grad-norm", c)?;
        }
        self.train.validate()
    }
}

/// The largest BPE vocabulary `--vocab-size` takes.
pub const MAX_VOCAB: usize = 1 << 20;

impl ModelConfig for Config {
    type Training = GptTraining;

    fn options(&self) -> &Options {
        &self.train
    }

    fn options_mut(&mut self) -> &mut Options {
        &mut self.train
    }

    fn validate(&self, ranks: usize) -> Result<()> {
        Config::validate(self, ranks)
    }

    fn memory_plan(&self, placement: Placement) -> Option<MemoryPlan> {
        Some(MemoryPlan::new(self, placement))
    }

    fn build(&self, comm: &crate::comm::Communicator) -> Result<GptTraining> {
        GptTraining::new(comm, self)
    }

    fn size(&self) -> Option<Size> {
        Some(Size {
            flag: "--dim",
            value: self.dim as f64,
            step: self.heads.max(1) as f64,
        })
    }

    fn with_size(&self, value: f64) -> Self {
        Config {
            dim: value as usize,
            ..self.clone()
        }
    }

    /// Every grid t × p × d of `ranks` (sequence parallelism kept where
    /// asked for and t > 1; the schedule, micro-batches and recomputation
    /// as they are).
    fn splits(&self, ranks: usize) -> Vec<(String, Self)> {
        let mut out = Vec::new();
        for t in divisors(ranks) {
            for p in divisors(ranks / t) {
                let d = ranks / t / p;
                let sp = self.sequence_parallel && t > 1;
                let mut flags = split_flags(&[
                    ("--tensor-parallel", t),
                    ("--pipeline", p),
                    ("--data-parallel", d),
                ]);
                if sp {
                    flags.push_str(" --sequence-parallel");
                }
                out.push((
                    flags,
                    Config {
                        tensor_parallel: t,
                        pipeline: p,
                        data_parallel: Some(d),
                        sequence_parallel: sp,
                        ..self.clone()
                    },
                ));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_is_the_ranks() {
        let cfg = Config {
            tensor_parallel: 2,
            ..Config::default()
        };
        assert_eq!(cfg.grid(4).unwrap(), (2, 1, 2));
        assert_eq!(cfg.grid(2).unwrap(), (1, 1, 2));
        assert!(cfg.grid(3).is_err());
        let cfg = Config {
            data_parallel: Some(3),
            ..cfg
        };
        assert_eq!(cfg.grid(6).unwrap(), (3, 1, 2));
        let e = cfg.grid(4).unwrap_err().to_string();
        assert!(e.contains("--ranks 6"), "{e}");
        let cfg = Config {
            pipeline: 2,
            data_parallel: None,
            ..cfg
        };
        assert_eq!(cfg.grid(8).unwrap(), (2, 2, 2));
        assert!(cfg.grid(6).is_err());
    }

    #[test]
    fn shapes_that_cannot_train_are_refused_by_flag() {
        let bad = |c: Config, flag: &str| {
            let e = c.validate(1).unwrap_err().to_string();
            assert!(e.contains(flag), "{e}");
        };
        bad(
            Config {
                heads: 3,
                ..Config::default()
            },
            "--heads 3",
        );
        bad(
            Config {
                layers: 0,
                ..Config::default()
            },
            "--layers",
        );
        bad(
            Config {
                clip_grad_norm: Some(0.0),
                ..Config::default()
            },
            "--clip-grad-norm",
        );
    }
}
