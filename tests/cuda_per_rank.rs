//! The per-rank communicator on CUDA, one thread per rank (the suite is in
//! tests/per_rank_suite). With fewer GPUs than ranks, ranks share GPUs (each with its
//! own stream and signal; few blocks so every rank's blocks are resident). Without a
//! GPU every test prints why it is skipped.
#![cfg(feature = "cuda")]

mod common;
mod per_rank_suite;

use peercomm::backend::cuda::Cuda;
use peercomm::backend::Backend;
use per_rank_suite::descriptor_channel::{self, Strangers};
use per_rank_suite::processes::{self, Devices};
use per_rank_suite::Placement;

fn placement(test: &str) -> Option<Placement> {
    match Cuda::device_count() {
        Ok(n) if n > 0 => Some(Placement {
            devices: n,
            max_blocks: 4,
        }),
        Ok(_) => {
            common::announce_skip(test, "no CUDA device");
            None
        }
        Err(e) => {
            common::announce_skip(test, &format!("no CUDA driver: {e}"));
            None
        }
    }
}

macro_rules! cuda_world {
    ($name:ident, $world:expr) => {
        #[test]
        fn $name() {
            if let Some(place) = placement(stringify!($name)) {
                per_rank_suite::checked_calls::<Cuda>(&place, $world);
            }
        }
    };
}

cuda_world!(cuda_per_rank_threads_world_2, 2);
cuda_world!(cuda_per_rank_threads_world_4, 4);
cuda_world!(cuda_per_rank_threads_world_8, 8);

macro_rules! cuda_collectives_world {
    ($name:ident, $world:expr) => {
        #[test]
        fn $name() {
            if let Some(place) = placement(stringify!($name)) {
                per_rank_suite::collectives::checked::<Cuda>(&place, $world);
            }
        }
    };
}

cuda_collectives_world!(cuda_per_rank_collectives_world_2, 2);
cuda_collectives_world!(cuda_per_rank_collectives_world_4, 4);

// The Lamport fused all-reduce + residual + RMSNorm against the one-stage one and batch
// invariance (tests/per_rank_suite/fused.rs, the decode shapes of tests/common/fused.rs),
// then mismatched fused calls, each a CallMismatch on every rank with nothing written.
macro_rules! cuda_lamport_fused_world {
    ($name:ident, $world:expr) => {
        #[test]
        fn $name() {
            if let Some(place) = placement(stringify!($name)) {
                let batches = per_rank_suite::fused::lamport_fused::<Cuda>(
                    &place,
                    $world,
                    &common::fused::DECODE_CASES,
                );
                eprintln!("{}: {batches} batches per rank", stringify!($name));
            }
        }
    };
}

cuda_lamport_fused_world!(cuda_per_rank_lamport_fused_world_2, 2);
cuda_lamport_fused_world!(cuda_per_rank_lamport_fused_world_4, 4);

#[test]
fn cuda_per_rank_lamport_fused_mismatch() {
    if let Some(place) = placement("cuda_per_rank_lamport_fused_mismatch") {
        per_rank_suite::fused::lamport_fused_mismatch::<Cuda>(&place, 2);
        per_rank_suite::fused::lamport_fused_mismatch::<Cuda>(&place, 4);
    }
}

// The staged all-reduce and collectives in chunks through a small payload (halves of
// 129 packs, and of 2049: more than the grid's 2048 threads), bit for bit against the
// unchunked calls; then a late, a missing and a mismatched rank in chunks.
macro_rules! cuda_chunked_world {
    ($name:ident, $world:expr) => {
        #[test]
        fn $name() {
            if let Some(place) = placement(stringify!($name)) {
                use per_rank_suite::chunked;
                for payload in [chunked::SMALL_PAYLOAD, chunked::GRID_PAYLOAD] {
                    chunked::chunked_all_reduce::<Cuda>(&place, $world, payload);
                    chunked::chunked_collectives::<Cuda>(&place, $world, payload);
                }
            }
        }
    };
}

