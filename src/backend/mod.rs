//! The one trait that abstracts what differs between vendors, and its implementations:
//! [`host`] (always built: CPU threads over memory arenas), `cuda` (feature `cuda`,
//! on cudarc) and `hip` (feature `hip`, on hip-sys).
//!
//! Static dispatch through associated types, as in wgpu-hal: a communicator is generic
//! over its backend and pays no virtual call per launch. Raw FFI stays inside the
//! backend modules.

use crate::dispatch::Algorithm;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::signal::{AllReduceArgs, GroupArgs};

pub use identity::DeviceIdentity;

#[cfg(feature = "cuda")]
pub mod cuda;
// The exported-handle records: used by the host backend's shared memory (Linux) and by
// the GPU backends.
#[cfg(any(target_os = "linux", feature = "cuda", feature = "hip"))]
pub(crate) mod handle;
#[cfg(feature = "hip")]
pub mod hip;
pub mod host;
mod identity;
pub(crate) mod p2p;
pub(crate) mod signal_init;

/// Only peercomm's backends implement [`Backend`]: the trait's launch and memory
/// methods follow the kernels, which change without notice.
mod sealed {
    pub trait Sealed {}
    impl Sealed for super::host::Host {}
    #[cfg(feature = "cuda")]
    impl Sealed for super::cuda::Cuda {}
    #[cfg(feature = "hip")]
    impl Sealed for super::hip::Hip {}
}

/// What backends launch and export: kernel kinds, launch dimensions, memory kinds,
/// exported ranges. Public only under the `unstable` feature (`crate::unstable`).
pub(crate) mod launch_types {
    use super::*;

    /// A file descriptor that travels between processes beside an exported handle
    /// ([`ExportedRange::descriptor`]).
    #[cfg(unix)]
    pub type Descriptor = std::os::fd::OwnedFd;
    /// Elsewhere than Unix no descriptor exists: an empty type.
    #[cfg(not(unix))]
    #[derive(Debug)]
    pub enum Descriptor {}

    /// A range of this process's memory exported for another process
    /// ([`Backend::export_range`]).
    #[derive(Debug)]
    pub struct ExportedRange {
        /// The handle record, sent as bytes (as [`Backend::export_memory`] makes them).
        pub handle: Vec<u8>,
        /// The range's offset in the exported allocation.
        pub offset: u64,
        /// A descriptor to send beside the handle, where the driver exports the memory
        /// only as one (CUDA: a memory pool made with a POSIX-fd handle type, a
        /// virtual-memory allocation; the host backend: a shared memory file). `None`: the
        /// handle alone maps it.
        pub descriptor: Option<Descriptor>,
    }

