//! The per-rank communicator (`peercomm::Comm`) with one thread per rank, generic over
//! the backend: every rank checks its own outputs against the f64 reference of inputs
//! that every rank can rebuild from a shared seed, and bitwise against its group's first
//! rank. Instantiated by tests/per_rank.rs (host) and tests/cuda_per_rank.rs (CUDA);
//! zero copy (registered and symmetric inputs) is in zero_copy.rs.

#![allow(dead_code)]

use super::common;

pub mod bounds;
pub mod capture_inputs;
pub mod chunked;
pub mod collectives;
pub mod descriptor_channel;
pub mod fault;
pub mod fused;
pub mod fuzz;
pub mod identity;
pub mod processes;
pub mod recovery;
pub mod sizing;
pub mod symmetric_trim;
pub mod teardown;
pub mod trust;
pub mod views;
pub mod zero_copy;
use std::sync::Barrier;
use std::time::Duration;

use peercomm::backend::Backend;
use peercomm::bootstrap::UniqueId;
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig, Error};

/// Where rank `r` of a world runs: its device ordinal, and the communicator settings
/// (several ranks may share a device when the backend has fewer than the world).
pub struct Placement {
    /// Devices the backend has.
    pub devices: usize,
    /// Blocks per launch (small when ranks share a device, so all are resident).
    pub max_blocks: u32,
}

impl Placement {
    fn ordinal(&self, rank: usize) -> usize {
        rank % self.devices
    }
    fn config(&self, world: usize) -> CommConfig {
        CommConfig {
            lamport_slot_bytes: 1 << 20,
            payload_bytes: 4 << 20,
            barrier_timeout: Some(Duration::from_secs(30)),
            max_blocks: Some(self.max_blocks),
            bootstrap_timeout: Duration::from_secs(30),
            allow_shared_devices: world > self.devices,
            ..CommConfig::default()
        }
    }
}

/// A fresh seed per run, printed so a failure can be replayed with PEERCOMM_SEED.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var("PEERCOMM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{test}: PEERCOMM_SEED={seed}");
    seed
}

/// Runs `body(rank, comm)` on one thread per rank of a fresh world.
pub fn with_world<B: Backend, R: Send>(
    place: &Placement,
    world: usize,
    body: impl Fn(usize, Comm<B>) -> R + Sync,
) -> Vec<R> {
    with_world_config(place, world, &place.config(world), body)
}

