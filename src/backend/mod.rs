//! The one trait that abstracts what differs between vendors, and its implementations:
//! [`host`] (always built: CPU threads over memory arenas), `cuda` (feature `cuda`) and
//! `hip` (feature `hip`). Static dispatch through associated types: a communicator is
//! generic over its backend and pays no virtual call per launch.

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::signal::{AllReduceArgs, ExchangeArgs, GroupArgs};

pub use identity::DeviceIdentity;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(any(target_os = "linux", feature = "cuda", feature = "hip"))]
pub(crate) mod handle;
#[cfg(feature = "hip")]
pub mod hip;
pub mod host;
mod identity;
pub(crate) mod p2p;
pub(crate) mod signal_init;

/// Only peercomm's backends implement [`Backend`]: its launch and memory methods follow
/// the kernels, which change without notice.
mod sealed {
    pub trait Sealed {}
}

pub(crate) mod launch_types;
pub(crate) use launch_types::*;

/// What a communicator can be built on: a backend's device, or for CUDA cudarc's
/// `Arc<CudaStream>` itself. It names its backend, so `Comm::from_rank` needs no
/// turbofish.
pub trait IntoDevice {
    /// The backend the device belongs to.
    type Backend: Backend;
    /// The device, ready for collectives (for a stream: its context, kernels loaded).
    fn into_device(self) -> Result<<Self::Backend as Backend>::Device>;
}

/// The argument structs of the kernels that take one of their own instead of
/// [`AllReduceArgs`] ([`Backend::launch_wide`]).
#[doc(hidden)]
#[derive(Clone, Copy)]
pub enum WideArgs<'a> {
    /// The batched all-reduce's ([`KernelKind::AllReduceGroup`]).
    Group(&'a GroupArgs),
    /// The exchange's ([`KernelKind::Exchange`]).
    Exchange(&'a ExchangeArgs),
}

impl WideArgs<'_> {
    /// The arguments every kernel reads (signals, group, timeout, descriptor).
    pub fn all(&self) -> &AllReduceArgs {
        match self {
            WideArgs::Group(g) => &g.all,
            WideArgs::Exchange(x) => &x.all,
        }
    }
}

