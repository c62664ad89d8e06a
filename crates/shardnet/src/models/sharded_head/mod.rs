//! The memory-balanced sharded classifier end to end, hybrid parallel: a
//! data-parallel MLP backbone feeding a [`ShardedClassifier`], as
//! `shardnet train face-head` (synthetic identities) and
//! `shardnet train mnist-arcface` (MNIST, ArcFace). [`HeadTraining`] plugs it
//! into the [shared training loop](crate::train::train), with a cosine learning
//! rate.
//!
//! One step on rank r of n, global batch B:
//! 1. rank r takes rows `chunk r` of the batch ([`chunk_sizes`](crate::comm::chunk_sizes)) through its
//!    replica of the backbone: features h_r (B_r, d), cast to the
//!    communication precision (f32, bf16 or f16);
//! 2. [`functions::allgather`]: every rank holds
//!    the B features; labels are known to every rank;
//! 3. the head's loss (the mean over B, identical everywhere) and accuracy;
//!    backward: local logits gradient, dW_r into the shard, each rank's
//!    share of dL/dh summed back to the sample's owner (reduce-scatter);
//! 4. [`allreduce_grads`] sums the backbone gradients (the loss was already
//!    a global mean: summing, not averaging, gives the one-device gradient);
//!    under half precision the [`LossScaler`] unscales and checks them;
//!    Adam steps the backbone (replicated) and W_r (sharded).
//!
//! With `--shard-state gradients` or `parameters` the backbone's weights
//! are shared out over the ranks too (ZeRO stages 2 and 3, as the MLP's
//! stages: `models::shares`): each layer reduce-scatters its weight's
//! gradient as its backward ends, the biases alone are allreduced, and
//! Adam steps each rank's shares; the same parameters bit for bit.
//!
//! **Synthetic identities** (`face-head`; no face data can be had here):
//! class c has a centre μ_c ∈ [−1, 1]^d drawn from (seed, c); a sample is
//! μ_c + σ·ε with ε uniform of unit variance and σ = 0.5, its class uniform
//! over C, all drawn from (seed, step, sample index), so every rank knows
//! every label and generates only its own rows. An "epoch" is
//! `steps_per_epoch` steps; the test set is 2048 fresh samples.
//!
//! **Cost per rank and step.** Bytes received: (B − B_r)·d·e + B·d·e·(n−1)/n
//! for the features and their gradient (e = 4, or 2 in half precision),
//! 2·(5B·4)(n−1)/n for the statistics, and the backbone's gradient
//! allreduce: none of it grows with C. Memory: W_r and the optimizer's slots
//! (SGD's momentum: 8·C_r·d bytes in all; Adam: 12·C_r·d; plus 4·C_r·d for
//! the gradient when unfused), B × C_r logits (4 or 2 bytes each), and the
//! backbone: equal on every rank up to one class row.
//!
//! The optimizer is `--optimizer sgd|adam|adamw`; by default the head's
//! rows are updated inside backward (the fused step), on the CPU kernels
//! and on the device-generic path alike. Fused, Partial FC is lazy as
//! InsightFace's: the sampled rows and their optimizer state (SGD's
//! momentum, Adam's moments) are stepped, the others left as they are,
//! weight decay included. Unfused (`--unfused-update`), unsampled rows get a
//! zero gradient and a dense step. A step the loss scaler skips skips the
//! backbone's update only: the fused head's gradient is computed in f32
//! from the logits and is finite whenever the loss is.
//!
//! `--naive-head` runs the scheme kept for the benchmark: each rank's logits
//! gathered on rank 0 (`functions::gather` of the transposed logits), which
//! alone runs the cross-entropy over B × C.

mod memory;

use super::shares::share_out;
use crate::comm::{chunk_range, Communicator};
use crate::data::{mnist, synchronized_iterator, Dataset, Identities, TensorDataset};
use crate::functions;
use crate::functions::Context;
use crate::functions::Margin;
use crate::links::ShardedClassifier;
use crate::nn::{Linear, Param, ParamStore, GATHER_BLOCK};
use crate::optim::{allreduce_grads, LossScaler, ShardState};
use crate::train::plan::{MemoryPlan, Placement};
use crate::train::{
    split_flags, ModelConfig, Options, Parts, Schedule, Size, StepOutput, Trace, TrainModel,
};
use crate::{Error, ReduceOp, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Where the samples come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// Seeded, class-clustered identities with `classes` classes.
    Synthetic {
        /// Steps per reported epoch.
        steps_per_epoch: usize,
    },
    /// MNIST (10 classes), from `data` (see [`crate::data::mnist`]).
    Mnist {
        /// Directory holding mnist/.
        data: Option<PathBuf>,
    },
}

