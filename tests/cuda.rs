//! The reference suite on CUDA, plus CUDA-graph replay, the schedule fuzzer and a
//! differential test against the host backend. Needs NVIDIA GPUs: with none (no
//! driver, or no device) every test prints why it is skipped. Run the GPU part on the
//! GPU machine with `scripts/device.sh tests` (one test thread: two communicators
//! spinning on the same GPUs at once could starve each other of SMs).
//!
//! Worlds larger than the GPU count run with several ranks per GPU
//! (`CommConfig::allow_shared_devices`, rank r on GPU `r % count`, at most 4 blocks per
//! launch so every rank's blocks are resident at once).
#![cfg(feature = "cuda")]

mod common;

use common::fuzz::{calls_from_env, differential, fuzz, fuzz_config, Knobs};
use common::{cuda_devices, Placement};
use peercomm::backend::cuda::Cuda;
use peercomm::backend::host::Host;
use peercomm::backend::Backend;
use peercomm::{Algorithm, AllReduceOptions, Error, ReduceOp, SingleController};

reference_suite!(Cuda, cuda_devices(), None, common::LENGTHS);

#[test]
fn no_gpu_gives_a_typed_error() {
    if cuda_devices().is_ok() {
        common::announce_skip("no_gpu_gives_a_typed_error", "a CUDA device is present");
        return;
    }
    match SingleController::<Cuda>::new(&[0], common::suite_config(None)) {
        Err(Error::NoDevice { .. }) => {}
        Err(other) => panic!("expected NoDevice, got {other}"),
        Ok(_) => panic!("a communicator without a GPU"),
    }
}

/// Each algorithm captured into a CUDA graph (one graph per rank's stream) and replayed
/// with new inputs uploaded between replays; every replay is checked.
#[test]
fn cuda_graph_replays_with_new_data() {
    let Some(gpus) = common::devices("cuda_graph_replays_with_new_data", cuda_devices(), 1) else {
        return;
    };
    let world = gpus.min(2);
    let mut rng = common::rng("cuda_graph_replays_with_new_data");
    let comm = common::open::<Cuda>(world, common::suite_config(None));
    let len = 12_345;
    let mut replays_done = 0;
    for (algorithm, replays) in [
        (Algorithm::Auto, 1000),
        (Algorithm::OneStage, 300),
        (Algorithm::TwoStage, 300),
        (Algorithm::Lamport, 300),
    ] {
        let mut ins: Vec<_> = comm
            .cores()
            .iter()
            .map(|r| Cuda::alloc_buffer::<half::bf16>(r.device(), len).unwrap())
            .collect();
        let mut outs: Vec<_> = comm
            .cores()
            .iter()
            .map(|r| Cuda::alloc_buffer::<half::bf16>(r.device(), len).unwrap())
            .collect();
        comm.synchronize().unwrap();
        // The safe capture helper: streams synchronised, event tracking paused and
        // restored inside.
        let (graphs, ran) = comm
            .capture(|| {
                comm.all_reduce_slices(
                    &ins,
                    &mut outs,
                    &ReduceOp::Sum,
                    &AllReduceOptions::new().algorithm(algorithm),
                )
            })
            .unwrap();
        // A group of one runs forced Lamport as the one-stage copy (Algorithm's docs).
        let expected = match (algorithm, world) {
            (Algorithm::Lamport, 1) => Algorithm::OneStage,
            (a, _) => a,
        };
        assert!(
            algorithm == Algorithm::Auto || ran == expected,
            "{algorithm:?} ran {ran:?}"
        );
        for r in comm.cores() {
            assert!(
                r.device().context().is_event_tracking(),
                "tracking restored"
            );
            assert!(!peercomm::backend::cuda::is_capturing(r.device().stream()).unwrap());
        }
        for _ in 0..replays {
            let data: Vec<Vec<half::bf16>> = (0..world)
                .map(|_| common::random_values(&mut rng, len))
                .collect();
            let poison = vec![half::bf16::NAN; len];
            for (r, rank) in comm.cores().iter().enumerate() {
                Cuda::upload(rank.device(), &data[r], &mut ins[r]).unwrap();
                Cuda::upload(rank.device(), &poison, &mut outs[r]).unwrap();
            }
            for g in &graphs {
                g.launch().unwrap();
            }
            comm.synchronize().unwrap();
            let got: Vec<Vec<half::bf16>> = comm
                .cores()
                .iter()
                .zip(&outs)
                .map(|(r, o)| Cuda::download(r.device(), o).unwrap())
                .collect();
            common::check_sums(
                &data,
                &got,
                world,
                &format!("graph replay of {}", algorithm.name()),
            );
            replays_done += 1;
        }
        drop(graphs);
    }
    eprintln!("cuda_graph_replays_with_new_data: {replays_done} replays checked on world {world}");
}

