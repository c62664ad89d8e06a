//! A run's settings ([`Config`]: the command's flags) and how stages are
//! placed on ranks ([`Balance`]), checked before any rank builds.

use super::super::digits::Digits;
use super::layer_dims;
pub use crate::links::Balance;
use crate::links::{Costs, Plan, Schedule};
use crate::train::Options;
use crate::{Error, Result};
use std::path::PathBuf;

/// Settings of one run (the command's flags).
#[derive(Clone, Debug)]
pub struct Config {
    /// Hidden units U.
    pub units: usize,
    /// Stages S; default: 2 (ChainerMN's split), or the number of ranks if
    /// larger.
    pub stages: Option<usize>,
    /// Examples per step.
    pub batch_size: usize,
    /// Micro-batches per step; 1: no pipelining.
    pub micro_batches: usize,
    /// Data-parallel groups G: the ranks form G pipelines of ranks/G
    /// ranks, each training on its share of every batch.
    pub data_parallel: usize,
    /// What the groups shard (`--shard-state`): nothing, the optimizer's
    /// state (ZeRO stage 1), the gradients too (stage 2) or the weights
    /// too (stage 3). Nothing with one group.
    pub shard_state: crate::optim::ShardState,
    /// With the weights shared out (`--shard-state parameters`): the most
    /// bytes of a weight a layer gathers at a time (`--gather-block-mib`;
    /// 0: whole), so that a pass holds a block of the weight and of its
    /// gradient, not the whole of either ([`crate::nn::Linear::with_gather_block`]).
    pub gather_block: usize,
    /// The pipeline schedule; `None`: the fastest that fits
    /// ([`Config::schedule_on`]).
    pub schedule: Option<Schedule>,
    /// Chunks per rank under the interleaved schedule (V); `None`: 2 there,
    /// 1 under the others.
    pub virtual_stages: Option<usize>,
    /// How stages are cut into chunks.
    pub balance: Balance,
    /// Seed of the initialisation and the shuffle.
    pub seed: u64,
    /// Where the data are (see [`crate::data::mnist`]).
    pub data: Option<PathBuf>,
    /// Which 28×28, 10-class dataset: MNIST or Fashion-MNIST.
    pub dataset: Digits,
    /// Epochs, steps, Adam's (constant) learning rate, evaluation, progress.
    pub train: Options,
}

impl Config {
    /// (data-parallel groups, ranks per pipeline) on `ranks` ranks; an
    /// error when the groups do not divide the ranks. The methods below
    /// that take a rank count take the pipeline's.
    pub fn grid(&self, ranks: usize) -> Result<(usize, usize)> {
        let g = self.data_parallel.max(1);
        if !ranks.is_multiple_of(g) {
            return Err(Error::Usage(format!(
                "--data-parallel {g} does not divide the {ranks} ranks: give a divisor of \
                 {ranks}, or run on a multiple of {g} ranks (each group is one pipeline of \
                 ranks/{g} ranks)"
            )));
        }
        Ok((g, ranks / g))
    }

    /// The stage count on `ranks` ranks: `--stages`, else one per rank (at
    /// least 2).
    pub fn stages_on(&self, ranks: usize) -> usize {
        self.stages.unwrap_or(2.max(ranks))
    }

    /// The schedule on `ranks` ranks: `--schedule`, else the fastest that
    /// fits: with one rank or one micro-batch every schedule is the same
    /// (GPipe); otherwise zero-bubble, whose simulated time is the least of
    /// the schedules with one chunk per rank and which holds at most
    /// 2(p − r) micro-batches on rank r (GPipe: all M).
    pub fn schedule_on(&self, ranks: usize) -> Schedule {
        match self.schedule {
            Some(s) => s,
            None if ranks == 1 || self.micro_batches == 1 => Schedule::GPipe,
            None => Schedule::ZeroBubble,
        }
    }

    /// Chunks per rank (V).
    pub fn virtual_stages_on(&self, ranks: usize) -> usize {
        match (self.virtual_stages, self.schedule_on(ranks)) {
            (Some(v), _) => v,
            (None, Schedule::Interleaved) => 2,
            (None, _) => 1,
        }
    }

    /// Refuse stage counts no machine here holds before anything is sized
    /// by them (the plan's vectors, the layers): the chunks overflow, or
    /// the layers' parameters, gradients and optimizer state, even of one
    /// unit each, exceed the memory this machine has for all `ranks` ranks.
    /// (The memory plan then weighs the units.)
    pub(super) fn check_size(&self, ranks: usize) -> Result<()> {
        let stages = self.stages_on(ranks);
        let v = self.virtual_stages_on(ranks);
        if ranks.checked_mul(v).is_none() {
            return Err(Error::Usage(format!(
                "--virtual-stages {v}: {ranks} ranks × {v} chunks overflow; give at most \
                 {} (each chunk needs a stage)",
                stages / ranks.max(1)
            )));
        }
        // The stage count alone (one unit a layer; the plan weighs the
        // units): what sizes the plan's own vectors.
        let per_stage = crate::train::plan::linear_bytes(1.0, 1.0);
        let bytes = stages as f64 * per_stage * (2 + self.train.optimizer.slots()) as f64;
        if !crate::train::plan::check_enabled() {
            return Ok(());
        }
        let available = crate::train::plan::available_memory()?;
        if available.bytes != u64::MAX && bytes > available.bytes as f64 * ranks as f64 {
            return Err(Error::Usage(format!(
                "--stages {stages}: so many layers need at least {} for their parameters, \
                 gradients and optimizer state, even of one unit each: more than {ranks} rank(s) \
                 × {} (the memory available here) hold; give fewer --stages",
                crate::train::plan::bytes(bytes),
                crate::train::plan::bytes(available.bytes as f64)
            )));
        }
        Ok(())
    }

