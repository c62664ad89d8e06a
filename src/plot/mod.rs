//! Training curves from a `--log-dir` (`shardnet plot DIR [DIR …]`).
//!
//! `shardnet train --log-dir D` appends one JSON object per line to two
//! files, flushed line by line:
//!
//! - `D/steps.jsonl`, one line per step: `step` (1-based over the run),
//!   `epoch`, `loss`, `accuracy`, `samples_per_s`, `lr`, `loss_scale`,
//!   `bytes_received`, `time_s` and, on some steps, `memory_bytes` (each
//!   rank's peak resident memory).
//! - `D/epochs.jsonl`, one line per finished epoch: `epoch`, `step` (its
//!   last step), `steps`, `train_loss`, `train_accuracy`, `test_accuracy`,
//!   `samples_per_s`, `memory_bytes`.
//!
//! A crash can leave the last line cut short: [`read_log`] skips it (and
//! says so in [`RunLog::skipped`]); a bad line anywhere else is an error
//! naming the file, line and column. A run resumed from a checkpoint logs
//! its steps and epochs again: the last line for a step (or epoch) wins.
//! `D/run.json`, when present, names the model for the titles.
//!
//! [`plot`] draws four 1000 × 600 PNG charts, one series per run (labelled
//! by the directory's name), against the step:
//!
//! | file | what |
//! |---|---|
//! | `loss.png` | training loss: each step (faint), its moving average, each epoch's mean (rings); log scale when it spans decades |
//! | `accuracy.png` | train accuracy per epoch (with fewer than two epochs: the per-step moving average) and test accuracy per epoch, in % |
//! | `throughput.png` | samples/s: each step (faint) and its moving average |
//! | `memory.png` | each rank's peak resident memory, one line per rank |
//!
//! The moving average is over the last `n / 50` steps of a run of `n`
//! steps (1 to 200). Text is drawn with a TrueType font ([`register_font`]).

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use shardnet::output::write_atomic_with;
use shardnet::{Error, Result};
use std::collections::BTreeMap;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

mod charts;
mod font;
mod log;
mod render;

pub use font::{register_font, FONT_ENV};
pub use log::{read_log, EpochRecord, RunLog, StepRecord};

use charts::{accuracy_chart, loss_chart, memory_chart, throughput_chart, Chart, Mark};
use render::render;

/// Draw the charts of the runs logged in `dirs` (see the module doc) into
/// the directory `out`, created if missing; the PNGs written, in order.
/// Each file is written atomically.
pub fn plot(dirs: &[PathBuf], out: &Path) -> Result<Vec<PathBuf>> {
    let runs = dirs
        .iter()
        .map(|d| read_log(d))
        .collect::<Result<Vec<_>>>()?;
    plot_runs(&runs, out)
}

/// [`plot`] of runs already read (to show their [`RunLog::skipped`] first).
pub fn plot_runs(runs: &[RunLog], out: &Path) -> Result<Vec<PathBuf>> {
    if runs.is_empty() {
        return Err(Error::Usage(
            "give at least one --log-dir of shardnet train to plot".into(),
        ));
    }
    if let Some(empty) = runs.iter().find(|r| r.steps.is_empty()) {
        return Err(Error::Usage(format!(
            "{}: no step logged yet, nothing to plot",
            empty.dir.join("steps.jsonl").display()
        )));
    }
    register_font()?;
    if out.exists() && !out.is_dir() {
        return Err(Error::Usage(format!(
            "--out {}: not a directory",
            out.display()
        )));
    }
    fs::create_dir_all(out).map_err(|e| Error::caused(format!("--out {}", out.display()), e))?;

    let dirs: Vec<PathBuf> = runs.iter().map(|r| r.dir.clone()).collect();
    let names = run_labels(&dirs);
    let subject = subject(runs, &names);
    let charts = [
        ("loss.png", loss_chart(runs, &names, &subject)),
        ("accuracy.png", accuracy_chart(runs, &names, &subject)),
        ("throughput.png", throughput_chart(runs, &names, &subject)),
        ("memory.png", memory_chart(runs, &names, &subject)),
    ];
    let mut written = Vec::with_capacity(charts.len());
    for (file, chart) in charts {
        let path = out.join(file);
        render(&path, &chart)?;
        written.push(path);
    }
    Ok(written)
}

/// A label per run: its directory's name, with as many parent directories
/// as it takes to tell equal names apart (`a/log`, `b/log`), numbered if
/// the same directory is given twice.
fn run_labels(dirs: &[PathBuf]) -> Vec<String> {
    let parts: Vec<Vec<String>> = dirs
        .iter()
        .map(|d| {
            let full = fs::canonicalize(d).unwrap_or_else(|_| d.clone());
            full.components()
                .filter_map(|c| match c {
                    std::path::Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
                    _ => None,
                })
                .collect()
        })
        .collect();
    let label = |p: &[String], k: usize| p[p.len().saturating_sub(k)..].join("/");
    let mut depth = vec![1; dirs.len()];
    loop {
        let labels: Vec<String> = parts
            .iter()
            .zip(&depth)
            .map(|(p, &k)| label(p, k))
            .collect();
        let mut grew = false;
        for i in 0..dirs.len() {
            let clash = (0..dirs.len()).any(|j| j != i && labels[j] == labels[i]);
            if clash && depth[i] < parts[i].len() {
                depth[i] += 1;
                grew = true;
            }
        }
        if !grew {
            break;
        }
    }
    let mut labels: Vec<String> = parts
        .iter()
        .zip(&depth)
        .map(|(p, &k)| label(p, k))
        .collect();
    // The same directory twice: number the later ones.
    let plain = labels.clone();
    for i in 0..labels.len() {
        let before = plain[..i].iter().filter(|l| **l == plain[i]).count();
        if before > 0 {
            labels[i] = format!("{} #{}", plain[i], before + 1);
        }
    }
    for l in labels.iter_mut().filter(|l| l.is_empty()) {
        *l = "/".into();
    }
    labels
}

/// What the titles name: the run (and model) of a single run, else the
/// model all the runs share.
fn subject(runs: &[RunLog], names: &[String]) -> String {
    let first = runs.first().and_then(|r| r.model.clone());
    let shared = runs.iter().all(|r| r.model == first);
    match (runs.len(), first) {
        (1, Some(m)) => format!(" — {}, {m}", names[0]),
        (1, None) => format!(" — {}", names[0]),
        (_, Some(m)) if shared => format!(" — {m}"),
        _ => String::new(),
    }
}
