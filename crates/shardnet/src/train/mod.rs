//! Training: the loop every model shares (`shardnet train <model>`), its
//! progress line and its metrics file.
//!
//! - [`run()`] / [`launch`]: the one runner (validate, plan, build, train,
//!   report) every model goes through, given its [`ModelConfig`].
//! - `trainer`: the loop ([`train`]).
//! - `model`: the [`TrainModel`] trait a model implements to be trained by
//!   it, and its [`Parts`] (parameters, optimizer, iterator, loss scaler),
//!   from which checkpoints read its state.
//! - `options`: the settings every model shares ([`Options`]).
//! - [`checkpoint`]: sharded checkpoints (every rank its own file, one
//!   manifest), resume on any number of ranks, `shardnet consolidate`.
//! - [`log`]: `--log-dir`'s JSON lines per step and per epoch.
//! - [`stop`]: SIGINT/SIGTERM as a stop request every rank agrees on.
//! - [`plan`]: each rank's peak memory from the configuration, checked
//!   against the memory available before anything is built
//!   (`shardnet plan <model>`).

pub mod checkpoint;
pub mod log;
mod model;
mod options;
pub mod plan;
mod progress;
mod run;
mod sizing;
pub mod stop;
mod trainer;

pub use model::{ModelScalars, Parts, StepOutput, Trace, TrainModel};
pub use options::{at_least_one, positive, Checkpointing, Options, Schedule};
pub use progress::{baseline_memory_bytes, peak_memory_bytes, Progress, Running};
pub use run::{launch, launch_on, run, ModelConfig, Report, Size};
pub use sizing::{divisors, fewest_ranks, largest_sizes, rank_bytes, split_flags, Fit};
pub use trainer::{
    train, train_with, Agreed, Cx, EndEvent, EpochEvent, Extension, StepEvent, Vote,
    MAX_SKIPPED_IN_A_ROW,
};

use serde::Serialize;

/// One epoch's figures, as written to `--metrics FILE`.
#[derive(Clone, Debug, Serialize)]
pub struct EpochMetrics {
    /// 1-based epoch number.
    pub epoch: usize,
    /// Steps run in this epoch.
    pub steps: usize,
    /// Mean training loss over the epoch's steps.
    pub train_loss: f64,
    /// Training accuracy over the epoch's steps, in [0, 1].
    pub train_accuracy: f64,
    /// Test-set accuracy after the epoch, in [0, 1].
    pub test_accuracy: f64,
    /// Training examples per second (wall clock, evaluation excluded).
    pub samples_per_s: f64,
}

/// What a training run reports (`--metrics FILE` is this, as JSON).
#[derive(Clone, Debug, Serialize)]
pub struct Metrics {
    /// The model trained (`mnist-mlp`, …).
    pub model: String,
    /// Communicator backend.
    pub comm: String,
    /// Number of ranks.
    pub ranks: usize,
    /// Per-epoch figures.
    pub epochs: Vec<EpochMetrics>,
    /// Peak resident memory of each rank, bytes. Thread ranks share one
    /// process, so under the local backend every entry is the process's.
    pub peak_memory_bytes: Vec<u64>,
    /// Whether `peak_memory_bytes` is per process shared by thread ranks
    /// (`"process"`) or per rank (`"rank"`).
    pub peak_memory_scope: String,
    /// The largest heap each rank's process held live, bytes
    /// ([`crate::heap::peak_bytes`]): `peak_memory_bytes` less the process's
    /// code and stacks and the freed blocks the allocator keeps. Absent
    /// where the program does not count its heap.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_heap_bytes: Option<Vec<u64>>,
    /// What each part of the run held at that heap peak (parameters,
    /// gradients, optimizer state, activations, communication's staging,
    /// data, other: [`crate::heap::Parts`]), per rank's process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_heap_parts: Option<Vec<crate::heap::Parts>>,
    /// Each rank's process's resident memory before its model was built
    /// (the program's code, the runtime, the threads), bytes.
    pub baseline_memory_bytes: Vec<u64>,
    /// Bytes each rank received per training step (mean over the timed
    /// steps; see `Communicator::bytes_received`), where measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_received_per_step: Option<Vec<f64>>,
    /// Set when the run was stopped by a signal: `epochs` then holds the
    /// epochs finished before it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interrupted: Option<Interrupted>,
}

/// Where a run was stopped by a signal.
#[derive(Clone, Debug, Serialize)]
pub struct Interrupted {
    /// `SIGINT`, `SIGTERM`, … (`--stop-after` for a planned stop).
    pub signal: String,
    /// Steps completed (over the run) when every rank stopped.
    pub after_step: usize,
    /// The `--checkpoint-dir` the run was saved to before it stopped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<std::path::PathBuf>,
}

impl EpochMetrics {
    /// The epoch's line for the progress display.
    pub fn summary(&self, evaluated: bool) -> String {
        self.summary_in(evaluated, "samples")
    }

    /// [`EpochMetrics::summary`] with the throughput in `unit`s per second
    /// ([`TrainModel::throughput_unit`]).
    pub fn summary_in(&self, evaluated: bool, unit: &str) -> String {
        let test = if evaluated {
            format!("test accuracy {:.2}%", self.test_accuracy * 100.0)
        } else {
            "not evaluated".into()
        };
        format!(
            "epoch {}: train loss {:.4}, train accuracy {:.2}%, {test}, {:.0} {unit}/s",
            self.epoch,
            self.train_loss,
            self.train_accuracy * 100.0,
            self.samples_per_s
        )
    }
}

impl Metrics {
    /// The report of a run of `model` on `comm`, with every rank's peak
    /// memory (gathered on rank 0).
    pub fn new(
        model: &str,
        comm: &crate::Communicator,
        epochs: Vec<EpochMetrics>,
        peak_memory_bytes: Vec<u64>,
        bytes_received_per_step: Option<Vec<f64>>,
    ) -> Self {
        let scope = if comm.backend() == "local" {
            "process"
        } else {
            "rank"
        };
        Metrics {
            model: model.into(),
            comm: comm.backend().into(),
            ranks: comm.size(),
            epochs,
            peak_memory_bytes,
            peak_memory_scope: scope.into(),
            peak_heap_bytes: None,
            peak_heap_parts: None,
            baseline_memory_bytes: Vec::new(),
            bytes_received_per_step,
            interrupted: None,
        }
    }
}