/// As `with_world`, over `config`.
pub fn with_world_config<B: Backend, R: Send>(
    place: &Placement,
    world: usize,
    config: &CommConfig,
    body: impl Fn(usize, Comm<B>) -> R + Sync,
) -> Vec<R> {
    let id = UniqueId::new().unwrap();
    let config = config.clone();
    std::thread::scope(|s| {
        let body = &body;
        let config = &config;
        let workers: Vec<_> = (0..world)
            .map(|rank| {
                s.spawn(move || {
                    let dev = B::open(place.ordinal(rank)).unwrap();
                    let comm = Comm::<B>::from_rank(dev, rank, world, &id, config.clone()).unwrap();
                    body(rank, comm)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    })
}

/// Calls of every algorithm the per-rank mode offers, every group size, odd lengths,
/// in and out of place, enqueued back to back; each rank checks each of its outputs
/// against the f64 reference, and every group's ranks agree bit for bit.
pub fn checked_calls<B: Backend>(place: &Placement, world: usize) {
    let seed = seed("per_rank_threads");
    let digests = with_world::<B, _>(place, world, |_rank, comm| {
        processes::run_checked(&comm, seed)
    });
    let by_call: Vec<(usize, usize, u64)> = digests
        .iter()
        .enumerate()
        .flat_map(|(rank, d)| d.iter().map(move |&(call, h)| (call, rank, h)))
        .collect();
    let calls = processes::compare_groups(world, &by_call);
    eprintln!("per_rank_threads world {world}: {calls} calls per rank checked");
}

/// Forced two-stage is refused per rank (it reads the peers' user buffers), with
/// nothing written; Auto still works.
pub fn refuses_two_stage<B: Backend>(place: &Placement) {
    with_world::<B, _>(place, 2, |_rank, comm| {
        let dev = comm.device();
        let mut send = B::alloc_buffer::<f32>(dev, 64).unwrap();
        B::upload(dev, &[1.0; 64], &mut send).unwrap();
        let mut recv = B::alloc_buffer::<f32>(dev, 64).unwrap();
        B::upload(dev, &[f32::NAN; 64], &mut recv).unwrap();
        let err = comm
            .all_reduce_sum_with(
                &send,
                &mut recv,
                &AllReduceOptions::new().algorithm(Algorithm::TwoStage),
            )
            .unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{err}");
        assert!(B::download(dev, &recv).unwrap().iter().all(|x| x.is_nan()));
        comm.all_reduce_sum_with(&send, &mut recv, &AllReduceOptions::new())
            .unwrap();
        comm.synchronize().unwrap();
        assert_eq!(B::download(dev, &recv).unwrap(), vec![2.0; 64]);
    });
}

/// Sibling groups make unequal numbers of subgroup calls, then the whole world
/// all-reduces (Lamport and one-stage): the per-domain counters and the world-only
/// Lamport state keep them consistent.
pub fn independent_sibling_groups<B: Backend>(place: &Placement) {
    let world = 4;
    let seed = seed("per_rank_independent_sibling_groups");
    let start = Barrier::new(world);
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let extra = if rank < 2 { 7 } else { 2 };
        start.wait();
        for call in 0..extra {
            let len = 333 + call;
            let mut buf = B::alloc_buffer::<f32>(dev, len).unwrap();
            B::upload(dev, &[1.0 + rank as f32; 1][..].repeat(len), &mut buf).unwrap();
            comm.all_reduce_sum_in_place_with(&mut buf, &AllReduceOptions::new().group_size(2))
                .unwrap();
            comm.synchronize().unwrap();
            let pair = (rank / 2 * 2) as f32;
            let expect = (1.0 + pair) + (2.0 + pair);
            assert!(B::download(dev, &buf).unwrap().iter().all(|&x| x == expect));
        }
        for (call, algorithm) in [Algorithm::Lamport, Algorithm::OneStage, Algorithm::Lamport]
            .into_iter()
            .enumerate()
        {
            let len = 4099;
            let mine = processes::input(seed, call, rank, len);
            let mut buf = B::alloc_buffer::<f32>(dev, len).unwrap();
            B::upload(dev, &mine, &mut buf).unwrap();
            let opts = AllReduceOptions::new().algorithm(algorithm);
            comm.all_reduce_sum_in_place_with(&mut buf, &opts).unwrap();
            comm.synchronize().unwrap();
            let ins: Vec<Vec<f32>> = (0..world)
                .map(|r| processes::input(seed, call, r, len))
                .collect();
            let got = B::download(dev, &buf).unwrap();
            common::check_sums(
                &ins,
                &vec![got; world],
                world,
                &format!("rank {rank} world call {call}"),
            );
        }
    });
}

/// A rank that never makes the call: the others time out with a typed error, refuse
/// further calls, and work again after a collective reinitialize.
pub fn missing_call_times_out_and_recovers<B: Backend>(place: &Placement) {
    let cfg = CommConfig {
        barrier_timeout: Some(Duration::from_millis(300)),
        ..place.config(2)
    };
    let id = UniqueId::new().unwrap();
    std::thread::scope(|s| {
        for rank in 0..2 {
            let cfg = cfg.clone();
            let id = &id;
            s.spawn(move || {
                let dev = B::open(place.ordinal(rank)).unwrap();
                let comm = Comm::<B>::from_rank(dev, rank, 2, id, cfg).unwrap();
                let dev = comm.device();
                let mut buf = B::alloc_buffer::<f32>(dev, 100).unwrap();
                B::upload(dev, &[1.0; 100], &mut buf).unwrap();
                if rank == 0 {
                    let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
                    comm.all_reduce_sum_in_place_with(&mut buf, &opts).unwrap();
                    match comm.synchronize() {
                        Err(Error::BarrierTimeout { rank: 0, .. }) => {}
                        other => panic!("rank 0: expected a timeout, got {other:?}"),
                    }
                    match comm.all_reduce_sum_in_place_with(&mut buf, &opts) {
                        Err(Error::Poisoned { first })
                            if matches!(*first, Error::BarrierTimeout { rank: 0, .. }) => {}
                        other => panic!("rank 0: expected Poisoned by the timeout, got {other:?}"),
                    }
                } else {
                    // Rank 1 skips the call; rank 0's abort reaches its record.
                    std::thread::sleep(Duration::from_millis(900));
                    match comm.synchronize() {
                        Err(Error::PeerAborted { rank: 1, by: 0, .. }) => {}
                        other => panic!("rank 1: expected PeerAborted, got {other:?}"),
                    }
                }
                comm.reinitialize().unwrap();
                B::upload(dev, &[1.0; 100], &mut buf).unwrap();
                comm.all_reduce_sum_in_place_with(&mut buf, &AllReduceOptions::new())
                    .unwrap();
                comm.synchronize().unwrap();
                assert_eq!(B::download(dev, &buf).unwrap(), vec![2.0; 100]);
            });
        }
    });
}
