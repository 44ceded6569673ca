//! The reference suite on the host backend (8 simulated devices, 3 blocks: an odd grid
//! stride), plus the schedule fuzzer at worlds 2-8 (few blocks: one thread per block).

mod common;

use common::fused::{self, fused_config, DECODE_CASES};
use common::fuzz::{calls_from_env, fuzz, Knobs};
use common::Placement;
use peercomm::backend::host::Host;

reference_suite!(Host, Ok(peercomm::MAX_GPUS), Some(3), common::LENGTHS);

/// The fuzzer over `world` host devices, `calls` calls unless PEERCOMM_FUZZ_CALLS says.
fn fuzz_host(world: usize, calls: usize, max_blocks: u32) {
    let knobs = Knobs::new(calls_from_env(calls));
    fuzz::<Host>(
        &format!("fuzz_schedule_world_{world}"),
        &Placement::round_robin(world, peercomm::MAX_GPUS),
        Some(max_blocks),
        &knobs,
    );
}

tests! {
    fuzz_schedule_world_2 => fuzz_host(2, 3000, 3);
    fuzz_schedule_world_3 => fuzz_host(3, 2000, 3);
    fuzz_schedule_world_4 => fuzz_host(4, 1600, 2);
    fuzz_schedule_world_8 => fuzz_host(8, 800, 2);
}

/// The Lamport fused call against one-stage and batch invariance (tests/common/fused.rs),
/// worlds 2 and 4.
fn lamport_fused_host(world: usize) {
    let test = format!("lamport_fused_world_{world}");
    let comm = common::open::<Host>(world, fused_config(common::suite_config(Some(3))));
    let mut rng = common::rng(&test);
    let started = std::time::Instant::now();
    let batches = fused::lamport_fused_matches_one_stage(&comm, &mut rng, &DECODE_CASES);
    fused::lamport_kinds_interleave(&comm, &mut rng);
    let took = started.elapsed();
    eprintln!("{test}: {batches} batches checked in {took:?}");
}

tests! {
    lamport_fused_world_2 => lamport_fused_host(2);
    lamport_fused_world_4 => lamport_fused_host(4);
}
