//! The CUDA half of the benchmark: peercomm and NCCL on the same devices, same buffers,
//! same run.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{group_end, group_start, Comm, NcclType, ReduceOp};
use peercomm::backend::cuda::Cuda;

use super::*;

fn iters_for(args: &Args, bytes: usize) -> usize {
    if let Some(calls) = args.batch_calls {
        return calls.max(1);
    }
    match bytes {
        b if b <= 1 << 20 => 50,
        b if b <= 16 << 20 => 20,
        b if b <= 256 << 20 => 5,
        _ => 2,
    }
}

/// Input sets per rank so that a batch cycles through more than the 60 MB L2.
fn sets_for(bytes: usize) -> usize {
    (192usize << 20).div_ceil(bytes).clamp(2, 16)
}

pub struct Gpu {
    pub comm: SingleController<Cuda>,
    pub streams: Vec<Arc<CudaStream>>,
    /// NCCL communicators per group size: `nccl[g][r]` for rank r.
    nccl: Vec<(usize, Vec<Comm>)>,
    /// NCCL with symmetric windows over the whole world, where the library has them.
    symmetric: Option<super::nccl_symmetric::Symmetric>,
}

impl Gpu {
    /// The NCCL communicators over groups of `group`, if NCCL runs in this benchmark.
    pub fn nccl_comms(&self, group: usize) -> Option<&[Comm]> {
        self.nccl
            .iter()
            .find(|(g, _)| *g == group)
            .map(|(_, c)| c.as_slice())
    }
}

/// The single-controller sweep over `world` ranks on `gpus` GPUs (rank r on GPU
/// r % gpus; with more ranks than GPUs they share, NCCL and the link figures are
/// skipped, and timings say nothing about a link).
pub fn run(args: &Args, world: usize, gpus: usize) -> Report {
    let max = args.max_bytes.unwrap_or(1 << 30);
    let shared = world > gpus;
    let config = CommConfig::default()
        .with_payload_bytes(max.max(1 << 20))
        // The slot holds the largest Lamport message and its 64-byte header.
        .with_lamport_slot_bytes(args.lamport_slot_bytes + 64)
        .with_barrier_timeout(Some(std::time::Duration::from_secs(30)))
        .with_max_blocks(if shared { Some(4) } else { args.max_blocks })
        .with_threads_per_block(args.threads)
        .with_allow_shared_devices(shared);
    if shared {
        println!("{world} ranks share {gpus} GPU(s): no NCCL, no link figures; timings say nothing about a link");
    }
    let ordinals: Vec<usize> = (0..world).map(|r| r % gpus).collect();
    let comm = SingleController::<Cuda>::new(&ordinals, config).expect("CUDA communicator");
    let streams: Vec<_> = comm
        .cores()
        .iter()
        .map(|r| r.device().stream().clone())
        .collect();
    let mut report = Report {
        date: chrono_free_date(),
        backend: format!("cuda ({})", comm.architecture()),
        api: "single-controller SingleController".into(),
        gpu_of_rank: Some(ordinals.clone()),
        devices: comm
            .cores()
            .iter()
            .map(|r| r.device().context().name().unwrap_or_else(|_| "?".into()))
            .collect(),
        ..Report::default()
    };
    println!(
        "peercomm-bench: single-controller SingleController, {} ({}), {}",
        machine_of(&report),
        comm.architecture(),
        report.date
    );
    println!("peercomm memory: {}", comm.memory_footprint());
    let groups = group_list(args, world);
    let mut gpu = Gpu {
        comm,
        streams,
        nccl: Vec::new(),
        symmetric: None,
    };
    if !args.no_nccl && !shared {
        for &g in &groups {
            let mut comms = Vec::new();
            for base in (0..world).step_by(g) {
                comms.extend(
                    Comm::from_devices(gpu.streams[base..base + g].to_vec())
                        .expect("NCCL communicator"),
                );
            }
            gpu.nccl.push((g, comms));
        }
        match super::nccl_symmetric::Symmetric::new(&gpu, max.min(256 << 20)) {
            Ok(s) => gpu.symmetric = Some(s),
            Err(why) => println!("no NCCL symmetric column: {why}"),
        }
    }
    if world >= 2 && !shared {
        let (one, both) = copy_engine_bandwidth(&gpu);
        let rtt = flag_round_trip(&gpu);
        println!("link: copy engine {one:.1} GB/s one way, {both:.1} GB/s each way both ways; flag round trip {rtt:.2} us");
        report.copy_engine_gbps_one_way = Some(one);
        report.copy_engine_gbps_both_ways = Some(both);
        report.flag_round_trip_us = Some(rtt);
        let launch = graph_launch(&gpu);
        report.graph_launch_us = Some(launch);
        println!(
            "floor per point: graph launch {launch:.2} us + one-way flag {:.2} us + bytes x 2(g-1)/g at {one:.1} GB/s",
            rtt / 2.0
        );
    }
    if args.host_cost {
        super::host_cost::run(&gpu, args);
    }
    let sizes = sizes(args, args.min_bytes, max);
    let mut pb = super::progress::Progress::new(
        args.dtypes.len() * groups.len() * sizes.len(),
        "all-reduce sweep",
    );
    let mut rng = rand::rngs::StdRng::from_os_rng();
    print_header();
    for dt in &args.dtypes {
        let dtype = parse_dtype(dt);
        for &group in &groups {
            for &bytes in &sizes {
                pb.set_message(format!("{dt} group {group} {}", human_bytes(bytes as f64)));
                let recs = match dtype {
                    DType::F32 => point::<f32>(&gpu, args, &mut rng, group, bytes),
                    DType::F16 => point::<half::f16>(&gpu, args, &mut rng, group, bytes),
                    DType::BF16 => point::<half::bf16>(&gpu, args, &mut rng, group, bytes),
                    other => unreachable!("parse_dtype gives f32, f16 or bf16, not {other:?}"),
                };
                pb.suspend(|| recs.iter().for_each(print_record));
                report.records.extend(recs);
                pb.inc();
            }
        }
    }
    pb.finish();
    if args.collectives {
        report
            .records
            .extend(super::collectives::run(&gpu, args, &sizes));
    }
    if args.overlap {
        report
            .records
            .extend(super::overlap::run(&gpu, args, &sizes));
    }
    if args.group_calls {
        report.records.extend(super::group::run(&gpu, args));
    }
    let peak = report.copy_engine_gbps_one_way.unwrap_or(0.0);
    if peak > 0.0 {
        let best = report
            .records
            .iter()
            .filter(|r| r.implementation == "peercomm-auto" && r.group == world)
            .map(|r| r.busbw_gbps)
            .fold(0.0, f64::max);
        println!(
            "peercomm peak bus bandwidth {best:.1} GB/s = {:.0}% of the copy-engine link bandwidth",
            100.0 * best / peak
        );
    }
    report
}

