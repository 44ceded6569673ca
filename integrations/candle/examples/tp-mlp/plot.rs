//! tp-mlp.png: time per block against tokens, for the single-GPU block, the tensor-
//! parallel block without its all-reduce, and with each all-reduce.

use plotters::prelude::*;

use super::Report;

pub fn draw(report: &Report, path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    // The bitmap backend needs a font it can rasterise without system fonts.
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "could not register the DejaVu font")?;
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
        ("TP + NCCL", |p| p.nccl_us, BLUE),
        ("TP + peercomm", |p| Some(p.peercomm_us), RED),
    ];
    let ys = pts
        .iter()
        .flat_map(|p| series.iter().filter_map(move |s| (s.1)(p)));
    let (ymin, ymax) = ys.fold((f64::MAX, 0f64), |(a, b), y| (a.min(y), b.max(y)));
    let xmin = pts.iter().map(|p| p.tokens).min().unwrap_or(1) as f64;
    let xmax = pts.iter().map(|p| p.tokens).max().unwrap_or(1) as f64;

    let root = BitMapBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!(
        "Llama-3-8B MLP block, bf16, {} ranks on {} (eager, candle)",
        report.ranks,
        report.devices.first().map(String::as_str).unwrap_or("?")
    );
    let mut chart = ChartBuilder::on(&root)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .caption(title, ("sans-serif", 20))
        .build_cartesian_2d(
            (xmin * 0.8..xmax * 1.25).log_scale(),
            (ymin * 0.8..ymax * 1.25).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("tokens per block")
        .y_desc("us per block (slowest rank)")
        .draw()?;
    for (name, pick, color) in series {
        let line: Vec<(f64, f64)> = pts
            .iter()
            .filter_map(|p| pick(p).map(|y| (p.tokens as f64, y)))
            .collect();
        if line.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart.draw_series(line.into_iter().map(|q| Circle::new(q, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
