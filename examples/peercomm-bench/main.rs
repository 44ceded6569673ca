//! peercomm-bench: all-reduce latency and bandwidth, peercomm against NCCL, in one
//! process and one run.
//!
//! On NVIDIA GPUs (built with `--features cuda`) it sweeps message sizes for bf16 and
//! f32, every group size of the world, each peercomm algorithm (auto and forced) and
//! NCCL, eager and inside CUDA graphs; times with device events after warm-up, takes
//! the median of many batches, rotates input buffers so large data is not served from
//! L2, and checks every configuration's sum before timing it. It also measures the
//! peer copy-engine bandwidth and the cross-GPU flag round trip. Without a GPU it runs
//! the host reference backend (small sizes, no NCCL) and says so.
//!
//! ```text
//! cargo run --release --example peercomm-bench                      # host backend
//! cargo run --release --features cuda --example peercomm-bench      # on GPUs
//! cargo run --release --example peercomm-bench -- --replot results/2026-12-01-h200x2/final/results.json
//! ```
//!
//! What a run shows and leaves behind:
//! - the first line of stdout names the folder the results go to (`--out`, else
//!   `bench-out/<UTC date and time>/`); the folder always receives `results.json`
//!   (every point), `results.csv` (the same, one row per point), `summary.txt` and
//!   `results.png`;
//! - a progress bar on stderr (a line at every tenth of the points when stderr is not a
//!   terminal);
//! - one line per point on stdout; each ratio column has one definition: `lat/nccl`,
//!   `lat/sym`, `lat/floor` are latency ratios (this row's latency over NCCL's, over
//!   NCCL's with symmetric windows, over the link's floor, at the same size and mode;
//!   below 1 is faster), and bus bandwidth has its own column;
//! - a closing summary at the sizes engines all-reduce (`summary.txt`).
//!
//! `--replot FILE` draws `results.png` again from a `results.json` of this benchmark
//! (or `tp-mlp.png` from the candle example's `tp-mlp.json`), measuring nothing and
//! leaving the JSON as it is.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use peercomm::backend::Backend;
use peercomm::{
    Algorithm, AllReduceOptions, CommConfig, DType, Element, ReduceOp, SingleController,
    TensorView, TensorViewMut,
};
use progress::Progress;
use rand::{Rng, SeedableRng};
use serde::Serialize;

