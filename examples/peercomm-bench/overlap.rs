//! `--overlap`: what programmatic dependent launch saves in a layer-like graph. Each
//! rank's graph holds pairs of (a producer kernel that writes the all-reduce's input,
//! the all-reduce), with `AllReduceOptions::overlap_previous` off and on; the time per
//! pair is reported for both (f32, whole world, graph mode).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use peercomm::backend::cuda::Cuda;
use peercomm::ReduceOp;

use super::gpu::{capture, time_batches, with_tracking, Gpu};
use super::*;

/// A stand-in for the GEMM before the all-reduce: writes every input element.
const PRODUCER: &str = r#"
extern "C" __global__ void write_input(float* x, unsigned long long n, float v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += gridDim.x * blockDim.x)
        x[i] = v;
}
"#;

fn producers(gpu: &Gpu) -> Result<Vec<CudaFunction>, String> {
    let arch = match gpu.comm.architecture() {
        "sm_90" => "compute_90",
        "sm_80" => "compute_80",
        other => return Err(format!("no producer build for {other}")),
    };
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(PRODUCER, opts).map_err(|e| format!("{e:?}"))?;
    gpu.comm
        .cores()
        .iter()
        .map(|r| {
            r.device()
                .context()
                .load_module(ptx.clone())
                .and_then(|m| m.load_function("write_input"))
                .map_err(|e| e.to_string())
        })
        .collect()
}

/// Records (mode "graph+producer", implementation "peercomm-auto" or
/// "peercomm-auto-overlap") per size.
pub fn run(gpu: &Gpu, args: &Args, sizes: &[usize]) -> Vec<Record> {
    let producer = match producers(gpu) {
        Ok(p) => p,
        Err(why) => {
            println!("--overlap skipped: the producer kernel could not be built ({why})");
            return Vec::new();
        }
    };
    let world = gpu.comm.world_size();
    let calls = 50;
    let mut records = Vec::new();
    for &bytes in sizes.iter().filter(|&&b| b <= 16 << 20) {
        let n = bytes / 4;
        let mut ins: Vec<CudaSlice<f32>> = (0..world)
            .map(|r| Cuda::alloc_buffer::<f32>(gpu.comm.core(r).device(), n).unwrap())
            .collect();
        let mut outs: Vec<CudaSlice<f32>> = (0..world)
            .map(|r| Cuda::alloc_buffer::<f32>(gpu.comm.core(r).device(), n).unwrap())
            .collect();
        for overlap in [false, true] {
            let opts = AllReduceOptions::new().overlap_previous(overlap);
            let mut ran = Algorithm::Auto;
            with_tracking(gpu, false);
            let graphs = capture(&gpu.streams, || {
                for _ in 0..calls {
                    for (r, f) in producer.iter().enumerate() {
                        let cfg = LaunchConfig::for_num_elems(n as u32);
                        let (len, value) = (n as u64, r as f32 + 1.0);
                        let mut b = gpu.streams[r].launch_builder(f);
                        b.arg(&mut ins[r]).arg(&len).arg(&value);
                        // SAFETY: the arguments match write_input's signature.
                        unsafe { b.launch(cfg) }.expect("producer");
                    }
                    let it: Vec<TensorView<Cuda>> =
                        ins.iter().map(|b| TensorView::flat(b)).collect();
                    let mut ot: Vec<TensorViewMut<Cuda>> =
                        outs.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
                    ran = gpu
                        .comm
                        .all_reduce(&it, &mut ot, &ReduceOp::Sum, &opts)
                        .unwrap();
                }
            });
            let t = time_batches(&gpu.streams, args.batches, calls, || {
                graphs.iter().for_each(|g| g.launch().unwrap())
            });
            drop(graphs);
            with_tracking(gpu, true);
            let want = (world * (world + 1) / 2) as f32;
            let got = Cuda::download(gpu.comm.core(0).device(), &outs[0]).unwrap();
            if got.iter().any(|&x| x != want) {
                println!("--overlap {bytes} B overlap {overlap}: WRONG SUM, not reported");
                continue;
            }
            let at = At {
                dtype: DType::F32,
                world,
                group: world,
                bytes,
            };
            let imp = if overlap {
                "peercomm-auto-overlap"
            } else {
                "peercomm-auto"
            };
            let r = record(at, imp, ran.name(), "graph+producer", t);
            print_record(&r);
            records.push(r);
        }
    }
    records
}
