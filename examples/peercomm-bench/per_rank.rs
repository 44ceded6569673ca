//! The per-rank half of the benchmark (`--per-rank`): one thread per GPU (or, with
//! `--processes`, one process per GPU: the benchmark re-runs itself once per rank), each
//! with its own peercomm `Comm` and its own cudarc NCCL `Comm::from_rank`, as an engine
//! that runs a thread or a process per GPU does. Every rank times its own stream with device events;
//! a point's latency is the slowest rank's. Eager calls show what such an engine pays
//! per call on the host; graph replays the GPU cost. The sum is checked once per point
//! (inputs are rank + 1 everywhere, so the sum is exact in bf16 for small worlds).
//! NCCL is skipped when ranks share a GPU (it refuses two ranks on one device).

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use cudarc::nccl::{Comm as NcclComm, Id, ReduceOp};
use peercomm::backend::cuda::Cuda;
use peercomm::backend::TypedBuffer;
use peercomm::bootstrap::UniqueId;
use peercomm::{Algorithm, Comm};

use super::*;

/// Calls per timed batch (unless `--batch-calls` says otherwise).
const CALLS: usize = 50;

/// How a rank times its batches: `calls` calls a batch, and the `--gate-us` wait.
#[derive(Clone, Copy)]
struct Timing {
    batches: usize,
    calls: usize,
    gate_us: u64,
}

/// Median time per call over `batches` batches of `calls` calls, in us. Each batch
/// starts after a device-side barrier of every rank (`comm.barrier`, untimed), so that
/// the ranks' batches start together on the GPU: without it, one rank's window would
/// include the wait for a peer thread that started its batch late (a few percent at
/// 5 us per call). With a gate (`--gate-us`) the barrier is followed by a device-side
/// wait and a second barrier, so that every rank's batch is enqueued before any
/// window opens (see `gpu::gate`).
fn per_call_us(
    comm: &Comm<Cuda>,
    stream: &cudarc::driver::CudaStream,
    timing: Timing,
    mut batch: impl FnMut(),
) -> f64 {
    batch();
    stream.synchronize().unwrap();
    let samples = (0..timing.batches)
        .map(|_| batch_us(comm, stream, timing, &mut batch))
        .collect();
    median(samples)
}

/// [`per_call_us`] of two batches timed in turns (a, b, a, b, ...): their medians, each
/// over samples taken at the same times, so that a drift of the machine's speed during
/// the sweep moves both alike (an operator against the sum).
fn per_call_us_paired(
    comm: &Comm<Cuda>,
    stream: &cudarc::driver::CudaStream,
    timing: Timing,
    mut a: impl FnMut(),
    mut b: impl FnMut(),
) -> (f64, f64) {
    a();
    b();
    stream.synchronize().unwrap();
    let (mut sa, mut sb) = (Vec::new(), Vec::new());
    for _ in 0..timing.batches {
        sa.push(batch_us(comm, stream, timing, &mut a));
        sb.push(batch_us(comm, stream, timing, &mut b));
    }
    (median(sa), median(sb))
}

/// One timed batch, per call in us, after the barrier (and gate) that starts the ranks'
/// batches together.
fn batch_us(
    comm: &Comm<Cuda>,
    stream: &cudarc::driver::CudaStream,
    timing: Timing,
    batch: &mut impl FnMut(),
) -> f64 {
    comm.barrier(0).unwrap();
    if timing.gate_us > 0 {
        comm.delay(Duration::from_micros(timing.gate_us)).unwrap();
        comm.barrier(0).unwrap();
    }
    let a = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    batch();
    let b = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    a.elapsed_ms(&b).unwrap() as f64 * 1e3 / timing.calls as f64
}

