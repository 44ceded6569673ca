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

/// `#[test]`s running `$body` with the placement `place(name, gpus, nccl)` gives, or
/// skipping.
macro_rules! placed_tests {
    ($($name:ident($gpus:expr, $nccl:expr) => |$p:ident| $body:expr;)+) => {$(
        #[test]
        fn $name() {
            if let Some($p) = place(stringify!($name), $gpus, $nccl) {
                $body;
            }
        }
    )+};
}

placed_tests! {
    cuda_no_peer_access_world_2(2, true) => |p| external_suite::no_peer_access::<Cuda>(&p, 2);
    cuda_failed_peer_check_world_2(2, true) =>
        |p| external_suite::failed_peer_check::<Cuda>(&p, 2);
    // Ranks 0, 1 share GPU 0 as one "host", ranks 2, 3 GPU 1 as the other; NCCL joins
    // ranks {0, 2} and {1, 3}, each across both GPUs.
    cuda_hierarchical_world_4_as_2_hosts(2, true) =>
        |p| external_suite::simulated_hosts::<Cuda>(&Place { devices: 2, ..p }, 4, 2);
    cuda_one_rank_per_simulated_host(2, true) =>
        |p| external_suite::simulated_hosts::<Cuda>(&p, 2, 2);
    cuda_refuse_keeps_typed_errors(1, false) =>
        |p| external_suite::refuse_keeps_typed_errors::<Cuda>(&p);
    cuda_size_invariant_by_default(1, false) =>
        |p| external_suite::size_invariant_by_default::<Cuda>(&p, 2);
    cuda_by_size_when_opted_in(2, true) =>
        |p| external_suite::by_size_when_opted_in::<Cuda>(&p, 2);
    cuda_single_controller_fallback(2, true) =>
        |_p| external_suite::single_controller::<Cuda>(&[0, 1]);
    cuda_other_collectives_stay_on_peer_memory(2, true) => |p| {
        external_suite::other_collectives_stay_on_peer_memory::<Cuda>(&Place { devices: 2, ..p })
    };
}
