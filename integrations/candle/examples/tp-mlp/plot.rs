//! tp-mlp.png: time per block against tokens, for the single-GPU block, the tensor-
//! parallel block without its all-reduce, and with each all-reduce. The title names the
//! machine as the run recorded it: when ranks share a GPU, the title says so and the
//! subtitle says what that does to the tensor-parallel times. The benchmark's
//! `peercomm-bench --replot tp-mlp.json` draws the same plot from a JSON file, through
//! this file.

use plotters::prelude::*;

// The title, legend and tick helpers of the root crate's benchmark plot.
#[path = "../../../../examples/peercomm-bench/chart.rs"]
#[allow(dead_code)]
mod chart;

use chart::{log10_ticks, number, Stroke};

use super::Report;

/// The machine as the run recorded it.
fn machine(report: &Report) -> String {
    let mut gpus = report.gpu_of_rank.clone();
    gpus.sort_unstable();
    gpus.dedup();
    let name = report.devices.first().map_or("?", String::as_str);
    match (report.shared_gpus, gpus.len()) {
        (true, 1) => format!("{} ranks sharing one {name}", report.ranks),
        (true, n) => format!("{} ranks sharing {n} x {name}", report.ranks),
        (false, 1) => format!("1 rank on one {name}"),
        (false, n) => format!("{n} x {name} (one GPU per rank)"),
    }
}

pub fn draw(report: &Report, path: &std::path::Path) -> chart::DrawResult {
    chart::register_font()?;
    let pts = &report.points;
    if pts.is_empty() {
        return Ok(());
    }
    type Pick = fn(&super::Point) -> Option<f64>;
    let series: [(&str, Pick, RGBColor); 4] = [
        ("1 GPU, no all-reduce", |p| Some(p.single_gpu_us), BLACK),
        (
            "TP share, no all-reduce",
            |p| Some(p.compute_only_us),
            RGBColor(150, 150, 150),
        ),
        ("TP + NCCL", |p| p.nccl_us, RGBColor(31, 119, 180)),
        (
            "TP + peercomm",
            |p| Some(p.peercomm_us),
            RGBColor(214, 39, 40),
        ),
    ];
    let ys = pts
        .iter()
        .flat_map(|p| series.iter().filter_map(move |s| (s.1)(p)));
    let (ymin, ymax) = ys.fold((f64::MAX, 0f64), |(a, b), y| (a.min(y), b.max(y)));
    let mut tokens: Vec<f64> = pts.iter().map(|p| p.tokens as f64).collect();
    tokens.sort_by(f64::total_cmp);
    tokens.dedup();
    let (xmin, xmax) = (tokens[0], tokens[tokens.len() - 1]);

    let (width, height) = (1000u32, 680u32);
    let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, rest) = root.split_vertically(84);
    let (plot, bottom) = rest.split_vertically(height - 84 - 44);
    let mut gpus = report.gpu_of_rank.clone();
    gpus.sort_unstable();
    gpus.dedup();
    let no_nccl = match &report.nccl_skipped {
        Some(_) if report.shared_gpus => " NCCL refuses two ranks on one GPU: no NCCL line.".into(),
        Some(why) => format!(" No NCCL line: {why}."),
        None => String::new(),
    };
    let subtitle = match (report.shared_gpus, gpus.len()) {
        (true, 1) => format!(
            "{} ran on the same GPU: each rank's share of the block runs beside the other \
             ranks' on it,\nso tensor parallelism cannot be faster than 1 GPU here.{no_nccl} \
             Times per block, slowest rank, eager.",
            if report.ranks == 2 {
                "Both ranks".to_string()
            } else {
                format!("All {} ranks", report.ranks)
            },
        ),
        (true, n) => format!(
            "{} ranks shared {n} GPUs: ranks on one GPU run their shares beside each other,\n\
             so these are not the times of one GPU per rank.{no_nccl} Times per block, slowest \
             rank, eager.",
            report.ranks
        ),
        (false, _) => format!("Times per block, slowest rank, eager.{no_nccl}"),
    };
    chart::titles(
        &top,
        &format!("Llama-3-8B MLP block, bf16, candle: {}", machine(report)),
        &subtitle,
    )?;
    let (y0, y1) = (ymin / 1.25, ymax * 1.25);
    let plot_py = f64::from(height - 84 - 44 - 2 * 15 - 40);
    let (ybold, ylight) = log10_ticks(y0, y1, plot_py, 24.0);
    let mut chart = ChartBuilder::on(&plot)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (xmin / 1.5..xmax * 1.5)
                .log_scale()
                .with_key_points(tokens.clone()),
            (y0..y1)
                .log_scale()
                .with_key_points(ybold)
                .with_light_points(ylight),
        )?;
    chart
        .configure_mesh()
        .x_desc("tokens per block")
        .x_label_formatter(&|t| number(*t))
        .y_desc("us per block (slowest rank)")
        .y_label_formatter(&|v| number(*v))
        .draw()?;
    let mut entries = Vec::new();
    for (name, pick, color) in series {
        let line: Vec<(f64, f64)> = pts
            .iter()
            .filter_map(|p| pick(p).map(|y| (p.tokens as f64, y)))
            .collect();
        if line.is_empty() {
            continue;
        }
        chart::draw_line(&mut chart, line, color, Stroke::Solid, true)?;
        entries.push((name.to_string(), color, Stroke::Solid));
    }
    chart::legend(&bottom, &entries)?;
    root.present()?;
    Ok(())
}
