//! The host reference backend: each "device" is a memory arena with a stream thread,
//! each block of a kernel an OS thread, and the kernels are Rust ports of the device
//! code spinning on real atomics over the same signal layout, so the protocol runs (and
//! CI tests it) on any machine. Addresses are process addresses: peer access is always
//! on and `map_peer` is the identity. Device `o`'s identity is
//! [`super::DeviceIdentity::simulated`] `(o, o)` in every process.
//!
//! # IPC (Linux)
//! Shared memory is a sealed (fixed-size: an importer never faults on a truncation)
//! `memfd` mapped `MAP_SHARED`. Its 40-byte handle (`pcho`, version 1, pid, fd, size,
//! `st_dev`, `st_ino`) names `/proc/<pid>/fd/<fd>`, whose identity and size the importer
//! checks before mapping it. A registered range ([`Backend::export_range`]) travels as
//! CUDA's pools do, a descriptor beside the handle, so CI covers that path too.
//! Elsewhere than Linux, shared allocation and import are `Error::Unsupported`.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use super::{Backend, Descriptor, ExportedRange, Kernel, LaunchDims, MemoryKind, WideArgs};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::signal::{AllReduceArgs, MAX_GPUS};

mod buffers;
mod device;
mod kernels;
mod memory;
#[cfg(target_os = "linux")]
mod shm;
mod stream;
mod user;

pub use buffers::HostBuffer;
pub use device::{Host, HostDevice};
use memory::Storage;
pub(crate) use memory::{HostMemory, HostPeerMapping};
use stream::{FreeOnStream, Stream};
pub use user::{HostBlock, Stopped};

/// Elsewhere than Linux: shared allocation and import are `Error::Unsupported`.
#[cfg(not(target_os = "linux"))]
mod shm {
    use crate::error::{Error, Result};
    use std::convert::Infallible;

    fn unsupported() -> Error {
        Error::Unsupported("host: shared memory (MemoryKind::Shared*, IPC) needs Linux".into())
    }
    pub(crate) struct SharedFile(Infallible);
    impl SharedFile {
        pub(crate) fn create(_bytes: usize) -> Result<Self> {
            Err(unsupported())
        }
        pub(crate) fn addr(&self) -> u64 {
            match self.0 {}
        }
        pub(crate) fn export(&self) -> Vec<u8> {
            match self.0 {}
        }
    }
    pub(crate) struct Mapping(Infallible);
    impl Mapping {
        pub(crate) fn addr(&self) -> u64 {
            match self.0 {}
        }
        pub(crate) fn len(&self) -> usize {
            match self.0 {}
        }
    }
    pub(crate) fn import(_handle: &[u8]) -> Result<Mapping> {
        Err(unsupported())
    }
    pub(crate) fn import_descriptor(_: &[u8], _: super::Descriptor) -> Result<Mapping> {
        Err(unsupported())
    }
    pub(crate) fn export_containing(
        _ptr: u64,
        _bytes: usize,
    ) -> Option<Result<(Vec<u8>, u64, super::Descriptor)>> {
        None
    }
}

impl super::sealed::Sealed for Host {}

impl Backend for Host {
    const NAME: &'static str = "host";
    type Device = HostDevice;
    type Memory = HostMemory;
    type Access<'a> = ();
    fn untracked_access<'a>() -> Self::Access<'a> {}
    type Buffer<T: Element> = HostBuffer<T>;
    type PeerMapping = HostPeerMapping;

    fn device_count() -> Result<usize> {
        Ok(MAX_GPUS)
    }

    fn open(ordinal: usize) -> Result<HostDevice> {
        if ordinal >= MAX_GPUS {
            return Err(Error::InvalidDevices(format!(
                "host device {ordinal} does not exist (the host backend has {MAX_GPUS})"
            )));
        }
        Ok(HostDevice {
            ordinal,
            stream: Arc::new(Stream::new(ordinal)),
        })
    }

    fn ordinal(dev: &HostDevice) -> usize {
        dev.ordinal
    }

    fn identity(dev: &HostDevice) -> Result<super::DeviceIdentity> {
        Ok(super::DeviceIdentity::simulated(dev.ordinal, dev.ordinal))
    }

