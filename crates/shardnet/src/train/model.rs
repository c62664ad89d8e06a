//! What the loop asks of a model ([`TrainModel`]): a step, an evaluation,
//! and its [`Parts`] (parameters, optimizer, iterator, loss scaler), from
//! which its checkpointed state ([`ModelScalars`] and the state tensors) is
//! read and restored the same way for every model; [`StepOutput`] and the
//! per-phase [`Trace`].

use crate::data::SerialIterator;
use crate::nn::{ParamStore, StateTensor};
use crate::optim::{LossScaler, Optimizer, OptimizerConfig};
use crate::{Error, Result};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Instant;

/// What every model's training holds besides its network: the parameters,
/// the optimizer over them, the batch iterator (where the model reads
/// batches through one) and the loss scaler (half precision). The loop sets
/// the learning rate through it, and checkpoints read and restore it.
pub struct Parts {
    /// This rank's parameters.
    pub store: ParamStore,
    /// The optimizer over them.
    pub opt: Optimizer,
    /// The batch iterator, whose position a checkpoint keeps.
    pub it: Option<SerialIterator>,
    /// The dynamic loss scaler, under half precision.
    pub scaler: Option<LossScaler>,
}

impl Parts {
    /// `store`'s parameters trained by `cfg`'s optimizer at base rate `lr`,
    /// batches from `it`. From then on the loop sets the rate, once per
    /// step ([`Optimizer::set_lr`]), and nothing else does.
    pub fn new(
        store: ParamStore,
        cfg: &OptimizerConfig,
        lr: f64,
        it: Option<SerialIterator>,
    ) -> Result<Self> {
        let opt = Optimizer::new(cfg, store.params(), lr)?;
        Ok(Parts {
            store,
            opt,
            it,
            scaler: None,
        })
    }

    /// The batch iterator, for a model that reads its batches through one.
    pub fn iterator(&mut self) -> Result<&mut SerialIterator> {
        self.it
            .as_mut()
            .ok_or_else(|| Error::Usage("this model reads no batches through an iterator".into()))
    }
}

/// A model with its data and optimizer, ready for [`train`](super::train).
/// Every method is called on every rank, in the same order.
pub trait TrainModel {
    /// The name in the metrics (`mnist-mlp`, `face-head`, …).
    fn name(&self) -> &str;

    /// Steps in one epoch. Default: the iterator's batches per epoch.
    fn steps_per_epoch(&self) -> usize {
        self.parts()
            .it
            .as_ref()
            .map_or(0, |it| it.batches_per_epoch())
    }

    /// Step `step` (0-based over the run): read the next batch, forward,
    /// backward, and update the parameters (the loop has set this step's
    /// learning rate in [`Parts::opt`]). Call [`Trace::start`] once the
    /// batch is ready and [`Trace::lap`] after each phase.
    fn step(&mut self, step: usize, trace: &mut Trace) -> Result<StepOutput>;

    /// Test-set accuracy in [0, 1] (each rank evaluates its share; rank 0's
    /// answer is the one reported).
    fn evaluate(&mut self) -> Result<f64>;

    /// What one of [`StepOutput::samples`] is, as the progress line and
    /// the epoch's summary name the throughput (`samples`, a GPT's
    /// `tokens`).
    fn throughput_unit(&self) -> &'static str {
        "samples"
    }

    /// Text appended to an epoch's summary line (e.g. the loss scale).
    fn epoch_note(&self) -> String {
        String::new()
    }

    /// The parameters, optimizer, iterator and loss scaler.
    fn parts(&self) -> &Parts;

    /// [`TrainModel::parts`], to change.
    fn parts_mut(&mut self) -> &mut Parts;

    /// State tensors besides the parameters and the optimizer's (batch
    /// norm's running statistics).
    fn extra_state(&self) -> Vec<StateTensor> {
        Vec::new()
    }

    /// Every tensor of this rank's training state (parameters, optimizer
    /// moments, running statistics), read and written in place by
    /// checkpoints.
    fn state(&self) -> Vec<StateTensor> {
        let parts = self.parts();
        let mut s = parts.store.state();
        s.extend(self.extra_state());
        s.extend(parts.opt.state());
        s
    }

    /// The scalar state a checkpoint keeps (optimizer step, iterator
    /// position, loss scale).
    fn scalars(&self) -> ModelScalars {
        ModelScalars::of(self.parts())
    }

    /// Continue from a checkpoint's scalar state.
    fn restore_scalars(&mut self, s: &ModelScalars) -> Result<()> {
        s.apply(self.parts_mut())
    }

    /// Whether a checkpoint written by `ranks` ranks can continue on this
    /// run's (another number): an error says why not. Default: yes, every
    /// sharded tensor is re-split.
    fn resume_from_ranks(&self, ranks: usize) -> Result<()> {
        let _ = ranks;
        Ok(())
    }

    /// The current loss scale, under half precision.
    fn loss_scale(&self) -> Option<f64> {
        self.parts().scaler.as_ref().map(|s| s.scale)
    }

    /// Every parameter after training, whole, by name, on rank 0 (the
    /// others get `None`): what `--save-params` writes. Collective. Default:
    /// none kept.
    fn gather_params(&self) -> Result<Option<BTreeMap<String, Tensor>>> {
        Ok(None)
    }
}

