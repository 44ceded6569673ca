//! The per-rank communicator (`peercomm::Comm`) with one thread per rank, generic over
//! the backend: every rank checks its own outputs against the f64 reference of inputs
//! that every rank can rebuild from a shared seed, and bitwise against its group's first
//! rank. `per_rank_suite!` instantiates every generic test for one backend
//! (tests/per_rank.rs: host, tests/cuda_per_rank.rs: CUDA, tests/hip_per_rank.rs: HIP);
//! a [`Scope`] says which worlds and sizes that backend's time allows.

#![allow(dead_code)]

use super::common;

// The suite's macros come before its modules, which use them.

/// `$f::<$b, T>(args)`, `T` the element type of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $f:ident::<$b:ty>($($arg:expr),* $(,)?)) => {
        match $dtype {
            peercomm::DType::F32 => $f::<$b, f32>($($arg),*),
            peercomm::DType::F16 => $f::<$b, half::f16>($($arg),*),
            peercomm::DType::BF16 => $f::<$b, half::bf16>($($arg),*),
            peercomm::DType::F64 => $f::<$b, f64>($($arg),*),
            peercomm::DType::I8 => $f::<$b, i8>($($arg),*),
            peercomm::DType::U8 => $f::<$b, u8>($($arg),*),
            peercomm::DType::I32 => $f::<$b, i32>($($arg),*),
            peercomm::DType::U32 => $f::<$b, u32>($($arg),*),
            peercomm::DType::I64 => $f::<$b, i64>($($arg),*),
            peercomm::DType::U64 => $f::<$b, u64>($($arg),*),
            #[allow(unreachable_patterns)]
            other => unreachable!("no test type for {other:?}"),
        }
    };
}

/// `(what, call)` rows: `what => call, ...`.
macro_rules! rows {
    ($($what:expr => $call:expr),+ $(,)?) => {
        vec![$(($what, $call)),+]
    };
}

/// Mismatch cases (`agreement::Case`): `what, Field: usual, other;` rows.
macro_rules! cases {
    ($($what:expr, $field:ident: $usual:expr, $other:expr;)+) => {
        vec![$(($what, peercomm::CallField::$field, $usual, $other)),+]
    };
}

pub mod agreement;
pub mod all_reduce;
pub mod bounds;
#[cfg(feature = "cuda")]
pub mod capture_graphs;
pub mod capture_inputs;
pub mod chunked;
pub mod collectives;
pub mod descriptor_channel;
pub mod device_api;
pub mod fault;
pub mod fused;
pub mod fuzz;
pub mod identity;
pub mod ops;
pub mod overlaps;
pub mod point_to_point;
pub mod process_faults;
pub mod processes;
pub mod recovery;
pub mod sizing;
pub mod symmetric_trim;
pub mod teardown;
pub mod views;
pub mod zero_copy;

use std::sync::Barrier;
use std::time::Duration;

use peercomm::backend::{Backend, DeviceBuffer};
use peercomm::bootstrap::UniqueId;
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig, Element, Error, ReduceOp};
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Where rank `r` of a world runs: its device ordinal, and the communicator settings
/// (several ranks may share a device when the backend has fewer than the world).
pub struct Placement {
    /// Devices the backend has.
    pub devices: usize,
    /// Blocks per launch (small when ranks share a device, so all are resident).
    pub max_blocks: u32,
}

impl Placement {
    /// Rank `rank`'s device ordinal.
    pub fn ordinal(&self, rank: usize) -> usize {
        rank % self.devices
    }
    /// The suite's configuration for `world` ranks.
    pub fn config(&self, world: usize) -> CommConfig {
        CommConfig::default()
            .with_lamport_slot_bytes(1 << 20)
            .with_payload_bytes(4 << 20)
            .with_barrier_timeout(Some(Duration::from_secs(30)))
            .with_max_blocks(Some(self.max_blocks))
            .with_bootstrap_timeout(Duration::from_secs(30))
            .with_allow_shared_devices(world > self.devices)
            // The memcheck stage of scripts/device.sh sets it: NCCL cannot start under
            // compute-sanitizer (its kernels do not load there).
            .with_fallback(if std::env::var_os("PEERCOMM_TEST_NO_FALLBACK").is_some() {
                peercomm::FallbackConfig::peer_memory_only()
            } else {
                Default::default()
            })
    }
}