    /// Each stage's cost: its layers' multiply-adds per example.
    fn stage_costs(&self, stages: usize) -> Vec<f64> {
        (0..stages)
            .map(|s| {
                let mut layers = vec![s];
                if s + 1 == stages {
                    layers.push(stages);
                }
                layers
                    .into_iter()
                    .map(|l| {
                        let (i, o) = layer_dims(l, stages, self.units);
                        (i * o) as f64
                    })
                    .sum()
            })
            .collect()
    }

    /// The stages of each global chunk (p·V of them; chunk c on rank
    /// c mod p), by `--balance`.
    pub fn chunks_on(&self, ranks: usize) -> Result<Vec<std::ops::Range<usize>>> {
        let stages = self.stages_on(ranks);
        let chunks = ranks.saturating_mul(self.virtual_stages_on(ranks));
        if stages < chunks {
            return Err(Error::Usage(format!(
                "{ranks} ranks with {} chunks each need at least {chunks} stages (--stages \
                 {stages}): give --stages {chunks} or more{}",
                chunks / ranks,
                if chunks > ranks {
                    ", or fewer --virtual-stages"
                } else {
                    ""
                }
            )));
        }
        self.balance.cut(&self.stage_costs(stages), chunks)
    }

    /// The pipeline's plan for a full batch on `ranks` ranks, simulated
    /// with each chunk's estimated costs (forward = its multiply-adds,
    /// backward twice that, half of it the weight gradients).
    pub fn pipeline_plan(&self, ranks: usize) -> Result<std::sync::Arc<Plan>> {
        let chunks = self.chunks_on(ranks)?;
        let v = self.virtual_stages_on(ranks);
        let m = self.micro_batches;
        Plan::new(
            self.schedule_on(ranks),
            ranks,
            m,
            v,
            &self.costs(ranks, &chunks),
        )
    }

    pub(super) fn costs(&self, ranks: usize, chunks: &[std::ops::Range<usize>]) -> Costs {
        let per_stage = self.stage_costs(self.stages_on(ranks));
        let f: Vec<f64> = chunks
            .iter()
            .map(|r| per_stage[r.clone()].iter().sum())
            .collect();
        Costs {
            backward: f.iter().map(|x| 2.0 * x).collect(),
            weight: f.clone(),
            forward: f,
        }
    }

    /// Refuse a configuration that cannot train (before any rank builds
    /// anything): every size at least 1, micro-batches no more than the
    /// batch, and the loop's settings ([`Options::validate`]).
    pub fn validate(&self) -> Result<()> {
        use crate::train::at_least_one;
        at_least_one("--units", self.units, "hidden units")?;
        at_least_one("--batch-size", self.batch_size, "the batch")?;
        if let Some(s) = self.stages {
            at_least_one("--stages", s, "stages")?;
        }
        if let Some(v) = self.virtual_stages {
            at_least_one("--virtual-stages", v, "chunks per rank")?;
            if v > 1 && self.schedule != Some(Schedule::Interleaved) {
                return Err(Error::Usage(format!(
                    "--virtual-stages {v} gives each rank {v} chunks of layers: it belongs to \
                     --schedule interleaved"
                )));
            }
        }
        at_least_one("--data-parallel", self.data_parallel, "the groups")?;
        let g = self.data_parallel;
        if self.batch_size < g {
            return Err(Error::Usage(format!(
                "--batch-size {} is smaller than --data-parallel {g}: each group needs an example \
                 of every batch",
                self.batch_size
            )));
        }
        let most = self.batch_size / g;
        if self.micro_batches == 0 || self.micro_batches > most {
            return Err(Error::Usage(format!(
                "--micro-batches {}: give 1 to {most} (the batch size{}); each micro-batch needs \
                 an example",
                self.micro_batches,
                if g > 1 {
                    format!(" over the {g} data-parallel groups")
                } else {
                    String::new()
                }
            )));
        }
        self.train.validate()
    }
}

impl Default for Config {
    /// ChainerMN's example: U = 100, 2 stages, batch 100, Adam at 1e-3,
    /// 5 epochs of MNIST.
    fn default() -> Self {
        Config {
            units: 100,
            stages: None,
            batch_size: 100,
            micro_batches: 1,
            data_parallel: 1,
            shard_state: crate::optim::ShardState::Optimizer,
            gather_block: crate::nn::GATHER_BLOCK,
            schedule: None,
            virtual_stages: None,
            balance: Balance::Counts,
            seed: 0,
            data: None,
            dataset: Digits::Mnist,
            train: Options {
                epochs: 5,
                lr: 1e-3,
                ..Options::default()
            },
        }
    }
}
