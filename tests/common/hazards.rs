//! Schedules that break a careless implementation, generic over the backend: skewed
//! ranks, changing widths, early frees, racing threads, late peers, the sign of zero.
//! Worlds larger than the device count share devices.

use std::time::Duration;

use peercomm::backend::Backend;
use peercomm::{
    Algorithm, AllReduceOptions, CommConfig, Element, Error, ReduceOp, SingleController,
};
use rand::rngs::StdRng;
use rand::Rng;

use super::{
    prepare_random, random_inputs, rng, run_batch, run_case, sprinkle_zeros, upload, views,
    views_mut, Call, Place, Prepared, Zeros,
};

/// Sized for the hazards' messages (Lamport up to 1 MiB, 4 MiB staged), with a timeout
/// that turns a hang into a failure without waiting a minute.
pub fn hazard_config(max_blocks: Option<u32>) -> CommConfig {
    CommConfig::default()
        .with_lamport_slot_bytes(1 << 20)
        .with_payload_bytes(4 << 20)
        .with_barrier_timeout(Some(Duration::from_secs(20)))
        .with_max_blocks(max_blocks)
}

/// One `#[test]` per hazard, each calling `common::hazards::<case>` with the suite's
/// `place_or_skip` and block bound. Used inside `reference_suite!`.
#[macro_export]
macro_rules! hazard_tests {
    ($backend:ty, $max_blocks:expr, $($case:ident),+ $(,)?) => {$(
        #[test]
        fn $case() {
            common::hazards::$case::<$backend>(&place_or_skip, $max_blocks);
        }
    )+};
}

/// (a) Forced Lamport while the width changes (`[world, 1, world, world]` x 5), rank 0
/// 20 ms late, no synchronisation: stale Lamport state across a width change shows.
pub fn lamport_after_width_change_with_late_rank<B: Backend>(
    place: Place,
    max_blocks: Option<u32>,
) {
    let name = "lamport_after_width_change_with_late_rank";
    for world in [2, 4] {
        let Some(placement) = place(name, world) else {
            return;
        };
        let comm = placement.open::<B>(hazard_config(max_blocks));
        let mut rng = rng(&format!("{name}_world_{world}"));
        let widths = [world, 1, world, world];
        let mut calls: Vec<Prepared<B, f32>> = (0..5)
            .flat_map(|_| widths)
            .map(|width| {
                let opts = AllReduceOptions::new()
                    .group_size(width)
                    .algorithm(Algorithm::Lamport);
                Prepared::new(&comm, random_inputs(&mut rng, world, 1024), false, opts)
            })
            .collect();
        let outcomes: Vec<_> = calls
            .iter_mut()
            .map(|c| {
                comm.delay_rank(0, Duration::from_millis(20)).unwrap();
                c.enqueue(&comm)
            })
            .collect();
        comm.synchronize()
            .unwrap_or_else(|e| panic!("{name}, world {world}: synchronize: {e}"));
        // The sums of every call first (the defect this test exists for: stale Lamport
        // data summed in after a width change), then what each call returned.
        let what = |i: usize, c: &Prepared<B, f32>| {
            format!("{name}, world {world}, call {i}: {}", c.describe(world))
        };
        for (i, (c, outcome)) in calls.iter().zip(&outcomes).enumerate() {
            if let Ok(ran) = outcome {
                let (results, width) = (c.results(&comm), c.width(world));
                super::check_result(&c.ins, &results, width, *ran, &what(i, c));
            }
        }
        for (i, (c, outcome)) in calls.iter().zip(&outcomes).enumerate() {
            c.check(&comm, outcome, &what(i, c));
        }
        eprintln!("{name}: world {world}: {} calls checked", calls.len());
    }
}

