//! The HIP backend (feature `hip`): AMD Instinct GPUs through the HIP runtime
//! (`libamdhip64`, linked by the `hip-sys` crate).
//!
//! - Devices: one [`HipDevice`] per GPU, with its own non-blocking stream and the
//!   embedded code object for its architecture loaded as a module
//!   (`hipModuleLoadData`); kernels run with `hipModuleLaunchKernel` on that stream.
//! - Signal memory ([`MemoryKind::Signal`]) is uncached device memory
//!   (`hipExtMallocWithFlags(.., hipDeviceMallocUncached)`), or fine-grained memory on
//!   runtimes without the uncached flag (HIP 5.x); see [`HipAllocation`]. Spins on it
//!   see the peers' stores, and the kernels' system-scope release/acquire sequences
//!   order everything else.
//! - Peer memory: one process, peer access on between every pair, unified addresses, so
//!   a peer's allocation is reached at its own address ([`Backend::map_peer`]).
//! - One process per GPU: IPC handles (see [IPC](#ipc)).
//! - Code objects for gfx90a and gfx942 (and gfx950 where the compiler knew it) are
//!   embedded at build time (build_hip.rs); the one whose processor matches the
//!   device's `gcnArchName` is loaded, and a device none matches is a typed error.
//!
//! # IPC
//! Shaped as the CUDA backend's legacy IPC: [`Backend::export_memory`] is
//! `hipIpcGetMemHandle` on the allocation (for signal memory, the uncached or
//! fine-grained allocation above), [`Backend::import_memory`] is `hipIpcOpenMemHandle`
//! with `hipIpcMemLazyEnablePeerAccess` on the importing device, and dropping the
//! [`HipPeerMapping`] synchronises that device and calls `hipIpcCloseMemHandle`. ROCm 6
//! and 7 define that flag as 1 and reject other values; the HIP 5 headers define it as
//! 0, so an import the runtime answers with `hipErrorInvalidValue` is retried once with
//! 0. The processes must be on one host; whether the importer must see the exporting
//! GPU (`HIP_VISIBLE_DEVICES`) is not documented by HIP, so isolated processes may
//! fall back to the external library there (a typed `P2pUnavailable` under
//! `Fallback::Refuse`). Ranks are told apart by [`Backend::identity`]
//! (`hipDeviceGetUuid` where the runtime exports it, and `hipDeviceGetPCIBusId`), not
//! by ordinal. Importing in the exporting process is `Error::Unsupported`
//! (recognised by the handle's process token before the runtime is asked). Unlike the
//! CUDA backend, the opened range is not compared with the handle's size: nothing of
//! this was run on AMD hardware (docs/amd.md), and the less untested code the better.
//! As on CUDA, import each handle once per process and share the mapping.
//!
//! The handle, 88 bytes, little-endian (framed as every backend's, see
//! `Backend::export_memory`): magic `pchi`, version `u32` = 1, the exporting
//! process's random token `u64`, the allocation's size `u64`, then the 64-byte
//! `hipIpcMemHandle_t`.
//!
//! # Why the HIP functions are declared here
//! `hip-sys` 0.1.2 ships bindings generated from HIP 5.4 headers in which `hipError_t`
//! is a Rust enum: a code the enum does not list (a newer ROCm adds some) would be
//! undefined behaviour the moment it is returned. Its `bindgen` feature regenerates the
//! bindings but writes them into the registry copy of the crate. So this module
//! declares the few functions it needs itself, with the status as a plain `i32`
//! ([`HipStatus`]), and takes only the opaque handle types and the link to
//! `amdhip64` from `hip-sys`. Every declaration below has the same C signature in HIP
//! 5.2 through 7.x. The device properties structure changed layout in ROCm 6, so the
//! architecture name is read through whichever versioned entry point the loaded
//! runtime exports (see `gcn_arch_name`).

use std::ffi::{c_int, c_void};
use std::marker::PhantomData;

use super::{Backend, ExportedRange, Kernel, LaunchDims, MemoryKind};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::signal::{AllReduceArgs, GroupArgs};

mod buffers;
mod device;
mod ffi;
mod launch;
mod memory;
mod runtime;

pub use buffers::HipBuffer;
pub use device::{HipDevice, HipEvent};
pub use ffi::HipStatus;
use launch::*;
use memory::*;
pub use memory::{HipAllocation, HipMemory, HipPeerMapping};
pub(crate) use runtime::set_device;
use runtime::*;
pub use runtime::{
    embedded_code_objects, runtime_version, skipped_architectures, EmbeddedCodeObject, Hip,
};

