//! The kernels of kernels.cu on CUDA: compiled at run time with NVRTC from
//! `peercomm::device::prelude()`, launched with cudarc's launch builder on the rank's
//! stream, checked by main.rs; then timed in CUDA graphs (ranks replay together) beside
//! the library's one-stage all-reduce and the unfused pair (all-reduce, then a bias +
//! GELU kernel), at sizes from 4 KiB to 16 MiB.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use peercomm::backend::cuda::Cuda;
use peercomm::backend::{Backend, TypedBuffer};
use peercomm::device::DeviceComm;
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig, ReduceOp, UniqueId};

use super::{Case, Outputs};

/// The kernels' source after the device API.
fn source() -> String {
    format!(
        "{}\n{}",
        peercomm::device::prelude(),
        include_str!("kernels.cu")
    )
}

/// The PTX, compiled once for the process (ranks are threads), and how long NVRTC took.
fn ptx() -> &'static (cudarc::nvrtc::Ptx, Duration) {
    static PTX: OnceLock<(cudarc::nvrtc::Ptx, Duration)> = OnceLock::new();
    PTX.get_or_init(|| {
        if let Some(lib) = std::env::var_os("PEERCOMM_NVRTC") {
            // Loaded once and kept: cudarc then finds it by its soname.
            // SAFETY: loading libnvrtc runs no initialiser with preconditions.
            let lib = unsafe { libloading::Library::new(lib) }.expect("PEERCOMM_NVRTC loads");
            std::mem::forget(lib);
        }
        let start = Instant::now();
        let options = cudarc::nvrtc::CompileOptions {
            arch: Some("sm_80"),
            options: vec!["-std=c++17".into()],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(source(), options)
            .unwrap_or_else(|e| panic!("NVRTC: {e:?}"));
        (ptx, start.elapsed())
    })
}

/// Each rank's kernels.
struct Kernels {
    one_stage_sum: CudaFunction,
    all_reduce_bias_gelu: CudaFunction,
    moe_combine: CudaFunction,
    bias_gelu: CudaFunction,
}

fn kernels(stream: &Arc<CudaStream>) -> Kernels {
    let (ptx, took) = ptx();
    let module = stream
        .context()
        .load_module(ptx.clone())
        .expect("load the PTX");
    let f = |name: &str| module.load_function(name).expect(name);
    if took.as_nanos() > 0 {
        eprintln!("NVRTC compiled kernels.cu with the device header in {took:?}");
    }
    Kernels {
        one_stage_sum: f("one_stage_sum"),
        all_reduce_bias_gelu: f("all_reduce_bias_gelu"),
        moe_combine: f("moe_combine"),
        bias_gelu: f("bias_gelu"),
    }
}

/// Launches kernel `$f` on `$stream` with `$cfg` and the arguments, in order.
macro_rules! launch {
    ($stream:expr, $f:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let mut b = $stream.launch_builder($f);
        $(b.arg($arg);)+
        // SAFETY: the arguments match the kernel's signature in kernels.cu.
        unsafe { b.launch($cfg) }.expect("a launch");
    }};
}

/// The grid of every kernel: at most `blocks` blocks of 512 threads, the library's block
/// (ranks sharing a GPU need every rank's blocks resident at once).
fn grid(n: usize, blocks: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(512).clamp(1, blocks), 1, 1),
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Rank `rank`'s part: its communicator (ranks of one GPU share it), the three kernels
/// checked by the caller, then the timings (rank 0 prints them).
pub fn run(rank: usize, world: usize, id: &UniqueId, config: CommConfig, case: &Case) -> Outputs {
    let gpus = Cuda::device_count().expect("CUDA devices").max(1);
    let shared = gpus < world;
    let blocks = if shared { 4 } else { 32 };
    let config = config.with_max_blocks(shared.then_some(4));
    let dev = Cuda::open(rank % gpus).expect("a CUDA device");
    let stream = dev.stream().clone();
    let comm = Comm::<Cuda>::from_rank(dev, rank, world, id, config).expect("a communicator");
    let k = kernels(&stream);
    let n = case.n;
    let mut x = comm.alloc_symmetric::<f32>(n).unwrap();
    x.copy_from_host(comm.device(), &case.x[rank]).unwrap();
    let xs = comm.device_comm(&x).unwrap();
    let bias = stream.clone_htod(&case.bias).unwrap();
    let mut sum = stream.alloc_zeros::<f32>(n).unwrap();
    let mut fused = stream.alloc_zeros::<f32>(n).unwrap();
    let len = n as u64;
    launch!(
        &stream,
        &k.one_stage_sum,
        grid(n, blocks),
        &xs,
        &mut sum,
        &len
    );
    launch!(
        &stream,
        &k.all_reduce_bias_gelu,
        grid(n, blocks),
        &xs,
        &bias,
        &mut fused,
        &len
    );
    let (tokens, hidden) = (case.tokens as u32, case.hidden as u32);
    let mut y = comm.alloc_symmetric::<f32>(case.y[rank].len()).unwrap();
    y.copy_from_host(comm.device(), &case.y[rank]).unwrap();
    let ys = comm.device_comm(&y).unwrap();
    let scores = stream.clone_htod(&case.scores[rank]).unwrap();
    let mut combined = stream
        .alloc_zeros::<f32>(case.tokens * case.hidden)
        .unwrap();
    launch!(
        &stream,
        &k.moe_combine,
        grid(case.tokens * case.hidden, blocks),
        &ys,
        &scores,
        &mut combined,
        &tokens,
        &hidden
    );
    comm.synchronize().expect("the kernels");
    // The library's one-stage sum of the same input, bit for bit the example's.
    let mut library = stream.alloc_zeros::<f32>(n).unwrap();
    let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    comm.all_reduce_with(&x, &mut library, &ReduceOp::Sum, &one)
        .unwrap();
    comm.synchronize().unwrap();
    let out = Outputs {
        sum: stream.clone_dtoh(&sum).unwrap(),
        fused: stream.clone_dtoh(&fused).unwrap(),
        combined: stream.clone_dtoh(&combined).unwrap(),
    };
    let lib = stream.clone_dtoh(&library).unwrap();
    let same = lib
        .iter()
        .zip(&out.sum)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(
        same,
        "rank {rank}: the example's one-stage sum differs from the library's"
    );
    drop((x, y));
    timings(&comm, &stream, &k, rank, blocks);
    out
}

