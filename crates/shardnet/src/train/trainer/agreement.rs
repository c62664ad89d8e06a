//! The ranks' agreement whether to go on ([`StopAgreement`]): after the
//! first step, every [`AGREE_EVERY`] steps (every step once steps are
//! slow), at the end of an epoch, and after any step a rank votes for (a
//! checkpoint's), the ranks exchange what each knows — a stop request
//! (SIGINT/SIGTERM), the first non-finite loss, peak memory — in one small
//! collective, so that every rank stops after the same step.

use super::extension::{Agreed, Cx, Extension, StepEvent};
use crate::train::{peak_memory_bytes, stop};
use crate::Result;

/// Steps between the ranks' agreements when steps are short; also at the
/// end of every epoch. Agreeing costs one small collective and a
/// synchronisation of the ranks (measured: 4% of a 1 ms step when done
/// every step).
pub const AGREE_EVERY: usize = 16;

/// Steps at least this long (the slowest rank's, in seconds) agree after
/// every step, so that a signal stops the run after the step in progress.
pub const SLOW_STEP: f64 = 0.05;

/// Agrees a stop and the run's health across the ranks.
pub struct StopAgreement {
    first_step: usize,
    every: usize,
    stop_after: Option<usize>,
}

impl StopAgreement {
    /// For a run whose first step here follows step `first_step` (0 for a
    /// new run), stopped after `stop_after` steps where given.
    pub fn new(first_step: usize, stop_after: Option<usize>) -> Self {
        StopAgreement {
            first_step,
            every: AGREE_EVERY,
            stop_after,
        }
    }

    /// Whether the ranks agree after `ev`'s step.
    pub fn due(&self, ev: &StepEvent<'_>) -> bool {
        ev.step == self.first_step + 1
            || ev.step.is_multiple_of(self.every)
            || ev.epoch_done
            || ev.vote.agree
    }
}

/// Merge every rank's (signal, first bad step, peak memory, step seconds):
/// what the ranks agreed, and the slowest rank's step.
pub fn merge(all: &[(i32, usize, u64, f64)]) -> (Agreed, f64) {
    let bad = all.iter().map(|a| a.1).min().unwrap_or(usize::MAX);
    (
        Agreed {
            signal: all.iter().map(|a| a.0).max().unwrap_or(0),
            bad_step: (bad != usize::MAX).then_some(bad),
            memory: all.iter().map(|a| a.2).collect(),
        },
        all.iter().map(|a| a.3).fold(0.0, f64::max),
    )
}

impl Extension for StopAgreement {
    fn after_step(&mut self, cx: &mut Cx<'_>, ev: &mut StepEvent<'_>) -> Result<()> {
        if self.due(ev) {
            let mine = (
                stop::stop_requested().unwrap_or(0),
                ev.vote.bad_step.unwrap_or(usize::MAX),
                peak_memory_bytes(),
                ev.took,
            );
            let (agreed, slowest) = merge(&cx.comm.allgather_obj(&mine)?);
            self.every = if slowest >= SLOW_STEP { 1 } else { AGREE_EVERY };
            if agreed.signal != 0 {
                // Every rank stops as the signalled one does, and says so
                // in its exit status (128 + the signal), not only the rank
                // that saw it.
                stop::request_stop(agreed.signal);
                ev.stop = Some(stop::signal_name(agreed.signal));
            }
            ev.agreed = Some(agreed);
        }
        // --stop-after: every rank knows it, no agreement needed.
        if ev.stop.is_none() && self.stop_after == Some(ev.step) {
            ev.stop = Some("--stop-after".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::merge;

    #[test]
    fn the_largest_signal_the_first_bad_step_and_the_slowest_rank_win() {
        let (a, slowest) = merge(&[(0, usize::MAX, 10, 0.01), (15, 7, 20, 0.2), (2, 5, 30, 0.1)]);
        assert_eq!(a.signal, 15);
        assert_eq!(a.bad_step, Some(5));
        assert_eq!(a.memory, vec![10, 20, 30]);
        assert_eq!(slowest, 0.2);
        let (a, _) = merge(&[(0, usize::MAX, 1, 0.0), (0, usize::MAX, 2, 0.0)]);
        assert_eq!((a.signal, a.bad_step), (0, None));
    }
}
