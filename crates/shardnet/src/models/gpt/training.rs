//! [`GptTraining`]: this rank's part of the GPT on the t × d grid, its text
//! and optimizer, and one step (see the module doc of [`super`]).

use super::net::{Dropout, Loss, Net};
use super::Config;
use crate::comm::{chunk_range, Communicator};
use crate::data::{synchronized_iterator, Corpus, Dataset, TextWindows};
use crate::functions::Context;
use crate::nn::{Param, ParamStore};
use crate::optim::allreduce_grads;
use crate::train::{Parts, StepOutput, Trace, TrainModel};
use crate::{Error, ReduceOp, Result};
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;

/// The GPT on this rank with its text and optimizer: what the
/// [training loop](crate::train::train) drives.
pub struct GptTraining {
    cfg: Config,
    world: Communicator,
    /// This rank's tensor-parallel group.
    tc: Context,
    /// The ranks at this rank's position in the other groups.
    dp: Option<Context>,
    group: usize,
    groups: usize,
    net: Net,
    train: TextWindows,
    validation: TextWindows,
    /// The last evaluation's mean loss per token.
    validation_loss: Option<f64>,
    /// Parameters, optimizer and the shuffle.
    parts: Parts,
}

impl GptTraining {
    /// Build this rank's part, read the corpus, set up the shuffle and the
    /// optimizer. Collective.
    pub fn new(comm: &Communicator, cfg: &Config) -> Result<Self> {
        cfg.validate(comm.size())?;
        let (groups, t) = cfg.grid(comm.size())?;
        let world = Context::new(comm);
        let group = comm.rank() / t;
        let split = |color: usize| -> Result<Context> {
            world
                .split(Some(color as u32), comm.rank() as i64)?
                .ok_or_else(|| Error::Usage("gpt: a rank was left out of its group".into()))
        };
        let tc = if groups == 1 {
            world.clone()
        } else {
            split(group)?
        };
        let dp = if groups == 1 {
            None
        } else {
            Some(split(groups + comm.rank() % t)?)
        };
        // Every rank reads the corpus; they agree on whether it could.
        let corpus = Corpus::read(cfg.corpus.as_deref());
        let ok: Vec<String> = comm
            .allgather_obj(&corpus.as_ref().err().map(|e| e.to_string()))?
            .into_iter()
            .flatten()
            .collect();
        let corpus = match (corpus, ok.first()) {
            (Err(e), _) => return Err(e),
            (Ok(_), Some(e)) => return Err(Error::Io(format!("another rank: {e}"))),
            (Ok(c), None) => c,
        };
        let host = crate::comm::HOST;
        let train = TextWindows::new(corpus.train.clone(), cfg.seq, &host, "training")?;
        let validation = TextWindows::new(corpus.validation.clone(), cfg.seq, &host, "validation")?;
        let store = ParamStore::new(comm.device(), cfg.seed);
        let net = Net::new(&tc, &store, cfg)?;
        let it = synchronized_iterator(comm, train.len(), cfg.batch_size, cfg.seed)?;
        let parts = Parts::new(store, &cfg.train.optimizer, cfg.train.lr, Some(it))?;
        Ok(GptTraining {
            cfg: cfg.clone(),
            world: comm.clone(),
            tc,
            dp,
            group,
            groups,
            net,
            train,
            validation,
            validation_loss: None,
            parts,
        })
    }

    /// This group's rows of a global batch of windows, on this rank's
    /// device.
    fn rows(&self, x: &Tensor) -> Result<Tensor> {
        let rows = chunk_range(x.dim(0)?, self.groups, self.group);
        Ok(x.narrow(0, rows.start, rows.len())?
            .to_device(self.tc.device())?)
    }

    /// (loss sum, hits) summed over the groups: the same on every rank.
    fn across_groups(&self, sum: f64, hits: usize) -> Result<(f64, usize)> {
        match &self.dp {
            Some(dp) => dp
                .comm()
                .allreduce_obj(&(sum, hits), |a, b| (a.0 + b.0, a.1 + b.1)),
            None => Ok((sum, hits)),
        }
    }

    /// The global norm of the gradients over every split: each sharded
    /// tensor's squares summed over the group, each whole one counted once
    /// (by the group's first rank). Collective over the group.
    fn grad_norm(&self) -> Result<f64> {
        let mut sq = 0.0;
        for p in self.parts.store.params() {
            if p.shard().is_none() && self.tc.rank() != 0 {
                continue;
            }
            if let Some(g) = p.grad() {
                sq += g
                    .to_dtype(DType::F64)?
                    .sqr()?
                    .sum_all()?
                    .to_scalar::<f64>()?;
            }
        }
        let sq = self.tc.comm().allreduce_obj(&sq, |a, b| a + b)?;
        Ok(sq.sqrt())
    }

    /// Scale every gradient so that their global norm is at most `max`
    /// (PyTorch's `clip_grad_norm_`: the factor max / (norm + 1e-6),
    /// applied when below 1).
    fn clip(&self, max: f64) -> Result<()> {
        let norm = self.grad_norm()?;
        let coef = max / (norm + 1e-6);
        if coef < 1.0 {
            for p in self.parts.store.params() {
                if let Some(g) = p.grad().cloned() {
                    p.set_grad(&(g * coef)?)?;
                }
            }
        }
        Ok(())
    }