/// The launch checks: the batched all-reduce and the exchange run through
/// [`Backend::launch_wide`] (`wide`: their arguments; a batch of
/// `1..=MAX_GROUP_CALLS` entries), every other kernel through [`Backend::launch`].
pub(crate) fn check_kernel(name: &str, kernel: Kernel, wide: Option<WideArgs<'_>>) -> Result<()> {
    let (max, symbol) = (crate::signal::MAX_GROUP_CALLS, kernel.symbol());
    let refuse = |why: String| Err(crate::Error::Unsupported(format!("{name}: {why}")));
    if !kernel.kind.takes(kernel.dtype) {
        return refuse(format!(
            "no {symbol} kernel (this family takes f32, f16, bf16)"
        ));
    }
    use KernelKind::{AllReduceGroup, Exchange};
    match (kernel.kind, wide) {
        (AllReduceGroup, Some(WideArgs::Group(g))) if g.count == 0 || g.count as usize > max => {
            refuse(format!(
                "a batched all-reduce of {} entries (1..={max})",
                g.count
            ))
        }
        (AllReduceGroup, Some(WideArgs::Group(_))) | (Exchange, Some(WideArgs::Exchange(_))) => {
            Ok(())
        }
        (AllReduceGroup | Exchange, _) => refuse(format!(
            "{symbol} takes arguments of its own: launch it with launch_wide"
        )),
        (_, Some(_)) => refuse(format!(
            "launch_wide runs the batched all-reduce and the exchange, not {symbol}"
        )),
        (_, None) => Ok(()),
    }
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
    /// the launch that uses it is enqueued.
    type Access<'a>;
    /// The access of memory with no bookkeeping (ordered on the communicator's stream).
    #[doc(hidden)]
    fn untracked_access<'a>() -> Self::Access<'a>;
    /// A typed device buffer (`CudaSlice<T>` for CUDA). Owned and `Send`: a dropped
    /// registration keeps it while a peer may still read it ([`crate::Registered`]).
    type Buffer<T: Element>: TypedBuffer<Self, Elem = T> + Send + 'static;
    /// Another process's memory mapped into this one; dropping it unmaps it.
    type PeerMapping: Send + Sync;

    /// Devices visible to this backend.
    fn device_count() -> Result<usize>;
    /// Opens device `ordinal` with a new stream.
    fn open(ordinal: usize) -> Result<Self::Device>;
    /// The ordinal of a device (in this process: `CUDA_VISIBLE_DEVICES` renumbers).
    fn ordinal(dev: &Self::Device) -> usize;
    /// What names the device physically (UUID, PCI bus id): ranks compare identities,
    /// not ordinals, to tell whether they share a device. Default: the ordinal only.
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
    /// Address at which `dev` reaches `peer_mem`, another device's allocation of this
    /// process (with peer access on, the same address).
    #[doc(hidden)]
    fn map_peer(dev: &Self::Device, peer_mem: &Self::Memory) -> Result<u64>;
    /// Prepares a device several ranks share: no rank's stream may wait for another's,
    /// since their collectives wait for each other (CUDA: no pool reuse across streams).
    #[doc(hidden)]
    fn prepare_shared_device(_dev: &Self::Device) -> Result<()> {
        Ok(())
    }
    /// Why device `peer_ordinal`'s kernels could not reach the user memory at `ptr`
    /// (a pool or mapping peer access does not cover), or `None`: a typed error
    /// instead of a fault. Default: every address is reachable.
    #[doc(hidden)]
    fn peer_access_problem(
        _dev: &Self::Device,
        _ptr: u64,
        _peer_ordinal: usize,
    ) -> Result<Option<String>> {
        Ok(None)
    }
    /// Exports a [`MemoryKind::SharedSignal`] allocation for another process of this
    /// host to map with [`Backend::import_memory`] (a `handle` record, valid while `mem`
    /// lives).
    #[doc(hidden)]
    fn export_memory(dev: &Self::Device, mem: &Self::Memory) -> Result<Vec<u8>>;
    /// Exports the allocation holding `[ptr, ptr + bytes)` for [`Backend::import_range`].
    /// Memory that cannot be exported (a pool without an IPC handle type, host heap) is
    /// [`crate::Error::CannotRegister`] (`rank` 0: the caller names it).
    #[doc(hidden)]
    fn export_range(dev: &Self::Device, ptr: u64, bytes: usize) -> Result<ExportedRange>;
    /// Maps memory another process exported into `dev`'s address space (the GPU
    /// backends refuse the exporter itself: it uses [`Backend::map_peer`]). A bad handle
    /// is `Error::Backend { call: "import_memory", .. }`.
    #[doc(hidden)]
    fn import_memory(dev: &Self::Device, handle: &[u8]) -> Result<Self::PeerMapping>;
    /// Maps a range exported with [`Backend::export_range`], closing the descriptor.
    /// Default: [`Backend::import_memory`] without a descriptor, refused with one.
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
    /// Fills `halves` 16-bit words at `ptr` (2-byte aligned) with `value`, on the stream.
    #[doc(hidden)]
    fn memset_d16(dev: &Self::Device, ptr: u64, value: u16, halves: usize) -> Result<()>;
    /// Copies device memory at `ptr` to the host, after the stream's earlier work.
    #[doc(hidden)]
    fn read(dev: &Self::Device, ptr: u64, dst: &mut [u8]) -> Result<()>;
    /// Copies `src` to device memory at `ptr`, after the stream's earlier work; returns
    /// once done.
    #[doc(hidden)]
    fn write(dev: &Self::Device, ptr: u64, src: &[u8]) -> Result<()>;
    /// Reads 32-bit words at `ptr` without waiting for the stream, each word whole while
    /// a kernel may write them (polls error records). Default: [`Backend::read`].
    #[doc(hidden)]
    fn read_words_now(dev: &Self::Device, ptr: u64, dst: &mut [u32]) -> Result<()> {
        let mut bytes = vec![0u8; dst.len() * 4];
        Self::read(dev, ptr, &mut bytes)?;
        for (w, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
            *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }
    /// Enqueues `kernel` (any but the batched all-reduce and the exchange) on the device's
    /// stream.
    #[doc(hidden)]
    fn launch(
        dev: &Self::Device,
        kernel: Kernel,
        dims: LaunchDims,
        args: &AllReduceArgs,
    ) -> Result<()>;
    /// As [`Backend::launch`], overlapping the previous kernel's tail (NVIDIA sm_90+
    /// programmatic dependent launch; kernels wait for the previous one's results).
    /// Default: a plain launch.
    #[doc(hidden)]
    fn launch_overlapping(
        dev: &Self::Device,
        kernel: Kernel,
        dims: LaunchDims,
        args: &AllReduceArgs,
    ) -> Result<()> {
        Self::launch(dev, kernel, dims, args)
    }
    /// Enqueues a kernel with an argument struct of its own: the batched all-reduce
    /// ([`KernelKind::AllReduceGroup`]) or the exchange ([`KernelKind::Exchange`]).
    #[doc(hidden)]
    fn launch_wide(
        dev: &Self::Device,
        kernel: Kernel,
        dims: LaunchDims,
        args: WideArgs<'_>,
    ) -> Result<()>;
    /// Waits for everything enqueued on the device's stream.
    fn synchronize(dev: &Self::Device) -> Result<()>;

    /// Allocates a typed buffer of `len` elements (contents unspecified).
    fn alloc_buffer<T: Element>(dev: &Self::Device, len: usize) -> Result<Self::Buffer<T>>;
    /// Copies `src` into `dst` (same length).
    fn upload<T: Element>(dev: &Self::Device, src: &[T], dst: &mut Self::Buffer<T>) -> Result<()>;
    /// Copies a buffer back to the host (generic code: [`TypedBuffer::to_host`] infers `T`).
    fn download<T: Element>(dev: &Self::Device, src: &Self::Buffer<T>) -> Result<Vec<T>>;
    /// Allocates a buffer holding a copy of `src` (`T` is inferred from `src`).
    fn alloc_from<T: Element>(dev: &Self::Device, src: &[T]) -> Result<Self::Buffer<T>> {
        let mut buf = Self::alloc_buffer::<T>(dev, src.len())?;
        Self::upload(dev, src, &mut buf)?;
        Ok(buf)
    }
}

/// A backend's typed buffer ([`Backend::Buffer`]), which knows its element type, so
/// code generic over the backend copies to and from it without a turbofish.
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

/// Implements [`TypedBuffer`] for a backend's buffer through its `upload` and `download`.
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
/// Kernels trust what this trait reports. An implementation must guarantee that:
///
/// - `read_ptr`'s (and `write_ptr`'s) address points to at least `len()` elements of
///   `dtype()` on device `device_ordinal()`, valid while the guard lives and, through
///   stream ordering, until the kernels enqueued meanwhile have finished;
/// - the address is a multiple of `dtype()`'s size (device kernels fault on an element
///   that straddles its alignment; the host backend reads unaligned and would not see it);
/// - the peers' kernels can reach the memory (CUDA: `cuMemAlloc` memory or the default
///   pool, which peercomm opens to the peers; host: any memory);
/// - the reported range stays the same while the value is only shared (it changes only
///   through `&mut self` or by moving it): a registration ([`crate::Comm::register`])
///   keeps reading it, so [`crate::Registered`] hands out no `&mut`.
///
/// Buffers may overlap: peercomm checks each call's buffers. The very same range as
/// input and output runs in place where the collective has an in-place form; any other
/// overlap with a written buffer is [`crate::Error::BuffersOverlap`] and a length whose
/// bytes no buffer can span [`crate::Error::SizeOverflow`], before anything is launched.
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
/// As for [`DeviceBuffer`]: `write_ptr`'s address is `read_ptr`'s (the same range,
/// writable), and its `&mut self` methods write that range without moving it.
pub unsafe trait DeviceBufferMut<B: Backend>: DeviceBuffer<B> {
    /// Address for a kernel on `dev` that writes it (and may read it).
    fn write_ptr<'a>(&'a mut self, dev: &'a B::Device) -> (u64, B::Access<'a>);
}
