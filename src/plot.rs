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

use crate::output::write_atomic_with;
use crate::{Error, Result};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

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
fn run_model(dir: &Path) -> Option<String> {
    let text = fs::read_to_string(dir.join("run.json")).ok()?;
    let run: serde_json::Value = serde_json::from_str(&text).ok()?;
    run.get("model")?.as_str().map(str::to_string)
}

/// Every non-blank line of the JSON-lines file `path` as a `T`. An invalid
/// last line is a write cut short by a crash: it is skipped, with a note in
/// `skipped`. An invalid line before it is an error naming the file, line
/// and column.
fn read_lines<T: DeserializeOwned>(path: &Path, skipped: &mut Vec<String>) -> Result<Vec<T>> {
    let bytes = fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
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

/// The environment variable naming the TrueType font charts are drawn with.
pub const FONT_ENV: &str = "SHARDNET_PLOT_FONT";

/// Where DejaVu Sans is looked for when [`FONT_ENV`] is unset (Debian and
/// Ubuntu, Fedora, Arch).
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Register the font plotters draws `"sans-serif"` text with (its
/// `ab_glyph` backend reads no system font on its own): the file named by
/// `$SHARDNET_PLOT_FONT`, else DejaVu Sans where the distribution puts it.
/// The first call reads the font; later calls return its outcome.
pub fn register_font() -> Result<()> {
    static FONT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    FONT.get_or_init(load_font).clone().map_err(Error::Usage)
}

fn load_font() -> std::result::Result<(), String> {
    let path = match std::env::var_os(FONT_ENV) {
        Some(p) => PathBuf::from(p),
        None => FONTS
            .iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .ok_or_else(|| {
                format!(
                    "no font to draw the charts' text with: none of {} exists; install \
                     DejaVu Sans (Debian: fonts-dejavu-core) or set {FONT_ENV} to a .ttf file",
                    FONTS.join(", ")
                )
            })?,
    };
    let bytes = fs::read(&path).map_err(|e| {
        format!(
            "font {}: {e} (set {FONT_ENV} to a .ttf file)",
            path.display()
        )
    })?;
    // plotters keeps the font for the life of the process.
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(bytes.into_boxed_slice()),
    )
    .map_err(|_| {
        format!(
            "font {}: not a TrueType font (set {FONT_ENV} to a .ttf file)",
            path.display()
        )
    })
}

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
    fs::create_dir_all(out).map_err(|e| Error::Io(format!("--out {}: {e}", out.display())))?;

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

/// How a series is drawn.
#[derive(Clone, Copy, PartialEq)]
enum Mark {
    /// A thick line.
    Line,
    /// A thin, pale line (the raw values under a moving average).
    Faint,
    /// A line through dots (few points).
    LineDots,
    /// A dashed line through dots.
    Dashed,
    /// Filled dots.
    Dots,
    /// Open rings.
    Rings,
}

/// One series of a chart.
struct Series {
    label: Option<String>,
    colour: RGBColor,
    mark: Mark,
    points: Vec<(f64, f64)>,
}

/// A chart to draw: the series and how the axes and legend go.
struct Chart {
    title: String,
    y_desc: String,
    series: Vec<Series>,
    /// The y axis starts at 0 (rates and sizes).
    from_zero: bool,
    /// The y axis may not leave [0, 100] (percentages).
    percent: bool,
    /// Losses spanning decades are drawn on a log scale.
    may_log: bool,
    legend: SeriesLabelPosition,
    /// Written across an empty chart.
    no_data: String,
}

/// Tableau's ten colours, one per run (or per run and rank).
fn colour(i: usize) -> RGBColor {
    const P: [(u8, u8, u8); 10] = [
        (31, 119, 180),
        (255, 127, 14),
        (44, 160, 44),
        (214, 39, 40),
        (148, 103, 189),
        (140, 86, 75),
        (227, 119, 194),
        (127, 127, 127),
        (188, 189, 34),
        (23, 190, 207),
    ];
    let (r, g, b) = P[i % P.len()];
    RGBColor(r, g, b)
}

/// The moving average's window for `n` points (see the module doc).
fn window(n: usize) -> usize {
    (n / 50).clamp(1, 200)
}

/// The trailing moving average of `points` over [`window`] points.
fn smooth(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let w = window(points.len());
    let mut sum = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(x, y))| {
            sum += y;
            if i >= w {
                sum -= points[i - w].1;
            }
            (x, sum / (i + 1).min(w) as f64)
        })
        .collect()
}