/// Median microseconds per call of `calls` captured calls, over 15 replays that every
/// rank starts together (threads or processes).
fn per_call_us(comm: &Comm<Cuda>, calls: usize, body: &mut dyn FnMut()) -> f64 {
    let (graph, ()) = comm
        .capture(|| {
            for _ in 0..calls {
                body();
            }
            Ok(())
        })
        .expect("a captured graph");
    let mut times = Vec::new();
    for _ in 0..15 {
        // Every rank at the same point: the library's barrier, waited for.
        comm.barrier(0).unwrap();
        comm.synchronize().unwrap();
        let start = Instant::now();
        graph.launch().unwrap();
        comm.synchronize().unwrap();
        times.push(start.elapsed().as_secs_f64() * 1e6 / calls as f64);
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// The example's one-stage sum against the library's, and the fused epilogue against
/// the unfused pair, graph mode, 4 KiB to 16 MiB a rank (f32).
fn timings(comm: &Comm<Cuda>, stream: &Arc<CudaStream>, k: &Kernels, rank: usize, blocks: u32) {
    let calls = 20;
    if rank == 0 {
        println!(
            "world {}: us per call, CUDA graphs of {calls} calls (ranks share a GPU: {})",
            comm.world_size(),
            blocks == 4
        );
        println!(
            "{:>10} {:>10} {:>10} {:>7} {:>10} {:>10} {:>7}",
            "bytes", "example", "library", "ratio", "fused", "unfused", "ratio"
        );
    }
    for shift in 12..=24 {
        let bytes = 1usize << shift;
        let n = bytes / 4;
        let len = n as u64;
        let x = comm.alloc_symmetric::<f32>(n).unwrap();
        let xs: DeviceComm = comm.device_comm(&x).unwrap();
        let bias: CudaSlice<f32> = stream.alloc_zeros(n).unwrap();
        let mut out: CudaSlice<f32> = stream.alloc_zeros(n).unwrap();
        let mut mid: CudaSlice<f32> = stream.alloc_zeros(n).unwrap();
        let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        let cfg = grid(n, blocks);
        let example = per_call_us(comm, calls, &mut || {
            launch!(stream, &k.one_stage_sum, cfg, &xs, &mut out, &len)
        });
        let library = per_call_us(comm, calls, &mut || {
            comm.all_reduce_with(&x, &mut out, &ReduceOp::Sum, &one)
                .unwrap();
        });
        let fused = per_call_us(comm, calls, &mut || {
            launch!(
                stream,
                &k.all_reduce_bias_gelu,
                cfg,
                &xs,
                &bias,
                &mut out,
                &len
            )
        });
        let unfused = per_call_us(comm, calls, &mut || {
            comm.all_reduce_with(&x, &mut mid, &ReduceOp::Sum, &one)
                .unwrap();
            launch!(stream, &k.bias_gelu, cfg, &mid, &bias, &mut out, &len);
        });
        if rank == 0 {
            println!(
                "{bytes:>10} {example:>10.2} {library:>10.2} {:>7.3} {fused:>10.2} {unfused:>10.2} {:>7.3}",
                example / library,
                fused / unfused
            );
        }
        comm.synchronize().unwrap();
    }
}