/// Settings of one run (the command's flags).
#[derive(Clone, Debug)]
pub struct Config {
    /// The data.
    pub source: Source,
    /// C, the classes of the head (10 for MNIST).
    pub classes: usize,
    /// d, the feature dimension.
    pub dim: usize,
    /// Hidden widths of the backbone MLP, input to features (synthetic
    /// input is d wide; MNIST's 784).
    pub hidden: Vec<usize>,
    /// The head's margin.
    pub margin: Margin,
    /// s; default: the margin's.
    pub scale: Option<f64>,
    /// Features, their gradients and the logits in F32, BF16 or F16.
    pub precision: DType,
    /// Partial FC's rate r (1: full head).
    pub sample_rate: f64,
    /// Global batch B.
    pub batch_size: usize,
    /// Seed of everything.
    pub seed: u64,
    /// How the backbone's gradients are combined (Sum is right; Mean is the
    /// 1/n bug, kept to show it).
    pub backbone_reduce: ReduceOp,
    /// What the ranks share out of the backbone (`--shard-state`): nothing
    /// (each holds it whole, gradients allreduced), each weight's gradient
    /// and optimizer state (`gradients`, ZeRO stage 2: a layer
    /// reduce-scatters its gradient as its backward ends, its weight
    /// gathered once a step), or the weights too (`parameters`, ZeRO
    /// stage 3, FSDP's design: gathered for each pass). The biases stay
    /// whole; the head is sharded by class whatever this is.
    pub shard_state: ShardState,
    /// Apply the optimizer to the head's shard inside backward, class block
    /// by class block as the gradient is produced (the fused step: no
    /// gradient of the shard is held); `false` accumulates the gradient and
    /// steps after (`--unfused-update`).
    pub fused_update: bool,
    /// Compute the loss with the naive head instead: each shard's logits
    /// gathered (concatenated) on rank 0, which alone computes the softmax
    /// cross-entropy over B × C (plain logits only; for the benchmark).
    pub naive: bool,
    /// Epochs, steps, evaluation, progress; Adam's learning rate at the
    /// start, decaying to 0 along a cosine over the run.
    pub train: Options,
}

