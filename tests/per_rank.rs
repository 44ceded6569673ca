//! The per-rank communicator on the host backend, one thread per rank: the generic
//! suite (tests/per_rank_suite) and the tests only the host backend can run. Multi-process
//! runs are in tests/per_rank_processes.rs.

mod common;
mod per_rank_suite;

use peercomm::backend::host::Host;
use per_rank_suite::{identity, teardown, Scope, HOST};

per_rank_suite!(
    Host,
    |_: &str| Some(HOST),
    Scope {
        calls: &[2, 3, 4, 8],
        collectives: &[2, 3, 4, 8],
        fuzz: &[(2, 1200, 24), (4, 600, 24), (8, 300, 16)],
        chunk_payloads: &[per_rank_suite::chunked::SMALL_PAYLOAD],
        multiprocessors: [&[1, 2], &[3, 1, 2]],
        element_misaligned_views: true,
        zero_copy_world_8: per_rank_suite::ALL_ALGORITHMS,
        drop_rounds: 3,
    }
);

/// Ranks pinned to 1 and 2 cores (the host backend's multiprocessors) with the grid
/// left to peercomm. Linux only; needs 2 cores.
#[cfg(target_os = "linux")]
#[test]
fn unequal_core_counts_agree_on_the_grid() {
    use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
    let mine = sched_getaffinity(None).expect("affinity");
    let cpus: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| mine.is_set(c)).collect();
    if cpus.len() < 2 {
        common::announce_skip(
            "unequal_core_counts_agree_on_the_grid",
            "needs 2 cores to pin ranks to 1 and 2 of them",
        );
        return;
    }
    let config = HOST.config(2).with_max_blocks(None);
    // Pin in the worker threads: `with_affinity` sets the mask of the calling thread.
    per_rank_suite::agreement::check_one_stage_sums::<Host>(
        &HOST,
        2,
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

tests! {
    /// The device API's host contract: kernels of an engine's own in Rust over a
    /// DeviceComm, beside the library's collectives, and a rank that never launches.
    host_kernel_world_2 => per_rank_suite::device_api::host_kernel_neighbours(&HOST, 2);
    host_kernel_world_3 => per_rank_suite::device_api::host_kernel_neighbours(&HOST, 3);
    host_kernel_world_4 => per_rank_suite::device_api::host_kernel_neighbours(&HOST, 4);
    host_kernel_timeout => per_rank_suite::device_api::host_kernel_timeout(&HOST);
    host_grid_barrier_world_2 => per_rank_suite::device_api::host_grid_barrier(&HOST, 2);
    host_grid_barrier_world_3 => per_rank_suite::device_api::host_grid_barrier(&HOST, 3);
    host_grid_barrier_timeout => per_rank_suite::device_api::host_grid_barrier_timeout(&HOST);
    single_controller_host_kernel =>
        per_rank_suite::device_api::single_controller_host_kernel(&HOST);

    /// CUDA_VISIBLE_DEVICES isolation, simulated: every rank on device 0, each on its own
    /// physical device.
    isolated_threads_world_2 => identity::isolated_threads::<Host>(&HOST, 2);
    isolated_threads_world_4 => identity::isolated_threads::<Host>(&HOST, 4);
    real_sharing_is_refused => identity::real_sharing_is_refused::<Host>(&HOST);
    allowed_sharing_caps_the_grid => identity::allowed_sharing_caps_the_grid::<Host>(&HOST);
    single_controller_uses_identities =>
        identity::single_controller_uses_identities::<Host>(&HOST);

    refuses_bootstrap_timeout_below_barrier_timeout =>
        teardown::refuses_bootstrap_timeout_below_barrier_timeout::<Host>(&HOST);
    synchronize_reports_within_twice_barrier_timeout =>
        teardown::synchronize_reports_within_twice_barrier_timeout::<Host>(&HOST);
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
        let uuid = format!("GPU-70656572-636f-6d6d-0000-0000000000{o:02x}");
        assert_eq!(id.uuid_string().unwrap(), uuid);
        for other in &ids[o + 1..] {
            assert_eq!(id.same_device(other), Some(false));
        }
    }
}

/// `Comm` moves to the thread that drives its rank (it is `Send`; that it is not
/// `Sync` is a compile-fail doctest on `Comm`).
#[test]
fn comm_is_send() {
    fn send<T: Send>() {}
    send::<peercomm::Comm<Host>>();
}

/// `Comm` and `SingleController` print what they are, not their internals.
#[test]
fn comm_and_communicator_print_backend_rank_and_world() {
    use peercomm::backend::Backend;
    let id = peercomm::bootstrap::UniqueId::new().unwrap();
    let comm = peercomm::Comm::<Host>::from_rank(Host::open(0).unwrap(), 0, 1, &id, HOST.config(1))
        .unwrap();
    let all = peercomm::SingleController::<Host>::new(&[0, 1], HOST.config(2)).unwrap();
    let want = r#"Comm { backend: "host", rank: 0, world_size: 1, .. }"#;
    assert_eq!(format!("{comm:?}"), want);
    let want = r#"SingleController { backend: "host", world_size: 2, .. }"#;
    assert_eq!(format!("{all:?}"), want);
}
