//! The fallback to the external library on the host backend (the host stand-in plays
//! NCCL), one thread per rank; the suite is in tests/external_suite.

mod common;
mod external_suite;

use external_suite::Place;
use peercomm::backend::host::Host;

const HOST: Place = Place {
    devices: peercomm::MAX_GPUS,
    max_blocks: 2,
};

tests! {
    no_peer_access_world_2 => external_suite::no_peer_access::<Host>(&HOST, 2);
    no_peer_access_world_4 => external_suite::no_peer_access::<Host>(&HOST, 4);
    failed_peer_check_world_3 => external_suite::failed_peer_check::<Host>(&HOST, 3);
    hierarchical_world_4_as_2_hosts => external_suite::simulated_hosts::<Host>(&HOST, 4, 2);
    hierarchical_world_6_as_2_hosts => external_suite::simulated_hosts::<Host>(&HOST, 6, 2);
    one_rank_per_simulated_host => external_suite::simulated_hosts::<Host>(&HOST, 2, 2);
    refuse_keeps_typed_errors => external_suite::refuse_keeps_typed_errors::<Host>(&HOST);
    size_invariant_by_default_world_2 =>
        external_suite::size_invariant_by_default::<Host>(&HOST, 2);

    size_invariant_by_default_world_4 =>
        external_suite::size_invariant_by_default::<Host>(&HOST, 4);

    by_size_when_opted_in => external_suite::by_size_when_opted_in::<Host>(&HOST, 2);
    single_controller_fallback => external_suite::single_controller::<Host>(&[0, 1, 2]);
}

#[test]
fn world_beyond_max_gpus() {
    // Nine ranks on the host backend's eight devices (two share one).
    external_suite::world_beyond_max_gpus::<Host>(&HOST);
}

tests! {
    simulated_hosts_must_name_every_rank =>
        external_suite::simulated_hosts_must_name_every_rank::<Host>(&HOST);

    other_collectives_stay_on_peer_memory =>
        external_suite::other_collectives_stay_on_peer_memory::<Host>(&HOST);
}
