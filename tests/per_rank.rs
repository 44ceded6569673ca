//! The per-rank communicator on the host backend, one thread per rank (the suite is in
//! tests/per_rank_suite). Multi-process runs are in tests/per_rank_processes.rs.

mod common;
mod per_rank_suite;

use peercomm::backend::host::Host;
use per_rank_suite::teardown::Exchange;
use per_rank_suite::{chunked, Placement};

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
fn per_rank_configuration_mismatch_names_the_fields() {
    per_rank_suite::sizing::a_configuration_mismatch_names_the_fields::<Host>(&HOST);
}

#[test]
fn per_rank_sized_for_the_largest_message() {
    per_rank_suite::sizing::sized_for_the_largest_message::<Host>(&HOST);
}

#[test]
fn per_rank_chunked_world_2() {
    per_rank_suite::chunked::chunked_all_reduce::<Host>(&HOST, 2, chunked::SMALL_PAYLOAD);
}

#[test]
fn per_rank_chunked_world_3() {
    per_rank_suite::chunked::chunked_all_reduce::<Host>(&HOST, 3, chunked::SMALL_PAYLOAD);
}

#[test]
fn per_rank_chunked_world_4() {
    per_rank_suite::chunked::chunked_all_reduce::<Host>(&HOST, 4, chunked::SMALL_PAYLOAD);
}

#[test]
fn per_rank_chunked_collectives_world_2() {
    per_rank_suite::chunked::chunked_collectives::<Host>(&HOST, 2, chunked::SMALL_PAYLOAD);
}

#[test]
fn per_rank_chunked_collectives_world_3() {
    per_rank_suite::chunked::chunked_collectives::<Host>(&HOST, 3, chunked::SMALL_PAYLOAD);
}

#[test]
fn per_rank_chunked_collectives_world_4() {
    per_rank_suite::chunked::chunked_collectives::<Host>(&HOST, 4, chunked::SMALL_PAYLOAD);
}

#[test]
fn per_rank_chunked_faults() {
    per_rank_suite::chunked::chunked_faults::<Host>(&HOST, 2);
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

#[test]
fn per_rank_unequal_multiprocessors_agree_on_the_grid() {
    per_rank_suite::trust::unequal_multiprocessors_agree_on_the_grid::<Host>(&HOST, &[1, 2]);
    per_rank_suite::trust::unequal_multiprocessors_agree_on_the_grid::<Host>(&HOST, &[3, 1, 2]);
}

/// The reported case itself: ranks whose threads are pinned to 1 and 2 cores (the host
/// backend's multiprocessors are the cores its thread may run on) and a grid left to
/// peercomm. Linux only (thread affinity); needs at least 2 cores.
#[cfg(target_os = "linux")]
#[test]
fn per_rank_unequal_core_counts_agree_on_the_grid() {
    use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
    let mine = sched_getaffinity(None).expect("affinity");
    let cpus: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| mine.is_set(c)).collect();
    if cpus.len() < 2 {
        common::announce_skip(
            "per_rank_unequal_core_counts_agree_on_the_grid",
            "needs 2 cores to pin ranks to 1 and 2 of them",
        );
        return;
    }
    let config = peercomm::CommConfig {
        max_blocks: None,
        ..per_rank_suite::trust::placement_config(&HOST, 2)
    };
    // Pin in the worker threads: `with_affinity` sets the mask of the calling thread.
    per_rank_suite::trust::check_one_stage_sums_pinned::<Host>(
        &HOST,
        &config,
        &|rank| {
            let mut set = CpuSet::new();
            for &c in &cpus[..rank + 1] {
                set.set(c);
            }
            sched_setaffinity(None, &set).expect("pin the rank's thread");
            assert_eq!(
                std::thread::available_parallelism().unwrap().get(),
                rank + 1
            );
        },
        "unequal_core_counts",
    );
}

#[test]
fn per_rank_mismatched_calls_are_typed_errors_world_2() {
    per_rank_suite::trust::mismatched_calls_are_typed_errors::<Host>(&HOST, 2);
}

#[test]
fn per_rank_mismatched_calls_are_typed_errors_world_3() {
    per_rank_suite::trust::mismatched_calls_are_typed_errors::<Host>(&HOST, 3);
}

#[test]
fn per_rank_group_of_one_against_a_world_call() {
    per_rank_suite::trust::a_group_of_one_against_a_world_call_is_caught_late::<Host>(&HOST);
}

#[test]
fn per_rank_different_group_widths() {
    per_rank_suite::trust::different_group_widths_are_caught::<Host>(&HOST);
}

