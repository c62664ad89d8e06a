//! `--log-dir D`: a run's metrics as JSON lines, appended as they happen,
//! so that a crash keeps everything up to the last line (rank 0 writes).
//!
//! | file | one line per | fields |
//! |---|---|---|
//! | `steps.jsonl` | step | `step` (1-based over the run), `epoch`, `loss`, `accuracy` (the batch's; null where not computed), `samples_per_s` (null in warm-up), `lr`, `loss_scale` (null in f32), `bytes_received` (rank 0's, this step), `time_s` (since this process started the run), `memory_bytes` (each rank's peak, on the steps where the ranks agree: after every step of 50 ms or more, every 16 shorter ones, at an epoch's end) |
//! | `epochs.jsonl` | epoch | `epoch`, `step`, `steps`, `train_loss`, `train_accuracy`, `test_accuracy` (null if not evaluated), `samples_per_s` |
//! | `run.json` | run (rewritten at each start) | `model`, `ranks`, `comm`, `settings` |
//!
//! A resumed run appends: a step that appears twice (run again after the
//! checkpoint it resumed from) counts by its last line, as `shardnet plot`
//! reads it.

use super::EpochMetrics;
use crate::comm::Communicator;
use crate::{Error, Result};
use serde::Serialize;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// One line of `steps.jsonl`.
#[derive(Clone, Debug, Serialize)]
pub struct StepLine {
    /// Steps completed over the run, this one included.
    pub step: usize,
    /// The epoch (1-based).
    pub epoch: usize,
    /// The step's loss.
    pub loss: f64,
    /// The batch's training accuracy.
    pub accuracy: Option<f64>,
    /// The step's examples per second (none during warm-up).
    pub samples_per_s: Option<f64>,
    /// The learning rate.
    pub lr: f64,
    /// The loss scale (half precision).
    pub loss_scale: Option<f64>,
    /// Bytes rank 0 received during the step.
    pub bytes_received: u64,
    /// Seconds since the run started in this process.
    pub time_s: f64,
    /// Every rank's peak memory, where the ranks exchanged it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<Vec<u64>>,
}

/// One line of `epochs.jsonl`.
#[derive(Serialize)]
struct EpochLine<'a> {
    #[serde(flatten)]
    epoch: &'a EpochMetrics,
    step: usize,
}

/// The log of a run: rank 0's open files (nothing elsewhere, or without
/// `--log-dir`).
pub struct RunLog {
    files: Option<(File, File, PathBuf)>,
    started: Instant,
}

fn open_append(path: &Path) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| Error::Io(format!("--log-dir: {}: {e}", path.display())))
}

impl RunLog {
    /// Open (create) `dir`'s logs on rank 0 and write `run.json`; `None`:
    /// no log. Collective: a directory rank 0 cannot write fails every rank.
    pub fn open(
        comm: &Communicator,
        dir: Option<&Path>,
        model: &str,
        settings: &[(String, String)],
    ) -> Result<Self> {
        let files = match (dir, comm.rank()) {
            (Some(d), 0) => Some((|| {
                std::fs::create_dir_all(d)
                    .map_err(|e| Error::Io(format!("--log-dir {}: {e}", d.display())))?;
                let run = serde_json::json!({
                    "model": model,
                    "ranks": comm.size(),
                    "comm": comm.backend(),
                    "settings": settings,
                });
                crate::output::write_atomic(&d.join("run.json"), run.to_string().as_bytes())?;
                Ok((
                    open_append(&d.join("steps.jsonl"))?,
                    open_append(&d.join("epochs.jsonl"))?,
                    d.to_path_buf(),
                ))
            })()),
            _ => None,
        };
        let files = super::checkpoint::agree_ok(comm, files.transpose())?;
        Ok(RunLog {
            files,
            started: Instant::now(),
        })
    }

    /// Seconds since the log was opened.
    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn line(file: &mut File, dir: &Path, what: &str, v: &impl Serialize) -> Result<()> {
        let mut text =
            serde_json::to_string(v).map_err(|e| Error::Io(format!("--log-dir: {e}")))?;
        text.push('\n');
        // One write per line: a crash leaves whole lines.
        file.write_all(text.as_bytes())
            .map_err(|e| Error::Io(format!("--log-dir: {}: {e}", dir.join(what).display())))
    }

    /// Append a step's line (rank 0).
    pub fn step(&mut self, line: &StepLine) -> Result<()> {
        match &mut self.files {
            Some((steps, _, dir)) => Self::line(steps, dir, "steps.jsonl", line),
            None => Ok(()),
        }
    }

    /// Append an epoch's line (rank 0), made durable.
    pub fn epoch(&mut self, e: &EpochMetrics, step: usize) -> Result<()> {
        match &mut self.files {
            Some((steps, epochs, dir)) => {
                Self::line(epochs, dir, "epochs.jsonl", &EpochLine { epoch: e, step })?;
                let _ = steps.sync_data();
                let _ = epochs.sync_data();
                Ok(())
            }
            None => Ok(()),
        }
    }
}
