//! MLPs on MNIST split *within* their layers across ranks (each rank its own
//! device): Chainer's `MnistMLPParallel` (`shardnet train
//! mnist-mlp-parallel`) and the exact tensor-parallel MLP (`shardnet train
//! mnist-mlp --parallel tensor`).
//!
//! **`MnistMLPParallel`** (Chainer's multi-GPU example, exactly): four MLPs
//! of three layers, `first0`/`first1` (784 → U/2 → U/2 → U) and
//! `second0`/`second1` (U → U/2 → U/2 → 10), part p on device p:
//!
//! | Chainer (one process, two GPUs) | here (rank p holds part p) |
//! |---|---|
//! | `x1 = F.copy(x, 1)` | the batch broadcast from rank 0 |
//! | `h0 = z0 + F.copy(z1, 0)`, `h1 = z1 + F.copy(z0, 1)` | h = allreduce(z_p) (backward: the sum of both ranks' gradients) |
//! | `y = y0 + F.copy(y1, 0)` | rank 1 sends y1, rank 0 adds it (send/recv with a delegate) |
//!
//! On one rank both parts run there: the same arithmetic in the same order,
//! so 1 and 2 ranks train the same parameters (tested).
//!
//! **Tensor-parallel MLP**: 784 → U ([`ColumnParallelLinear`], its output
//! left split) → relu → U → U ([`RowParallelLinear`] on the split input: one
//! allreduce forward, one backward) → relu → U → 10 (replicated). Every rank
//! computes the same loss; any number of ranks trains the one-device MLP's
//! parameters (the weights come from the global tensors' seeds), to f32
//! rounding of the split sums.

mod memory;

use super::digits::{Digits, RankZeroData};
use crate::comm::Communicator;
use crate::functions::{self as f, Context};
use crate::links::{ColumnParallelLinear, Features, LinearConfig, RowParallelLinear};
use crate::nn::{Linear, ParamStore};
use crate::train::plan::{MemoryPlan, Placement};
use crate::train::{split_flags, ModelConfig, Options, Parts, Size, StepOutput, Trace, TrainModel};
use crate::{Error, ReduceOp, Result};
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Which split of the MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Chainer's `MnistMLPParallel`: two parts, on 1 or 2 ranks.
    Chainer,
    /// The exact tensor-parallel MLP, on any number of ranks.
    Tensor,
}

/// Settings of one run (the command's flags).
#[derive(Clone, Debug)]
pub struct Config {
    /// The split.
    pub split: Split,
    /// Hidden units U.
    pub units: usize,
    /// Examples per step.
    pub batch_size: usize,
    /// Seed of the initialisation and the shuffle.
    pub seed: u64,
    /// Where the data are (see [`crate::data::mnist`]).
    pub data: Option<PathBuf>,
    /// MNIST or Fashion-MNIST.
    pub dataset: Digits,
    /// Epochs, steps, Adam's learning rate, evaluation, progress.
    pub train: Options,
}

impl Config {
    /// Chainer's example: U = 1000, batch 100, Adam at 1e-3, 20 epochs (its
    /// defaults) — here 1 epoch.
    pub fn new(split: Split) -> Self {
        Config {
            split,
            units: 1000,
            batch_size: 100,
            seed: 0,
            data: None,
            dataset: Digits::Mnist,
            train: Options {
                epochs: 1,
                lr: 1e-3,
                ..Options::default()
            },
        }
    }

    /// Refuse what cannot train (before any rank builds anything).
    pub fn validate(&self) -> Result<()> {
        use crate::train::at_least_one;
        at_least_one("--units", self.units, "hidden units")?;
        at_least_one("--batch-size", self.batch_size, "the batch")?;
        if self.split == Split::Chainer && self.units < 2 {
            return Err(Error::Usage(format!(
                "--units {}: MnistMLPParallel halves the hidden width: give at least 2",
                self.units
            )));
        }
        self.train.validate()
    }
}

/// A three-layer MLP (Chainer's `MnistMLP`): relu after the first two;
/// Chainer's initialisation (LeCun normal weights, zero biases).
struct Mlp([Linear; 3]);

impl Mlp {
    fn new(store: &ParamStore, name: &str, first_layer: usize, dims: [usize; 4]) -> Result<Self> {
        let l = |k: usize| -> Result<Linear> {
            let (fan_in, fan_out) = (dims[k], dims[k + 1]);
            let std = 1.0 / (fan_in as f64).sqrt();
            let w = crate::nn::init::normal_layer(
                store.seed(),
                first_layer + k,
                0,
                (fan_out, fan_in),
                std,
                store.device(),
            )?;
            let b = Tensor::zeros(fan_out, candle_core::DType::F32, store.device())?;
            Ok(Linear::new(
                store.add(&format!("{name}.l{}.weight", k + 1), &w, None)?,
                Some(store.add(&format!("{name}.l{}.bias", k + 1), &b, None)?),
            ))
        };
        Ok(Mlp([l(0)?, l(1)?, l(2)?]))
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.0[0].forward(x)?.relu()?;
        let h = self.0[1].forward(&h)?.relu()?;
        self.0[2].forward(&h)
    }
}