impl Config {
    /// The model's command name: `face-head` or `mnist-arcface`.
    pub fn command(&self) -> &'static str {
        match self.source {
            Source::Synthetic { .. } => "face-head",
            Source::Mnist { .. } => "mnist-arcface",
        }
    }

    /// `face-head` defaults: C classes of d-dimensional synthetic identities.
    pub fn face_head(classes: usize, dim: usize) -> Self {
        Config {
            source: Source::Synthetic {
                steps_per_epoch: 100,
            },
            classes,
            dim,
            hidden: vec![dim],
            margin: Margin::ArcFace { m: 0.5 },
            scale: None,
            precision: DType::F32,
            sample_rate: 1.0,
            batch_size: 256,
            seed: 0,
            backbone_reduce: ReduceOp::Sum,
            shard_state: ShardState::None,
            fused_update: true,
            naive: false,
            train: Options {
                epochs: 1,
                lr: 1e-2,
                schedule: Schedule::Cosine,
                ..Options::default()
            },
        }
    }

    /// Refuse a configuration that cannot train (before any rank builds
    /// anything): every size at least 1, a scale that is a finite number
    /// > 0, a sample rate in (0, 1], and the loop's settings.
    pub fn validate(&self) -> Result<()> {
        use crate::train::{at_least_one, positive};
        at_least_one("--classes", self.classes, "the head's classes")?;
        at_least_one("--dim", self.dim, "the feature dimension")?;
        at_least_one("--batch-size", self.batch_size, "the batch")?;
        if let Some(w) = self.hidden.iter().find(|w| **w == 0) {
            at_least_one("hidden", *w, "every hidden width")?;
        }
        if let Source::Synthetic { steps_per_epoch } = self.source {
            at_least_one("--steps-per-epoch", steps_per_epoch, "steps per epoch")?;
        }
        if let Some(s) = self.scale {
            positive("--scale", s)?;
        }
        if self.shard_state == ShardState::Optimizer {
            return Err(Error::Usage(
                "--shard-state optimizer: the head's optimizer state is sharded by class \
                 already; the backbone shares its gradients (gradients) or its weights too \
                 (parameters), or nothing (none)"
                    .into(),
            ));
        }
        if self.shares_backbone() && self.backbone_reduce != ReduceOp::Sum {
            return Err(Error::Usage(
                "a backbone shared out (--shard-state gradients or parameters) sums its \
                 gradients over the ranks; averaging them is the unsharded backbone's \
                 comparison only"
                    .into(),
            ));
        }
        if !(self.sample_rate > 0.0 && self.sample_rate <= 1.0) {
            return Err(Error::Usage(format!(
                "--sample-rate {}: Partial FC's rate is a fraction in (0, 1] (1: the full head)",
                self.sample_rate
            )));
        }
        self.train.validate()
    }

    /// Whether the backbone's weights are shared out over the ranks
    /// (`--shard-state gradients` or `parameters`).
    pub fn shares_backbone(&self) -> bool {
        matches!(
            self.shard_state,
            ShardState::Gradients | ShardState::Parameters
        )
    }

    /// `mnist-arcface` defaults: MLP 784–512–512–64, ArcFace (m = 0.5,
    /// s = 30) over 10 classes.
    pub fn mnist_arcface(data: Option<PathBuf>) -> Self {
        Config {
            source: Source::Mnist { data },
            classes: 10,
            dim: 64,
            hidden: vec![512, 512],
            scale: Some(30.0),
            batch_size: 128,
            train: Options {
                epochs: 5,
                lr: 1e-3,
                schedule: Schedule::Cosine,
                ..Options::default()
            },
            ..Config::face_head(10, 64)
        }
    }

    fn input_dim(&self) -> usize {
        match self.source {
            Source::Synthetic { .. } => self.dim,
            Source::Mnist { .. } => 784,
        }
    }
}

/// The model on one rank: the backbone replica and the head's shard.
#[doc(hidden)]
pub struct Model {
    /// Backbone layers (relu between them), replicated on every rank.
    pub backbone: Vec<Linear>,
    /// This rank's shard of the head.
    pub head: ShardedClassifier,
    /// Every parameter of this rank (the backbone's, then the head's shard).
    pub store: ParamStore,
}

impl Model {
    /// Build from the config: backbone layer l from (seed, l), uniform in
    /// ±1/√in, each weight shared out over the ranks of `comm` where the
    /// config says so (made whole once, this rank's chunk kept); the head
    /// from (seed, class).
    pub fn new(comm: &Context, cfg: &Config) -> Result<Self> {
        let mut widths = vec![cfg.input_dim()];
        widths.extend(&cfg.hidden);
        widths.push(cfg.dim);
        let store = ParamStore::new(comm.device(), cfg.seed);
        let shared = cfg.shares_backbone() && comm.size() > 1;
        let mut backbone = Vec::new();
        for (l, w) in widths.windows(2).enumerate() {
            let name = format!("backbone{l}");
            backbone.push(if shared {
                let whole = ParamStore::new(comm.device(), cfg.seed);
                let layer = whole.linear(&name, l, w[0], w[1])?;
                share_out(&layer, comm, cfg.shard_state, &store, GATHER_BLOCK)?
            } else {
                store.linear(&name, l, w[0], w[1])?
            });
        }
        let mut head = ShardedClassifier::new(comm, cfg.classes, cfg.dim, cfg.margin, cfg.seed)?;
        head.scale = cfg.scale.unwrap_or(cfg.margin.default_scale());
        head.logits = cfg.precision;
        head.sample_rate = cfg.sample_rate;
        store.register(head.weight.clone())?;
        Ok(Model {
            backbone,
            head,
            store,
        })
    }

    /// The backbone's parameters (a share of each weight where shared
    /// out).
    pub fn backbone_params(&self) -> Vec<Param> {
        self.backbone.iter().flat_map(|l| l.params()).collect()
    }