/// Host time per eager call, on the host clock (the GPU work drained outside the timed
/// part): the staged call, the zero-copy call and an empty kernel launched through the
/// same path (`Comm::delay` of zero: peercomm's launch without validation, planning or
/// buffers). Every rank runs it (the calls are collective); rank 0 prints.
#[allow(clippy::too_many_arguments)]
fn host_cost(
    comm: &Comm<Cuda>,
    stream: &cudarc::driver::CudaStream,
    rank: usize,
    bytes: usize,
    send: &CudaSlice<half::bf16>,
    symmetric: &peercomm::SymmetricBuffer<Cuda, half::bf16>,
    recv: &mut CudaSlice<half::bf16>,
) {
    const N: usize = 20;
    let time = |f: &mut dyn FnMut()| {
        let samples = (0..9)
            .map(|_| {
                rendezvous(comm);
                let t = std::time::Instant::now();
                for _ in 0..N {
                    f();
                }
                let us = t.elapsed().as_secs_f64() * 1e6 / N as f64;
                stream.synchronize().unwrap();
                us
            })
            .collect();
        median(samples)
    };
    let opts = AllReduceOptions::new();
    let staged = time(&mut || {
        comm.all_reduce_with(send, recv, &peercomm::ReduceOp::Sum, &opts)
            .unwrap();
    });
    let zero_copy = time(&mut || {
        comm.all_reduce_with(symmetric, recv, &peercomm::ReduceOp::Sum, &opts)
            .unwrap();
    });
    let launch = time(&mut || comm.delay(Duration::ZERO).unwrap());
    // The staged call again with cudarc's event tracking off: what is left above the
    // launch is peercomm's own (checks, lookup, plan, descriptor, arguments); the
    // difference to the tracked call is the waits and records cudarc's safety asks
    // for on a `CudaSlice` (a wait for its last write and a read record on the input;
    // waits for its last read and write and a write record on the output).
    set_tracking(comm, stream, false);
    let untracked = time(&mut || {
        comm.all_reduce_with(send, recv, &peercomm::ReduceOp::Sum, &opts)
            .unwrap();
    });
    set_tracking(comm, stream, true);
    comm.synchronize().unwrap();
    if rank == 0 {
        println!(
            "host cost {:>9}: staged call {staged:6.2} us, symmetric call {zero_copy:6.2} us, empty launch {launch:6.2} us: {:.2}x / {:.2}x the launch",
            human_bytes(bytes as f64),
            staged / launch,
            zero_copy / launch
        );
        println!(
            "host cost {:>9}: staged call, cudarc event tracking off {untracked:6.2} us: {:.2}x the launch (cudarc's events {:.2} us, peercomm above the launch {:.2} us)",
            human_bytes(bytes as f64),
            untracked / launch,
            staged - untracked,
            untracked - launch
        );
    }
}

/// Turns cudarc's event tracking of this rank's context on or off, between two
/// rendezvous of every rank (threads sharing a GPU share its context: no rank may be
/// inside a call while the flag changes).
fn set_tracking(comm: &Comm<Cuda>, stream: &cudarc::driver::CudaStream, on: bool) {
    rendezvous(comm);
    // SAFETY: every rank's stream is idle (the rendezvous synchronised them); while
    // tracking is off the benchmark uses its buffers on the rank's own stream only.
    unsafe {
        if on {
            stream.context().enable_event_tracking()
        } else {
            stream.context().disable_event_tracking()
        }
    }
    rendezvous(comm);
}

/// The peercomm `UniqueId` the parent made, as a string.
const CHILD_ID: &str = "PEERCOMM_BENCH_UNIQUE_ID";
/// The NCCL id the parent made, as hex (absent without NCCL).
const CHILD_NCCL_ID: &str = "PEERCOMM_BENCH_NCCL_ID";
/// Prefix of the line on which a child reports its records (JSON).
const RECORDS_LINE: &str = "PEERCOMM_BENCH_RECORDS ";

