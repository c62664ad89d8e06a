//! VGG16 for 32×32 images with channel-parallel convolutions (ChainerMN's
//! channel-wise parallel example) and, beyond it, a 2-D grid of ranks:
//! `shardnet train vgg16`.
//!
//! **The network.** 13 convolutions (3×3, padding 1), each followed by
//! batch normalisation (optional; without it the convolutions have biases)
//! and ReLU, with 2×2 max pooling after the 2nd, 4th, 7th, 10th and 13th:
//!
//! ```text
//! 64 64 M 128 128 M 256 256 256 M 512 512 512 M 512 512 512 M
//! → dropout(0.5) → Linear(512, 512) → ReLU → dropout(0.5) → Linear(512, classes)
//! ```
//!
//! `--width W` scales every layer's channels (and the hidden 512) to
//! max(1, round(c·W)). Inputs: CIFAR-10 (3×32×32), seeded synthetic
//! 3×32×32 images, or MNIST / Fashion-MNIST padded to 32×32 (one channel).
//!
//! **The grid.** `--data-parallel G` arranges the n ranks as G groups of
//! P = n / G consecutive ranks. Inside a group every convolution's channels
//! are split over its P ranks as `--parallel-conv` says
//! ([`ChannelSplit`]: `none`, `grouped` — ChainerMN's
//! `ParallelConvolution2D` — `output`, `input`); everything else
//! (batch normalisation, pooling, the classifier) is replicated inside the
//! group — except with the exact splits, which keep activations split by
//! channels between convolutions and run batch normalisation, ReLU and
//! pooling on each rank's own channels. Across groups the batch is split (data parallelism): group g takes
//! chunk g of each global batch, batch normalisation uses the statistics of
//! the whole batch (ChainerMN's `MultiNodeBatchNormalization` over the
//! ranks holding the same channels) — or, with `--local-batch-norm`
//! ([`Config::batch_norm_slices`]), the statistics of each group's own
//! images, as PyTorch's DDP normalises — and gradients are summed over
//! those ranks. The loss is the mean over the global batch and dropout's masks are
//! drawn for the global batch, so with an exact split (`output`, `input`,
//! `none`) any grid trains the one-device model, to rounding (tested; with
//! `--local-batch-norm`, the one-device model normalising G slices of each
//! batch alone).
//!
//! **Data** (ChainerMN's multi-node iterator): rank 0 reads the dataset and
//! broadcasts each global batch; the other ranks iterate an empty dataset of
//! the same length, in step.
//!
//! **One step.** The channel group (color rank / P) and the data-parallel
//! group (color G + rank mod P) are `Context::split`s; group g keeps rows
//! `chunk_range(B, G, g)` of the batch. Each convolution is a
//! `links::ChannelConv2d`. With G > 1 the batch statistics are allreduced
//! over the data-parallel group inside the fused batch norm + ReLU op (+ the
//! 2 × 2 pooling where a stage ends), whose backward runs on the tape so
//! every rank reduces in the same order; a replica the epoch's last batch
//! leaves without images still makes every allreduce. With
//! `--local-batch-norm` one allreduce after the backward averages the
//! replicas' running statistics (their update is linear); on one rank the
//! same slices of the batch are normalised one by one (ghost batch norm),
//! the reference the tests compare with. The loss is the group's sum of
//! cross-entropies / B. With G > 1 the optimizer's state is shared out over
//! the data-parallel group (`Optimizer::shard_state`, ZeRO stage 1: each
//! replica holds the moments of its rows, `chunk_range` of dimension 0, of
//! every parameter that is no shard or a shard along dimension 0) and
//! `optim::sharded_step` runs the update: gradients reduce-scattered by rows
//! (`Communicator::reduce_scatter_slices`), each rank's rows stepped, the
//! rows allgathered into every rank's parameters (`allgather_slices`): the
//! same bits as an allreduce and a whole step. Checkpoints hold each
//! replica's rows as a shard of the global moments, so a run resumes on
//! another `--data-parallel`. With an exact split any (G, P) computes the
//! one-device gradients to f32 rounding (`tests/vgg16.rs`, at 1e-5).
//! `--shard-state none` allreduces the gradients and keeps the state whole.
//!
//! **Fully sharded** (`--shard-state parameters`, ZeRO stage 3, FSDP's
//! design): each replica keeps a share of every convolution's weight
//! (chunk r of the rank's weight along its channel split's dimension, or
//! along the output channels when it is whole), and so of its gradient and
//! Adam's moments. Each convolution gathers its weight over the replicas
//! when its forward runs and drops it after, keeping its input alone;
//! backward gathers it again and reduce-scatters the weight's gradient
//! into the share (`nn::Conv2d::fully_sharded`): no recomputation. Batch
//! norms and the classifier stay whole, their gradients allreduced. The
//! shares are registered under the usual names with a `Shard`, so
//! checkpoints reshard. The same sums as the unsharded run.
//! `--shard-state gradients` (ZeRO stage 2) shares out the gradients and
//! the state the same way but keeps each weight whole once gathered, from
//! the first pass of a step to the next step (one allgather a step).
//!
//! Bytes per step and rank, output split, P ranks, f32, ring collectives:
//! forward Σ_layers 4·b·H·W·C_out·(P−1)/P (gather-from), backward
//! Σ_layers 2·4·b·H·W·C_in·(P−1)/P (the input gradient's allreduce; none for
//! the first layer, whose input needs no gradient).