    /// The backbone's parameters whose gradients are allreduced after
    /// backward: all of them, or only the biases of layers whose weights
    /// are shared out (they reduce-scatter their gradients themselves).
    fn replicated_params(&self) -> Vec<Param> {
        self.backbone
            .iter()
            .flat_map(|l| {
                if l.is_shared_out() {
                    l.bias().cloned().into_iter().collect()
                } else {
                    l.params()
                }
            })
            .collect()
    }

    /// The backbone's weights kept whole since the last step (`--shard-state
    /// gradients`) dropped: the next pass gathers the shares again.
    fn forget_gathered(&self) {
        for l in &self.backbone {
            l.forget_gathered();
        }
    }

    /// This rank's rows → features (B_r, d), in `precision`.
    fn features(&self, x: &Tensor, precision: DType) -> Result<Tensor> {
        let mut h = x.clone();
        for (l, layer) in self.backbone.iter().enumerate() {
            h = layer.forward(&h)?;
            if l + 1 < self.backbone.len() {
                h = h.relu()?;
            }
        }
        Ok(h.to_dtype(precision)?)
    }

    /// Forward and backward of one global batch, of which `x` is this rank's
    /// rows; `loss_scale` multiplies the loss before backward. Returns
    /// (loss, correct). The backbone's gradients are this rank's share.
    pub fn forward_backward(
        &self,
        comm: &Context,
        x: &Tensor,
        labels: &[u32],
        precision: DType,
        loss_scale: f64,
    ) -> Result<(f64, usize)> {
        let h = self.features(x, precision)?;
        let all = functions::allgather(comm, &h, 0)?;
        let out = self.head.forward(&all, labels)?;
        let loss = out.loss.to_scalar::<f32>()? as f64;
        let mut grads = (out.loss * loss_scale)?.backward()?;
        self.store.absorb(&mut grads)?;
        Ok((loss, out.correct))
    }

    /// [`Model::forward_backward`] with the naive head: logits
    /// (B, C_r) on each rank, gathered transposed to (C, B) on rank 0, which
    /// computes the cross-entropy; backward scatters the logits' gradient.
    pub fn forward_backward_naive(
        &self,
        comm: &Context,
        x: &Tensor,
        labels: &[u32],
    ) -> Result<(f64, usize)> {
        if self.head.margin != Margin::None {
            return Err(Error::Usage(
                "the naive head has plain logits only: use --margin none".into(),
            ));
        }
        let all = functions::allgather(comm, &self.features(x, DType::F32)?, 0)?;
        let z = Linear::new(self.head.weight.clone(), None).forward(&all)?;
        let gathered = functions::gather(comm, &z.t()?.contiguous()?, 0, 0)?;
        if comm.rank() != 0 {
            let mut grads = gathered.sum_all()?.backward()?;
            self.store.absorb(&mut grads)?;
            return Ok((0.0, 0));
        }
        let logits = gathered.t()?;
        let t = Tensor::new(labels, comm.device())?;
        let loss = candle_nn::loss::cross_entropy(&logits, &t)?;
        let correct = crate::functions::top1_hits(&logits, &t)?;
        let value = loss.to_scalar::<f32>()? as f64;
        let mut grads = loss.backward()?;
        self.store.absorb(&mut grads)?;
        Ok((value, correct))
    }

    /// Top-1 correct over the full head (no sampling, no gradient), for a
    /// global batch of which `x` is this rank's rows.
    fn evaluate(&self, comm: &Context, x: &Tensor, labels: &[u32], p: DType) -> Result<usize> {
        let _eval = comm.no_grad();
        let all = functions::allgather(comm, &self.features(x, p)?, 0)?;
        Ok(self.head.evaluate(&all, labels)?.correct)
    }
}

/// The data of a run, on every rank.
enum Data {
    Synthetic,
    Mnist {
        train: TensorDataset,
        test: TensorDataset,
    },
}

/// The logits precision named `name` (`--precision`): `f32`, `bf16` or
/// `f16`.
pub fn parse_precision(name: &str) -> Result<DType> {
    match name {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        other => Err(Error::Usage(format!(
            "--precision {other}: use f32, bf16 or f16"
        ))),
    }
}

/// The synthetic identities of `cfg`: batch `step`, rows `rows` of it.
fn synthetic(
    cfg: &Config,
    step: u64,
    rows: std::ops::Range<usize>,
    device: &Device,
) -> Result<(Tensor, Vec<u32>)> {
    let ids = Identities {
        seed: cfg.seed,
        classes: cfg.classes,
        dim: cfg.dim,
    };
    ids.batch(step, cfg.batch_size, rows, device)
}

