//! A tensor-parallel MLP block shaped like Llama-3-8B's (hidden 4096, intermediate 14336,
//! bf16) in candle, one thread per rank, or with `--processes` one process per rank (as
//! engines run one process per GPU): column-parallel gate and up projections, SiLU,
//! row-parallel down projection, then an all-reduce of the `[tokens, 4096]` partial sums,
//! through cudarc's NCCL `Comm::from_rank` and through peercomm's per-rank `Comm`, in the
//! same run. Decode batches of 1, 8, 32 and 128 tokens and a 2048-token prefill by
//! default; prints a table and writes `tp-mlp.json` and `tp-mlp.png` under `--out`.
//!
//! Per block, the slowest rank's mean time over `--iters` eager iterations (the median of
//! `--rounds` rounds), for: the whole block on one GPU (no parallelism), the rank's share
//! of the block without the all-reduce, the block with each all-reduce, and each
//! all-reduce alone at the block's size. Each output is checked against the single-GPU
//! block (bf16 tolerance, `peercomm_candle::mlp::Comparison`).
//!
//! More ranks than GPUs (e.g. `--ranks 2` on one GPU) share GPUs through peercomm's
//! `CommConfig::allow_shared_devices`; NCCL refuses two ranks on one GPU, so its columns
//! are skipped there, with the reason printed and recorded.
//!
//! With `--processes` the example starts itself once per rank (`std::env::current_exe()`,
//! the same arguments), handing each process its rank, peercomm's `UniqueId` and NCCL's id
//! through the environment, never the command line (the ids hold secrets); each rank
//! process prints its measurements as one JSON line, which the launcher merges
//! (`processes.rs`).

mod plot;
mod processes;

use std::sync::{Arc, Barrier};
use std::time::Instant;

use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Storage, Tensor};
use clap::Parser;
use cudarc::nccl::{Comm as NcclComm, Id as NcclId, ReduceOp};
use half::bf16;
use peercomm::bootstrap::UniqueId;
use peercomm_candle::mlp::{random_input, Comparison, Mlp, MlpShape};
use peercomm_candle::{AllReduceOptions, CandleComm, CommConfig};
use serde::Serialize;

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Parser, Debug)]
#[command(about = "Tensor-parallel Llama-3-8B MLP block in candle: NCCL against peercomm")]
struct Args {
    /// Folder for tp-mlp.json and tp-mlp.png.
    #[arg(long, default_value = "results/candle-tp")]
    out: std::path::PathBuf,
    /// Ranks (threads, or processes with --processes); rank r runs on GPU r % gpus.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// GPUs to use (default: every visible one, at most --ranks).
    #[arg(long)]
    gpus: Option<usize>,
    /// Tokens per block: decode batches and the prefill.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128,2048")]
    tokens: Vec<usize>,
    /// Timed iterations per round.
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// Untimed iterations before each round.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Rounds (the median round is reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Leave NCCL out.
    #[arg(long)]
    no_nccl: bool,
    /// One process per rank (the example starts itself once per rank) instead of one
    /// thread per rank.
    #[arg(long)]
    processes: bool,
}

/// One measured point (times in microseconds per block, slowest rank).
#[derive(Serialize, Clone, Debug, Default)]
struct Point {
    tokens: usize,
    /// Bytes each rank all-reduces: tokens x hidden x 2.
    allreduce_bytes: usize,
    single_gpu_us: f64,
    compute_only_us: f64,
    peercomm_us: f64,
    nccl_us: Option<f64>,
    peercomm_allreduce_us: f64,
    nccl_allreduce_us: Option<f64>,
    /// The algorithm peercomm's dispatch picked.
    peercomm_algorithm: String,
    /// max |tp - single GPU| / rms(single GPU), and whether every element is within the
    /// bf16 tolerance.
    peercomm_max_err_over_rms: f64,
    peercomm_within_tolerance: bool,
    nccl_max_err_over_rms: Option<f64>,
    nccl_within_tolerance: Option<bool>,
}

#[derive(Serialize, Debug)]
struct Report {
    block: &'static str,
    hidden: usize,
    intermediate: usize,
    dtype: &'static str,
    ranks: usize,
    gpu_of_rank: Vec<usize>,
    devices: Vec<String>,
    shared_gpus: bool,
    nccl_skipped: Option<String>,
    iters: usize,
    warmup: usize,
    rounds: usize,
    mode: &'static str,
    points: Vec<Point>,
}

