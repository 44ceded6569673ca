//! parity.md and parity.png: the NCCL-parity figures of a per-rank sweep, each call's
//! graph-mode latency over its baseline's at the same size and world (lower is better,
//! 1 = the same):
//! - the operators (`--ops`) over the sum of the same type and bytes, timed in turns
//!   with each operator (`-{op}-sum` rows; the sweep's sum row where a report has none);
//! - the sum over other element types (`--sum-types`) over f32's of the same bytes;
//! - all-to-all, all-to-all-v and send/recv (`--exchange`) over a device-to-device copy
//!   of the same bytes.
//!
//! Written beside results.json when the sweep has any of these rows; `--replot` draws
//! them again.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use plotters::prelude::*;

use super::chart::{self, pow2_ticks, Stroke};
use super::Report;

/// The three comparisons: (title, what the ratio is over).
const PANELS: [(&str, &str); 3] = [
    ("operators", "the sum"),
    ("element types", "f32 of the same bytes"),
    ("point to point", "a D2D copy of the same bytes"),
];

/// The operators of the first panel (`--ops`).
const OPERATORS: [&str; 4] = ["prod", "max", "min", "avg"];

/// What a row is to the figures.
enum Role {
    /// The baseline of panel `.0`.
    Baseline(usize),
    /// A line of panel `.0`, named `.1`.
    Member(usize, String),
    /// The baseline of line `.1` of panel `.0` alone (the sum timed in turns with it).
    LineBaseline(usize, String),
}

/// The role of an implementation's rows (per-rank names carry `-thread` or `-process`).
fn role(implementation: &str) -> Option<Role> {
    if implementation.starts_with("d2d-copy") {
        return Some(Role::Baseline(2));
    }
    let rest = ["peercomm-per-rank-thread", "peercomm-per-rank-process"]
        .iter()
        .find_map(|p| implementation.strip_prefix(p))?;
    let rest = rest.strip_prefix('-').unwrap_or(rest);
    match rest {
        "" => Some(Role::Baseline(0)),
        op if OPERATORS.contains(&op) => Some(Role::Member(0, op.into())),
        paired
            if paired
                .strip_suffix("-sum")
                .is_some_and(|op| OPERATORS.contains(&op)) =>
        {
            Some(Role::LineBaseline(
                0,
                paired.trim_end_matches("-sum").into(),
            ))
        }
        "sum-f32" => Some(Role::Baseline(1)),
        "all-to-all"
        | "all-to-all-v"
        | "sendrecv"
        | "all-to-all-symmetric"
        | "sendrecv-symmetric" => Some(Role::Member(2, rest.into())),
        _ => rest
            .strip_prefix("sum-")
            .map(|t| Role::Member(1, format!("sum {t}"))),
    }
}

/// Panel -> line -> (bytes -> (ratio, baseline us)), over the graph-mode rows of the
/// world of the first record.
type Ratios = Vec<BTreeMap<String, BTreeMap<usize, (f64, f64)>>>;

fn ratios(report: &Report) -> Ratios {
    let mut out: Ratios = vec![BTreeMap::new(); PANELS.len()];
    let Some(first) = report.records.first() else {
        return out;
    };
    let rows = || {
        (report.records.iter())
            .filter(|r| r.mode == "graph" && r.world == first.world && r.group == r.world)
    };
    // (panel, line or "" for the panel's, bytes) -> baseline us.
    let mut base = BTreeMap::new();
    for r in rows() {
        match role(&r.implementation) {
            Some(Role::Baseline(p)) => base.insert((p, String::new(), r.bytes), r.latency_us),
            Some(Role::LineBaseline(p, name)) => base.insert((p, name, r.bytes), r.latency_us),
            _ => None,
        };
    }
    for r in rows() {
        if let Some(Role::Member(p, name)) = role(&r.implementation) {
            let own = base.get(&(p, name.clone(), r.bytes));
            if let Some(&b) = own.or_else(|| base.get(&(p, String::new(), r.bytes))) {
                let line = out[p].entry(name).or_default();
                line.insert(r.bytes, (r.latency_us / b, b));
            }
        }
    }
    out
}

/// Whether the report has any row of the figures.
pub fn any(report: &Report) -> bool {
    ratios(report).iter().any(|p| !p.is_empty())
}

