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
//! **Data parallelism** (`--data-parallel G`): the ranks form G groups of
//! ranks/G, each group one pipeline (group g is ranks g·p … g·p + p − 1)
//! training on its rows of every batch (`chunk_range`); rank 0 deals each
//! group's rows out, the inputs to its first rank and the labels to its
//! last, and each group's loss is its rows' share of the whole batch's
//! mean. The ranks holding the same stages in the G groups are one
//! data-parallel group, over which `--shard-state` shares:
//!
//! | `--shard-state` | each replica holds | after backward |
//! |---|---|---|
//! | `none` | everything whole | gradients allreduced, Adam steps everything |
//! | `optimizer` (ZeRO-1, the default) | Adam's rows of its share | gradients reduce-scattered, its rows stepped, parameters allgathered ([`sharded_step`]) |
//! | `gradients` (ZeRO-2) | each weight whole (gathered by the step's first pass, kept for the step) and a share of its gradient and moments | nothing for the weights: each pass's dW was reduce-scattered into the shares by the layer; the biases allreduced |
//! | `parameters` (ZeRO-3, FSDP) | a share of each weight, its gradient and moments | as `gradients`; each weight is gathered for each pass and dropped after, by blocks of `--gather-block-mib` |
//!
//! A weight's share is its chunk along its larger dimension
//! ([`Linear::fully_sharded`]); every micro-batch's weight gradient is
//! reduce-scattered as its backward ends (never deferred to zero-bubble's W
//! pass), so with one micro-batch the groups train ZeRO-1's parameters bit
//! for bit, and with several to rounding (each micro-batch is summed over
//! the groups before the next is added). Fully sharded, a weight shared out
//! by rows and larger than `--gather-block-mib` (8 MiB) is gathered a block
//! of rows at a time and each block's gradient reduce-scattered
//! ([`Linear::with_gather_block`]): a rank holds one block of a weight and
//! of its gradient at a time, and dL/dx, summed block by block, agrees with
//! ZeRO-1's to rounding.
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

use super::digits::RankZeroData;
use super::shares::share_out;
use crate::comm::{chunk_range, chunk_sizes, split_rows, Communicator};
use crate::functions::Context;
use crate::links::{ChainLink, Pipeline};
use crate::nn::{Linear, Param, ParamStore};
use crate::optim::{allreduce_grads, sharded_step, ShardState};
use crate::train::plan::{MemoryPlan, Placement};
use crate::train::{split_flags, ModelConfig, Options, Parts, Size, StepOutput, Trace, TrainModel};
use crate::ReduceOp;
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