/// Where the ranks run and what they compute: the same in the launcher and in every
/// rank's process.
struct Setup {
    gpus: usize,
    gpu_of_rank: Vec<usize>,
    shared: bool,
    nccl_skipped: Option<String>,
    config: CommConfig,
    weights: Arc<Mlp>,
    inputs: Vec<Tensor>,
}

fn setup(args: &Args) -> BoxResult<Setup> {
    let visible = cudarc::driver::CudaContext::device_count()
        .map_err(|e| format!("no CUDA driver or device: {e}"))? as usize;
    if visible == 0 || args.ranks == 0 {
        return Err("needs at least one GPU and one rank".into());
    }
    let gpus = args
        .gpus
        .unwrap_or(visible)
        .min(visible)
        .min(args.ranks)
        .max(1);
    let gpu_of_rank: Vec<usize> = (0..args.ranks).map(|r| r % gpus).collect();
    let shared = gpus < args.ranks;
    let nccl_skipped = if args.no_nccl {
        Some("--no-nccl".to_string())
    } else if shared {
        Some(format!(
            "{} ranks on {gpus} GPU(s): NCCL refuses two ranks on one GPU (peercomm runs them with allow_shared_devices)",
            args.ranks
        ))
    } else {
        None
    };
    let shape = MlpShape::LLAMA3_8B;
    if !shape.intermediate.is_multiple_of(args.ranks) {
        return Err(format!(
            "{} ranks do not divide {} channels",
            args.ranks, shape.intermediate
        )
        .into());
    }
    let weights = Arc::new(Mlp::random(shape, DType::BF16, 7, &Device::Cpu)?);
    let inputs: Vec<Tensor> = args
        .tokens
        .iter()
        .map(|&t| random_input(t, shape.hidden, DType::BF16, 100 + t as u64, &Device::Cpu))
        .collect::<Result<_, _>>()?;
    Ok(Setup {
        gpus,
        gpu_of_rank,
        shared,
        nccl_skipped,
        config: CommConfig::default().with_allow_shared_devices(shared),
        weights,
        inputs,
    })
}

fn main() -> BoxResult<()> {
    let args = Args::parse();
    if let Some(rank) = processes::rank_of_this_process()? {
        return processes::rank_main(&args, rank);
    }
    let Setup {
        gpus,
        gpu_of_rank,
        shared,
        nccl_skipped,
        config,
        weights,
        inputs,
    } = setup(&args)?;
    if let Some(why) = &nccl_skipped {
        println!("NCCL column skipped: {why}");
    }
    let shape = MlpShape::LLAMA3_8B;
    let devices: Vec<String> = (0..gpus)
        .map(|g| {
            cudarc::driver::CudaContext::new(g)
                .and_then(|c| c.name())
                .unwrap_or_default()
        })
        .collect();
    println!(
        "Llama-3-8B MLP block, bf16, {} ranks on GPUs {gpu_of_rank:?} ({}), one {} per rank",
        args.ranks,
        devices.join(", "),
        if args.processes { "process" } else { "thread" }
    );

    // The whole block on GPU 0: the reference outputs and the no-parallelism time.
    let (reference, single_us) = single_gpu(&weights, &inputs, &args)?;

    let id = UniqueId::new()?;
    let nccl_id = if nccl_skipped.is_none() {
        Some(NcclId::new().map_err(|e| format!("NCCL unique id: {e:?}"))?)
    } else {
        None
    };
    let per_rank: Vec<Vec<RankPoint>> = if args.processes {
        processes::launch(&args, &id, nccl_id.as_ref(), &reference)?
    } else {
        let data = (&*weights, &inputs[..], &reference[..]);
        run_threads(&args, &gpu_of_rank, data, (&id, nccl_id), &config)?
    };

    let points: Vec<Point> = (0..args.tokens.len())
        .map(|k| {
            merge(
                args.tokens[k],
                shape.hidden,
                single_us[k],
                per_rank.iter().map(|r| &r[k]),
            )
        })
        .collect();
    print_table(&points);
    let report = Report {
        block: "Llama-3-8B MLP (gate/up column-parallel, SiLU, down row-parallel, all-reduce)",
        hidden: shape.hidden,
        intermediate: shape.intermediate,
        dtype: "bf16",
        ranks: args.ranks,
        gpu_of_rank,
        devices,
        shared_gpus: shared,
        nccl_skipped,
        iters: args.iters,
        warmup: args.warmup,
        rounds: args.rounds,
        mode: if args.processes {
            "eager, one process per rank, slowest rank's mean per block, median round"
        } else {
            "eager, one thread per rank, slowest rank's mean per block, median round"
        },
        points,
    };
    std::fs::create_dir_all(&args.out)?;
    let json = args.out.join("tp-mlp.json");
    std::fs::write(&json, serde_json::to_string_pretty(&report)?)?;
    println!("wrote {}", json.display());
    let png = args.out.join("tp-mlp.png");
    match plot::draw(&report, &png) {
        Ok(()) => println!("wrote {}", png.display()),
        Err(e) => println!("no plot: {e}"),
    }
    let bad = report
        .points
        .iter()
        .any(|p| !p.peercomm_within_tolerance || p.nccl_within_tolerance == Some(false));
    if bad {
        return Err("an output is outside the bf16 tolerance of the single-GPU block".into());
    }
    Ok(())
}