    /// The gradients of the next batch (forward and backward, summed over
    /// the groups, clipped; no update), whole, on rank 0: what tests
    /// compare between grids. Collective.
    pub fn gradients(&mut self) -> Result<Option<BTreeMap<String, Tensor>>> {
        self.forward_backward(0, &mut Trace::new(self.world.rank()))?;
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
        let whole = grads.gather_whole(self.tc.comm())?;
        Ok(whole.filter(|_| self.world.rank() == 0))
    }

    /// Forward and backward on the next global batch, the gradients summed
    /// over the groups and clipped: (loss sum over the batch's tokens,
    /// hits, tokens), the same on every rank.
    fn forward_backward(&mut self, step: usize, trace: &mut Trace) -> Result<(f64, usize, usize)> {
        let b = self.parts.iterator()?.next_batch(&self.train)?;
        let (Some(x), Some(t)) = (&b.x, &b.t) else {
            return Err(Error::Usage("gpt: a batch without tokens".into()));
        };
        let tokens = b.len * self.cfg.seq;
        let first_row = chunk_range(b.len, self.groups, self.group).start;
        let (x, t) = (self.rows(x)?, self.rows(t)?);
        // The step's dropout seed: the run's and the step's, on every rank.
        let mut s = self.cfg.seed ^ ((step as u64) << 20) ^ 0x6A09_E667_F3BC_C908;
        let dropout = Dropout {
            p: self.cfg.dropout,
            seed: crate::rng::splitmix64(&mut s),
            first_row,
        };
        trace.start();
        let loss = self.net.loss(&x, &t, tokens, Some(dropout))?;
        trace.lap("forward");
        let mut grads = loss.scaled.backward()?;
        self.parts.store.absorb(&mut grads)?;
        trace.lap("backward");
        let partial = self.net.sequence_partial();
        if !partial.is_empty() {
            allreduce_grads(self.tc.comm(), &partial, ReduceOp::Sum)?;
        }
        if let Some(dp) = &self.dp {
            let params: Vec<Param> = self
                .parts
                .store
                .params()
                .into_iter()
                .filter(|p| p.value().elem_count() > 0)
                .collect();
            allreduce_grads(dp.comm(), &params, ReduceOp::Sum)?;
            trace.lap("allreduce");
        }
        if let Some(max) = self.cfg.clip_grad_norm {
            self.clip(max)?;
        }
        let (sum, hits) = self.across_groups(loss.sum, loss.hits)?;
        Ok((sum, hits, tokens))
    }
}

impl TrainModel for GptTraining {
    fn name(&self) -> &str {
        "gpt"
    }

    fn parts(&self) -> &Parts {
        &self.parts
    }

    fn parts_mut(&mut self) -> &mut Parts {
        &mut self.parts
    }

    fn step(&mut self, step: usize, trace: &mut Trace) -> Result<StepOutput> {
        let (sum, hits, tokens) = self.forward_backward(step, trace)?;
        self.parts.opt.step()?;
        trace.lap("step");
        Ok(StepOutput {
            loss: sum / tokens as f64,
            correct: hits,
            samples: tokens,
            skipped: false,
        })
    }

    /// Next-token accuracy over the validation text (every window, in
    /// batches of `--batch-size`); its mean loss goes to the epoch's line.
    fn evaluate(&mut self) -> Result<f64> {
        let _eval = self.tc.no_grad();
        let n = self.validation.len();
        let (mut sum, mut hits, mut at) = (0.0, 0usize, 0usize);
        while at < n {
            let k = self.cfg.batch_size.min(n - at);
            let idx: Vec<usize> = (at..at + k).collect();
            let b = self.validation.batch(&idx)?;
            let (Some(x), Some(t)) = (&b.x, &b.t) else {
                return Err(Error::Usage("gpt: a batch without tokens".into()));
            };
            let (x, t) = (self.rows(x)?, self.rows(t)?);
            let loss = if x.dim(0)? == 0 {
                Loss {
                    sum: 0.0,
                    hits: 0,
                    scaled: Tensor::new(0f32, &crate::comm::HOST)?,
                }
            } else {
                self.net.loss(&x, &t, 1, None)?
            };
            sum += loss.sum;
            hits += loss.hits;
            at += k;
        }
        let (sum, hits) = self.across_groups(sum, hits)?;
        let tokens = (n * self.cfg.seq).max(1) as f64;
        self.validation_loss = Some(sum / tokens);
        Ok(hits as f64 / tokens)
    }

    fn epoch_note(&self) -> String {
        match self.validation_loss {
            Some(l) => format!(
                ", validation loss {l:.4}, perplexity {:.2}, bits per byte {:.3}",
                l.exp(),
                l / std::f64::consts::LN_2
            ),
            None => String::new(),
        }
    }

    /// Every parameter whole by name (the module doc's list), on rank 0
    /// (the groups hold copies; the first group's are gathered); `None`
    /// elsewhere. Collective.
    fn gather_params(&self) -> Result<Option<BTreeMap<String, Tensor>>> {
        let whole = self.parts.store.gather_whole(self.tc.comm())?;
        Ok(whole.filter(|_| self.world.rank() == 0))
    }
}