cuda_chunked_world!(cuda_per_rank_chunked_world_2, 2);
cuda_chunked_world!(cuda_per_rank_chunked_world_3, 3);
cuda_chunked_world!(cuda_per_rank_chunked_world_4, 4);

#[test]
fn cuda_per_rank_chunked_faults() {
    if let Some(place) = placement("cuda_per_rank_chunked_faults") {
        per_rank_suite::chunked::chunked_faults::<Cuda>(&place, 2);
    }
}

#[test]
fn cuda_per_rank_collectives_bad_inputs() {
    if let Some(place) = placement("cuda_per_rank_collectives_bad_inputs") {
        per_rank_suite::collectives::bad_inputs::<Cuda>(&place);
    }
}

#[test]
fn cuda_per_rank_independent_sibling_groups() {
    if let Some(place) = placement("cuda_per_rank_independent_sibling_groups") {
        per_rank_suite::independent_sibling_groups::<Cuda>(&place);
    }
}

#[test]
fn cuda_per_rank_miss_next_times_out_and_recovers() {
    if let Some(place) = placement("cuda_per_rank_miss_next_times_out_and_recovers") {
        per_rank_suite::fault::miss_next_times_out_and_recovers::<Cuda>(&place);
    }
}

#[test]
fn cuda_per_rank_configuration_mismatch_names_the_fields() {
    if let Some(place) = placement("cuda_per_rank_configuration_mismatch_names_the_fields") {
        per_rank_suite::sizing::a_configuration_mismatch_names_the_fields::<Cuda>(&place);
    }
}

#[test]
fn cuda_per_rank_sized_for_the_largest_message() {
    if let Some(place) = placement("cuda_per_rank_sized_for_the_largest_message") {
        per_rank_suite::sizing::sized_for_the_largest_message::<Cuda>(&place);
    }
}

#[test]
fn cuda_per_rank_missing_call_times_out_and_recovers() {
    if let Some(place) = placement("cuda_per_rank_missing_call_times_out_and_recovers") {
        per_rank_suite::missing_call_times_out_and_recovers::<Cuda>(&place);
    }
}

/// One process per rank: IPC handles between processes (on one GPU the two processes
/// time-slice it, which is slow but exercises the same mapping).
fn devices(test: &str) -> Option<Devices> {
    placement(test).map(|p| Devices {
        count: p.devices,
        max_blocks: 4,
    })
}

/// The child processes' entry point (does nothing when run as a normal test).
#[test]
fn per_rank_child() {
    if let Some((role, rank, world, id, seed)) = processes::child_args() {
        if per_rank_suite::capture_inputs::graphs::child(&role, rank, world, &id, seed) {
            return;
        }
        let n = Cuda::device_count().expect("a CUDA device in the child");
        let devices = Devices {
            count: n,
            max_blocks: 4,
        };
        if descriptor_channel::child::<Cuda>(&role, &devices, (rank, world, &id), registers) {
            return;
        }
        processes::child_main::<Cuda>(&devices);
    }
}

/// A registration whose memory CUDA exports only as a descriptor (a buffer from a pool
/// made with the POSIX-fd handle type), dropped again.
fn registers(comm: &peercomm::Comm<Cuda>) -> Result<(), peercomm::Error> {
    use per_rank_suite::capture_inputs::graphs::{alloc, Memory};
    let buffer = alloc::<f32>(comm, Memory::PosixPool, 4096);
    let registered = comm.register(buffer.as_view()).map_err(|e| e.error);
    registered.map(drop)
}

/// The descriptor channel beside an idle connection of another user (nobody): every
/// rank registers a POSIX-fd pool buffer within the bound, alike (skipped where the
/// test is not root).
#[test]
fn cuda_per_rank_descriptor_channel_beside_another_user() {
    if let Some(d) = devices("cuda_per_rank_descriptor_channel_beside_another_user") {
        descriptor_channel::beside_strangers::<Cuda>(&d, registers, Strangers::AnotherUser);
    }
}

