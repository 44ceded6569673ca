//! What the benchmark's plot and the candle example's plot (which includes this file)
//! share: a title with a subtitle, a legend below the charts, tick labels spaced so
//! that they never meet on log axes, and lines drawn solid, dashed or dotted.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Result of drawing.
pub type DrawResult = Result<(), Box<dyn std::error::Error>>;

/// How a line is drawn.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Stroke {
    Solid,
    Dashed,
    Dotted,
}

/// Registers the bundled DejaVu font as "sans-serif" (the bitmap backend needs a font
/// it can rasterise without system fonts).
pub fn register_font() -> DrawResult {
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "could not register the DejaVu font".into())
}

/// Draws `pts` in `chart` as one line of `color` and `stroke`, with a dot per point.
pub fn draw_line<DB, X, Y>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<X, Y>>,
    pts: Vec<(f64, f64)>,
    color: RGBColor,
    stroke: Stroke,
    dots: bool,
) -> DrawResult
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let style = color.stroke_width(2);
    match stroke {
        Stroke::Solid => {
            chart.draw_series(LineSeries::new(pts.clone(), style))?;
        }
        Stroke::Dashed => {
            chart.draw_series(DashedLineSeries::new(pts.clone(), 8, 5, style))?;
        }
        Stroke::Dotted => {
            chart.draw_series(DashedLineSeries::new(
                pts.clone(),
                2,
                5,
                color.stroke_width(3),
            ))?;
        }
    }
    if dots {
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
    }
    Ok(())
}

/// A title and, smaller, a subtitle (if any), centred at the top of `area`.
pub fn titles<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    subtitle: &str,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let (w, _) = area.dim_in_pixel();
    let centre = Pos::new(HPos::Center, VPos::Top);
    area.draw(&Text::new(
        title.to_string(),
        (w as i32 / 2, 8),
        ("sans-serif", 22)
            .into_font()
            .into_text_style(area)
            .pos(centre),
    ))?;
    for (i, line) in subtitle.lines().enumerate() {
        area.draw(&Text::new(
            line.to_string(),
            (w as i32 / 2, 38 + 19 * i as i32),
            ("sans-serif", 15)
                .into_font()
                .into_text_style(area)
                .pos(centre),
        ))?;
    }
    Ok(())
}

/// The legend as centred rows of (sample line, name) entries across `area`, which lies
/// outside the charts, so it never covers a curve.
pub fn legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    entries: &[(String, RGBColor, Stroke)],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let font = ("sans-serif", 15).into_font().into_text_style(area);
    let (w, _) = area.dim_in_pixel();
    let (sample, gap, pad) = (36i32, 8i32, 28i32);
    let widths: Vec<i32> = entries
        .iter()
        .map(|(name, _, _)| {
            let (tw, _) = area
                .estimate_text_size(name, &font)
                .unwrap_or((9 * name.len() as u32, 15));
            sample + gap + tw as i32 + pad
        })
        .collect();
    let mut rows: Vec<Vec<usize>> = vec![Vec::new()];
    let mut used = 0;
    for (i, &ew) in widths.iter().enumerate() {
        if used + ew > w as i32 - 40 && !rows[rows.len() - 1].is_empty() {
            rows.push(Vec::new());
            used = 0;
        }
        let last = rows.len() - 1;
        rows[last].push(i);
        used += ew;
    }
    for (row, members) in rows.iter().enumerate() {
        let total: i32 = members.iter().map(|&i| widths[i]).sum::<i32>() - pad;
        let mut x = (w as i32 - total) / 2;
        let y = 16 + 24 * row as i32;
        for &i in members {
            let (name, color, stroke) = &entries[i];
            let style = color.stroke_width(if *stroke == Stroke::Dotted { 3 } else { 2 });
            let (dash, space) = match stroke {
                Stroke::Solid => (sample, 0),
                Stroke::Dashed => (8, 5),
                Stroke::Dotted => (2, 5),
            };
            let mut s = 0;
            while s < sample {
                let e = (s + dash).min(sample);
                area.draw(&PathElement::new(vec![(x + s, y), (x + e, y)], style))?;
                s = e + space;
            }
            area.draw(&Text::new(
                name.clone(),
                (x + sample + gap, y),
                font.pos(Pos::new(HPos::Left, VPos::Center)),
            ))?;
            x += widths[i];
        }
    }
    Ok(())
}

/// "0.5", "12", "350": a tick label without a spurious ".0".
pub fn number(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 10.0 || (v - v.round()).abs() < 1e-9 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Labelled ticks at powers of two in `[lo, hi]`, every step-th power so that labels
/// are at least `min_px` apart on an axis of `px` pixels; light grid lines at every
/// power.
pub fn pow2_ticks(lo: f64, hi: f64, px: f64, min_px: f64) -> (Vec<f64>, Vec<f64>) {
    let (a, b) = (lo.log2().ceil() as i32, hi.log2().floor() as i32);
    let per_octave = px / (hi.log2() - lo.log2()).max(1e-9);
    let step = ((min_px / per_octave).ceil() as usize).max(1);
    let bold = (a..=b).step_by(step).map(|e| 2f64.powi(e)).collect();
    let light = (a..=b).map(|e| 2f64.powi(e)).collect();
    (bold, light)
}

/// Labelled ticks on a log10 axis over `[lo, hi]` of `px` pixels: the densest of 1..9,
/// 1-2-3-5, 1-2-5, 1-3, 1 per decade, then every other, third... decade, whose
/// neighbours are at least `min_px` apart; light grid lines at 1..9 of every decade.
pub fn log10_ticks(lo: f64, hi: f64, px: f64, min_px: f64) -> (Vec<f64>, Vec<f64>) {
    let per_decade = px / (hi.log10() - lo.log10()).max(1e-9);
    let (d0, d1) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let within = |mults: &[f64], every: i32| -> Vec<f64> {
        (d0..=d1)
            .filter(|d| (d - d0) % every == 0)
            .flat_map(|d| mults.iter().map(move |m| m * 10f64.powi(d)))
            .filter(|v| *v >= lo && *v <= hi)
            .collect()
    };
    let apart = |t: &[f64]| {
        t.windows(2)
            .all(|w| (w[1].log10() - w[0].log10()) * per_decade >= min_px)
    };
    let per_decade_sets: [&[f64]; 5] = [
        &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
        &[1.0, 2.0, 3.0, 5.0],
        &[1.0, 2.0, 5.0],
        &[1.0, 3.0],
        &[1.0],
    ];
    let light = within(per_decade_sets[0], 1);
    for mults in per_decade_sets {
        let t = within(mults, 1);
        if apart(&t) {
            return (t, light);
        }
    }
    for every in 2..=8 {
        let t = within(&[1.0], every);
        if apart(&t) {
            return (t, light);
        }
    }
    (within(&[1.0], 9), light)
}