/// The host backend's placement: a device per rank, 2 blocks per launch.
pub const HOST: Placement = Placement {
    devices: peercomm::MAX_GPUS,
    max_blocks: 2,
};

pub use common::seed;

/// Every rank's input of case `case`: the same in every thread.
pub fn inputs<T: Element>(seed: u64, case: usize, world: usize, len: usize) -> Vec<Vec<T>> {
    let mut rng = StdRng::seed_from_u64(seed ^ ((case as u64) << 24));
    common::random_inputs::<T>(&mut rng, world, len)
}

/// A one-stage all-reduce from `input` (all `rank + 1` on every rank) into a poisoned
/// output, waited for: every element must be the sum over the ranks.
pub fn check_rank_sum<B: Backend>(comm: &Comm<B>, input: &dyn DeviceBuffer<B>) {
    let (dev, world, n) = (comm.device(), comm.world_size(), input.len());
    let mut out = B::alloc_from(dev, &nan::<f32>(n)).unwrap();
    let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    comm.all_reduce_with(input, &mut out, &ReduceOp::Sum, &one)
        .unwrap();
    comm.synchronize().unwrap();
    let want = vec![(world * (world + 1) / 2) as f32; n];
    let note = format!("rank {}", comm.rank());
    assert_eq!(B::download(dev, &out).unwrap(), want, "{note}");
}

