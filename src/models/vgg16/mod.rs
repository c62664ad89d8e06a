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
//! ranks holding the same channels), and gradients are summed over those
//! ranks. The loss is the mean over the global batch and dropout's masks are
//! drawn for the global batch, so with an exact split (`output`, `input`,
//! `none`) any grid trains the one-device model, to rounding (tested).
//!
//! **Data** (ChainerMN's multi-node iterator): rank 0 reads the dataset and
//! broadcasts each global batch; the other ranks iterate an empty dataset of
//! the same length, in step.

mod memory;

use crate::comm::{chunk_range, Communicator};
use crate::data::{
    cifar10, fashion_mnist, mnist, pad_images, synchronized_iterator, synthetic_images, Dataset,
    EmptyDataset, TensorDataset,
};
use crate::functions::{self as f, Context};
use crate::links::{ChannelConv2d, ChannelSplit, InputParallelConv2d, OutputParallelConv2d};
use crate::nn::{dropout, max_pool2d, relu, BatchNorm2d, Linear, Param, ParamStore, StateTensor};
use crate::optim::allreduce_grads;
use crate::train::plan::{MemoryPlan, Placement};
use crate::train::{ModelConfig, Options, Parts, StepOutput, Trace, TrainModel};
use crate::{Error, ReduceOp, Result};
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::path::PathBuf;

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
            dropout: 0.5,
            batch_size: 32,
            seed: 0,
            dataset: ImageSet::Mnist,
            data: None,
            synthetic_examples: 10_000,
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
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::Usage(format!(
                "--dropout {}: give a probability in [0, 1)",
                self.dropout
            )));
        }
        if self.dataset == ImageSet::Synthetic {
            at_least_one("--synthetic-examples", self.synthetic_examples, "examples")?;
        }
        self.train.validate()
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

/// One convolution as this rank holds it.
enum Conv {
    /// The drop-in forms (whole, ChainerMN's grouped): replicated
    /// activations in and out.
    Replicated(ChannelConv2d),
    /// Exact, output channels: the whole input in, this rank's output
    /// channels out.
    Output(OutputParallelConv2d),
    /// Exact, input channels on channel-sharded activations: this rank's
    /// channels in and out.
    Input(InputParallelConv2d),
}

/// The network on one rank.
struct Net {
    ctx: Context,
    split: ChannelSplit,
    convs: Vec<Conv>,
    norms: Vec<Option<BatchNorm2d>>,
    fc1: Linear,
    fc2: Linear,
}

impl Net {
    fn new(cfg: &Config, cc: &Context, dp: Option<&Context>, store: &ParamStore) -> Result<Self> {
        let (mut convs, mut norms) = (Vec::new(), Vec::new());
        let mut cin = cfg.dataset.channels();
        let (n, r) = (cc.size(), cc.rank());
        for (k, &c) in VGG16.iter().filter(|c| **c > 0).enumerate() {
            let cout = cfg.scaled(c);
            let name = format!("conv{}", k + 1);
            let bias = !cfg.batch_norm;
            let ch = (cin, cout);
            let conv = match cfg.split {
                ChannelSplit::Output => Conv::Output(
                    OutputParallelConv2d::new(cc, store, &name, k, ch, 3, 1, 1, bias)?
                        .sharded_output(),
                ),
                ChannelSplit::Input => Conv::Input(InputParallelConv2d::new_sharded(
                    cc, store, &name, k, ch, 3, 1, 1, bias,
                )?),
                split => Conv::Replicated(ChannelConv2d::new(
                    cc, store, split, &name, k, cin, cout, 3, 1, 1, bias,
                )?),
            };
            convs.push(conv);
            let bn_name = format!("bn{}", k + 1);
            norms.push(if cfg.batch_norm {
                // Sharded activations: each rank normalises its channels.
                let bn = match cfg.split {
                    ChannelSplit::Output | ChannelSplit::Input => {
                        BatchNorm2d::new_shard(store, &bn_name, chunk_range(cout, n, r), cout)?
                    }
                    _ => BatchNorm2d::new(store, &bn_name, cout)?,
                };
                Some(match dp {
                    Some(dp) => bn.multi_node(dp.clone()),
                    None => bn,
                })
            } else {
                None
            });
            cin = cout;
        }
        let hidden = cfg.scaled(512);
        Ok(Net {
            ctx: cc.clone(),
            split: cfg.split,
            convs,
            norms,
            fc1: store.linear("fc1", 13, cin, hidden)?,
            fc2: store.linear("fc2", 14, hidden, 10)?,
        })
    }

