//! The settings every model's run shares ([`Options`]): how long to train,
//! the learning rate and its [`Schedule`], the optimizer, evaluation,
//! checkpoints, logs; and the checks that name the flag a bad value came
//! from.

use crate::{Error, Result};
use std::path::PathBuf;

/// How the learning rate moves over a run of T steps (step t = 0, 1, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// lr_t = lr.
    Constant,
    /// lr_t = lr · ½ (1 + cos(π t / T)): from lr down to 0 at the end.
    Cosine,
    /// A GPT's (nanoGPT's): linear warm-up lr_t = lr · (t + 1) / W over the
    /// first W = `warmup` steps, then a cosine from lr down to lr / 10 at
    /// the end: lr_t = lr/10 + (lr − lr/10) · ½ (1 + cos(π (t − W) / (T − W))).
    WarmupCosine {
        /// Steps of warm-up (W).
        warmup: usize,
    },
}

impl Schedule {
    /// The rate of step `step` of `total`, from the base rate `lr`.
    pub fn at(self, lr: f64, step: usize, total: usize) -> f64 {
        match self {
            Schedule::Constant => lr,
            Schedule::Cosine => {
                let progress = step as f64 / total.max(1) as f64;
                lr * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
            Schedule::WarmupCosine { warmup } if step < warmup => {
                lr * (step + 1) as f64 / warmup as f64
            }
            Schedule::WarmupCosine { warmup } => {
                let progress = (step - warmup) as f64 / total.saturating_sub(warmup).max(1) as f64;
                let floor = lr / 10.0;
                floor + (lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

/// How long to train and what to show: the settings every model shares.
#[derive(Clone, Debug)]
pub struct Options {
    /// Epochs of [`TrainModel::steps_per_epoch`](super::TrainModel::steps_per_epoch) steps.
    pub epochs: usize,
    /// Stop after this many steps in all.
    pub max_steps: Option<usize>,
    /// The first steps of the run, excluded from samples/s and bytes per
    /// step (they still train).
    pub warmup_steps: usize,
    /// The optimizer's base learning rate.
    pub lr: f64,
    /// The optimizer (`--optimizer`, `--momentum`, `--weight-decay`).
    pub optimizer: crate::optim::OptimizerConfig,
    /// How the rate moves over the run.
    pub schedule: Schedule,
    /// Evaluate on the test set after each epoch.
    pub evaluate: bool,
    /// Show the progress line (rank 0).
    pub progress: bool,
    /// Write checkpoints (`--checkpoint-dir`, `--checkpoint-every`, `--keep`).
    pub checkpoint: Option<Checkpointing>,
    /// Continue from this checkpoint (`--resume`: a checkpoint directory, or
    /// a `--checkpoint-dir` for its newest).
    pub resume: Option<PathBuf>,
    /// Append per-step and per-epoch metrics as JSON lines here (`--log-dir`).
    pub log_dir: Option<PathBuf>,
    /// Stop after this many steps in all as a signal would (checkpoint
    /// written, schedule unchanged: the run continues with `--resume`),
    /// `--stop-after`.
    pub stop_after: Option<usize>,
    /// The run's settings as (name, value), named as the caller's users know
    /// them (the `shardnet` command: by flag): what the ranks agree on, a
    /// checkpoint records, and a resume must match by field (see
    /// [`super::checkpoint::differences`]).
    pub settings: Vec<(String, String)>,
}

/// Where and how often a run writes checkpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpointing {
    /// The directory (`--checkpoint-dir`); created if missing.
    pub dir: PathBuf,
    /// Every this many steps (`--checkpoint-every`); besides, always at
    /// the end of the run and when stopped by a signal.
    pub every: Option<usize>,
    /// Keep the newest this many (`--keep`).
    pub keep: usize,
}

impl Options {
    /// Refuse settings that cannot make a run: no epochs, a zero step limit,
    /// a learning rate that is not a finite number > 0. Every message names
    /// the flag.
    pub fn validate(&self) -> Result<()> {
        if self.epochs == 0 {
            return Err(Error::Usage("--epochs 0: train at least 1 epoch".into()));
        }
        if let Some(c) = &self.checkpoint {
            if c.every == Some(0) {
                return Err(Error::Usage(
                    "--checkpoint-every 0: give a number of steps of at least 1".into(),
                ));
            }
            at_least_one("--keep", c.keep, "checkpoints kept")?;
        }
        if self.max_steps == Some(0) {
            return Err(Error::Usage(
                "--max-steps 0: allow at least 1 step, or leave the flag out for whole epochs"
                    .into(),
            ));
        }
        // Flags whose only purpose is a checkpoint: without a directory
        // they would train, then keep nothing.
        if self.checkpoint.is_none() {
            if let Some(n) = self.stop_after {
                return Err(Error::Usage(format!(
                    "--stop-after {n} stops the run to continue it later, but without \
                     --checkpoint-dir DIR nothing is kept to continue from: add it"
                )));
            }
            if let Some(r) = &self.resume {
                return Err(Error::Usage(format!(
                    "--resume {} without --checkpoint-dir: the resumed run would keep no \
                     checkpoint; add --checkpoint-dir (the same directory continues it there)",
                    r.display()
                )));
            }
        }
        self.optimizer.validate()?;
        positive("--lr", self.lr)
    }
}

/// `value` must be a finite number > 0; the error names `flag`.
pub fn positive(flag: &str, value: f64) -> Result<()> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(Error::Usage(format!(
            "{flag} {value}: must be a finite number greater than 0"
        )))
    }
}

/// `value` must be at least 1; the error names `flag` and says what it counts.
pub fn at_least_one(flag: &str, value: usize, what: &str) -> Result<()> {
    if value >= 1 {
        Ok(())
    } else {
        Err(Error::Usage(format!("{flag} 0: {what} must be at least 1")))
    }
}

impl Default for Options {
    /// One epoch at lr 1e-3, constant, evaluated, with progress.
    fn default() -> Self {
        Options {
            epochs: 1,
            max_steps: None,
            warmup_steps: 0,
            lr: 1e-3,
            optimizer: crate::optim::OptimizerConfig::default(),
            schedule: Schedule::Constant,
            evaluate: true,
            progress: true,
            checkpoint: None,
            resume: None,
            log_dir: None,
            stop_after: None,
            settings: Vec::new(),
        }
    }
}

impl Options {
    /// Steps the run will take, given the steps of an epoch.
    pub fn total_steps(&self, steps_per_epoch: usize) -> usize {
        self.max_steps
            .unwrap_or(usize::MAX)
            .min(self.epochs.saturating_mul(steps_per_epoch))
    }
}

#[cfg(test)]
mod tests {
    use super::Schedule;

    #[test]
    fn warm_up_then_cosine_to_a_tenth() {
        let s = Schedule::WarmupCosine { warmup: 4 };
        let at = |t| s.at(1.0, t, 14);
        assert_eq!([at(0), at(1), at(3)], [0.25, 0.5, 1.0]);
        assert_eq!(at(4), 1.0);
        assert!((at(9) - 0.55).abs() < 1e-12);
        assert!((at(14) - 0.1).abs() < 1e-12);
        assert!(at(5) < 1.0 && at(5) > at(6));
    }
}
