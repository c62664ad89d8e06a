//! ChainerMN's model-parallel MLP on MNIST, as `shardnet train mnist-mlp`.
//!
//! The MLP has S stages: stage s is `relu(Linear(in, U))` (in = 784 for
//! s = 0, else U), and the last stage ends with `Linear(U, 10)`. With S = 2
//! on 2 ranks this is ChainerMN's example: rank 0 holds `Linear(784, U)` +
//! relu, rank 1 holds `Linear(U, U)` + relu + `Linear(U, 10)`. The stages
//! are cut into p·V chunks ([`chunk_sizes`], or by cost with `--balance
//! auto`: [`crate::links::balance`]) and trained as a [`Pipeline`] by `--schedule`
//! (GPipe, 1F1B, interleaved with V = `--virtual-stages` chunks per rank,
//! zero-bubble). Rank 0 reads the data and feeds chunk 0; the loss is on
//! the last chunk's rank (p − 1), which rank 0 sends the labels and which
//! sends rank 0 the step's loss and hits. Other ranks iterate an empty
//! dataset of the same length. [`MlpTraining`] plugs the model into the
//! [shared training loop](crate::train::train).
//!
//! Parameters are initialised from (seed, layer), uniform in ±1/√in (as
//! PyTorch's and Chainer's default), so any split of the same S stages over
//! any number of ranks, any schedule and any placement trains the same
//! model: the exactness tests compare 1, 2, 3 and 4 ranks, every schedule.
//!
//! **One step.** Every rank draws the same batch indices
//! (`synchronized_iterator`: rank 0's seed, broadcast once). The ranks agree
//! on (schedule, M, V) in one digest collective, and each takes its passes
//! from the `Plan` for M (made once per M). F(v, i): x is rank 0's
//! micro-batch (chunk 0) or the activation received, made a `Var`; the
//! chunk's output is sent on at once (sends never wait), or on the last
//! chunk the loss is CE(y_i, t_i) · |i| / B, the mean over the whole batch.
//! B(v, i): backward from that loss or from y · g with g received; dL/dx
//! goes back. Each `Linear` writes dW += gᵀx and db += Σ g into its `Param`
//! buffers, one GEMM per micro-batch (in B, or in W under zero-bubble); on
//! the generic path candle's backward computes them and nothing is
//! deferred. `Adam::step` reads each buffer once. `SHARDNET_TRACE=1` prints
//! each rank's pipeline and optimizer time per step.
//!
//! Why its own `Linear` and `Adam`: for a 4096 × 4096 weight on one core,
//! candle's backward takes 46 ms per accumulation and candle-nn's AdamW
//! 578 ms per step, against a 44 ms forward GEMM; the 5-stage 4096-unit MLP
//! trains at 118 samples/s on one rank with them, 63 with candle's (batch
//! 100).

mod config;
mod memory;

pub use config::{Balance, Config};

use super::digits::{on_device, RankZeroData};
use crate::comm::{chunk_sizes, split_rows, Communicator};
use crate::data::TensorDataset;
use crate::links::{ChainLink, Pipeline};
use crate::nn::{Linear, ParamStore};
use crate::train::plan::{MemoryPlan, Placement};
use crate::train::{split_flags, ModelConfig, Options, Parts, Size, StepOutput, Trace, TrainModel};
use crate::{Error, Result};
use candle_core::Tensor;
use std::collections::BTreeMap;

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

/// This rank's chunks of the model as a pipeline, and its parameters.
fn build(comm: &Communicator, cfg: &Config) -> Result<(Pipeline, ParamStore)> {
    let (r, n) = (comm.rank(), comm.size());
    let stages = cfg.stages_on(n);
    let chunks = cfg.chunks_on(n)?;
    let store = ParamStore::new(comm.device(), cfg.seed);
    let mut mine: Vec<Box<dyn ChainLink>> = Vec::new();
    for c in (r..chunks.len()).step_by(n) {
        let layers = stage_layers(chunks[c].clone(), stages, cfg.units, &store)?;
        mine.push(Box::new(StageRun { layers }));
    }
    let costs = cfg.costs(n, &chunks);
    let pipe = Pipeline::new(comm, cfg.schedule_on(n), mine)?.with_costs(costs);
    Ok((pipe, store))
}

