//! Reading a `--log-dir`: `steps.jsonl` and `epochs.jsonl` as records (a
//! cut last line skipped, a bad line before it refused naming file and
//! line, the last record of a resumed step or epoch kept).

use super::*;

/// One line of `steps.jsonl`: one training step. Figures the trainer
/// could not compute (a warm-up step's samples/s, a non-finite loss) are
/// `None`; fields this reader does not know are ignored.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct StepRecord {
    /// 1-based step over the whole run.
    pub step: u64,
    /// 1-based epoch the step belongs to.
    pub epoch: u64,
    /// The step's mean loss.
    pub loss: Option<f64>,
    /// The step's training accuracy, in [0, 1].
    pub accuracy: Option<f64>,
    /// The step's training examples per second.
    pub samples_per_s: Option<f64>,
    /// The learning rate of the step.
    pub lr: Option<f64>,
    /// The dynamic loss scale, under half precision.
    pub loss_scale: Option<f64>,
    /// Bytes rank 0 received during the step.
    pub bytes_received: Option<u64>,
    /// Seconds since the process started (a resumed run starts again at 0).
    pub time_s: Option<f64>,
    /// Peak resident memory of each rank, bytes (on some steps only).
    pub memory_bytes: Option<Vec<u64>>,
}

/// One line of `epochs.jsonl`: one finished epoch.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct EpochRecord {
    /// 1-based epoch number.
    pub epoch: u64,
    /// The epoch's last step (over the run).
    pub step: u64,
    /// Steps run in the epoch.
    pub steps: Option<u64>,
    /// Mean training loss over the epoch's steps.
    pub train_loss: Option<f64>,
    /// Training accuracy over the epoch's steps, in [0, 1].
    pub train_accuracy: Option<f64>,
    /// Test-set accuracy after the epoch, in [0, 1]; `None` if not evaluated.
    pub test_accuracy: Option<f64>,
    /// Training examples per second over the epoch.
    pub samples_per_s: Option<f64>,
    /// Peak resident memory of each rank, bytes.
    pub memory_bytes: Option<Vec<u64>>,
}

/// A `--log-dir` as read by [`read_log`]: one record per step and per
/// epoch (the last logged for each), in order.
#[derive(Clone, Debug)]
pub struct RunLog {
    /// The directory read.
    pub dir: PathBuf,
    /// The model trained, from `run.json` when it has one.
    pub model: Option<String>,
    /// Steps in increasing order, one per step number.
    pub steps: Vec<StepRecord>,
    /// Epochs in increasing order, one per epoch number.
    pub epochs: Vec<EpochRecord>,
    /// One note per incomplete last line skipped (`FILE:LINE: …`).
    pub skipped: Vec<String>,
}

/// Read the logs of `shardnet train --log-dir dir`: `steps.jsonl` (which
/// must exist), `epochs.jsonl` and `run.json` (each if present). See the
/// module doc for what is skipped, refused and deduplicated.
pub fn read_log(dir: &Path) -> Result<RunLog> {
    let steps_path = dir.join("steps.jsonl");
    if !dir.is_dir() {
        return Err(Error::Usage(format!(
            "{}: no such directory (give the --log-dir of a shardnet train run)",
            dir.display()
        )));
    }
    if !steps_path.is_file() {
        return Err(Error::Usage(format!(
            "{} is not a --log-dir of shardnet train: no steps.jsonl",
            dir.display()
        )));
    }
    let mut skipped = Vec::new();
    let steps: Vec<StepRecord> = read_lines(&steps_path, &mut skipped)?;
    let epochs_path = dir.join("epochs.jsonl");
    let epochs: Vec<EpochRecord> = if epochs_path.exists() {
        read_lines(&epochs_path, &mut skipped)?
    } else {
        Vec::new()
    };
    // Later lines replace earlier ones: a resumed run logs its steps again.
    let steps: BTreeMap<u64, StepRecord> = steps.into_iter().map(|s| (s.step, s)).collect();
    let epochs: BTreeMap<u64, EpochRecord> = epochs.into_iter().map(|e| (e.epoch, e)).collect();
    Ok(RunLog {
        dir: dir.to_path_buf(),
        model: run_model(dir),
        steps: steps.into_values().collect(),
        epochs: epochs.into_values().collect(),
        skipped,
    })
}

/// The `"model"` of `dir/run.json`; only a title depends on it, so a
/// missing or unreadable file is no model rather than an error.
pub(super) fn run_model(dir: &Path) -> Option<String> {
    let text = fs::read_to_string(dir.join("run.json")).ok()?;
    let run: serde_json::Value = serde_json::from_str(&text).ok()?;
    run.get("model")?.as_str().map(str::to_string)
}

/// Every non-blank line of the JSON-lines file `path` as a `T`. An invalid
/// last line is a write cut short by a crash: it is skipped, with a note in
/// `skipped`. An invalid line before it is an error naming the file, line
/// and column.
pub(super) fn read_lines<T: DeserializeOwned>(
    path: &Path,
    skipped: &mut Vec<String>,
) -> Result<Vec<T>> {
    let bytes = fs::read(path).map_err(|e| Error::caused(path.display().to_string(), e))?;
    // A cut can split a character; that line then fails as JSON, not here.
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .collect();
    let mut out = Vec::with_capacity(lines.len());
    for (k, &(i, line)) in lines.iter().enumerate() {
        match serde_json::from_str::<T>(line) {
            Ok(v) => out.push(v),
            Err(e) => {
                // serde_json ends its message with "at line 1 column C";
                // the line that matters is the file's.
                let full = e.to_string();
                let why = full.split(" at line ").next().unwrap_or(&full);
                let at = format!("{}:{}:{}", path.display(), i + 1, e.column());
                if k + 1 == lines.len() {
                    skipped.push(format!(
                        "{at}: skipped the incomplete last line ({why}): the run was cut short"
                    ));
                } else {
                    return Err(Error::Io(format!("{at}: not a log line: {why}")));
                }
            }
        }
    }
    Ok(out)
}