/// This rank's chunks of the model as a pipeline over `pc` (its group's
/// ranks), and its parameters. With `shares`, each weight is shared out
/// over the replicas of `dp` (`--shard-state gradients` or `parameters`):
/// made whole one layer at a time (the unsharded model's values), this
/// replica's chunk along the weight's larger dimension registered in the
/// store under the weight's name with its [`Shard`](crate::nn::Shard), the
/// layer sharded ([`share_out`]).
fn build(
    pc: &Communicator,
    cfg: &Config,
    shares: Option<(&Context, ShardState)>,
) -> Result<(Pipeline, ParamStore, Vec<Linear>)> {
    let (r, n) = (pc.rank(), pc.size());
    let stages = cfg.stages_on(n);
    let chunks = cfg.chunks_on(n)?;
    let store = ParamStore::new(pc.device(), cfg.seed);
    let mut mine: Vec<Box<dyn ChainLink>> = Vec::new();
    let mut linears = Vec::new();
    for c in (r..chunks.len()).step_by(n) {
        let layers = match shares {
            None => stage_layers(chunks[c].clone(), stages, cfg.units, &store)?,
            Some((dp, state)) => {
                let mut layers = Vec::new();
                for s in chunks[c].clone() {
                    let whole = ParamStore::new(pc.device(), cfg.seed);
                    for l in stage_layers(s..s + 1, stages, cfg.units, &whole)? {
                        let block = cfg.gather_block;
                        let linear = share_out(&l.linear, dp, state, &store, block)?;
                        layers.push(Layer { linear, ..l });
                    }
                }
                layers
            }
        };
        linears.extend(layers.iter().map(|l| l.linear.clone()));
        mine.push(Box::new(StageRun { layers }));
    }
    let costs = cfg.costs(n, &chunks);
    let pipe = Pipeline::new(pc, cfg.schedule_on(n), mine)?.with_costs(costs);
    Ok((pipe, store, linears))
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

/// The MLP on this rank with its data and optimizer: what the
/// [training loop](crate::train::train) drives.
pub struct MlpTraining {
    cfg: Config,
    /// Every rank.
    world: Communicator,
    /// This rank's pipeline (its group's ranks).
    comm: Communicator,
    /// The ranks holding the same stages in the other groups (G > 1).
    dp: Option<Context>,
    /// This rank's group and the groups.
    group: usize,
    groups: usize,
    model: Pipeline,
    /// This rank's layers (the pipeline's chunks hold them too).
    linears: Vec<Linear>,
    digits: RankZeroData,
    /// Parameters, optimizer and the shuffle.
    parts: Parts,
    /// Whether the weights are shared out over the groups (their
    /// gradients summed by the layers themselves).
    shared: bool,
    /// Whether the note on a last batch shorter than the micro-batches was
    /// printed.
    noted_short_batch: bool,
}

impl MlpTraining {
    /// Build this rank's stages, read the data on rank 0 (the others learn
    /// its sizes), and set up the shuffle and Adam. Collective.
    pub fn new(comm: &Communicator, cfg: &Config) -> Result<Self> {
        cfg.validate()?;
        let (groups, p) = cfg.grid(comm.size())?;
        let group = comm.rank() / p;
        let world = Context::new(comm);
        let split = |color: usize| -> Result<Context> {
            world
                .split(Some(color as u32), comm.rank() as i64)?
                .ok_or_else(|| Error::Usage("mnist-mlp: a rank was left out of its group".into()))
        };
        let (pc, dp) = if groups == 1 {
            (comm.clone(), None)
        } else {
            (
                split(group)?.comm().clone(),
                Some(split(groups + comm.rank() % p)?),
            )
        };
        let shared = dp.is_some()
            && matches!(
                cfg.shard_state,
                ShardState::Gradients | ShardState::Parameters
            );
        let (model, store, linears) = build(
            &pc,
            cfg,
            dp.as_ref().filter(|_| shared).map(|d| (d, cfg.shard_state)),
        )?;
        let (digits, it) = RankZeroData::read(
            comm,
            cfg.dataset,
            cfg.data.as_deref(),
            cfg.batch_size,
            cfg.seed,
        )?;
        if groups > 1 {
            // Every group needs an example of every batch (and of every
            // slice of the test set evaluated at once).
            let last = digits.train_len % cfg.batch_size;
            if last != 0 && last < groups {
                return Err(Error::Usage(format!(
                    "an epoch's last batch has {last} examples ({} % --batch-size {}), fewer than \
                     the {groups} data-parallel groups: give a --batch-size that leaves at least \
                     {groups} (or none)",
                    digits.train_len, cfg.batch_size
                )));
            }
            let slice = eval_slices(digits.test_len).into_iter().min().unwrap_or(0);
            if cfg.train.evaluate && slice < groups {
                return Err(Error::Usage(format!(
                    "the test set ({} examples) is evaluated in slices of {slice}, fewer than \
                     the {groups} data-parallel groups: give --no-eval or fewer groups",
                    digits.test_len
                )));
            }
        }
        let mut parts = Parts::new(store, &cfg.train.optimizer, cfg.train.lr, Some(it))?;
        if let Some(dp) = dp
            .as_ref()
            .filter(|_| cfg.shard_state == ShardState::Optimizer)
        {
            // Each replica keeps and steps its rows of the optimizer's
            // state (ZeRO stage 1).
            parts.opt.shard_state(dp.size(), dp.rank())?;
        }
        Ok(MlpTraining {
            cfg: cfg.clone(),
            world: comm.clone(),
            comm: pc,
            dp,
            group,
            groups,
            model,
            linears,
            digits,
            parts,
            shared,
            noted_short_batch: false,
        })
    }

    /// Rank 0's `x` and `t` (a batch, or a slice of the test set) dealt
    /// out: each group's rows of `x` to its pipeline's first rank, of `t`
    /// to its last; `len` rows in all, known everywhere. Returns this
    /// rank's (x, t), each where it goes.
    fn deal(
        &self,
        x: Option<&Tensor>,
        t: Option<&Tensor>,
        len: usize,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let world = &self.world;
        let (p, me) = (self.comm.size(), world.rank());
        let device = world.device();
        let (mut x_mine, mut t_mine) = (None, None);
        if me == 0 {
            let (Some(x), Some(t)) = (x, t) else {
                return Err(Error::Usage("mnist-mlp: rank 0 has no batch".into()));
            };
            for q in 0..self.groups {
                let rows = chunk_range(len, self.groups, q);
                let xq = x.narrow(0, rows.start, rows.len())?;
                let tq = t.narrow(0, rows.start, rows.len())?;
                let (first, last) = (q * p, q * p + p - 1);
                match first {
                    0 => x_mine = Some(xq),
                    dst => world.send(&xq.contiguous()?, dst)?,
                }
                match last {
                    0 => t_mine = Some(tq),
                    dst => world.send(&tq.contiguous()?, dst)?,
                }
            }
        } else {
            if me % p == 0 {
                x_mine = Some(world.recv(0)?);
            }
            if me % p == p - 1 {
                t_mine = Some(world.recv(0)?);
            }
        }
        let on = |v: Option<Tensor>| v.map(|v| v.to_device(device)).transpose();
        Ok((on(x_mine)?, on(t_mine)?))
    }

    /// (loss, hits) summed over the groups' last ranks, on rank 0 (0
    /// elsewhere; every rank with several groups).
    fn report(&self, value: Option<(f64, usize)>) -> Result<(f64, usize)> {
        if self.groups == 1 {
            let t = value
                .map(|(l, c)| Tensor::new(&[l, c as f64], &crate::comm::HOST))
                .transpose()?;
            return Ok(match to_rank_zero(&self.comm, t)? {
                Some(t) => {
                    let v = t.to_vec1::<f64>()?;
                    (v[0], v[1] as usize)
                }
                None => (0.0, 0),
            });
        }
        self.world
            .allreduce_obj(&value.unwrap_or((0.0, 0)), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// The weights kept whole since the last step (`--shard-state
    /// gradients`) dropped: the next pass gathers the shares again.
    fn forget_gathered(&self) {
        for l in &self.linears {
            l.forget_gathered();
        }
    }
}

/// The test set's slices evaluated at once: ≤ 1000 examples, as even as
/// can be.
fn eval_slices(len: usize) -> Vec<usize> {
    chunk_sizes(len, len.div_ceil(1000).max(1))
}

impl TrainModel for MlpTraining {
    /// Every parameter by name (`layer{l}.weight`, `.bias`), whole, on
    /// rank 0 (the first group's, or every group's shares joined); `None`
    /// elsewhere. Collective.
    fn gather_params(&self) -> Result<Option<BTreeMap<String, Tensor>>> {
        let holders = if self.shared { &self.world } else { &self.comm };
        let whole = self.parts.store.gather_whole_with(holders, &[])?;
        Ok(whole.filter(|_| self.world.rank() == 0))
    }

    fn resume_from_ranks(&self, ranks: usize) -> Result<()> {
        let (g, now) = (self.groups, self.comm.size());
        let then = ranks / g;
        if self.cfg.stages.is_none() && 2.max(then) != 2.max(now) {
            return Err(Error::Usage(format!(
                "without --stages the MLP has as many stages as each pipeline has ranks (at \
                 least 2: {} then, {} now, with --data-parallel {g}), so this model needs \
                 {ranks} ranks; a run started with --stages S can continue on any number of \
                 pipeline ranks up to S",
                2.max(then),
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
        let r = self.world.rank();
        // Each micro-batch of each group needs an example.
        let m = self
            .cfg
            .micro_batches
            .clamp(1, (b.len / self.groups).max(1));
        if m < self.cfg.micro_batches && !self.noted_short_batch {
            // On purpose (the epoch's last batch may be short); said once.
            self.noted_short_batch = true;
            if r == 0 {
                eprintln!(
                    "note: an epoch's last batch has {} examples, too few for --micro-batches {}{}: \
                     it runs as {m} micro-batches",
                    b.len,
                    self.cfg.micro_batches,
                    if self.groups > 1 {
                        format!(" in each of {} groups", self.groups)
                    } else {
                        String::new()
                    }
                );
            }
        }
        // Weights kept whole (sharded gradients) are gathered afresh from
        // the shares the last step updated (or a checkpoint restored).
        self.forget_gathered();
        let (x, t) = self.deal(b.x.as_ref(), b.t.as_ref(), b.len)?;
        let rows = chunk_range(b.len, self.groups, self.group).len();
        let parts = chunk_sizes(rows, m);
        let xs = x.map(|x| split_rows(&x, &parts)).transpose()?;
        let ts = t.map(|t| split_rows(&t, &parts)).transpose()?;
        trace.start();
        let mut correct = 0usize;
        let losses = self.model.step(xs.as_deref(), m, &mut |i, y| {
            let ts = ts.as_ref().ok_or_else(|| {
                Error::Usage("the last rank of the pipeline has no labels".into())
            })?;
            correct += crate::functions::top1_hits(y, &ts[i])?;
            // The mean over the whole batch: every group's share of it.
            Ok((candle_nn::loss::cross_entropy(y, &ts[i])? * (parts[i] as f64 / b.len as f64))?)
        })?;
        trace.lap("pipeline");
        let mut mine = None;
        if !losses.is_empty() {
            let mut loss = 0.0;
            for l in &losses {
                loss += l.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
            }
            mine = Some((loss, correct));
        }
        match (&self.dp, self.cfg.shard_state) {
            (None, _) => self.parts.opt.step()?,
            // The groups' gradients summed into each rank's rows, those
            // rows stepped, the parameters gathered.
            (Some(dp), ShardState::Optimizer) => {
                sharded_step(dp.comm(), &mut self.parts.opt, ReduceOp::Sum)?
            }
            (Some(dp), _) => {
                // The whole parameters' gradients summed (every one, or the
                // biases beside the shares, which the layers summed).
                let whole: Vec<Param> = self
                    .parts
                    .store
                    .params()
                    .into_iter()
                    .filter(|p| !self.shared || p.shard().is_none())
                    .collect();
                allreduce_grads(dp.comm(), &whole, ReduceOp::Sum)?;
                self.parts.opt.step()?
            }
        }
        trace.lap("step");
        let (loss, correct) = self.report(mine)?;
        Ok(StepOutput {
            loss,
            correct,
            samples: b.len,
            skipped: false,
        })
    }

    /// One pass over the test set through the pipelines (each group its
    /// rows of each slice), no gradient; the accuracy on rank 0 (every
    /// rank with several groups).
    fn evaluate(&mut self) -> Result<f64> {
        let _eval = self.dp.as_ref().map(|dp| dp.no_grad());
        self.forget_gathered();
        let device = self.world.device().clone();
        let test = self.digits.test();
        let len = self.digits.test_len;
        let (mut hits, mut at) = (0usize, 0usize);
        for k in eval_slices(len) {
            let part = test.map(|t| t.slice(at, k)).transpose()?;
            let (x, t) = self.deal(part.as_ref().map(|p| &p.x), part.as_ref().map(|p| &p.t), k)?;
            let x = x.map(|x| x.to_device(&device)).transpose()?;
            let out = self
                .model
                .forward(x.as_ref().map(std::slice::from_ref), 1)?;
            if let (Some(y), Some(t)) = (out.first(), &t) {
                hits += crate::functions::top1_hits(y, t)?;
            }
            at += k;
        }
        let (_, hits) = self.report(Some((0.0, hits)))?;
        Ok(hits as f64 / len.max(1) as f64)
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
        let (_, p) = self.grid(ranks)?;
        self.check_size(p)?;
        self.pipeline_plan(p).map(|_| ())
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

    /// A stage per rank (its micro-batches and schedule as they are), one
    /// group.
    fn splits(&self, ranks: usize) -> Vec<(String, Self)> {
        vec![(
            split_flags(&[("--stages", ranks)]),
            Config {
                stages: Some(ranks),
                data_parallel: 1,
                ..self.clone()
            },
        )]
    }
}
