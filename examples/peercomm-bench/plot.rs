//! results.png: all-reduce latency and bus bandwidth against the message size, for the
//! whole-world group of the first dtype: peercomm (the single controller's auto
//! dispatch; the per-rank `Comm`, staged and with symmetric inputs) and NCCL (plain, and
//! with symmetric windows where it ran), CUDA-graph replays
//! (solid) and eager calls (dashed), and the link's floor where the run measured one.
//!
//! The x axis is in bytes per rank (KiB, MiB, GiB), ticks are spaced so that their
//! labels never meet, the legend sits below the charts (never over a curve), and the
//! title names the API and the machine as the run knows them: ranks that share a GPU
//! are called so, whatever the device names say.

use plotters::prelude::*;

use super::chart::{self, log10_ticks, number, pow2_ticks, Stroke};
use super::Report;

/// A named line: (bytes, latency us, bus GB/s) points.
struct Line {
    name: String,
    color: RGBColor,
    stroke: Stroke,
    points: Vec<(f64, f64, f64)>,
}

/// The family, colour and name in the legend of an implementation, or None for the
/// ones the plot leaves to results.csv (peercomm's forced algorithms).
fn family(implementation: &str) -> Option<(&'static str, RGBColor)> {
    match implementation {
        "peercomm-auto" => Some(("peercomm single controller", RGBColor(214, 39, 40))),
        "peercomm-per-rank-thread" | "peercomm-per-rank-process" => {
            Some(("peercomm per rank", RGBColor(255, 127, 14)))
        }
        "peercomm-per-rank-thread-symmetric" | "peercomm-per-rank-process-symmetric" => {
            Some(("peercomm per rank, symmetric", RGBColor(148, 103, 189)))
        }
        "nccl-symmetric" => Some(("NCCL symmetric", RGBColor(44, 160, 44))),
        "nccl" | "nccl-per-rank-thread" | "nccl-per-rank-process" => {
            Some(("NCCL", RGBColor(31, 119, 180)))
        }
        _ => None,
    }
}