/// (b) Buffers (1-4 MiB) dropped right after the call returns, 40 rounds, then one
/// checked call: frees must be stream-ordered.
pub fn drop_buffers_before_synchronize<B: Backend>(place: Place, max_blocks: Option<u32>) {
    let name = "drop_buffers_before_synchronize";
    let Some(placement) = place(name, 2) else {
        return;
    };
    let comm = placement.open::<B>(hazard_config(max_blocks));
    let world = comm.world_size();
    let mut rng = rng(name);
    let most = 1 << 20; // f32 elements: 4 MiB
    let values: Vec<Vec<f32>> = random_inputs(&mut rng, world, most);
    let rounds = 40;
    for round in 0..rounds {
        let len = rng.random_range(most / 4..=most);
        let algorithm = [Algorithm::OneStage, Algorithm::TwoStage, Algorithm::Auto][round % 3];
        let in_place = round % 4 == 3;
        let ranks = comm.cores().iter();
        let ins = ranks.clone().zip(&values);
        let mut ins: Vec<_> = ins
            .map(|(k, v)| upload::<B, f32>(k.device(), &v[..len]))
            .collect();
        let outs = ranks.filter(|_| !in_place);
        let outs = outs.map(|k| B::alloc_buffer::<f32>(k.device(), len).unwrap());
        let mut outs: Vec<_> = outs.collect();
        let opts = AllReduceOptions::new().algorithm(algorithm);
        let outcome = if in_place {
            comm.all_reduce_in_place(&mut views_mut(&mut ins), &ReduceOp::Sum, &opts)
        } else {
            comm.all_reduce(
                &views(&ins),
                &mut views_mut(&mut outs),
                &ReduceOp::Sum,
                &opts,
            )
        };
        outcome.unwrap_or_else(|e| panic!("{name}, round {round}: {e}"));
        drop(ins);
        drop(outs);
    }
    comm.synchronize()
        .unwrap_or_else(|e| panic!("{name}: synchronize after {rounds} rounds: {e}"));
    for algorithm in Algorithm::ALL {
        run_case::<B, f32>(&comm, &mut rng, algorithm, 0, 100_003, false)
            .unwrap_or_else(|e| panic!("{name}: the checked call after the rounds: {e}"));
    }
    eprintln!(
        "{name}: {rounds} rounds of buffers dropped before synchronize, then 3 checked calls"
    );
}

/// (c) Threads share one `&SingleController`, each making and checking its own calls:
/// every collective must be enqueued on all ranks atomically.
pub fn concurrent_callers_share_one_communicator<B: Backend>(
    place: Place,
    max_blocks: Option<u32>,
) {
    let name = "concurrent_callers_share_one_communicator";
    for (world, threads) in [(2, 3), (4, 4)] {
        let Some(placement) = place(name, world) else {
            return;
        };
        let comm = placement.open::<B>(hazard_config(max_blocks));
        let seed = super::seed(&format!("{name}_world_{world}"));
        let calls_per_thread = 40;
        std::thread::scope(|s| {
            for t in 0..threads {
                let comm = &comm;
                s.spawn(move || {
                    let mut rng = <StdRng as rand::SeedableRng>::seed_from_u64(seed ^ t as u64);
                    let knobs = super::fuzz::Knobs {
                        max_bytes: 256 << 10,
                        ..super::fuzz::Knobs::new(calls_per_thread)
                    };
                    for i in 0..calls_per_thread {
                        let d = super::fuzz::draw(&mut rng, world, &knobs);
                        let mut call = d.prepare(comm, &mut rng);
                        let what = format!(
                            "{name}, world {world}, thread {t}, call {i}: {}",
                            call.describe(world)
                        );
                        let outcome = call.enqueue(comm);
                        comm.synchronize()
                            .unwrap_or_else(|e| panic!("{what}: synchronize: {e}"));
                        call.check(comm, &outcome, &what);
                    }
                });
            }
        });
        eprintln!(
            "{name}: world {world}: {threads} threads x {calls_per_thread} calls, each checked"
        );
    }
}

/// (d) Rank 1 three timeouts late: `synchronize` reports rank 0's `BarrierTimeout`, no
/// rank writes its output, `reinitialize` recovers; a peer late by a quarter succeeds.
pub fn late_peer_after_timeout<B: Backend>(place: Place, max_blocks: Option<u32>) {
    let name = "late_peer_after_timeout";
    let Some(placement) = place(name, 2) else {
        return;
    };
    let timeout = Duration::from_millis(250);
    let comm = placement.open::<B>(hazard_config(max_blocks).with_barrier_timeout(Some(timeout)));
    let mut rng = rng(name);
    late_peer_times_out_and_writes_nothing(&comm, &mut rng, timeout);
    late_peer_within_timeout_succeeds(&comm, &mut rng, timeout);
}