/// What one training step did, as seen by this rank.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepOutput {
    /// The step's loss (mean over the batch); 0 on a rank that does not
    /// compute it.
    pub loss: f64,
    /// Examples of the batch classified correctly (0 where not computed).
    pub correct: usize,
    /// Examples in the (global) batch.
    pub samples: usize,
    /// The loss scaler skipped this step (inf/NaN gradients): its loss may
    /// be non-finite without the run having diverged. Must agree on every
    /// rank (the scaler decides collectively).
    pub skipped: bool,
}

/// The scalar state of a model that a checkpoint keeps next to its tensors.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelScalars {
    /// The optimizer's updates so far (Adam's t; SGD's count).
    pub optimizer_steps: u64,
    /// The batch iterator's (completed epochs, position in the epoch).
    pub iterator: Option<(usize, usize)>,
    /// The dynamic loss scale (half precision).
    pub loss_scaler: Option<crate::optim::LossScaler>,
}

impl ModelScalars {
    /// The scalars of `parts`.
    pub fn of(parts: &Parts) -> Self {
        ModelScalars {
            optimizer_steps: parts.opt.steps(),
            iterator: parts.it.as_ref().map(|i| i.position()),
            loss_scaler: parts.scaler.clone(),
        }
    }

    /// Put these scalars back into `parts`; a part the checkpoint lacks (or
    /// has where the model has none) is an error.
    pub fn apply(&self, parts: &mut Parts) -> Result<()> {
        parts.opt.set_steps(self.optimizer_steps);
        match (parts.it.as_mut(), self.iterator) {
            (Some(it), Some(p)) => it.set_position(p)?,
            (None, None) => {}
            _ => {
                return Err(Error::Usage(
                    "the checkpoint's batch iterator does not match this model's".into(),
                ))
            }
        }
        match (parts.scaler.as_mut(), &self.loss_scaler) {
            (Some(s), Some(saved)) => *s = saved.clone(),
            (None, None) => {}
            _ => {
                return Err(Error::Usage(
                    "the checkpoint's loss scaler does not match this model's precision".into(),
                ))
            }
        }
        Ok(())
    }
}

/// Per-step phase timing, printed by rank when `SHARDNET_TRACE` is set:
/// `rank 0: forward 3 ms, backward 5 ms, step 1 ms`.
pub struct Trace {
    rank: usize,
    on: bool,
    last: Instant,
    laps: Vec<(&'static str, f64)>,
}

impl Trace {
    /// Timing for `rank`, on when `SHARDNET_TRACE` is set.
    pub fn new(rank: usize) -> Self {
        Trace {
            rank,
            on: std::env::var_os("SHARDNET_TRACE").is_some(),
            last: Instant::now(),
            laps: Vec::new(),
        }
    }

    /// Start timing the step's first phase now.
    pub fn start(&mut self) {
        self.laps.clear();
        self.last = Instant::now();
    }

    /// The phase `name` ends now; the next one starts.
    pub fn lap(&mut self, name: &'static str) {
        if self.on {
            let now = Instant::now();
            self.laps.push((name, (now - self.last).as_secs_f64()));
            self.last = now;
        }
    }

    /// Print the step's phases (when on).
    pub(super) fn print(&mut self) {
        if self.on && !self.laps.is_empty() {
            let parts: Vec<String> = self
                .laps
                .iter()
                .map(|(name, s)| format!("{name} {:.0} ms", s * 1e3))
                .collect();
            eprintln!("rank {}: {}", self.rank, parts.join(", "));
        }
        self.laps.clear();
    }
}
