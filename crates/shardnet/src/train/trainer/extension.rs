//! What an extension of the loop is ([`Extension`]) and what the loop hands
//! it: after each step a [`StepEvent`], after each epoch an [`EpochEvent`],
//! at the end an [`EndEvent`], with the run's [`Cx`] (communicator, model,
//! options).
//!
//! As in Chainer's `Trainer`, the loop only steps; everything else — the
//! ranks' agreement, the divergence guard, the run log, checkpoints,
//! evaluation, the progress line — is an extension called in a fixed order
//! after each step. Extensions earlier in the order write what later ones
//! read: the agreement fills [`StepEvent::agreed`] and [`StepEvent::stop`],
//! the evaluation [`EpochMetrics::test_accuracy`], the divergence guard
//! [`EpochEvent::warnings`].
//!
//! Every rank calls every hook in the same order, so an extension may make
//! collectives in [`Extension::after_step`], [`Extension::after_epoch`] and
//! [`Extension::finish`] (not in [`Extension::vote`], which is local).

use super::state::LoopState;
use crate::comm::Communicator;
use crate::train::{EpochMetrics, Options, StepOutput, TrainModel};
use crate::Result;

/// The run, as an extension's hook sees it.
pub struct Cx<'a> {
    /// The ranks.
    pub comm: &'a Communicator,
    /// The model being trained.
    pub model: &'a mut dyn TrainModel,
    /// The run's settings.
    pub opts: &'a Options,
}

/// What this rank asks of the agreement after a step (local knowledge,
/// gathered by [`Extension::vote`] before any rank communicates).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Vote {
    /// The ranks must agree after this step (a checkpoint will be written:
    /// nothing non-finite may be saved).
    pub agree: bool,
    /// The first step (1-based) whose loss was not finite on this rank.
    pub bad_step: Option<usize>,
}

/// What the ranks agreed after a step (one small collective).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Agreed {
    /// The signal any rank was stopped by (the largest number; 0 for none).
    pub signal: i32,
    /// The first step whose loss was not finite on any rank.
    pub bad_step: Option<usize>,
    /// Every rank's peak resident memory, bytes.
    pub memory: Vec<u64>,
}

/// One finished step, as every extension sees it.
pub struct StepEvent<'a> {
    /// Steps completed over the run, this one included.
    pub step: usize,
    /// The epoch (1-based).
    pub epoch: usize,
    /// Steps of the epoch completed, this one included.
    pub in_epoch: usize,
    /// Steps in an epoch.
    pub steps_per_epoch: usize,
    /// Steps the run takes.
    pub total: usize,
    /// The step's learning rate.
    pub lr: f64,
    /// What the model's step returned on this rank.
    pub out: StepOutput,
    /// Bytes this rank received during the step.
    pub received: u64,
    /// The step's seconds on this rank.
    pub took: f64,
    /// Past the warm-up steps: the step counts towards samples/s.
    pub warm: bool,
    /// Samples the epoch's timed steps took, and their seconds.
    pub timed: (usize, f64),
    /// The epoch's last step (or the run's).
    pub epoch_done: bool,
    /// What every rank asked of the agreement.
    pub vote: Vote,
    /// What the ranks agreed after this step, when they did.
    pub agreed: Option<Agreed>,
    /// Why the run stops after this step (`SIGINT`, `--stop-after`, …).
    pub stop: Option<String>,
    pub(crate) state: &'a LoopState,
}

impl StepEvent<'_> {
    /// The epoch's mean loss so far.
    pub fn epoch_loss(&self) -> f64 {
        self.state.epoch_loss()
    }

    /// The epoch's training accuracy so far.
    pub fn epoch_accuracy(&self) -> f64 {
        self.state.epoch_accuracy()
    }
}

/// One finished epoch (or the part of it a step limit or a stop allowed).
pub struct EpochEvent<'a> {
    /// Its figures; the evaluation fills the test accuracy (NaN until then).
    pub metrics: EpochMetrics,
    /// Evaluated on the test set.
    pub evaluated: bool,
    /// A stop came in this epoch: it is kept, not evaluated.
    pub interrupted: bool,
    /// Lines the progress display prints after the epoch's summary.
    pub warnings: Vec<String>,
    pub(crate) state: &'a LoopState,
}

/// The run's end (its last step, a step limit, or a stop).
pub struct EndEvent<'a> {
    /// Steps completed over the run.
    pub step: usize,
    /// A signal or `--stop-after` ended it.
    pub interrupted: bool,
    pub(crate) state: &'a LoopState,
}

/// A concern of the loop besides the step: called on every rank, in the
/// order the extensions were given, after each step, after each epoch and
/// at the end. Every hook does nothing by default.
pub trait Extension {
    /// Before the ranks agree after a step: what this rank knows. Local:
    /// no communication here.
    fn vote(&mut self, ev: &StepEvent<'_>, vote: &mut Vote) {
        let _ = (ev, vote);
    }

    /// After each step (and the votes).
    fn after_step(&mut self, cx: &mut Cx<'_>, ev: &mut StepEvent<'_>) -> Result<()> {
        let _ = (cx, ev);
        Ok(())
    }

    /// After each epoch, or the part of it the run took.
    fn after_epoch(&mut self, cx: &mut Cx<'_>, ev: &mut EpochEvent<'_>) -> Result<()> {
        let _ = (cx, ev);
        Ok(())
    }

    /// When the run ends without an error.
    fn finish(&mut self, cx: &mut Cx<'_>, end: &EndEvent<'_>) -> Result<()> {
        let _ = (cx, end);
        Ok(())
    }
}