/// On the last chunk's rank: `value` sent to rank 0 (a step's loss and
/// hits, an evaluation's logits); rank 0 returns what arrived, the others
/// `None`. With one rank, `value` itself.
fn to_rank_zero(comm: &Communicator, value: Option<Tensor>) -> Result<Option<Tensor>> {
    let (r, n) = (comm.rank(), comm.size());
    if n == 1 {
        return Ok(value);
    }
    if r == n - 1 {
        let v = value.ok_or_else(|| {
            Error::Usage("the last rank of the pipeline has no output to report".into())
        })?;
        comm.send(&v, 0)?;
    }
    if r == 0 {
        return Ok(Some(comm.recv(n - 1)?));
    }
    Ok(None)
}

/// One pass over the test set through the pipeline, no gradient. Rank 0
/// returns the accuracy.
fn evaluate(
    pipe: &Pipeline,
    comm: &Communicator,
    test: Option<&TensorDataset>,
    len: usize,
) -> Result<f64> {
    let device = comm.device();
    let mut correct = 0.0;
    let batch = 1000;
    let mut at = 0;
    while at < len {
        let k = batch.min(len - at);
        let part = test
            .map(|t| on_device(&t.slice(at, k)?, device))
            .transpose()?;
        let out = pipe.forward(part.as_ref().map(|p| std::slice::from_ref(&p.x)), 1)?;
        // The logits go to rank 0, which has the labels.
        let y = to_rank_zero(comm, out.into_iter().next())?;
        if let (Some(y), Some(p)) = (y, &part) {
            correct += crate::functions::top1_hits(&y.to_device(device)?, &p.t)? as f64;
        }
        at += k;
    }
    Ok(correct / len as f64)
}

/// The MLP on this rank with its data and optimizer: what the
/// [training loop](crate::train::train) drives.
pub struct MlpTraining {
    cfg: Config,
    comm: Communicator,
    model: Pipeline,
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
            comm: comm.clone(),
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
        let comm = &self.comm;
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
        let now = self.comm.size();
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
        let comm = self.comm.clone();
        let (r, n) = (comm.rank(), comm.size());
        let device = comm.device();
        let m = self.cfg.micro_batches.clamp(1, b.len);
        if m < self.cfg.micro_batches && !self.noted_short_batch {
            // On purpose (the epoch's last batch may be short); said once.
            self.noted_short_batch = true;
            if r == 0 {
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
        // The loss is on the last rank: rank 0 sends it the labels.
        let labels = match (&b.t, r) {
            (Some(t), 0) if n > 1 => {
                comm.send(t, n - 1)?;
                None
            }
            (Some(t), _) => Some(t.clone()),
            (None, _) if r == n - 1 => Some(comm.recv(0)?),
            _ => None,
        };
        let ts = labels
            .map(|t| split_rows(&t.to_device(device)?, &parts))
            .transpose()?;
        trace.start();
        let mut correct = 0usize;
        let losses = self.model.step(xs.as_deref(), m, &mut |i, y| {
            let ts = ts.as_ref().ok_or_else(|| {
                Error::Usage("the last rank of the pipeline has no labels".into())
            })?;
            correct += crate::functions::top1_hits(y, &ts[i])?;
            Ok((candle_nn::loss::cross_entropy(y, &ts[i])? * (parts[i] as f64 / b.len as f64))?)
        })?;
        trace.lap("pipeline");
        let report = if losses.is_empty() {
            None
        } else {
            let mut loss = 0.0;
            for l in &losses {
                loss += l.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
            }
            Some(Tensor::new(&[loss, correct as f64], &crate::comm::HOST)?)
        };
        let (loss, correct) = match to_rank_zero(&comm, report)? {
            Some(t) => {
                let v = t.to_vec1::<f64>()?;
                (v[0], v[1] as usize)
            }
            None => (0.0, 0),
        };
        self.parts.opt.step()?;
        trace.lap("step");
        Ok(StepOutput {
            loss,
            correct,
            samples: b.len,
            skipped: false,
        })
    }

    fn evaluate(&mut self) -> Result<f64> {
        evaluate(
            &self.model,
            &self.comm,
            self.digits.test(),
            self.digits.test_len,
        )
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

    fn validate(&self, ranks: usize) -> Result<()> {
        Config::validate(self)?;
        self.check_size(ranks)?;
        self.pipeline_plan(ranks).map(|_| ())
    }

    fn memory_plan(&self, placement: Placement) -> Option<MemoryPlan> {
        Some(MemoryPlan::new(self, placement))
    }

    fn build(&self, comm: &Communicator) -> Result<MlpTraining> {
        MlpTraining::new(comm, self)
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

    /// A stage per rank (its micro-batches and schedule as they are).
    fn splits(&self, ranks: usize) -> Vec<(String, Self)> {
        vec![(
            split_flags(&[("--stages", ranks)]),
            Config {
                stages: Some(ranks),
                ..self.clone()
            },
        )]
    }
}