/// The descriptor channel beside idle, garbage and wrong-nonce connections of this
/// user (other processes, and the peer's own process): ignored, every rank registers
/// within the bound, alike.
#[test]
fn cuda_per_rank_descriptor_channel_beside_bogus_senders() {
    if let Some(d) = devices("cuda_per_rank_descriptor_channel_beside_bogus_senders") {
        descriptor_channel::beside_strangers::<Cuda>(&d, registers, Strangers::Bogus);
    }
}

#[test]
fn cuda_per_rank_processes_world_2() {
    if let Some(d) = devices("cuda_per_rank_processes_world_2") {
        processes::checked_world::<Cuda>(&d, 2);
    }
}

/// Real CUDA_VISIBLE_DEVICES isolation: rank r's process sees only GPU r, as its
/// device 0 (rank 0 is the test process, on its device 0). Needs two GPUs; not run in
/// CI (no GPU) and not run yet on two GPUs (the GPU runs).
#[test]
fn cuda_per_rank_isolated_processes_world_2() {
    let test = "cuda_per_rank_isolated_processes_world_2";
    if let Some(d) = devices(test) {
        if d.count < 2 {
            common::announce_skip(test, "needs 2 CUDA devices");
            return;
        }
        processes::isolated_world::<Cuda>(&d, 2, Some("CUDA_VISIBLE_DEVICES"));
    }
}

#[test]
fn cuda_per_rank_killed_process_gives_a_typed_error() {
    if let Some(d) = devices("cuda_per_rank_killed_process_gives_a_typed_error") {
        processes::killed_process_gives_a_typed_error::<Cuda>(&d);
    }
}

#[test]
fn cuda_per_rank_registration_beside_a_killed_peer() {
    if let Some(d) = devices("cuda_per_rank_registration_beside_a_killed_peer") {
        processes::registration_beside_a_killed_peer::<Cuda>(&d);
    }
}

#[test]
fn cuda_per_rank_create_drop_cycles_leak_nothing() {
    if let Some(d) = devices("cuda_per_rank_create_drop_cycles_leak_nothing") {
        processes::create_drop_cycles_leak_nothing::<Cuda>(&d, 200);
    }
}

/// Each rank captures its own all-reduce into a CUDA graph on its own stream and
/// replays it with new inputs uploaded between replays; every replay is checked on
/// every rank against the f64 reference (one-stage staged, and Lamport).
#[test]
fn cuda_per_rank_graph_replays() {
    use peercomm::{Algorithm, AllReduceOptions};
    let Some(place) = placement("cuda_per_rank_graph_replays") else {
        return;
    };
    let seed = per_rank_suite::seed("cuda_per_rank_graph_replays");
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
                .capture(|| comm.all_reduce_sum_with(&send, &mut recv, &opts))
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
    eprintln!(
        "cuda_per_rank_graph_replays: {} replays checked per rank",
        checked[0]
    );
}

