//! Seed 001's model-parallel MLP on MNIST, as `shardnet train mnist-mlp`.
//!
//! The MLP has S stages: stage s is `relu(Linear(in, U))` (in = 784 for
//! s = 0, else U), and the last stage ends with `Linear(U, 10)`. With S = 2
//! this is the seed: rank 0 holds `Linear(784, U)` + relu and the loss, rank 1
//! holds `Linear(U, U)` + relu + `Linear(U, 10)`. Stages are spread over the
//! ranks in contiguous runs ([`chunk_sizes`]); rank 0 reads the data, sends
//! its activations on, and receives the logits back for the softmax
//! cross-entropy, as in the seed. Other ranks iterate an empty dataset of
//! the same length.
//!
//! Parameters are initialised from (seed, layer), uniform in ±1/√in (as
//! PyTorch's and Chainer's default), so any split of the same S stages over
//! any number of ranks trains the same model: the exactness tests compare
//! 1, 2 and 3 ranks.

use super::{peak_memory_bytes, EpochMetrics, Metrics, Progress};
use crate::comm::{chunk_sizes, split_rows, Communicator};
use crate::data::{
    fashion_mnist, mnist, splitmix64, synchronized_iterator, Dataset, EmptyDataset, TensorDataset,
};
use crate::functions::Context;
use crate::links::{ChainLink, MultiNodeChainList};
use crate::nn::{Linear, Param};
use crate::optim::Adam;
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Settings of one run (the command's flags).
#[derive(Clone, Debug)]
pub struct Config {
    /// Hidden units U.
    pub units: usize,
    /// Stages S; default: 2 (the seed), or the number of ranks if larger.
    pub stages: Option<usize>,
    /// Examples per step.
    pub batch_size: usize,
    /// Micro-batches per step (GPipe); 1: no pipelining.
    pub micro_batches: usize,
    /// Adam's learning rate.
    pub lr: f64,
    /// Epochs over the training set.
    pub epochs: usize,
    /// Stop after this many steps in all.
    pub max_steps: Option<usize>,
    /// Seed of the initialisation and the shuffle.
    pub seed: u64,
    /// The first steps of the run, excluded from samples/s (they still train).
    pub warmup_steps: usize,
    /// Where the data are (see [`crate::data::mnist`]).
    pub data: Option<PathBuf>,
    /// Which 28×28, 10-class dataset: MNIST or Fashion-MNIST.
    pub dataset: Digits,
    /// Evaluate on the test set after each epoch.
    pub evaluate: bool,
    /// Show the progress line (rank 0).
    pub progress: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            units: 100,
            stages: None,
            batch_size: 100,
            micro_batches: 1,
            lr: 1e-3,
            epochs: 5,
            max_steps: None,
            seed: 0,
            warmup_steps: 0,
            data: None,
            dataset: Digits::Mnist,
            evaluate: true,
            progress: true,
        }
    }
}

/// The datasets this model trains on (same shapes, 10 classes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Digits {
    /// MNIST handwritten digits.
    Mnist,
    /// Fashion-MNIST (Debian's `dataset-fashion-mnist`, or `--data DIR`).
    FashionMnist,
}

impl std::str::FromStr for Digits {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "mnist" => Ok(Digits::Mnist),
            "fashion-mnist" => Ok(Digits::FashionMnist),
            other => Err(Error::Usage(format!(
                "unknown dataset '{other}' (use mnist or fashion-mnist)"
            ))),
        }
    }
}

/// What a run returns on rank 0.
pub struct Report {
    /// Per-epoch figures and memory.
    pub metrics: Metrics,
    /// Every parameter after training, by name (`layer{l}.weight`, `.bias`).
    pub params: BTreeMap<String, Tensor>,
}

