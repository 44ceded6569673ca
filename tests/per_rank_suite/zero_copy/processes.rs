//! Zero copy across processes (children of the test binary): symmetric inputs read in
//! place through IPC, heap registrations refused where they cannot be exported, and
//! no leaked registration, import, fd or mapping.

use std::time::Duration;

use peercomm::backend::{Backend, TypedBuffer};
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig, Error, ReduceOp};

use super::super::common::{self, digest, group_sizes};
use super::super::{check_rank_sum, nan, seed, Placement};
use super::super::{process_faults, processes};

/// The all-reduces every rank process makes on symmetric inputs: (length, group size,
/// algorithm, in place).
fn process_schedule(world: usize) -> Vec<(usize, usize, Algorithm, bool)> {
    let mut calls = Vec::new();
    for (i, len) in [7usize, 4099, 65_537].into_iter().enumerate() {
        for group in group_sizes(world) {
            for algorithm in [Algorithm::OneStage, Algorithm::TwoStage] {
                calls.push((len, group, algorithm, (i + group) % 2 == 1));
            }
        }
    }
    calls
}

/// One rank process's part of `symmetric_processes`: every call of the schedule on a
/// symmetric input, checked against the f64 reference; an all-to-all read in place; a heap buffer's registration
/// (refused across processes where `heap_refused`); returns (call, digest) per call.
pub fn symmetric_rank<B: Backend>(
    comm: &Comm<B>,
    seed: u64,
    heap_refused: bool,
) -> Vec<(usize, u64)> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let mut digests = Vec::new();
    for (call, &(len, group, algorithm, in_place)) in process_schedule(world).iter().enumerate() {
        let what =
            format!("process rank {rank} call {call}: {len} x f32, group {group}, {algorithm:?}");
        let mut send = comm.alloc_symmetric::<f32>(len).expect(&what);
        send.copy_from_host(dev, &processes::input(seed, call, rank, len))
            .unwrap();
        let opts = AllReduceOptions::new()
            .group_size(group)
            .algorithm(algorithm);
        let (opts, mut recv) = (
            opts.blocks(2),
            B::alloc_from(dev, &nan::<f32>(len)).unwrap(),
        );
        let ran = match in_place {
            true => comm.all_reduce_in_place_with(&mut send, &ReduceOp::Sum, &opts),
            false => comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &opts),
        };
        assert_eq!(ran.expect(&what), algorithm, "{what}");
        comm.synchronize().expect(&what);
        let got = if in_place {
            send.to_host(dev)
        } else {
            B::download(dev, &recv)
        }
        .unwrap();
        let base = rank / group * group;
        let ins: Vec<Vec<f32>> = (base..base + group)
            .map(|r| processes::input(seed, call, r, len))
            .collect();
        common::check_sums(&ins, &vec![got.clone(); group], group, &what);
        digests.push((call, digest(&got)));
    }
    // An all-to-all from a symmetric buffer: each peer reads its part in place, where
    // it mapped this rank's segment.
    let n = 1000;
    let mut sym = comm.alloc_symmetric::<f32>(world * n).unwrap();
    sym.copy_from_host(dev, &processes::input(seed, 999, rank, world * n))
        .unwrap();
    let mut out = B::alloc_from(dev, &nan::<f32>(world * n)).unwrap();
    comm.all_to_all(&sym, &mut out).unwrap();
    comm.synchronize().unwrap();
    let got = B::download(dev, &out).unwrap();
    for q in 0..world {
        let theirs = processes::input(seed, 999, q, world * n);
        let same = (got[q * n..(q + 1) * n]
            .iter()
            .zip(&theirs[rank * n..(rank + 1) * n]))
        .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "rank {rank}: the all-to-all part from rank {q}");
    }
    drop(sym);
    let segments = comm.registrations();
    assert_eq!(segments.0, 1, "rank {rank}: one segment");
    let mapped = "every peer's segment mapped once";
    assert_eq!(segments.1, world - 1, "rank {rank}: {mapped}");
    // A heap buffer: in another process a peer cannot map it.
    let data: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let plain = B::alloc_from(dev, &data).unwrap();
    match comm.register(plain) {
        Ok(reg) => {
            let what = "a heap buffer registered across processes";
            assert!(!heap_refused, "rank {rank}: {what}");
            drop(reg);
        }
        Err(peercomm::RegisterError { error, buffer, .. }) => {
            let refused = matches!(error, Error::CannotRegister { .. });
            assert!(refused, "rank {rank}: {error:?}");
            let back = B::download(dev, &buffer).unwrap();
            assert_eq!(back, data, "the buffer comes back");
        }
    }
    let note = format!("rank {rank}: nothing registered");
    assert_eq!(comm.registrations(), segments, "{note}");
    if heap_refused {
        // Rank 0 offers a symmetric buffer, the others heap buffers of the same size:
        // refused on every rank, naming rank 1 (the first that cannot export).
        let what = format!("rank {rank}: a symmetric buffer beside heap buffers");
        let s = comm.alloc_symmetric::<f32>(256).unwrap();
        let error = if rank == 0 {
            comm.register(s).map(drop).map_err(|e| e.error)
        } else {
            let heap = B::alloc_from(dev, &data).unwrap();
            comm.register(heap).map(drop).map_err(|e| e.error)
        };
        let named = matches!(error, Err(Error::CannotRegister { rank: 1, .. }));
        assert!(named, "{what}: {error:?}");
        assert_eq!(comm.registrations(), segments, "{what}: nothing registered");
    }
    // A symmetric buffer can be registered again (its segment is exportable).
    let again = comm.alloc_symmetric::<f32>(100).unwrap();
    let mut again = comm.register(again).unwrap();
    again
        .copy_from_host(dev, &[rank as f32 + 1.0; 100])
        .unwrap();
    let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    comm.all_reduce_in_place_with(&mut again, &ReduceOp::Sum, &one)
        .unwrap();

    comm.synchronize().unwrap();
    let want = (world * (world + 1) / 2) as f32;
    assert_eq!(again.to_host(dev).unwrap(), vec![want; 100]);
    drop(again);
    assert_eq!(comm.registrations(), segments);
    digests
}