/// This rank's rows of a global batch of `b`.
fn my_rows(comm: &Communicator, b: usize) -> std::ops::Range<usize> {
    chunk_range(b, comm.size(), comm.rank())
}

/// MNIST rows `rows` of a batch (on `device`) and all its labels.
fn mnist_batch(
    ds: &TensorDataset,
    idx: &[usize],
    rows: std::ops::Range<usize>,
    device: &Device,
) -> Result<(Tensor, Vec<u32>)> {
    let b = ds.batch(idx)?;
    let (Some(x), Some(t)) = (b.x, b.t) else {
        return Err(Error::Usage("MNIST batch without data".into()));
    };
    let labels = t.to_dtype(DType::U32)?.to_vec1::<u32>()?;
    Ok((
        x.narrow(0, rows.start, rows.len())?.to_device(device)?,
        labels,
    ))
}

/// The hybrid model on this rank with its data, Adam and (under half
/// precision) loss scaler: what the [training loop](crate::train::train) drives.
pub struct HeadTraining {
    ctx: Context,
    cfg: Config,
    model: Model,
    data: Data,
    steps_per_epoch: usize,
    backbone: Vec<Param>,
    /// The backbone's parameters and the head's shard (the store is the
    /// model's, shared), what the optimizer updates, the shuffle (MNIST) and
    /// the loss scaler (half precision).
    parts: Parts,
}

impl HeadTraining {
    /// Build the backbone replica and this rank's head shard, read the data
    /// (MNIST on every rank) and set up Adam. Collective.
    pub fn new(comm: &Communicator, cfg: &Config) -> Result<Self> {
        let ctx = Context::new(comm);
        if cfg.batch_size < ctx.size() {
            return Err(Error::Usage(format!(
                "batch size {} is smaller than the {} ranks: every rank needs a sample",
                cfg.batch_size,
                ctx.size()
            )));
        }
        let model = Model::new(&ctx, cfg)?;
        let (data, it, steps_per_epoch) = match &cfg.source {
            Source::Synthetic { steps_per_epoch } => (Data::Synthetic, None, *steps_per_epoch),
            Source::Mnist { data } => {
                let (train, test) = mnist(data.as_deref())?;
                // Every rank read its own copy: the same shape everywhere.
                let shape = |d: &TensorDataset| format!("{:?}", d.x.dims());
                ctx.agree(
                    "MNIST files",
                    &[
                        ("training images".into(), shape(&train)),
                        ("test images".into(), shape(&test)),
                    ],
                )?;
                let it = synchronized_iterator(&ctx, train.len(), cfg.batch_size, cfg.seed)?;
                let steps = it.batches_per_epoch();
                (Data::Mnist { train, test }, Some(it), steps)
            }
        };
        let backbone = model.replicated_params();
        // The store holds the backbone's parameters, then the head's shard.
        let mut parts = Parts::new(model.store.clone(), &cfg.train.optimizer, cfg.train.lr, it)?;
        if cfg.fused_update && !cfg.naive {
            parts.opt.fuse(&model.head.weight)?;
        }
        parts.scaler = (cfg.precision != DType::F32).then(|| LossScaler::new(65536.0));
        Ok(HeadTraining {
            ctx,
            cfg: cfg.clone(),
            model,
            data,
            steps_per_epoch,
            backbone,
            parts,
        })
    }
}

impl TrainModel for HeadTraining {
    fn parts(&self) -> &Parts {
        &self.parts
    }

    fn parts_mut(&mut self) -> &mut Parts {
        &mut self.parts
    }

    fn name(&self) -> &str {
        self.cfg.command()
    }

    /// The backbone and the whole head (its shards joined by class), on
    /// rank 0. Collective.
    fn gather_params(&self) -> Result<Option<BTreeMap<String, Tensor>>> {
        self.parts.store.gather_whole(self.ctx.comm())
    }

    fn steps_per_epoch(&self) -> usize {
        self.steps_per_epoch
    }

