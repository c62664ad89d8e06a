//! `--log-dir D`: a run's metrics as JSON lines, appended as they happen,
//! so that a crash keeps everything up to the last line (rank 0 writes).
//!
//! | file | one line per | fields |
//! |---|---|---|
//! | `steps.jsonl` | step | `step` (1-based over the run), `epoch`, `loss`, `accuracy` (the batch's; null where not computed), `samples_per_s` (null in warm-up), `lr`, `loss_scale` (null in f32), `bytes_received` (rank 0's, this step), `time_s` (since this process started the run), `memory_bytes` (each rank's peak, on the steps where the ranks agree: after every step of 50 ms or more, every 16 shorter ones, at an epoch's end) |
//! | `epochs.jsonl` | epoch | `epoch`, `step`, `steps`, `train_loss`, `train_accuracy`, `test_accuracy` (null if not evaluated), `samples_per_s` |
//! | `run.json` | run (rewritten at each start) | `run` (its id, kept across resumes), `model`, `ranks`, `comm`, `settings` |
//!
//! A directory holds the log of one run. Its rank 0 holds the directory's
//! lock ([`DirLock`]) while it runs; a new run into a directory that holds
//! another run's lines is refused, and so is a resume of another run. A
//! resumed run first drops the lines of the steps and epochs it does
//! again (those after the checkpoint it resumed from), then appends: no
//! step or epoch appears twice.

use super::EpochMetrics;
use crate::comm::Communicator;
use crate::output::{DirLock, Holder};
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
    /// The directory's lock, held while the log is open (rank 0).
    _lock: Option<DirLock>,
}

/// The lines of `path` (if any) that `keep` accepts (parsed as JSON; a
/// line a crash cut short is dropped), written back atomically.
fn keep_lines(path: &Path, keep: impl Fn(&serde_json::Value) -> bool) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .filter(|l| serde_json::from_str(l).is_ok_and(|v| keep(&v)))
        .map(|l| format!("{l}\n"))
        .collect();
    if kept.len() != text.len() {
        crate::output::write_atomic(path, kept.as_bytes())?;
    }
    Ok(())
}

/// Whether `path` holds anything.
fn has_lines(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.len() > 0)
}

fn open_append(path: &Path) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| Error::caused(format!("--log-dir: {}", path.display()), e))
}

impl RunLog {
    /// Open (create) `dir`'s logs on rank 0 for run `run`, and write
    /// `run.json`; `None`: no log. `resumed`: (the step, the finished
    /// epochs) of the checkpoint this run resumed from; `held`: a
    /// directory whose lock the run holds already (its checkpoints'). Collective: a
    /// directory rank 0 cannot write or take fails every rank.
    pub fn open(
        comm: &Communicator,
        dir: Option<&Path>,
        (run, resumed): (&str, Option<(usize, usize)>),
        held: Option<&Path>,
        model: &str,
        settings: &[(String, String)],
    ) -> Result<Self> {
        let files = match (dir, comm.rank()) {
            (Some(d), 0) => Some((|| {
                crate::output::make_dir("--log-dir", d)?;
                // The run's checkpoint directory is its own already.
                let lock = match held {
                    Some(h) if crate::output::same_path(h, d) => None,
                    _ => Some(DirLock::take("--log-dir", d, &Holder::this_process(run))?.lock),
                };
                let (steps, epochs) = (d.join("steps.jsonl"), d.join("epochs.jsonl"));
                let before: Option<serde_json::Value> = std::fs::read(d.join("run.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok());
                let theirs = before.as_ref().map(|v| {
                    let field = |k: &str| v[k].as_str().unwrap_or("").to_string();
                    (field("run"), field("model"))
                });
                let logged = has_lines(&steps) || has_lines(&epochs);
                let describe = |t: &Option<(String, String)>| match t {
                    Some((id, m)) if !id.is_empty() => format!("run {id}, {m}"),
                    Some((_, m)) => m.clone(),
                    None => "no run.json".into(),
                };
                let other = match (&theirs, resumed) {
                    // A new run's lines would be mixed with those there.
                    (_, None) => logged,
                    // A resume continues its own run's log only.
                    (Some((id, m)), Some(_)) => {
                        logged && if id.is_empty() { m != model } else { id != run }
                    }
                    (None, Some(_)) => false,
                };
                if other {
                    return Err(Error::Usage(format!(
                        "--log-dir {}: it holds the log of another run ({}); its lines and this \
                         run's would be mixed: give another --log-dir{}",
                        d.display(),
                        describe(&theirs),
                        if resumed.is_some() {
                            ""
                        } else {
                            ", or continue that run with --resume"
                        }
                    )));
                }
                if let Some((step, finished)) = resumed {
                    let at = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(u64::MAX);
                    keep_lines(&steps, |v| at(v, "step") <= step as u64)?;
                    keep_lines(&epochs, |v| at(v, "epoch") <= finished as u64)?;
                }
                let run = serde_json::json!({
                    "run": run,
                    "model": model,
                    "ranks": comm.size(),
                    "comm": comm.backend(),
                    "settings": settings,
                });
                crate::output::write_atomic(&d.join("run.json"), run.to_string().as_bytes())?;
                Ok((
                    (open_append(&steps)?, open_append(&epochs)?, d.to_path_buf()),
                    lock,
                ))
            })()),
            _ => None,
        };
        let opened = super::checkpoint::agree_ok(comm, files.transpose())?;
        let (files, lock) = opened.map_or((None, None), |(f, l)| (Some(f), l));
        Ok(RunLog {
            files,
            started: Instant::now(),
            _lock: lock,
        })
    }

    /// Seconds since the log was opened.
    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn line(file: &mut File, dir: &Path, what: &str, v: &impl Serialize) -> Result<()> {
        let mut text = serde_json::to_string(v).map_err(|e| Error::caused("--log-dir", e))?;
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