    fn multiprocessor_count(_dev: &HostDevice) -> Result<usize> {
        Ok(std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1))
    }

    fn architecture(_dev: &HostDevice) -> Result<String> {
        Ok("host".to_string())
    }

    fn can_access_peer(_dev: &HostDevice, _peer: &HostDevice) -> Result<bool> {
        Ok(true)
    }

    fn enable_peer_access(_dev: &HostDevice, _peer: &HostDevice) -> Result<()> {
        Ok(())
    }

    fn alloc(dev: &HostDevice, bytes: usize, kind: MemoryKind) -> Result<HostMemory> {
        HostMemory::new(dev, bytes, kind)
    }

    fn memory_ptr(mem: &HostMemory) -> u64 {
        mem.addr()
    }

    fn map_peer(_dev: &HostDevice, peer_mem: &HostMemory) -> Result<u64> {
        Ok(peer_mem.addr())
    }

    fn export_memory(_dev: &HostDevice, mem: &HostMemory) -> Result<Vec<u8>> {
        match mem.storage.get() {
            Storage::Shared(file) => Ok(file.export()),
            Storage::Heap(_) => Err(Error::Unsupported(
                "host: export_memory needs an allocation made with MemoryKind::SharedSignal \
                 (this one is heap memory, which other processes cannot map)"
                    .into(),
            )),
        }
    }

    fn export_range(_dev: &HostDevice, ptr: u64, bytes: usize) -> Result<ExportedRange> {
        let (handle, offset, descriptor) =
            shm::export_containing(ptr, bytes).ok_or_else(|| Error::CannotRegister {
                rank: 0,
                reason: "host: the buffer is heap memory, which other processes cannot map; \
                         allocate it with Comm::alloc_symmetric (ranks in one process can \
                         register any buffer)"
                    .into(),
            })??;
        Ok(ExportedRange {
            handle,
            offset,
            descriptor: Some(descriptor),
        })
    }

    fn import_memory(dev: &HostDevice, handle: &[u8]) -> Result<HostPeerMapping> {
        Self::import_range(dev, handle, None)
    }

    fn import_range(
        dev: &HostDevice,
        handle: &[u8],
        descriptor: Option<Descriptor>,
    ) -> Result<HostPeerMapping> {
        let mapping = match descriptor {
            Some(d) => shm::import_descriptor(handle, d)?,
            None => shm::import(handle)?,
        };
        Ok(HostPeerMapping {
            mapping: FreeOnStream::new(mapping, &dev.stream),
        })
    }

    fn mapping_ptr(mapping: &HostPeerMapping) -> u64 {
        mapping.mapping.get().addr()
    }

    fn memset_d32(dev: &HostDevice, ptr: u64, value: u32, words: usize) -> Result<()> {
        fill(dev, ptr, value, words)
    }

    fn memset_d16(dev: &HostDevice, ptr: u64, value: u16, halves: usize) -> Result<()> {
        fill(dev, ptr, value, halves)
    }

    fn read(dev: &HostDevice, ptr: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: the caller passes a range inside one of its allocations.
        unsafe { copy_idle(dev, ptr as *const u8, dst.as_mut_ptr(), dst.len()) }
    }

    fn write(dev: &HostDevice, ptr: u64, src: &[u8]) -> Result<()> {
        // SAFETY: as in `read`.
        unsafe { copy_idle(dev, src.as_ptr(), ptr as *mut u8, src.len()) }
    }

    fn read_words_now(_dev: &HostDevice, ptr: u64, dst: &mut [u32]) -> Result<()> {
        for (i, w) in dst.iter_mut().enumerate() {
            // SAFETY: the caller passes a 4-byte aligned range of live memory; kernels
            // (block threads) write these words only through atomics, so an atomic
            // load races with nothing.
            let word = unsafe { AtomicU32::from_ptr((ptr as *mut u32).add(i)) };
            *w = word.load(std::sync::atomic::Ordering::Acquire);
        }
        Ok(())
    }

    fn launch(
        dev: &HostDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: &AllReduceArgs,
    ) -> Result<()> {
        super::check_kernel(Self::NAME, kernel, None)?;
        let args = *args;
        // SAFETY: the communicator built `args` from live allocations of the layout the
        // kernels expect.
        run_blocks(dev, dims.blocks, move |b| unsafe {
            kernels::run_block(kernel, &args, b, dims.blocks)
        });
        Ok(())
    }

    fn launch_wide(
        dev: &HostDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: WideArgs<'_>,
    ) -> Result<()> {
        super::check_kernel(Self::NAME, kernel, Some(args))?;
        // SAFETY: as in `launch`; the entries and peers come from buffers the
        // communicator holds for the call.
        match args {
            WideArgs::Group(g) => {
                let g = *g;
                run_blocks(dev, dims.blocks, move |b| unsafe {
                    kernels::run_group_block(kernel, &g, b, dims.blocks)
                })
            }
            WideArgs::Exchange(x) => {
                let x = *x;
                run_blocks(dev, dims.blocks, move |b| unsafe {
                    kernels::run_exchange_block(&x, b, dims.blocks)
                })
            }
        }
        Ok(())
    }

    fn synchronize(dev: &HostDevice) -> Result<()> {
        dev.stream.synchronize();
        Ok(())
    }

    fn alloc_buffer<T: Element>(dev: &HostDevice, len: usize) -> Result<HostBuffer<T>> {
        let dtype = T::DTYPE;
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            device::alloc_error(format!(
                "{len} elements of {dtype:?} overflow the address space"
            ))
        })?;
        Ok(HostBuffer {
            mem: HostMemory::new(dev, bytes, MemoryKind::Plain)?,
            len,
            _t: std::marker::PhantomData,
        })
    }

    fn upload<T: Element>(dev: &HostDevice, src: &[T], dst: &mut HostBuffer<T>) -> Result<()> {
        if src.len() != dst.len {
            let (rank, n) = (dev.ordinal, src.len());
            let what = format!("upload of {n} elements into a buffer of {}", dst.len);
            return Err(Error::LengthMismatch { rank, what });
        }
        // SAFETY: dst holds `len` elements of T.
        unsafe { copy_idle(dev, src.as_ptr(), dst.mem.addr() as *mut T, src.len()) }
    }

    fn download<T: Element>(dev: &HostDevice, src: &HostBuffer<T>) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len];
        // SAFETY: src holds `len` elements of T.
        unsafe { copy_idle(dev, src.mem.addr() as *const T, out.as_mut_ptr(), src.len)? };
        Ok(out)
    }
}

