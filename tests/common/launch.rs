//! The single controller's parallel launch: the same bits on and off, a launch failing
//! on one rank poisons (once another rank was launched), a drop joins the threads.

use std::time::{Duration, Instant};

use peercomm::backend::Backend;
use peercomm::{Algorithm, AllReduceOptions, CommConfig, DType, Error, Result, SingleController};
use rand::rngs::StdRng;

use super::{
    expected, prepare_random, random_inputs, rng, suite_config, Call, Expected, Place, Prepared,
    Zeros,
};

/// The calls of one comparison: every algorithm the width allows, three dtypes, short
/// and long, in place and not (`(dtype, len, in place, options)`).
fn cases(world: usize) -> Vec<(DType, usize, bool, AllReduceOptions)> {
    let mut cases = Vec::new();
    for group in super::group_sizes(world) {
        let group_size = if group == world { 0 } else { group };
        for algorithm in [Algorithm::Auto].into_iter().chain(Algorithm::ALL) {
            if matches!(expected(algorithm, group, world), Expected::Unsupported) {
                continue;
            }
            for (i, dtype) in super::EVERY_KERNEL.into_iter().enumerate() {
                for len in [7, 4096 + 3] {
                    let opts = AllReduceOptions::new()
                        .group_size(group_size)
                        .algorithm(algorithm);
                    cases.push((dtype, len, (i + len) % 2 == 1, opts));
                }
            }
        }
    }
    cases
}

/// Runs `cases` on fresh data back to back, then as a group; checks each and returns
/// every outcome and every rank's bits.
fn run_cases<B: Backend>(
    comm: &SingleController<B>,
    seed: u64,
    cases: &[(DType, usize, bool, AllReduceOptions)],
    what: &str,
) -> Vec<(Result<Algorithm>, Vec<Vec<u32>>)> {
    let mut rng: StdRng = rand::SeedableRng::seed_from_u64(seed);
    let mut calls: Vec<Box<dyn Call<B>>> = cases
        .iter()
        .map(|&(dtype, len, in_place, opts)| {
            prepare_random(comm, &mut rng, dtype, len, Zeros::NONE, in_place, opts)
        })
        .collect();
    let outcomes: Vec<Result<Algorithm>> = calls.iter_mut().map(|c| c.enqueue(comm)).collect();
    // A group of whole-world all-reduces (`launch_group_on_all`).
    let world = comm.world_size();
    let mut grouped: Vec<Prepared<B, f32>> = (0..3)
        .map(|i| {
            let ins = random_inputs::<f32>(&mut rng, world, 100 + 37 * i);
            Prepared::new(comm, ins, i == 1, AllReduceOptions::new())
        })
        .collect();
    let mut group = comm.group();
    for call in grouped.iter_mut() {
        call.add_to_group(&mut group).expect("add to the group");
    }
    let group_outcome = group.end();
    comm.synchronize()
        .unwrap_or_else(|e| panic!("{what}: synchronize: {e}"));
    let mut out = Vec::new();
    for (i, (call, outcome)) in calls.iter().zip(outcomes).enumerate() {
        call.check(
            comm,
            &outcome,
            &format!("{what}, call {i}: {}", call.describe(world)),
        );
        out.push((outcome, call.result_bits(comm)));
    }
    let algorithms = group_outcome.unwrap_or_else(|e| panic!("{what}: the group: {e}"));
    for (i, (call, algorithm)) in grouped.iter().zip(algorithms).enumerate() {
        let outcome = Ok(algorithm);
        call.check(comm, &outcome, &format!("{what}, grouped call {i}"));
        out.push((outcome, call.result_bits(comm)));
    }
    out
}

/// Worlds 2 and 4: the same bits and algorithms with parallel launch on and off
/// (switched at run time and from the configuration).
pub fn parallel_matches_sequential<B: Backend>(place: Place, max_blocks: Option<u32>) {
    let name = "parallel_launch_matches_sequential";
    for world in [2, 4] {
        let Some(placement) = place(name, world) else {
            return;
        };
        let seed = super::seed(&format!("{name}_world_{world}"));
        let cases = cases(world);
        let comm = placement.open::<B>(suite_config(max_blocks));
        assert!(comm.parallel_launch(), "parallel launch is on by default");
        let parallel = run_cases(&comm, seed, &cases, &format!("{name}, world {world}, on"));
        comm.set_parallel_launch(false).unwrap();
        assert!(!comm.parallel_launch());
        let sequential = run_cases(&comm, seed, &cases, &format!("{name}, world {world}, off"));
        drop(comm);
        let config = suite_config(max_blocks).with_parallel_launch(false);
        let comm = placement.open::<B>(config);
        assert!(!comm.parallel_launch());
        let configured_off = run_cases(&comm, seed, &cases, &format!("{name}, world {world}, off"));
        comm.set_parallel_launch(true).unwrap();
        let switched_on = run_cases(&comm, seed, &cases, &format!("{name}, world {world}, on"));
        for (i, (p, s)) in parallel.iter().zip(&sequential).enumerate() {
            assert_eq!(
                p.0, s.0,
                "{name}, world {world}, call {i}: the algorithm differs"
            );
            assert!(
                p.1 == s.1,
                "{name}, world {world}, call {i}: the bits differ with parallel launch on \
                 and off"
            );
        }
        assert!(parallel == configured_off && parallel == switched_on);
        eprintln!(
            "{name}: world {world}: {} calls, the same bits with parallel launch on and off",
            parallel.len()
        );
    }
}