mod memory;

use crate::comm::{chunk_range, Communicator};
use crate::data::{
    cifar10, fashion_mnist, mnist, pad_images, synchronized_iterator, synthetic_images, Dataset,
    EmptyDataset, TensorDataset,
};
use crate::functions::{self as f, Context};
use crate::links::{
    ChannelConv2d, ChannelSplit, ConvConfig, InputParallelConv2d, OutputParallelConv2d,
};
use crate::nn::{dropout, max_pool2d, relu, BatchNorm2d, Linear, Param, ParamStore, StateTensor};
use crate::optim::{allreduce_grads, sharded_step, ShardState};
use crate::train::plan::{MemoryPlan, Placement};
use crate::train::{divisors, ModelConfig, Options, Parts, Size, StepOutput, Trace, TrainModel};
use crate::{Error, ReduceOp, Result};
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::path::PathBuf;

mod net;
mod training;

pub use training::Vgg16Training;

use net::Net;

/// VGG16's convolution widths; 0 marks a 2×2 max pooling.
pub const VGG16: [usize; 18] = [
    64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0,
];

/// The images a run trains on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageSet {
    /// CIFAR-10's binary files (`--data DIR`).
    Cifar10,
    /// Seeded synthetic 3×32×32 images of 10 classes (benchmarks).
    Synthetic,
    /// MNIST padded to 32×32.
    Mnist,
    /// Fashion-MNIST padded to 32×32.
    FashionMnist,
}

impl std::str::FromStr for ImageSet {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cifar10" => Ok(ImageSet::Cifar10),
            "synthetic" => Ok(ImageSet::Synthetic),
            "mnist" => Ok(ImageSet::Mnist),
            "fashion-mnist" => Ok(ImageSet::FashionMnist),
            other => Err(Error::Usage(format!(
                "unknown dataset '{other}' (use cifar10, synthetic, mnist or fashion-mnist)"
            ))),
        }
    }
}

impl ImageSet {
    /// Input channels.
    pub fn channels(&self) -> usize {
        match self {
            ImageSet::Cifar10 | ImageSet::Synthetic => 3,
            ImageSet::Mnist | ImageSet::FashionMnist => 1,
        }
    }
}

