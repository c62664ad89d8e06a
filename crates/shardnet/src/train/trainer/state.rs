//! Where the loop stands ([`LoopState`]): what a checkpoint keeps of it,
//! so that a resumed run reports what the uninterrupted one would, and the
//! check that a checkpoint's position is one a run can reach.

use crate::train::{EpochMetrics, StepOutput};
use serde::{Deserialize, Serialize};

/// Steps skipped in a row by the loss scaler after which the run counts as
/// diverged (the scale has been halved this many times without one good
/// step).
pub const MAX_SKIPPED_IN_A_ROW: usize = 25;

/// f64 as its bits, so that a checkpoint gives back exactly what it took.
mod bits {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        v.to_bits().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        u64::deserialize(d).map(f64::from_bits)
    }
}

/// A finished epoch's figures, exactly (f64 bits).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct EpochRecord {
    pub(crate) epoch: usize,
    pub(crate) steps: usize,
    #[serde(with = "bits")]
    pub(crate) train_loss: f64,
    #[serde(with = "bits")]
    pub(crate) train_accuracy: f64,
    #[serde(with = "bits")]
    pub(crate) test_accuracy: f64,
    #[serde(with = "bits")]
    pub(crate) samples_per_s: f64,
}

impl From<&EpochMetrics> for EpochRecord {
    fn from(e: &EpochMetrics) -> Self {
        EpochRecord {
            epoch: e.epoch,
            steps: e.steps,
            train_loss: e.train_loss,
            train_accuracy: e.train_accuracy,
            test_accuracy: e.test_accuracy,
            samples_per_s: e.samples_per_s,
        }
    }
}

impl From<&EpochRecord> for EpochMetrics {
    fn from(e: &EpochRecord) -> Self {
        EpochMetrics {
            epoch: e.epoch,
            steps: e.steps,
            train_loss: e.train_loss,
            train_accuracy: e.train_accuracy,
            test_accuracy: e.test_accuracy,
            samples_per_s: e.samples_per_s,
        }
    }
}

/// Where the loop stands: what a checkpoint keeps of it, so that a resumed
/// run reports what the uninterrupted one would.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct LoopState {
    /// Steps completed over the run.
    pub(crate) step: usize,
    /// The epoch in progress (1-based).
    pub(crate) epoch: usize,
    /// Its steps completed.
    pub(crate) in_epoch: usize,
    #[serde(with = "bits")]
    pub(crate) loss_sum: f64,
    pub(crate) correct: usize,
    pub(crate) seen: usize,
    /// The run's first positive loss (bits; 0 for none yet).
    pub(crate) first_loss: u64,
    pub(crate) skipped_in_a_row: usize,
    pub(crate) finished: Vec<EpochRecord>,
    /// The epoch's samples/s so far (bits; 0: not measured): what a
    /// resumed run reports for an epoch it has no step of its own to time.
    #[serde(default)]
    pub(crate) rate: u64,
    /// Written when a signal or --stop-after stopped the run: its last
    /// epoch may not be evaluated and recorded yet, even at the run's end.
    #[serde(default)]
    pub(crate) interrupted: bool,
}

impl LoopState {
    pub(crate) fn start() -> Self {
        LoopState {
            step: 0,
            epoch: 1,
            in_epoch: 0,
            loss_sum: 0.0,
            correct: 0,
            seen: 0,
            first_loss: 0,
            skipped_in_a_row: 0,
            finished: Vec::new(),
            rate: 0,
            interrupted: false,
        }
    }

    /// Refuse a position that no run can have reached (a manifest edited,
    /// or written for other data): every field against what it can be.
    pub(crate) fn check(
        &self,
        steps_per_epoch: usize,
        step: usize,
    ) -> std::result::Result<(), String> {
        let spe = steps_per_epoch;
        let finite = |bits: u64| f64::from_bits(bits).is_finite();
        let fraction = |x: f64| (0.0..=1.0).contains(&x);
        let whole = self.in_epoch == spe;
        let finished_ok =
            self.finished.len() + 1 == self.epoch || (whole && self.finished.len() == self.epoch);
        let checks: [(bool, String); 9] = [
            (
                self.step == step,
                format!("step {} in a checkpoint of step {step}", self.step),
            ),
            (self.epoch >= 1, format!("epoch {}", self.epoch)),
            (
                self.in_epoch <= spe,
                format!("{} steps into an epoch of {spe}", self.in_epoch),
            ),
            (
                self.epoch
                    .checked_sub(1)
                    .and_then(|e| e.checked_mul(spe))
                    .and_then(|n| n.checked_add(self.in_epoch))
                    == Some(self.step),
                format!(
                    "step {} at step {} of epoch {} ({spe} steps per epoch)",
                    self.step, self.in_epoch, self.epoch
                ),
            ),
            (
                self.correct <= self.seen && (self.seen == 0) == (self.in_epoch == 0),
                format!("{} correct of {} samples seen", self.correct, self.seen),
            ),
            (
                self.loss_sum.is_finite(),
                format!("a loss sum of {}", self.loss_sum),
            ),
            (
                finite(self.first_loss) && finite(self.rate),
                "a first loss or rate that is not a number".into(),
            ),
            (
                self.skipped_in_a_row < MAX_SKIPPED_IN_A_ROW,
                format!("{} skipped steps in a row", self.skipped_in_a_row),
            ),
            (
                finished_ok
                    && self.finished.iter().enumerate().all(|(i, e)| {
                        e.epoch == i + 1
                            && e.steps == spe
                            && fraction(e.train_accuracy)
                            && (e.test_accuracy.is_nan() || fraction(e.test_accuracy))
                            && e.train_loss.is_finite()
                    }),
                format!(
                    "{} finished epochs in epoch {}",
                    self.finished.len(),
                    self.epoch
                ),
            ),
        ];
        match checks.into_iter().find(|(ok, _)| !ok) {
            Some((_, what)) => Err(what),
            None => Ok(()),
        }
    }

    /// Epoch `epoch` begins: its counters start from nothing.
    pub(crate) fn begin_epoch(&mut self, epoch: usize) {
        self.epoch = epoch;
        self.in_epoch = 0;
        self.loss_sum = 0.0;
        self.correct = 0;
        self.seen = 0;
        self.rate = 0;
    }

    /// Count a finished step.
    pub(crate) fn record(&mut self, out: &StepOutput) {
        if self.first_loss == 0 && out.loss > 0.0 && out.loss.is_finite() {
            self.first_loss = out.loss.to_bits();
        }
        self.skipped_in_a_row = if out.skipped {
            self.skipped_in_a_row + 1
        } else {
            0
        };
        self.step += 1;
        self.in_epoch += 1;
        // A step the loss scaler skipped may have no finite loss: it
        // counts as a step, not in the sum.
        if out.loss.is_finite() {
            self.loss_sum += out.loss;
        }
        self.correct += out.correct;
        self.seen += out.samples;
    }

    /// The epoch's mean loss so far.
    pub(crate) fn epoch_loss(&self) -> f64 {
        self.loss_sum / self.in_epoch as f64
    }

    /// The epoch's training accuracy so far.
    pub(crate) fn epoch_accuracy(&self) -> f64 {
        self.correct as f64 / self.seen as f64
    }

    pub(crate) fn first_loss(&self) -> Option<f64> {
        (self.first_loss != 0).then(|| f64::from_bits(self.first_loss))
    }
}