impl Backend for Hip {
    const NAME: &'static str = "hip";
    type Device = HipDevice;
    type Memory = HipMemory;
    type Access<'a> = ();
    fn untracked_access<'a>() -> Self::Access<'a> {}
    type Buffer<T: Element> = HipBuffer<T>;
    type PeerMapping = HipPeerMapping;

    /// Devices visible to HIP. With no AMD GPU (or no driver) this is
    /// [`Error::NoDevice`] carrying what `hipGetDeviceCount` said.
    fn device_count() -> Result<usize> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out pointer.
        let status = unsafe { ffi::hipGetDeviceCount(&mut n) };
        match status {
            ffi::SUCCESS => Ok(n.max(0) as usize),
            ffi::ERROR_NO_DEVICE | ffi::ERROR_INSUFFICIENT_DRIVER | ffi::ERROR_NOT_INITIALIZED => {
                Err(Error::NoDevice {
                    backend: Hip::NAME,
                    detail: format!("hipGetDeviceCount: {}", describe(status)),
                })
            }
            other => Err(Error::Backend {
                backend: Hip::NAME,
                call: "hipGetDeviceCount",
                detail: describe(other),
            }),
        }
    }

    fn open(ordinal: usize) -> Result<HipDevice> {
        device::open(ordinal)
    }

    fn ordinal(dev: &HipDevice) -> usize {
        dev.ordinal
    }

    fn identity(dev: &HipDevice) -> Result<super::DeviceIdentity> {
        Ok(super::DeviceIdentity::new(
            dev.ordinal,
            device_uuid(dev.ordinal),
            Some(&pci_bus_id(dev.ordinal)?),
        ))
    }

    fn multiprocessor_count(dev: &HipDevice) -> Result<usize> {
        Ok(dev.compute_units)
    }

    fn architecture(dev: &HipDevice) -> Result<String> {
        Ok(dev.processor.clone())
    }

    fn can_access_peer(dev: &HipDevice, peer: &HipDevice) -> Result<bool> {
        let mut can: c_int = 0;
        // SAFETY: `can` is a valid out pointer.
        check(
            unsafe {
                ffi::hipDeviceCanAccessPeer(&mut can, dev.ordinal as c_int, peer.ordinal as c_int)
            },
            "hipDeviceCanAccessPeer",
        )?;
        Ok(can != 0)
    }

    fn enable_peer_access(dev: &HipDevice, peer: &HipDevice) -> Result<()> {
        set_device(dev.ordinal)?;
        // SAFETY: plain value arguments.
        match unsafe { ffi::hipDeviceEnablePeerAccess(peer.ordinal as c_int, 0) } {
            ffi::SUCCESS | ffi::ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            other => check(other, "hipDeviceEnablePeerAccess"),
        }
    }

    fn alloc(dev: &HipDevice, bytes: usize, kind: MemoryKind) -> Result<HipMemory> {
        allocate(dev.ordinal, bytes, kind)
    }

    fn memory_ptr(mem: &HipMemory) -> u64 {
        mem.ptr
    }

    fn map_peer(_dev: &HipDevice, peer_mem: &HipMemory) -> Result<u64> {
        // One process, unified virtual addresses, peer access enabled by the
        // communicator: the peer's allocation is reached at its own address.
        Ok(peer_mem.ptr)
    }

    fn export_memory(_dev: &HipDevice, mem: &HipMemory) -> Result<Vec<u8>> {
        memory::export_memory(_dev, mem)
    }

    fn export_range(dev: &HipDevice, ptr: u64, bytes: usize) -> Result<ExportedRange> {
        let (handle, offset) = memory::export_range(dev, ptr, bytes)?;
        Ok(ExportedRange {
            handle,
            offset,
            descriptor: None,
        })
    }

    fn import_memory(dev: &HipDevice, handle: &[u8]) -> Result<HipPeerMapping> {
        memory::import_memory(dev, handle)
    }

    fn mapping_ptr(mapping: &HipPeerMapping) -> u64 {
        mapping.ptr
    }

    fn memset_d32(dev: &HipDevice, ptr: u64, value: u32, words: usize) -> Result<()> {
        set_device(dev.ordinal)?;
        // SAFETY: the caller passes a range inside one of its allocations; the write is
        // ordered on the device's stream.
        check(
            unsafe {
                ffi::hipMemsetD32Async(ptr as *mut c_void, value as c_int, words, dev.stream)
            },
            "hipMemsetD32Async",
        )
    }

    fn memset_d16(dev: &HipDevice, ptr: u64, value: u16, halves: usize) -> Result<()> {
        set_device(dev.ordinal)?;
        // SAFETY: the caller passes a range inside one of its allocations; the write is
        // ordered on the device's stream.
        check(
            unsafe { ffi::hipMemsetD16Async(ptr as *mut c_void, value, halves, dev.stream) },
            "hipMemsetD16Async",
        )
    }

    fn read(dev: &HipDevice, ptr: u64, dst: &mut [u8]) -> Result<()> {
        set_device(dev.ordinal)?;
        // SAFETY: the caller passes a device range of dst.len() bytes; `dst` stays
        // borrowed until the stream is synchronised below.
        check(
            unsafe {
                ffi::hipMemcpyDtoHAsync(
                    dst.as_mut_ptr().cast(),
                    ptr as *mut c_void,
                    dst.len(),
                    dev.stream,
                )
            },
            "hipMemcpyDtoHAsync",
        )?;
        Self::synchronize(dev)
    }

    fn write(dev: &HipDevice, ptr: u64, src: &[u8]) -> Result<()> {
        set_device(dev.ordinal)?;
        // SAFETY: the caller passes a device range of src.len() bytes; `src` stays
        // borrowed until the stream is synchronised below.
        check(
            unsafe {
                ffi::hipMemcpyHtoDAsync(
                    ptr as *mut c_void,
                    src.as_ptr().cast(),
                    src.len(),
                    dev.stream,
                )
            },
            "hipMemcpyHtoDAsync",
        )?;
        Self::synchronize(dev)
    }

    fn read_words_now(dev: &HipDevice, ptr: u64, dst: &mut [u32]) -> Result<()> {
        set_device(dev.ordinal)?;
        // SAFETY: the caller passes a device range of dst.len() words. The synchronous
        // copy runs on the null stream, which does not wait for the rank's
        // non-blocking stream; `dst` is written before the call returns.
        check(
            unsafe {
                ffi::hipMemcpyDtoH(
                    dst.as_mut_ptr().cast(),
                    ptr as *mut c_void,
                    std::mem::size_of_val(dst),
                )
            },
            "hipMemcpyDtoH",
        )
    }

    fn launch(
        dev: &HipDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: &AllReduceArgs,
    ) -> Result<()> {
        super::check_plain_kernel(Self::NAME, kernel)?;
        // SAFETY: every kernel but the batched all-reduce (refused above) takes one
        // `peercomm_allreduce_args` by value (the header both sides compile).
        unsafe { launch_by_value(dev, kernel, dims, args.group_width, args) }
    }

    fn launch_group(
        dev: &HipDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: &GroupArgs,
    ) -> Result<()> {
        super::check_group_kernel(Self::NAME, kernel, args)?;
        // SAFETY: the batched all-reduce kernels (checked above) take one
        // `peercomm_group_args` by value (the header both sides compile).
        unsafe { launch_by_value(dev, kernel, dims, args.all.group_width, args) }
    }

    fn synchronize(dev: &HipDevice) -> Result<()> {
        // SAFETY: the stream is live.
        check(
            unsafe { ffi::hipStreamSynchronize(dev.stream) },
            "hipStreamSynchronize",
        )
    }

    fn alloc_buffer<T: Element>(dev: &HipDevice, len: usize) -> Result<HipBuffer<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::Unsupported(format!("a buffer of {len} elements")))?;
        Ok(HipBuffer {
            mem: allocate(dev.ordinal, bytes, MemoryKind::Plain)?,
            len,
            _t: PhantomData,
        })
    }

    fn upload<T: Element>(dev: &HipDevice, src: &[T], dst: &mut HipBuffer<T>) -> Result<()> {
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
        set_device(dev.ordinal)?;
        // SAFETY: `dst` holds `len` elements of T; `src` stays borrowed until the stream
        // is synchronised below.
        check(
            unsafe {
                ffi::hipMemcpyHtoDAsync(
                    dst.mem.ptr as *mut c_void,
                    src.as_ptr().cast(),
                    std::mem::size_of_val(src),
                    dev.stream,
                )
            },
            "hipMemcpyHtoDAsync",
        )?;
        Self::synchronize(dev)
    }

    fn download<T: Element>(dev: &HipDevice, src: &HipBuffer<T>) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len];
        set_device(dev.ordinal)?;
        // SAFETY: `src` holds `len` elements of T; `out` has room for them and stays
        // borrowed until the stream is synchronised below.
        check(
            unsafe {
                ffi::hipMemcpyDtoHAsync(
                    out.as_mut_ptr().cast(),
                    src.mem.ptr as *mut c_void,
                    std::mem::size_of_val(out.as_slice()),
                    dev.stream,
                )
            },
            "hipMemcpyDtoHAsync",
        )?;
        Self::synchronize(dev)?;
        Ok(out)
    }
}

super::impl_typed_buffer!(Hip, HipBuffer);
