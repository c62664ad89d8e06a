//! The training loop every model shares: epochs of steps, an optional step
//! limit, warm-up steps, the learning-rate schedule, `SHARDNET_TRACE`
//! timing, and the [`Metrics`] rank 0 reports — and nothing else: every
//! other concern is an [`Extension`] called after each step, after each
//! epoch and at the end, in this order:
//!
//! | extension | what it does |
//! |---|---|
//! | [`Evaluation`](evaluation) | the test-set accuracy after each epoch (`evaluate`) |
//! | [`StopAgreement`](agreement) | the ranks agree whether to go on: a signal, a non-finite loss, peak memory |
//! | [`DivergenceGuard`](divergence) | a non-finite loss or a scaler that skips every step stops the run; a growing loss is reported |
//! | [`RunLog`](crate::train::log) | `--log-dir`'s lines |
//! | [`Checkpoints`](checkpoints) | `--checkpoint-dir`: the directory held for the run, checkpoints written and pruned |
//! | [`ProgressReport`](report) | the progress line and each epoch's summary (rank 0) |
//!
//! then a caller's own ([`train_with`]). A model plugs in through
//! [`TrainModel`]: it owns its data, its parameters and its optimizer, and
//! does one step (forward, backward, update) when asked. The loop runs the
//! same calls in the same order on every rank, so the collectives inside a
//! step and inside the extensions line up.
//!
//! The loop alone sets the learning rate (constant or cosine), once per
//! step, in `Parts::opt` just before the step; the warm-up steps are left out
//! of samples/s, and `--max-steps` counts over the whole run. Before the
//! ranks agree after a step, each extension votes with what it knows locally
//! (a checkpoint due, a non-finite loss).
//!
//! Per step the loop reads [`Communicator::bytes_received`] before and after,
//! and reports the mean over the steps after the warm-up: the step's
//! communication (data loading and the optimizer included).

mod agreement;
mod checkpoints;
mod divergence;
mod evaluation;
mod extension;
mod report;
mod resume;
mod run_log;
mod state;

pub use extension::{Agreed, Cx, EndEvent, EpochEvent, Extension, StepEvent, Vote};
pub use state::MAX_SKIPPED_IN_A_ROW;

use super::log::RunLog;
use super::model::{Trace, TrainModel};
use super::options::Options;
use super::{peak_memory_bytes, EpochMetrics, Metrics};
use crate::comm::Communicator;
use crate::{Error, Result};
use agreement::StopAgreement;
use checkpoints::Checkpoints;
use divergence::DivergenceGuard;
use evaluation::Evaluation;
use report::ProgressReport;
use state::{EpochRecord, LoopState};
use std::time::Instant;

/// Train `model` on every rank of `comm` with the standard extensions;
/// rank 0 gets the metrics (every rank's peak memory and bytes per step,
/// gathered), the others `None`.
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
    train_with(comm, model, opts, Vec::new())
}