/// `raw` drawn faint under its moving average, which carries `label`
/// (raw alone when there are too few points to average).
fn raw_and_smoothed(label: String, colour: RGBColor, raw: Vec<(f64, f64)>) -> Vec<Series> {
    if window(raw.len()) < 2 {
        return vec![Series {
            label: Some(label),
            colour,
            mark: few_or_many(raw.len()),
            points: raw,
        }];
    }
    let label = format!("{label}, mean of {} steps", window(raw.len()));
    let smoothed = smooth(&raw);
    vec![
        Series {
            label: None,
            colour,
            mark: Mark::Faint,
            points: raw,
        },
        Series {
            label: Some(label),
            colour,
            mark: Mark::Line,
            points: smoothed,
        },
    ]
}

/// A line, with a dot on each point when there are few.
fn few_or_many(n: usize) -> Mark {
    if n < 30 {
        Mark::LineDots
    } else {
        Mark::Line
    }
}

/// (step, f(step)) wherever `f` has a finite value.
fn per_step(run: &RunLog, f: impl Fn(&StepRecord) -> Option<f64>) -> Vec<(f64, f64)> {
    run.steps
        .iter()
        .filter_map(|s| f(s).filter(|v| v.is_finite()).map(|v| (s.step as f64, v)))
        .collect()
}

/// (last step of the epoch, f(epoch)) wherever `f` has a finite value.
fn per_epoch(run: &RunLog, f: impl Fn(&EpochRecord) -> Option<f64>) -> Vec<(f64, f64)> {
    run.epochs
        .iter()
        .filter_map(|e| f(e).filter(|v| v.is_finite()).map(|v| (e.step as f64, v)))
        .collect()
}

fn loss_chart(runs: &[RunLog], names: &[String], subject: &str) -> Chart {
    let mut series = Vec::new();
    for (i, (run, name)) in runs.iter().zip(names).enumerate() {
        series.extend(raw_and_smoothed(
            name.clone(),
            colour(i),
            per_step(run, |s| s.loss),
        ));
        let epochs = per_epoch(run, |e| e.train_loss);
        if !epochs.is_empty() {
            series.push(Series {
                label: Some(format!("{name}, epoch mean")),
                colour: colour(i),
                mark: Mark::Rings,
                points: epochs,
            });
        }
    }
    Chart {
        title: format!("training loss{subject}"),
        y_desc: "loss".into(),
        series,
        from_zero: false,
        percent: false,
        may_log: true,
        legend: SeriesLabelPosition::UpperRight,
        no_data: "no finite loss in steps.jsonl".into(),
    }
}

fn accuracy_chart(runs: &[RunLog], names: &[String], subject: &str) -> Chart {
    let mut series = Vec::new();
    let pct = |v: Option<f64>| v.map(|a| a * 100.0);
    for (i, (run, name)) in runs.iter().zip(names).enumerate() {
        let c = colour(i);
        let train = per_epoch(run, |e| pct(e.train_accuracy));
        if train.len() >= 2 {
            series.push(Series {
                label: Some(format!("{name} train, per epoch")),
                colour: c,
                mark: Mark::Line,
                points: train.clone(),
            });
            series.push(Series {
                label: None,
                colour: c,
                mark: Mark::Rings,
                points: train,
            });
        } else {
            series.extend(raw_and_smoothed(
                format!("{name} train, per step"),
                c,
                per_step(run, |s| pct(s.accuracy)),
            ));
        }
        let test = per_epoch(run, |e| pct(e.test_accuracy));
        if !test.is_empty() {
            series.push(Series {
                label: Some(format!("{name} test")),
                colour: c,
                mark: if test.len() >= 2 {
                    Mark::Dashed
                } else {
                    Mark::Dots
                },
                points: test,
            });
        }
    }
    Chart {
        title: format!("accuracy{subject}"),
        y_desc: "accuracy (%)".into(),
        series,
        from_zero: false,
        percent: true,
        may_log: false,
        legend: SeriesLabelPosition::LowerRight,
        no_data: "no accuracy in steps.jsonl or epochs.jsonl".into(),
    }
}

