//! Communicators: one per-rank core (`core`: setup, routing, planning, launch) and two
//! front doors over it, [`SingleController`] (`single`: one process driving every
//! device) and [`Comm`] (`per_rank`: one rank per thread or process); `zero_copy`:
//! registered buffers, the symmetric pool and graph capture.

mod config;
mod core;
mod per_rank;
mod single;
mod zero_copy;

pub use self::core::planning::collective::CollectiveOptions;
pub use self::core::planning::sizing::MemoryFootprint;
pub use self::core::Rank;
pub use config::{AllReduceOptions, CommConfig};
pub use per_rank::group::CommGroup;
pub use per_rank::Comm;
#[doc(hidden)]
#[cfg(feature = "unstable")]
pub use per_rank::{free_expired_teardowns, parked_teardowns};
#[allow(deprecated)]
pub use single::group::CommunicatorGroup;
pub use single::group::SingleControllerGroup;
#[allow(deprecated)]
pub use single::Communicator;
pub use single::SingleController;
#[cfg(feature = "cuda")]
pub use zero_copy::capture::RegisteredGraph;
pub use zero_copy::capture_inputs::CaptureInputs;
pub use zero_copy::registered::{RegisterError, Registered};
pub use zero_copy::symmetric::{SymmetricBuffer, SYMMETRIC_SEGMENT_BYTES};