/// Each rank captures an all-gather, a reduce-scatter, a broadcast, a scatter and the
/// fused all-reduce + residual + RMSNorm into one graph and replays it with new inputs
/// (and a fresh residual) every time; every replay is checked.
#[test]
fn cuda_per_rank_collectives_graph_replays() {
    use common::collectives::{assert_bits, check_rms_norm, expect, Which};
    use half::bf16;
    use peercomm::CollectiveOptions;
    use rand::SeedableRng;
    let Some(place) = placement("cuda_per_rank_collectives_graph_replays") else {
        return;
    };
    let seed = per_rank_suite::seed("cuda_per_rank_collectives_graph_replays");
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
                comm.all_gather(&x, &mut gathered, &o)?;
                comm.reduce_scatter_sum(&wide, &mut part, &o)?;
                comm.broadcast(Some(&x), &mut bcast, 1, &o)?;
                comm.scatter(Some(&wide), &mut piece, 0, &o)?;
                comm.all_reduce_residual_rms_norm(
                    &partial,
                    &mut res,
                    &weight,
                    &mut normed,
                    1e-5,
                    &o,
                )
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
            assert_bits(
                &get(&gathered),
                &expect(Which::AllGather, &xs, world, rank),
                &what("all-gather"),
            );
            assert_bits(
                &get(&part),
                &expect(Which::ReduceScatter, &wides, world, rank),
                &what("reduce-scatter"),
            );
            let b = Which::Broadcast {
                root: 1,
                in_place: false,
            };
            assert_bits(
                &get(&bcast),
                &expect(b, &xs, world, rank),
                &what("broadcast"),
            );
            assert_bits(
                &get(&piece),
                &expect(Which::Scatter { root: 0 }, &wides, world, rank),
                &what("scatter"),
            );
            check_rms_norm(
                &partials,
                &residual,
                &w,
                world,
                rank,
                1e-5,
                &get(&normed),
                &get(&res),
                &what("fused"),
            );
        }
    });
}

/// The schedule fuzzer through the per-rank API (one thread per rank; ranks share GPUs
/// where there are fewer): `PEERCOMM_FUZZ_CALLS` calls (default 2000) at worlds 2 and 4.
#[test]
fn cuda_per_rank_fuzz() {
    let Some(place) = placement("cuda_per_rank_fuzz") else {
        return;
    };
    let calls = std::env::var("PEERCOMM_FUZZ_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    for world in [2, 4] {
        per_rank_suite::fuzz::fuzz_threads::<Cuda>(&place, world, calls, 24);
    }
}

// Trust on the per-rank path (issue 18): the grid agreed across ranks that report
// different multiprocessor counts, typed call mismatches on every rank, the rank that
// never came named, one sign of zero.
macro_rules! cuda_trust {
    ($name:ident, |$place:ident| $body:expr) => {
        #[test]
        fn $name() {
            if let Some($place) = placement(stringify!($name)) {
                $body;
            }
        }
    };
}

cuda_trust!(
    cuda_per_rank_unequal_multiprocessors_agree_on_the_grid,
    |place| {
        per_rank_suite::trust::unequal_multiprocessors_agree_on_the_grid::<Cuda>(&place, &[4, 8]);
        per_rank_suite::trust::unequal_multiprocessors_agree_on_the_grid::<Cuda>(
            &place,
            &[16, 3, 9],
        );
    }
);
cuda_trust!(cuda_per_rank_mismatched_calls_are_typed_errors, |place| {
    per_rank_suite::trust::mismatched_calls_are_typed_errors::<Cuda>(&place, 2);
    per_rank_suite::trust::mismatched_calls_are_typed_errors::<Cuda>(&place, 3);
});
cuda_trust!(cuda_per_rank_group_of_one_against_a_world_call, |place| {
    per_rank_suite::trust::a_group_of_one_against_a_world_call_is_caught_late::<Cuda>(&place)
});
cuda_trust!(cuda_per_rank_different_group_widths, |place| {
    per_rank_suite::trust::different_group_widths_are_caught::<Cuda>(&place)
});
cuda_trust!(cuda_per_rank_the_rank_that_never_came_is_named, |place| {
    per_rank_suite::trust::the_rank_that_never_came_is_named::<Cuda>(&place)
});
cuda_trust!(cuda_per_rank_one_sign_of_zero, |place| {
    per_rank_suite::trust::one_sign_of_zero::<Cuda>(&place, 2);
    per_rank_suite::trust::one_sign_of_zero::<Cuda>(&place, 3);
});
// Teardown (issue 18, item 4): a rank that drops its Comm while its peer's collective is
// queued behind a delay (the peer's kernel then writes its error record into the
// dropped rank's parked signal), and a drop whose peer holds on returns within about a
// second.
cuda_trust!(cuda_per_rank_drop_while_peer_collective_queued, |place| {
    per_rank_suite::teardown::drop_while_peer_collective_queued::<Cuda>(&place, 2)
});
cuda_trust!(cuda_per_rank_drop_returns_while_peer_holds_on, |place| {
    per_rank_suite::teardown::drop_returns_while_peer_holds_on::<Cuda>(&place)
});
// A drop beside a peer's exchange (register, alloc_symmetric, trim_symmetric,
// register_inputs_of, reinitialize while the peer's all-reduce is pending): the typed
// mismatch on both ranks and the dropping rank's signal parked; and ranks making
// different exchanges at once all get the mismatch, then go on in step.
cuda_trust!(cuda_per_rank_drop_beside_a_peer_exchange, |place| {
    for what in per_rank_suite::teardown::Exchange::ALL {
        per_rank_suite::teardown::drop_beside_a_peer_exchange::<Cuda>(&place, what);
    }
});
cuda_trust!(
    cuda_per_rank_different_exchanges_are_typed_errors,
    |place| {
        use per_rank_suite::teardown::Exchange::*;
        for kinds in [
            [Register, AllocSymmetric].as_slice(),
            &[TrimSymmetric, Reinitialize],
            &[RegisterInputsOf, Register],
            &[Register, Register, AllocSymmetric],
        ] {
            per_rank_suite::teardown::different_exchanges_are_typed_errors::<Cuda>(&place, kinds);
        }
    }
);

