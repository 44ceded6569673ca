//! Programmatic dependent launch (`AllReduceOptions::overlap_previous`): the collective
//! may start while the kernel before it is finishing, and must still read what that
//! kernel wrote. A producer kernel spins, then writes the input as its last act; the
//! all-reduce launched right after it (eager, and inside a CUDA graph) must sum the
//! produced values, never the poison that was there before. Needs an NVIDIA GPU and
//! NVRTC (to build the producer); without either, each test prints why it is skipped.
//! With one GPU, two ranks share it.
#![cfg(feature = "cuda")]
// Rank indices address several per-rank vectors at once.
#![allow(clippy::needless_range_loop)]

mod common;

use std::sync::Arc;

use common::Placement;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use peercomm::backend::cuda::Cuda;
use peercomm::backend::Backend;
use peercomm::{
    Algorithm, AllReduceOptions, ReduceOp, SingleController, TensorView, TensorViewMut,
};

const PRODUCER: &str = r#"
extern "C" __global__ void produce(float* x, unsigned long long n, float base,
                                   unsigned long long spin_ns) {
    unsigned long long t0, t;
#if __CUDA_ARCH__ >= 900
    // Let the next kernel (launched with programmatic serialization) start at once:
    // it then runs while this one has not written anything yet.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < spin_ns);
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += gridDim.x * blockDim.x)
        x[i] = base + (float)(i % 7);
}
"#;

/// The producer compiled for every rank's context, or why not.
fn producers(comm: &SingleController<Cuda>) -> Result<Vec<CudaFunction>, String> {
    let arch = match comm.architecture() {
        "sm_80" => "compute_80",
        "sm_90" => "compute_90",
        other => return Err(format!("no producer build for {other}")),
    };
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        ..Default::default()
    };
    let ptx = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(PRODUCER, opts))
        .map_err(|_| "NVRTC could not be loaded".to_string())?
        .map_err(|e| format!("NVRTC failed: {e:?}"))?;
    comm.cores()
        .iter()
        .map(|r| {
            let module = r
                .device()
                .context()
                .load_module(ptx.clone())
                .map_err(|e| format!("load producer: {e}"))?;
            module
                .load_function("produce")
                .map_err(|e| format!("producer symbol: {e}"))
        })
        .collect()
}

fn produce(f: &CudaFunction, stream: &Arc<CudaStream>, x: &mut CudaSlice<f32>, base: f32) {
    let n = x.len() as u64;
    let spin_ns = 20_000u64;
    let cfg = LaunchConfig {
        grid_dim: (8, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(f);
    b.arg(x).arg(&n).arg(&base).arg(&spin_ns);
    // SAFETY: the arguments match the producer's signature; x holds n floats.
    unsafe { b.launch(cfg) }.expect("producer launch");
}

/// One buffer of `n` floats per rank.
fn buffers(comm: &SingleController<Cuda>, n: usize) -> Vec<CudaSlice<f32>> {
    comm.cores()
        .iter()
        .map(|r| Cuda::alloc_buffer::<f32>(r.device(), n).unwrap())
        .collect()
}

fn expected(world: usize, base: impl Fn(usize) -> f32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (0..world).map(|r| base(r) + (i % 7) as f32).sum())
        .collect()
}

fn setup(test: &str) -> Option<(SingleController<Cuda>, Vec<CudaFunction>)> {
    let gpus = common::devices(test, common::cuda_devices(), 1)?;
    let comm = Placement::round_robin(2, gpus).open::<Cuda>(common::suite_config(None));
    match producers(&comm) {
        Ok(f) => Some((comm, f)),
        Err(why) => {
            common::announce_skip(test, &why);
            None
        }
    }
}

#[test]
fn overlapped_launch_reads_what_the_previous_kernel_wrote() {
    let Some((comm, producer)) = setup("overlapped_launch_reads_what_the_previous_kernel_wrote")
    else {
        return;
    };
    let world = comm.world_size();
    let streams: Vec<_> = comm
        .cores()
        .iter()
        .map(|r| r.device().stream().clone())
        .collect();
    for (algorithm, n) in [
        (Algorithm::Lamport, 4099usize),
        (Algorithm::OneStage, 4099),
        (Algorithm::OneStage, 1 << 18),
        (Algorithm::TwoStage, 100_003),
    ] {
        let (mut ins, mut outs) = (buffers(&comm, n), buffers(&comm, n));
        let opts = AllReduceOptions::new()
            .algorithm(algorithm)
            .overlap_previous(true);
        for call in 0..20 {
            for r in 0..world {
                let dev = comm.core(r).device();
                Cuda::upload(dev, &vec![f32::NAN; n], &mut ins[r]).unwrap();
                Cuda::upload(dev, &vec![f32::NAN; n], &mut outs[r]).unwrap();
            }
            let base = |r: usize| (call * 10 + r) as f32;
            for r in 0..world {
                produce(&producer[r], &streams[r], &mut ins[r], base(r));
            }
            let it: Vec<TensorView<Cuda>> = ins.iter().map(|b| TensorView::flat(b)).collect();
            let mut ot: Vec<TensorViewMut<Cuda>> =
                outs.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
            let ran = comm
                .all_reduce(&it, &mut ot, &ReduceOp::Sum, &opts)
                .unwrap();
            assert_eq!(ran, algorithm);
            comm.synchronize().unwrap();
            let want = expected(world, base, n);
            for r in 0..world {
                let got = Cuda::download(comm.core(r).device(), &outs[r]).unwrap();
                assert!(
                    got == want,
                    "{algorithm:?} n {n} call {call}: rank {r} summed something else than the \
                     produced input (first element {} against {})",
                    got[0],
                    want[0]
                );
            }
        }
    }
}

#[test]
fn overlapped_launch_inside_a_graph_reads_what_the_producer_wrote() {
    let Some((comm, producer)) =
        setup("overlapped_launch_inside_a_graph_reads_what_the_producer_wrote")
    else {
        return;
    };
    let world = comm.world_size();
    let n = 65_537usize;
    let streams: Vec<_> = comm
        .cores()
        .iter()
        .map(|r| r.device().stream().clone())
        .collect();
    let (mut ins, mut outs) = (buffers(&comm, n), buffers(&comm, n));
    comm.synchronize().unwrap();
    let opts = AllReduceOptions::new().overlap_previous(true);
    let (graphs, _) = comm
        .capture(|| {
            for r in 0..world {
                produce(&producer[r], &streams[r], &mut ins[r], r as f32 + 1.0);
            }
            comm.all_reduce_slices(&ins, &mut outs, &ReduceOp::Sum, &opts)
        })
        .unwrap();
    let want = expected(world, |r| r as f32 + 1.0, n);
    for replay in 0..50 {
        for r in 0..world {
            let dev = comm.core(r).device();
            Cuda::upload(dev, &vec![f32::NAN; n], &mut ins[r]).unwrap();
            Cuda::upload(dev, &vec![f32::NAN; n], &mut outs[r]).unwrap();
            streams[r].synchronize().unwrap();
        }
        graphs.iter().for_each(|g| g.launch().unwrap());
        comm.synchronize().unwrap();
        for r in 0..world {
            let got = Cuda::download(comm.core(r).device(), &outs[r]).unwrap();
            assert!(got == want, "replay {replay}: rank {r} summed the poison");
        }
    }
    drop(graphs);
}
