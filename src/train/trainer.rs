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

use super::checkpoint::{self, Snapshot};
use super::log::{RunLog, StepLine};
use super::model::{ModelScalars, Trace, TrainModel};
use super::options::{Checkpointing, Options};
use super::{peak_memory_bytes, EpochMetrics, Metrics, Progress};
use crate::comm::Communicator;
use crate::output::{DirLock, Holder};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;

/// Steps skipped in a row by the loss scaler after which the run counts as
/// diverged (the scale has been halved this many times without one good
/// step).
pub const MAX_SKIPPED_IN_A_ROW: usize = 25;

/// Steps between the ranks' agreements on whether to go on (a stop request,
/// a non-finite loss) when steps are short; also at the end of every
/// epoch. Agreeing costs one small collective and a synchronisation of the
/// ranks (measured: 4% of a 1 ms step when done every step).
const AGREE_EVERY: usize = 16;

/// Steps at least this long (the slowest rank's, in seconds) agree after
/// every step, so that a signal stops the run after the step in progress.
const SLOW_STEP: f64 = 0.05;

/// An epoch's mean loss this many times the run's first is reported as
/// diverging (finite, so training goes on).
const EXPLODED: f64 = 1e3;

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
struct EpochRecord {
    epoch: usize,
    steps: usize,
    #[serde(with = "bits")]
    train_loss: f64,
    #[serde(with = "bits")]
    train_accuracy: f64,
    #[serde(with = "bits")]
    test_accuracy: f64,
    #[serde(with = "bits")]
    samples_per_s: f64,
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
struct LoopState {
    /// Steps completed over the run.
    step: usize,
    /// The epoch in progress (1-based).
    epoch: usize,
    /// Its steps completed.
    in_epoch: usize,
    #[serde(with = "bits")]
    loss_sum: f64,
    correct: usize,
    seen: usize,
    /// The run's first positive loss (bits; 0 for none yet).
    first_loss: u64,
    skipped_in_a_row: usize,
    finished: Vec<EpochRecord>,
    /// The epoch's samples/s so far (bits; 0: not measured): what a
    /// resumed run reports for an epoch it has no step of its own to time.
    #[serde(default)]
    rate: u64,
    /// Written when a signal or --stop-after stopped the run: its last
    /// epoch may not be evaluated and recorded yet, even at the run's end.
    #[serde(default)]
    interrupted: bool,
}

impl LoopState {
    fn start() -> Self {
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
    fn check(&self, steps_per_epoch: usize, step: usize) -> std::result::Result<(), String> {
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

    fn first_loss(&self) -> Option<f64> {
        (self.first_loss != 0).then(|| f64::from_bits(self.first_loss))
    }
}

/// Write a checkpoint of run `run`'s `model` with the loop at `st`.
/// Collective.
fn save(
    comm: &Communicator,
    model: &dyn TrainModel,
    (opts, run): (&Options, &str),
    ck: &Checkpointing,
    st: &LoopState,
) -> Result<PathBuf> {
    let json = |v: serde_json::Result<serde_json::Value>| {
        v.map_err(|e| Error::Io(format!("checkpoint state: {e}")))
    };
    let snap = Snapshot {
        run,
        model: model.name(),
        settings: &opts.settings,
        step: st.step,
        progress: json(serde_json::to_value(st))?,
        scalars: json(serde_json::to_value(model.scalars()))?,
    };
    let began = Instant::now();
    let saved = checkpoint::save(comm, &ck.dir, ck.keep, &model.state(), &snap)?;
    let secs = began.elapsed().as_secs_f64();
    if comm.rank() == 0 && opts.progress && saved.bytes > 0 {
        eprintln!(
            "checkpoint of step {} written to {}: {:.2} GB in {secs:.2} s ({:.2} GB/s)",
            st.step,
            saved.dir.display(),
            saved.bytes as f64 / 1e9,
            saved.bytes as f64 / 1e9 / secs.max(1e-9)
        );
    }
    Ok(saved.dir)
}

/// The run's id: the checkpoint's for a resume, a new one otherwise (rank
/// 0's, for every rank). Collective.
fn run_id(comm: &Communicator, opts: &Options) -> Result<String> {
    let mine = (comm.rank() == 0).then(|| {
        let theirs = match &opts.resume {
            // A checkpoint of the first format has no id: one from its
            // model and settings, the same at every resume of it.
            Some(p) => checkpoint::find(p)
                .and_then(|d| checkpoint::read_manifest(&d))
                .map(|m| match m.run.is_empty() {
                    true => legacy_run_id(&m),
                    false => m.run,
                }),
            None => Ok(String::new()),
        };
        theirs
            .map(|r| {
                if r.is_empty() {
                    crate::output::new_run_id()
                } else {
                    r
                }
            })
            .map_err(|e| e.to_string())
    });
    let id: std::result::Result<String, String> = comm.bcast_obj(mine.as_ref(), 0)?;
    id.map_err(Error::Usage)
}

/// The id of a run whose checkpoint (of the first format) has none: from
/// its model and settings, so that each resume of it gets the same.
fn legacy_run_id(m: &checkpoint::Manifest) -> String {
    crate::output::run_id_of(&format!("{}{:?}", m.model, m.settings))
}

/// Take `--checkpoint-dir` for run `run` (rank 0; the others get `None`):
/// created, locked, checked for another run's checkpoints, and cleared of
/// the temporaries a killed run left. Collective.
fn take_checkpoint_dir(
    comm: &Communicator,
    opts: &Options,
    ck: &Checkpointing,
    run: &str,
) -> Result<Option<DirLock>> {
    let mine = match comm.rank() {
        0 => (|| {
            let flag = "--checkpoint-dir";
            crate::output::make_dir(flag, &ck.dir)?;
            let taken = DirLock::take(flag, &ck.dir, &Holder::this_process(run))?;
            if let (Some(h), true) = (&taken.replaced, opts.progress) {
                eprintln!(
                    "{flag} {}: run {} (process {} on {}) ended without releasing it; this run \
                     takes it over",
                    ck.dir.display(),
                    h.run,
                    h.pid,
                    h.host
                );
            }
            checkpoint::check_dir(&ck.dir, opts.resume.as_deref())?;
            checkpoint::remove_leftovers(&ck.dir)?;
            Ok(Some(taken.lock))
        })(),
        _ => Ok(None),
    };
    checkpoint::agree_ok(comm, mine)
}

/// Train `model` on every rank of `comm`; rank 0 gets the metrics (every
/// rank's peak memory and bytes per step, gathered), the others `None`.
///
/// With [`Options::resume`], the model's state and the loop's position come
/// from the checkpoint first; with [`Options::checkpoint`], checkpoints are
/// written every K steps, after the last step, and when a signal stops the
/// run; with [`Options::log_dir`], rank 0 appends a JSON line per step and
/// per epoch.
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
    let run = run_id(comm, opts)?;
    // Held until the run ends: no other run writes this directory.
    let _lock = match &opts.checkpoint {
        Some(ck) => take_checkpoint_dir(comm, opts, ck, &run)?,
        None => None,
    };
    let mut st = LoopState::start();
    if let Some(path) = &opts.resume {
        let began = Instant::now();
        let r = checkpoint::restore(
            comm,
            path,
            model.name(),
            &opts.settings,
            &model.state(),
            &|then| model.resume_from_ranks(then),
        )?;
        let secs = began.elapsed().as_secs_f64();
        let scalars: std::result::Result<ModelScalars, _> =
            serde_json::from_value(r.scalars.clone());
        let progress_state: std::result::Result<LoopState, _> =
            serde_json::from_value(r.progress.clone());
        let bad = |what: &str, e: serde_json::Error| {
            Error::Io(format!(
                "{}: the {what} in {} cannot be read ({e})",
                r.dir.display(),
                checkpoint::MANIFEST
            ))
        };
        let restored = scalars
            .map_err(|e| bad("model's scalar state", e))
            .and_then(|s| model.restore_scalars(&s))
            .and(progress_state.map_err(|e| bad("loop's state", e)))
            .and_then(|st: LoopState| {
                st.check(steps_per_epoch, r.step).map_err(|what| {
                    Error::Io(format!(
                        "{}: the loop's state in its {} is not one a run can reach ({what}): \
                         the manifest was edited, or this run's data is not the checkpoint's",
                        r.dir.display(),
                        checkpoint::MANIFEST
                    ))
                })?;
                Ok(st)
            });
        st = checkpoint::agree_ok(comm, restored)?;
        // Resumed from an older checkpoint of its own directory: the later,
        // damaged ones (check_dir refused any intact one) are set aside.
        if let Some(ck) = &opts.checkpoint {
            let aside = match rank {
                0 => checkpoint::set_aside_after(&ck.dir, st.step),
                _ => Ok(()),
            };
            checkpoint::agree_ok(comm, aside)?;
        }
        // A checkpoint written after its epoch's end (the run's last): the
        // next epoch is the one in progress.
        if st.finished.len() == st.epoch {
            st.epoch += 1;
            st.in_epoch = 0;
            st.loss_sum = 0.0;
            st.correct = 0;
            st.seen = 0;
            st.rate = 0;
        }
        if st.step >= total && !st.interrupted {
            return Err(Error::Usage(format!(
                "--resume {}: the checkpoint is at step {}, and this run ends at step {total} \
                 (--epochs {}{}): nothing is left to train; raise --epochs or --max-steps",
                r.dir.display(),
                st.step,
                opts.epochs,
                opts.max_steps
                    .map_or(String::new(), |m| format!(", --max-steps {m}"))
            )));
        }
        if show {
            progress.epoch(&format!(
                "resumed from {} at step {} ({} rank{} wrote it; {:.2} GB read in {secs:.2} s, \
                 {:.2} GB/s)",
                r.dir.display(),
                st.step,
                r.ranks,
                if r.ranks == 1 { "" } else { "s" },
                r.bytes as f64 / 1e9,
                r.bytes as f64 / 1e9 / secs.max(1e-9)
            ));
        }
    }
    let left = total.saturating_sub(st.step);
    if opts.warmup_steps > 0 && opts.warmup_steps >= left {
        return Err(Error::Usage(format!(
            "--warmup-steps {} leaves no step of the {left} this run takes to time samples/s: \
             give fewer (at most {})",
            opts.warmup_steps,
            left.saturating_sub(1)
        )));
    }
    // Opened after the resume: lines of the steps and epochs the resumed
    // run does again are dropped first, so that none appears twice.
    let mut log = RunLog::open(
        comm,
        opts.log_dir.as_deref(),
        (
            &run,
            opts.resume.as_ref().map(|_| (st.step, st.finished.len())),
        ),
        opts.checkpoint.as_ref().map(|c| c.dir.as_path()),
        model.name(),
        &opts.settings,
    )?;
    let mut epochs: Vec<EpochMetrics> = st.finished.iter().map(EpochMetrics::from).collect();
    // From here a signal stops the run after a step, with its checkpoint.
    super::stop::training_started();
    let (mut bytes, mut counted) = (0u64, 0usize);
    let warmup_until = st.step + opts.warmup_steps;
    // The first step whose loss was not finite here: (step, epoch, loss, lr).
    let mut first_bad: Option<(usize, usize, f64, f64)> = None;
    let mut interrupted = None;
    // A checkpoint of a stopped run is written again at the end, as the
    // run finishes what was left (its last epoch's record at least).
    let mut saved_at = opts
        .resume
        .as_ref()
        .filter(|_| !st.interrupted)
        .map(|_| st.step);
    st.interrupted = false;
    let start_epoch = st.epoch;
    let first_step = st.step;
    let mut agree_every = AGREE_EVERY;
    'run: for epoch in start_epoch..=opts.epochs {
        progress.restart();
        if epoch != st.epoch {
            st.epoch = epoch;
            st.in_epoch = 0;
            st.loss_sum = 0.0;
            st.correct = 0;
            st.seen = 0;
            st.rate = 0;
        }
        let mut timed = 0usize;
        for s in st.in_epoch..steps_per_epoch {
            if opts.max_steps.is_some_and(|m| st.step >= m) {
                break;
            }
            let step = st.step;
            let lr = opts.schedule.at(opts.lr, step, total);
            let before = comm.bytes_received();
            let began = Instant::now();
            trace.start();
            // The one way the rate reaches the optimizer: here, once a step.
            model.parts_mut().opt.set_lr(lr);
            let out = model.step(step, &mut trace)?;
            let received = comm.bytes_received() - before;
            let took = began.elapsed().as_secs_f64();
            trace.print();
            if first_bad.is_none() && !out.skipped && !out.loss.is_finite() {
                first_bad = Some((step + 1, epoch, out.loss, lr));
            }
            if st.first_loss == 0 && out.loss > 0.0 && out.loss.is_finite() {
                st.first_loss = out.loss.to_bits();
            }
            st.skipped_in_a_row = if out.skipped {
                st.skipped_in_a_row + 1
            } else {
                0
            };
            if st.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW {
                return Err(Error::Usage(format!(
                    "step {} (epoch {epoch}): the loss scaler skipped the last {} \
                     steps in a row (inf/NaN gradients at every scale it tried): training diverged \
                     or half precision overflows; lower --lr or use --precision f32",
                    step + 1,
                    st.skipped_in_a_row
                )));
            }
            st.step += 1;
            st.in_epoch += 1;
            // A step the loss scaler skipped may have no finite loss: it
            // counts as a step, not in the sum.
            if out.loss.is_finite() {
                st.loss_sum += out.loss;
            }
            st.correct += out.correct;
            st.seen += out.samples;
            let warm = st.step > warmup_until;
            if warm {
                bytes += received;
                counted += 1;
                timed += out.samples;
            } else {
                // Warm-up steps train but do not count towards samples/s.
                progress.restart();
            }
            if show {
                // The bar counts the steps this epoch and this run will take
                // (--max-steps may end both early).
                let (epochs, steps) = super::progress::run_shape(total, steps_per_epoch, epoch);
                progress.step(&super::progress::Running {
                    epoch,
                    epochs,
                    step: s + 1,
                    steps,
                    loss: st.loss_sum / st.in_epoch as f64,
                    accuracy: st.correct as f64 / st.seen as f64,
                    samples: timed,
                    done: st.step,
                    total,
                });
            }
            let step = st.step;
            // After the first step, every `agree_every` steps and at the end
            // of an epoch, the ranks agree whether to go on: a stop request
            // on any rank (SIGINT/SIGTERM), a non-finite loss on any rank;
            // rank 0 learns every rank's peak memory for the log. Steps of
            // SLOW_STEP or more (the slowest rank's, as agreed: the same
            // answer everywhere) agree after every step.
            let epoch_done = s + 1 == steps_per_epoch || opts.max_steps.is_some_and(|m| step >= m);
            let mut memory = None;
            let mut signal = 0;
            // --stop-after: every rank knows it, no agreement needed.
            let stop_here = opts.stop_after == Some(step);
            // A step that writes a checkpoint agrees first: a non-finite
            // loss on any rank stops the run before it is saved (nothing
            // non-finite is kept, and --keep prunes no good checkpoint for
            // it).
            let saves = opts.checkpoint.as_ref().is_some_and(|ck| {
                ck.every.is_some_and(|k| step.is_multiple_of(k)) || step == total || stop_here
            });
            if step == first_step + 1 || step.is_multiple_of(agree_every) || epoch_done || saves {
                let mine = (
                    super::stop::stop_requested().unwrap_or(0),
                    first_bad.map_or(usize::MAX, |b| b.0),
                    peak_memory_bytes(),
                    took,
                );
                let all: Vec<(i32, usize, u64, f64)> = comm.allgather_obj(&mine)?;
                let slowest = all.iter().map(|a| a.3).fold(0.0, f64::max);
                agree_every = if slowest >= SLOW_STEP { 1 } else { AGREE_EVERY };
                signal = all.iter().map(|a| a.0).max().unwrap_or(0);
                if signal != 0 {
                    // Every rank stops as the signalled one does, and says
                    // so in its exit status (128 + the signal), not only
                    // the rank that saw it.
                    super::stop::request_stop(signal);
                }
                let bad_step = all.iter().map(|a| a.1).min().unwrap_or(usize::MAX);
                memory = Some(all.iter().map(|a| a.2).collect::<Vec<u64>>());
                if bad_step != usize::MAX {
                    let what = match first_bad {
                        Some((at, e, loss, lr)) if at == bad_step => {
                            format!("epoch {e}): the loss is {loss} (learning rate {lr:.3e})")
                        }
                        _ => "on another rank): the loss is not finite".into(),
                    };
                    // The likely causes, as this run set them.
                    let mut causes = vec![format!("--lr {:e}", opts.lr)];
                    if opts.optimizer.weight_decay > 0.0 {
                        causes.push(format!("--weight-decay {:e}", opts.optimizer.weight_decay));
                    }
                    if model.loss_scale().is_some() {
                        causes.push("--precision (f32 has no loss scale to overflow)".into());
                    }
                    let kept = if opts.checkpoint.is_some() {
                        "; no checkpoint of it was written, the earlier ones are kept"
                    } else {
                        ""
                    };
                    return Err(Error::Usage(format!(
                        "step {bad_step} ({what}, so training stopped: the run diverged{kept}; \
                         lower {}",
                        causes.join(" or ")
                    )));
                }
            }
            log.step(&StepLine {
                step,
                epoch,
                loss: out.loss,
                accuracy: (out.samples > 0).then(|| out.correct as f64 / out.samples as f64),
                samples_per_s: (warm && took > 0.0).then(|| out.samples as f64 / took),
                lr,
                loss_scale: model.loss_scale(),
                bytes_received: received,
                time_s: log.elapsed(),
                memory_bytes: memory,
            })?;
            if let Some(ck) = &opts.checkpoint {
                if saves || signal != 0 {
                    if timed > 0 {
                        st.rate = (timed as f64 / progress.elapsed()).to_bits();
                    }
                    st.interrupted = signal != 0 || stop_here;
                    save(comm, model, (opts, &run), ck, &st)?;
                    st.interrupted = false;
                    saved_at = Some(step);
                }
            }
            if signal != 0 || stop_here {
                let why = if signal != 0 {
                    super::stop::signal_name(signal)
                } else {
                    "--stop-after".to_string()
                };
                interrupted = Some(super::Interrupted {
                    signal: why.clone(),
                    after_step: step,
                    checkpoint: opts.checkpoint.as_ref().map(|c| c.dir.clone()),
                });
                if show {
                    progress.epoch(&format!(
                        "{why} after step {step}: stopping; the finished epochs are kept"
                    ));
                }
                if !epoch_done {
                    break 'run;
                }
                break;
            }
        }
        if st.in_epoch == 0 {
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
            steps: st.in_epoch,
            train_loss: st.loss_sum / st.in_epoch as f64,
            train_accuracy: st.correct as f64 / st.seen as f64,
            test_accuracy,
            // An epoch this process timed no step of (a resume at its end,
            // or within its warm-up) keeps the rate measured before.
            samples_per_s: if timed > 0 {
                timed as f64 / secs
            } else {
                f64::from_bits(st.rate)
            },
        };
        if show {
            progress.epoch(&format!(
                "{}{}",
                e.summary(opts.evaluate && interrupted.is_none()),
                model.epoch_note()
            ));
            if let Some(first) = st.first_loss().filter(|f| e.train_loss > EXPLODED * f) {
                progress.epoch(&format!(
                    "warning: the training loss is {:.1e} times the first step's: the run is \
                     diverging; lower --lr",
                    e.train_loss / first
                ));
            }
        }
        log.epoch(&e, st.step)?;
        let stopped = interrupted.is_some() || opts.max_steps.is_some_and(|m| st.step >= m);
        // A whole epoch is recorded (a partial one, at a step limit, is
        // reported but stays in progress for a resume).
        if st.in_epoch == steps_per_epoch && interrupted.is_none() {
            st.finished.push(EpochRecord::from(&e));
            st.rate = 0;
        }
        epochs.push(e);
        if stopped {
            break;
        }
    }
    // A run resumed at its end, or whose last step was not a checkpoint's.
    if let Some(ck) = &opts.checkpoint {
        if saved_at != Some(st.step) && interrupted.is_none() {
            save(comm, model, (opts, &run), ck, &st)?;
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
