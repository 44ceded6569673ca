//! The per-rank communicator on HIP (AMD GPUs), one thread per rank: the generic suite
//! (tests/per_rank_suite). With fewer GPUs than ranks, ranks share GPUs. Without an AMD
//! GPU (CI, the NVIDIA machines) every test prints why it is skipped.
#![cfg(feature = "hip")]

mod common;
mod per_rank_suite;

use peercomm::backend::hip::Hip;
use per_rank_suite::{gpu_placement, GPU_SCOPE};

per_rank_suite!(Hip, gpu_placement::<Hip>, GPU_SCOPE);
