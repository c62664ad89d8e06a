//! The checkpoint writer and pruner ([`Checkpoints`]): the run's id, its
//! `--checkpoint-dir` taken for the run (locked, checked, cleared of a
//! killed run's temporaries), a checkpoint every `--checkpoint-every`
//! steps, at the run's last step, and after the step a stop came in; the
//! newest `--keep` kept. A step that writes one is agreed first (its vote),
//! so a diverged step stops the run before its checkpoint is written.

use super::extension::{Cx, EndEvent, Extension, StepEvent, Vote};
use super::state::LoopState;
use crate::comm::Communicator;
use crate::output::{DirLock, Holder};
use crate::train::checkpoint::{self, Snapshot};
use crate::train::{Checkpointing, Options, TrainModel};
use crate::{Error, Result};
use std::path::PathBuf;
use std::time::Instant;

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
        v.map_err(|e| Error::caused("checkpoint state", e))
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
pub fn run_id(comm: &Communicator, opts: &Options) -> Result<String> {
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

/// Writes the run's checkpoints; holds its directory until the run ends.
pub struct Checkpoints {
    ck: Checkpointing,
    run: String,
    /// Rank 0's lock on the directory: no other run writes it meanwhile.
    _lock: Option<DirLock>,
    /// The step of the checkpoint the directory's newest holds of this run.
    saved_at: Option<usize>,
    total: usize,
    stop_after: Option<usize>,
}

impl Checkpoints {
    /// Take `ck`'s directory for run `run` of `total` steps. Collective.
    pub fn take(
        comm: &Communicator,
        opts: &Options,
        ck: &Checkpointing,
        run: &str,
        total: usize,
    ) -> Result<Self> {
        Ok(Checkpoints {
            _lock: take_checkpoint_dir(comm, opts, ck, run)?,
            ck: ck.clone(),
            run: run.into(),
            saved_at: None,
            total,
            stop_after: opts.stop_after,
        })
    }

    /// The run resumed at `st` from a checkpoint: later, damaged ones in
    /// this directory (`check_dir` refused any intact one) are set aside.
    /// A checkpoint of a stopped run is written again at the end, as the
    /// run finishes what was left (its last epoch's record at least).
    /// Collective.
    pub fn resumed(&mut self, comm: &Communicator, st: &LoopState) -> Result<()> {
        let aside = match comm.rank() {
            0 => checkpoint::set_aside_after(&self.ck.dir, st.step),
            _ => Ok(()),
        };
        checkpoint::agree_ok(comm, aside)?;
        self.saved_at = (!st.interrupted).then_some(st.step);
        Ok(())
    }

    /// Whether a checkpoint is due after `step` (a stop besides).
    fn due(&self, step: usize) -> bool {
        self.ck.every.is_some_and(|k| step.is_multiple_of(k))
            || step == self.total
            || self.stop_after == Some(step)
    }
}

impl Extension for Checkpoints {
    fn vote(&mut self, ev: &StepEvent<'_>, vote: &mut Vote) {
        // Agreed first: a non-finite loss on any rank stops the run before
        // this checkpoint is written.
        vote.agree |= self.due(ev.step);
    }

    fn after_step(&mut self, cx: &mut Cx<'_>, ev: &mut StepEvent<'_>) -> Result<()> {
        let signalled = ev.agreed.as_ref().is_some_and(|a| a.signal != 0);
        if self.due(ev.step) || signalled {
            let mut st = ev.state.clone();
            let (timed, secs) = ev.timed;
            if timed > 0 {
                st.rate = (timed as f64 / secs.max(1e-9)).to_bits();
            }
            st.interrupted = ev.stop.is_some();
            save(cx.comm, cx.model, (cx.opts, &self.run), &self.ck, &st)?;
            self.saved_at = Some(ev.step);
        }
        Ok(())
    }

    fn finish(&mut self, cx: &mut Cx<'_>, end: &EndEvent<'_>) -> Result<()> {
        // A run resumed at its end, or whose last step was not a
        // checkpoint's.
        if self.saved_at != Some(end.step) && !end.interrupted {
            save(cx.comm, cx.model, (cx.opts, &self.run), &self.ck, end.state)?;
            self.saved_at = Some(end.step);
        }
        Ok(())
    }
}
