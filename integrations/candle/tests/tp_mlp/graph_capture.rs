//! What an engine does to put peercomm's all-reduce into the CUDA graph of its model
//! step: it begins a capture itself on the candle device's stream, calls the all-reduce
//! on tensors allocated before the capture, ends the capture, and launches the graph
//! again and again with fresh inputs written into the captured tensors.

use std::sync::Barrier;

use candle_core::{Device, Tensor};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use peercomm_candle::{CandleComm, ReduceOp, UniqueId};

use super::reference::{check, input, poisoned, reduce, values, DTYPES};
use super::{gpus, placement, seed};

const SHAPE: (usize, usize) = (33, 257);
const REPLAYS: u64 = 20;

/// Captures `f`'s work on `device`'s stream into a graph, as an engine does around its
/// model step: the stream synchronised, cudarc's event tracking off during the capture
/// (an event recorded inside a capture cannot be waited on outside it), relaxed mode
/// (other threads keep using CUDA meanwhile).
fn capture(device: &Device, f: impl FnOnce() -> peercomm_candle::Result<()>) -> CudaGraph {
    let cuda = device.as_cuda_device().unwrap();
    let stream = cuda.cuda_stream();
    stream.synchronize().unwrap();
    let tracking = cuda.is_event_tracking();
    // SAFETY: the stream is synchronised and only this stream uses the tensors until
    // tracking is back on; nothing is allocated during the capture.
    unsafe { cuda.disable_event_tracking() };
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    let called = f();
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    if tracking {
        // SAFETY: as above; tensors made meanwhile (none) would stay untracked.
        unsafe { stream.context().enable_event_tracking() };
    }
    called.unwrap();
    graph.unwrap().expect("the capture recorded the all-reduce")
}

#[test]
fn all_reduce_in_a_graph_the_engine_captured() {
    let test = "all_reduce_in_a_graph_the_engine_captured";
    let Some(n) = gpus(test) else {
        return;
    };
    let (ordinals, config) = placement(n);
    let world = ordinals.len();
    eprintln!("ranks on GPUs {ordinals:?}");
    let seed = seed(test);
    let id = UniqueId::new().unwrap();
    let warm = Barrier::new(world);
    let ops = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg];
    std::thread::scope(|s| {
        for (rank, &ordinal) in ordinals.iter().enumerate() {
            let (id, config, warm) = (&id, config.clone(), &warm);
            s.spawn(move || {
                let dev = Device::new_cuda_with_stream(ordinal).unwrap();
                let comm = CandleComm::from_rank(&dev, rank, world, id, config).unwrap();
                let dims = [SHAPE.0, SHAPE.1];
                // Allocated before the capture: the graph reads and writes these.
                let tensors: Vec<(Tensor, Tensor)> = DTYPES
                    .iter()
                    .map(|&dtype| (poisoned(&dims, dtype, &dev), poisoned(&dims, dtype, &dev)))
                    .collect();
                // `slice_set` (candle's copy kernel, which writes the fresh inputs) runs
                // once per dtype before any collective: a first use loads its module,
                // which could wait behind a peer's collective on a shared GPU.
                for (x, _) in &tensors {
                    x.slice_set(&poisoned(&dims, x.dtype(), &dev), 0, 0)
                        .unwrap();
                }
                dev.synchronize().unwrap();
                warm.wait();
                for (k, &op) in ops.iter().enumerate() {
                    for (d, (x, out)) in tensors.iter().enumerate() {
                        let dtype = x.dtype();
                        let graph = capture(&dev, || comm.all_reduce_into(x, out, &op).map(drop));
                        for replay in 0..REPLAYS {
                            let call = ((k * DTYPES.len() + d) as u64) * REPLAYS + replay;
                            let ins: Vec<Tensor> = (0..world)
                                .map(|r| input(seed, call, r, SHAPE, dtype))
                                .collect();
                            x.slice_set(&ins[rank].to_device(&dev).unwrap(), 0, 0)
                                .unwrap();
                            out.slice_set(&poisoned(&dims, dtype, &dev), 0, 0).unwrap();
                            graph.launch().unwrap();
                            comm.synchronize().unwrap();
                            let want = reduce(op, &ins.iter().map(values).collect::<Vec<_>>());
                            let what = format!("rank {rank} {op:?} {dtype:?} replay {replay}");
                            check(&values(out), &want, dtype, Some(op), &what);
                        }
                    }
                }
                eprintln!(
                    "{test}: rank {rank} checked {} replays",
                    ops.len() * DTYPES.len() * REPLAYS as usize
                );
            });
        }
    });
}
