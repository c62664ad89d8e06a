//! A one-line progress display: epoch, step, loss, accuracy, samples/s,
//! time left.

use std::io::{IsTerminal, Write};
use std::time::Instant;

/// Redraws one line on stderr (at most 10 times a second) when stderr is a
/// terminal; otherwise prints only each epoch's summary.
pub struct Progress {
    tty: bool,
    last: Instant,
    begun: Instant,
}

/// The running figures of an epoch, for [`Progress::step`].
#[derive(Clone, Debug)]
pub struct Running {
    /// 1-based epoch, of `epochs`.
    pub epoch: usize,
    /// Epochs in the run.
    pub epochs: usize,
    /// 1-based step within the epoch, of `steps`.
    pub step: usize,
    /// Steps in the epoch.
    pub steps: usize,
    /// Mean loss over the epoch so far.
    pub loss: f64,
    /// Training accuracy over the epoch so far, in [0, 1].
    pub accuracy: f64,
    /// Examples the epoch's timed steps took (warm-up excluded)…
    pub samples: usize,
    /// …and their seconds.
    pub secs: f64,
    /// Steps done in the run, of `total`.
    pub done: usize,
    /// Steps the run will take.
    pub total: usize,
    /// What `samples` counts (`samples`, `tokens`: [`TrainModel::throughput_unit`](super::TrainModel::throughput_unit)).
    pub unit: &'static str,
}

impl Default for Progress {
    fn default() -> Self {
        Self::new()
    }
}

impl Progress {
    /// A display starting now.
    pub fn new() -> Self {
        Progress {
            tty: std::io::stderr().is_terminal(),
            last: Instant::now(),
            begun: Instant::now(),
        }
    }

    /// Show the running figures of an epoch.
    pub fn step(&mut self, r: &Running) {
        if !self.tty || self.last.elapsed().as_secs_f64() < 0.1 {
            return;
        }
        self.last = Instant::now();
        let width = 24;
        let done = (width * r.step / r.steps.max(1)).min(width);
        // Remaining steps at the run's pace so far (evaluations included).
        let left = r.total.saturating_sub(r.done);
        let eta = self.begun.elapsed().as_secs_f64() / r.done.max(1) as f64 * left as f64;
        eprint!(
            "\repoch {}/{} [{}{}] {}/{}  loss {:.4}  acc {:.2}%  {:.0} {}/s  ETA {}   ",
            r.epoch,
            r.epochs,
            "#".repeat(done),
            "-".repeat(width - done),
            r.step,
            r.steps,
            r.loss,
            r.accuracy * 100.0,
            r.samples as f64 / r.secs.max(1e-9),
            r.unit,
            clock(eta)
        );
        let _ = std::io::stderr().flush();
    }

    /// Print an epoch's summary on its own line.
    pub fn epoch(&mut self, line: &str) {
        if self.tty {
            eprint!("\r{:120}\r", "");
        }
        eprintln!("{line}");
    }
}

/// (epochs the run will take, steps epoch `epoch` will take), 1-based
/// epochs, for a run of `total` steps in epochs of `per_epoch`: what the
/// bar counts to, so that `--max-steps 200` in epochs of 1875 shows
/// "200/200", not "199/1875 … ETA 0s".
pub fn run_shape(total: usize, per_epoch: usize, epoch: usize) -> (usize, usize) {
    let per_epoch = per_epoch.max(1);
    let start = epoch.saturating_sub(1).saturating_mul(per_epoch);
    (
        total.div_ceil(per_epoch).max(epoch),
        total.saturating_sub(start).min(per_epoch),
    )
}

/// `s` seconds as `1h02m`, `3m05s` or `42s`.
fn clock(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, min, sec) => format!("{min}m{sec:02}s"),
        (h, min, _) => format!("{h}h{min:02}m"),
    }
}

/// This process's peak resident memory (VmHWM), bytes; 0 where unknown.
pub fn peak_memory_bytes() -> u64 {
    status_bytes("VmHWM:")
}

/// This process's resident memory when a run first asked (before its
/// model was built: the program's code, the runtime, the threads), bytes;
/// 0 where unknown.
pub fn baseline_memory_bytes() -> u64 {
    static BASELINE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *BASELINE.get_or_init(|| status_bytes("VmRSS:"))
}

/// A `kB` line of /proc/self/status, in bytes; 0 where unknown.
fn status_bytes(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::run_shape;

    #[test]
    fn the_bar_counts_the_steps_the_run_will_take() {
        // --max-steps 200, epochs of 1875: one epoch of 200 steps.
        assert_eq!(run_shape(200, 1875, 1), (1, 200));
        // 5000 steps of 3 epochs' worth: the third takes 1250.
        assert_eq!(run_shape(5000, 1875, 1), (3, 1875));
        assert_eq!(run_shape(5000, 1875, 3), (3, 1250));
        // Whole epochs.
        assert_eq!(run_shape(3750, 1875, 2), (2, 1875));
    }
}
