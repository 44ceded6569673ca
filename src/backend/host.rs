//! The host reference backend: each "device" is a memory arena with a stream thread,
//! each block of a kernel an OS thread, and the kernels are Rust ports of the device
//! code spinning on real atomics over the same signal layout. It makes the protocol
//! testable on any machine and is what CI runs.
//!
//! Addresses are plain process addresses, so every arena is reachable from every
//! other: peer access is always available and `map_peer` is the identity.
//!
//! Device `o`'s identity ([`Backend::identity`]) is [`super::DeviceIdentity::simulated`]
//! `(o, o)` in every process: the same ordinal in two processes is one "device" (as on a
//! GPU host without `CUDA_VISIBLE_DEVICES`). `Simulation::physical_devices` gives ranks
//! other physical devices, e.g. every rank on ordinal 0 but each on its own device (the
//! isolation engines make with `CUDA_VISIBLE_DEVICES`).
//!
//! # IPC (Linux)
//! So that the host backend can run the protocol with one process per rank, as engines
//! do on GPUs, shared signal memory is an anonymous shared memory file
//! (`memfd_create`, close-on-exec), sized, sealed against shrinking and growing (an
//! importer's pages can never be truncated away under it, which would fault with
//! SIGBUS), and mapped `MAP_SHARED` read/write; it is zero-filled and page aligned.
//! The exporter keeps the file open, and its handle names it by the exporter's
//! process id and fd number: the importer opens `/proc/<pid>/fd/<fd>` read/write (the
//! kernel allows that to processes that may inspect the exporter, e.g. the same user),
//! checks the file's identity and size, maps it shared and closes the fd at once (the
//! mapping keeps the file alive). Passing the fd itself over a Unix socket would need
//! a socket between every pair of ranks; a path through `/proc` travels as plain bytes
//! over any bootstrap. Importing in the exporting process works like any other import.
//!
//! The handle, 40 bytes, little-endian (framed as every backend's, see
//! `Backend::export_memory`): magic `pcho`, version `u32` = 1, exporter pid `u32`, fd
//! number `u32`, size `u64`, then the file's `st_dev` `u64` and `st_ino` `u64`. The
//! identity tells a freed allocation whose fd number was reused by another file from
//! the file the handle names (shared memory inode numbers are not reused while the
//! kernel's counter has not wrapped). Atomics across processes on `MAP_SHARED` memory
//! are ordinary atomics on Linux, so the kernels need nothing new.
//!
//! A registered range ([`Backend::export_range`]: a symmetric buffer, or any range of
//! a `SharedData` allocation) is exported instead the way CUDA exports memory pools
//! and virtual-memory allocations: as a descriptor of the file, beside the same
//! handle, that a Unix socket carries to the importer (`SCM_RIGHTS`, the per-rank
//! communicator's descriptor channel); [`Backend::import_range`] checks that the
//! descriptor is the file the handle names (identity and size) and maps it. So the
//! processes tests that CI runs cover the path those GPU allocations take.
//!
//! Freeing is stream-ordered like every host allocation: dropping the exporter's
//! `HostMemory` unmaps and closes in order on its device's stream, and dropping a
//! `HostPeerMapping` unmaps in order on the importing device's stream. Elsewhere than
//! Linux, `SharedSignal` allocation and import are `Error::Unsupported`.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use super::{Backend, Descriptor, ExportedRange, Kernel, LaunchDims, MemoryKind};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::signal::{AllReduceArgs, GroupArgs, MAX_GPUS};

// This file: the `Host` type and its `Backend` impl. Beside it in host/: the stream
// worker (stream.rs), the device (device.rs), allocations and peer mappings (memory.rs),
// the typed buffer (buffers.rs), Linux shared memory (shm.rs) and the kernels
// (kernels.rs and kernels/).
mod buffers;
mod device;
mod kernels;
mod memory;
#[cfg(target_os = "linux")]
mod shm;
mod stream;

pub use buffers::HostBuffer;
pub use device::{Host, HostDevice};
use memory::Storage;
pub(crate) use memory::{HostMemory, HostPeerMapping};
use stream::{FreeOnStream, Stream};

/// Shared memory needs Linux (memfd, `/proc/<pid>/fd`); elsewhere `SharedSignal`
/// allocation and import are `Error::Unsupported`, and these types are never built.
#[cfg(not(target_os = "linux"))]
mod shm {
    use crate::error::{Error, Result};
    use std::convert::Infallible;

