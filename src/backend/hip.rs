//! The HIP backend (feature `hip`): AMD Instinct GPUs through the HIP runtime
//! (`libamdhip64`, linked by the `hip-sys` crate).
//!
//! - Devices: one [`HipDevice`] per GPU with its own non-blocking stream and the
//!   embedded code object for its `gcnArchName` (gfx90a, gfx942, gfx950 where the
//!   compiler knew it; another is a typed error), launched with `hipModuleLaunchKernel`.
//! - Signal memory (`MemoryKind::Signal`) is uncached device memory, or fine-grained
//!   on HIP 5.x ([`HipAllocation`]): spins see peers' stores, and the kernels'
//!   system-scope release/acquire order the rest.
//! - One process: peer access between every pair and unified addresses, so a peer's
//!   allocation is reached at its own address ([`Backend::map_peer`]).
//!
//! # IPC
//! As CUDA's legacy IPC: `hipIpcGetMemHandle`, `hipIpcOpenMemHandle` with
//! `hipIpcMemLazyEnablePeerAccess` (1 on ROCm 6 and 7, 0 in HIP 5 headers: an import
//! answered `hipErrorInvalidValue` is retried once with 0), `hipIpcCloseMemHandle` after
//! synchronising on drop of the [`HipPeerMapping`]. One host only; whether the importer
//! must see the exporting GPU is undocumented, so isolated processes may fall back to
//! the external library. Ranks are told apart by [`Backend::identity`]. A same-process
//! import is `Error::Unsupported` (by process token). The opened range is not checked
//! against the handle's size (untested on AMD hardware, docs/amd.md: less code).
//! Import each handle once per process and share the mapping.
//!
//! The handle, 88 bytes LE: magic `pchi`, version `u32` = 1, the exporter's random
//! token `u64`, the allocation's size `u64`, the 64-byte `hipIpcMemHandle_t`.
//!
//! # Why the HIP functions are declared here
//! `hip-sys` 0.1.2's bindings (HIP 5.4) make `hipError_t` a Rust enum, so a code a newer
//! ROCm adds would be undefined behaviour. This module declares the few functions it
//! needs with the status as a plain `i32` ([`HipStatus`]), taking only opaque handle
//! types and the link from `hip-sys`; each has the same C signature in HIP 5.2 to 7.x.
//! The device properties changed layout in ROCm 6, so the architecture name is read
//! through whichever versioned entry point the runtime exports (`gcn_arch_name`).

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
use device::{dtoh, htod};
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

impl super::sealed::Sealed for Hip {}

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
        // One process, unified addresses, peer access on: valid here as it is.
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
        // SAFETY: the caller passes a device range of dst.len() bytes.
        unsafe { dtoh(dev, dst.as_mut_ptr().cast(), ptr, dst.len()) }
    }

    fn write(dev: &HipDevice, ptr: u64, src: &[u8]) -> Result<()> {
        // SAFETY: the caller passes a device range of src.len() bytes.
        unsafe { htod(dev, ptr, src.as_ptr().cast(), src.len()) }
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
        let bytes = std::mem::size_of_val(src);
        // SAFETY: `dst` holds `len` elements of T, as many as `src`.
        unsafe { htod(dev, dst.mem.ptr, src.as_ptr().cast(), bytes) }
    }

    fn download<T: Element>(dev: &HipDevice, src: &HipBuffer<T>) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len];
        // SAFETY: `src` holds `len` elements of T; `out` has room for them.
        unsafe {
            dtoh(
                dev,
                out.as_mut_ptr().cast(),
                src.mem.ptr,
                std::mem::size_of_val(out.as_slice()),
            )
        }?;
        Ok(out)
    }
}

super::impl_typed_buffer!(Hip, HipBuffer);