/// Settings of one run (the command's flags).
#[derive(Clone, Debug)]
pub struct Config {
    /// How each convolution's channels are split inside a group.
    pub split: ChannelSplit,
    /// Channel multiplier W.
    pub width: f64,
    /// Batch normalisation after each convolution.
    pub batch_norm: bool,
    /// Data-parallel groups G (the ranks form G × n/G).
    pub data_parallel: usize,
    /// Batch normalisation's statistics: `None`, over the whole global
    /// batch (synchronised across the G groups: the one-device model);
    /// `Some(K)`, over each of K slices of it alone ([`chunk_range`]'s,
    /// as the groups split the batch). K must be G (`--local-batch-norm`:
    /// each replica normalises its own images, as PyTorch's DDP and
    /// ChainerMN's plain `BatchNormalization` do, with no communication)
    /// or, on G = 1, any number: ghost batch normalisation, the same
    /// function on one device. The running statistics are the mean of the
    /// slices' (each slice updates them from the same values; the replicas
    /// average theirs after each step).
    pub batch_norm_slices: Option<usize>,
    /// Dropout probability in the classifier.
    pub dropout: f64,
    /// Global batch size (split over the groups).
    pub batch_size: usize,
    /// Seed of the initialisation, the shuffle and dropout.
    pub seed: u64,
    /// The images.
    pub dataset: ImageSet,
    /// Where CIFAR-10 / MNIST are.
    pub data: Option<PathBuf>,
    /// Training examples of the synthetic set (its test set is 1/5 of it).
    pub synthetic_examples: usize,
    /// What the data-parallel groups shard: nothing, the optimizer's state
    /// (ZeRO stage 1, the default), the convolutions' gradients and state
    /// (ZeRO stage 2) or their weights too (ZeRO stage 3). Nothing without
    /// groups.
    pub shard_state: ShardState,
    /// Epochs, steps, Adam's learning rate, evaluation, progress.
    pub train: Options,
}

impl Config {
    /// Defaults: output-channel parallel, width 1, batch norm, batch 32,
    /// Adam at 1e-3, 1 epoch of MNIST.
    pub fn new(split: ChannelSplit) -> Self {
        Config {
            split,
            width: 1.0,
            batch_norm: true,
            data_parallel: 1,
            batch_norm_slices: None,
            dropout: 0.5,
            batch_size: 32,
            seed: 0,
            dataset: ImageSet::Mnist,
            data: None,
            synthetic_examples: 10_000,
            shard_state: ShardState::Optimizer,
            train: Options {
                epochs: 1,
                lr: 1e-3,
                ..Options::default()
            },
        }
    }

    /// Channels of a layer of `c` at this width.
    pub fn scaled(&self, c: usize) -> usize {
        ((c as f64 * self.width).round() as usize).max(1)
    }

