//! Drawing a chart to a PNG with plotters (atomically written): axes,
//! series, legend and ticks.

use super::*;

pub(super) const SIZE: (u32, u32) = (1000, 600);

/// Draw `chart` and write it to `path` as a PNG, atomically.
pub(super) fn render(path: &Path, chart: &Chart) -> Result<()> {
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
        .map_err(|e| Error::caused(path.display().to_string(), e))
    })
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// Pick the axes' ranges (and a log scale for a loss spanning decades),
/// then draw.
pub(super) fn draw(root: &DrawingArea<BitMapBackend, Shift>, chart: &Chart) -> DrawResult {
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
pub(super) fn draw_on<Y>(
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
pub(super) fn legend_mark<DB: DrawingBackend>(
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
pub(super) fn tick(v: f64) -> String {
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
