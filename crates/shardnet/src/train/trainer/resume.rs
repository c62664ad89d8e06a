//! `--resume`: the model's state and the loop's position from a
//! checkpoint, each checked before the run goes on.

use super::state::LoopState;
use crate::comm::Communicator;
use crate::train::checkpoint;
use crate::train::{ModelScalars, Options, TrainModel};
use crate::{Error, Result};
use std::path::Path;
use std::time::Instant;

/// Restore `model` and the loop from the checkpoint at `path` for a run of
/// `total` steps in epochs of `steps_per_epoch`: the loop's state, and the
/// line that says where the run resumed. Collective.
pub fn restore(
    comm: &Communicator,
    model: &mut dyn TrainModel,
    opts: &Options,
    path: &Path,
    (steps_per_epoch, total): (usize, usize),
) -> Result<(LoopState, String)> {
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
    let scalars: std::result::Result<ModelScalars, _> = serde_json::from_value(r.scalars.clone());
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
    let mut st = checkpoint::agree_ok(comm, restored)?;
    // A checkpoint written after its epoch's end (the run's last): the
    // next epoch is the one in progress.
    if st.finished.len() == st.epoch {
        st.begin_epoch(st.epoch + 1);
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
    let line = format!(
        "resumed from {} at step {} ({} rank{} wrote it; {:.2} GB read in {secs:.2} s, \
         {:.2} GB/s)",
        r.dir.display(),
        st.step,
        r.ranks,
        if r.ranks == 1 { "" } else { "s" },
        r.bytes as f64 / 1e9,
        r.bytes as f64 / 1e9 / secs.max(1e-9)
    );
    Ok((st, line))
}