/// The children's variant: whether heap registrations are refused.
fn variant(heap_refused: bool) -> [(String, String); 1] {
    let v = ["heap-any", "heap-refused"][heap_refused as usize];
    [(processes::VARIANT.to_string(), v.to_string())]
}

/// `world` rank processes all-reduce symmetric inputs (one- and two-stage, every group
/// size, in and out of place), checked and bitwise equal per group; each peer segment
/// mapped once; heap registrations refused where `heap_refused`; symmetric ones work.
pub fn symmetric_processes<B: Backend>(devices: &Placement, world: usize, heap_refused: bool) {
    let seed = seed(&format!("per_rank_zero_copy_processes world {world}"));
    let extra = variant(heap_refused);
    let all = processes::digest_world::<B>(devices, world, "zero-copy", seed, &extra, |comm| {
        symmetric_rank(comm, seed, heap_refused)
    });
    let groups: Vec<usize> = process_schedule(world).iter().map(|c| c.1).collect();
    let calls = processes::compare_group_digests(world, &groups, &all);
    eprintln!(
        "per_rank_zero_copy_processes world {world}: {calls} symmetric calls per rank, bits equal"
    );
}

/// One rank process's cycles: a symmetric buffer allocated, registered, given back and
/// dropped; heap registrations (refused where `heap_refused`); every 100th cycle an
/// all-reduce reads the registered buffer in place.
fn zero_copy_cycles<B: Backend>(comm: &Comm<B>, cycles: usize, heap_refused: bool) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let at = comm.alloc_symmetric::<f32>(16).unwrap().placement();
    for cycle in 0..cycles {
        let s = comm.alloc_symmetric::<f32>(16).unwrap();
        let reused = "the range is reused";
        assert_eq!(s.placement(), at, "rank {rank} cycle {cycle}: {reused}");
        let mut reg = comm.register(s).unwrap();
        if cycle % 100 == 0 {
            reg.copy_from_host(dev, &[rank as f32 + 1.0; 16]).unwrap();
            check_rank_sum(comm, &reg);
        }
        drop(reg.into_inner());
        // A registered pass over a plain buffer: exported, mapped by the peer for the
        // second pass and unmapped with the value (refused where heap memory is).
        let plain = B::alloc_from(dev, &[rank as f32 + 1.0; 16]).unwrap();
        let mut out = B::alloc_from(dev, &[f32::NAN; 16]).unwrap();
        let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        match comm
            .register_inputs_of(|| comm.all_reduce_with(&plain, &mut out, &ReduceOp::Sum, &one))
        {
            Ok((_, inputs)) => {
                assert!(!heap_refused, "rank {rank}: a heap buffer registered");
                assert_eq!((inputs.registered(), inputs.in_place_calls()), (1, 1));
                comm.synchronize().unwrap();
                let want = (world * (world + 1) / 2) as f32;
                assert_eq!(B::download(dev, &out).unwrap(), vec![want; 16]);
            }
            // Refused where heap memory is, and where the driver pool cannot export.
            Err(Error::CannotRegister { .. }) => {}
            Err(e) => panic!("rank {rank}: {e:?}"),
        }
        comm.synchronize().unwrap();
        match comm.register(B::alloc_from(dev, &[1.0f32; 16]).unwrap()) {
            Ok(_registered) => assert!(!heap_refused, "rank {rank}: a heap buffer registered"),
            Err(peercomm::RegisterError {
                error: Error::CannotRegister { .. },
                buffer,
                ..
            }) => drop(buffer),
            Err(e) => panic!("rank {rank}: {e:?}"),
        }
    }
}