/// [`train`], with `extra` extensions called after the standard ones (in
/// the order given), on every rank.
pub fn train_with(
    comm: &Communicator,
    model: &mut dyn TrainModel,
    opts: &Options,
    extra: Vec<Box<dyn Extension>>,
) -> Result<Option<Metrics>> {
    opts.validate()?;
    let rank = comm.rank();
    let steps_per_epoch = model.steps_per_epoch();
    let total = opts.total_steps(steps_per_epoch);
    let mut report = ProgressReport::new(rank == 0 && opts.progress);
    let run = checkpoints::run_id(comm, opts)?;
    // Held until the run ends: no other run writes this directory.
    let mut checkpoints = match &opts.checkpoint {
        Some(ck) => Some(Checkpoints::take(comm, opts, ck, &run, total)?),
        None => None,
    };
    let mut st = LoopState::start();
    if let Some(path) = &opts.resume {
        let (resumed, line) = resume::restore(comm, model, opts, path, (steps_per_epoch, total))?;
        st = resumed;
        if let Some(c) = &mut checkpoints {
            c.resumed(comm, &st)?;
        }
        report.note(&line);
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
    let log = RunLog::open(
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
    let mut exts: Vec<Box<dyn Extension>> = Vec::new();
    if opts.evaluate {
        exts.push(Box::new(Evaluation));
    }
    exts.push(Box::new(StopAgreement::new(st.step, opts.stop_after)));
    exts.push(Box::new(DivergenceGuard::new()));
    exts.push(Box::new(log));
    if let Some(c) = checkpoints {
        exts.push(Box::new(c));
    }
    exts.push(Box::new(report));
    exts.extend(extra);
    let stopped = steps(
        comm,
        model,
        opts,
        (steps_per_epoch, total),
        &mut st,
        &mut exts,
    )?;
    let mut cx = Cx { comm, model, opts };
    let end = EndEvent {
        step: st.step,
        interrupted: stopped.interrupted.is_some(),
        state: &st,
    };
    for x in &mut exts {
        x.finish(&mut cx, &end)?;
    }
    let peaks = comm.gather_obj(&peak_memory_bytes(), 0)?;
    let heaps = comm.gather_obj(&crate::heap::peak_bytes(), 0)?;
    let parts = comm.gather_obj(&crate::heap::peak_parts(), 0)?;
    let baselines = comm.gather_obj(&super::baseline_memory_bytes(), 0)?;
    let bytes_all = comm.gather_obj(&stopped.bytes_per_step, 0)?;
    let (Some(peaks), Some(heaps), Some(parts), Some(baselines), Some(bytes_all)) =
        (peaks, heaps, parts, baselines, bytes_all)
    else {
        return Ok(None);
    };
    let mut metrics = Metrics::new(model.name(), comm, stopped.epochs, peaks, Some(bytes_all));
    metrics.interrupted = stopped.interrupted;
    metrics.peak_heap_bytes = heaps.into_iter().collect();
    metrics.peak_heap_parts = parts.into_iter().collect();
    metrics.baseline_memory_bytes = baselines;
    Ok(Some(metrics))
}

/// What the steps leave for the metrics.
struct Ran {
    epochs: Vec<EpochMetrics>,
    bytes_per_step: f64,
    interrupted: Option<super::Interrupted>,
}

/// The loop itself: each step, then every extension; each epoch's end,
/// then every extension. From `st` to the run's end (`total` steps in
/// epochs of `steps_per_epoch`), a step limit or a stop.
fn steps(
    comm: &Communicator,
    model: &mut dyn TrainModel,
    opts: &Options,
    (steps_per_epoch, total): (usize, usize),
    st: &mut LoopState,
    exts: &mut [Box<dyn Extension>],
) -> Result<Ran> {
    let mut trace = Trace::new(comm.rank());
    let mut epochs: Vec<EpochMetrics> = st.finished.iter().map(EpochMetrics::from).collect();
    // From here a signal stops the run after a step, with its checkpoint.
    super::stop::training_started();
    let (mut bytes, mut counted) = (0u64, 0usize);
    let warmup_until = st.step + opts.warmup_steps;
    let mut interrupted = None;
    st.interrupted = false;
    let limit = |step: usize| opts.max_steps.is_some_and(|m| step >= m);
    'run: for epoch in st.epoch..=opts.epochs {
        if epoch != st.epoch {
            st.begin_epoch(epoch);
        }
        // The epoch's throughput clock, restarted after each warm-up step.
        let mut clock = Instant::now();
        let mut timed = 0usize;
        while st.in_epoch < steps_per_epoch && !limit(st.step) {
            let lr = opts.schedule.at(opts.lr, st.step, total);
            let before = comm.bytes_received();
            let began = Instant::now();
            trace.start();
            // The one way the rate reaches the optimizer: here, once a step.
            model.parts_mut().opt.set_lr(lr);
            let out = {
                let _step = crate::heap::counting_as(crate::heap::Part::Activations);
                model.step(st.step, &mut trace)?
            };
            let received = comm.bytes_received() - before;
            let took = began.elapsed().as_secs_f64();
            trace.print();
            st.record(&out);
            let warm = st.step > warmup_until;
            if warm {
                bytes += received;
                counted += 1;
                timed += out.samples;
            } else {
                // Warm-up steps train but do not count towards samples/s.
                clock = Instant::now();
            }
            let mut ev = StepEvent {
                step: st.step,
                epoch,
                in_epoch: st.in_epoch,
                steps_per_epoch,
                total,
                lr,
                out,
                received,
                took,
                warm,
                timed: (timed, clock.elapsed().as_secs_f64()),
                epoch_done: st.in_epoch == steps_per_epoch || limit(st.step),
                vote: Vote::default(),
                agreed: None,
                stop: None,
                state: st,
            };
            let mut vote = Vote::default();
            for x in exts.iter_mut() {
                x.vote(&ev, &mut vote);
            }
            ev.vote = vote;
            let mut cx = Cx { comm, model, opts };
            for x in exts.iter_mut() {
                x.after_step(&mut cx, &mut ev)?;
            }
            if let Some(why) = ev.stop {
                interrupted = Some(super::Interrupted {
                    signal: why,
                    after_step: st.step,
                    checkpoint: opts.checkpoint.as_ref().map(|c| c.dir.clone()),
                });
                if !ev.epoch_done {
                    break 'run;
                }
                break;
            }
        }
        if st.in_epoch == 0 {
            break;
        }
        let secs = clock.elapsed().as_secs_f64();
        let mut ev = EpochEvent {
            metrics: EpochMetrics {
                epoch,
                steps: st.in_epoch,
                train_loss: st.epoch_loss(),
                train_accuracy: st.epoch_accuracy(),
                test_accuracy: f64::NAN,
                // An epoch this process timed no step of (a resume at its
                // end, or within its warm-up) keeps the rate measured
                // before.
                samples_per_s: if timed > 0 {
                    timed as f64 / secs
                } else {
                    f64::from_bits(st.rate)
                },
            },
            evaluated: false,
            interrupted: interrupted.is_some(),
            warnings: Vec::new(),
            state: st,
        };
        let mut cx = Cx { comm, model, opts };
        for x in exts.iter_mut() {
            x.after_epoch(&mut cx, &mut ev)?;
        }
        let e = ev.metrics;
        // A whole epoch is recorded (a partial one, at a step limit, is
        // reported but stays in progress for a resume).
        if st.in_epoch == steps_per_epoch && interrupted.is_none() {
            st.finished.push(EpochRecord::from(&e));
            st.rate = 0;
        }
        epochs.push(e);
        if interrupted.is_some() || limit(st.step) {
            break;
        }
    }
    Ok(Ran {
        epochs,
        bytes_per_step: if counted > 0 {
            bytes as f64 / counted as f64
        } else {
            0.0
        },
        interrupted,
    })
}
