//! results.png: latency and bus bandwidth against message size, peercomm (auto) against
//! NCCL, for the whole-world group of the first dtype, eager and graph.

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

use super::Report;

/// A named line: (bytes, latency us, bus GB/s) points.
type Series = (String, Vec<(f64, f64, f64)>);

pub fn draw(report: &Report, path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    // The bitmap backend needs a font it can rasterise without system fonts.
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "could not register the DejaVu font")?;
    let Some(first) = report.records.first() else {
        return Ok(());
    };
    let (dtype, world) = (first.dtype.clone(), first.world);
    let series: Vec<Series> = ["peercomm-auto", "nccl", "nccl-symmetric"]
        .iter()
        .flat_map(|imp| ["graph", "eager"].map(|mode| (*imp, mode)))
        .map(|(imp, mode)| {
            let pts = report
                .records
                .iter()
                .filter(|r| {
                    r.implementation == imp
                        && r.mode == mode
                        && r.dtype == dtype
                        && r.group == world
                })
                .map(|r| (r.bytes as f64, r.latency_us, r.busbw_gbps))
                .collect();
            (format!("{imp} {mode}"), pts)
        })
        .filter(|(_, p): &Series| !p.is_empty())
        .collect();
    // The physical floor of the same run (launch + one-way flag + bytes at the copy
    // engine's bandwidth), for the points that have one.
    let mut floor: Vec<(f64, f64, f64)> = report
        .records
        .iter()
        .filter(|r| r.dtype == dtype && r.group == world && r.mode == "graph")
        .filter_map(|r| {
            let f = r.floor_us?;
            Some((r.bytes as f64, f, r.busbw_gbps * r.latency_us / f))
        })
        .collect();
    floor.sort_by(|a, b| a.0.total_cmp(&b.0));
    floor.dedup_by(|a, b| a.0 == b.0);
    let mut series = series;
    if !floor.is_empty() {
        series.push(("floor (link, same run)".into(), floor));
    }
    if series.is_empty() {
        return Ok(());
    }
    let xs = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0));
    let (xmin, xmax) = xs.fold((f64::MAX, 0f64), |(a, b), x| (a.min(x), b.max(x)));
    let lat_max = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold(1.0, f64::max);
    let lat_min = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold(f64::MAX, f64::min);
    let bw_max = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.2))
        .fold(1.0, f64::max);

    let root = BitMapBackend::new(path, (1400, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!(
        "all-reduce {dtype}, {world} x {}, {} ({})",
        report.devices.first().map(String::as_str).unwrap_or("?"),
        report.backend,
        report.date
    );
    let root = root.titled(&title, ("sans-serif", 22))?;
    let (left, right) = root.split_horizontally(700);
    panel(
        &left,
        "latency (us, lower is better)",
        "us",
        (xmin..xmax).log_scale().base(2.0),
        (lat_min * 0.8..lat_max * 1.2).log_scale(),
        &series,
        |p| p.1,
    )?;
    panel(
        &right,
        "bus bandwidth (GB/s, higher is better)",
        "GB/s",
        (xmin..xmax).log_scale().base(2.0),
        0.0..bw_max * 1.1,
        &series,
        |p| p.2,
    )?;
    root.present()?;
    Ok(())
}

/// One chart: every series against bytes per rank, `pick` choosing the y value.
fn panel<DB, X, Y>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    caption: &str,
    y_desc: &str,
    x: X,
    y: Y,
    series: &[Series],
    pick: fn(&(f64, f64, f64)) -> f64,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let colors = [
        RED,
        BLUE,
        MAGENTA,
        CYAN,
        GREEN,
        RGBColor(255, 140, 0),
        BLACK,
    ];
    let mut chart = ChartBuilder::on(area)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .caption(caption, ("sans-serif", 18))
        .build_cartesian_2d(x, y)?;
    chart
        .configure_mesh()
        .x_desc("bytes per rank")
        .x_label_formatter(&|x| super::human_bytes(*x))
        .y_desc(y_desc)
        .draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|p| (p.0, pick(p))),
                c.stroke_width(2),
            ))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}