    fn step(&mut self, step: usize, trace: &mut Trace) -> Result<StepOutput> {
        let (comm, cfg) = (&self.ctx, &self.cfg);
        let device = comm.device();
        let (x, labels) = match &self.data {
            Data::Mnist { train, .. } => {
                let idx = self.parts.iterator()?.next_indices();
                mnist_batch(train, &idx, my_rows(comm, idx.len()), device)?
            }
            Data::Synthetic => synthetic(cfg, step as u64, my_rows(comm, cfg.batch_size), device)?,
        };
        trace.start();
        // Weights kept whole are gathered again from the shares the last
        // step updated (or a checkpoint restored).
        self.model.forget_gathered();
        // Partial FC's sample follows the run's step (a resume included).
        self.model.head.set_step(step as u64);
        let scale = self.parts.scaler.as_ref().map_or(1.0, |s| s.scale);
        // The head's shard is updated inside backward (when fused), with
        // this step's rate and the gradient unscaled.
        self.parts.opt.prepare_fused(1.0 / scale);
        let (loss, correct) = if cfg.naive {
            self.model.forward_backward_naive(comm, &x, &labels)?
        } else {
            self.model
                .forward_backward(comm, &x, &labels, cfg.precision, scale)?
        };
        trace.lap("forward and backward");
        allreduce_grads(comm, &self.backbone, cfg.backbone_reduce)?;
        trace.lap("gradient allreduce");
        let finite = match self.parts.scaler.as_mut() {
            Some(s) => s.unscale(comm, self.parts.opt.params())?,
            None => true,
        };
        if finite {
            self.parts.opt.step()?;
        } else {
            // The fused head's update is already applied (its gradient is
            // computed in f32 from the logits and was finite); the
            // backbone's step is skipped.
            self.parts.opt.end_step();
        }
        trace.lap("step");
        Ok(StepOutput {
            loss,
            correct,
            samples: labels.len(),
            skipped: !finite,
        })
    }

    /// Test accuracy over the full head: MNIST's test set, or 2048 fresh
    /// synthetic samples.
    fn evaluate(&mut self) -> Result<f64> {
        self.model.forget_gathered();
        let (comm, cfg, model) = (&self.ctx, &self.cfg, &self.model);
        let device = comm.device();
        let (mut correct, mut total) = (0usize, 0usize);
        match &self.data {
            Data::Mnist { test, .. } => {
                let n = test.len();
                for start in (0..n).step_by(1000) {
                    let idx: Vec<usize> = (start..(start + 1000).min(n)).collect();
                    let (x, labels) = mnist_batch(test, &idx, my_rows(comm, idx.len()), device)?;
                    correct += model.evaluate(comm, &x, &labels, cfg.precision)?;
                    total += labels.len();
                }
            }
            Data::Synthetic => {
                for k in 0..2048usize.div_ceil(cfg.batch_size) {
                    let rows = my_rows(comm, cfg.batch_size);
                    let (x, labels) = synthetic(cfg, u64::MAX - k as u64, rows, device)?;
                    correct += model.evaluate(comm, &x, &labels, cfg.precision)?;
                    total += labels.len();
                }
            }
        }
        Ok(correct as f64 / total as f64)
    }

    fn epoch_note(&self) -> String {
        self.parts.scaler.as_ref().map_or(String::new(), |s| {
            format!(", loss scale {} ({} steps skipped)", s.scale, s.skipped)
        })
    }
}

impl ModelConfig for Config {
    type Training = HeadTraining;

    fn options(&self) -> &Options {
        &self.train
    }

    fn options_mut(&mut self) -> &mut Options {
        &mut self.train
    }

    fn validate(&self, _ranks: usize) -> Result<()> {
        Config::validate(self)
    }

    fn memory_plan(&self, placement: Placement) -> Option<MemoryPlan> {
        Some(MemoryPlan::new(self, placement))
    }

    fn build(&self, comm: &Communicator) -> Result<HeadTraining> {
        HeadTraining::new(comm, self)
    }

    fn size(&self) -> Option<Size> {
        Some(Size::count("--classes", self.classes))
    }

    fn with_size(&self, value: f64) -> Self {
        Config {
            classes: value as usize,
            ..self.clone()
        }
    }

    /// The classes over all the ranks, the backbone data parallel.
    fn splits(&self, ranks: usize) -> Vec<(String, Self)> {
        vec![(split_flags(&[("--ranks", ranks)]), self.clone())]
    }
}