/// The first half of (d), on a communicator whose barrier timeout is `timeout`.
pub fn late_peer_times_out_and_writes_nothing<B: Backend>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    timeout: Duration,
) {
    let world = comm.world_size();
    let ins = random_inputs::<f32>(rng, world, 4099);
    let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    let mut call = Prepared::<B, f32>::new(comm, ins, false, opts);
    comm.delay_rank(1, 3 * timeout).unwrap();
    call.enqueue(comm)
        .expect("the call is enqueued (the timeout is found on the device)");
    match comm.synchronize() {
        Err(Error::BarrierTimeout { rank: 0, .. }) => {}
        other => panic!(
            "rank 1 late by {:?} with a timeout of {timeout:?}: expected rank 0's \
             BarrierTimeout (the root cause) from synchronize, got {other:?}",
            3 * timeout
        ),
    }
    assert!(comm.is_poisoned(), "a timeout must poison the communicator");
    let outs = call.results(comm);
    for (r, out) in outs.iter().enumerate() {
        let written = out.iter().filter(|x| !x.is_nan()).count();
        assert_eq!(
            written,
            0,
            "rank {r} wrote {written} of {} output elements after its group gave up \
             (rank 1 started after rank 0 abandoned the start barrier and must not pass it)",
            out.len()
        );
    }
    comm.reinitialize().unwrap();
    assert!(!comm.is_poisoned());
    for algorithm in Algorithm::ALL {
        run_case::<B, f32>(comm, rng, algorithm, 0, 777, false)
            .unwrap_or_else(|e| panic!("after reinitialize: {e}"));
    }
}

/// The second half of (d): rank 1 late by a quarter of the timeout; every algorithm
/// succeeds and is checked.
pub fn late_peer_within_timeout_succeeds<B: Backend>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    timeout: Duration,
) {
    let world = comm.world_size();
    let mut calls: Vec<Box<dyn Call<B>>> = Vec::new();
    for algorithm in Algorithm::ALL {
        let opts = AllReduceOptions::new().algorithm(algorithm);
        calls.push(Box::new(Prepared::<B, f32>::new(
            comm,
            random_inputs(rng, world, 4099),
            false,
            opts,
        )));
    }
    let outcomes: Vec<_> = calls
        .iter_mut()
        .map(|c| {
            comm.delay_rank(1, timeout / 4).unwrap();
            c.enqueue(comm)
        })
        .collect();
    comm.synchronize().unwrap_or_else(|e| {
        panic!(
            "rank 1 late by {:?} with a timeout of {timeout:?} must succeed: {e}",
            timeout / 4
        )
    });
    for (c, outcome) in calls.iter().zip(&outcomes) {
        c.check(
            comm,
            outcome,
            &format!("rank 1 late by {:?}: {}", timeout / 4, c.describe(world)),
        );
    }
}

/// (e) A group of one returns its input bit for bit (-0.0 included) for every
/// algorithm, dtype and placement, in worlds of one, two and four.
pub fn sign_of_zero_in_groups_of_one<B: Backend>(place: Place, max_blocks: Option<u32>) {
    let name = "sign_of_zero_in_groups_of_one";
    let zeros = Zeros {
        lane: 0.3,
        column: 0.1,
        positive: 0.05,
    };
    for world in [1, 2, 4] {
        let Some(placement) = place(name, world) else {
            return;
        };
        let comm = placement.open::<B>(hazard_config(max_blocks));
        let mut rng = rng(&format!("{name}_world_{world}"));
        let mut calls: Vec<Box<dyn Call<B>>> = Vec::new();
        for algorithm in super::REQUESTS {
            for dtype in super::EVERY_KERNEL {
                for len in [1, 7, 33, 1000, 4099] {
                    for in_place in [false, true] {
                        let opts = AllReduceOptions::new().group_size(1).algorithm(algorithm);
                        calls.push(prepare_random(
                            &comm, &mut rng, dtype, len, zeros, in_place, opts,
                        ));
                    }
                }
            }
        }
        let n = calls.len();
        run_batch(&comm, &mut calls, &format!("{name}, world {world}"));
        eprintln!("{name}: world {world}: {n} calls over groups of one returned their inputs");
    }
}