/// A short timeout: the ranks that were launched give up quickly.
fn fault_config(max_blocks: Option<u32>) -> CommConfig {
    suite_config(max_blocks).with_barrier_timeout(Some(Duration::from_millis(200)))
}

/// One all-reduce (or, `grouped`, a group of two) of fresh data on every rank.
fn call<B: Backend>(comm: &SingleController<B>, rng: &mut StdRng, grouped: bool) -> Result<()> {
    let world = comm.world_size();
    let opts = AllReduceOptions::new();
    let mut calls: Vec<Prepared<B, f32>> = (0..1 + usize::from(grouped))
        .map(|_| Prepared::new(comm, random_inputs(rng, world, 300), false, opts))
        .collect();
    if grouped {
        let mut group = comm.group();
        for c in calls.iter_mut() {
            c.add_to_group(&mut group)?;
        }
        group.end().map(|_| ())
    } else {
        calls[0].enqueue(comm).map(|_| ())
    }
}

/// `fail_next_launch` is a typed error that poisons once another rank was launched
/// (always in parallel; sequentially not when the first rank fails). Single calls and
/// groups; `reinitialize` recovers.
pub fn launch_failure_poisons<B: Backend>(place: Place, max_blocks: Option<u32>) {
    let name = "parallel_launch_failure_poisons";
    let mut rng = rng(name);
    for world in [2, 4] {
        let Some(placement) = place(name, world) else {
            return;
        };
        let comm = placement.open::<B>(fault_config(max_blocks));
        for parallel in [true, false] {
            comm.set_parallel_launch(parallel).unwrap();
            for failing in [0, world - 1] {
                for grouped in [false, true] {
                    let what = format!(
                        "{name}: world {world}, parallel {parallel}, rank {failing} fails, \
                         grouped {grouped}"
                    );
                    comm.fail_next_launch(failing).unwrap();
                    let got = call(&comm, &mut rng, grouped);
                    let injected = matches!(got, Err(Error::Backend { call: "launch", .. }));
                    assert!(
                        injected,
                        "{what}: expected the injected launch error, got {got:?}"
                    );
                    let poisons = parallel || failing > 0;
                    assert_eq!(comm.is_poisoned(), poisons, "{what}");
                    if poisons {
                        match call(&comm, &mut rng, false) {
                            Err(Error::Poisoned { first })
                                if matches!(*first, Error::Backend { call: "launch", .. }) => {}
                            other => {
                                panic!("{what}: expected Poisoned by the launch, got {other:?}")
                            }
                        }
                        // The launched ranks time out waiting for the one that failed.
                        let _ = comm.synchronize();
                        comm.reinitialize().unwrap();
                        assert!(!comm.is_poisoned(), "{what}");
                    }
                    call(&comm, &mut rng, grouped)
                        .unwrap_or_else(|e| panic!("{what}: the call after: {e}"));
                    comm.synchronize()
                        .unwrap_or_else(|e| panic!("{what}: the call after: {e}"));
                }
            }
        }
        eprintln!("{name}: world {world}: every injected launch failure reported and recovered");
    }
}

/// A small communicator: the drop test builds many.
fn small_config(max_blocks: Option<u32>) -> CommConfig {
    CommConfig::default()
        .with_lamport_slot_bytes(64 << 10)
        .with_payload_bytes(1 << 20)
        .with_barrier_timeout(Some(Duration::from_secs(60)))
        .with_max_blocks(max_blocks)
}

/// Building and dropping `count` communicators (worlds 2 and 4) ends every launch
/// thread in bounded time.
pub fn drop_joins_launch_threads<B: Backend>(place: Place, max_blocks: Option<u32>, count: usize) {
    let name = "parallel_launch_drop_joins_threads";
    for world in [2, 4] {
        let Some(placement) = place(name, world) else {
            return;
        };
        let started = Instant::now();
        for i in 0..count {
            let comm = placement.open::<B>(small_config(max_blocks));
            let pool = comm
                .launch_pool_probe()
                .expect("a world of two or more starts the launch threads");
            if i % 10 == 0 {
                comm.delay_all(Duration::ZERO).unwrap();
                comm.barrier(0).unwrap();
                comm.synchronize().unwrap();
            }
            drop(comm);
            assert!(
                pool.upgrade().is_none(),
                "{name}: world {world}: communicator {i}'s launch threads outlived it"
            );
        }
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(240),
            "{name}: world {world}: {count} communicators took {took:?}"
        );
        eprintln!("{name}: world {world}: {count} communicators built and dropped in {took:?}");
    }
    // Off from the configuration: no threads at all.
    if let Some(placement) = place(name, 2) {
        let comm = placement.open::<B>(small_config(max_blocks).with_parallel_launch(false));
        assert!(comm.launch_pool_probe().is_none());
    }
}
