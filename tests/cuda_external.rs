//! The fallback to NCCL on CUDA (the suite is in tests/external_suite), one thread per
//! rank. NCCL refuses two ranks on one GPU, so every test that runs NCCL needs two
//! GPUs and says so when skipped; the default-configuration test runs on one.
#![cfg(feature = "cuda")]

mod common;
mod external_suite;

use external_suite::Place;
use peercomm::backend::cuda::Cuda;
use peercomm::backend::Backend;
use peercomm::unstable::HasExternalLibrary;

/// A placement when at least `gpus` GPUs (and, when `nccl`, NCCL) are there.
fn place(test: &str, gpus: usize, nccl: bool) -> Option<Place> {
    let n = match Cuda::device_count() {
        Ok(n) => n,
        Err(e) => {
            common::announce_skip(test, &format!("no CUDA driver: {e}"));
            return None;
        }
    };
    if n < gpus {
        let why = if nccl {
            format!("needs {gpus} GPUs ({n} here): NCCL refuses two ranks on one GPU")
        } else {
            format!("needs {gpus} GPUs ({n} here)")
        };
        common::announce_skip(test, &why);
        return None;
    }
    if nccl {
        if let Err(e) = Cuda::external_library().check_available() {
            common::announce_skip(test, &e.to_string());
            return None;
        }
    }
    Some(Place {
        devices: n,
        max_blocks: 4,
    })
}

#[test]
fn cuda_no_peer_access_world_2() {
    if let Some(p) = place("cuda_no_peer_access_world_2", 2, true) {
        external_suite::no_peer_access::<Cuda>(&p, 2);
    }
}

#[test]
fn cuda_failed_peer_check_world_2() {
    if let Some(p) = place("cuda_failed_peer_check_world_2", 2, true) {
        external_suite::failed_peer_check::<Cuda>(&p, 2);
    }
}

#[test]
fn cuda_hierarchical_world_4_as_2_hosts() {
    // Ranks 0, 1 share GPU 0 as one "host", ranks 2, 3 GPU 1 as the other; NCCL joins
    // ranks {0, 2} and {1, 3}, each across both GPUs.
    if let Some(p) = place("cuda_hierarchical_world_4_as_2_hosts", 2, true) {
        let p = Place { devices: 2, ..p };
        external_suite::simulated_hosts::<Cuda>(&p, 4, 2);
    }
}

#[test]
fn cuda_one_rank_per_simulated_host() {
    if let Some(p) = place("cuda_one_rank_per_simulated_host", 2, true) {
        external_suite::simulated_hosts::<Cuda>(&p, 2, 2);
    }
}

#[test]
fn cuda_refuse_keeps_typed_errors() {
    if let Some(p) = place("cuda_refuse_keeps_typed_errors", 1, false) {
        external_suite::refuse_keeps_typed_errors::<Cuda>(&p);
    }
}

#[test]
fn cuda_size_invariant_by_default() {
    if let Some(p) = place("cuda_size_invariant_by_default", 1, false) {
        external_suite::size_invariant_by_default::<Cuda>(&p, 2);
    }
}

#[test]
fn cuda_by_size_when_opted_in() {
    if let Some(p) = place("cuda_by_size_when_opted_in", 2, true) {
        external_suite::by_size_when_opted_in::<Cuda>(&p, 2);
    }
}

#[test]
fn cuda_single_controller_fallback() {
    if place("cuda_single_controller_fallback", 2, true).is_some() {
        external_suite::single_controller::<Cuda>(&[0, 1]);
    }
}

#[test]
fn cuda_other_collectives_stay_on_peer_memory() {
    if let Some(p) = place("cuda_other_collectives_stay_on_peer_memory", 2, true) {
        let p = Place { devices: 2, ..p };
        external_suite::other_collectives_stay_on_peer_memory::<Cuda>(&p);
    }
}