/// (f) The algorithms give the same bits on the same inputs, and an element's result
/// does not depend on the message length (n against the first n of 2n).
pub fn algorithms_agree_bitwise_and_ignore_length<B: Backend>(
    place: Place,
    max_blocks: Option<u32>,
) {
    let name = "algorithms_agree_bitwise_and_ignore_length";
    for (world, group_size) in [(2, 0), (3, 0), (4, 0), (4, 2)] {
        let Some(placement) = place(name, world) else {
            return;
        };
        let comm = placement.open::<B>(hazard_config(max_blocks));
        let mut rng = rng(&format!("{name}_world_{world}_group_{group_size}"));
        let mut compared = 0;
        for n in [1, 5, 8, 9, 127, 1000, 4099, 65_537] {
            compared += agree::<B, f32>(&comm, &mut rng, group_size, n);
            compared += agree::<B, half::f16>(&comm, &mut rng, group_size, n);
            compared += agree::<B, half::bf16>(&comm, &mut rng, group_size, n);
        }
        eprintln!(
            "{name}: world {world}, group {}: {compared} element results agree across \
             algorithms and lengths",
            if group_size == 0 { world } else { group_size }
        );
    }
}

/// Runs every algorithm allowed over `group_size` at lengths n and 2n on the same
/// inputs, checks each call, and compares the first n elements of every result.
fn agree<B: Backend, T: Element>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    group_size: usize,
    n: usize,
) -> usize {
    let world = comm.world_size();
    let algorithms: &[Algorithm] = if group_size == 0 || group_size == world {
        &Algorithm::ALL
    } else {
        &[Algorithm::OneStage, Algorithm::TwoStage]
    };
    let mut long = random_inputs::<T>(rng, world, 2 * n);
    sprinkle_zeros(rng, &mut long, Zeros::LANES);
    let short: Vec<Vec<T>> = long.iter().map(|v| v[..n].to_vec()).collect();
    let mut calls: Vec<(Algorithm, usize, Prepared<B, T>)> = Vec::new();
    for &algorithm in algorithms {
        for ins in [&short, &long] {
            let opts = AllReduceOptions::new()
                .group_size(group_size)
                .algorithm(algorithm);
            calls.push((
                algorithm,
                ins[0].len(),
                Prepared::new(comm, ins.clone(), false, opts),
            ));
        }
    }
    let outcomes: Vec<_> = calls.iter_mut().map(|(_, _, c)| c.enqueue(comm)).collect();
    comm.synchronize().unwrap();
    let mut results = Vec::new();
    for ((algorithm, len, c), outcome) in calls.iter().zip(&outcomes) {
        let what = format!("{} of {len}: {}", algorithm.name(), c.describe(world));
        c.check(comm, outcome, &what);
        results.push((*algorithm, *len, c.results(comm)));
    }
    let (lead_alg, lead_len, lead) = &results[0];
    for (algorithm, len, res) in &results[1..] {
        for r in 0..world {
            for e in 0..n {
                assert_eq!(
                    res[r][e].to_bits_u32(),
                    lead[r][e].to_bits_u32(),
                    "{:?}, world {world}, group size {group_size}, rank {r}, element {e}: \
                     {} over {len} elements gives {:?}, {} over {lead_len} gives {:?} \
                     (inputs {:?})",
                    T::DTYPE,
                    algorithm.name(),
                    res[r][e],
                    lead_alg.name(),
                    lead[r][e],
                    long.iter().map(|v| v[e]).collect::<Vec<_>>()
                );
            }
        }
    }
    (results.len() - 1) * world * n
}