    /// Refuse what cannot train (before any rank builds anything).
    pub fn validate(&self) -> Result<()> {
        use crate::train::at_least_one;
        if !(self.width.is_finite() && self.width > 0.0) {
            return Err(Error::Usage(format!(
                "--width {}: give a positive channel multiplier (0.25 for quick runs)",
                self.width
            )));
        }
        if self.scaled(512) > 1 << 16 {
            return Err(Error::Usage(format!(
                "--width {}: {} channels per layer is more than this model takes",
                self.width,
                self.scaled(512)
            )));
        }
        at_least_one("--batch-size", self.batch_size, "the batch")?;
        at_least_one("--data-parallel", self.data_parallel, "the groups")?;
        if self.batch_size < self.data_parallel {
            return Err(Error::Usage(format!(
                "--batch-size {} is smaller than --data-parallel {}: every group needs an example",
                self.batch_size, self.data_parallel
            )));
        }
        if let Some(k) = self.batch_norm_slices {
            self.validate_slices(k)?;
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::Usage(format!(
                "--dropout {}: give a probability in [0, 1)",
                self.dropout
            )));
        }
        if self.dataset == ImageSet::Synthetic {
            at_least_one("--synthetic-examples", self.synthetic_examples, "examples")?;
        }
        let sharded = matches!(
            self.shard_state,
            ShardState::Gradients | ShardState::Parameters
        );
        if sharded && self.split == ChannelSplit::Grouped {
            return Err(Error::Usage(format!(
                "--shard-state {} with --parallel-conv grouped: ChainerMN's grouped layer is not \
                 sharded over the replicas; give --parallel-conv output, input or none",
                self.shard_state
            )));
        }
        self.train.validate()
    }

    /// Refuse batch norm over `k` slices where it cannot be done.
    fn validate_slices(&self, k: usize) -> Result<()> {
        if !self.batch_norm {
            return Err(Error::Usage(
                "--local-batch-norm with --no-batch-norm: there is no batch normalisation to \
                 make local; drop one of the two"
                    .into(),
            ));
        }
        let g = self.data_parallel;
        if g == 1 && k == 1 {
            // From the command line: one replica is the whole batch.
            return Err(Error::Usage(
                "--local-batch-norm normalises each data-parallel replica's images alone; with \
                 --data-parallel 1 there is one replica and the flag would change nothing: give \
                 --data-parallel G > 1, or drop it"
                    .into(),
            ));
        }
        if k == 0 || (g > 1 && k != g) {
            return Err(Error::Usage(format!(
                "batch norm over {k} slices of the batch on --data-parallel {g}: the slices are \
                 the replicas' (--local-batch-norm), or any number on one replica"
            )));
        }
        if self.batch_size < k {
            return Err(Error::Usage(format!(
                "--batch-size {} is smaller than the {k} slices batch norm normalises alone: \
                 every slice needs an image",
                self.batch_size
            )));
        }
        Ok(())
    }

    /// The grid on `ranks` ranks: (groups G, ranks per group P), or an error
    /// when G does not divide them.
    pub fn grid(&self, ranks: usize) -> Result<(usize, usize)> {
        let g = self.data_parallel;
        if !ranks.is_multiple_of(g) {
            return Err(Error::Usage(format!(
                "--data-parallel {g} does not divide {ranks} ranks: the ranks form groups of \
                 equal size"
            )));
        }
        Ok((g, ranks / g))
    }
}

impl ModelConfig for Config {
    type Training = Vgg16Training;

    fn options(&self) -> &Options {
        &self.train
    }

    fn options_mut(&mut self) -> &mut Options {
        &mut self.train
    }

    fn validate(&self, ranks: usize) -> Result<()> {
        Config::validate(self)?;
        self.grid(ranks).map(|_| ())
    }

    fn memory_plan(&self, placement: Placement) -> Option<MemoryPlan> {
        Some(MemoryPlan::new(self, placement))
    }

    fn build(&self, comm: &Communicator) -> Result<Vgg16Training> {
        Vgg16Training::new(comm, self)
    }

    fn size(&self) -> Option<Size> {
        Some(Size {
            flag: "--width",
            value: self.width,
            step: 1.0 / 64.0,
        })
    }

    fn with_size(&self, value: f64) -> Self {
        Config {
            width: value,
            ..self.clone()
        }
    }

    /// G data-parallel groups of n / G ranks, each split exactly by its
    /// output or input channels (not split on one rank a group); the
    /// grouped split is another model, and left out.
    fn splits(&self, ranks: usize) -> Vec<(String, Self)> {
        let mut out = Vec::new();
        for g in divisors(ranks) {
            let kinds: &[ChannelSplit] = if ranks / g == 1 {
                &[ChannelSplit::None]
            } else {
                &[ChannelSplit::Output, ChannelSplit::Input]
            };
            for &split in kinds {
                let mut flags = Vec::new();
                if ranks > 1 {
                    flags.push(format!("--parallel-conv {split}"));
                }
                if g > 1 {
                    flags.push(format!("--data-parallel {g}"));
                }
                let flags = if flags.is_empty() {
                    "one rank".to_string()
                } else {
                    flags.join(" ")
                };
                out.push((
                    flags,
                    Config {
                        split,
                        data_parallel: g,
                        ..self.clone()
                    },
                ));
            }
        }
        out
    }
}