fn event(stream: &CudaStream) -> cudarc::driver::CudaEvent {
    stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("record event")
}

/// Median over batches of (slowest rank's batch time / calls per batch), in us.
pub fn time_batches(
    streams: &[Arc<CudaStream>],
    batches: usize,
    calls: usize,
    launch: impl FnMut(),
) -> f64 {
    time_gated_batches(streams, batches, calls, || {}, launch)
}

/// The gate of `--gate-us` on every rank of `comm`, enqueued before a batch's start
/// events: a barrier, a device-side wait of `gate_us`, a second barrier. The batch is
/// enqueued while the GPU waits, and every rank's window opens when the second
/// barrier lets go, so the window holds the GPU's work alone. Nothing with
/// `gate_us == 0`.
pub fn gate(comm: &SingleController<Cuda>, gate_us: u64) {
    if gate_us > 0 {
        comm.barrier(0).expect("gate barrier");
        comm.delay_all(std::time::Duration::from_micros(gate_us))
            .expect("gate wait");
        comm.barrier(0).expect("gate barrier");
    }
}

/// [`time_batches`] with `gate()` enqueued before each batch's start events (and
/// before the warm-up batch).
pub fn time_gated_batches(
    streams: &[Arc<CudaStream>],
    batches: usize,
    calls: usize,
    mut gate: impl FnMut(),
    mut launch: impl FnMut(),
) -> f64 {
    gate();
    launch();
    for s in streams {
        s.synchronize().unwrap();
    }
    let samples = (0..batches)
        .map(|_| {
            gate();
            let starts: Vec<_> = streams.iter().map(|s| event(s)).collect();
            launch();
            let ends: Vec<_> = streams.iter().map(|s| event(s)).collect();
            starts
                .iter()
                .zip(&ends)
                .map(|(a, b)| a.elapsed_ms(b).expect("elapsed") as f64)
                .fold(0.0, f64::max)
                * 1e3
                / calls as f64
        })
        .collect();
    median(samples)
}