    /// What a device allocation is for.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum MemoryKind {
        /// Ordinary device memory.
        Plain,
        /// Signal memory: counters and flags that peers write and spin on. Uncached or
        /// fine-grained where the vendor distinguishes (AMD), so spins see peers' stores.
        Signal,
        /// Signal memory that other processes will map ([`Backend::export_memory`]): as
        /// `Signal`, allocated so that it can be exported (on the host backend: a shared
        /// memory file instead of the heap).
        SharedSignal,
        /// Ordinary (cached) device memory that other processes can map: the symmetric
        /// buffers' pool (`Comm::alloc_symmetric`). `cuMemAlloc` / `hipMalloc` memory (IPC
        /// capable); on the host backend a shared memory file.
        SharedData,
    }

    /// Declares [`KernelKind`] from the one list of kernel families: each with its name in
    /// the kernels' symbols and whether it is exported for every [`DType`] or for f32 only.
    /// The discriminants (the call descriptor's kind field) follow the list's order.
    macro_rules! kernel_kinds {
        ($($(#[$doc:meta])* $kind:ident = $name:literal, $every_dtype:literal;)*) => {
            /// Which kernel family a launch runs.
            #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
            pub enum KernelKind {
                $($(#[$doc])* $kind,)*
            }

            impl KernelKind {
                /// Every kind, in the order of its discriminant.
                pub(crate) const ALL: &'static [KernelKind] = &[$(KernelKind::$kind),*];

                /// Name used in kernel symbols and reports.
                pub const fn name(self) -> &'static str {
                    match self {
                        $(KernelKind::$kind => $name,)*
                    }
                }

                /// Whether the device code exports it for every dtype (else f32 only).
                const fn every_dtype(self) -> bool {
                    match self {
                        $(KernelKind::$kind => $every_dtype,)*
                    }
                }
            }
        };
    }

    kernel_kinds! {
        /// Every rank reads every peer's input and reduces the whole message.
        OneStage = "one_stage", true;
        /// Reduce-scatter into the payload, barrier, all-gather from the peers' payloads.
        TwoStage = "two_stage", true;
        /// Barrier-free: data carries its own readiness (the -0.0 sentinel).
        Lamport = "lamport", true;
        /// A start and an end barrier and nothing else (also the timeout probe).
        Barrier = "barrier", true;
        /// Ranks 0 and 1 bounce a flag `num_elements` times through their payloads (one
        /// thread each): measures the cross-GPU flag round trip. f32 only.
        PingPong = "pingpong", false;
        /// One thread spins for `timeout_ns` nanoseconds and touches no memory: fault
        /// injection (a rank made late on purpose). f32 only.
        Delay = "delay", false;
        /// All-gather: every group member gets every member's input, in group-rank order.
        AllGather = "all_gather", true;
        /// Reduce-scatter (sum): group rank r gets part r of the sum
        /// ([`crate::reduce_scatter_part`]).
        ReduceScatter = "reduce_scatter", true;
        /// Broadcast of the root's input to every group member.
        Broadcast = "broadcast", true;
        /// Scatter: group rank r gets part r of the root's input.
        Scatter = "scatter", true;
        /// All-reduce, residual add and RMSNorm in one kernel, row by row.
        AllReduceRmsNorm = "allreduce_rmsnorm", true;
        /// A batch of up to [`crate::signal::MAX_GROUP_CALLS`] all-reduces of one dtype and
        /// one group width in one kernel, one start and one end barrier (NCCL-style group
        /// calls). Staged like one-stage: each rank copies every entry's input into its own
        /// payload, then reduces its share of every entry from the members' payloads, each
        /// entry's bits those of a one-stage all-reduce of that entry alone. Launched with
        /// [`Backend::launch_group`] (its arguments are a [`GroupArgs`]).
        AllReduceGroup = "allreduce_group", true;
        /// The fused all-reduce, residual add and RMSNorm without a barrier: each rank pushes
        /// its input rows into every peer's Lamport slot (as [`KernelKind::Lamport`] does),
        /// then each block computes whole rows as their packs arrive, with the row function
        /// of [`KernelKind::AllReduceRmsNorm`], so both give the same bits. Whole world of
        /// two or more ranks, the message plus its header within one Lamport slot.
        LamportRmsNorm = "lamport_rmsnorm", true;
    }

    impl Algorithm {
        /// The kernel family (`None` for `Auto` and the paths that are not one kernel).
        /// (Defined with the kernels: the dispatch table that names algorithms is data and
        /// knows nothing of kernels.)
        pub(crate) const fn kernel_kind(self) -> Option<KernelKind> {
            match self {
                Algorithm::Auto | Algorithm::Nccl | Algorithm::Hierarchical => None,
                Algorithm::OneStage => Some(KernelKind::OneStage),
                Algorithm::TwoStage => Some(KernelKind::TwoStage),
                Algorithm::Lamport => Some(KernelKind::Lamport),
            }
        }
    }

    /// One kernel entry point: a family and an element type.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Kernel {
        /// The family.
        pub kind: KernelKind,
        /// The element type it reduces.
        pub dtype: DType,
    }

    impl Kernel {
        /// Every kernel the device code must export.
        pub fn all() -> impl Iterator<Item = Kernel> {
            KernelKind::ALL.iter().flat_map(|&kind| {
                let dtypes: &[DType] = if kind.every_dtype() {
                    &DType::ALL
                } else {
                    &[DType::F32]
                };
                dtypes.iter().map(move |&dtype| Kernel { kind, dtype })
            })
        }
        /// Its exported symbol, e.g. `peercomm_two_stage_bf16`.
        pub fn symbol(self) -> String {
            format!("peercomm_{}_{}", self.kind.name(), self.dtype.name())
        }
    }

    /// Grid of a launch.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct LaunchDims {
        /// Blocks (at most `MAX_NUM_BLOCKS_UPPER_BOUND`).
        pub blocks: u32,
        /// Threads per block.
        pub threads: u32,
    }

    /// The 32-bit word the Lamport region is filled with: the f32 -0.0 pattern. No
    /// producer writes it: f32 -0.0 is sent as +0.0, and for 16-bit types every -0.0 lane
    /// is sent as +0.0, so the high half of a word is never 0x8000. Readiness is tested
    /// per 32-bit word, which 16-byte stores never tear.
    pub const LAMPORT_SENTINEL: u32 = 0x8000_0000;
}
pub(crate) use launch_types::*;