#[derive(Parser, Debug, Clone)]
#[command(about = "peercomm all-reduce benchmark against NCCL")]
struct Args {
    /// Smallest message in bytes per rank.
    #[arg(long, default_value_t = 1024)]
    min_bytes: usize,
    /// Largest message in bytes per rank (default: 1 GiB on GPUs, 4 MiB on the host).
    #[arg(long)]
    max_bytes: Option<usize>,
    /// Element types.
    #[arg(long, value_delimiter = ',', default_value = "bf16,f32")]
    dtypes: Vec<String>,
    /// Group sizes to run (default: every divisor of the world).
    #[arg(long, value_delimiter = ',')]
    groups: Option<Vec<usize>>,
    /// Timed batches per point (the median is reported).
    #[arg(long, default_value_t = 15)]
    batches: usize,
    /// Skip the CUDA-graph measurements.
    #[arg(long)]
    no_graph: bool,
    /// Skip NCCL.
    #[arg(long)]
    no_nccl: bool,
    /// Skip the forced algorithms (auto dispatch and NCCL only).
    #[arg(long)]
    auto_only: bool,
    /// The largest Lamport message in bytes (its slot holds it and a 64-byte header).
    #[arg(long, default_value_t = 1 << 20)]
    lamport_slot_bytes: usize,
    /// Upper bound of blocks per launch (default: one per multiprocessor).
    #[arg(long)]
    max_blocks: Option<u32>,
    /// Threads per block.
    #[arg(long, default_value_t = 512)]
    threads: u32,
    /// Explicit message sizes in bytes (instead of the power-of-two sweep).
    #[arg(long, value_delimiter = ',')]
    sizes: Option<Vec<usize>>,
    /// Algorithms to run (auto, one_stage, two_stage, lamport); default all four.
    #[arg(long, value_delimiter = ',')]
    algorithms: Option<Vec<String>>,
    /// Folder for results.json, results.csv, summary.txt and results.png (default:
    /// bench-out/<UTC date and time>/ in the current directory).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Draw the plot of a results.json of this benchmark (or of the candle example's
    /// tp-mlp.json) again, beside it or into --out, without measuring anything.
    #[arg(long, value_name = "JSON")]
    replot: Option<PathBuf>,
    /// Measure the per-rank communicator instead: this many threads, one rank each
    /// (round-robin over the GPUs), against cudarc's NCCL `Comm::from_rank` (bf16,
    /// whole world, up to 1 MiB unless --max-bytes says otherwise).
    #[arg(long)]
    per_rank: Option<usize>,
    /// With --per-rank: also run the single controller over the same ranks (auto
    /// dispatch, the whole world) in the same run and put its records ("peercomm-auto")
    /// in the same report, so that the per-rank paths (staged "peercomm-per-rank-thread"
    /// and zero-copy "peercomm-per-rank-thread-symmetric") compare with it.
    #[arg(long)]
    with_single: bool,
    /// With --per-rank: one process per rank instead of one thread (the benchmark
    /// starts itself once per rank; ranks find each other through a UniqueId).
    #[arg(long)]
    processes: bool,
    /// Also time graphs of (producer kernel, all-reduce) with and without programmatic
    /// dependent launch (`AllReduceOptions::overlap_previous`), f32, up to 16 MiB.
    #[arg(long)]
    overlap: bool,
    /// Also time all-gather, reduce-scatter and broadcast against NCCL's (bf16, up to
    /// 16 MiB), and the fused all-reduce + residual + RMSNorm against the unfused pairs
    /// (examples/peercomm-bench/collectives.rs).
    #[arg(long)]
    collectives: bool,
    /// Also time a group of 8 all-reduces (one batched kernel per rank) against 8
    /// separate calls and against one call (single controller, bf16, graph mode;
    /// examples/peercomm-bench/group.rs).
    #[arg(long)]
    group_calls: bool,
    /// Also print where an eager call's host time goes (event tracking, validation and
    /// planning, launches), before the sweep.
    #[arg(long)]
    host_cost: bool,
    /// Per-rank mode: also time these reduction operators (prod, max, min, avg) beside
    /// the sum, staged, in graph mode, each in turns with the sum batch by batch (rows
    /// `peercomm-per-rank-<op>` and `peercomm-per-rank-<op>-sum`).
    #[arg(long, value_delimiter = ',')]
    ops: Vec<String>,
    /// Per-rank mode: also time all-to-all, all-to-all-v (uneven parts) and a send/recv
    /// ring shift against a device-to-device copy of the same bytes, in graph mode
    /// (examples/peercomm-bench/exchange.rs).
    #[arg(long)]
    exchange: bool,
    /// Per-rank mode: also time the sum over these element types (i8, u8, i32, u32, i64,
    /// u64, f64, f16, bf16) against f32 of the same bytes, staged, in graph mode (rows
    /// `peercomm-per-rank-sum-<type>`; examples/peercomm-bench/types.rs).
    #[arg(long, value_delimiter = ',')]
    sum_types: Vec<String>,
    /// Ranks of the single-controller sweep (default: one per GPU). More ranks than
    /// GPUs share them: a correctness and host-cost check, not a link measurement.
    #[arg(long)]
    world: Option<usize>,
    /// Calls per timed batch, every size, for the single controller's all-reduce sweep
    /// and the per-rank sweep (default: 50 up to 1 MiB, fewer above on the single
    /// controller; 50 per rank). A cost paid once per batch shrinks per call as this
    /// grows; one paid per call does not.
    #[arg(long)]
    batch_calls: Option<usize>,
    /// Opens each timed batch's window on the GPU only after this many microseconds of
    /// device-side wait that follows a barrier of every rank, and closes the wait with
    /// a second barrier (0, the default: no gate). Every rank's batch is then enqueued
    /// before any rank's window opens, and the windows open together: the figure is the
    /// GPU's cost alone, without the host's launch latency or the spread between the
    /// ranks' (threads', processes') launches. The graph rows of the all-reduce
    /// sweeps, single controller and per rank, peercomm's and NCCL's alike (the gate
    /// is peercomm's barrier and wait on the same streams); eager rows are never gated
    /// (their host cost is what they measure).
    #[arg(long, default_value_t = 0)]
    gate_us: u64,
}

/// One measured point.
#[derive(Serialize, serde::Deserialize, Clone, Debug)]
struct Record {
    dtype: String,
    world: usize,
    group: usize,
    bytes: usize,
    /// "peercomm-auto", "peercomm-one_stage", ..., "nccl".
    implementation: String,
    /// Algorithm that ran (the auto dispatch's choice for "peercomm-auto").
    algorithm: String,
    mode: String,
    latency_us: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
    /// Latency over NCCL's in the same mode (lower is better); None without NCCL.
    ratio_vs_nccl: Option<f64>,
    /// Latency over NCCL's with symmetric-window buffers ("nccl-symmetric"), where the
    /// loaded NCCL has them.
    ratio_vs_nccl_symmetric: Option<f64>,
    /// The physical floor of this point from the link measured in the same run:
    /// graph launch + one-way flag latency + the bytes each rank must take in
    /// (bytes x 2(g-1)/g) at the copy-engine bandwidth. None without a link measurement.
    floor_us: Option<f64>,
    /// Latency over the floor (1.0 is the physical limit).
    ratio_vs_floor: Option<f64>,
}