fn copy_engine_bandwidth(gpu: &Gpu) -> (f64, f64) {
    let bytes = 256usize << 20;
    let n = bytes / 4;
    let dev = |r: usize| gpu.comm.core(r).device();
    let a0 = Cuda::alloc_buffer::<f32>(dev(0), n).unwrap();
    let mut b1 = Cuda::alloc_buffer::<f32>(dev(1), n).unwrap();
    let a1 = Cuda::alloc_buffer::<f32>(dev(1), n).unwrap();
    let mut b0 = Cuda::alloc_buffer::<f32>(dev(0), n).unwrap();
    let s = &gpu.streams;
    let (p_a0, _g1) = a0.device_ptr(&s[0]);
    let (p_b1, _g2) = b1.device_ptr_mut(&s[1]);
    let (p_a1, _g3) = a1.device_ptr(&s[1]);
    let (p_b0, _g4) = b0.device_ptr_mut(&s[0]);
    // Cross-device copies by unified address: the copy engine moves them over the link.
    let copy = |stream: &CudaStream, dst: u64, src: u64| {
        stream.context().bind_to_thread().unwrap();
        // SAFETY: both ranges are live 256 MiB allocations with peer access enabled.
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream()) }
            .result()
            .unwrap();
    };
    let one = time_batches(&s[..1], 10, 1, || copy(&s[0], p_b1, p_a0));
    let both = time_batches(&s[..2], 10, 1, || {
        copy(&s[0], p_b1, p_a0);
        copy(&s[1], p_b0, p_a1);
    });
    (
        bytes as f64 / (one * 1e-6) / 1e9,
        bytes as f64 / (both * 1e-6) / 1e9,
    )
}

fn flag_round_trip(gpu: &Gpu) -> f64 {
    let iters = 10_000u32;
    gpu.comm.launch_flag_ping_pong(100).unwrap();
    gpu.comm.synchronize().unwrap();
    let mut samples = Vec::new();
    for _ in 0..5 {
        // The launch zeroes the flags and waits for that, then enqueues both sides; the
        // few microseconds of launch are noise over 10,000 round trips.
        gpu.comm.launch_flag_ping_pong(iters).unwrap();
        let start = Instant::now();
        gpu.comm.synchronize().unwrap();
        samples.push(start.elapsed().as_secs_f64() * 1e6 / iters as f64);
    }
    median(samples)
}

/// Per-launch cost of a near-empty kernel (one block, no work) replayed from a graph of
/// 500 launches on rank 0's stream.
fn graph_launch(gpu: &Gpu) -> f64 {
    let launches = 500;
    let stream = &gpu.streams[..1];
    with_tracking(gpu, false);
    let graphs = capture(stream, || {
        for _ in 0..launches {
            gpu.comm
                .delay_rank(0, std::time::Duration::ZERO)
                .expect("empty launch");
        }
    });
    let t = time_batches(stream, 11, launches, || {
        graphs.iter().for_each(|g| g.launch().unwrap())
    });
    drop(graphs);
    with_tracking(gpu, true);
    t
}

/// Writes NaN over a buffer (the poison checked for afterwards).
fn poison<T: Element>(stream: &CudaStream, buf: &mut CudaSlice<T>) {
    // Benchmark sizes are multiples of 4 bytes, so whole words cover the buffer.
    let words = buf.len() * T::DTYPE.size() / 4;
    let pattern: u32 = match T::DTYPE {
        DType::F32 => 0x7FC0_0000,
        DType::F16 => 0x7E00_7E00,
        DType::BF16 => 0x7FC0_7FC0,
        // The other types: 0xa5 bytes.
        _ => 0xA5A5_A5A5,
    };
    let (ptr, _guard) = buf.device_ptr_mut(stream);
    // SAFETY: `ptr` covers buf.len() elements, `words` 32-bit words of them.
    unsafe { sys::cuMemsetD32Async(ptr, pattern, words, stream.cu_stream()) }
        .result()
        .unwrap();
}

pub fn with_tracking(gpu: &Gpu, on: bool) {
    for r in gpu.comm.cores() {
        r.device().stream().synchronize().unwrap();
        // SAFETY: every stream is idle; while tracking is off the benchmark orders its
        // own work (graph capture and replay on the ranks' streams only).
        unsafe {
            if on {
                r.device().context().enable_event_tracking()
            } else {
                r.device().context().disable_event_tracking()
            }
        }
    }
}

/// peercomm's safe capture helper (streams synchronised, cudarc's event tracking paused
/// and restored to what `with_tracking` set).
pub fn capture(streams: &[Arc<CudaStream>], mut body: impl FnMut()) -> Vec<CudaGraph> {
    peercomm::backend::cuda::capture(streams, || {
        body();
        Ok(())
    })
    .expect("captured graphs")
    .0
}