    fn unsupported() -> Error {
        Error::Unsupported(
            "host: shared signal memory (MemoryKind::SharedSignal, IPC export/import) needs \
             Linux"
                .into(),
        )
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
    pub(crate) fn import_descriptor(
        _handle: &[u8],
        descriptor: super::Descriptor,
    ) -> Result<Mapping> {
        drop(descriptor);
        Err(unsupported())
    }
    pub(crate) fn export_containing(
        _ptr: u64,
        _bytes: usize,
    ) -> Option<Result<(Vec<u8>, u64, super::Descriptor)>> {
        None
    }
}

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
        Ok(HostPeerMapping {
            mapping: FreeOnStream::new(shm::import(handle)?, &dev.stream),
        })
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
        dev.stream.enqueue(Box::new(move || {
            let p = ptr as *mut u32;
            for i in 0..words {
                // SAFETY: the caller passes a range inside one of its allocations;
                // the stream orders this after earlier work on the device.
                unsafe { p.add(i).write_volatile(value) };
            }
        }));
        Ok(())
    }

    fn memset_d16(dev: &HostDevice, ptr: u64, value: u16, halves: usize) -> Result<()> {
        dev.stream.enqueue(Box::new(move || {
            let p = ptr as *mut u16;
            for i in 0..halves {
                // SAFETY: the caller passes a range inside one of its allocations;
                // the stream orders this after earlier work on the device.
                unsafe { p.add(i).write_volatile(value) };
            }
        }));
        Ok(())
    }

    fn read(dev: &HostDevice, ptr: u64, dst: &mut [u8]) -> Result<()> {
        dev.stream.synchronize();
        // SAFETY: the caller passes a range inside one of its allocations and the
        // stream is idle.
        unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn write(dev: &HostDevice, ptr: u64, src: &[u8]) -> Result<()> {
        dev.stream.synchronize();
        // SAFETY: the caller passes a range inside one of its allocations and the
        // stream is idle.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), ptr as *mut u8, src.len()) };
        Ok(())
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
        super::check_plain_kernel(Self::NAME, kernel)?;
        let args = *args;
        dev.stream.enqueue(Box::new(move || {
            std::thread::scope(|s| {
                for block in 0..dims.blocks {
                    let args = &args;
                    std::thread::Builder::new()
                        .name(format!("peercomm-host-block-{block}"))
                        .spawn_scoped(s, move || {
                            // SAFETY: the communicator built `args` from live
                            // allocations of the same layout the kernels expect.
                            unsafe { kernels::run_block(kernel, args, block, dims.blocks) }
                        })
                        .expect("spawn host block thread");
                }
            });
        }));
        Ok(())
    }

    fn launch_group(
        dev: &HostDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: &GroupArgs,
    ) -> Result<()> {
        super::check_group_kernel(Self::NAME, kernel, args)?;
        let args = *args;
        dev.stream.enqueue(Box::new(move || {
            std::thread::scope(|s| {
                for block in 0..dims.blocks {
                    let args = &args;
                    std::thread::Builder::new()
                        .name(format!("peercomm-host-block-{block}"))
                        .spawn_scoped(s, move || {
                            // SAFETY: the communicator built `args` from live
                            // allocations of the same layout the kernels expect, and
                            // its entries from buffers it holds for the call.
                            unsafe { kernels::run_group_block(kernel, args, block, dims.blocks) }
                        })
                        .expect("spawn host block thread");
                }
            });
        }));
        Ok(())
    }

    fn synchronize(dev: &HostDevice) -> Result<()> {
        dev.stream.synchronize();
        Ok(())
    }

    fn alloc_buffer<T: Element>(dev: &HostDevice, len: usize) -> Result<HostBuffer<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::Backend {
                backend: "host",
                call: "alloc",
                detail: format!(
                    "{len} elements of {:?} overflow the address space",
                    T::DTYPE
                ),
            })?;
        Ok(HostBuffer {
            mem: HostMemory::new(dev, bytes, MemoryKind::Plain)?,
            len,
            _t: std::marker::PhantomData,
        })
    }

    fn upload<T: Element>(dev: &HostDevice, src: &[T], dst: &mut HostBuffer<T>) -> Result<()> {
        if src.len() != dst.len {
            return Err(Error::LengthMismatch {
                rank: dev.ordinal,
                what: format!(
                    "upload of {} elements into a buffer of {}",
                    src.len(),
                    dst.len
                ),
            });
        }
        dev.stream.synchronize();
        // SAFETY: dst holds `len` elements of T and the stream is idle.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.mem.addr() as *mut T, src.len()) };
        Ok(())
    }

    fn download<T: Element>(dev: &HostDevice, src: &HostBuffer<T>) -> Result<Vec<T>> {
        dev.stream.synchronize();
        let mut out = vec![T::default(); src.len];
        // SAFETY: src holds `len` elements of T and the stream is idle.
        unsafe {
            std::ptr::copy_nonoverlapping(src.mem.addr() as *const T, out.as_mut_ptr(), src.len)
        };
        Ok(out)
    }
}

super::impl_typed_buffer!(Host, HostBuffer);
