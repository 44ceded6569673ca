//! The per-rank half of the benchmark (`--per-rank`): one thread per GPU, each with its
//! own peercomm `Comm` and its own cudarc NCCL `Comm::from_rank`, as an engine that
//! runs a thread per GPU does. Every rank times its own stream with device events;
//! a point's latency is the slowest rank's. Eager calls show what such an engine pays
//! per call on the host; graph replays the GPU cost. The sum is checked once per point
//! (inputs are rank + 1 everywhere, so the sum is exact in bf16 for small worlds).
//! NCCL is skipped when ranks share a GPU (it refuses two ranks on one device).

use std::sync::{Barrier, Mutex};
use std::time::Duration;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaSlice;
use cudarc::nccl::{Comm as NcclComm, Id, ReduceOp};
use peercomm::backend::cuda::Cuda;
use peercomm::bootstrap::UniqueId;
use peercomm::Comm;

use super::*;

/// Calls per timed batch.
const CALLS: usize = 50;

/// Median time per call over `batches` batches of `CALLS` calls, in us.
fn per_call_us(
    stream: &cudarc::driver::CudaStream,
    batches: usize,
    mut batch: impl FnMut(),
) -> f64 {
    batch();
    stream.synchronize().unwrap();
    let samples = (0..batches)
        .map(|_| {
            let a = stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .unwrap();
            batch();
            let b = stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .unwrap();
            a.elapsed_ms(&b).unwrap() as f64 * 1e3 / CALLS as f64
        })
        .collect();
    median(samples)
}

/// Runs the per-rank sweep over `world` ranks on `gpus` GPUs (round-robin).
pub fn run(args: &Args, world: usize, gpus: usize) -> Vec<Record> {
    let shared = gpus < world;
    let with_nccl = !args.no_nccl && !shared;
    let max = args.max_bytes.unwrap_or(1 << 20);
    let sizes = sizes(args, args.min_bytes, max);
    let config = CommConfig {
        payload_bytes: max.max(1 << 20),
        lamport_slot_bytes: args.lamport_slot_bytes,
        barrier_timeout: Some(Duration::from_secs(30)),
        max_blocks: if shared { Some(4) } else { args.max_blocks },
        threads_per_block: args.threads,
        allow_shared_devices: shared,
        ..CommConfig::default()
    };
    println!(
        "per-rank mode: {world} threads on {gpus} GPU(s){}{}",
        if shared {
            " (shared: timings mean nothing)"
        } else {
            ""
        },
        if with_nccl { "" } else { ", no NCCL" }
    );
    let id = UniqueId::new().expect("bootstrap id");
    let nccl_id = with_nccl.then(|| Id::new().expect("NCCL id"));
    let start = Barrier::new(world);
    let records = Mutex::new(vec![Vec::new(); world]);
    std::thread::scope(|s| {
        for rank in 0..world {
            let (config, id, start, records, sizes) =
                (config.clone(), &id, &start, &records, &sizes);
            s.spawn(move || {
                let dev = Cuda::open(rank % gpus).expect("device");
                let stream = dev.stream().clone();
                let comm =
                    Comm::<Cuda>::from_rank(dev, rank, world, id, config).expect("peercomm Comm");
                let nccl = nccl_id.map(|i| {
                    NcclComm::from_rank(stream.clone(), rank, world, i).expect("NCCL from_rank")
                });
                let mut mine = Vec::new();
                for &bytes in sizes {
                    let n = bytes / 2;
                    let send: CudaSlice<half::bf16> = stream
                        .clone_htod(&vec![half::bf16::from_f32(rank as f32 + 1.0); n])
                        .unwrap();
                    let mut recv = stream.alloc_zeros::<half::bf16>(n).unwrap();
                    let opts = AllReduceOptions::new();
                    start.wait();
                    let algorithm = comm.all_reduce_sum(&send, &mut recv, &opts).unwrap();
                    comm.synchronize().unwrap();
                    let want = (world * (world + 1) / 2) as f32;
                    let got = stream.clone_dtoh(&recv).unwrap();
                    assert!(
                        got.iter().all(|x| x.to_f32() == want),
                        "rank {rank}: wrong sum at {bytes} B"
                    );
                    let at = |imp: &str, alg: &str, mode: &str, us| {
                        let a = At {
                            dtype: DType::BF16,
                            world,
                            group: world,
                            bytes,
                        };
                        record(a, imp, alg, mode, us)
                    };
                    start.wait();
                    let eager = per_call_us(&stream, args.batches, || {
                        for _ in 0..CALLS {
                            comm.all_reduce_sum(&send, &mut recv, &opts).unwrap();
                        }
                    });
                    mine.push(at("peercomm-per-rank", algorithm.name(), "eager", eager));
                    if let Some(nccl) = &nccl {
                        start.wait();
                        let eager = per_call_us(&stream, args.batches, || {
                            for _ in 0..CALLS {
                                nccl.all_reduce(&send, &mut recv, &ReduceOp::Sum).unwrap();
                            }
                        });
                        mine.push(at("nccl-per-rank", "nccl", "eager", eager));
                    }
                    if !args.no_graph {
                        stream.synchronize().unwrap();
                        // SAFETY: this rank's stream is idle; the buffers outlive the
                        // graphs, and only this rank's stream runs them.
                        unsafe { comm.device().context().disable_event_tracking() };
                        let graph_of = |body: &mut dyn FnMut()| {
                            stream
                                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                                .unwrap();
                            body();
                            stream
                                .end_capture(CUgraphInstantiate_flags(0))
                                .unwrap()
                                .expect("a captured graph")
                        };
                        let ours = graph_of(&mut || {
                            for _ in 0..CALLS {
                                comm.all_reduce_sum(&send, &mut recv, &opts).unwrap();
                            }
                        });
                        start.wait();
                        let graph = per_call_us(&stream, args.batches, || ours.launch().unwrap());
                        mine.push(at("peercomm-per-rank", algorithm.name(), "graph", graph));
                        if let Some(nccl) = &nccl {
                            let theirs = graph_of(&mut || {
                                for _ in 0..CALLS {
                                    nccl.all_reduce(&send, &mut recv, &ReduceOp::Sum).unwrap();
                                }
                            });
                            start.wait();
                            let graph =
                                per_call_us(&stream, args.batches, || theirs.launch().unwrap());
                            mine.push(at("nccl-per-rank", "nccl", "graph", graph));
                        }
                        stream.synchronize().unwrap();
                        // SAFETY: the stream is idle again.
                        unsafe { comm.device().context().enable_event_tracking() };
                    }
                    comm.synchronize().unwrap();
                }
                records.lock().unwrap()[rank] = mine;
            });
        }
    });
    // A point's latency is its slowest rank's.
    let per_rank = records.into_inner().unwrap();
    let mut out: Vec<Record> = per_rank[0].clone();
    for (i, r) in out.iter_mut().enumerate() {
        let slowest = per_rank.iter().map(|m| m[i].latency_us).fold(0.0, f64::max);
        *r = {
            let a = At {
                dtype: DType::BF16,
                world,
                group: world,
                bytes: r.bytes,
            };
            record(a, &r.implementation, &r.algorithm, &r.mode, slowest)
        };
    }
    print_header();
    out.iter().for_each(print_record);
    out
}