fn throughput_chart(runs: &[RunLog], names: &[String], subject: &str) -> Chart {
    let mut series = Vec::new();
    for (i, (run, name)) in runs.iter().zip(names).enumerate() {
        series.extend(raw_and_smoothed(
            name.clone(),
            colour(i),
            per_step(run, |s| s.samples_per_s),
        ));
    }
    Chart {
        title: format!("training throughput{subject}"),
        y_desc: "samples/s".into(),
        series,
        from_zero: true,
        percent: false,
        may_log: false,
        legend: SeriesLabelPosition::LowerRight,
        no_data: "no samples/s in steps.jsonl".into(),
    }
}

fn memory_chart(runs: &[RunLog], names: &[String], subject: &str) -> Chart {
    // Each run's (step, per-rank bytes), from its steps and epochs.
    let logged: Vec<BTreeMap<u64, &[u64]>> = runs
        .iter()
        .map(|run| {
            let epochs = run
                .epochs
                .iter()
                .filter_map(|e| Some((e.step, e.memory_bytes.as_deref()?)));
            let steps = run
                .steps
                .iter()
                .filter_map(|s| Some((s.step, s.memory_bytes.as_deref()?)));
            epochs.chain(steps).collect()
        })
        .collect();
    let top = logged
        .iter()
        .flat_map(|m| m.values().flat_map(|b| b.iter()))
        .copied()
        .max()
        .unwrap_or(0);
    let (unit, per) = if top >= 1 << 30 {
        ("GiB", (1u64 << 30) as f64)
    } else {
        ("MiB", (1u64 << 20) as f64)
    };
    let mut series = Vec::new();
    for (run, name) in logged.iter().zip(names) {
        let ranks = run.values().map(|b| b.len()).max().unwrap_or(0);
        for r in 0..ranks {
            let points: Vec<(f64, f64)> = run
                .iter()
                .filter_map(|(&step, b)| Some((step as f64, *b.get(r)? as f64 / per)))
                .collect();
            let label = if runs.len() == 1 {
                format!("rank {r}")
            } else {
                format!("{name} rank {r}")
            };
            series.push(Series {
                label: Some(label),
                colour: colour(series.len()),
                mark: few_or_many(points.len()),
                points,
            });
        }
    }
    Chart {
        title: format!("peak resident memory per rank{subject}"),
        y_desc: format!("peak resident memory ({unit})"),
        series,
        from_zero: true,
        percent: false,
        may_log: false,
        legend: SeriesLabelPosition::LowerRight,
        no_data: "no memory_bytes in steps.jsonl or epochs.jsonl".into(),
    }
}

const SIZE: (u32, u32) = (1000, 600);

/// Draw `chart` and write it to `path` as a PNG, atomically.
fn render(path: &Path, chart: &Chart) -> Result<()> {
    let (w, h) = SIZE;
    let mut pixels = vec![0u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, SIZE).into_drawing_area();
        draw(&root, chart)
            .and_then(|()| root.present().map_err(Into::into))
            .map_err(|e| Error::Io(format!("{}: cannot draw the chart: {e}", path.display())))?;
    }
    // The temporary file's name has no .png for plotters to go by, so the
    // pixels are encoded here.
    write_atomic_with(path, |tmp| {
        image::save_buffer_with_format(
            tmp,
            &pixels,
            w,
            h,
            image::ColorType::Rgb8,
            image::ImageFormat::Png,
        )
        .map_err(|e| Error::Io(format!("{}: {e}", path.display())))
    })
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// Pick the axes' ranges (and a log scale for a loss spanning decades),
/// then draw.
fn draw(root: &DrawingArea<BitMapBackend, Shift>, chart: &Chart) -> DrawResult {
    root.fill(&WHITE)?;
    let points = || chart.series.iter().flat_map(|s| s.points.iter());
    let Some((x0, x1, y0, y1)) = points().fold(None, |acc, &(x, y)| {
        let (a, b, c, d) = acc.unwrap_or((x, x, y, y));
        Some((a.min(x), b.max(x), c.min(y), d.max(y)))
    }) else {
        let area = root
            .margin(16, 16, 16, 16)
            .titled(&chart.title, ("sans-serif", 26))?;
        let (w, h) = area.dim_in_pixel();
        let centred = TextStyle::from(("sans-serif", 20)).pos(Pos::new(HPos::Center, VPos::Center));
        area.draw(&Text::new(
            chart.no_data.clone(),
            (w as i32 / 2, h as i32 / 2),
            centred,
        ))?;
        return Ok(());
    };
    let x = if x1 > x0 { x0..x1 } else { x0 - 1.0..x1 + 1.0 };
    if chart.may_log && y0 > 0.0 && y1 / y0 > 20.0 {
        return draw_on(root, chart, x, (y0 / 1.3..y1 * 1.3).log_scale(), true);
    }
    let pad = if y1 > y0 { (y1 - y0) * 0.08 } else { 1.0 };
    let (mut lo, mut hi) = (y0 - pad, y1 + pad);
    if chart.from_zero {
        lo = 0.0;
        hi = y1 + (y1 - 0.0).abs() * 0.1 + if y1 > 0.0 { 0.0 } else { 1.0 };
    }
    if chart.percent {
        // Within [0, 100], and still a range if a log holds values outside.
        lo = lo.clamp(0.0, 99.0);
        hi = hi.min(100.0).max(lo + 1.0);
    }
    draw_on(root, chart, x, lo..hi, false)
}