/// This rank's part of the network.
enum Net {
    /// Parts `first[i]`, `second[i]` of Chainer's model held here.
    Chainer { first: Vec<Mlp>, second: Vec<Mlp> },
    /// The tensor-parallel layers.
    Tensor(Box<TensorMlp>),
}

/// The tensor-parallel MLP's layers.
struct TensorMlp {
    l1: ColumnParallelLinear,
    l2: RowParallelLinear,
    l3: Linear,
}

/// What one forward gives: rank 0's logits (every rank's, for the tensor
/// split), and a delegate to start backward from on a rank without them.
struct Forward {
    logits: Option<Tensor>,
    delegate: Option<Tensor>,
}

impl Net {
    fn new(ctx: &Context, store: &ParamStore, cfg: &Config) -> Result<Self> {
        let (rank, n, u) = (ctx.rank(), ctx.size(), cfg.units);
        match cfg.split {
            Split::Chainer => {
                if n > 2 {
                    return Err(Error::Usage(format!(
                        "MnistMLPParallel has two parts: run it on 1 or 2 ranks, not {n}"
                    )));
                }
                let parts: Vec<usize> = if n == 1 { vec![0, 1] } else { vec![rank] };
                let half = u / 2;
                let mut first = Vec::new();
                let mut second = Vec::new();
                // Layers keyed by part, never by rank: any placement, one model.
                for &p in &parts {
                    first.push(Mlp::new(
                        store,
                        &format!("first{p}"),
                        3 * p,
                        [784, half, half, u],
                    )?);
                    second.push(Mlp::new(
                        store,
                        &format!("second{p}"),
                        6 + 3 * p,
                        [u, half, half, 10],
                    )?);
                }
                Ok(Net::Chainer { first, second })
            }
            Split::Tensor => Ok(Net::Tensor(Box::new(TensorMlp {
                l1: {
                    let sharded = LinearConfig::new().with_features(Features::Sharded);
                    ColumnParallelLinear::new(ctx, &store.pp("l1"), 784, u, sharded)?
                },
                l2: RowParallelLinear::new(
                    ctx,
                    &store.pp("l2"),
                    u,
                    u,
                    LinearConfig::new()
                        .with_features(Features::Sharded)
                        .with_layer(1),
                )?,
                l3: store.linear("l3", 2, u, 10)?,
            }))),
        }
    }

    fn forward(&self, ctx: &Context, x: &Tensor) -> Result<Forward> {
        match self {
            Net::Chainer { first, second } => {
                let sum = |parts: &[Mlp], x: &Tensor| -> Result<Tensor> {
                    let mut acc = parts[0].forward(x)?;
                    for p in &parts[1..] {
                        acc = (acc + p.forward(x)?)?;
                    }
                    Ok(acc)
                };
                let z = sum(first, x)?;
                // h0 = z0 + copy(z1), h1 = z1 + copy(z0): the same sum on both.
                let h = if ctx.size() == 2 {
                    f::allreduce(ctx, &z, ReduceOp::Sum)?
                } else {
                    z
                };
                let y = sum(second, &h.relu()?)?;
                // y = y0 + copy(y1, 0).
                match (ctx.size(), ctx.rank()) {
                    (1, _) => Ok(Forward {
                        logits: Some(y),
                        delegate: None,
                    }),
                    (_, 0) => Ok(Forward {
                        logits: Some((y + f::recv(ctx, 1, None)?)?),
                        delegate: None,
                    }),
                    _ => Ok(Forward {
                        logits: None,
                        delegate: Some(f::send(&y, ctx, 0)?),
                    }),
                }
            }
            Net::Tensor(m) => {
                let h = m.l1.forward(x)?.relu()?;
                let h = m.l2.forward(&h)?.relu()?;
                Ok(Forward {
                    logits: Some(m.l3.forward(&h)?),
                    delegate: None,
                })
            }
        }
    }
}

/// The model on this rank with its data and optimizer: what the
/// [training loop](crate::train::train) drives.
pub struct ParallelTraining {
    ctx: Context,
    cfg: Config,
    net: Net,
    digits: RankZeroData,
    /// Parameters, optimizer and the shuffle.
    parts: Parts,
}

