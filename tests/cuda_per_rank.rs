//! The per-rank communicator on CUDA, one thread per rank: the generic suite
//! (tests/per_rank_suite) and the CUDA-only tests (processes, graphs, descriptors).
//! With fewer GPUs than ranks, ranks share GPUs (each with its own stream and signal;
//! few blocks so every rank's blocks are resident). Without a GPU every test prints
//! why it is skipped.
#![cfg(feature = "cuda")]

mod common;
mod per_rank_suite;

use peercomm::backend::cuda::Cuda;
use peercomm::backend::{Backend, TypedBuffer as _};
use peercomm::ReduceOp;
use per_rank_suite::capture_graphs as graphs;
use per_rank_suite::descriptor_channel::{self, Strangers};
use per_rank_suite::{gpu_placement, process_faults, processes, GPU_SCOPE};

per_rank_suite!(Cuda, gpu_placement::<Cuda>, GPU_SCOPE);

/// The child processes' entry point (does nothing when run as a normal test).
#[test]
fn per_rank_child() {
    if let Some((role, rank, world, id, seed)) = processes::child_args() {
        if graphs::child(&role, rank, world, &id, seed) {
            return;
        }
        let place = suite_place("per_rank_child").expect("a CUDA device in the child");
        if descriptor_channel::child::<Cuda>(&role, &place, (rank, world, &id), registers) {
            return;
        }
        processes::child_main::<Cuda>(&place);
    }
}

/// A registration whose memory CUDA exports only as a descriptor (a buffer from a pool
/// made with the POSIX-fd handle type), dropped again.
fn registers(comm: &peercomm::Comm<Cuda>) -> Result<(), peercomm::Error> {
    let buffer = graphs::alloc::<f32>(comm, graphs::Memory::PosixPool, 4096);
    comm.register_borrowed(buffer.as_view())
        .map(drop)
        .map_err(|e| e.error)
}

// One process per rank: IPC handles between processes (on one GPU the two processes
// time-slice it, which is slow but exercises the same mapping).
per_rank_test! {
    /// The descriptor channel beside an idle connection of another user (nobody): every
    /// rank registers a POSIX-fd pool buffer within the bound, alike (skipped where the
    /// test is not root).
    descriptor_channel_beside_another_user: |p| descriptor_channel::beside_strangers::<Cuda>(p, registers, Strangers::AnotherUser);
    /// The descriptor channel beside idle, garbage and wrong-nonce connections of this
    /// user (other processes, and the peer's own process): ignored, every rank registers
    /// within the bound, alike.
    descriptor_channel_beside_bogus_senders: |p| descriptor_channel::beside_strangers::<Cuda>(p, registers, Strangers::Bogus);
    processes_world_2: |p| processes::checked_world::<Cuda>(p, 2);
    /// Real CUDA_VISIBLE_DEVICES isolation: rank r's process sees only GPU r, as its
    /// device 0 (rank 0 is the test process, on its device 0). Needs two GPUs.
    isolated_processes_world_2: |p| if p.devices < 2 {
        common::announce_skip("isolated_processes_world_2", "needs 2 CUDA devices")
    } else {
        processes::isolated_world::<Cuda>(p, 2, Some("CUDA_VISIBLE_DEVICES"))
    };
    killed_process_gives_a_typed_error: |p| process_faults::killed_process_gives_a_typed_error::<Cuda>(p);
    registration_beside_a_killed_peer: |p| process_faults::registration_beside_a_killed_peer::<Cuda>(p);
    create_drop_cycles_leak_nothing: |p| process_faults::create_drop_cycles_leak_nothing::<Cuda>(p, 200);
    /// Symmetric inputs across processes through CUDA IPC. Whether cudarc's own
    /// allocations can be registered across processes depends on the driver's pools:
    /// either way is accepted (a refusal is CannotRegister on every rank, buffer back).
    zero_copy_processes_world_2: |p| per_rank_suite::zero_copy::processes::symmetric_processes::<Cuda>(p, 2, false);
    zero_copy_cycles_leak_nothing: |_p| per_rank_suite::zero_copy::processes::cycles_leak_nothing::<Cuda>(200, false);
    capture_registered_world_2: |p| graphs::replays_read_in_place(p, 2);
    capture_registered_world_4: |p| graphs::replays_read_in_place(p, 4);
    /// `Comm::capture_registered` with one process per rank: `cuMemAlloc` inputs exported
    /// through CUDA IPC and read in place by every replay; cudarc's pool buffers refused
    /// alike on every rank.
    capture_registered_processes_world_2: |_p| graphs::processes_world(2);
    /// Registration across processes of memory CUDA exports only as a POSIX file
    /// descriptor (a pool made with that handle type, and virtual memory that requested
    /// it): read in place, bitwise equal on every rank; virtual memory without a
    /// shareable handle type refused alike; 1,000 register/drop cycles per kind leak no
    /// fd or mapping.
    register_shareable_processes_world_2: |_p| graphs::shareable_processes_world(2);
}