/// Draw `chart` against step `x` and value `y` (a linear or log range).
fn draw_on<Y>(
    root: &DrawingArea<BitMapBackend, Shift>,
    chart: &Chart,
    x: Range<f64>,
    y: Y,
    log: bool,
) -> DrawResult
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut ctx = ChartBuilder::on(root)
        .caption(&chart.title, ("sans-serif", 26))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x, y)?;
    let y_desc = if log {
        format!("{} (log scale)", chart.y_desc)
    } else {
        chart.y_desc.clone()
    };
    ctx.configure_mesh()
        .x_desc("step")
        .y_desc(y_desc)
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(*v))
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .light_line_style(TRANSPARENT)
        .draw()?;
    for s in &chart.series {
        let c = s.colour;
        let pts = s.points.iter().copied();
        let drawn = match s.mark {
            Mark::Line => ctx.draw_series(LineSeries::new(pts, c.stroke_width(2)))?,
            Mark::Faint => ctx.draw_series(LineSeries::new(pts, c.mix(0.25).stroke_width(1)))?,
            Mark::LineDots => {
                ctx.draw_series(pts.clone().map(|p| Circle::new(p, 4, c.filled())))?;
                ctx.draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            }
            Mark::Dashed => {
                ctx.draw_series(pts.clone().map(|p| Circle::new(p, 4, c.filled())))?;
                ctx.draw_series(DashedLineSeries::new(pts, 8, 5, c.stroke_width(2)))?
            }
            Mark::Dots => ctx.draw_series(pts.map(|p| Circle::new(p, 5, c.filled())))?,
            Mark::Rings => ctx.draw_series(pts.map(|p| Circle::new(p, 6, c.stroke_width(2))))?,
        };
        if let Some(label) = &s.label {
            let mark = s.mark;
            drawn
                .label(label)
                .legend(move |(x, y)| legend_mark(mark, c, x, y));
        }
    }
    if chart.series.iter().any(|s| s.label.is_some()) {
        ctx.configure_series_labels()
            .position(chart.legend.clone())
            .label_font(("sans-serif", 16))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

/// A series' sample in the legend, at (x, y).
fn legend_mark<DB: DrawingBackend>(
    mark: Mark,
    c: RGBColor,
    x: i32,
    y: i32,
) -> DynElement<'static, DB, (i32, i32)> {
    let line = vec![(x, y), (x + 24, y)];
    match mark {
        Mark::Line | Mark::Faint | Mark::LineDots => {
            PathElement::new(line, c.stroke_width(2)).into_dyn()
        }
        Mark::Dashed => DashedPathElement::new(line, 6, 3, c.stroke_width(2)).into_dyn(),
        Mark::Dots => Circle::new((x + 12, y), 5, c.filled()).into_dyn(),
        Mark::Rings => Circle::new((x + 12, y), 6, c.stroke_width(2)).into_dyn(),
    }
}

/// An axis label: at most three decimals, trailing zeros dropped; small
/// magnitudes in scientific notation.
fn tick(v: f64) -> String {
    if v != 0.0 && v.abs() < 0.01 {
        return format!("{v:.1e}");
    }
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".into()
    } else {
        s.into()
    }
}
