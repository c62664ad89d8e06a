//! A one-line progress display: epoch, step, loss, accuracy, samples/s.

use std::io::{IsTerminal, Write};
use std::time::Instant;

/// Redraws one line on stderr (at most 10 times a second) when stderr is a
/// terminal; otherwise prints only each epoch's summary.
pub struct Progress {
    tty: bool,
    last: Instant,
    start: Instant,
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
            start: Instant::now(),
        }
    }

    /// Restart the throughput clock (at the start of an epoch).
    pub fn restart(&mut self) {
        self.start = Instant::now();
    }

    /// Seconds since the last restart.
    pub fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Show the running figures of an epoch.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        epoch: usize,
        epochs: usize,
        step: usize,
        steps: usize,
        loss: f64,
        acc: f64,
        samples: usize,
    ) {
        if !self.tty || self.last.elapsed().as_secs_f64() < 0.1 {
            return;
        }
        self.last = Instant::now();
        let width = 24;
        let done = (width * step / steps.max(1)).min(width);
        eprint!(
            "\repoch {epoch}/{epochs} [{}{}] {step}/{steps}  loss {loss:.4}  acc {:.2}%  {:.0} samples/s   ",
            "#".repeat(done),
            "-".repeat(width - done),
            acc * 100.0,
            samples as f64 / self.elapsed().max(1e-9)
        );
        let _ = std::io::stderr().flush();
    }

    /// Print an epoch's summary on its own line.
    pub fn epoch(&mut self, line: &str) {
        if self.tty {
            eprint!("\r{:100}\r", "");
        }
        eprintln!("{line}");
    }
}

/// This process's peak resident memory (VmHWM), bytes; 0 where unknown.
pub fn peak_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}