/// A run: what it ran on, the link figures, every point. Files written by older
/// versions lack some fields (`serde(default)`), so `--replot` reads them too.
#[derive(Serialize, serde::Deserialize, Debug, Default)]
#[serde(default)]
struct Report {
    date: String,
    backend: String,
    /// "single-controller SingleController" or "per-rank Comm (threads|processes)".
    api: String,
    /// The device name of each rank.
    devices: Vec<String>,
    /// The device ordinal of each rank (None in files from older versions).
    gpu_of_rank: Option<Vec<usize>>,
    copy_engine_gbps_one_way: Option<f64>,
    copy_engine_gbps_both_ways: Option<f64>,
    flag_round_trip_us: Option<f64>,
    /// Per-launch cost of a near-empty kernel replayed from a CUDA graph (500 launches).
    graph_launch_us: Option<f64>,
    records: Vec<Record>,
}

fn sizes(args: &Args, min: usize, max: usize) -> Vec<usize> {
    if let Some(list) = &args.sizes {
        return list.clone();
    }
    let mut v: Vec<usize> = (0..=40)
        .map(|s| 1usize << s)
        .filter(|&b| b >= min && b <= max)
        .collect();
    // A few odd sizes: they exercise the scalar tail and the partition remainders.
    for odd in [12_345 * 4, 1_000_003 * 4, 33_554_467 * 4] {
        if odd >= min && odd <= max {
            v.push(odd);
        }
    }
    v.sort_unstable();
    v
}

