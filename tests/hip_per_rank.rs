//! The per-rank communicator on HIP (AMD GPUs), one thread per rank: the generic suite
//! (tests/per_rank_suite). With fewer GPUs than ranks, ranks share GPUs. Without an AMD
//! GPU (CI, the NVIDIA machines) every test prints why it is skipped.
#![cfg(feature = "hip")]

mod common;
mod per_rank_suite;

use peercomm::backend::hip::Hip;
use per_rank_suite::chunked::{GRID_PAYLOAD, SMALL_PAYLOAD};
use per_rank_suite::Scope;

per_rank_suite!(
    Hip,
    per_rank_suite::gpu_placement::<Hip>,
    Scope {
        calls: &[2, 4, 8],
        collectives: &[2, 4],
        fuzz: &[(2, 2000, 24), (4, 2000, 24)],
        chunk_payloads: &[SMALL_PAYLOAD, GRID_PAYLOAD],
        multiprocessors: [&[4, 8], &[16, 3, 9]],
        element_misaligned_views: false,
        zero_copy_world_8: &[peercomm::Algorithm::TwoStage],
        drop_rounds: 2,
    }
);
