//! The divergence guard ([`DivergenceGuard`]): a non-finite loss on any
//! rank stops the run at the agreement after it — before any checkpoint of
//! it is written, so nothing non-finite is kept and `--keep` prunes no good
//! checkpoint for a bad one — naming the step and the likely causes as the
//! run set them; so do [`MAX_SKIPPED_IN_A_ROW`] steps the loss scaler
//! skipped; an epoch whose loss has grown [`EXPLODED`]-fold is reported.

use super::extension::{Cx, EpochEvent, Extension, StepEvent, Vote};
use super::state::MAX_SKIPPED_IN_A_ROW;
use crate::train::Options;
use crate::{Error, Result};

/// An epoch's mean loss this many times the run's first is reported as
/// diverging (finite, so training goes on).
pub const EXPLODED: f64 = 1e3;

/// The first step whose loss was not finite on this rank.
#[derive(Clone, Copy, Debug)]
struct Bad {
    step: usize,
    epoch: usize,
    loss: f64,
    lr: f64,
}

/// Stops a diverged run; warns of a diverging one.
#[derive(Default)]
pub struct DivergenceGuard {
    first_bad: Option<Bad>,
}

impl DivergenceGuard {
    /// A guard that has seen no step.
    pub fn new() -> Self {
        Self::default()
    }

    /// The error for a run whose first non-finite loss (on any rank) was at
    /// step `bad_step`, with the likely causes as `opts` set them (`scaled`:
    /// the run has a loss scale).
    fn diverged(&self, bad_step: usize, opts: &Options, scaled: bool) -> Error {
        let what = match self.first_bad {
            Some(b) if b.step == bad_step => format!(
                "epoch {}): the loss is {} (learning rate {:.3e})",
                b.epoch, b.loss, b.lr
            ),
            _ => "on another rank): the loss is not finite".into(),
        };
        let mut causes = vec![format!("--lr {:e}", opts.lr)];
        if opts.optimizer.weight_decay > 0.0 {
            causes.push(format!("--weight-decay {:e}", opts.optimizer.weight_decay));
        }
        if scaled {
            causes.push("--precision (f32 has no loss scale to overflow)".into());
        }
        let kept = if opts.checkpoint.is_some() {
            "; no checkpoint of it was written, the earlier ones are kept"
        } else {
            ""
        };
        Error::Usage(format!(
            "step {bad_step} ({what}, so training stopped: the run diverged{kept}; lower {}",
            causes.join(" or ")
        ))
    }
}

impl Extension for DivergenceGuard {
    fn vote(&mut self, ev: &StepEvent<'_>, vote: &mut Vote) {
        if self.first_bad.is_none() && !ev.out.skipped && !ev.out.loss.is_finite() {
            self.first_bad = Some(Bad {
                step: ev.step,
                epoch: ev.epoch,
                loss: ev.out.loss,
                lr: ev.lr,
            });
        }
        vote.bad_step = self.first_bad.map(|b| b.step);
    }

    fn after_step(&mut self, cx: &mut Cx<'_>, ev: &mut StepEvent<'_>) -> Result<()> {
        // The scaler decides on every rank alike: every rank stops here.
        let skipped = ev.state.skipped_in_a_row;
        if skipped >= MAX_SKIPPED_IN_A_ROW {
            return Err(Error::Usage(format!(
                "step {} (epoch {}): the loss scaler skipped the last {skipped} steps in a row \
                 (inf/NaN gradients at every scale it tried): training diverged or half \
                 precision overflows; lower --lr or use --precision f32",
                ev.step, ev.epoch
            )));
        }
        match ev.agreed.as_ref().and_then(|a| a.bad_step) {
            Some(bad) => Err(self.diverged(bad, cx.opts, cx.model.loss_scale().is_some())),
            None => Ok(()),
        }
    }

    fn after_epoch(&mut self, _cx: &mut Cx<'_>, ev: &mut EpochEvent<'_>) -> Result<()> {
        let loss = ev.metrics.train_loss;
        if let Some(first) = ev.state.first_loss().filter(|f| loss > EXPLODED * f) {
            ev.warnings.push(format!(
                "warning: the training loss is {:.1e} times the first step's: the run is \
                 diverging; lower --lr",
                loss / first
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Bad, DivergenceGuard};
    use crate::train::{Checkpointing, Options};

    #[test]
    fn the_message_names_the_step_and_the_causes_the_run_set() {
        let mut opts = Options {
            lr: 0.5,
            ..Options::default()
        };
        let mut g = DivergenceGuard::new();
        g.first_bad = Some(Bad {
            step: 3,
            epoch: 1,
            loss: f64::NAN,
            lr: 0.5,
        });
        let e = g.diverged(3, &opts, false).to_string();
        assert!(e.contains("step 3 (epoch 1): the loss is NaN"), "{e}");
        assert!(e.contains("lower --lr 5e-1"), "{e}");
        assert!(
            !e.contains("--weight-decay") && !e.contains("--precision"),
            "{e}"
        );
        // Another rank's step first; weight decay, a loss scale, checkpoints.
        opts.optimizer.weight_decay = 1e9;
        opts.checkpoint = Some(Checkpointing {
            dir: "ck".into(),
            every: None,
            keep: 1,
        });
        let e = g.diverged(2, &opts, true).to_string();
        assert!(e.contains("step 2 (on another rank)"), "{e}");
        assert!(e.contains("--weight-decay 1e9"), "{e}");
        assert!(e.contains("--precision"), "{e}");
        assert!(e.contains("the earlier ones are kept"), "{e}");
    }
}