/// Every rank in a thread of this process.
fn run_threads(
    args: &Args,
    gpu_of_rank: &[usize],
    (weights, inputs, reference): (&Mlp, &[Tensor], &[Tensor]),
    (id, nccl_id): (&UniqueId, Option<NcclId>),
    config: &CommConfig,
) -> BoxResult<Vec<Vec<RankPoint>>> {
    let barrier = Barrier::new(args.ranks);
    std::thread::scope(|s| {
        let workers: Vec<_> = gpu_of_rank
            .iter()
            .enumerate()
            .map(|(rank, &gpu)| {
                let ctx = RankCtx {
                    rank,
                    gpu,
                    world: args.ranks,
                    weights,
                    inputs,
                    reference,
                    id,
                    nccl_id,
                    config: config.clone(),
                    sync: Rendezvous::Threads(&barrier),
                    args,
                };
                s.spawn(move || run_rank(ctx))
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a rank panicked"))
            .collect::<BoxResult<Vec<_>>>()
    })
}

/// Runs the whole block on GPU 0: reference outputs (on the host) and times per block.
fn single_gpu(weights: &Mlp, inputs: &[Tensor], args: &Args) -> BoxResult<(Vec<Tensor>, Vec<f64>)> {
    let dev = Device::new_cuda_with_stream(0)?;
    let full = weights.shard(0, 1, &dev)?;
    let mut reference = vec![];
    let mut times = vec![];
    for x in inputs {
        let x = x.to_device(&dev)?;
        reference.push(full.forward(&x)?.to_device(&Device::Cpu)?);
        let mut rounds = vec![];
        for _ in 0..args.rounds {
            rounds.push(time(&dev, args, || {
                full.forward(&x)?;
                Ok(())
            })?);
        }
        times.push(median(rounds));
    }
    Ok((reference, times))
}

/// What one rank's thread needs.
struct RankCtx<'a> {
    rank: usize,
    gpu: usize,
    world: usize,
    weights: &'a Mlp,
    inputs: &'a [Tensor],
    reference: &'a [Tensor],
    id: &'a UniqueId,
    nccl_id: Option<NcclId>,
    config: CommConfig,
    sync: Rendezvous<'a>,
    args: &'a Args,
}

/// How the ranks wait for each other between measurements.
enum Rendezvous<'a> {
    /// Ranks in threads of this process.
    Threads(&'a Barrier),
    /// Ranks in processes of their own: a peercomm barrier on the stream, then a wait
    /// for it (every rank has then reached the same point).
    Processes,
}

impl RankCtx<'_> {
    /// Waits until every rank gets here.
    fn wait(&self, comm: &CandleComm) -> BoxResult<()> {
        match self.sync {
            Rendezvous::Threads(barrier) => {
                barrier.wait();
            }
            Rendezvous::Processes => {
                comm.comm().barrier(0)?;
                comm.synchronize()?;
            }
        }
        Ok(())
    }
}

/// One rank's measurements at one size (a JSON line from a rank's process).
#[derive(Default, Serialize, serde::Deserialize)]
struct RankPoint {
    compute_us: f64,
    peercomm_us: f64,
    nccl_us: Option<f64>,
    peercomm_ar_us: f64,
    nccl_ar_us: Option<f64>,
    algorithm: String,
    peercomm_check: Option<Check>,
    nccl_check: Option<Check>,
}

/// A [`Comparison`] with the rank's verdict.
#[derive(Clone, Copy, Serialize, serde::Deserialize)]
struct Check {
    max_abs: f64,
    rms: f64,
    passes: bool,
}