fn point<T: Element + NcclType>(
    gpu: &Gpu,
    args: &Args,
    rng: &mut rand::rngs::StdRng,
    group: usize,
    bytes: usize,
) -> Vec<Record> {
    let world = gpu.comm.world_size();
    let at = At {
        dtype: T::DTYPE,
        world,
        group,
        bytes,
    };
    let n = bytes / T::DTYPE.size();
    let sets = sets_for(bytes);
    let iters = iters_for(args, bytes);
    let dev = |r: usize| gpu.comm.core(r).device();
    let host: Vec<Vec<T>> = (0..world).map(|_| fill::<T>(rng, n)).collect();
    let mut ins: Vec<Vec<CudaSlice<T>>> = Vec::new();
    let mut outs: Vec<Vec<CudaSlice<T>>> = Vec::new();
    for (r, data) in host.iter().enumerate() {
        let mut first = Cuda::alloc_buffer::<T>(dev(r), n).unwrap();
        Cuda::upload(dev(r), data, &mut first).unwrap();
        let mut v = vec![first];
        for _ in 1..sets {
            let mut b = Cuda::alloc_buffer::<T>(dev(r), n).unwrap();
            gpu.streams[r].memcpy_dtod(&v[0], &mut b).unwrap();
            v.push(b);
        }
        ins.push(v);
        outs.push(
            (0..sets)
                .map(|_| Cuda::alloc_buffer::<T>(dev(r), n).unwrap())
                .collect(),
        );
    }
    let mut records = Vec::new();
    let call = |alg: Algorithm, set: usize, outs: &mut Vec<Vec<CudaSlice<T>>>| {
        let it: Vec<TensorView<Cuda>> = ins.iter().map(|v| TensorView::flat(&v[set])).collect();
        let mut ot: Vec<TensorViewMut<Cuda>> = outs
            .iter_mut()
            .map(|v| TensorViewMut::flat(&mut v[set]))
            .collect();
        gpu.comm.all_reduce(
            &it,
            &mut ot,
            &peercomm::ReduceOp::Sum,
            &AllReduceOptions::new().group_size(group).algorithm(alg),
        )
    };
    let download = |outs: &Vec<Vec<CudaSlice<T>>>| -> Vec<Vec<T>> {
        (0..world)
            .map(|r| Cuda::download(dev(r), &outs[r][0]).unwrap())
            .collect()
    };
    for alg in algorithms(args) {
        for (stream, out) in gpu.streams.iter().zip(outs.iter_mut()) {
            poison(stream, &mut out[0]);
        }
        let ran = match call(alg, 0, &mut outs) {
            Ok(a) => a,
            Err(_) => continue, // e.g. a forced Lamport above its slot: not applicable
        };
        gpu.comm.synchronize().expect("device error");
        let imp = format!("peercomm-{}", alg.name());
        if let Err(e) = check(&host, &download(&outs), group, &imp) {
            println!("WRONG SUM, not timed: {e}");
            continue;
        }
        let gated = || gate(&gpu.comm, args.gate_us);
        let eager = time_batches(&gpu.streams, args.batches, iters, || {
            for i in 0..iters {
                call(alg, i % sets, &mut outs).unwrap();
            }
        });
        records.push(record(at, &imp, ran.name(), "eager", eager));
        if !args.no_graph {
            with_tracking(gpu, false);
            let graphs = capture(&gpu.streams, || {
                for i in 0..iters {
                    call(alg, i % sets, &mut outs).unwrap();
                }
            });
            let t = time_gated_batches(&gpu.streams, args.batches, iters, gated, || {
                graphs.iter().for_each(|g| g.launch().unwrap())
            });
            drop(graphs);
            with_tracking(gpu, true);
            records.push(record(at, &imp, ran.name(), "graph", t));
        }
    }
    if let Some((_, comms)) = gpu.nccl.iter().find(|(g, _)| *g == group) {
        let nccl_call = |set: usize, outs: &mut Vec<Vec<CudaSlice<T>>>| {
            group_start().unwrap();
            for (r, c) in comms.iter().enumerate() {
                c.all_reduce(&ins[r][set], &mut outs[r][set], &ReduceOp::Sum)
                    .unwrap();
            }
            group_end().unwrap();
        };
        for (stream, out) in gpu.streams.iter().zip(outs.iter_mut()) {
            poison(stream, &mut out[0]);
        }
        nccl_call(0, &mut outs);
        for s in &gpu.streams {
            s.synchronize().unwrap();
        }
        match check(&host, &download(&outs), group, "nccl") {
            Err(e) => println!("NCCL WRONG SUM: {e}"),
            Ok(()) => {
                let gated = || gate(&gpu.comm, args.gate_us);
                let eager = time_batches(&gpu.streams, args.batches, iters, || {
                    for i in 0..iters {
                        nccl_call(i % sets, &mut outs);
                    }
                });
                records.push(record(at, "nccl", "nccl", "eager", eager));
                if !args.no_graph {
                    with_tracking(gpu, false);
                    let graphs = capture(&gpu.streams, || {
                        for i in 0..iters {
                            nccl_call(i % sets, &mut outs);
                        }
                    });
                    let t = time_gated_batches(&gpu.streams, args.batches, iters, gated, || {
                        graphs.iter().for_each(|g| g.launch().unwrap())
                    });
                    drop(graphs);
                    with_tracking(gpu, true);
                    records.push(record(at, "nccl", "nccl", "graph", t));
                }
            }
        }
    }
    if let Some(sym) = &gpu.symmetric {
        records.extend(sym.point(gpu, args, at, &host, iters));
    }
    records
}