/// The per-rank run as a report: the sweep's records and the machine they ran on.
pub fn report(args: &Args, world: usize, gpus: usize) -> Report {
    let gpu_of_rank: Vec<usize> = (0..world).map(|r| r % gpus).collect();
    // Names through the driver, without a context in this process (the children of
    // --processes make their own).
    let name = |ordinal: usize| {
        cudarc::driver::result::init()
            .and_then(|()| cudarc::driver::result::device::get(ordinal as i32))
            .and_then(cudarc::driver::result::device::get_name)
            .unwrap_or_else(|_| "?".into())
    };
    let how = if args.processes {
        "processes"
    } else {
        "threads"
    };
    Report {
        date: chrono_free_date(),
        backend: format!("cuda (per-rank {how})"),
        api: format!("per-rank Comm ({how})"),
        devices: gpu_of_rank.iter().map(|&o| name(o)).collect(),
        gpu_of_rank: Some(gpu_of_rank),
        records: run(args, world, gpus),
        ..Report::default()
    }
}

/// Runs the per-rank sweep over `world` ranks on `gpus` GPUs (round-robin), in threads
/// or (`--processes`) in child processes; in a child, runs that child's rank and exits.
pub fn run(args: &Args, world: usize, gpus: usize) -> Vec<Record> {
    if let Ok(rank) = std::env::var(CHILD_RANK) {
        run_child(args, rank.parse().expect("child rank"), world, gpus);
    }
    let shared = gpus < world;
    let with_nccl = !args.no_nccl && !shared;
    println!(
        "per-rank mode: {world} {} on {gpus} GPU(s){}{}",
        if args.processes {
            "processes"
        } else {
            "threads"
        },
        if shared {
            " (shared: timings mean nothing)"
        } else {
            ""
        },
        if with_nccl { "" } else { ", no NCCL" }
    );
    let id = UniqueId::new().expect("bootstrap id");
    let nccl_id = with_nccl.then(|| Id::new().expect("NCCL id"));
    let per_rank = if args.processes {
        spawn_children(world, &id, nccl_id)
    } else {
        let records = Mutex::new(vec![Vec::new(); world]);
        std::thread::scope(|s| {
            for rank in 0..world {
                let (id, records) = (&id, &records);
                s.spawn(move || {
                    let mine = sweep(args, rank, world, gpus, id, nccl_id);
                    records.lock().unwrap()[rank] = mine;
                });
            }
        });
        records.into_inner().unwrap()
    };
    let mode = if args.processes { "process" } else { "thread" };
    slowest_rank(per_rank, world, mode)
}

/// A child of `--processes`: runs its rank, prints its records on one line, exits.
fn run_child(args: &Args, rank: usize, world: usize, gpus: usize) -> ! {
    let id: UniqueId = std::env::var(CHILD_ID)
        .expect("the parent passes the id")
        .parse()
        .expect("a valid UniqueId");
    let nccl_id = std::env::var(CHILD_NCCL_ID).ok().map(|hex| {
        let mut internal = [0 as std::ffi::c_char; 128];
        for (i, b) in internal.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex") as std::ffi::c_char;
        }
        Id::uninit(internal)
    });
    let mine = sweep(args, rank, world, gpus, &id, nccl_id);
    println!("{RECORDS_LINE}{}", serde_json::to_string(&mine).unwrap());
    std::process::exit(0)
}

/// Starts one child per rank (this executable, same arguments) and collects their
/// records.
fn spawn_children(world: usize, id: &UniqueId, nccl_id: Option<Id>) -> Vec<Vec<Record>> {
    // Rank 0 is a child: it binds the id's address itself, so this process lets go.
    id.release();
    let exe = std::env::current_exe().expect("own executable");
    let children: Vec<_> = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.args(std::env::args_os().skip(1))
                .env(CHILD_RANK, rank.to_string())
                .env(CHILD_ID, id.to_string())
                .stdout(Stdio::piped());
            if let Some(nid) = &nccl_id {
                let hex: String = nid
                    .internal()
                    .iter()
                    .map(|b| format!("{:02x}", *b as u8))
                    .collect();
                cmd.env(CHILD_NCCL_ID, hex);
            }
            cmd.spawn().expect("start a rank process")
        })
        .collect();
    children
        .into_iter()
        .enumerate()
        .map(|(rank, mut child)| {
            let out = child.stdout.take().unwrap();
            let mut records = None;
            for line in std::io::BufReader::new(out).lines() {
                let line = line.expect("child output");
                match line.strip_prefix(RECORDS_LINE) {
                    Some(json) => records = Some(serde_json::from_str(json).expect("records")),
                    None => println!("[rank {rank}] {line}"),
                }
            }
            let status = child.wait().expect("child exit");
            assert!(status.success(), "rank {rank} process failed: {status}");
            records.unwrap_or_else(|| panic!("rank {rank} reported no records"))
        })
        .collect()
}

