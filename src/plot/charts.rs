//! What each chart shows: its series (raw and smoothed, one colour per
//! run), marks and axes, built from the runs' records.

use super::*;

/// How a series is drawn.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Mark {
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
pub(super) struct Series {
    pub(super) label: Option<String>,
    pub(super) colour: RGBColor,
    pub(super) mark: Mark,
    pub(super) points: Vec<(f64, f64)>,
}

/// A chart to draw: the series and how the axes and legend go.
pub(super) struct Chart {
    pub(super) title: String,
    pub(super) y_desc: String,
    pub(super) series: Vec<Series>,
    /// The y axis starts at 0 (rates and sizes).
    pub(super) from_zero: bool,
    /// The y axis may not leave [0, 100] (percentages).
    pub(super) percent: bool,
    /// Losses spanning decades are drawn on a log scale.
    pub(super) may_log: bool,
    pub(super) legend: SeriesLabelPosition,
    /// Written across an empty chart.
    pub(super) no_data: String,
}

/// Tableau's ten colours, one per run (or per run and rank).
pub(super) fn colour(i: usize) -> RGBColor {
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
pub(super) fn window(n: usize) -> usize {
    (n / 50).clamp(1, 200)
}

/// The trailing moving average of `points` over [`window`] points.
pub(super) fn smooth(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
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
pub(super) fn raw_and_smoothed(
    label: String,
    colour: RGBColor,
    raw: Vec<(f64, f64)>,
) -> Vec<Series> {
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
pub(super) fn few_or_many(n: usize) -> Mark {
    if n < 30 {
        Mark::LineDots
    } else {
        Mark::Line
    }
}

/// (step, f(step)) wherever `f` has a finite value.
pub(super) fn per_step(run: &RunLog, f: impl Fn(&StepRecord) -> Option<f64>) -> Vec<(f64, f64)> {
    run.steps
        .iter()
        .filter_map(|s| f(s).filter(|v| v.is_finite()).map(|v| (s.step as f64, v)))
        .collect()
}

/// (last step of the epoch, f(epoch)) wherever `f` has a finite value.
pub(super) fn per_epoch(run: &RunLog, f: impl Fn(&EpochRecord) -> Option<f64>) -> Vec<(f64, f64)> {
    run.epochs
        .iter()
        .filter_map(|e| f(e).filter(|v| v.is_finite()).map(|v| (e.step as f64, v)))
        .collect()
}

pub(super) fn loss_chart(runs: &[RunLog], names: &[String], subject: &str) -> Chart {
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

pub(super) fn accuracy_chart(runs: &[RunLog], names: &[String], subject: &str) -> Chart {
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

pub(super) fn throughput_chart(runs: &[RunLog], names: &[String], subject: &str) -> Chart {
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

pub(super) fn memory_chart(runs: &[RunLog], names: &[String], subject: &str) -> Chart {
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
