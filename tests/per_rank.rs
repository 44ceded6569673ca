//! The per-rank communicator on the host backend, one thread per rank (the suite is in
//! tests/per_rank_suite). Multi-process runs are in tests/per_rank_processes.rs.

mod common;
mod per_rank_suite;

use peercomm::backend::host::Host;
use per_rank_suite::Placement;

const HOST: Placement = Placement {
    devices: peercomm::MAX_GPUS,
    max_blocks: 2,
};

#[test]
fn per_rank_threads_world_2() {
    per_rank_suite::checked_calls::<Host>(&HOST, 2);
}

#[test]
fn per_rank_threads_world_3() {
    per_rank_suite::checked_calls::<Host>(&HOST, 3);
}

#[test]
fn per_rank_threads_world_4() {
    per_rank_suite::checked_calls::<Host>(&HOST, 4);
}

#[test]
fn per_rank_threads_world_8() {
    per_rank_suite::checked_calls::<Host>(&HOST, 8);
}

#[test]
fn per_rank_refuses_two_stage() {
    per_rank_suite::refuses_two_stage::<Host>(&HOST);
}

#[test]
fn per_rank_independent_sibling_groups() {
    per_rank_suite::independent_sibling_groups::<Host>(&HOST);
}

#[test]
fn per_rank_missing_call_times_out_and_recovers() {
    per_rank_suite::missing_call_times_out_and_recovers::<Host>(&HOST);
}

#[test]
fn per_rank_miss_next_times_out_and_recovers() {
    per_rank_suite::fault::miss_next_times_out_and_recovers::<Host>(&HOST);
}

#[test]
fn per_rank_sized_for_the_largest_message() {
    per_rank_suite::sizing::sized_for_the_largest_message::<Host>(&HOST);
}

#[test]
fn per_rank_fuzz_world_2() {
    per_rank_suite::fuzz::fuzz_threads::<Host>(&HOST, 2, 1200, 24);
}

#[test]
fn per_rank_fuzz_world_4() {
    per_rank_suite::fuzz::fuzz_threads::<Host>(&HOST, 4, 600, 24);
}

#[test]
fn per_rank_fuzz_world_8() {
    per_rank_suite::fuzz::fuzz_threads::<Host>(&HOST, 8, 300, 16);
}

#[test]
fn per_rank_collectives_world_2() {
    per_rank_suite::collectives::checked::<Host>(&HOST, 2);
}

#[test]
fn per_rank_collectives_world_3() {
    per_rank_suite::collectives::checked::<Host>(&HOST, 3);
}

#[test]
fn per_rank_collectives_world_4() {
    per_rank_suite::collectives::checked::<Host>(&HOST, 4);
}

#[test]
fn per_rank_collectives_world_8() {
    per_rank_suite::collectives::checked::<Host>(&HOST, 8);
}

#[test]
fn per_rank_collectives_bad_inputs() {
    per_rank_suite::collectives::bad_inputs::<Host>(&HOST);
}