/// parity.md: per panel, a table of the ratios by size, and each line's worst.
pub fn table(report: &Report) -> String {
    let world = report.records.first().map_or(0, |r| r.world);
    let mut s = format!(
        "# NCCL-parity figures, world {world}, CUDA-graph replays\n\n{}, {}. Each cell is \
         the call's latency over its baseline's (lower is better); the second column is \
         the first line's baseline latency.\n",
        report.backend, report.date
    );
    if super::shares_gpus(report) {
        s.push_str("Ranks share a GPU: the timings say nothing about a link.\n");
    }
    for (p, lines) in ratios(report).iter().enumerate() {
        if lines.is_empty() {
            continue;
        }
        let (title, over) = PANELS[p];
        let _ = write!(s, "\n## {title}, over {over}\n\n| bytes | baseline us |");
        for name in lines.keys() {
            let _ = write!(s, " {name} |");
        }
        s.push_str("\n|---|---|");
        s.push_str(&"---|".repeat(lines.len()));
        s.push('\n');
        let sizes: std::collections::BTreeSet<usize> =
            lines.values().flat_map(|l| l.keys().copied()).collect();
        for bytes in sizes {
            let b = lines
                .values()
                .find_map(|l| l.get(&bytes))
                .map_or(0.0, |x| x.1);
            let _ = write!(s, "| {} | {b:.2} |", super::human_bytes(bytes as f64));
            for l in lines.values() {
                match l.get(&bytes) {
                    Some((r, _)) => {
                        let _ = write!(s, " {r:.3} |");
                    }
                    None => s.push_str(" |"),
                }
            }
            s.push('\n');
        }
        s.push_str("| worst | |");
        for l in lines.values() {
            let worst = l.values().map(|x| x.0).fold(0.0, f64::max);
            let _ = write!(s, " {worst:.3} |");
        }
        s.push('\n');
    }
    s
}

/// Line colours, in the order of the lines of a panel.
const COLORS: [RGBColor; 9] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(23, 190, 207),
];

/// parity.png: one chart per panel that has lines, ratio against bytes per rank.
pub fn draw(report: &Report, path: &std::path::Path) -> chart::DrawResult {
    chart::register_font()?;
    let all = ratios(report);
    let panels: Vec<usize> = (0..PANELS.len()).filter(|&p| !all[p].is_empty()).collect();
    if panels.is_empty() {
        return Ok(());
    }
    let world = report.records.first().map_or(0, |r| r.world);
    let (width, height) = (560 * panels.len() as u32, 620u32);
    let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, charts) = root.split_vertically(64);
    let mut subtitle = format!(
        "{}, {}; CUDA-graph replays; lower is better, 1 = the same",
        report.backend, report.date
    );
    if super::shares_gpus(report) {
        subtitle.push_str("; ranks share a GPU");
    }
    chart::titles(
        &top,
        &format!("latency over the baseline's, world {world}"),
        &subtitle,
    )?;
    let areas = charts.split_evenly((1, panels.len()));
    for (area, &p) in areas.iter().zip(&panels) {
        let (plot, legend) = area.split_vertically(height - 64 - 110);
        let lines = &all[p];
        let points = || lines.values().flat_map(|l| l.iter());
        let (xmin, xmax) = points().fold((f64::MAX, 0f64), |(a, b), (&x, _)| {
            (a.min(x as f64), b.max(x as f64))
        });
        let ymax = points().map(|(_, r)| r.0).fold(1.0, f64::max) * 1.1;
        let ymin = points().map(|(_, r)| r.0).fold(1.0, f64::min) * 0.9;
        let (x0, x1) = (xmin / 1.4, xmax * 1.4);
        let (bold, light) = pow2_ticks(x0, x1, 560.0 - 60.0 - 30.0, 80.0);
        let (title, over) = PANELS[p];
        let mut c = ChartBuilder::on(&plot)
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .caption(format!("{title}, over {over}"), ("sans-serif", 17))
            .build_cartesian_2d(
                (x0..x1)
                    .log_scale()
                    .with_key_points(bold)
                    .with_light_points(light),
                ymin..ymax,
            )?;
        c.configure_mesh()
            .x_desc("bytes per rank")
            .x_label_formatter(&|b| super::human_bytes(*b))
            .y_desc("ratio")
            .y_labels(8)
            .y_label_formatter(&|v| format!("{v:.2}"))
            .draw()?;
        chart::draw_line(
            &mut c,
            vec![(x0, 1.0), (x1, 1.0)],
            BLACK,
            Stroke::Dotted,
            false,
        )?;
        let mut entries = Vec::new();
        for (i, (name, l)) in lines.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let pts = l.iter().map(|(&b, r)| (b as f64, r.0)).collect();
            chart::draw_line(&mut c, pts, color, Stroke::Solid, true)?;
            entries.push((name.clone(), color, Stroke::Solid));
        }
        chart::legend(&legend, &entries)?;
    }
    root.present()?;
    Ok(())
}
