//! Plot `bench/mlp_widths.sh`'s CSV: training samples/s against the hidden
//! width U (log-log, one panel per batch size, one line per variant and rank
//! count), and below them the speed-up of 2 ranks (or 2 threads) over 1.
//!
//!     cargo run --release --features mpi --example plot_widths -- bench/mlp_widths.csv bench/mlp_widths.png
//!
//! Text is drawn with plotters' `ab_glyph` backend from a TrueType file:
//! `$SHARDNET_PLOT_FONT`, default DejaVu Sans (Debian's fonts-dejavu-core);
//! see `shardnet_cli::plot::register_font`.

use plotters::element::DashedPathElement;
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::error::Error;

/// One CSV row: `impl,scheme,ranks,threads,micro_batches,batch,units,warmup,timed_steps,samples_per_s`.
#[derive(Clone, Debug)]
struct Row {
    framework: String,
    scheme: String,
    ranks: u32,
    threads: u32,
    micro: u32,
    batch: u32,
    units: u32,
    samples_per_s: f64,
}

/// A line of the plot: everything but the width.
type Key = (String, String, u32, u32, u32);

fn key(r: &Row) -> Key {
    (
        r.framework.clone(),
        r.scheme.clone(),
        r.ranks,
        r.threads,
        r.micro,
    )
}

fn read(path: &str) -> Result<Vec<Row>, Box<dyn Error>> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate().skip(1) {
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        if f.len() != 10 {
            return Err(format!("{path}:{}: expected 10 fields, got {}", i + 1, f.len()).into());
        }
        let n = |k: usize| {
            f[k].parse::<u32>()
                .map_err(|e| format!("{path}:{}: {e}", i + 1))
        };
        rows.push(Row {
            framework: f[0].to_string(),
            scheme: f[1].to_string(),
            ranks: n(2)?,
            threads: n(3)?,
            micro: n(4)?,
            batch: n(5)?,
            units: n(6)?,
            samples_per_s: f[9].parse().map_err(|e| format!("{path}:{}: {e}", i + 1))?,
        });
    }
    Ok(rows)
}

fn label(k: &Key) -> String {
    let (fw, scheme, ranks, threads, micro) = k;
    let mut s = format!("{fw} {scheme}");
    if *micro > 1 {
        s += &format!(" M={micro}");
    }
    if fw == "pytorch" && scheme == "single" {
        s += &format!(", {threads} thread{}", if *threads > 1 { "s" } else { "" });
    } else {
        s += &format!(", {ranks} rank{}", if *ranks > 1 { "s" } else { "" });
    }
    s
}

/// One colour per framework and scheme.
fn colour(k: &Key) -> RGBColor {
    match (k.0.as_str(), k.1.as_str(), k.4 > 1) {
        ("shardnet", "tensor", _) => RGBColor(0, 90, 200),
        ("shardnet", "chainer", _) => RGBColor(220, 50, 32),
        ("shardnet", "pipeline", false) => RGBColor(0, 150, 70),
        ("shardnet", "pipeline", true) => RGBColor(150, 200, 0),
        ("pytorch", "single", _) => RGBColor(90, 90, 90),
        ("pytorch", "tensor", _) => RGBColor(130, 40, 200),
        ("pytorch", "chainer", _) => RGBColor(240, 150, 0),
        _ => RGBColor(0, 0, 0),
    }
}

/// The one-core row that a parallel row is measured against.
fn baseline(k: &Key) -> Option<Key> {
    let (fw, scheme, ranks, threads, _) = k;
    if *ranks == 1 && *threads == 1 {
        return None;
    }
    let scheme = if fw == "pytorch" && scheme == "tensor" {
        "single".to_string()
    } else {
        scheme.clone()
    };
    Some((fw.clone(), scheme, 1, 1, 1))
}

type Lines = BTreeMap<Key, Vec<(f64, f64)>>;

fn panel(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    title: &str,
    y_desc: &str,
    lines: &Lines,
    y_range: (f64, f64),
    one: bool,
) -> Result<(), Box<dyn Error>> {
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (800f64..20000f64)
                .log_scale()
                .with_key_points(vec![1000.0, 2000.0, 4000.0, 8000.0, 16000.0]),
            (y_range.0..y_range.1).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("hidden width U (log scale)")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| {
            if *y >= 1.0 {
                format!("{y:.0}")
            } else {
                format!("{y:.2}")
            }
        })
        .label_style(("sans-serif", 16))
        .light_line_style(RGBColor(238, 238, 238))
        .draw()?;
    if one {
        chart.draw_series(LineSeries::new(
            [(800.0, 1.0), (20000.0, 1.0)],
            BLACK.stroke_width(1),
        ))?;
    }
    for (k, pts) in lines {
        let c = colour(k);
        let parallel = k.2 > 1 || k.3 > 1;
        let style = c.stroke_width(if parallel { 3 } else { 2 });
        if parallel {
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), style))?
                .label(label(k))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        } else {
            chart
                .draw_series(DashedLineSeries::new(pts.iter().copied(), 8, 5, style))?
                .label(label(k))
                .legend(move |(x, y)| {
                    DashedPathElement::new(vec![(x, y), (x + 24, y)], 6, 3, style)
                });
        }
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().collect();
    let csv = args.get(1).map_or("bench/mlp_widths.csv", String::as_str);
    let png = args.get(2).map_or("bench/mlp_widths.png", String::as_str);
    shardnet_cli::plot::register_font()?;

    let rows = read(csv)?;
    let mut batches: Vec<u32> = rows.iter().map(|r| r.batch).collect();
    batches.sort_unstable();
    batches.dedup();

    let root = BitMapBackend::new(png, (900 * batches.len() as u32, 1500)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(900);
    let tops = top.split_evenly((1, batches.len()));
    let bottoms = bottom.split_evenly((1, batches.len()));
    for (i, &b) in batches.iter().enumerate() {
        let here: Vec<&Row> = rows.iter().filter(|r| r.batch == b).collect();
        let mut sps: Lines = BTreeMap::new();
        for r in &here {
            sps.entry(key(r))
                .or_default()
                .push((r.units as f64, r.samples_per_s));
        }
        let mut speedup: Lines = BTreeMap::new();
        for r in &here {
            let Some(base) = baseline(&key(r)) else {
                continue;
            };
            if let Some(b0) = here.iter().find(|q| key(q) == base && q.units == r.units) {
                speedup
                    .entry(key(r))
                    .or_default()
                    .push((r.units as f64, r.samples_per_s / b0.samples_per_s));
            }
        }
        for l in sps.values_mut().chain(speedup.values_mut()) {
            l.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        let (lo, hi) = here.iter().fold((f64::MAX, 0f64), |(lo, hi), r| {
            (lo.min(r.samples_per_s), hi.max(r.samples_per_s))
        });
        panel(
            &tops[i],
            &format!("training samples/s, batch {b} (one core per rank)"),
            "samples/s (log scale)",
            &sps,
            (lo / 1.5, hi * 6.0),
            false,
        )?;
        let (slo, shi) = speedup
            .values()
            .flatten()
            .fold((1f64, 1f64), |(lo, hi), p| (lo.min(p.1), hi.max(p.1)));
        panel(
            &bottoms[i],
            &format!("speed-up of 2 ranks (2 threads) over 1, batch {b}"),
            "speed-up (log scale)",
            &speedup,
            (slo / 1.3, shi * 2.0),
            true,
        )?;
    }
    root.present()?;
    eprintln!("wrote {png}");
    Ok(())
}
