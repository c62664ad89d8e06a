//! The progress display as an extension ([`ProgressReport`], rank 0 with
//! `progress`): the running bar after each step, a stop's line, each
//! epoch's summary and the warnings earlier extensions left for it.

use super::extension::{Cx, EpochEvent, Extension, StepEvent};
use crate::train::progress::{run_shape, Progress, Running};
use crate::Result;

/// Shows the run's progress on stderr (or nothing, where not `shown`).
pub struct ProgressReport {
    bar: Progress,
    shown: bool,
}

impl ProgressReport {
    /// A display (silent unless `shown`).
    pub fn new(shown: bool) -> Self {
        ProgressReport {
            bar: Progress::new(),
            shown,
        }
    }

    /// Print a line of its own (a resume's, …).
    pub fn note(&mut self, line: &str) {
        if self.shown {
            self.bar.epoch(line);
        }
    }
}

impl Extension for ProgressReport {
    fn after_step(&mut self, cx: &mut Cx<'_>, ev: &mut StepEvent<'_>) -> Result<()> {
        if !self.shown {
            return Ok(());
        }
        // The bar counts the steps this epoch and this run will take
        // (--max-steps may end both early).
        let (epochs, steps) = run_shape(ev.total, ev.steps_per_epoch, ev.epoch);
        self.bar.step(&Running {
            epoch: ev.epoch,
            epochs,
            step: ev.in_epoch,
            steps,
            loss: ev.epoch_loss(),
            accuracy: ev.epoch_accuracy(),
            samples: ev.timed.0,
            secs: ev.timed.1,
            done: ev.step,
            total: ev.total,
            unit: cx.model.throughput_unit(),
        });
        if let Some(why) = &ev.stop {
            self.bar.epoch(&format!(
                "{why} after step {}: stopping; the finished epochs are kept",
                ev.step
            ));
        }
        Ok(())
    }

    fn after_epoch(&mut self, cx: &mut Cx<'_>, ev: &mut EpochEvent<'_>) -> Result<()> {
        if self.shown {
            self.bar.epoch(&format!(
                "{}{}",
                ev.metrics
                    .summary_in(ev.evaluated, cx.model.throughput_unit()),
                cx.model.epoch_note()
            ));
            for w in &ev.warnings {
                self.bar.epoch(w);
            }
        }
        Ok(())
    }
}