/// What a communicator can be built on: a backend's device (with its stream), or for
/// CUDA cudarc's `Arc<CudaStream>` itself. It names its backend, so
/// `Comm::from_rank(stream, rank, world, &id, config)` needs no turbofish.
pub trait IntoDevice {
    /// The backend the device belongs to.
    type Backend: Backend;
    /// The device, ready for collectives (for a stream: its context, with the kernels
    /// loaded).
    fn into_device(self) -> Result<<Self::Backend as Backend>::Device>;
}

/// Refuses a [`Backend::launch`] of the batched all-reduce, whose kernel takes a
/// [`GroupArgs`], not an [`AllReduceArgs`].
pub(crate) fn check_plain_kernel(backend: &'static str, kernel: Kernel) -> Result<()> {
    if kernel.kind == KernelKind::AllReduceGroup {
        return Err(crate::Error::Unsupported(format!(
            "{backend}: {} takes group arguments: launch it with launch_group",
            kernel.symbol()
        )));
    }
    Ok(())
}

/// What [`Backend::launch_group`] checks before anything is enqueued: the kernel is
/// the batched all-reduce and its entry count is in `1..=MAX_GROUP_CALLS`.
pub(crate) fn check_group_kernel(
    backend: &'static str,
    kernel: Kernel,
    args: &GroupArgs,
) -> Result<()> {
    let max = crate::signal::MAX_GROUP_CALLS;
    if kernel.kind != KernelKind::AllReduceGroup {
        return Err(crate::Error::Unsupported(format!(
            "{backend}: launch_group runs the batched all-reduce, not {}",
            kernel.symbol()
        )));
    }
    if args.count == 0 || args.count as usize > max {
        return Err(crate::Error::Unsupported(format!(
            "{backend}: a batched all-reduce of {} entries (1..={max})",
            args.count
        )));
    }
    Ok(())
}