// Zero copy (tests/per_rank_suite/zero_copy.rs): all-reduces whose inputs lie in
// symmetric and registered buffers (every algorithm at worlds 2 and 4, two-stage at 8),
// in and out of place, every group size, bit for bit the single controller's over the
// same devices; the other collectives on symmetric inputs; nothing staged; the
// refusals, mismatched input places, and register/alloc cycles.
cuda_trust!(cuda_per_rank_zero_copy_all_reduce_world_2, |place| {
    per_rank_suite::zero_copy::all_reduce_matches_single_controller::<Cuda>(
        &place,
        2,
        &ZERO_COPY_ALGORITHMS,
    )
});
cuda_trust!(cuda_per_rank_zero_copy_all_reduce_world_4, |place| {
    per_rank_suite::zero_copy::all_reduce_matches_single_controller::<Cuda>(
        &place,
        4,
        &ZERO_COPY_ALGORITHMS,
    )
});
cuda_trust!(cuda_per_rank_zero_copy_two_stage_world_8, |place| {
    per_rank_suite::zero_copy::all_reduce_matches_single_controller::<Cuda>(
        &place,
        8,
        &[peercomm::Algorithm::TwoStage],
    )
});
cuda_trust!(cuda_per_rank_zero_copy_collectives_world_2, |place| {
    per_rank_suite::zero_copy::collectives_match_single_controller::<Cuda>(&place, 2)
});
cuda_trust!(cuda_per_rank_zero_copy_collectives_world_4, |place| {
    per_rank_suite::zero_copy::collectives_match_single_controller::<Cuda>(&place, 4)
});
cuda_trust!(cuda_per_rank_zero_copy_stages_nothing, |place| {
    per_rank_suite::zero_copy::stages_nothing::<Cuda>(&place)
});
cuda_trust!(cuda_per_rank_zero_copy_registration_refusals, |place| {
    per_rank_suite::zero_copy::registration_refusals::<Cuda>(&place, 2);
    per_rank_suite::zero_copy::registration_refusals::<Cuda>(&place, 3);
});
cuda_trust!(cuda_per_rank_zero_copy_mismatched_inputs, |place| {
    per_rank_suite::zero_copy::mismatched_inputs::<Cuda>(&place, 2);
    per_rank_suite::zero_copy::mismatched_inputs::<Cuda>(&place, 3);
});
cuda_trust!(cuda_per_rank_zero_copy_inputs_dropped_in_flight, |place| {
    per_rank_suite::zero_copy::inputs_dropped_in_flight::<Cuda>(&place, 2);
    per_rank_suite::zero_copy::inputs_dropped_in_flight::<Cuda>(&place, 4);
});
cuda_trust!(cuda_per_rank_zero_copy_register_drop_cycles, |place| {
    per_rank_suite::zero_copy::register_drop_cycles::<Cuda>(&place, 2, 1000)
});
cuda_trust!(cuda_per_rank_zero_copy_symmetric_drop_cycles, |place| {
    per_rank_suite::zero_copy::symmetric_drop_cycles::<Cuda>(&place, 2, 1000)
});