impl ParallelTraining {
    /// Build this rank's part, read the data on rank 0 (the others learn
    /// its sizes), set up the shuffle and Adam. Collective.
    pub fn new(comm: &Communicator, cfg: &Config) -> Result<Self> {
        cfg.validate()?;
        let ctx = Context::new(comm);
        let store = ParamStore::new(comm.device(), cfg.seed);
        let net = Net::new(&ctx, &store, cfg)?;
        let (digits, it) = RankZeroData::read(
            comm,
            cfg.dataset,
            cfg.data.as_deref(),
            cfg.batch_size,
            cfg.seed,
        )?;
        let parts = Parts::new(store, &cfg.train.optimizer, cfg.train.lr, Some(it))?;
        Ok(ParallelTraining {
            ctx,
            cfg: cfg.clone(),
            net,
            digits,
            parts,
        })
    }

    /// Rank 0's examples (x, labels) on every rank's device: x broadcast
    /// (Chainer's `F.copy(x, 1)`), labels too where every rank computes the
    /// loss.
    fn share(&self, x: Option<&Tensor>, t: Option<&Tensor>) -> Result<(Tensor, Option<Tensor>)> {
        let device = self.ctx.device();
        let x = self.ctx.bcast(x, 0)?.to_device(device)?;
        let t = match self.net {
            Net::Tensor(_) => Some(self.ctx.bcast(t, 0)?.to_device(device)?),
            Net::Chainer { .. } => t.map(|t| t.to_device(device)).transpose()?,
        };
        Ok((x, t))
    }
}

impl TrainModel for ParallelTraining {
    fn parts(&self) -> &Parts {
        &self.parts
    }

    fn parts_mut(&mut self) -> &mut Parts {
        &mut self.parts
    }

    /// Every parameter whole (shards joined), on rank 0. Collective.
    fn gather_params(&self) -> Result<Option<BTreeMap<String, Tensor>>> {
        self.parts.store.gather_whole(&self.ctx)
    }

    fn name(&self) -> &str {
        match self.cfg.split {
            Split::Chainer => "mnist-mlp-parallel",
            Split::Tensor => "mnist-mlp",
        }
    }

    fn step(&mut self, _step: usize, trace: &mut Trace) -> Result<StepOutput> {
        let b = self.digits.next_batch(self.parts.iterator()?)?;
        let (x, t) = self.share(b.x.as_ref(), b.t.as_ref())?;
        trace.start();
        let out = self.net.forward(&self.ctx, &x)?;
        trace.lap("forward");
        let (mut loss_value, mut correct) = (0.0, 0);
        let root = match (&out.logits, &t) {
            (Some(y), Some(t)) => {
                let loss = candle_nn::loss::cross_entropy(y, t)?;
                loss_value = loss.to_scalar::<f32>()? as f64;
                correct = f::top1_hits(y, t)?;
                loss
            }
            _ => out.delegate.clone().ok_or_else(|| {
                Error::Usage("mnist parallel MLP: a rank with neither logits nor delegate".into())
            })?,
        };
        let mut grads = root.backward()?;
        self.parts.store.absorb(&mut grads)?;
        trace.lap("backward");
        self.parts.opt.step()?;
        trace.lap("step");
        // Only rank 0's count is reported (every rank's is the same for the
        // tensor split).
        if self.ctx.rank() != 0 {
            correct = 0;
        }
        Ok(StepOutput {
            loss: if self.ctx.rank() == 0 {
                loss_value
            } else {
                0.0
            },
            correct,
            samples: b.len,
            skipped: false,
        })
    }

    fn evaluate(&mut self) -> Result<f64> {
        let _eval = self.ctx.no_grad();
        let (test, len) = (self.digits.test(), self.digits.test_len);
        let (mut correct, mut at) = (0usize, 0usize);
        while at < len {
            let k = 1000.min(len - at);
            let part = test.map(|t| t.slice(at, k)).transpose()?;
            let (x, t) = self.share(part.as_ref().map(|p| &p.x), part.as_ref().map(|p| &p.t))?;
            let out = self.net.forward(&self.ctx, &x)?;
            if let (Some(y), Some(t), 0) = (&out.logits, &t, self.ctx.rank()) {
                correct += f::top1_hits(y, t)?;
            }
            at += k;
        }
        Ok(correct as f64 / len.max(1) as f64)
    }
}

impl ModelConfig for Config {
    type Training = ParallelTraining;

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

    fn build(&self, comm: &Communicator) -> Result<ParallelTraining> {
        ParallelTraining::new(comm, self)
    }

    fn size(&self) -> Option<Size> {
        Some(Size::count("--units", self.units))
    }

    fn with_size(&self, value: f64) -> Self {
        Config {
            units: value as usize,
            ..self.clone()
        }
    }

    /// Every layer over all the ranks.
    fn splits(&self, ranks: usize) -> Vec<(String, Self)> {
        vec![(split_flags(&[("--ranks", ranks)]), self.clone())]
    }
}