#[test]
fn per_rank_the_rank_that_never_came_is_named() {
    per_rank_suite::trust::the_rank_that_never_came_is_named::<Host>(&HOST);
}

#[test]
fn per_rank_one_sign_of_zero() {
    per_rank_suite::trust::one_sign_of_zero::<Host>(&HOST, 2);
    per_rank_suite::trust::one_sign_of_zero::<Host>(&HOST, 3);
}

/// CUDA_VISIBLE_DEVICES isolation, simulated: every rank on device 0, each on its own
/// physical device.
#[test]
fn per_rank_isolated_threads_world_2() {
    per_rank_suite::identity::isolated_threads::<Host>(&HOST, 2);
}

#[test]
fn per_rank_isolated_threads_world_4() {
    per_rank_suite::identity::isolated_threads::<Host>(&HOST, 4);
}

#[test]
fn per_rank_real_sharing_is_refused() {
    per_rank_suite::identity::real_sharing_is_refused::<Host>(&HOST);
}

#[test]
fn per_rank_allowed_sharing_caps_the_grid() {
    per_rank_suite::identity::allowed_sharing_caps_the_grid::<Host>(&HOST);
}

#[test]
fn single_controller_uses_identities() {
    per_rank_suite::identity::single_controller_uses_identities::<Host>(&HOST);
}

/// The host backend's identity is deterministic per ordinal (the same in every process
/// and every call) and distinct between ordinals.
#[test]
fn host_identity_is_stable() {
    use peercomm::backend::Backend;
    use peercomm::DeviceIdentity;
    let ids: Vec<DeviceIdentity> = (0..peercomm::MAX_GPUS)
        .map(|o| Host::identity(&Host::open(o).unwrap()).unwrap())
        .collect();
    for (o, id) in ids.iter().enumerate() {
        assert_eq!(id.ordinal(), o);
        assert_eq!(*id, Host::identity(&Host::open(o).unwrap()).unwrap());
        assert_eq!(*id, DeviceIdentity::simulated(o, o));
        assert_eq!(id.pci_bus_id(), Some(format!("0000:{o:02x}:00.0").as_str()));
        assert_eq!(
            id.uuid_string().unwrap(),
            format!("GPU-70656572-636f-6d6d-0000-0000000000{o:02x}")
        );
        for other in &ids[o + 1..] {
            assert_eq!(id.same_device(other), Some(false));
        }
    }
}

/// `Comm` moves to the thread that drives its rank (it is `Send`; that it is not
/// `Sync` is a compile-fail doctest on `Comm`).
#[test]
fn per_rank_comm_is_send() {
    fn send<T: Send>() {}
    send::<peercomm::Comm<Host>>();
}

/// The Lamport fused all-reduce + residual + RMSNorm against the one-stage one and batch
/// invariance through the per-rank `Comm` (tests/per_rank_suite/fused.rs), worlds 2 and
/// 4: the decode shapes (bf16 and f16, hidden 4096 and 8192, 1 to 256 tokens), small
/// rows and f32.
#[test]
fn per_rank_lamport_fused_world_2() {
    let batches =
        per_rank_suite::fused::lamport_fused::<Host>(&HOST, 2, &common::fused::DECODE_CASES);
    eprintln!("per_rank_lamport_fused_world_2: {batches} batches per rank");
}

#[test]
fn per_rank_lamport_fused_world_4() {
    let batches =
        per_rank_suite::fused::lamport_fused::<Host>(&HOST, 4, &common::fused::DECODE_CASES);
    eprintln!("per_rank_lamport_fused_world_4: {batches} batches per rank");
}

#[test]
fn per_rank_lamport_fused_mismatch() {
    per_rank_suite::fused::lamport_fused_mismatch::<Host>(&HOST, 2);
    per_rank_suite::fused::lamport_fused_mismatch::<Host>(&HOST, 4);
}

// Zero copy (tests/per_rank_suite/zero_copy.rs): all-reduces whose inputs lie in symmetric
// and registered buffers, every algorithm, in and out of place, every group size, bit
// for bit the single controller's; the other collectives on symmetric inputs; the
// refusals, mismatched input places, and register/alloc cycles.
const ZERO_COPY_ALGORITHMS: [peercomm::Algorithm; 4] = [
    peercomm::Algorithm::OneStage,
    peercomm::Algorithm::TwoStage,
    peercomm::Algorithm::Lamport,
    peercomm::Algorithm::Auto,
];

#[test]
fn per_rank_zero_copy_all_reduce_world_2() {
    per_rank_suite::zero_copy::all_reduce_matches_single_controller::<Host>(
        &HOST,
        2,
        &ZERO_COPY_ALGORITHMS,
    );
}