impl From<Comparison> for Check {
    fn from(c: Comparison) -> Self {
        Check {
            max_abs: c.max_abs,
            rms: c.rms,
            passes: c.passes(),
        }
    }
}

fn run_rank(c: RankCtx<'_>) -> BoxResult<Vec<RankPoint>> {
    let dev = Device::new_cuda_with_stream(c.gpu)?;
    let comm = CandleComm::from_rank(&dev, c.rank, c.world, c.id, c.config.clone())?;
    let nccl = match c.nccl_id {
        Some(id) => Some(
            NcclComm::from_rank(dev.as_cuda_device()?.cuda_stream(), c.rank, c.world, id)
                .map_err(|e| format!("rank {}: NCCL Comm::from_rank: {e:?}", c.rank))?,
        ),
        None => None,
    };
    let shard = c.weights.shard(c.rank, c.world, &dev)?;
    let opts = AllReduceOptions::new();
    // Ranks sharing a GPU share its context, and a first use of a kernel (candle and
    // cuBLAS load modules lazily) can wait for the whole context, including a peer's
    // collective that spins waiting for this rank. So every rank runs everything but
    // the collectives once, at every size, before any rank starts one.
    for (k, x) in c.inputs.iter().enumerate() {
        let partial = shard.forward(&x.to_device(&dev)?)?;
        Comparison::new(&partial.copy()?, &c.reference[k])?;
    }
    dev.synchronize()?;
    c.wait(&comm)?;
    let mut out = vec![];
    for (k, x) in c.inputs.iter().enumerate() {
        let x = x.to_device(&dev)?;
        let partial = shard.forward(&x)?;
        let mut p = RankPoint::default();

        // Correctness first (one block each), then the timings.
        let y = comm.all_reduce_sum(&partial, &opts)?;
        p.algorithm = format!(
            "{:?}",
            comm.all_reduce_sum_in_place(&partial.copy()?, &opts)?
        );
        comm.synchronize()?;
        p.peercomm_check = Some(Comparison::new(&y, &c.reference[k])?.into());
        if let Some(nccl) = &nccl {
            let y = nccl_all_reduce(nccl, &partial)?;
            p.nccl_check = Some(Comparison::new(&y, &c.reference[k])?.into());
        }

        let mut rounds: Vec<[f64; 5]> = vec![];
        for _ in 0..c.args.rounds {
            let mut r = [f64::NAN; 5];
            r[0] = timed(&c, &comm, &dev, || {
                shard.forward(&x)?;
                Ok(())
            })?;
            r[1] = timed(&c, &comm, &dev, || {
                comm.all_reduce_sum(&shard.forward(&x)?, &opts)?;
                Ok(())
            })?;
            r[2] = timed(&c, &comm, &dev, || {
                comm.all_reduce_sum(&partial, &opts)?;
                Ok(())
            })?;
            if let Some(nccl) = &nccl {
                r[3] = timed(&c, &comm, &dev, || {
                    nccl_all_reduce(nccl, &shard.forward(&x)?)?;
                    Ok(())
                })?;
                r[4] = timed(&c, &comm, &dev, || {
                    nccl_all_reduce(nccl, &partial)?;
                    Ok(())
                })?;
            }
            rounds.push(r);
        }
        comm.synchronize()?;
        let col = |i: usize| median(rounds.iter().map(|r| r[i]).collect());
        p.compute_us = col(0);
        p.peercomm_us = col(1);
        p.peercomm_ar_us = col(2);
        if nccl.is_some() {
            p.nccl_us = Some(col(3));
            p.nccl_ar_us = Some(col(4));
        }
        out.push(p);
    }
    Ok(out)
}

/// The same all-reduce through cudarc's NCCL communicator, out of place, on the rank's
/// candle stream (bf16).
fn nccl_all_reduce(nccl: &NcclComm, t: &Tensor) -> BoxResult<Tensor> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err("not a CUDA tensor".into());
    };
    let CudaStorageSlice::BF16(slice) = &cuda.slice else {
        return Err("the example all-reduces bf16".into());
    };
    let (start, end) = layout.contiguous_offsets().ok_or("not contiguous")?;
    // SAFETY: NCCL writes every element before later work on this stream reads it.
    let mut out = unsafe { cuda.device.alloc::<bf16>(end - start) }?;
    nccl.all_reduce(&slice.slice(start..end), &mut out, &ReduceOp::Sum)
        .map_err(|e| format!("ncclAllReduce: {e:?}"))?;
    let out = CudaStorage::wrap_cuda_slice(out, cuda.device.clone());
    Ok(Tensor::from_storage(
        Storage::Cuda(out),
        layout.shape().clone(),
        BackpropOp::none(),
        false,
    ))
}