/// The capture helper leaves nothing behind when the closure fails, panics or enqueues
/// nothing: no stream is left capturing, event tracking is back on, the error (or the
/// panic) comes through, and the next eager all-reduce is checked against the
/// reference.
#[test]
fn cuda_capture_cleans_up_on_error_and_panic() {
    use peercomm::backend::cuda::is_capturing;
    let Some(gpus) = common::devices(
        "cuda_capture_cleans_up_on_error_and_panic",
        cuda_devices(),
        1,
    ) else {
        return;
    };
    let world = gpus.min(2);
    let comm = common::open::<Cuda>(world, common::suite_config(None));
    let mut rng = common::rng("cuda_capture_cleans_up_on_error_and_panic");
    let clean = |what: &str| {
        for r in comm.cores() {
            assert!(
                !is_capturing(r.device().stream()).unwrap(),
                "{what}: still capturing"
            );
            assert!(
                r.device().context().is_event_tracking(),
                "{what}: tracking off"
            );
        }
    };
    let refused = Error::Unsupported("refused on purpose".into());
    match comm.capture(|| Err::<(), _>(refused.clone())) {
        Err(e) => assert_eq!(e, refused),
        Ok(_) => panic!("a failing closure gave graphs"),
    }
    clean("closure error");
    assert!(matches!(
        comm.capture(|| Ok(())),
        Err(Error::Unsupported(_))
    ));
    clean("empty capture");
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = comm.capture(|| -> peercomm::Result<()> { panic!("inside the capture") });
    }));
    assert!(panicked.is_err(), "the panic comes through");
    clean("closure panic");
    for algorithm in Algorithm::ALL {
        common::run_case::<Cuda, f32>(&comm, &mut rng, algorithm, 0, 4099, false).unwrap();
    }
}

/// The schedule fuzzer over `world` ranks, round-robin over the GPUs there are (on one
/// GPU every rank shares it: the sums are what this checks, the timings mean nothing
/// then). Calls: `PEERCOMM_FUZZ_CALLS`, or 2000.
fn fuzz_cuda(test: &str, world: usize) {
    let Some(gpus) = common::devices(test, cuda_devices(), 1) else {
        return;
    };
    let placement = Placement::round_robin(world, gpus);
    let knobs = Knobs {
        max_delay_ms: 2,
        max_explicit_blocks: if placement.shared { 4 } else { 64 },
        ..Knobs::new(calls_from_env(2000))
    };
    fuzz::<Cuda>(test, &placement, None, &knobs);
}

/// The collectives sweep and the fused kernel with ranks sharing the GPUs (worlds 2 and
/// 4 round-robin over however many there are), so one GPU checks them too.
#[test]
fn collectives_on_shared_gpus() {
    let Some(gpus) = common::devices("collectives_on_shared_gpus", cuda_devices(), 1) else {
        return;
    };
    for world in [2, 4] {
        let comm = Placement::round_robin(world, gpus).open::<Cuda>(common::suite_config(None));
        common::collectives::sweep_on(&comm, &common::collectives::COLLECTIVE_LENGTHS);
        common::collectives::rms_norm_sweep_on(&comm);
    }
}

/// The Lamport fused all-reduce + residual + RMSNorm against the one-stage one and batch
/// invariance, then Lamport all-reduces and fused calls interleaved: single controller,
/// worlds 2 and 4 round-robin over the GPUs there are (so one GPU checks them too).
#[test]
fn lamport_fused_on_shared_gpus() {
    let Some(gpus) = common::devices("lamport_fused_on_shared_gpus", cuda_devices(), 1) else {
        return;
    };
    for world in [2, 4] {
        let placement = Placement::round_robin(world, gpus);
        let config = common::fused::fused_config(common::suite_config(None));
        let comm = placement.open::<Cuda>(config);
        let mut rng = common::rng(&format!("lamport_fused_on_shared_gpus_world_{world}"));
        let batches = common::fused::lamport_fused_matches_one_stage(
            &comm,
            &mut rng,
            &common::fused::DECODE_CASES,
        );
        common::fused::lamport_kinds_interleave(&comm, &mut rng);
        eprintln!(
            "lamport_fused_on_shared_gpus: world {world} on GPUs {:?}: {batches} batches",
            placement.ordinals
        );
    }
}

tests! {
    fuzz_schedule_world_2 => fuzz_cuda("fuzz_schedule_world_2", 2);
    fuzz_schedule_world_4_shared_gpus => fuzz_cuda("fuzz_schedule_world_4_shared_gpus", 4);
    fuzz_schedule_world_8_shared_gpus => fuzz_cuda("fuzz_schedule_world_8_shared_gpus", 8);
}

/// The same schedule and the same random inputs through the host reference backend and
/// CUDA, outputs compared bit for bit: world 2 on two GPUs (world 1 with one GPU), then
/// worlds 2 and 4 sharing GPU 0.
#[test]
fn host_and_cuda_agree_bitwise() {
    let Some(gpus) = common::devices("host_and_cuda_agree_bitwise", cuda_devices(), 1) else {
        return;
    };
    let placements = [
        Placement::round_robin(gpus.min(2), gpus),
        Placement::round_robin(2, 1),
        Placement::round_robin(4, 1),
    ];
    for placement in placements {
        let world = placement.world();
        let ordinals: Vec<usize> = (0..world).collect();
        let host = SingleController::<Host>::new(&ordinals, fuzz_config(Some(3))).unwrap();
        let cuda = placement.open::<Cuda>(fuzz_config(None));
        differential(
            &format!(
                "host_and_cuda_agree_bitwise (world {world} on GPUs {:?})",
                placement.ordinals
            ),
            &host,
            &cuda,
            32,
        );
    }
}