/// A vendor (or the host reference) as peercomm needs it.
pub trait Backend: sealed::Sealed + Sized + Send + Sync + 'static {
    /// Short name for messages (`"host"`, `"cuda"`, `"hip"`).
    const NAME: &'static str;
    /// One GPU with the stream peercomm launches on.
    type Device: Send + Sync + IntoDevice<Backend = Self>;
    /// An owned device allocation.
    type Memory: Send + Sync;
    /// Keeps a user buffer's synchronisation bookkeeping (cudarc's events) alive until
    /// the launch that uses the buffer has been enqueued.
    type Access<'a>;
    /// The access of memory with no bookkeeping (a symmetric buffer, ordered on the
    /// communicator's stream): records and waits for nothing.
    #[doc(hidden)]
    fn untracked_access<'a>() -> Self::Access<'a>;
    /// A typed device buffer (what users hold: `CudaSlice<T>` for CUDA). Through
    /// [`TypedBuffer`] it names its element type, so generic code copies to and from it
    /// without a turbofish. Owned and `Send`, so that a dropped registration can keep
    /// it while a peer may still read it (see [`crate::Registered`]).
    type Buffer<T: Element>: TypedBuffer<Self, Elem = T> + Send + 'static;
    /// Another process's memory mapped into this one (an imported IPC handle). Dropping
    /// it unmaps it and closes what the import opened.
    type PeerMapping: Send + Sync;

    /// Devices visible to this backend.
    fn device_count() -> Result<usize>;
    /// Opens device `ordinal` with a new stream.
    fn open(ordinal: usize) -> Result<Self::Device>;
    /// The ordinal of a device (in this process: `CUDA_VISIBLE_DEVICES` renumbers).
    fn ordinal(dev: &Self::Device) -> usize;
    /// What names the device physically, beside its ordinal here: its UUID and PCI bus
    /// id (CUDA: `cuDeviceGetUuid` and the PCI attributes; HIP: `hipDeviceGetUuid`
    /// where the runtime exports it, and `hipDeviceGetPCIBusId`; host: the
    /// deterministic [`DeviceIdentity::simulated`] of the ordinal). Ranks compare
    /// identities, not ordinals, to tell whether they share a device. The default
    /// reports the ordinal only (nothing physical), so that ranks of one process are
    /// told apart by ordinal and ranks of different processes are taken to be on
    /// different devices.
    fn identity(dev: &Self::Device) -> Result<DeviceIdentity> {
        Ok(DeviceIdentity::new(Self::ordinal(dev), None, None))
    }
    /// Streaming multiprocessors / compute units (sizes the grid).
    fn multiprocessor_count(dev: &Self::Device) -> Result<usize>;
    /// Architecture name, e.g. `sm_90`, `gfx942`, `host` (keys the dispatch table).
    fn architecture(dev: &Self::Device) -> Result<String>;
    /// Whether `dev` can access `peer`'s memory directly.
    fn can_access_peer(dev: &Self::Device, peer: &Self::Device) -> Result<bool>;
    /// Lets `dev` access `peer`'s memory; enabling twice is not an error.
    fn enable_peer_access(dev: &Self::Device, peer: &Self::Device) -> Result<()>;
    /// Allocates `bytes` on `dev`.
    fn alloc(dev: &Self::Device, bytes: usize, kind: MemoryKind) -> Result<Self::Memory>;
    /// Device address of an allocation (valid on its own device).
    fn memory_ptr(mem: &Self::Memory) -> u64;
    /// Address at which `dev` reaches `peer_mem` (another device's allocation). In one
    /// process with peer access on, that is the same address; a one-process-per-GPU
    /// backend would import an IPC handle here.
    #[doc(hidden)]
    fn map_peer(dev: &Self::Device, peer_mem: &Self::Memory) -> Result<u64>;
    /// Prepares a device that several ranks share (`CommConfig::allow_shared_devices`):
    /// nothing may make one rank's stream wait for another's, since their collectives
    /// wait for each other. On CUDA this turns off the default memory pool's reuse
    /// across streams through internal dependencies, which would otherwise let a
    /// buffer freed on one rank's stream delay another rank's allocation until that
    /// rank's earlier collectives finish. The default: nothing to do.
    #[doc(hidden)]
    fn prepare_shared_device(_dev: &Self::Device) -> Result<()> {
        Ok(())
    }
    /// Why the kernels of device `peer_ordinal` (of this process) could not reach the
    /// user memory at `ptr` on `dev` (which they are about to read directly), or `None`
    /// when they can. Called before a launch whose peers read user buffers, and when a
    /// per-rank buffer is registered, so that memory peer access does not cover (a
    /// memory pool or a virtual-memory mapping without access for the peer) is a typed
    /// error instead of a fault. The default: every address is reachable.
    #[doc(hidden)]
    fn peer_access_problem(
        _dev: &Self::Device,
        _ptr: u64,
        _peer_ordinal: usize,
    ) -> Result<Option<String>> {
        Ok(None)
    }
    /// Exports an allocation made with [`MemoryKind::SharedSignal`] so that a process
    /// on the same host holding the returned bytes can map it with
    /// [`Backend::import_memory`] (CUDA: `cuIpcGetMemHandle`; HIP:
    /// `hipIpcGetMemHandle`; host: a shared memory file). The bytes are a fixed-length
    /// record to send as they are (over a bootstrap, say): a 4-byte magic naming the
    /// backend, a little-endian `u32` version, then the backend's fields (each
    /// backend's module docs give its layout). The handle stays valid while `mem` lives.
    #[doc(hidden)]
    fn export_memory(dev: &Self::Device, mem: &Self::Memory) -> Result<Vec<u8>>;
    /// Exports the allocation that holds `[ptr, ptr + bytes)` on `dev` so that another
    /// process can map it with [`Backend::import_range`]: the handle (as
    /// [`Backend::export_memory`] makes them), `ptr`'s offset in the allocation, and
    /// where the driver exports the memory only as a file descriptor, the descriptor
    /// (it travels beside the handle over a Unix socket). Memory the driver cannot
    /// export (CUDA: a stream-ordered pool without an IPC handle type, such as cudarc's
    /// default allocations, or a virtual-memory allocation made without one; host: heap
    /// memory) is [`crate::Error::CannotRegister`] saying why (its `rank` is 0: the
    /// caller names the rank).
    #[doc(hidden)]
    fn export_range(dev: &Self::Device, ptr: u64, bytes: usize) -> Result<ExportedRange>;
    /// Maps memory that another process exported into `dev`'s address space. Importing
    /// in the exporting process itself is an error on the GPU backends (CUDA and HIP
    /// IPC refuse it; one process reaches its own memory through
    /// [`Backend::map_peer`]) and works on the host backend. A handle that is
    /// malformed, of another backend or version, or names memory that is gone is
    /// `Error::Backend { call: "import_memory", .. }` saying which.
    #[doc(hidden)]
    fn import_memory(dev: &Self::Device, handle: &[u8]) -> Result<Self::PeerMapping>;
    /// Maps a range another process exported with [`Backend::export_range`]: its
    /// handle, and the descriptor that came with it (closed here once the memory is
    /// mapped, or on error). The default maps a handle without a descriptor with
    /// [`Backend::import_memory`] and refuses one with a descriptor.
    #[doc(hidden)]
    fn import_range(
        dev: &Self::Device,
        handle: &[u8],
        descriptor: Option<Descriptor>,
    ) -> Result<Self::PeerMapping> {
        match descriptor {
            None => Self::import_memory(dev, handle),
            Some(_) => Err(Error::Backend {
                backend: Self::NAME,
                call: "import_memory",
                detail: "this backend maps no memory exported as a file descriptor".into(),
            }),
        }
    }
    /// Address of an imported mapping, valid for kernels on the importing device.
    #[doc(hidden)]
    fn mapping_ptr(mapping: &Self::PeerMapping) -> u64;
    /// Fills `words` 32-bit words at `ptr` with `value`, on the device's stream.
    #[doc(hidden)]
    fn memset_d32(dev: &Self::Device, ptr: u64, value: u32, words: usize) -> Result<()>;
    /// Fills `halves` 16-bit words at `ptr` (2-byte aligned) with `value`, on the
    /// device's stream.
    #[doc(hidden)]
    fn memset_d16(dev: &Self::Device, ptr: u64, value: u16, halves: usize) -> Result<()>;
    /// Copies device memory at `ptr` to the host, after the stream's earlier work.
    #[doc(hidden)]
    fn read(dev: &Self::Device, ptr: u64, dst: &mut [u8]) -> Result<()>;
    /// Copies `src` to device memory at `ptr`, after the stream's earlier work; returns
    /// once the copy is done.
    #[doc(hidden)]
    fn write(dev: &Self::Device, ptr: u64, src: &[u8]) -> Result<()>;
    /// Reads `dst.len()` 32-bit words at `ptr` (4-byte aligned) without waiting for the
    /// work queued on the device's stream: the words may be read while a kernel that
    /// writes them runs (each word is read whole). Used to poll error records. The
    /// default waits, as [`Backend::read`] does; the host, CUDA and HIP backends do not.
    #[doc(hidden)]
    fn read_words_now(dev: &Self::Device, ptr: u64, dst: &mut [u32]) -> Result<()> {
        let mut bytes = vec![0u8; dst.len() * 4];
        Self::read(dev, ptr, &mut bytes)?;
        for (w, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
            *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }
    /// Enqueues `kernel` on the device's stream. Every kernel but
    /// [`KernelKind::AllReduceGroup`] (which [`Backend::launch_group`] enqueues).
    #[doc(hidden)]
    fn launch(
        dev: &Self::Device,
        kernel: Kernel,
        dims: LaunchDims,
        args: &AllReduceArgs,
    ) -> Result<()>;
    /// As [`Backend::launch`], but the kernel may be scheduled while the kernel before
    /// it on the stream is still finishing, so its launch and entry overlap that
    /// kernel's tail (programmatic dependent launch on NVIDIA sm_90 and newer). Every
    /// peercomm kernel first waits, on the device, until the previous kernel's results
    /// are visible, so the result is the same. Backends and devices without such a
    /// launch run a plain [`Backend::launch`].
    #[doc(hidden)]
    fn launch_overlapping(
        dev: &Self::Device,
        kernel: Kernel,
        dims: LaunchDims,
        args: &AllReduceArgs,
    ) -> Result<()> {
        Self::launch(dev, kernel, dims, args)
    }
    /// Enqueues the batched all-reduce `kernel` ([`KernelKind::AllReduceGroup`] of one
    /// dtype) on the device's stream, its [`GroupArgs`] passed by value (552 bytes of
    /// kernel parameters, against the 288 of [`AllReduceArgs`]).
    #[doc(hidden)]
    fn launch_group(
        dev: &Self::Device,
        kernel: Kernel,
        dims: LaunchDims,
        args: &GroupArgs,
    ) -> Result<()>;
    /// Waits for everything enqueued on the device's stream.
    fn synchronize(dev: &Self::Device) -> Result<()>;

    /// Allocates a typed buffer of `len` elements (contents unspecified).
    fn alloc_buffer<T: Element>(dev: &Self::Device, len: usize) -> Result<Self::Buffer<T>>;
    /// Copies `src` into `dst` (same length).
    fn upload<T: Element>(dev: &Self::Device, src: &[T], dst: &mut Self::Buffer<T>) -> Result<()>;
    /// Copies a buffer back to the host. In code generic over the backend, `T` cannot
    /// be inferred through `Self::Buffer<T>`: call [`TypedBuffer::to_host`] on the
    /// buffer instead.
    fn download<T: Element>(dev: &Self::Device, src: &Self::Buffer<T>) -> Result<Vec<T>>;
    /// Allocates a buffer holding a copy of `src` (`T` is inferred from `src`).
    fn alloc_from<T: Element>(dev: &Self::Device, src: &[T]) -> Result<Self::Buffer<T>> {
        let mut buf = Self::alloc_buffer::<T>(dev, src.len())?;
        Self::upload(dev, src, &mut buf)?;
        Ok(buf)
    }
}