const ZERO_COPY_ALGORITHMS: [peercomm::Algorithm; 4] = [
    peercomm::Algorithm::OneStage,
    peercomm::Algorithm::TwoStage,
    peercomm::Algorithm::Lamport,
    peercomm::Algorithm::Auto,
];

/// Symmetric inputs across processes through CUDA IPC (rank 0 in the test process; on
/// one GPU the processes time-slice it). Whether cudarc's own allocations can be
/// registered across processes depends on the driver's pools: either way is accepted
/// (a refusal must be CannotRegister on every rank, with the buffer back).
#[test]
fn cuda_per_rank_zero_copy_processes_world_2() {
    if let Some(d) = devices("cuda_per_rank_zero_copy_processes_world_2") {
        per_rank_suite::zero_copy::symmetric_processes::<Cuda>(&d, 2, false);
    }
}

#[test]
fn cuda_per_rank_zero_copy_cycles_leak_nothing() {
    if devices("cuda_per_rank_zero_copy_cycles_leak_nothing").is_some() {
        per_rank_suite::zero_copy::cycles_leak_nothing::<Cuda>(200, false);
    }
}

// Registered captures (tests/per_rank_suite/capture_inputs.rs): the generic passes run
// eagerly, then graphs captured with `Comm::capture_registered` and replayed.
cuda_trust!(
    cuda_per_rank_capture_inputs_second_pass_reads_in_place,
    |place| {
        per_rank_suite::capture_inputs::second_pass_reads_in_place::<Cuda>(&place, 2);
        per_rank_suite::capture_inputs::second_pass_reads_in_place::<Cuda>(&place, 4);
    }
);
cuda_trust!(
    cuda_per_rank_capture_inputs_disagreeing_passes_are_refused,
    |place| {
        per_rank_suite::capture_inputs::disagreeing_passes_are_refused::<Cuda>(&place, 2);
        per_rank_suite::capture_inputs::disagreeing_passes_are_refused::<Cuda>(&place, 3);
    }
);
cuda_trust!(cuda_per_rank_capture_inputs_cycles_leak_nothing, |place| {
    per_rank_suite::capture_inputs::pass_cycles_leak_nothing::<Cuda>(&place, 2, 300)
});
cuda_trust!(cuda_per_rank_capture_registered_world_2, |place| {
    per_rank_suite::capture_inputs::graphs::replays_read_in_place(&place, 2)
});
cuda_trust!(cuda_per_rank_capture_registered_world_4, |place| {
    per_rank_suite::capture_inputs::graphs::replays_read_in_place(&place, 4)
});

/// `Comm::capture_registered` with one process per rank: `cuMemAlloc` inputs exported
/// through CUDA IPC and read in place by every replay; cudarc's pool buffers refused
/// alike on every rank (on one GPU the processes time-slice it).
#[test]
fn cuda_per_rank_capture_registered_processes_world_2() {
    if devices("cuda_per_rank_capture_registered_processes_world_2").is_some() {
        per_rank_suite::capture_inputs::graphs::processes_world(2);
    }
}

/// Registration across processes of memory CUDA exports only as a POSIX file
/// descriptor (a pool made with that handle type, and virtual memory that requested
/// it): read in place by the replays, right and bitwise equal on every rank; virtual
/// memory without a shareable handle type refused alike; 1,000 register/drop cycles
/// per kind leak no fd or mapping (two processes sharing one GPU).
#[test]
fn cuda_per_rank_register_shareable_processes_world_2() {
    if devices("cuda_per_rank_register_shareable_processes_world_2").is_some() {
        per_rank_suite::capture_inputs::graphs::shareable_processes_world(2);
    }
}