/// A point's latency is its slowest rank's.
fn slowest_rank(per_rank: Vec<Vec<Record>>, world: usize, mode: &str) -> Vec<Record> {
    let mut out: Vec<Record> = per_rank[0].clone();
    for (i, r) in out.iter_mut().enumerate() {
        let slowest = per_rank.iter().map(|m| m[i].latency_us).fold(0.0, f64::max);
        let a = At {
            dtype: DType::BF16,
            world,
            group: world,
            bytes: r.bytes,
        };
        // "peercomm-per-rank" -> "peercomm-per-rank-thread", and the symmetric-buffer
        // variant -> "peercomm-per-rank-thread-symmetric".
        let imp = if r.implementation.contains("per-rank") {
            r.implementation
                .replacen("per-rank", &format!("per-rank-{mode}"), 1)
        } else {
            format!("{}-{mode}", r.implementation)
        };
        *r = record(a, &imp, &r.algorithm, &r.mode, slowest);
    }
    print_header();
    out.iter().for_each(print_record);
    out
}

/// Every rank at the same point: a barrier over peercomm's own signals, then a wait
/// for it on the host (ranks may be threads or processes).
fn rendezvous(comm: &Comm<Cuda>) {
    comm.barrier(0).unwrap();
    comm.synchronize().unwrap();
}

