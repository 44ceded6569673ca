//! Internals for peercomm's own tests, benchmarks and tools (feature `unstable`): the
//! signal layout, the dispatch table, the barrier protocol's host model, the launch
//! types, the parked teardowns. They change with the kernels: no semver promise.

pub use crate::backend::launch_types::{
    Descriptor, ExportedRange, Kernel, KernelKind, LaunchDims, MemoryKind, LAMPORT_SENTINEL,
};
pub use crate::comm::{free_expired_teardowns, parked_teardowns};
pub use crate::dispatch::{
    blocks_for, choose, external_from, provenance, table, DispatchRow, Provenance,
};
#[cfg(feature = "hip")]
pub use crate::external::rccl::RCCL_LIBRARY_ENV;
pub use crate::external::{
    library_of, ExternalAllReduce, ExternalLibrary, HasExternalLibrary, Unavailable,
};
pub use crate::signal::*;

/// The host model of the barrier protocol (what the loom tests check).
pub mod protocol {
    pub use crate::protocol::*;
}
