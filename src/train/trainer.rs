//! The training loop every model shares: epochs of steps, an optional step
//! limit, warm-up steps, the learning-rate schedule, the progress line,
//! evaluation after each epoch, `SHARDNET_TRACE` timing, and the
//! [`Metrics`] rank 0 reports.
//!
//! A model plugs in through [`TrainModel`]: it owns its data, its parameters
//! and its optimizer, and does one step (forward, backward, update) when
//! asked. [`train`] runs the same calls in the same order on every rank, so
//! the collectives inside a step line up.
//!
//! Per step the loop reads [`Communicator::bytes_received`] before and after,
//! and reports the mean over the steps after the warm-up: the step's
//! communication (data loading and the optimizer included).

use super::{peak_memory_bytes, EpochMetrics, Metrics, Progress};
use crate::comm::Communicator;
use crate::{Error, Result};
use std::time::Instant;

/// How the learning rate moves over a run of T steps (step t = 0, 1, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// lr_t = lr.
    Constant,
    /// lr_t = lr · ½ (1 + cos(π t / T)): from lr down to 0 at the end.
    Cosine,
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
        }
    }
}

/// How long to train and what to show: the settings every model shares.
#[derive(Clone, Debug)]
pub struct Options {
    /// Epochs of [`TrainModel::steps_per_epoch`] steps.
    pub epochs: usize,
    /// Stop after this many steps in all.
    pub max_steps: Option<usize>,
    /// The first steps of the run, excluded from samples/s and bytes per
    /// step (they still train).
    pub warmup_steps: usize,
    /// The optimizer's base learning rate.
    pub lr: f64,
    /// How the rate moves over the run.
    pub schedule: Schedule,
    /// Evaluate on the test set after each epoch.
    pub evaluate: bool,
    /// Show the progress line (rank 0).
    pub progress: bool,
}