#[test]
fn per_rank_zero_copy_all_reduce_world_3() {
    per_rank_suite::zero_copy::all_reduce_matches_single_controller::<Host>(
        &HOST,
        3,
        &ZERO_COPY_ALGORITHMS,
    );
}

#[test]
fn per_rank_zero_copy_all_reduce_world_4() {
    per_rank_suite::zero_copy::all_reduce_matches_single_controller::<Host>(
        &HOST,
        4,
        &ZERO_COPY_ALGORITHMS,
    );
}

#[test]
fn per_rank_zero_copy_all_reduce_world_8() {
    per_rank_suite::zero_copy::all_reduce_matches_single_controller::<Host>(
        &HOST,
        8,
        &ZERO_COPY_ALGORITHMS,
    );
}

#[test]
fn per_rank_zero_copy_collectives_world_2() {
    per_rank_suite::zero_copy::collectives_match_single_controller::<Host>(&HOST, 2);
}

#[test]
fn per_rank_zero_copy_collectives_world_3() {
    per_rank_suite::zero_copy::collectives_match_single_controller::<Host>(&HOST, 3);
}

#[test]
fn per_rank_zero_copy_collectives_world_4() {
    per_rank_suite::zero_copy::collectives_match_single_controller::<Host>(&HOST, 4);
}

#[test]
fn per_rank_zero_copy_collectives_world_8() {
    per_rank_suite::zero_copy::collectives_match_single_controller::<Host>(&HOST, 8);
}

#[test]
fn per_rank_zero_copy_registration_refusals() {
    per_rank_suite::zero_copy::registration_refusals::<Host>(&HOST, 2);
    per_rank_suite::zero_copy::registration_refusals::<Host>(&HOST, 3);
}

#[test]
fn per_rank_zero_copy_mismatched_inputs() {
    per_rank_suite::zero_copy::mismatched_inputs::<Host>(&HOST, 2);
    per_rank_suite::zero_copy::mismatched_inputs::<Host>(&HOST, 3);
}

#[test]
fn per_rank_zero_copy_register_drop_cycles() {
    per_rank_suite::zero_copy::register_drop_cycles::<Host>(&HOST, 2, 1000);
}

#[test]
fn per_rank_zero_copy_symmetric_drop_cycles() {
    per_rank_suite::zero_copy::symmetric_drop_cycles::<Host>(&HOST, 2, 1000);
}

#[test]
fn per_rank_zero_copy_stages_nothing() {
    per_rank_suite::zero_copy::stages_nothing::<Host>(&HOST);
}

#[test]
fn per_rank_zero_copy_inputs_dropped_in_flight() {
    per_rank_suite::zero_copy::inputs_dropped_in_flight::<Host>(&HOST, 2);
    per_rank_suite::zero_copy::inputs_dropped_in_flight::<Host>(&HOST, 4);
}

// Registered passes (what a registered graph capture is on CUDA): the second pass reads
// every input in place; disagreeing ranks refused in step; cycles leak nothing.
#[test]
fn per_rank_capture_inputs_second_pass_reads_in_place() {
    per_rank_suite::capture_inputs::second_pass_reads_in_place::<Host>(&HOST, 2);
    per_rank_suite::capture_inputs::second_pass_reads_in_place::<Host>(&HOST, 4);
}

#[test]
fn per_rank_capture_inputs_disagreeing_passes_are_refused() {
    per_rank_suite::capture_inputs::disagreeing_passes_are_refused::<Host>(&HOST, 2);
    per_rank_suite::capture_inputs::disagreeing_passes_are_refused::<Host>(&HOST, 3);
}

#[test]
fn per_rank_capture_inputs_cycles_leak_nothing() {
    per_rank_suite::capture_inputs::pass_cycles_leak_nothing::<Host>(&HOST, 2, 300);
}

#[test]
fn per_rank_symmetric_trim_frees_only_segments_empty_everywhere() {
    per_rank_suite::symmetric_trim::frees_only_segments_empty_everywhere::<Host>(&HOST, 2);
    per_rank_suite::symmetric_trim::frees_only_segments_empty_everywhere::<Host>(&HOST, 3);
}

#[test]
fn per_rank_places_compared_exactly() {
    per_rank_suite::zero_copy::places_compared_exactly::<Host>(&HOST, 2);
    per_rank_suite::zero_copy::places_compared_exactly::<Host>(&HOST, 3);
}