/// splitmix64-based uniform values in ±bound from (seed, layer, which).
pub(crate) fn uniform(
    seed: u64,
    layer: usize,
    which: u64,
    dims: (usize, usize),
    bound: f64,
) -> Result<Tensor> {
    let mut s = seed ^ ((layer as u64) << 32) ^ (which << 56) ^ 0x5DEE_CE66_D1CE_4E5B;
    let n = dims.0 * dims.1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            let z = splitmix64(&mut s);
            (((z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * bound) as f32
        })
        .collect();
    Ok(Tensor::from_vec(v, dims, &Device::Cpu)?)
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

fn stage_layers(stages: std::ops::Range<usize>, total: usize, cfg: &Config) -> Result<Vec<Layer>> {
    let mut layers = Vec::new();
    for s in stages {
        let mut idx = vec![s];
        if s == total - 1 {
            idx.push(total);
        }
        for l in idx {
            let (i, o) = layer_dims(l, total, cfg.units);
            let bound = 1.0 / (i as f64).sqrt();
            let weight = Param::new(
                format!("layer{l}.weight"),
                &uniform(cfg.seed, l, 0, (o, i), bound)?,
            )?;
            let bias = Param::new(
                format!("layer{l}.bias"),
                &uniform(cfg.seed, l, 1, (1, o), bound)?.reshape(o)?,
            )?;
            layers.push(Layer {
                linear: Linear::new(weight, Some(bias)),
                relu: l != total,
            });
        }
    }
    Ok(layers)
}

/// This rank's part of the model: the chain list, its parameters (name, var).
fn build(comm: &Communicator, cfg: &Config) -> Result<(MultiNodeChainList, Vec<Param>)> {
    let (r, n) = (comm.rank(), comm.size());
    let stages = cfg.stages.unwrap_or(2.max(n));
    if stages < n {
        return Err(Error::Usage(format!(
            "{n} ranks need at least {n} stages (--stages {stages})"
        )));
    }
    let counts = chunk_sizes(stages, n);
    let first: usize = counts[..r].iter().sum();
    let layers = stage_layers(first..first + counts[r], stages, cfg)?;
    let params = layers.iter().flat_map(|l| l.linear.params()).collect();
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
    Ok((model, params))
}

/// One pass over the test set through the pipeline, no gradient. Rank 0
/// returns the accuracy.
fn evaluate(model: &MultiNodeChainList, test: Option<&TensorDataset>, len: usize) -> Result<f64> {
    let _eval = model.context().no_grad();
    let mut correct = 0.0;
    let batch = 1000;
    let mut at = 0;
    while at < len {
        let k = batch.min(len - at);
        let part = test.map(|t| t.slice(at, k)).transpose()?;
        let out = model.forward(part.as_ref().map(|p| std::slice::from_ref(&p.x)), 1)?;
        if let (Some(y), Some(p)) = (out.outputs.first(), &part) {
            correct += y
                .argmax(1)?
                .eq(&p.t)?
                .to_dtype(DType::F64)?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
        at += k;
    }
    Ok(correct / len as f64)
}

/// Train on every rank of `comm`; rank 0 gets the report.
pub fn run(comm: &Communicator, cfg: &Config) -> Result<Option<Report>> {
    let r = comm.rank();
    let (model, params) = build(comm, cfg)?;
    // Rank 0 reads MNIST; the others learn the sizes and iterate empty data.
    let data = match (r, cfg.dataset) {
        (0, Digits::Mnist) => Some(mnist(cfg.data.as_deref())?),
        (0, Digits::FashionMnist) => Some(fashion_mnist(cfg.data.as_deref())?),
        _ => None,
    };
    let sizes = comm.bcast_obj(
        data.as_ref().map(|(tr, te)| (tr.len(), te.len())).as_ref(),
        0,
    )?;
    let empty = EmptyDataset::new(sizes.0);
    let train: &dyn Dataset = match &data {
        Some((tr, _)) => tr,
        None => &empty,
    };
    let mut it = synchronized_iterator(comm, sizes.0, cfg.batch_size, cfg.seed)?;
    let mut opt = Adam::new(params.clone(), cfg.lr)?;
    let steps_per_epoch = it.batches_per_epoch();
    let trace = std::env::var_os("SHARDNET_TRACE").is_some();
    let mut progress = Progress::new();
    let mut epochs = Vec::new();
    let mut step = 0;
    'training: for epoch in 1..=cfg.epochs {
        progress.restart();
        let (mut loss_sum, mut correct, mut seen, mut steps) = (0.0, 0.0, 0usize, 0usize);
        let mut timed = 0usize;
        for s in 0..steps_per_epoch {
            if cfg.max_steps.is_some_and(|m| step >= m) {
                break;
            }
            let b = it.next_batch(train)?;
            let m = cfg.micro_batches.clamp(1, b.len);
            let parts = chunk_sizes(b.len, m);
            let xs = b.x.as_ref().map(|x| split_rows(x, &parts)).transpose()?;
            let t0 = std::time::Instant::now();
            let out = model.forward(xs.as_deref(), m)?;
            let t1 = std::time::Instant::now();
            let loss = match (&b.t, out.outputs.is_empty()) {
                (Some(t), false) => {
                    let ts = split_rows(t, &parts)?;
                    let mut total: Option<Tensor> = None;
                    for (i, y) in out.outputs.iter().enumerate() {
                        let l = (candle_nn::loss::cross_entropy(y, &ts[i])?
                            * (parts[i] as f64 / b.len as f64))?;
                        correct += y
                            .argmax(1)?
                            .eq(&ts[i])?
                            .to_dtype(DType::F64)?
                            .sum_all()?
                            .to_scalar::<f64>()?;
                        total = Some(match total {
                            Some(acc) => acc.add(&l)?,
                            None => l,
                        });
                    }
                    total
                }
                _ => None,
            };
            if let Some(l) = &loss {
                loss_sum += l.to_scalar::<f32>()? as f64;
            }
            // Parameter gradients accumulate in the Params; candle's store
            // holds only the activations'.
            out.backward_root(loss)?.backward()?;
            let t2 = std::time::Instant::now();
            opt.step()?;
            if trace {
                eprintln!(
                    "rank {r}: forward {:.0} ms, backward {:.0} ms, step {:.0} ms",
                    (t1 - t0).as_secs_f64() * 1e3,
                    (t2 - t1).as_secs_f64() * 1e3,
                    t2.elapsed().as_secs_f64() * 1e3
                );
            }
            step += 1;
            steps += 1;
            seen += b.len;
            if step <= cfg.warmup_steps {
                // Warm-up steps train but do not count towards samples/s.
                progress.restart();
                timed = 0;
            } else {
                timed += b.len;
            }
            if r == 0 && cfg.progress {
                progress.step(
                    epoch,
                    cfg.epochs,
                    s + 1,
                    steps_per_epoch,
                    loss_sum / steps as f64,
                    correct / seen as f64,
                    timed,
                );
            }
        }
        let secs = progress.elapsed();
        if steps == 0 {
            break 'training;
        }
        let test_accuracy = if cfg.evaluate {
            let test = data.as_ref().map(|(_, te)| te);
            evaluate(&model, test, sizes.1)?
        } else {
            f64::NAN
        };
        let e = EpochMetrics {
            epoch,
            steps,
            train_loss: loss_sum / steps as f64,
            train_accuracy: correct / seen as f64,
            test_accuracy,
            samples_per_s: timed as f64 / secs,
        };
        if r == 0 && cfg.progress {
            progress.epoch(&e.summary(cfg.evaluate));
        }
        epochs.push(e);
        if cfg.max_steps.is_some_and(|m| step >= m) {
            break;
        }
    }
    // Everything rank 0 reports: peak memory of each rank, every parameter.
    let peaks = comm.gather_obj(&peak_memory_bytes(), 0)?;
    let mine: Vec<(String, Vec<usize>, Vec<f32>)> = params
        .iter()
        .map(|p| {
            Ok((
                p.name().to_string(),
                p.value().dims().to_vec(),
                p.value().flatten_all()?.to_vec1::<f32>()?,
            ))
        })
        .collect::<Result<_>>()?;
    let all = comm.gather_obj(&mine, 0)?;
    let (Some(peaks), Some(all)) = (peaks, all) else {
        return Ok(None);
    };
    let mut params = BTreeMap::new();
    for (name, dims, v) in all.into_iter().flatten() {
        params.insert(name, Tensor::from_vec(v, dims, &Device::Cpu)?);
    }
    Ok(Some(Report {
        metrics: Metrics::new("mnist-mlp", comm, epochs, peaks, None),
        params,
    }))
}