super::impl_typed_buffer!(Host, HostBuffer);

/// Copies `n` values once the device's stream is idle.
///
/// # Safety
/// `src` and `dst` are valid for `n` values and do not overlap.
unsafe fn copy_idle<T>(dev: &HostDevice, src: *const T, dst: *mut T, n: usize) -> Result<()> {
    dev.stream.synchronize();
    std::ptr::copy_nonoverlapping(src, dst, n);
    Ok(())
}

/// Fills `n` values of `T` at `ptr` with `v`, on the device's stream.
fn fill<T: Copy + Send + 'static>(dev: &HostDevice, ptr: u64, v: T, n: usize) -> Result<()> {
    dev.stream.enqueue(Box::new(move || {
        let p = ptr as *mut T;
        for i in 0..n {
            // SAFETY: the caller passes a range inside one of its allocations; the
            // stream orders this after earlier work on the device.
            unsafe { p.add(i).write_volatile(v) };
        }
    }));
    Ok(())
}

/// Enqueues a kernel on the device's stream: one scoped thread per block runs `block`.
/// Enqueues `kernel` over `comm` on `dev`'s stream, `blocks` blocks (the device API's
/// host contract, see [`HostBlock`]).
///
/// # Safety
/// `comm` is of a communicator on `dev` that outlives the kernel (its drop drains the
/// stream first).
pub(crate) unsafe fn launch_user_kernel<F>(
    dev: &HostDevice,
    comm: &crate::device::DeviceComm,
    blocks: u32,
    kernel: F,
) where
    F: Fn(&HostBlock) -> Result<(), Stopped> + Send + Sync + 'static,
{
    let comm = *comm;
    // SAFETY: the caller's.
    run_blocks(dev, blocks, move |b| unsafe {
        user::run_block(&comm, b, blocks, &kernel)
    });
}

fn run_blocks(dev: &HostDevice, blocks: u32, block: impl Fn(u32) + Send + Sync + 'static) {
    dev.stream.enqueue(Box::new(move || {
        std::thread::scope(|s| {
            for b in 0..blocks {
                let block = &block;
                std::thread::Builder::new()
                    .name(format!("peercomm-host-block-{b}"))
                    .spawn_scoped(s, move || block(b))
                    .expect("spawn host block thread");
            }
        });
    }));
}