/// A backend's typed buffer ([`Backend::Buffer`]), which knows its element type: host
/// copies infer `T` from the buffer, so code generic over the backend needs no
/// turbofish.
///
/// ```
/// use peercomm::backend::{host::Host, Backend, TypedBuffer};
///
/// fn round_trip<B: Backend>(dev: &B::Device) -> peercomm::Result<Vec<f32>> {
///     let mut buf = B::alloc_from(dev, &[1.0f32, -0.0, 3.5])?; // T from the slice
///     buf.copy_from_host(dev, &[2.0, 4.0, 8.0])?;
///     buf.to_host(dev) // T from the buffer
/// }
/// let dev = Host::open(0)?;
/// assert_eq!(round_trip::<Host>(&dev)?, vec![2.0, 4.0, 8.0]);
/// # Ok::<(), peercomm::Error>(())
/// ```
pub trait TypedBuffer<B: Backend>: DeviceBufferMut<B> {
    /// The element type.
    type Elem: Element;
    /// Copies `src` (of the buffer's length) into the buffer ([`Backend::upload`]).
    fn copy_from_host(&mut self, dev: &B::Device, src: &[Self::Elem]) -> Result<()>;
    /// Copies the buffer back to the host ([`Backend::download`]).
    fn to_host(&self, dev: &B::Device) -> Result<Vec<Self::Elem>>;
}