cuda_trust!(cuda_per_rank_symmetric_trim, |place| {
    per_rank_suite::symmetric_trim::frees_only_segments_empty_everywhere::<Cuda>(&place, 2)
});
cuda_trust!(cuda_per_rank_places_compared_exactly, |place| {
    per_rank_suite::zero_copy::places_compared_exactly::<Cuda>(&place, 2);
    per_rank_suite::zero_copy::places_compared_exactly::<Cuda>(&place, 3);
});
cuda_trust!(cuda_per_rank_fused_arguments_mismatch, |place| {
    per_rank_suite::fused::fused_arguments_mismatch::<Cuda>(&place, 2);
    per_rank_suite::fused::fused_arguments_mismatch::<Cuda>(&place, 3);
});

#[test]
fn cuda_per_rank_misaligned_views() {
    if let Some(place) = placement("cuda_per_rank_misaligned_views") {
        // Element-aligned only: a CUDA kernel faults on a view misaligned for its type.
        per_rank_suite::views::misaligned_views::<Cuda>(&place, 0);
    }
}

#[test]
fn cuda_per_rank_poisoned_names_its_cause() {
    if let Some(place) = placement("cuda_per_rank_poisoned_names_its_cause") {
        per_rank_suite::recovery::poisoned_names_its_cause::<Cuda>(&place);
    }
}

// Sizes and ranges a call cannot trust (tests/per_rank_suite/bounds.rs): lengths whose
// bytes overflow, writes into registered buffers, inputs overlapping outputs.
cuda_trust!(cuda_per_rank_huge_lengths_are_refused, |place| {
    per_rank_suite::bounds::huge_lengths_are_refused::<Cuda>(&place, 2)
});
cuda_trust!(
    cuda_per_rank_huge_buffers_in_collectives_are_refused,
    |place| { per_rank_suite::bounds::huge_buffers_in_collectives_are_refused::<Cuda>(&place, 2) }
);
cuda_trust!(cuda_per_rank_registered_writes_keep_the_range, |place| {
    per_rank_suite::bounds::registered_writes_keep_the_range::<Cuda>(&place, 2)
});
cuda_trust!(cuda_per_rank_overlapping_buffers_are_refused, |place| {
    per_rank_suite::bounds::overlapping_buffers_are_refused::<Cuda>(&place)
});
cuda_trust!(cuda_per_rank_overlap_on_one_rank, |place| {
    per_rank_suite::bounds::overlap_on_one_rank::<Cuda>(&place)
});
cuda_trust!(cuda_single_controller_overlaps, |place| {
    per_rank_suite::bounds::single_controller_overlaps::<Cuda>(&place)
});

#[test]
fn cuda_per_rank_a_leaf_without_rank_zero_names_real_functions() {
    if let Some(place) = placement("cuda_per_rank_a_leaf_without_rank_zero_names_real_functions") {
        per_rank_suite::recovery::a_leaf_without_rank_zero_names_real_functions::<Cuda>(&place);
    }
}

#[test]
fn cuda_per_rank_a_skipped_call_is_caught_where_it_is_awaited() {
    if let Some(place) = placement("cuda_per_rank_a_skipped_call_is_caught_where_it_is_awaited") {
        per_rank_suite::recovery::a_skipped_call_is_caught_where_it_is_awaited::<Cuda>(&place);
    }
}

#[test]
fn cuda_per_rank_check_errors_is_a_per_step_poll() {
    if let Some(place) = placement("cuda_per_rank_check_errors_is_a_per_step_poll") {
        per_rank_suite::recovery::check_errors_is_a_per_step_poll::<Cuda>(&place);
    }
}