/// Each rank captures its own all-reduce into a CUDA graph on its own stream and
/// replays it with new inputs uploaded between replays; every replay is checked on
/// every rank against the f64 reference (one-stage staged, and Lamport).
#[test]
fn graph_replays() {
    use peercomm::{Algorithm, AllReduceOptions};
    let Some(place) = suite_place("graph_replays") else {
        return;
    };
    let seed = common::seed("graph_replays");
    let world = 2;
    let replays = 200;
    let checked = per_rank_suite::with_world::<Cuda, _>(&place, world, |rank, comm| {
        let dev = comm.device();
        let len = 12_345;
        let mut done = 0;
        for algorithm in [Algorithm::OneStage, Algorithm::Lamport] {
            let mut send = Cuda::alloc_buffer::<f32>(dev, len).unwrap();
            let mut recv = Cuda::alloc_buffer::<f32>(dev, len).unwrap();
            let opts = AllReduceOptions::new().algorithm(algorithm);
            let (graph, _) = comm
                .capture(|| comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &opts))
                .unwrap();
            for i in 0..replays {
                let call = done + i;
                let mine = per_rank_suite::processes::input(seed, call, rank, len);
                Cuda::upload(dev, &mine, &mut send).unwrap();
                Cuda::upload(dev, &vec![f32::NAN; len], &mut recv).unwrap();
                graph.launch().unwrap();
                comm.synchronize().unwrap();
                let got = Cuda::download(dev, &recv).unwrap();
                let ins: Vec<Vec<f32>> = (0..world)
                    .map(|r| per_rank_suite::processes::input(seed, call, r, len))
                    .collect();
                common::check_sums(
                    &ins,
                    &vec![got; world],
                    world,
                    &format!("rank {rank} replay {i} of {}", algorithm.name()),
                );
            }
            done += replays;
            drop(graph);
        }
        done
    });
    eprintln!("graph_replays: {} replays checked per rank", checked[0]);
}

/// Each rank captures an all-gather, a reduce-scatter, a broadcast, a scatter and the
/// fused all-reduce + residual + RMSNorm into one graph and replays it with new inputs
/// (and a fresh residual) every time; every replay is checked.
#[test]
fn collectives_graph_replays() {
    use common::collectives::{assert_bits, check_rms_norm, expect, Which};
    use half::bf16;
    use peercomm::CollectiveOptions;
    use rand::SeedableRng;
    let Some(place) = suite_place("collectives_graph_replays") else {
        return;
    };
    let seed = common::seed("collectives_graph_replays");
    let (world, replays, n, hidden, tokens) = (2, 50, 4099, 4096, 3);
    per_rank_suite::with_world::<Cuda, _>(&place, world, |rank, comm| {
        let dev = comm.device();
        let buf = |len: usize| Cuda::alloc_buffer::<bf16>(dev, len).unwrap();
        let (mut x, mut wide) = (buf(n), buf(n * world));
        let part_len = peercomm::reduce_scatter_part(n * world, world, rank).len();
        let (mut gathered, mut part, mut bcast, mut piece) =
            (buf(n * world), buf(part_len), buf(n), buf(n));
        let (mut partial, mut res, mut weight, mut normed) = (
            buf(tokens * hidden),
            buf(tokens * hidden),
            buf(hidden),
            buf(tokens * hidden),
        );
        let o = CollectiveOptions::new();
        let (graph, _) = comm
            .capture(|| {
                comm.all_gather_with(&x, &mut gathered, &o)?;
                comm.reduce_scatter_with(&wide, &mut part, &ReduceOp::Sum, &o)?;
                comm.broadcast_with(Some(&x), &mut bcast, 1, &o)?;
                comm.scatter_with(Some(&wide), &mut piece, 0, &o)?;
                let (p, w) = (&partial, &weight);
                comm.all_reduce_residual_rms_norm(p, &mut res, w, &mut normed, 1e-5, &o)
            })
            .unwrap();
        for i in 0..replays {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ ((i as u64) << 16));
            let xs = common::random_inputs::<bf16>(&mut rng, world, n);
            let wides = common::random_inputs::<bf16>(&mut rng, world, n * world);
            let partials = common::random_inputs::<bf16>(&mut rng, world, tokens * hidden);
            let residual = common::random_values::<bf16>(&mut rng, tokens * hidden);
            let w = common::random_values::<bf16>(&mut rng, hidden);
            Cuda::upload(dev, &xs[rank], &mut x).unwrap();
            Cuda::upload(dev, &wides[rank], &mut wide).unwrap();
            Cuda::upload(dev, &partials[rank], &mut partial).unwrap();
            Cuda::upload(dev, &residual, &mut res).unwrap();
            Cuda::upload(dev, &w, &mut weight).unwrap();
            for out in [
                &mut gathered,
                &mut part,
                &mut bcast,
                &mut piece,
                &mut normed,
            ] {
                let len = out.len();
                Cuda::upload(dev, &vec![bf16::NAN; len], out).unwrap();
            }
            graph.launch().unwrap();
            comm.synchronize().unwrap();
            let what = |c: &str| format!("rank {rank} replay {i} {c}");
            let get = |b: &cudarc::driver::CudaSlice<bf16>| Cuda::download(dev, b).unwrap();
            let (bcast_from_1, scatter_from_0) = (
                Which::Broadcast {
                    root: 1,
                    in_place: false,
                },
                Which::Scatter { root: 0 },
            );
            for (out, which, ins, name) in [
                (&gathered, Which::AllGather, &xs, "all-gather"),
                (&part, Which::ReduceScatter, &wides, "reduce-scatter"),
                (&bcast, bcast_from_1, &xs, "broadcast"),
                (&piece, scatter_from_0, &wides, "scatter"),
            ] {
                assert_bits(&get(out), &expect(which, ins, world, rank), &what(name));
            }
            let (normed, res, what) = (get(&normed), get(&res), what("fused"));
            check_rms_norm(
                &partials, &residual, &w, world, rank, 1e-5, &normed, &res, &what,
            );
        }
    });
}