    /// Logits of this group's images `x` (b, C, 32, 32); dropout masks are
    /// rows `rows` of the global batch's (`global` rows), drawn from `seed`.
    ///
    /// With an exact split the activations stay split by channels between
    /// the convolutions (batch norm, ReLU and pooling are per channel, so
    /// each rank runs them on its own): `output` gathers them after each
    /// block (after the pooling, where there is one), `input` never until
    /// the classifier.
    fn forward(
        &self,
        x: &Tensor,
        train: bool,
        drop: Option<(f64, u64, std::ops::Range<usize>, usize)>,
    ) -> Result<Tensor> {
        let ctx = &self.ctx;
        // The images need no gradient: each rank takes its channels locally.
        let mut h = match self.split {
            ChannelSplit::Input => {
                let own = chunk_range(x.dims()[1], ctx.size(), ctx.rank());
                x.narrow(1, own.start, own.len())?
            }
            _ => x.clone(),
        };
        let mut layer = 0;
        for (at, &c) in VGG16.iter().enumerate() {
            if c == 0 {
                continue;
            }
            h = match &self.convs[layer] {
                Conv::Replicated(conv) => conv.forward(&h)?,
                Conv::Output(conv) => conv.forward(&h)?,
                Conv::Input(conv) => conv.forward(&h)?,
            };
            if let Some(bn) = &self.norms[layer] {
                h = bn.forward(&h, train)?;
            }
            h = relu(&h)?;
            if VGG16.get(at + 1) == Some(&0) {
                h = max_pool2d(&h, 2)?;
            }
            let last = layer + 1 == self.convs.len();
            h = match &self.convs[layer] {
                Conv::Output(_) => f::allgather_replicated(ctx, &h, 1)?,
                Conv::Input(_) if last => f::allgather_replicated(ctx, &h, 1)?,
                _ => h,
            };
            layer += 1;
        }
        let mut h = h.flatten_from(1)?;
        let masked = |h: &Tensor, which: u64| -> Result<Tensor> {
            match (&drop, train) {
                (Some((p, seed, rows, global)), true) if *p > 0.0 => {
                    // The global batch's mask, this group's rows: any grid
                    // drops the same elements of the same example.
                    let ones = Tensor::ones((*global, h.dims()[1]), h.dtype(), h.device())?;
                    let mask = dropout(&ones, *p, seed ^ which.wrapping_mul(0x9E37_79B9))?;
                    Ok(h.mul(&mask.narrow(0, rows.start, rows.len())?)?)
                }
                _ => Ok(h.clone()),
            }
        };
        h = masked(&h, 1)?;
        h = relu(&self.fc1.forward(&h)?)?;
        h = masked(&h, 2)?;
        self.fc2.forward(&h)
    }
}

/// The model on this rank with its data and optimizer: what the
/// [training loop](crate::train::train) drives.
pub struct Vgg16Training {
    cfg: Config,
    world: Communicator,
    /// The channel-parallel group (this rank's P ranks).
    cc: Context,
    /// The ranks holding the same channels in the other groups.
    dp: Option<Context>,
    group: usize,
    groups: usize,
    net: Net,
    data: Option<(TensorDataset, TensorDataset)>,
    empty: EmptyDataset,
    test_len: usize,
    /// Parameters, optimizer and the shuffle.
    parts: Parts,
}

/// Read the images on rank 0.
fn read(cfg: &Config) -> Result<(TensorDataset, TensorDataset)> {
    let dir = cfg.data.as_deref();
    Ok(match cfg.dataset {
        ImageSet::Cifar10 => {
            let d = dir.ok_or_else(|| {
                Error::Usage(
                    "--dataset cifar10 needs --data DIR, the directory holding CIFAR-10's binary \
                     files (data_batch_1.bin … test_batch.bin)"
                        .into(),
                )
            })?;
            cifar10(d)?
        }
        ImageSet::Synthetic => {
            let n = cfg.synthetic_examples;
            (
                synthetic_images(n, 3, 32, 10, cfg.seed)?,
                synthetic_images(n.div_ceil(5), 3, 32, 10, cfg.seed ^ 0x7E57)?,
            )
        }
        ImageSet::Mnist => {
            let (tr, te) = mnist(dir)?;
            (pad_images(&tr, 28, 2)?, pad_images(&te, 28, 2)?)
        }
        ImageSet::FashionMnist => {
            let (tr, te) = fashion_mnist(dir)?;
            (pad_images(&tr, 28, 2)?, pad_images(&te, 28, 2)?)
        }
    })
}