fn parse_dtype(s: &str) -> DType {
    match s {
        "f32" => DType::F32,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        other => panic!("unknown dtype {other} (f32, f16, bf16)"),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn bus_factor(group: usize) -> f64 {
    if group <= 1 {
        1.0
    } else {
        2.0 * (group as f64 - 1.0) / group as f64
    }
}

/// Random data, fresh per run: a random chunk tiled with a random offset per rank
/// (generating gigabytes one value at a time would dominate the run).
fn fill<T: Element>(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<T> {
    let chunk: Vec<T> = (0..(1usize << 20).min(n))
        .map(|_| {
            let m: f32 = rng.random_range(1e-3..1.0);
            T::from_f32(if rng.random::<bool>() { m } else { -m })
        })
        .collect();
    let off = rng.random_range(0..chunk.len());
    (0..n).map(|i| chunk[(i + off) % chunk.len()]).collect()
}

/// Checks a sample (every element up to 4M, else 1M random ones and the tail) of each
/// rank's output against the f64 sums over its group.
fn check<T: Element>(
    ins: &[Vec<T>],
    outs: &[Vec<T>],
    group: usize,
    what: &str,
) -> Result<(), String> {
    let n = ins[0].len();
    let mut rng = rand::rngs::StdRng::seed_from_u64(n as u64);
    let idx: Vec<usize> = if n <= 1 << 22 {
        (0..n).collect()
    } else {
        (0..1 << 20)
            .map(|_| rng.random_range(0..n))
            .chain(n - 1000..n)
            .collect()
    };
    let eps = match T::DTYPE {
        DType::F32 => f32::EPSILON as f64,
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        other => unreachable!("the bench runs f32, f16 and bf16, not {}", other.name()),
    };
    for g in (0..ins.len()).step_by(group) {
        for &e in &idx {
            let (mut sum, mut abs) = (0f64, 0f64);
            for input in &ins[g..g + group] {
                let x = input[e].to_f32() as f64;
                sum += x;
                abs += x.abs();
            }
            let tol = 0.5 * eps * sum.abs() + group as f64 * f32::EPSILON as f64 * abs + 1e-7;
            for (r, out) in outs.iter().enumerate().skip(g).take(group) {
                let got = out[e].to_f32() as f64;
                if !(got - sum).abs().le(&tol) {
                    return Err(format!(
                        "{what}: rank {r} element {e}: got {got}, expected {sum}"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// What each ratio column means, printed above every table of points.
const COLUMNS: &str = "lat/nccl, lat/sym, lat/floor: latency ratios at the same size and mode \
(below 1 is faster): this row's latency over NCCL's, over NCCL's with symmetric windows, over the \
link's floor\nbusbw: bus bandwidth in GB/s, bytes x 2(g-1)/g over the latency";

fn print_header() {
    println!("{COLUMNS}");
    println!(
        "{:>5} {:>5} {:>12} {:>20} {:>10} {:>6} {:>11} {:>10} {:>10} {:>9} {:>9} {:>9}",
        "dtype",
        "group",
        "bytes",
        "implementation",
        "algorithm",
        "mode",
        "latency_us",
        "algbw_GB/s",
        "busbw_GB/s",
        "lat/nccl",
        "lat/sym",
        "lat/floor"
    );
}

fn print_record(r: &Record) {
    println!(
        "{:>5} {:>5} {:>12} {:>20} {:>10} {:>6} {:>11.2} {:>10.2} {:>10.2} {:>9} {:>9} {:>9}",
        r.dtype,
        r.group,
        r.bytes,
        r.implementation,
        r.algorithm,
        r.mode,
        r.latency_us,
        r.algbw_gbps,
        r.busbw_gbps,
        r.ratio_vs_nccl
            .map_or("-".to_string(), |x| format!("{x:.2}")),
        r.ratio_vs_nccl_symmetric
            .map_or("-".to_string(), |x| format!("{x:.2}")),
        r.ratio_vs_floor
            .map_or("-".to_string(), |x| format!("{x:.2}"))
    );
}

/// Where a measurement was taken: element type, world, group width, bytes per rank.
#[derive(Clone, Copy)]
struct At {
    dtype: DType,
    world: usize,
    group: usize,
    bytes: usize,
}

fn record(at: At, imp: &str, alg: &str, mode: &str, us: f64) -> Record {
    let algbw = at.bytes as f64 / (us * 1e-6) / 1e9;
    Record {
        dtype: at.dtype.name().into(),
        world: at.world,
        group: at.group,
        bytes: at.bytes,
        implementation: imp.into(),
        algorithm: alg.into(),
        mode: mode.into(),
        latency_us: us,
        algbw_gbps: algbw,
        busbw_gbps: algbw * bus_factor(at.group),
        ratio_vs_nccl: None,
        ratio_vs_nccl_symmetric: None,
        floor_us: None,
        ratio_vs_floor: None,
    }
}

/// Fills in each record's ratios against NCCL (plain, and with symmetric windows) at
/// the same point and mode.
fn attach_ratios(records: &mut [Record]) {
    let is_nccl = |r: &Record| r.implementation.starts_with("nccl");
    let nccl: Vec<Record> = records.iter().filter(|r| is_nccl(r)).cloned().collect();
    let same = |a: &Record, b: &Record| {
        a.dtype == b.dtype && a.group == b.group && a.bytes == b.bytes && a.mode == b.mode
    };
    // Per-rank NCCL rows carry the mode as a suffix ("nccl-per-rank-thread").
    let kind = |n: &Record| -> String {
        n.implementation
            .replace("-per-rank-thread", "")
            .replace("-per-rank-process", "")
    };
    for r in records.iter_mut().filter(|r| !is_nccl(r)) {
        let ratio = |name: &str| {
            nccl.iter()
                .find(|n| same(n, r) && kind(n) == name)
                .map(|n| n.latency_us)
        };
        let (plain, symmetric) = (ratio("nccl"), ratio("nccl-symmetric"));
        r.ratio_vs_nccl = plain.map(|t| r.latency_us / t);
        r.ratio_vs_nccl_symmetric = symmetric.map(|t| r.latency_us / t);
    }
}

/// The floor of a point of `bytes` per rank over groups of `group`, from the link
/// figures of the same run (None where the run has none, or for a group of one).
fn floor_us(report: &Report, group: usize, bytes: usize) -> Option<f64> {
    let (launch, rtt, gbps) = (
        report.graph_launch_us?,
        report.flag_round_trip_us?,
        report.copy_engine_gbps_one_way?,
    );
    (group > 1).then(|| launch + rtt / 2.0 + bytes as f64 * bus_factor(group) / (gbps * 1e3))
}

/// Fills in each record's floor and its ratio to it.
fn attach_floors(report: &mut Report) {
    for i in 0..report.records.len() {
        // The floor is the all-reduce's; the other collectives' modes ("graph-all_gather")
        // move other byte counts.
        if report.records[i].mode.contains('-') {
            continue;
        }
        let (group, bytes) = (report.records[i].group, report.records[i].bytes);
        if let Some(f) = floor_us(report, group, bytes) {
            let r = &mut report.records[i];
            r.floor_us = Some(f);
            r.ratio_vs_floor = Some(r.latency_us / f);
        }
    }
}

/// "1 KiB", "64 MiB", "12.1 KiB": a byte count for people.
fn human_bytes(bytes: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if (v - v.round()).abs() < 1e-9 {
        format!("{} {}", v.round(), units[u])
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// The folder of a run without `--out`: bench-out/<UTC date and time>/ (a suffix when
/// a folder of that second exists already).
fn default_out() -> PathBuf {
    let (date, time) = utc_now();
    let base = Path::new("bench-out").join(format!("{date}_{time}"));
    let mut dir = base.clone();
    let mut n = 2;
    while dir.exists() {
        dir = PathBuf::from(format!("{}-{n}", base.display()));
        n += 1;
    }
    dir
}

/// results.json, results.csv, summary.txt and results.png into `dir`.
fn write_outputs(dir: &Path, report: &Report, summary: &str) {
    std::fs::create_dir_all(dir).expect("create the output folder");
    let json = serde_json::to_string_pretty(report).unwrap();
    std::fs::write(dir.join("results.json"), json).expect("write results.json");
    std::fs::write(dir.join("results.csv"), csv(report)).expect("write results.csv");
    std::fs::write(dir.join("summary.txt"), summary).expect("write summary.txt");
    if parity::any(report) {
        std::fs::write(dir.join("parity.md"), parity::table(report)).expect("write parity.md");
        if let Err(e) = parity::draw(report, &dir.join("parity.png")) {
            println!("the parity plot failed: {e}");
        }
        println!("wrote {0}/parity.md and {0}/parity.png", dir.display());
    }
    match plot::draw(report, &dir.join("results.png")) {
        Ok(()) => println!(
            "wrote {0}/results.json, {0}/results.csv, {0}/summary.txt and {0}/results.png",
            dir.display()
        ),
        Err(e) => println!(
            "wrote {0}/results.json, {0}/results.csv and {0}/summary.txt; the plot failed: {e}",
            dir.display()
        ),
    }
}

/// Every point, one row each; the ratio columns are latency ratios (see [`COLUMNS`]).
fn csv(report: &Report) -> String {
    let opt = |x: Option<f64>| x.map_or(String::new(), |v| format!("{v}"));
    let mut out = String::from(
        "dtype,world,group,bytes,implementation,algorithm,mode,latency_us,algbw_gbps,busbw_gbps,\
         latency_ratio_vs_nccl,latency_ratio_vs_nccl_symmetric,floor_us,latency_ratio_vs_floor\n",
    );
    for r in &report.records {
        writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.dtype,
            r.world,
            r.group,
            r.bytes,
            r.implementation,
            r.algorithm,
            r.mode,
            r.latency_us,
            r.algbw_gbps,
            r.busbw_gbps,
            opt(r.ratio_vs_nccl),
            opt(r.ratio_vs_nccl_symmetric),
            opt(r.floor_us),
            opt(r.ratio_vs_floor)
        )
        .unwrap();
    }
    out
}

/// The API a report's all-reduce went through (older files do not say: their
/// implementation names do).
fn api_of(report: &Report) -> String {
    if !report.api.is_empty() {
        report.api.clone()
    } else if report
        .records
        .iter()
        .any(|r| r.implementation.starts_with("peercomm-per-rank"))
    {
        "per-rank Comm".into()
    } else {
        "single-controller SingleController".into()
    }
}

/// The machine as the run knows it: ranks, devices, and whether ranks share one.
fn machine_of(report: &Report) -> String {
    let world = report
        .records
        .first()
        .map_or(report.devices.len(), |r| r.world);
    if report.backend == "host" {
        return format!("{world} ranks on the host reference backend (CPU threads, no GPU)");
    }
    let name = report.devices.first().map_or("?", String::as_str);
    match &report.gpu_of_rank {
        Some(gpus) => {
            let mut distinct = gpus.clone();
            distinct.sort_unstable();
            distinct.dedup();
            match distinct.len() {
                n if n == world && world == 1 => format!("1 {name}"),
                n if n == world => format!("{world} x {name} (one GPU per rank)"),
                1 => format!("{world} ranks sharing one {name}"),
                n => format!("{world} ranks sharing {n} x {name}"),
            }
        }
        // Files from before gpu_of_rank: the link figures are measured only between
        // ranks on different GPUs.
        None if report.copy_engine_gbps_one_way.is_some() => {
            format!("{world} x {name} (one GPU per rank)")
        }
        None => format!("{world} ranks on {name} (the file does not say how many GPUs)"),
    }
}

/// Whether ranks of this run share a GPU (timings then say nothing about a link).
fn shares_gpus(report: &Report) -> bool {
    report.gpu_of_rank.as_ref().is_some_and(|gpus| {
        let mut distinct = gpus.clone();
        distinct.sort_unstable();
        distinct.dedup();
        distinct.len() < gpus.len()
    }) && report.backend != "host"
}

/// The all-reduce sizes of engines: hidden 4096 in bf16 (a Llama-3-8B layer, the candle
/// example's shape) at 1, 8, 32 and 128 tokens (decode) and 2048 (prefill).
const ENGINE_SIZES: [usize; 5] = [8 << 10, 64 << 10, 256 << 10, 1 << 20, 16 << 20];

/// The closing summary: per dtype and mode, peercomm's all-reduce over the whole world
/// at the engine sizes against NCCL, NCCL with symmetric windows and the floor.
fn summary(report: &Report) -> String {
    let mut out = String::new();
    let world = report.records.first().map_or(0, |r| r.world);
    let plain_mode = |r: &Record| r.mode == "eager" || r.mode == "graph";
    let is_ours = |r: &Record| {
        r.implementation == "peercomm-auto" || r.implementation.starts_with("peercomm-per-rank")
    };
    let ours: Vec<&Record> = report
        .records
        .iter()
        .filter(|r| is_ours(r) && plain_mode(r) && r.group == world)
        .collect();
    writeln!(
        out,
        "summary: all-reduce over the whole world, {}, {}",
        api_of(report),
        machine_of(report)
    )
    .unwrap();
    if ours.is_empty() {
        writeln!(out, "(no whole-world all-reduce in this run)").unwrap();
        return out;
    }
    let engine: Vec<&Record> = ours
        .iter()
        .copied()
        .filter(|r| ENGINE_SIZES.contains(&r.bytes))
        .collect();
    let rows = if engine.is_empty() {
        writeln!(out, "(none of the engine sizes ran: every size of the run)").unwrap();
        ours
    } else {
        writeln!(
            out,
            "at the sizes engines all-reduce per rank: hidden 4096 in bf16 at 1, 8, 32, 128 \
             tokens (decode: 8 KiB, 64 KiB, 256 KiB, 1 MiB) and 2048 (prefill: 16 MiB)"
        )
        .unwrap();
        engine
    };
    if !report
        .records
        .iter()
        .any(|r| r.implementation.starts_with("nccl"))
    {
        writeln!(
            out,
            "no NCCL in this run (host backend, ranks sharing a GPU, or --no-nccl): its columns are empty"
        )
        .unwrap();
    }
    if shares_gpus(report) {
        writeln!(
            out,
            "ranks share a GPU: every rank's kernels run on one GPU, so these timings say nothing about a link"
        )
        .unwrap();
    }
    writeln!(out, "{COLUMNS}").unwrap();
    writeln!(
        out,
        "{:>5} {:>5} {:>9} {:>34} {:>11} {:>9} {:>9} {:>11} {:>9} {:>9} {:>9} {:>15} {:>11}",
        "dtype",
        "mode",
        "bytes",
        "implementation",
        "peercomm_us",
        "nccl_us",
        "lat/nccl",
        "nccl_sym_us",
        "lat/sym",
        "floor_us",
        "lat/floor",
        "peercomm_busbw",
        "nccl_busbw"
    )
    .unwrap();
    let f2 = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
    let bw = |x: Option<f64>| {
        x.map_or("-".to_string(), |v| {
            if v < 10.0 {
                format!("{v:.2}")
            } else {
                format!("{v:.1}")
            }
        })
    };
    let mut rows = rows;
    rows.sort_by(|a, b| {
        (&a.dtype, &a.mode, a.bytes, &a.implementation).cmp(&(
            &b.dtype,
            &b.mode,
            b.bytes,
            &b.implementation,
        ))
    });
    for r in rows {
        let partner = |name: &str| {
            report.records.iter().find(|n| {
                n.dtype == r.dtype
                    && n.group == r.group
                    && n.bytes == r.bytes
                    && n.mode == r.mode
                    && n.implementation
                        .replace("-per-rank-thread", "")
                        .replace("-per-rank-process", "")
                        == name
            })
        };
        let (nccl, sym) = (partner("nccl"), partner("nccl-symmetric"));
        writeln!(
            out,
            "{:>5} {:>5} {:>9} {:>34} {:>11.2} {:>9} {:>9} {:>11} {:>9} {:>9} {:>9} {:>15} {:>11}",
            r.dtype,
            r.mode,
            human_bytes(r.bytes as f64),
            r.implementation,
            r.latency_us,
            f2(nccl.map(|n| n.latency_us)),
            f2(r.ratio_vs_nccl),
            f2(sym.map(|n| n.latency_us)),
            f2(r.ratio_vs_nccl_symmetric),
            f2(r.floor_us),
            f2(r.ratio_vs_floor),
            bw(Some(r.busbw_gbps)),
            bw(nccl.map(|n| n.busbw_gbps))
        )
        .unwrap();
    }
    writeln!(out, "(times in us, bus bandwidth in GB/s)").unwrap();
    out
}

fn algorithms(args: &Args) -> Vec<Algorithm> {
    if let Some(names) = &args.algorithms {
        return names
            .iter()
            .map(|n| match n.as_str() {
                "auto" => Algorithm::Auto,
                "one_stage" => Algorithm::OneStage,
                "two_stage" => Algorithm::TwoStage,
                "lamport" => Algorithm::Lamport,
                other => panic!("unknown algorithm {other}"),
            })
            .collect();
    }
    if args.auto_only {
        vec![Algorithm::Auto]
    } else {
        vec![
            Algorithm::Auto,
            Algorithm::OneStage,
            Algorithm::TwoStage,
            Algorithm::Lamport,
        ]
    }
}

fn group_list(args: &Args, world: usize) -> Vec<usize> {
    args.groups.clone().unwrap_or_else(|| {
        (1..=world)
            .rev()
            .filter(|g| world.is_multiple_of(*g))
            .collect()
    })
}

// ---------------------------------------------------------------------------------
// Host backend (no GPU): the same sweep at small sizes, timed with the wall clock.

fn run_host(args: &Args, why: &str) -> Report {
    use peercomm::backend::host::Host;
    println!("no GPU ({why}): running the host reference backend (CPU threads), no NCCL");
    let world = 2;
    let max = args.max_bytes.unwrap_or(4 << 20);
    let config = CommConfig::default()
        .with_payload_bytes(max)
        // The slot holds the largest Lamport message and its 64-byte header.
        .with_lamport_slot_bytes(args.lamport_slot_bytes + 64);
    let comm = SingleController::<Host>::new(&[0, 1], config).expect("host communicator");
    let mut report = Report {
        date: chrono_free_date(),
        backend: "host".into(),
        api: "single-controller SingleController".into(),
        devices: vec!["host arena 0".into(), "host arena 1".into()],
        gpu_of_rank: Some(vec![0, 1]),
        ..Report::default()
    };
    let mut rng = rand::rngs::StdRng::from_os_rng();
    let groups = group_list(args, world);
    let sizes = sizes(args, args.min_bytes, max);
    let algorithms = algorithms(args);
    let mut progress = Progress::new(
        args.dtypes.len() * groups.len() * sizes.len() * algorithms.len(),
        "all-reduce sweep (host)",
    );
    print_header();
    for dt in &args.dtypes {
        let dtype = parse_dtype(dt);
        for &group in &groups {
            for &bytes in &sizes {
                for &alg in &algorithms {
                    progress.set_message(format!(
                        "{dt} group {group} {} {}",
                        human_bytes(bytes as f64),
                        alg.name()
                    ));
                    let r = match dtype {
                        DType::F32 => {
                            host_point::<f32>(&comm, &mut rng, alg, group, bytes, args.batches)
                        }
                        DType::F16 => host_point::<half::f16>(
                            &comm,
                            &mut rng,
                            alg,
                            group,
                            bytes,
                            args.batches,
                        ),
                        DType::BF16 => host_point::<half::bf16>(
                            &comm,
                            &mut rng,
                            alg,
                            group,
                            bytes,
                            args.batches,
                        ),
                        other => unreachable!("parse_dtype gives f32, f16 or bf16, not {other:?}"),
                    };
                    if let Some(r) = r {
                        progress.suspend(|| print_record(&r));
                        report.records.push(r);
                    }
                    progress.inc();
                }
            }
        }
    }
    progress.finish();
    report
}

fn host_point<T: Element>(
    comm: &SingleController<peercomm::backend::host::Host>,
    rng: &mut rand::rngs::StdRng,
    alg: Algorithm,
    group: usize,
    bytes: usize,
    batches: usize,
) -> Option<Record> {
    use peercomm::backend::host::Host;
    let n = bytes / T::DTYPE.size();
    let world = comm.world_size();
    let ins: Vec<Vec<T>> = (0..world).map(|_| fill::<T>(rng, n)).collect();
    let mut ib: Vec<_> = comm
        .cores()
        .iter()
        .map(|r| Host::alloc_buffer::<T>(r.device(), n).unwrap())
        .collect();
    let mut ob: Vec<_> = comm
        .cores()
        .iter()
        .map(|r| Host::alloc_buffer::<T>(r.device(), n).unwrap())
        .collect();
    for (r, rank) in comm.cores().iter().enumerate() {
        Host::upload(rank.device(), &ins[r], &mut ib[r]).unwrap();
        Host::upload(rank.device(), &vec![T::from_f32(f32::NAN); n], &mut ob[r]).unwrap();
    }
    let opts = AllReduceOptions::new().group_size(group).algorithm(alg);
    let run = |ob: &mut Vec<<Host as Backend>::Buffer<T>>| {
        let it: Vec<TensorView<Host>> = ib.iter().map(|b| TensorView::flat(b)).collect();
        let mut ot: Vec<TensorViewMut<Host>> =
            ob.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
        comm.all_reduce(&it, &mut ot, &ReduceOp::Sum, &opts)
    };
    let ran = run(&mut ob).ok()?;
    comm.synchronize().unwrap();
    let outs: Vec<Vec<T>> = comm
        .cores()
        .iter()
        .zip(&ob)
        .map(|(r, b)| Host::download(r.device(), b).unwrap())
        .collect();
    check(&ins, &outs, group, "host").expect("wrong sum");
    let iters = 5;
    let samples: Vec<f64> = (0..batches.min(7))
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                run(&mut ob).unwrap();
            }
            comm.synchronize().unwrap();
            t.elapsed().as_secs_f64() * 1e6 / iters as f64
        })
        .collect();
    let imp = format!("peercomm-{}", alg.name());
    Some(record(
        At {
            dtype: T::DTYPE,
            world,
            group,
            bytes,
        },
        &imp,
        ran.name(),
        "eager",
        median(samples),
    ))
}

/// Today's date (UTC) from the system clock, without a date crate.
fn chrono_free_date() -> String {
    utc_now().0
}

/// (date, time): "2026-12-01" and "09-30-00" (UTC) from the system clock.
fn utc_now() -> (String, String) {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let days = secs.div_euclid(86_400);
    let of_day = secs.rem_euclid(86_400);
    // Civil-from-days (proleptic Gregorian), after H. Hinnant's well-known derivation.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (
        format!("{y:04}-{m:02}-{d:02}"),
        format!(
            "{:02}-{:02}-{:02}",
            of_day / 3600,
            of_day / 60 % 60,
            of_day % 60
        ),
    )
}

#[cfg(feature = "cuda")]
mod collectives;
#[cfg(feature = "cuda")]
mod exchange;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
mod group;
#[cfg(feature = "cuda")]
mod host_cost;
#[cfg(feature = "cuda")]
mod nccl_symmetric;
#[cfg(feature = "cuda")]
mod overlap;
#[cfg(feature = "cuda")]
mod per_rank;
#[cfg(feature = "cuda")]
mod types;

// Also compiled inside `replot`, through the candle example's plot (which includes it
// by path), so that its plot is checked and drawn here: two copies, on purpose.
#[allow(clippy::duplicate_mod)]
mod chart;
mod parity;
mod plot;

mod progress;
mod replot;

/// Set in the rank processes of `--per-rank N --processes` (their rank): they print and
/// write nothing of their own.
const CHILD_RANK: &str = "PEERCOMM_BENCH_CHILD_RANK";

fn main() {
    let args = Args::parse();
    if let Some(json) = &args.replot {
        match replot::run(json, args.out.as_deref()) {
            Ok(png) => println!(
                "peercomm-bench: drew {} from {}",
                png.display(),
                json.display()
            ),
            Err(e) => {
                eprintln!("peercomm-bench: --replot {}: {e}", json.display());
                std::process::exit(1);
            }
        }
        return;
    }
    let out = args.out.clone().unwrap_or_else(default_out);
    if std::env::var_os(CHILD_RANK).is_none() {
        println!(
            "peercomm-bench: results go to {}/ (results.json, results.csv, summary.txt, results.png)",
            out.display()
        );
    }
    #[cfg(feature = "cuda")]
    let mut report = match peercomm::backend::cuda::Cuda::device_count() {
        Ok(n) if n >= 1 && args.per_rank.is_some() => {
            let world = args.per_rank.unwrap();
            // The single controller first (its memory is freed before the ranks start).
            let single = args.with_single.then(|| {
                let single_args = Args {
                    auto_only: true,
                    no_nccl: true,
                    groups: Some(vec![world]),
                    dtypes: vec!["bf16".into()],
                    ..args.clone()
                };
                gpu::run(&single_args, world.min(peercomm::MAX_GPUS), n).records
            });
            let mut report = per_rank::report(&args, world, n);
            if let Some(single) = single {
                report.api = format!("{} and single-controller SingleController", report.api);
                report.records.extend(single);
            }
            report
        }
        Ok(n) if n >= 1 => gpu::run(&args, args.world.unwrap_or(n).min(peercomm::MAX_GPUS), n),
        Ok(_) => run_host(&args, "no CUDA device"),
        Err(e) => run_host(&args, &e.to_string()),
    };
    #[cfg(not(feature = "cuda"))]
    let mut report = run_host(&args, "built without the `cuda` feature");
    attach_ratios(&mut report.records);
    attach_floors(&mut report);
    let summary = summary(&report);
    println!("\n{summary}");
    write_outputs(&out, &report, &summary);
}