pub fn draw(report: &Report, path: &std::path::Path) -> chart::DrawResult {
    chart::register_font()?;
    let Some(first) = report.records.first() else {
        return Ok(());
    };
    let (dtype, world) = (first.dtype.clone(), first.world);
    let whole = |r: &&super::Record| r.dtype == dtype && r.group == world;
    let mut lines: Vec<Line> = Vec::new();
    for imp in [
        "peercomm-auto",
        "peercomm-per-rank-thread",
        "peercomm-per-rank-thread-symmetric",
        "nccl",
        "nccl-symmetric",
    ] {
        let (name, color) = family(imp).expect("a plotted family");
        for (mode, stroke) in [("graph", Stroke::Solid), ("eager", Stroke::Dashed)] {
            let mut points: Vec<(f64, f64, f64)> = report
                .records
                .iter()
                .filter(whole)
                .filter(|r| r.mode == mode)
                .filter(|r| family(&r.implementation).is_some_and(|(n, _)| n == name))
                .map(|r| (r.bytes as f64, r.latency_us, r.busbw_gbps))
                .collect();
            if points.is_empty() {
                continue;
            }
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            lines.push(Line {
                name: format!("{name}, {mode}"),
                color,
                stroke,
                points,
            });
        }
    }
    // The physical floor of the same run (graph launch + one-way flag + bytes at the
    // copy engine's bandwidth), for the points that have one.
    let mut floor: Vec<(f64, f64, f64)> = report
        .records
        .iter()
        .filter(whole)
        .filter(|r| r.mode == "graph")
        .filter_map(|r| {
            let f = r.floor_us?;
            Some((r.bytes as f64, f, r.busbw_gbps * r.latency_us / f))
        })
        .collect();
    floor.sort_by(|a, b| a.0.total_cmp(&b.0));
    floor.dedup_by(|a, b| a.0 == b.0);
    if !floor.is_empty() {
        lines.push(Line {
            name: "floor of the link (same run)".into(),
            color: BLACK,
            stroke: Stroke::Dotted,
            points: floor,
        });
    }
    if lines.is_empty() {
        return Ok(());
    }
    let all = || lines.iter().flat_map(|l| l.points.iter());
    let (xmin, xmax) = all().fold((f64::MAX, 0f64), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (lat_min, lat_max) = all().fold((f64::MAX, 0f64), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let bw_max = all().map(|p| p.2).fold(0.0, f64::max).max(1e-3);

    let (width, height) = (1400u32, 720u32);
    let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, rest) = root.split_vertically(64);
    let (charts, bottom) = rest.split_vertically(height - 64 - 64);
    let has = |mode: &str| lines.iter().any(|l| l.name.ends_with(mode));
    let modes = match (has("graph"), has("eager")) {
        (true, true) => "solid: CUDA-graph replays, dashed: eager calls",
        (true, false) => "CUDA-graph replays",
        _ => "eager calls (dashed)",
    };
    let mut subtitle = format!(
        "{}, {}; {modes}; every point in results.json",
        report.backend, report.date
    );
    if super::shares_gpus(report) {
        subtitle.push_str("; ranks share a GPU, so timings say nothing about a link");
    }
    chart::titles(
        &top,
        &format!(
            "all-reduce {dtype} over {world} ranks, {}: {}",
            super::api_of(report),
            super::machine_of(report)
        ),
        &subtitle,
    )?;
    let (left, right) = charts.split_horizontally(width / 2);
    // Plot width: the panel less its y label area and margins.
    let plot_px = f64::from(width / 2 - 60 - 2 * 15);
    let plot_py = f64::from(height - 128 - 40 - 2 * 15 - 30);
    let (x0, x1) = (xmin / 1.4, xmax * 1.4);
    let (bold, light) = pow2_ticks(x0, x1, plot_px, 80.0);
    let x = || {
        (x0..x1)
            .log_scale()
            .with_key_points(bold.clone())
            .with_light_points(light.clone())
    };
    let (y0, y1) = (lat_min / 1.3, lat_max * 1.3);
    let (ybold, ylight) = log10_ticks(y0, y1, plot_py, 24.0);
    let mut chart = ChartBuilder::on(&left)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .caption("latency per call (us, lower is better)", ("sans-serif", 18))
        .build_cartesian_2d(
            x(),
            (y0..y1)
                .log_scale()
                .with_key_points(ybold)
                .with_light_points(ylight),
        )?;
    chart
        .configure_mesh()
        .x_desc("bytes per rank")
        .x_label_formatter(&|b| super::human_bytes(*b))
        .y_desc("us")
        .y_label_formatter(&|v| number(*v))
        .draw()?;
    for l in &lines {
        let pts = l.points.iter().map(|p| (p.0, p.1)).collect();
        chart::draw_line(&mut chart, pts, l.color, l.stroke, false)?;
    }
    let mut chart = ChartBuilder::on(&right)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .caption("bus bandwidth (GB/s, higher is better)", ("sans-serif", 18))
        .build_cartesian_2d(x(), 0.0..bw_max * 1.1)?;
    chart
        .configure_mesh()
        .x_desc("bytes per rank")
        .x_label_formatter(&|b| super::human_bytes(*b))
        .y_desc("GB/s")
        .y_labels(8)
        .y_label_formatter(&|v| number(*v))
        .draw()?;
    for l in &lines {
        let pts = l.points.iter().map(|p| (p.0, p.2)).collect();
        chart::draw_line(&mut chart, pts, l.color, l.stroke, false)?;
    }
    let entries: Vec<(String, RGBColor, Stroke)> = lines
        .iter()
        .map(|l| (l.name.clone(), l.color, l.stroke))
        .collect();
    chart::legend(&bottom, &entries)?;
    root.present()?;
    Ok(())
}