#[test]
fn per_rank_fused_arguments_mismatch() {
    per_rank_suite::fused::fused_arguments_mismatch::<Host>(&HOST, 2);
    per_rank_suite::fused::fused_arguments_mismatch::<Host>(&HOST, 3);
}

#[test]
fn per_rank_misaligned_views() {
    per_rank_suite::views::misaligned_views::<Host>(&HOST, 0);
}

#[test]
fn per_rank_views_misaligned_for_their_element_type() {
    per_rank_suite::views::misaligned_views::<Host>(&HOST, 1);
}

#[test]
fn per_rank_poisoned_names_its_cause() {
    per_rank_suite::recovery::poisoned_names_its_cause::<Host>(&HOST);
}

#[test]
fn per_rank_a_leaf_without_rank_zero_names_real_functions() {
    per_rank_suite::recovery::a_leaf_without_rank_zero_names_real_functions::<Host>(&HOST);
}

// A drop beside a peer's exchange, and ranks making different exchanges at once
// (tests/per_rank_suite/teardown.rs): the typed mismatch on every rank, the dropping
// rank's memory parked.
#[test]
fn per_rank_drop_beside_a_peer_register() {
    per_rank_suite::teardown::drop_beside_a_peer_exchange::<Host>(&HOST, Exchange::Register);
}

#[test]
fn per_rank_drop_beside_a_peer_alloc_symmetric() {
    per_rank_suite::teardown::drop_beside_a_peer_exchange::<Host>(&HOST, Exchange::AllocSymmetric);
}

#[test]
fn per_rank_drop_beside_a_peer_trim_symmetric() {
    per_rank_suite::teardown::drop_beside_a_peer_exchange::<Host>(&HOST, Exchange::TrimSymmetric);
}

#[test]
fn per_rank_drop_beside_a_peer_register_inputs_of() {
    per_rank_suite::teardown::drop_beside_a_peer_exchange::<Host>(
        &HOST,
        Exchange::RegisterInputsOf,
    );
}

#[test]
fn per_rank_drop_beside_a_peer_reinitialize() {
    per_rank_suite::teardown::drop_beside_a_peer_exchange::<Host>(&HOST, Exchange::Reinitialize);
}

macro_rules! different_exchanges {
    ($name:ident, $($kind:ident),+) => {
        #[test]
        fn $name() {
            per_rank_suite::teardown::different_exchanges_are_typed_errors::<Host>(
                &HOST,
                &[$(Exchange::$kind),+],
            );
        }
    };
}

different_exchanges!(
    per_rank_different_exchanges_register_alloc,
    Register,
    AllocSymmetric
);
different_exchanges!(
    per_rank_different_exchanges_trim_reinitialize,
    TrimSymmetric,
    Reinitialize
);
different_exchanges!(
    per_rank_different_exchanges_capture_register,
    RegisterInputsOf,
    Register
);
different_exchanges!(
    per_rank_different_exchanges_world_3,
    Register,
    Register,
    AllocSymmetric
);

#[test]
fn per_rank_a_skipped_call_is_caught_where_it_is_awaited() {
    per_rank_suite::recovery::a_skipped_call_is_caught_where_it_is_awaited::<Host>(&HOST);
}

#[test]
fn per_rank_check_errors_is_a_per_step_poll() {
    per_rank_suite::recovery::check_errors_is_a_per_step_poll::<Host>(&HOST);
}

// Sizes and ranges a call cannot trust (tests/per_rank_suite/bounds.rs): lengths whose
// bytes overflow, writes into registered buffers, inputs overlapping outputs.
#[test]
fn per_rank_huge_lengths_are_refused() {
    per_rank_suite::bounds::huge_lengths_are_refused::<Host>(&HOST, 2);
}

#[test]
fn per_rank_huge_buffers_in_collectives_are_refused() {
    per_rank_suite::bounds::huge_buffers_in_collectives_are_refused::<Host>(&HOST, 2);
}

#[test]
fn per_rank_registered_writes_keep_the_range() {
    per_rank_suite::bounds::registered_writes_keep_the_range::<Host>(&HOST, 2);
    per_rank_suite::bounds::registered_writes_keep_the_range::<Host>(&HOST, 3);
}

#[test]
fn per_rank_overlapping_buffers_are_refused() {
    per_rank_suite::bounds::overlapping_buffers_are_refused::<Host>(&HOST);
}

#[test]
fn per_rank_overlap_on_one_rank() {
    per_rank_suite::bounds::overlap_on_one_rank::<Host>(&HOST);
}

#[test]
fn single_controller_overlaps() {
    per_rank_suite::bounds::single_controller_overlaps::<Host>(&HOST);
}