/// Each rank captures a ring shift (a group of a send and a receive, one message in
/// chunks, staged) and an uneven all-to-all from a symmetric buffer (read in place) into
/// one graph and replays it with new inputs every time; every replay is checked bit for
/// bit against what the peers sent.
#[test]
fn exchange_graph_replays() {
    let Some(place) = suite_place("exchange_graph_replays") else {
        return;
    };
    let seed = common::seed("exchange_graph_replays");
    let (world, replays, n) = (3, 30, 3 << 20);
    // Rank r sends rank q (r + 2q + 1) * 1000 elements.
    let count = |r: usize, q: usize| (r + 2 * q + 1) * 1000;
    per_rank_suite::with_world::<Cuda, _>(&place, world, |rank, comm| {
        let dev = comm.device();
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        let sends: Vec<usize> = (0..world).map(|q| count(rank, q)).collect();
        let recvs: Vec<usize> = (0..world).map(|q| count(q, rank)).collect();
        let (total_send, total_recv) = (sends.iter().sum(), recvs.iter().sum::<usize>());
        let mut ring_in = Cuda::alloc_buffer::<f32>(dev, n).unwrap();
        let mut ring_out = Cuda::alloc_buffer::<f32>(dev, n).unwrap();
        // The all-to-all-v's input in the symmetric pool (of one size on every rank):
        // the peers read it in place, replay after replay.
        let widest = (0..world)
            .map(|r| (0..world).map(|q| count(r, q)).sum::<usize>())
            .max()
            .unwrap();
        let mut a2a_in = comm.alloc_symmetric::<f32>(widest).unwrap();
        let mut a2a_out = Cuda::alloc_buffer::<f32>(dev, total_recv).unwrap();
        let (graph, _) = comm
            .capture(|| {
                let mut group = comm.group();
                group.send(&ring_in, next)?;
                group.recv(&mut ring_out, prev)?;
                group.end()?;
                comm.all_to_all_v(&a2a_in, &sends, &mut a2a_out, &recvs)
            })
            .unwrap();
        let input = |call: usize, r: usize, len: usize| processes::input(seed, call, r, len);
        for i in 0..replays {
            let (ring, a2a) = (2 * i, 2 * i + 1);
            Cuda::upload(dev, &input(ring, rank, n), &mut ring_in).unwrap();
            let mut mine = input(a2a, rank, total_send);
            mine.resize(widest, 0.0);
            a2a_in.copy_from_host(dev, &mine).unwrap();
            Cuda::upload(dev, &vec![f32::NAN; n], &mut ring_out).unwrap();
            Cuda::upload(dev, &vec![f32::NAN; total_recv], &mut a2a_out).unwrap();
            graph.launch().unwrap();
            comm.synchronize().unwrap();
            let got = common::bits(&Cuda::download(dev, &ring_out).unwrap());
            let want = common::bits(&input(ring, prev, n));
            assert!(
                got == want,
                "rank {rank} replay {i}: the ring shift from rank {prev}"
            );
            let got = common::bits(&Cuda::download(dev, &a2a_out).unwrap());
            let mut at = 0;
            for q in 0..world {
                let theirs = common::bits(&input(a2a, q, (0..world).map(|x| count(q, x)).sum()));
                let start: usize = (0..rank).map(|x| count(q, x)).sum();
                let len = count(q, rank);
                let what = format!("rank {rank} replay {i}: all-to-all-v from rank {q}");
                assert!(got[at..at + len] == theirs[start..start + len], "{what}");
                at += len;
            }
        }
    });
}