/// Mean microseconds per call of `f` on this rank, every rank starting together.
fn timed(
    c: &RankCtx<'_>,
    comm: &CandleComm,
    dev: &Device,
    mut f: impl FnMut() -> BoxResult<()>,
) -> BoxResult<f64> {
    // No rank starts a collective while another still works alone (see run_rank).
    dev.synchronize()?;
    c.wait(comm)?;
    for _ in 0..c.args.warmup {
        f()?;
    }
    dev.synchronize()?;
    c.wait(comm)?;
    let t0 = Instant::now();
    for _ in 0..c.args.iters {
        f()?;
    }
    dev.synchronize()?;
    let us = t0.elapsed().as_secs_f64() * 1e6 / c.args.iters.max(1) as f64;
    c.wait(comm)?;
    Ok(us)
}

/// `timed` for one device alone.
fn time(dev: &Device, args: &Args, mut f: impl FnMut() -> BoxResult<()>) -> BoxResult<f64> {
    for _ in 0..args.warmup {
        f()?;
    }
    dev.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..args.iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() * 1e6 / args.iters.max(1) as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The slowest rank's times and the worst check over the ranks.
fn merge<'a>(
    tokens: usize,
    hidden: usize,
    single_us: f64,
    ranks: impl Iterator<Item = &'a RankPoint>,
) -> Point {
    let mut p = Point {
        tokens,
        allreduce_bytes: tokens * hidden * 2,
        single_gpu_us: single_us,
        peercomm_within_tolerance: true,
        ..Point::default()
    };
    let max_opt = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    for r in ranks {
        p.compute_only_us = p.compute_only_us.max(r.compute_us);
        p.peercomm_us = p.peercomm_us.max(r.peercomm_us);
        p.peercomm_allreduce_us = p.peercomm_allreduce_us.max(r.peercomm_ar_us);
        p.nccl_us = max_opt(p.nccl_us, r.nccl_us);
        p.nccl_allreduce_us = max_opt(p.nccl_allreduce_us, r.nccl_ar_us);
        p.peercomm_algorithm.clone_from(&r.algorithm);
        if let Some(c) = r.peercomm_check {
            let e = c.max_abs / c.rms;
            p.peercomm_max_err_over_rms = p.peercomm_max_err_over_rms.max(e);
            p.peercomm_within_tolerance &= c.passes;
        }
        if let Some(c) = r.nccl_check {
            let e = c.max_abs / c.rms;
            p.nccl_max_err_over_rms = max_opt(p.nccl_max_err_over_rms, Some(e));
            p.nccl_within_tolerance = Some(p.nccl_within_tolerance.unwrap_or(true) && c.passes);
        }
    }
    p
}

fn print_table(points: &[Point]) {
    let opt =
        |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |v| format!("{v:.digits$}"));
    println!(
        "{:>6} {:>9} {:>9} {:>9} {:>11} {:>8} {:>9} {:>11}  {:<10} {:>9} {:>9}",
        "tokens",
        "1 GPU",
        "TP share",
        "TP+NCCL",
        "TP+peercomm",
        "ratio",
        "NCCL ar",
        "peercomm ar",
        "algorithm",
        "err/rms",
        "NCCL e/r"
    );
    for p in points {
        println!(
            "{:>6} {:>9.1} {:>9.1} {:>9} {:>11.1} {:>8} {:>9} {:>11.1}  {:<10} {:>9.2e} {:>9}",
            p.tokens,
            p.single_gpu_us,
            p.compute_only_us,
            opt(p.nccl_us, 1),
            p.peercomm_us,
            opt(p.nccl_us.map(|n| p.peercomm_us / n), 3),
            opt(p.nccl_allreduce_us, 1),
            p.peercomm_allreduce_us,
            p.peercomm_algorithm,
            p.peercomm_max_err_over_rms,
            p.nccl_max_err_over_rms
                .map_or("-".to_string(), |e| format!("{e:.2e}")),
        );
    }
    println!(
        "(us per block, slowest rank; ratio = TP+peercomm / TP+NCCL; ar = the all-reduce alone)"
    );
}