impl Vgg16Training {
    /// Build this rank's part, read the data on rank 0 (the others learn
    /// its sizes or its error), set up the shuffle and Adam. Collective.
    pub fn new(comm: &Communicator, cfg: &Config) -> Result<Self> {
        cfg.validate()?;
        let (groups, p) = cfg.grid(comm.size())?;
        let world = Context::new(comm);
        let group = comm.rank() / p;
        let split = |color: usize| -> Result<Context> {
            world
                .split(Some(color as u32), comm.rank() as i64)?
                .ok_or_else(|| Error::Usage("vgg16: a rank was left out of its group".into()))
        };
        let cc = if groups == 1 {
            world.clone()
        } else {
            split(group)?
        };
        let dp = if groups == 1 {
            None
        } else {
            Some(split(groups + comm.rank() % p)?)
        };
        let store = ParamStore::new(comm.device(), cfg.seed);
        let net = Net::new(cfg, &cc, dp.as_ref(), &store)?;
        // Rank 0 reads; every rank learns the sizes, or rank 0's error.
        let data = if comm.rank() == 0 {
            Some(read(cfg))
        } else {
            None
        };
        let shared: std::result::Result<(usize, usize, usize), String> = comm.bcast_obj(
            data.as_ref()
                .map(|d| match d {
                    Ok((tr, te)) => Ok((tr.len(), te.len(), tr.x.dims()[1])),
                    Err(e) => Err(e.to_string()),
                })
                .as_ref(),
            0,
        )?;
        let (train_len, test_len, features) = shared.map_err(|e| match comm.rank() {
            0 => Error::Io(e),
            _ => Error::Io(format!("rank 0 could not read the images: {e}")),
        })?;
        let want = cfg.dataset.channels() * 32 * 32;
        if features != want {
            return Err(Error::Io(format!(
                "vgg16: the images have {features} values each, expected {want}"
            )));
        }
        let data = data.transpose()?;
        let it = synchronized_iterator(comm, train_len, cfg.batch_size, cfg.seed)?;
        let parts = Parts::new(store, &cfg.train.optimizer, cfg.train.lr, Some(it))?;
        Ok(Vgg16Training {
            cfg: cfg.clone(),
            world: comm.clone(),
            cc,
            dp,
            group,
            groups,
            net,
            data,
            empty: EmptyDataset::new(train_len),
            test_len,
            parts,
        })
    }

    /// This rank's parameters.
    pub fn params(&self) -> Vec<Param> {
        self.parts.store.params()
    }

    /// Rank 0's global batch (x, labels) on every rank, and this group's
    /// rows of it.
    fn share(
        &self,
        x: Option<&Tensor>,
        t: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, std::ops::Range<usize>, usize)> {
        let dev = self.cc.device();
        let x = self.world.bcast(x, 0)?.to_device(dev)?;
        let t = self.world.bcast(t, 0)?.to_device(dev)?;
        let global = x.dims()[0];
        let rows = chunk_range(global, self.groups, self.group);
        let c = self.cfg.dataset.channels();
        let x = x
            .narrow(0, rows.start, rows.len())?
            .reshape((rows.len(), c, 32, 32))?;
        let t = t.narrow(0, rows.start, rows.len())?;
        Ok((x, t, rows, global))
    }

    /// (loss sum over the global batch, hits) from every group: the same
    /// on every rank.
    fn across_groups(&self, loss_sum: f64, hits: usize) -> Result<(f64, usize)> {
        match &self.dp {
            Some(dp) => dp
                .comm()
                .allreduce_obj(&(loss_sum, hits), |a, b| (a.0 + b.0, a.1 + b.1)),
            None => Ok((loss_sum, hits)),
        }
    }
}

impl Vgg16Training {
    /// Step `step`'s forward and backward on the next global batch, the
    /// gradients summed over the groups: (loss summed over the global batch,
    /// hits, examples), the same on every rank.
    fn forward_backward(&mut self, step: usize, trace: &mut Trace) -> Result<(f64, usize, usize)> {
        let train: &dyn Dataset = match &self.data {
            Some((tr, _)) => tr,
            None => &self.empty,
        };
        let b = self.parts.iterator()?.next_batch(train)?;
        let (x, t, rows, global) = self.share(b.x.as_ref(), b.t.as_ref())?;
        trace.start();
        // Dropout's seed: the run's and the step's, the same on every rank.
        let seed = crate::rng::splitmix64(&mut (self.cfg.seed ^ (step as u64) << 20));
        let drop = Some((self.cfg.dropout, seed, rows.clone(), global));
        let y = self.net.forward(&x, true, drop)?;
        trace.lap("forward");
        // The mean over the global batch: this group's sum / global (a
        // group may hold no rows: the last batch of an epoch can be
        // shorter than the groups; its sum is 0, and it still runs the
        // backward, whose batch norms are collective).
        let nll = candle_nn::ops::log_softmax(&y, 1)?
            .gather(&t.unsqueeze(1)?, 1)?
            .sum_all()?
            .neg()?;
        let local = nll.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        let hits = f::top1_hits(&y, &t)?;
        let mut grads = (nll / global as f64)?.backward()?;
        self.parts.store.absorb(&mut grads)?;
        trace.lap("backward");
        if let Some(dp) = &self.dp {
            let params: Vec<Param> = self
                .parts
                .store
                .params()
                .into_iter()
                .filter(|p| p.value().elem_count() > 0)
                .collect();
            allreduce_grads(dp.comm(), &params, ReduceOp::Sum)?;
        }
        let (loss_sum, hits) = self.across_groups(local, hits)?;
        Ok((loss_sum, hits, b.len))
    }