/// `cycles` communicators built over `boot` and dropped, each with a symmetric buffer
/// (a segment exported to the peer and mapped there) that an all-reduce reads in place.
fn comm_cycles<B: Backend>(
    devices: &Placement,
    boot: &std::sync::Arc<peercomm::TcpBootstrap>,
    config: &CommConfig,
    rank: usize,
    cycles: usize,
) {
    for _ in 0..cycles {
        let dev = B::open(devices.ordinal(rank)).unwrap();
        let comm = Comm::<B>::from_bootstrap(dev, Box::new(boot.clone()), config.clone()).unwrap();
        let dev = comm.device();
        let mut s = comm.alloc_symmetric::<f32>(16).unwrap();
        s.copy_from_host(dev, &[rank as f32 + 1.0; 16]).unwrap();
        check_rank_sum(&comm, &s);
        assert_eq!(comm.registrations(), (1, 1));
    }
}

/// Cycles before the counts are taken (caches that stay: see `processes.rs`).
const WARM_UP: usize = 20;

/// The child roles of this module (`processes::child_main` hands them on); whether
/// `role` is one.
pub fn child_role<B: Backend>(
    role: &str,
    (devices, rank, world, id, seed): processes::ChildArgs,
) -> bool {
    let heap_refused = std::env::var(processes::VARIANT).as_deref() == Ok("heap-refused");
    match role {
        "zero-copy" => {
            let dev = B::open(devices.ordinal(rank)).unwrap();
            let config = processes::config_for(devices, world);
            let comm = Comm::<B>::from_rank(dev, rank, world, id, config).unwrap();
            for (call, d) in symmetric_rank(&comm, seed, heap_refused) {
                println!("DIGEST {call} {rank} {d}");
            }
        }
        "zero-copy-cycles" => {
            let cycles = seed as usize;
            let boot = std::sync::Arc::new(
                peercomm::TcpBootstrap::connect(id, rank, world, Duration::from_secs(30)).unwrap(),
            );
            let config = processes::config_for(devices, world)
                .with_lamport_slot_bytes(4096)
                .with_payload_bytes(64 << 10)
                .with_barrier_timeout(Some(Duration::from_secs(2)));
            let dev = B::open(devices.ordinal(rank)).unwrap();
            let comm =
                Comm::<B>::from_bootstrap(dev, Box::new(boot.clone()), config.clone()).unwrap();
            zero_copy_cycles(&comm, WARM_UP, heap_refused);
            comm_cycles::<B>(devices, &boot, &config, rank, WARM_UP);
            let before = process_faults::open_files_and_maps();
            let registered = comm.registrations();
            let what = "one segment, the peer's mapped";
            assert_eq!(registered, (1, 1), "rank {rank}: {what}");
            zero_copy_cycles(&comm, cycles, heap_refused);
            comm_cycles::<B>(devices, &boot, &config, rank, cycles / 10);
            assert_eq!(comm.registrations(), registered, "rank {rank}");
            // The empty segment given back: its mapping in the peer closed.
            assert!(comm.trim_symmetric().unwrap() > 0, "rank {rank}");
            assert_eq!(comm.registrations(), (0, 0), "rank {rank}");
            process_faults::print_counts(before);
        }
        _ => return false,
    }
    true
}

/// Lifetimes across processes: two child rank processes run `cycles` zero-copy cycles
/// and `cycles / 10` communicators; registrations, imports, open files and mappings
/// end where they started (small slack for harness threads).
// `B` is the children's backend.
#[allow(clippy::extra_unused_type_parameters)]
pub fn cycles_leak_nothing<B: Backend>(cycles: usize, heap_refused: bool) {
    let test = "per_rank_zero_copy_cycles_leak_nothing";
    let extra = variant(heap_refused);
    process_faults::counts_stay_flat(test, "zero-copy-cycles", cycles, &extra);
}