/// One rank's sweep: its records, in the same order on every rank.
fn sweep(
    args: &Args,
    rank: usize,
    world: usize,
    gpus: usize,
    id: &UniqueId,
    nccl_id: Option<Id>,
) -> Vec<Record> {
    let shared = gpus < world;
    let sizes = sizes(args, args.min_bytes, args.max_bytes.unwrap_or(1 << 20));
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let config = CommConfig::default()
        .with_payload_bytes(largest.max(1 << 20))
        // The slot holds the largest Lamport message and its 64-byte header.
        .with_lamport_slot_bytes(args.lamport_slot_bytes + 64)
        .with_barrier_timeout(Some(Duration::from_secs(30)))
        .with_max_blocks(if shared { Some(4) } else { args.max_blocks })
        .with_threads_per_block(args.threads)
        .with_allow_shared_devices(shared);
    let dev = Cuda::open(rank % gpus).expect("device");
    let stream = dev.stream().clone();
    let comm = Comm::<Cuda>::from_rank(dev, rank, world, id, config).expect("peercomm Comm");
    let nccl = nccl_id
        .map(|i| NcclComm::from_rank(stream.clone(), rank, world, i).expect("NCCL from_rank"));
    let calls = args.batch_calls.unwrap_or(CALLS).max(1);
    let timing = Timing {
        batches: args.batches,
        calls,
        gate_us: args.gate_us,
    };
    // Eager batches are never gated: their host cost is what they measure.
    let eager_timing = Timing {
        gate_us: 0,
        ..timing
    };
    let mut mine = Vec::new();
    // Rank 0 shows the progress (its thread, or its process's stderr).
    let mut progress =
        (rank == 0).then(|| super::progress::Progress::new(sizes.len(), "per-rank sweep"));
    for &bytes in &sizes {
        if let Some(p) = progress.as_mut() {
            p.set_message(human_bytes(bytes as f64));
        }
        let n = bytes / 2;
        let send: CudaSlice<half::bf16> = stream
            .clone_htod(&vec![half::bf16::from_f32(rank as f32 + 1.0); n])
            .unwrap();
        let mut recv = stream.alloc_zeros::<half::bf16>(n).unwrap();
        // The same input in the symmetric pool: the peers read it in place.
        let mut symmetric = comm
            .alloc_symmetric::<half::bf16>(n)
            .expect("a symmetric buffer");
        symmetric
            .copy_from_host(
                comm.device(),
                &vec![half::bf16::from_f32(rank as f32 + 1.0); n],
            )
            .unwrap();
        let opts = AllReduceOptions::new();
        rendezvous(&comm);
        if args.host_cost && bytes <= 256 << 10 {
            host_cost(&comm, &stream, rank, bytes, &send, &symmetric, &mut recv);
        }
        let want = (world * (world + 1) / 2) as f32;
        let check = |what: &str, recv: &mut CudaSlice<half::bf16>| {
            let got = stream.clone_dtoh(recv).unwrap();
            assert!(
                got.iter().all(|x| x.to_f32() == want),
                "rank {rank}: wrong sum at {bytes} B ({what})"
            );
            stream.memset_zeros(recv).unwrap();
        };
        let algorithm = comm
            .all_reduce_with(&send, &mut recv, &peercomm::ReduceOp::Sum, &opts)
            .unwrap();
        comm.synchronize().unwrap();
        check("staged", &mut recv);
        let sym_algorithm = comm
            .all_reduce_with(&symmetric, &mut recv, &peercomm::ReduceOp::Sum, &opts)
            .unwrap();
        comm.synchronize().unwrap();
        check("symmetric", &mut recv);
        let at = |imp: &str, alg: &str, mode: &str, us| {
            let a = At {
                dtype: DType::BF16,
                world,
                group: world,
                bytes,
            };
            record(a, imp, alg, mode, us)
        };
        rendezvous(&comm);
        let eager = per_call_us(&comm, &stream, eager_timing, || {
            for _ in 0..calls {
                comm.all_reduce_with(&send, &mut recv, &peercomm::ReduceOp::Sum, &opts)
                    .unwrap();
            }
        });
        mine.push(at("peercomm-per-rank", algorithm.name(), "eager", eager));
        rendezvous(&comm);
        let eager = per_call_us(&comm, &stream, eager_timing, || {
            for _ in 0..calls {
                comm.all_reduce_with(&symmetric, &mut recv, &peercomm::ReduceOp::Sum, &opts)
                    .unwrap();
            }
        });
        mine.push(at(
            "peercomm-per-rank-symmetric",
            sym_algorithm.name(),
            "eager",
            eager,
        ));
        if let Some(nccl) = &nccl {
            rendezvous(&comm);
            let eager = per_call_us(&comm, &stream, eager_timing, || {
                for _ in 0..calls {
                    nccl.all_reduce(&send, &mut recv, &ReduceOp::Sum).unwrap();
                }
            });
            mine.push(at("nccl-per-rank", "nccl", "eager", eager));
        }
        if !args.no_graph {
            let graph_of = |body: &mut dyn FnMut()| {
                comm.capture(|| {
                    body();
                    Ok(())
                })
                .expect("a captured graph")
                .0
            };
            let ours = graph_of(&mut || {
                for _ in 0..calls {
                    comm.all_reduce_with(&send, &mut recv, &peercomm::ReduceOp::Sum, &opts)
                        .unwrap();
                }
            });
            let zero_copy = graph_of(&mut || {
                for _ in 0..calls {
                    comm.all_reduce_with(&symmetric, &mut recv, &peercomm::ReduceOp::Sum, &opts)
                        .unwrap();
                }
            });
            // The staged call's plain buffers, captured registered: the graph reads them
            // in place (one registration, shared by the 50 calls).
            let (registered, registered_algorithm) = comm
                .capture_registered(|| {
                    let mut ran = Algorithm::Auto;
                    for _ in 0..calls {
                        ran = comm.all_reduce_with(
                            &send,
                            &mut recv,
                            &peercomm::ReduceOp::Sum,
                            &opts,
                        )?;
                    }
                    Ok(ran)
                })
                .expect("a registered capture");
            // Each other operator, staged as the sum: every rank's input is rank + 1, so
            // each result is a small exact integer.
            for name in &args.ops {
                let op = match name.as_str() {
                    "prod" => peercomm::ReduceOp::Prod,
                    "max" => peercomm::ReduceOp::Max,
                    "min" => peercomm::ReduceOp::Min,
                    "avg" => peercomm::ReduceOp::Avg,
                    other => panic!("--ops: {other} is not prod, max, min or avg"),
                };
                let w = world as f32;
                let want = match op {
                    peercomm::ReduceOp::Prod => (1..=world).map(|r| r as f32).product(),
                    peercomm::ReduceOp::Max => w,
                    peercomm::ReduceOp::Min => 1.0,
                    _ => half::bf16::from_f32((w + 1.0) / 2.0).to_f32(),
                };
                let ran = comm.all_reduce_with(&send, &mut recv, &op, &opts).unwrap();
                comm.synchronize().unwrap();
                let got = stream.clone_dtoh(&recv).unwrap();
                assert!(
                    got.iter().all(|x| x.to_f32() == want),
                    "rank {rank}: wrong {name} at {bytes} B"
                );
                let graph = graph_of(&mut || {
                    for _ in 0..calls {
                        comm.all_reduce_with(&send, &mut recv, &op, &opts).unwrap();
                    }
                });
                // Timed in turns with the sum's graph: the ratio compares samples taken
                // at the same times.
                rendezvous(&comm);
                let (us, sum_us) = per_call_us_paired(
                    &comm,
                    &stream,
                    timing,
                    || graph.launch().unwrap(),
                    || ours.launch().unwrap(),
                );
                mine.push(at(
                    &format!("peercomm-per-rank-{name}"),
                    ran.name(),
                    "graph",
                    us,
                ));
                mine.push(at(
                    &format!("peercomm-per-rank-{name}-sum"),
                    algorithm.name(),
                    "graph",
                    sum_us,
                ));
            }
            let time = |launch: &dyn Fn()| per_call_us(&comm, &stream, timing, launch);
            let row = |imp: &str, alg: &str, us: f64| at(imp, alg, "graph", us);
            let sweep = super::exchange::Sweep {
                comm: &comm,
                stream: &stream,
                calls,
                time: &time,
                row: &row,
            };
            if !args.sum_types.is_empty() {
                rendezvous(&comm);
                mine.extend(super::types::rows(&sweep, bytes, &args.sum_types));
            }
            if args.exchange {
                rendezvous(&comm);
                mine.extend(super::exchange::rows(&sweep, n));
            }
            let theirs = nccl.as_ref().map(|nccl| {
                graph_of(&mut || {
                    for _ in 0..calls {
                        nccl.all_reduce(&send, &mut recv, &ReduceOp::Sum).unwrap();
                    }
                })
            });
            rendezvous(&comm);
            let graph = per_call_us(&comm, &stream, timing, || ours.launch().unwrap());
            mine.push(at("peercomm-per-rank", algorithm.name(), "graph", graph));
            rendezvous(&comm);
            let graph = per_call_us(&comm, &stream, timing, || zero_copy.launch().unwrap());
            mine.push(at(
                "peercomm-per-rank-symmetric",
                sym_algorithm.name(),
                "graph",
                graph,
            ));
            rendezvous(&comm);
            let graph = per_call_us(&comm, &stream, timing, || registered.launch().unwrap());
            mine.push(at(
                "peercomm-per-rank-registered",
                registered_algorithm.name(),
                "graph",
                graph,
            ));
            drop(registered);
            if let Some(theirs) = theirs {
                rendezvous(&comm);
                let graph = per_call_us(&comm, &stream, timing, || theirs.launch().unwrap());
                mine.push(at("nccl-per-rank", "nccl", "graph", graph));
            }
        }
        comm.synchronize().unwrap();
        if let Some(p) = progress.as_mut() {
            p.inc();
        }
    }
    if let Some(p) = progress {
        p.finish();
    }
    mine
}