    /// The gradients of step `step` (forward and backward on the next
    /// batch, no update), whole, on rank 0: what tests compare between
    /// splits, since Adam's update hides a gradient's scale. Collective.
    pub fn gradients(&mut self, step: usize) -> Result<Option<BTreeMap<String, Tensor>>> {
        self.forward_backward(step, &mut Trace::new(self.world.rank()))?;
        let grads = ParamStore::new(self.parts.store.device(), self.cfg.seed);
        for p in self.parts.store.params() {
            let g = match p.take_grad() {
                Some(g) => g,
                None => p.value().zeros_like()?,
            };
            let q = Param::new(p.name(), &g)?;
            grads.register(match p.shard() {
                Some(s) => q.with_shard(s),
                None => q,
            })?;
        }
        let whole = grads.gather_whole(self.cc.comm())?;
        Ok(whole.filter(|_| self.world.rank() == 0))
    }
}

impl TrainModel for Vgg16Training {
    fn resume_from_ranks(&self, _ranks: usize) -> Result<()> {
        if self.cfg.split == ChannelSplit::Grouped {
            return Err(Error::Usage(
                "ChainerMN's grouped convolution (--parallel-conv grouped) is another function on \
                 another number of ranks (its groups are the ranks): resume it on the same number"
                    .into(),
            ));
        }
        Ok(())
    }

    fn parts(&self) -> &Parts {
        &self.parts
    }

    fn parts_mut(&mut self) -> &mut Parts {
        &mut self.parts
    }

    /// Batch norm's running statistics.
    fn extra_state(&self) -> Vec<StateTensor> {
        self.net
            .norms
            .iter()
            .flatten()
            .flat_map(|bn| bn.state())
            .collect()
    }

    /// Every parameter whole (shards joined), on rank 0 (groups hold
    /// copies; the first group's are gathered); `None` elsewhere, and
    /// empty for the grouped split, whose weights are not shards of one
    /// tensor. Collective.
    fn gather_params(&self) -> Result<Option<BTreeMap<String, Tensor>>> {
        if self.cfg.split == ChannelSplit::Grouped {
            return Ok((self.world.rank() == 0).then(BTreeMap::new));
        }
        let whole = self.parts.store.gather_whole(self.cc.comm())?;
        Ok(whole.filter(|_| self.world.rank() == 0))
    }

    fn name(&self) -> &str {
        "vgg16"
    }

    fn step(&mut self, step: usize, trace: &mut Trace) -> Result<StepOutput> {
        let (loss_sum, hits, samples) = self.forward_backward(step, trace)?;
        self.parts.opt.step()?;
        trace.lap("step");
        Ok(StepOutput {
            loss: loss_sum / samples as f64,
            correct: hits,
            samples,
            skipped: false,
        })
    }

    fn evaluate(&mut self) -> Result<f64> {
        let _eval = self.cc.no_grad();
        let test = self.data.as_ref().map(|(_, te)| te);
        let (len, mut hits, mut at) = (self.test_len, 0usize, 0usize);
        while at < len {
            let k = 500.min(len - at);
            let part = test.map(|t| t.slice(at, k)).transpose()?;
            let (x, t, _, _) =
                self.share(part.as_ref().map(|p| &p.x), part.as_ref().map(|p| &p.t))?;
            let y = self.net.forward(&x, false, None)?;
            hits += f::top1_hits(&y, &t)?;
            at += k;
        }
        let (_, hits) = self.across_groups(0.0, hits)?;
        Ok(hits as f64 / len.max(1) as f64)
    }
}

impl ModelConfig for Config {
    type Training = Vgg16Training;

    fn options(&self) -> &Options {
        &self.train
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
}
