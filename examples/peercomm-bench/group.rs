//! `--group-calls`: what a group of all-reduces costs against the same calls made one
//! by one and against one call (single controller, bf16, whole world, graph mode).
//! Each graph iteration is one call, eight separate calls, or one `SingleController::group`
//! of eight (one batched kernel per rank); the time per iteration is reported, and the
//! ratio of a group of eight to one call.

use cudarc::driver::CudaSlice;
use half::bf16;
use peercomm::backend::cuda::Cuda;
use peercomm::ReduceOp;

use super::gpu::{capture, time_batches, with_tracking, Gpu};
use super::*;

/// Calls per group.
const GROUP: usize = 8;

/// Records (mode "graph", implementations "peercomm-1-call", "peercomm-8-calls",
/// "peercomm-group-of-8") at 1, 4 and 16 KiB per call.
pub fn run(gpu: &Gpu, args: &Args) -> Vec<Record> {
    let world = gpu.comm.world_size();
    let iterations = 50;
    let mut records = Vec::new();
    println!("group calls (single controller, bf16, graph mode, {world} ranks):");
    for bytes in [1usize << 10, 4 << 10, 16 << 10] {
        let n = bytes / 2;
        let dev = |r: usize| gpu.comm.core(r).device();
        let value = |r: usize, s: usize| bf16::from_f32((r + s + 1) as f32);
        let ins: Vec<Vec<CudaSlice<bf16>>> = (0..GROUP)
            .map(|s| {
                (0..world)
                    .map(|r| Cuda::alloc_from(dev(r), &vec![value(r, s); n]).unwrap())
                    .collect()
            })
            .collect();
        let mut outs: Vec<Vec<CudaSlice<bf16>>> = (0..GROUP)
            .map(|_| {
                (0..world)
                    .map(|r| Cuda::alloc_buffer::<bf16>(dev(r), n).unwrap())
                    .collect()
            })
            .collect();
        let mut times = Vec::new();
        // Also one call forced to one-stage (the batched kernel's algorithm) and
        // smaller groups, to tell a fixed cost of the batched kernel from a per-call one.
        for (imp, calls, grouped, algorithm) in [
            ("peercomm-1-call", 1, false, Algorithm::Auto),
            ("peercomm-1-call-one_stage", 1, false, Algorithm::OneStage),
            ("peercomm-8-calls", GROUP, false, Algorithm::Auto),
            ("peercomm-group-of-2", 2, true, Algorithm::Auto),
            ("peercomm-group-of-4", 4, true, Algorithm::Auto),
            ("peercomm-group-of-8", GROUP, true, Algorithm::Auto),
        ] {
            for o in outs.iter_mut().flatten() {
                Cuda::upload(
                    gpu.comm.core(0).device(),
                    &vec![bf16::from_f32(f32::NAN); n],
                    o,
                )
                .ok();
            }
            with_tracking(gpu, false);
            let mut ran = Algorithm::Auto;
            let graphs = capture(&gpu.streams, || {
                for _ in 0..iterations {
                    if grouped {
                        let mut g = gpu.comm.group();
                        for (i, o) in ins.iter().zip(outs.iter_mut()).take(calls) {
                            g.all_reduce_slices(i, o, &ReduceOp::Sum).unwrap();
                        }
                        ran = g.end().unwrap()[0];
                    } else {
                        for (i, o) in ins.iter().zip(outs.iter_mut()).take(calls) {
                            ran = gpu
                                .comm
                                .all_reduce_slices(
                                    i,
                                    o,
                                    &ReduceOp::Sum,
                                    &AllReduceOptions::new().algorithm(algorithm),
                                )
                                .unwrap();
                        }
                    }
                }
            });
            let t = time_batches(&gpu.streams, args.batches, iterations, || {
                graphs.iter().for_each(|g| g.launch().unwrap())
            });
            drop(graphs);
            with_tracking(gpu, true);
            let mut right = true;
            for (s, o) in outs.iter().enumerate().take(calls) {
                let want = (0..world).map(|r| (r + s + 1) as f32).sum::<f32>();
                for (r, b) in o.iter().enumerate() {
                    let got = Cuda::download(dev(r), b).unwrap();
                    right &= got.iter().all(|x| x.to_f32() == want);
                }
            }
            if !right {
                println!("  {imp} at {bytes} B: WRONG SUM, not reported");
                continue;
            }
            println!(
                "  {bytes:>6} B per call  {imp:<22} {t:>8.2} us per iteration ({})",
                ran.name()
            );
            times.push((imp, t));
            let at = At {
                dtype: DType::BF16,
                world,
                group: world,
                bytes,
            };
            records.push(record(at, imp, ran.name(), "graph", t));
        }
        let time_of = |name: &str| times.iter().find(|(i, _)| *i == name).map(|t| t.1);
        if let (Some(one), Some(eight), Some(group)) = (
            time_of("peercomm-1-call"),
            time_of("peercomm-8-calls"),
            time_of("peercomm-group-of-8"),
        ) {
            println!(
                "  {bytes:>6} B per call  group of 8 / one call = {:.2}, group of 8 / 8 calls = {:.2}",
                group / one,
                group / eight
            );
        }
    }
    records
}
