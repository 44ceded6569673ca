//! `--replot FILE`: draws a plot again from its JSON alone, measuring nothing and
//! leaving the JSON as it is: `results.png` (and parity.md and parity.png where it has
//! their rows) from a `results.json` of this benchmark (files of older versions too),
//! or `tp-mlp.png` from the candle example's `tp-mlp.json`
//! (integrations/candle/examples/tp-mlp, whose plot module is compiled here as well). The PNG goes beside the JSON, or into `--out`; for a results.json the
//! closing summary is printed again too.

use std::path::{Path, PathBuf};

use serde::Deserialize;

#[path = "../../integrations/candle/examples/tp-mlp/plot.rs"]
mod tp_mlp_plot;

/// What the candle example's plot reads of its `tp-mlp.json` (its `Report`).
#[derive(Deserialize)]
struct Report {
    ranks: usize,
    gpu_of_rank: Vec<usize>,
    devices: Vec<String>,
    shared_gpus: bool,
    nccl_skipped: Option<String>,
    points: Vec<Point>,
}

/// One point of `tp-mlp.json`, as far as the plot reads it.
#[derive(Deserialize)]
struct Point {
    tokens: usize,
    single_gpu_us: f64,
    compute_only_us: f64,
    peercomm_us: f64,
    nccl_us: Option<f64>,
}

/// Draws the plot of `json` into `out` (default: beside it); returns the PNG's path.
pub fn run(json: &Path, out: Option<&Path>) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(json)?;
    let value: serde_json::Value = serde_json::from_str(&text)?;
    let dir = match out {
        Some(d) => d.to_path_buf(),
        None => json.parent().unwrap_or(Path::new(".")).to_path_buf(),
    };
    std::fs::create_dir_all(&dir)?;
    if value.get("records").is_some() {
        let report: super::Report = serde_json::from_value(value)?;
        print!("{}", super::summary(&report));
        let png = dir.join("results.png");
        super::plot::draw(&report, &png)?;
        if super::parity::any(&report) {
            std::fs::write(dir.join("parity.md"), super::parity::table(&report))?;
            super::parity::draw(&report, &dir.join("parity.png"))?;
        }
        Ok(png)
    } else if value.get("points").is_some() {
        let report: Report = serde_json::from_value(value)?;
        let png = dir.join("tp-mlp.png");
        tp_mlp_plot::draw(&report, &png)?;
        Ok(png)
    } else {
        Err("neither a peercomm-bench results.json (records) nor a tp-mlp.json (points)".into())
    }
}
