//! ChainerMN's model-parallel MLP on MNIST, as `shardnet train mnist-mlp`.
//!
//! The MLP has S stages: stage s is `relu(Linear(in, U))` (in = 784 for
//! s = 0, else U), and the last stage ends with `Linear(U, 10)`. With S = 2
//! this is ChainerMN's example: rank 0 holds `Linear(784, U)` + relu and the
//! loss, rank 1 holds `Linear(U, U)` + relu + `Linear(U, 10)`. Stages are
//! spread over the ranks in contiguous runs ([`chunk_sizes`]); rank 0 reads
//! the data, sends its activations on, and receives the logits back for the
//! softmax cross-entropy. Other ranks iterate an empty dataset of the same
//! length. [`MlpTraining`] plugs the model into the
//! [shared training loop](crate::train::train).
//!
//! Parameters are initialised from (seed, layer), uniform in ±1/√in (as
//! PyTorch's and Chainer's default), so any split of the same S stages over
//! any number of ranks trains the same model: the exactness tests compare
//! 1, 2 and 3 ranks.

mod memory;

use super::digits::{on_device, Digits, RankZeroData};
use crate::comm::{chunk_sizes, split_rows, Communicator};
use crate::data::TensorDataset;
use crate::functions::Context;
use crate::links::{ChainLink, MultiNodeChainList};
use crate::nn::{Linear, ParamStore};
use crate::train::plan::{MemoryPlan, Placement};
use crate::train::{ModelConfig, Options, Parts, StepOutput, Trace, TrainModel};
use crate::{Error, Result};
use candle_core::Tensor;
use std::collections::BTreeMap;
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
    /// Micro-batches per step (GPipe); 1: no pipelining.
    pub micro_batches: usize,
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
    /// The stage count on `ranks` ranks: `--stages`, else one per rank (at
    /// least 2).
    pub fn stages_on(&self, ranks: usize) -> usize {
        self.stages.unwrap_or(2.max(ranks))
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
        if self.micro_batches == 0 || self.micro_batches > self.batch_size {
            return Err(Error::Usage(format!(
                "--micro-batches {}: give 1 to {} (the batch size); each micro-batch needs an example",
                self.micro_batches, self.batch_size
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

/// Layer l of an S-stage MLP: (in, out).
fn layer_dims(l: usize, stages: usize, units: usize) -> (usize, usize) {
    let input = if l == 0 { 784 } else { units };
    let output = if l == stages { 10 } else { units };
    (input, output)
}

struct Layer {
    linear: Linear,
    relu: bool,
}

/// The layers of this rank's stages, applied in order.
struct StageRun {
    layers: Vec<Layer>,
}

impl ChainLink for StageRun {
    fn forward(&self, xs: &[Tensor]) -> Result<Tensor> {
        let mut h = xs[0].clone();
        for l in &self.layers {
            h = l.linear.forward(&h)?;
            if l.relu {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// Layers of `stages` (of `total`), their parameters made in `store`
/// (`layer{l}.weight`, `.bias`, from (seed, l)).
fn stage_layers(
    stages: std::ops::Range<usize>,
    total: usize,
    units: usize,
    store: &ParamStore,
) -> Result<Vec<Layer>> {
    let mut layers = Vec::new();
    for s in stages {
        let mut idx = vec![s];
        if s == total - 1 {
            idx.push(total);
        }
        for l in idx {
            let (i, o) = layer_dims(l, total, units);
            layers.push(Layer {
                linear: store.linear(&format!("layer{l}"), l, i, o)?,
                relu: l != total,
            });
        }
    }
    Ok(layers)
}

/// This rank's part of the model: the chain list, its parameters (name, var).
fn build(comm: &Communicator, cfg: &Config) -> Result<(MultiNodeChainList, ParamStore)> {
    let (r, n) = (comm.rank(), comm.size());
    let stages = cfg.stages_on(n);
    if stages < n {
        return Err(Error::Usage(format!(
            "{n} ranks need at least {n} stages (--stages {stages})"
        )));
    }
    let counts = chunk_sizes(stages, n);
    let first: usize = counts[..r].iter().sum();
    let store = ParamStore::new(comm.device(), cfg.seed);
    let layers = stage_layers(first..first + counts[r], stages, cfg.units, &store)?;
    let run = StageRun { layers };
    let mut model = MultiNodeChainList::new(&Context::new(comm));
    if n == 1 {
        model.add_link(run, &[], &[])?;
    } else if r == 0 {
        model.add_link(run, &[], &[1])?;
        model.add_link(|xs: &[Tensor]| Ok(xs[0].clone()), &[n - 1], &[])?;
    } else {
        model.add_link(run, &[r - 1], &[(r + 1) % n])?;
    }
    Ok((model, store))
}

/// One pass over the test set through the pipeline, no gradient. Rank 0
/// returns the accuracy.
fn evaluate(model: &MultiNodeChainList, test: Option<&TensorDataset>, len: usize) -> Result<f64> {
    let _eval = model.context().no_grad();
    let device = model.context().device();
    let mut correct = 0.0;
    let batch = 1000;
    let mut at = 0;
    while at < len {
        let k = batch.min(len - at);
        let part = test
            .map(|t| on_device(&t.slice(at, k)?, device))
            .transpose()?;
        let out = model.forward(part.as_ref().map(|p| std::slice::from_ref(&p.x)), 1)?;
        if let (Some(y), Some(p)) = (out.outputs.first(), &part) {
            correct += crate::functions::top1_hits(y, &p.t)? as f64;
        }
        at += k;
    }
    Ok(correct / len as f64)
}

/// The MLP on this rank with its data and optimizer: what the
/// [training loop](crate::train::train) drives.
pub struct MlpTraining {
    cfg: Config,
    model: MultiNodeChainList,
    digits: RankZeroData,
    /// Parameters, optimizer and the shuffle.
    parts: Parts,
    /// Whether the note on a last batch shorter than the micro-batches was
    /// printed.
    noted_short_batch: bool,
}

impl MlpTraining {
    /// Build this rank's stages, read the data on rank 0 (the others learn
    /// its sizes), and set up the shuffle and Adam. Collective.
    pub fn new(comm: &Communicator, cfg: &Config) -> Result<Self> {
        let (model, store) = build(comm, cfg)?;
        let (digits, it) = RankZeroData::read(
            comm,
            cfg.dataset,
            cfg.data.as_deref(),
            cfg.batch_size,
            cfg.seed,
        )?;
        let parts = Parts::new(store, &cfg.train.optimizer, cfg.train.lr, Some(it))?;
        Ok(MlpTraining {
            cfg: cfg.clone(),
            model,
            digits,
            parts,
            noted_short_batch: false,
        })
    }
}

impl TrainModel for MlpTraining {
    /// Every parameter by name (`layer{l}.weight`, `.bias`), gathered on
    /// rank 0; `None` elsewhere. Collective.
    fn gather_params(&self) -> Result<Option<BTreeMap<String, Tensor>>> {
        let comm = self.model.context();
        let mine: Vec<(String, Vec<usize>, Vec<f32>)> = self
            .parts
            .store
            .state_dict()
            .into_iter()
            .map(|e| {
                let v = e.tensor.flatten_all()?.to_vec1::<f32>()?;
                Ok((e.name, e.tensor.dims().to_vec(), v))
            })
            .collect::<Result<_>>()?;
        let Some(all) = comm.gather_obj(&mine, 0)? else {
            return Ok(None);
        };
        let mut params = BTreeMap::new();
        for (name, dims, v) in all.into_iter().flatten() {
            params.insert(name, Tensor::from_vec(v, dims, comm.device())?);
        }
        Ok(Some(params))
    }

    fn resume_from_ranks(&self, ranks: usize) -> Result<()> {
        let now = self.model.context().size();
        if self.cfg.stages.is_none() && 2.max(ranks) != 2.max(now) {
            return Err(Error::Usage(format!(
                "without --stages the MLP has as many stages as ranks (at least 2: {} then, {} \
                 now), so this model needs {ranks} ranks; a run started with --stages S can \
                 continue on any number up to S",
                2.max(ranks),
                2.max(now),
            )));
        }
        Ok(())
    }

    fn name(&self) -> &str {
        "mnist-mlp"
    }

    fn parts(&self) -> &Parts {
        &self.parts
    }

    fn parts_mut(&mut self) -> &mut Parts {
        &mut self.parts
    }

    fn step(&mut self, _step: usize, trace: &mut Trace) -> Result<StepOutput> {
        let b = self.digits.next_batch(self.parts.iterator()?)?;
        let device = self.model.context().device();
        let m = self.cfg.micro_batches.clamp(1, b.len);
        if m < self.cfg.micro_batches && !self.noted_short_batch {
            // On purpose (the epoch's last batch may be short); said once.
            self.noted_short_batch = true;
            if self.model.context().rank() == 0 {
                eprintln!(
                    "note: an epoch's last batch has {} examples, fewer than --micro-batches {}: \
                     it runs as {m} micro-batches",
                    b.len, self.cfg.micro_batches
                );
            }
        }
        let parts = chunk_sizes(b.len, m);
        let xs =
            b.x.as_ref()
                .map(|x| split_rows(&x.to_device(device)?, &parts))
                .transpose()?;
        trace.start();
        let out = self.model.forward(xs.as_deref(), m)?;
        trace.lap("forward");
        let mut correct = 0.0;
        let loss = match (&b.t, out.outputs.is_empty()) {
            (Some(t), false) => {
                let ts = split_rows(&t.to_device(device)?, &parts)?;
                let mut total: Option<Tensor> = None;
                for (i, y) in out.outputs.iter().enumerate() {
                    let l = (candle_nn::loss::cross_entropy(y, &ts[i])?
                        * (parts[i] as f64 / b.len as f64))?;
                    correct += crate::functions::top1_hits(y, &ts[i])? as f64;
                    total = Some(match total {
                        Some(acc) => acc.add(&l)?,
                        None => l,
                    });
                }
                total
            }
            _ => None,
        };
        let value = match &loss {
            Some(l) => l.to_scalar::<f32>()? as f64,
            None => 0.0,
        };
        // The CPU kernels accumulate parameter gradients in the Params; on
        // the generic path they arrive in candle's store and are moved in.
        let mut grads = out.backward_root(loss)?.backward()?;
        self.parts.store.absorb(&mut grads)?;
        trace.lap("backward");
        self.parts.opt.step()?;
        trace.lap("step");
        Ok(StepOutput {
            loss: value,
            correct: correct as usize,
            samples: b.len,
            skipped: false,
        })
    }

    fn evaluate(&mut self) -> Result<f64> {
        evaluate(&self.model, self.digits.test(), self.digits.test_len)
    }
}

impl ModelConfig for Config {
    type Training = MlpTraining;

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

    fn build(&self, comm: &Communicator) -> Result<MlpTraining> {
        MlpTraining::new(comm, self)
    }
}