/// Polls `check_errors` until it reports an error (before `deadline`), which it returns.
pub fn first_error<B: Backend>(comm: &Comm<B>, deadline: std::time::Instant) -> Error {
    loop {
        match comm.check_errors() {
            Ok(()) => assert!(std::time::Instant::now() < deadline, "no error seen"),
            Err(e) => return e,
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `len` poisons (NaNs of the floats, `common::poison`): a poisoned output.
pub fn nan<T: Element>(len: usize) -> Vec<T> {
    vec![common::poison::<T>(); len]
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
    world_threads(place, world, config, &|_| {}, |rank, comm, _| {
        body(rank, comm)
    })
}

/// Runs `body(rank, comm, meet)` on one thread per rank over `config`; `meet` is a
/// barrier of the world's threads.
pub fn in_step<B: Backend, R: Send>(
    place: &Placement,
    world: usize,
    config: &CommConfig,
    body: impl Fn(usize, &Comm<B>, &Barrier) -> R + Sync,
) -> Vec<R> {
    world_threads(place, world, config, &|_| {}, |rank, comm, meet| {
        body(rank, &comm, meet)
    })
}

/// The one world runner: one thread per rank, each calling `before(rank)`, then making
/// its `Comm` over `config` and running `body(rank, comm, meet)`, `meet` a barrier of
/// the world's threads.
pub fn world_threads<B: Backend, R: Send>(
    place: &Placement,
    world: usize,
    config: &CommConfig,
    before: &(dyn Fn(usize) + Sync),
    body: impl Fn(usize, Comm<B>, &Barrier) -> R + Sync,
) -> Vec<R> {
    let id = UniqueId::new().unwrap();
    let meet = Barrier::new(world);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..world)
            .map(|rank| {
                let (id, body, meet, config) = (&id, &body, &meet, config.clone());
                s.spawn(move || {
                    before(rank);
                    let dev = B::open(place.ordinal(rank)).unwrap();
                    let comm = Comm::<B>::from_rank(dev, rank, world, id, config).unwrap();
                    body(rank, comm, meet)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    })
}

/// What one backend runs of the suite: the worlds and sizes its time allows (a world
/// outside them prints a skip).
pub struct Scope {
    /// Worlds of the checked calls and of the zero-copy all-reduce.
    pub calls: &'static [usize],
    /// Worlds of the other collectives, zero copy included.
    pub collectives: &'static [usize],
    /// The fuzzer's worlds: (world, calls unless PEERCOMM_FUZZ_CALLS says, batch).
    pub fuzz: &'static [(usize, usize, usize)],
    /// Payloads the chunked calls run through (`chunked::SMALL_PAYLOAD`, ...).
    pub chunk_payloads: &'static [usize],
    /// Simulated multiprocessor counts of two worlds whose ranks differ.
    pub multiprocessors: [&'static [usize]; 2],
    /// Whether views misaligned for their element type run (a GPU kernel faults on
    /// them; the host runs them).
    pub element_misaligned_views: bool,
    /// Algorithms of the zero-copy all-reduce at world 8.
    pub zero_copy_world_8: &'static [Algorithm],
    /// Rounds of a drop while a peer's collective is queued.
    pub drop_rounds: usize,
}

/// What a GPU backend runs of the suite (CUDA and HIP alike).
pub const GPU_SCOPE: Scope = Scope {
    calls: &[2, 4, 8],
    collectives: &[2, 4],
    fuzz: &[(2, 2000, 24), (4, 2000, 24)],
    // Halves of 129 packs, and of 2049: more than the grid's 2048 threads.
    chunk_payloads: &[chunked::SMALL_PAYLOAD, chunked::GRID_PAYLOAD],
    multiprocessors: [&[4, 8], &[16, 3, 9]],
    element_misaligned_views: false,
    zero_copy_world_8: &[Algorithm::TwoStage],
    drop_rounds: 2,
};

/// A GPU backend's placement for `test`: its devices shared round-robin, 4 blocks per
/// launch so that every rank's blocks are resident; `None` after a printed skip where
/// there is no device or no driver.
pub fn gpu_placement<B: Backend>(test: &str) -> Option<Placement> {
    match B::device_count() {
        Ok(n) if n > 0 => Some(Placement {
            devices: n,
            max_blocks: 4,
        }),
        Ok(_) => {
            common::announce_skip(test, &format!("no {} device", B::NAME));
            None
        }
        Err(e) => {
            common::announce_skip(test, &format!("no {} driver: {e}", B::NAME));
            None
        }
    }
}

/// Every algorithm the zero-copy all-reduce runs.
pub const ALL_ALGORITHMS: &[Algorithm] = &[
    Algorithm::OneStage,
    Algorithm::TwoStage,
    Algorithm::Lamport,
    Algorithm::Auto,
];

/// Runs `body(place, world)` for a test of `worlds` unless the world is outside the
/// backend's scope or the backend has no device (both with a printed skip).
pub fn in_scope(
    test: &str,
    world: usize,
    worlds: &[usize],
    place: impl Fn(&str) -> Option<Placement>,
    body: impl FnOnce(&Placement),
) {
    if !worlds.contains(&world) {
        common::announce_skip(
            test,
            &format!("world {world} is outside this backend's scope"),
        );
    } else if let Some(p) = place(test) {
        body(&p);
    }
}

/// One `#[test]` per world (a module named for the behaviour, a test per world), each
/// running `body` where `$worlds` holds its world. Expanded inside `per_rank_suite!`.
#[macro_export]
#[doc(hidden)]
macro_rules! per_rank_worlds {
    ($name:ident, $worlds:expr, [$($test:ident = $w:literal),+], |$p:ident, $world:ident| $body:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $test() {
                    let test = concat!(stringify!($name), "::", stringify!($test));
                    per_rank_suite::in_scope(test, $w, $worlds, suite_place, |$p| {
                        let $world: usize = $w;
                        $body;
                    });
                }
            )+
        }
    };
}

/// One `#[test]` running `body` with the backend's placement. Expanded inside
/// `per_rank_suite!`.
#[macro_export]
#[doc(hidden)]
macro_rules! per_rank_test {
    ($($(#[$meta:meta])* $name:ident: |$p:ident| $body:expr;)+) => {
        $(
            $(#[$meta])*
            #[test]
            fn $name() {
                if let Some($p) = suite_place(stringify!($name)) {
                    let $p = &$p;
                    $body;
                }
            }
        )+
    };
}

/// Every generic per-rank test for backend `$b`: `$place` gives a test's placement (or
/// `None` after a printed skip), `$scope` the [`Scope`].
#[macro_export]
macro_rules! per_rank_suite {
    ($b:ty, $place:expr, $scope:expr) => {
        type B = $b;
        const SCOPE: per_rank_suite::Scope = $scope;

        /// The placement of `test`'s world, or `None` after a printed skip.
        fn suite_place(test: &str) -> Option<per_rank_suite::Placement> {
            $place(test)
        }

        per_rank_worlds!(checked_calls, SCOPE.calls, [world_2 = 2, world_3 = 3, world_4 = 4, world_8 = 8],
            |p, world| per_rank_suite::all_reduce::checked_calls::<B>(p, world));
        per_rank_worlds!(collectives, SCOPE.collectives, [world_2 = 2, world_3 = 3, world_4 = 4, world_8 = 8],
            |p, world| per_rank_suite::collectives::checked::<B>(p, world));
        per_rank_worlds!(chunked_all_reduce, &[2, 3, 4], [world_2 = 2, world_3 = 3, world_4 = 4], |p, world| {
            for &payload in SCOPE.chunk_payloads {
                per_rank_suite::chunked::chunked_all_reduce::<B>(p, world, payload);
            }
        });
        per_rank_worlds!(chunked_collectives, &[2, 3, 4], [world_2 = 2, world_3 = 3, world_4 = 4], |p, world| {
            for &payload in SCOPE.chunk_payloads {
                per_rank_suite::chunked::chunked_collectives::<B>(p, world, payload);
            }
        });
        per_rank_worlds!(fuzz, &SCOPE.fuzz.iter().map(|f| f.0).collect::<Vec<_>>(),
            [world_2 = 2, world_4 = 4, world_8 = 8], |p, world| {
            let &(_, calls, batch) = SCOPE.fuzz.iter().find(|f| f.0 == world).unwrap();
            let calls = common::fuzz::calls_from_env(calls);
            per_rank_suite::fuzz::fuzz_threads::<B>(p, world, calls, batch)
        });
        per_rank_worlds!(lamport_fused, &[2, 4], [world_2 = 2, world_4 = 4], |p, world| {
            let batches = per_rank_suite::fused::lamport_fused::<B>(p, world, &common::fused::DECODE_CASES);
            eprintln!("lamport_fused world {world}: {batches} batches per rank");
        });
        per_rank_worlds!(zero_copy_all_reduce, SCOPE.calls, [world_2 = 2, world_3 = 3, world_4 = 4, world_8 = 8],
            |p, world| {
            let algorithms = if world == 8 { SCOPE.zero_copy_world_8 } else { per_rank_suite::ALL_ALGORITHMS };
            per_rank_suite::zero_copy::all_reduce_matches_single_controller::<B>(p, world, algorithms)
        });
        per_rank_worlds!(zero_copy_collectives, SCOPE.collectives, [world_2 = 2, world_3 = 3, world_4 = 4, world_8 = 8],
            |p, world| per_rank_suite::zero_copy::collectives::collectives_match_single_controller::<B>(p, world));

        per_rank_worlds!(operators, SCOPE.collectives, [world_2 = 2, world_3 = 3, world_4 = 4, world_8 = 8],
            |p, world| per_rank_suite::ops::operators_checked::<B>(p, world));
        per_rank_worlds!(operators_in_a_group, &[2, 4], [world_2 = 2, world_4 = 4],
            |p, world| per_rank_suite::ops::mixed_group::<B>(p, world));
        per_rank_worlds!(reduce, SCOPE.collectives, [world_2 = 2, world_3 = 3, world_4 = 4, world_8 = 8],
            |p, world| per_rank_suite::ops::reduce_checked::<B>(p, world));
        per_rank_worlds!(group_of_collectives, &[2, 3, 4], [world_2 = 2, world_3 = 3, world_4 = 4],
            |p, world| per_rank_suite::ops::group_of_collectives::<B>(p, world));
        per_rank_worlds!(operator_mismatch, &[2, 3], [world_2 = 2, world_3 = 3],
            |p, world| per_rank_suite::ops::operator_mismatch::<B>(p, world));
        per_rank_worlds!(dtype_mismatch, &[2, 3], [world_2 = 2, world_3 = 3],
            |p, world| per_rank_suite::ops::dtype_mismatch::<B>(p, world));
        per_rank_worlds!(send_recv, &[2, 4], [world_2 = 2, world_4 = 4],
            |p, world| per_rank_suite::point_to_point::send_recv_checked::<B>(p, world));
        per_rank_worlds!(ring_and_pipeline, &[2, 3, 4], [world_2 = 2, world_3 = 3, world_4 = 4],
            |p, world| per_rank_suite::point_to_point::ring_and_pipeline::<B>(p, world));
        per_rank_worlds!(all_to_all, &[2, 3, 4], [world_2 = 2, world_3 = 3, world_4 = 4],
            |p, world| per_rank_suite::point_to_point::all_to_all_checked::<B>(p, world));
        per_rank_worlds!(all_to_all_v_moe, &[2, 4], [world_2 = 2, world_4 = 4],
            |p, world| per_rank_suite::point_to_point::all_to_all_v_moe::<B>(p, world));
        per_rank_worlds!(all_to_all_v_unaligned, &[2, 3], [world_2 = 2, world_3 = 3],
            |p, world| per_rank_suite::point_to_point::all_to_all_v_unaligned::<B>(p, world));
        per_rank_worlds!(in_place_sends, &[2, 3, 4], [world_2 = 2, world_3 = 3, world_4 = 4],
            |p, world| per_rank_suite::point_to_point::in_place_sends::<B>(p, world));
        per_rank_worlds!(device_comm_fields, &[2, 4], [world_2 = 2, world_4 = 4],
            |p, world| per_rank_suite::device_api::device_comm_fields::<B>(p, world));
        per_rank_worlds!(mismatched_calls_are_typed_errors, &[2, 3], [world_2 = 2, world_3 = 3],
            |p, world| per_rank_suite::agreement::mismatched_calls_are_typed_errors::<B>(p, world));

        per_rank_test! {
            refuses_two_stage: |p| per_rank_suite::all_reduce::refuses_two_stage::<B>(p);
            send_recv_mismatch: |p| per_rank_suite::point_to_point::send_recv_mismatch::<B>(p);
            point_to_point_bad_arguments: |p| per_rank_suite::point_to_point::bad_arguments::<B>(p);
            unmatched_sends: |p| per_rank_suite::point_to_point::unmatched_sends::<B>(p);
            a_mismatched_pair_stops_the_others: |p| per_rank_suite::point_to_point::a_mismatched_pair_stops_the_others::<B>(p);
            point_to_point_options: |p| per_rank_suite::point_to_point::options_and_groups::<B>(p);
            device_comm_refusals: |p| per_rank_suite::device_api::device_comm_refusals::<B>(p);
            unreceived_in_place_send: |p| per_rank_suite::point_to_point::unreceived_in_place_send::<B>(p);
            lamport_every_operator: |p| per_rank_suite::ops::lamport_every_operator::<B>(p);
            integer_avg_refused: |p| per_rank_suite::ops::integer_avg_refused::<B>(p);
            independent_sibling_groups: |p| per_rank_suite::all_reduce::independent_sibling_groups::<B>(p);
            missing_call_times_out_and_recovers: |p| per_rank_suite::all_reduce::missing_call_times_out_and_recovers::<B>(p);
            miss_next_times_out_and_recovers: |p| per_rank_suite::fault::miss_next_times_out_and_recovers::<B>(p);
            configuration_mismatch_names_the_fields: |p| per_rank_suite::sizing::a_configuration_mismatch_names_the_fields::<B>(p);
            sized_for_the_largest_message: |p| per_rank_suite::sizing::sized_for_the_largest_message::<B>(p);
            chunked_faults: |p| per_rank_suite::chunked::chunked_faults::<B>(p, 2);
            collectives_bad_inputs: |p| per_rank_suite::collectives::bad_inputs::<B>(p);
            lamport_fused_mismatch: |p| for world in [2, 4] { per_rank_suite::fused::lamport_fused_mismatch::<B>(p, world) };
            fused_arguments_mismatch: |p| for world in [2, 3] { per_rank_suite::fused::fused_arguments_mismatch::<B>(p, world) };
            unequal_multiprocessors_agree_on_the_grid: |p| for counts in SCOPE.multiprocessors { per_rank_suite::agreement::unequal_multiprocessors_agree_on_the_grid::<B>(p, counts) };
            group_of_one_against_a_world_call: |p| per_rank_suite::agreement::a_group_of_one_against_a_world_call_is_caught_late::<B>(p);
            different_group_widths: |p| per_rank_suite::agreement::different_group_widths_are_caught::<B>(p);
            the_rank_that_never_came_is_named: |p| per_rank_suite::agreement::the_rank_that_never_came_is_named::<B>(p);
            one_sign_of_zero: |p| for world in [2, 3] { per_rank_suite::agreement::one_sign_of_zero::<B>(p, world) };
            drop_while_peer_collective_queued: |p| per_rank_suite::teardown::drop_while_peer_collective_queued::<B>(p, SCOPE.drop_rounds);
            drop_returns_while_peer_holds_on: |p| per_rank_suite::teardown::drop_returns_while_peer_holds_on::<B>(p);
            drop_beside_a_peer_register: |p| per_rank_suite::teardown::drop_beside_a_peer_exchange::<B>(p, per_rank_suite::teardown::Exchange::Register);
            drop_beside_a_peer_alloc_symmetric: |p| per_rank_suite::teardown::drop_beside_a_peer_exchange::<B>(p, per_rank_suite::teardown::Exchange::AllocSymmetric);
            drop_beside_a_peer_trim_symmetric: |p| per_rank_suite::teardown::drop_beside_a_peer_exchange::<B>(p, per_rank_suite::teardown::Exchange::TrimSymmetric);
            drop_beside_a_peer_register_inputs_of: |p| per_rank_suite::teardown::drop_beside_a_peer_exchange::<B>(p, per_rank_suite::teardown::Exchange::RegisterInputsOf);
            drop_beside_a_peer_reinitialize: |p| per_rank_suite::teardown::drop_beside_a_peer_exchange::<B>(p, per_rank_suite::teardown::Exchange::Reinitialize);
            different_exchanges_register_alloc: |p| per_rank_suite::teardown::different_exchanges_are_typed_errors::<B>(p, &[per_rank_suite::teardown::Exchange::Register, per_rank_suite::teardown::Exchange::AllocSymmetric]);
            different_exchanges_trim_reinitialize: |p| per_rank_suite::teardown::different_exchanges_are_typed_errors::<B>(p, &[per_rank_suite::teardown::Exchange::TrimSymmetric, per_rank_suite::teardown::Exchange::Reinitialize]);
            different_exchanges_capture_register: |p| per_rank_suite::teardown::different_exchanges_are_typed_errors::<B>(p, &[per_rank_suite::teardown::Exchange::RegisterInputsOf, per_rank_suite::teardown::Exchange::Register]);
            different_exchanges_world_3: |p| per_rank_suite::teardown::different_exchanges_are_typed_errors::<B>(p, &[per_rank_suite::teardown::Exchange::Register, per_rank_suite::teardown::Exchange::Register, per_rank_suite::teardown::Exchange::AllocSymmetric]);
            zero_copy_stages_nothing: |p| per_rank_suite::zero_copy::collectives::stages_nothing::<B>(p);
            zero_copy_registration_refusals: |p| for world in [2, 3] { per_rank_suite::zero_copy::refusals::registration_refusals::<B>(p, world) };
            zero_copy_mismatched_inputs: |p| for world in [2, 3] { per_rank_suite::zero_copy::refusals::mismatched_inputs::<B>(p, world) };
            zero_copy_inputs_dropped_in_flight: |p| for world in [2, 4] { per_rank_suite::zero_copy::lifetimes::inputs_dropped_in_flight::<B>(p, world) };
            zero_copy_registered_input_retired_in_flight: |p| per_rank_suite::zero_copy::lifetimes::registered_input_retired_in_flight::<B>(p);
            zero_copy_register_drop_cycles: |p| per_rank_suite::zero_copy::lifetimes::register_drop_cycles::<B>(p, 2, 1000);
            zero_copy_symmetric_drop_cycles: |p| per_rank_suite::zero_copy::lifetimes::symmetric_drop_cycles::<B>(p, 2, 1000);
            places_compared_exactly: |p| for world in [2, 3] { per_rank_suite::zero_copy::refusals::places_compared_exactly::<B>(p, world) };
            capture_inputs_second_pass_reads_in_place: |p| for world in [2, 4] { per_rank_suite::capture_inputs::second_pass_reads_in_place::<B>(p, world) };
            capture_inputs_disagreeing_passes_are_refused: |p| for world in [2, 3] { per_rank_suite::capture_inputs::disagreeing_passes_are_refused::<B>(p, world) };
            capture_inputs_cycles_leak_nothing: |p| per_rank_suite::capture_inputs::pass_cycles_leak_nothing::<B>(p, 2, 300);
            symmetric_trim_frees_only_segments_empty_everywhere: |p| for world in [2, 3] { per_rank_suite::symmetric_trim::frees_only_segments_empty_everywhere::<B>(p, world) };
            misaligned_views: |p| per_rank_suite::views::misaligned_views::<B>(p, 0);
            views_misaligned_for_their_element_type: |p| if SCOPE.element_misaligned_views { per_rank_suite::views::misaligned_views::<B>(p, 1) } else {
                common::announce_skip("views_misaligned_for_their_element_type", "a GPU kernel faults on a view misaligned for its element type")
            };
            poisoned_names_its_cause: |p| per_rank_suite::recovery::poisoned_names_its_cause::<B>(p);
            a_leaf_without_rank_zero_names_real_functions: |p| per_rank_suite::recovery::a_leaf_without_rank_zero_names_real_functions::<B>(p);
            a_skipped_call_is_caught_where_it_is_awaited: |p| per_rank_suite::recovery::a_skipped_call_is_caught_where_it_is_awaited::<B>(p);
            check_errors_is_a_per_step_poll: |p| per_rank_suite::recovery::check_errors_is_a_per_step_poll::<B>(p);
            huge_lengths_are_refused: |p| per_rank_suite::bounds::huge_lengths_are_refused::<B>(p, 2);
            huge_buffers_in_collectives_are_refused: |p| per_rank_suite::bounds::huge_buffers_in_collectives_are_refused::<B>(p, 2);
            registered_writes_keep_the_range: |p| for world in [2, 3] { per_rank_suite::bounds::registered_writes_keep_the_range::<B>(p, world) };
            overlapping_buffers_are_refused: |p| per_rank_suite::overlaps::overlapping_buffers_are_refused::<B>(p);
            overlap_on_one_rank: |p| per_rank_suite::overlaps::overlap_on_one_rank::<B>(p);
            single_controller_overlaps: |p| per_rank_suite::overlaps::single_controller_overlaps::<B>(p);
        }
    };
}