impl Options {
    /// Refuse settings that cannot make a run: no epochs, a zero step limit,
    /// a learning rate that is not a finite number > 0. Every message names
    /// the flag.
    pub fn validate(&self) -> Result<()> {
        if self.epochs == 0 {
            return Err(Error::Usage("--epochs 0: train at least 1 epoch".into()));
        }
        if self.max_steps == Some(0) {
            return Err(Error::Usage(
                "--max-steps 0: allow at least 1 step, or leave the flag out for whole epochs"
                    .into(),
            ));
        }
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
            schedule: Schedule::Constant,
            evaluate: true,
            progress: true,
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

/// Steps skipped in a row by the loss scaler after which the run counts as
/// diverged (the scale has been halved this many times without one good
/// step).
pub const MAX_SKIPPED_IN_A_ROW: usize = 25;

/// Steps between the ranks' agreements on whether to go on (a stop request,
/// a non-finite loss); also at the end of every epoch. Agreeing costs one
/// small collective and a synchronisation of the ranks (measured: 4% of a
/// 1 ms step when done every step).
const AGREE_EVERY: usize = 16;

/// An epoch's mean loss this many times the run's first is reported as
/// diverging (finite, so training goes on).
const EXPLODED: f64 = 1e3;

/// A model with its data and optimizer, ready for [`train`]. Every method
/// is called on every rank, in the same order.
pub trait TrainModel {
    /// The name in the metrics (`mnist-mlp`, `face-head`, …).
    fn name(&self) -> &str;

    /// Steps in one epoch.
    fn steps_per_epoch(&self) -> usize;

    /// Step `step` (0-based over the run): read the next batch, forward,
    /// backward, and update the parameters at learning rate `lr`. Call
    /// [`Trace::start`] once the batch is ready and [`Trace::lap`] after
    /// each phase.
    fn step(&mut self, step: usize, lr: f64, trace: &mut Trace) -> Result<StepOutput>;

    /// Test-set accuracy in [0, 1] (each rank evaluates its share; rank 0's
    /// answer is the one reported).
    fn evaluate(&mut self) -> Result<f64>;

    /// Text appended to an epoch's summary line (e.g. the loss scale).
    fn epoch_note(&self) -> String {
        String::new()
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
    fn print(&mut self) {
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

/// Train `model` on every rank of `comm`; rank 0 gets the metrics (every
/// rank's peak memory and bytes per step, gathered), the others `None`.
pub fn train(
    comm: &Communicator,
    model: &mut dyn TrainModel,
    opts: &Options,
) -> Result<Option<Metrics>> {
    opts.validate()?;
    let rank = comm.rank();
    let steps_per_epoch = model.steps_per_epoch();
    let total = opts.total_steps(steps_per_epoch);
    let show = rank == 0 && opts.progress;
    let mut trace = Trace::new(rank);
    let mut progress = Progress::new();
    let mut epochs = Vec::new();
    let mut step = 0usize;
    let (mut bytes, mut counted) = (0u64, 0usize);
    let mut skipped_in_a_row = 0usize;
    // The run's first loss, for the note on a loss that explodes.
    let mut first_loss = None;
    // The first step whose loss was not finite here: (step, epoch, loss, lr).
    let mut first_bad: Option<(usize, usize, f64, f64)> = None;
    let mut interrupted = None;
    'run: for epoch in 1..=opts.epochs {
        progress.restart();
        let (mut loss_sum, mut correct, mut seen, mut steps, mut timed) =
            (0.0, 0usize, 0usize, 0usize, 0usize);
        for s in 0..steps_per_epoch {
            if opts.max_steps.is_some_and(|m| step >= m) {
                break;
            }
            let lr = opts.schedule.at(opts.lr, step, total);
            let before = comm.bytes_received();
            trace.start();
            let out = model.step(step, lr, &mut trace)?;
            let received = comm.bytes_received() - before;
            trace.print();
            if first_bad.is_none() && !out.skipped && !out.loss.is_finite() {
                first_bad = Some((step + 1, epoch, out.loss, lr));
            }
            first_loss = first_loss.or((out.loss > 0.0).then_some(out.loss));
            skipped_in_a_row = if out.skipped { skipped_in_a_row + 1 } else { 0 };
            if skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW {
                return Err(Error::Usage(format!(
                    "step {} (epoch {epoch}): the loss scaler skipped the last {skipped_in_a_row} \
                     steps in a row (inf/NaN gradients at every scale it tried): training diverged \
                     or half precision overflows; lower --lr or use --precision f32",
                    step + 1
                )));
            }
            step += 1;
            steps += 1;
            loss_sum += out.loss;
            correct += out.correct;
            seen += out.samples;
            if step > opts.warmup_steps {
                bytes += received;
                counted += 1;
                timed += out.samples;
            } else {
                // Warm-up steps train but do not count towards samples/s.
                progress.restart();
            }
            if show {
                progress.step(&super::progress::Running {
                    epoch,
                    epochs: opts.epochs,
                    step: s + 1,
                    steps: steps_per_epoch,
                    loss: loss_sum / steps as f64,
                    accuracy: correct as f64 / seen as f64,
                    samples: timed,
                    done: step,
                    total,
                });
            }
            // Every AGREE_EVERY steps and at the end of an epoch, the ranks
            // agree whether to go on: a stop request on any rank
            // (SIGINT/SIGTERM), a non-finite loss on any rank.
            let epoch_done = s + 1 == steps_per_epoch || opts.max_steps.is_some_and(|m| step >= m);
            if step.is_multiple_of(AGREE_EVERY) || epoch_done {
                let mine = (
                    super::stop::stop_requested().unwrap_or(0),
                    first_bad.map_or(usize::MAX, |b| b.0),
                );
                let (signal, bad_step) =
                    comm.allreduce_obj(&mine, |a, b| (a.0.max(b.0), a.1.min(b.1)))?;
                if bad_step != usize::MAX {
                    let what = match first_bad {
                        Some((at, e, loss, lr)) if at == bad_step => {
                            format!("epoch {e}): the loss is {loss} (learning rate {lr:.3e})")
                        }
                        _ => "on another rank): the loss is not finite".into(),
                    };
                    return Err(Error::Usage(format!(
                        "step {bad_step} ({what}, so training stopped: the run diverged; lower --lr"
                    )));
                }
                if signal != 0 {
                    interrupted = Some(super::Interrupted {
                        signal: super::stop::signal_name(signal),
                        after_step: step,
                    });
                    if show {
                        progress.epoch(&format!(
                            "{} after step {step}: stopping; the finished epochs are kept",
                            super::stop::signal_name(signal),
                        ));
                    }
                    if !epoch_done {
                        break 'run;
                    }
                    break;
                }
            }
        }
        if steps == 0 {
            break;
        }
        let secs = progress.elapsed();
        // An epoch finished just as a stop came: kept, not evaluated.
        let test_accuracy = if opts.evaluate && interrupted.is_none() {
            model.evaluate()?
        } else {
            f64::NAN
        };
        let e = EpochMetrics {
            epoch,
            steps,
            train_loss: loss_sum / steps as f64,
            train_accuracy: correct as f64 / seen as f64,
            test_accuracy,
            samples_per_s: timed as f64 / secs,
        };
        if show {
            progress.epoch(&format!(
                "{}{}",
                e.summary(opts.evaluate && interrupted.is_none()),
                model.epoch_note()
            ));
            if let Some(first) = first_loss.filter(|f| e.train_loss > EXPLODED * f) {
                progress.epoch(&format!(
                    "warning: the training loss is {:.1e} times the first step's: the run is \
                     diverging; lower --lr",
                    e.train_loss / first
                ));
            }
        }
        epochs.push(e);
        if interrupted.is_some() || opts.max_steps.is_some_and(|m| step >= m) {
            break;
        }
    }
    let per_step = if counted > 0 {
        bytes as f64 / counted as f64
    } else {
        0.0
    };
    let peaks = comm.gather_obj(&peak_memory_bytes(), 0)?;
    let bytes_all = comm.gather_obj(&per_step, 0)?;
    let (Some(peaks), Some(bytes_all)) = (peaks, bytes_all) else {
        return Ok(None);
    };
    let mut metrics = Metrics::new(model.name(), comm, epochs, peaks, Some(bytes_all));
    metrics.interrupted = interrupted;
    Ok(Some(metrics))
}