/// Implements [`TypedBuffer`] for a backend's buffer type by delegating to the
/// backend's `upload` and `download`.
macro_rules! impl_typed_buffer {
    ($backend:ty, $buffer:ident) => {
        impl<T: $crate::dtype::Element> $crate::backend::TypedBuffer<$backend> for $buffer<T> {
            type Elem = T;
            fn copy_from_host(
                &mut self,
                dev: &<$backend as $crate::backend::Backend>::Device,
                src: &[T],
            ) -> $crate::error::Result<()> {
                <$backend as $crate::backend::Backend>::upload(dev, src, self)
            }
            fn to_host(
                &self,
                dev: &<$backend as $crate::backend::Backend>::Device,
            ) -> $crate::error::Result<Vec<T>> {
                <$backend as $crate::backend::Backend>::download(dev, self)
            }
        }
    };
}
pub(crate) use impl_typed_buffer;

/// A device buffer a collective can read: its element type, length and device are
/// known at run time, so mismatches across ranks are reported, not compiled away.
///
/// # Safety
/// Kernels trust what this trait reports. An implementation must guarantee:
///
/// - that the address returned by `read_ptr` (and `write_ptr`) points to at least
///   `len()` elements of `dtype()` on device `device_ordinal()` (so `len()` elements
///   of `dtype()` are a byte count that fits the address space), valid for as long as
///   the returned guard lives and, through the backend's stream ordering, until the
///   kernels enqueued while it lived have finished;
/// - that the address is a multiple of `dtype()`'s size: the device kernels load and
///   store whole elements (16-byte packs where the address allows, else element by
///   element), and an element that straddles its natural alignment faults there (the
///   host backend reads unaligned, so a test there would not see it);
/// - that the memory is reachable by the peers' kernels (on CUDA: `cuMemAlloc` memory
///   or the device's default memory pool, which peercomm opens to the peers; on the
///   host backend: any host memory);
/// - that the range it reports (`read_ptr`'s address, `len()`, `dtype()`,
///   `device_ordinal()`) stays the same while the value is only shared: it changes only
///   through `&mut self` or by moving or replacing the value. A registration
///   ([`crate::Comm::register`]) relies on it: the peers keep reading the range it
///   reported, which is why [`crate::Registered`] hands out no `&mut` to its buffer.
///
/// The trait does not promise that two buffers are disjoint: an implementation may
/// report ranges that overlap (views of one allocation, say). peercomm checks a call's
/// buffers instead: an input and an output that are the very same range run in place
/// where the collective has an in-place form (the all-reduce; a broadcast root's
/// input), and any other overlap between a buffer the call writes and another of its
/// buffers (on any rank, for the single controller) is [`crate::Error::BuffersOverlap`]
/// before anything is launched. A length whose bytes no buffer can span is
/// [`crate::Error::SizeOverflow`].
pub unsafe trait DeviceBuffer<B: Backend> {
    /// Element type.
    fn dtype(&self) -> DType;
    /// Elements.
    fn len(&self) -> usize;
    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Ordinal of the device holding it.
    fn device_ordinal(&self) -> usize;
    /// Address for a kernel on `dev` that reads it; the access guard must live until
    /// that kernel is enqueued.
    fn read_ptr<'a>(&'a self, dev: &'a B::Device) -> (u64, B::Access<'a>);
}

/// A device buffer a collective can write.
///
/// # Safety
/// As for [`DeviceBuffer`], for writes through `write_ptr`: its address is
/// `read_ptr`'s (the same range, writable), and its own methods that take `&mut self`
/// (such as [`TypedBuffer::copy_from_host`]) write that range without moving it.
pub unsafe trait DeviceBufferMut<B: Backend>: DeviceBuffer<B> {
    /// Address for a kernel on `dev` that writes it (and may read it).
    fn write_ptr<'a>(&'a mut self, dev: &'a B::Device) -> (u64, B::Access<'a>);
}
