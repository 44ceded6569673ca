//! The HIP backend (feature `hip`): AMD GPUs through the HIP runtime (`libamdhip64`,
//! linked by `hip-sys`). Each [`HipDevice`] has its own non-blocking stream and the
//! embedded code object for its `gcnArchName` (another architecture is a typed error).
//! Signal memory is uncached, or fine-grained on HIP 5.x ([`HipAllocation`]). One
//! process reaches a peer's allocation at its own address ([`Backend::map_peer`]).
//!
//! # IPC
//! As CUDA's legacy IPC (the same record), closed after synchronising when the
//! [`HipPeerMapping`] drops; a same-process import is `Error::Unsupported`, and the
//! opened range is not checked against the handle's size.
//!
//! `ffi` declares the HIP functions with the status as a plain `i32` ([`HipStatus`]):
//! `hip-sys` makes `hipError_t` a Rust enum, so a code a newer ROCm adds would be UB.

use std::ffi::{c_int, c_void};
use std::marker::PhantomData;

use super::{Backend, ExportedRange, Kernel, LaunchDims, MemoryKind, WideArgs};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::signal::AllReduceArgs;

/// One HIP call (`unsafe`: the site's `// SAFETY:` note covers it), its status checked
/// and named after the function.
macro_rules! hip {
    ($f:ident($($a:expr),* $(,)?)) => {
        $crate::backend::hip::check(
            unsafe { $crate::backend::hip::ffi::$f($($a),*) },
            stringify!($f),
        )
    };
}

mod device;
mod ffi;
mod memory;
mod runtime;

use device::{copy, launch_by_value};
pub use device::{HipDevice, HipEvent};
pub use ffi::HipStatus;
use memory::*;
pub use memory::{HipAllocation, HipBuffer, HipMemory, HipPeerMapping};
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

    /// Devices visible to HIP; [`Error::NoDevice`] without a GPU or driver.
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
            other => Err(backend_err("hipGetDeviceCount", describe(other))),
        }
    }

    fn open(ordinal: usize) -> Result<HipDevice> {
        device::open(ordinal)
    }

    fn ordinal(dev: &HipDevice) -> usize {
        dev.ordinal
    }

    fn identity(dev: &HipDevice) -> Result<super::DeviceIdentity> {
        let uuid = device_uuid(dev.ordinal);
        let pci = pci_bus_id(dev.ordinal)?;
        Ok(super::DeviceIdentity::new(dev.ordinal, uuid, Some(&pci)))
    }

    fn multiprocessor_count(dev: &HipDevice) -> Result<usize> {
        Ok(dev.compute_units)
    }

    fn architecture(dev: &HipDevice) -> Result<String> {
        Ok(dev.processor.clone())
    }

    fn can_access_peer(dev: &HipDevice, peer: &HipDevice) -> Result<bool> {
        let (mut can, a, b) = (0, dev.ordinal as c_int, peer.ordinal as c_int);
        // SAFETY: `can` is a valid out pointer.
        hip!(hipDeviceCanAccessPeer(&mut can, a, b))?;
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
        set_device(mem.ordinal)?;
        let record = handle_record(mem.ptr, mem.bytes);
        record.map_err(|s| backend_err("hipIpcGetMemHandle", describe(s)))
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
        let (dst, value) = (ptr as *mut c_void, value as c_int);
        // SAFETY: a range of the caller's allocation, written in order on the device's stream.
        hip!(hipMemsetD32Async(dst, value, words, dev.stream))
    }

    fn memset_d16(dev: &HipDevice, ptr: u64, value: u16, halves: usize) -> Result<()> {
        set_device(dev.ordinal)?;
        // SAFETY: as for memset_d32.
        let dst = ptr as *mut c_void;
        hip!(hipMemsetD16Async(dst, value, halves, dev.stream))
    }

    fn read(dev: &HipDevice, ptr: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: the caller passes a device range of dst.len() bytes.
        unsafe { copy(dev, ptr, dst.as_mut_ptr().cast(), dst.len(), true) }
    }

    fn write(dev: &HipDevice, ptr: u64, src: &[u8]) -> Result<()> {
        // SAFETY: the caller passes a device range of src.len() bytes.
        unsafe { copy(dev, ptr, src.as_ptr().cast_mut().cast(), src.len(), false) }
    }

    fn read_words_now(dev: &HipDevice, ptr: u64, dst: &mut [u32]) -> Result<()> {
        set_device(dev.ordinal)?;
        let (host, n) = (dst.as_mut_ptr().cast(), std::mem::size_of_val(dst));
        // SAFETY: a device range of dst.len() words; this synchronous copy (null stream: it
        // does not wait for the rank's stream) writes `dst` before returning.
        hip!(hipMemcpyDtoH(host, ptr as *mut c_void, n))
    }

    fn launch(
        dev: &HipDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: &AllReduceArgs,
    ) -> Result<()> {
        super::check_kernel(Self::NAME, kernel, None)?;
        // SAFETY: the other kernels (checked above) take one `peercomm_allreduce_args` by value.
        unsafe { launch_by_value(dev, kernel, dims, args.group_width, args) }
    }

    fn launch_wide(
        dev: &HipDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: WideArgs<'_>,
    ) -> Result<()> {
        super::check_kernel(Self::NAME, kernel, Some(args))?;
        let width = args.all().group_width;
        // SAFETY: the batched kernels and the exchange (checked above) take one
        // `peercomm_group_args` or `peercomm_exchange_args` by value.
        match args {
            WideArgs::Group(g) => unsafe { launch_by_value(dev, kernel, dims, width, g) },
            WideArgs::Exchange(x) => unsafe { launch_by_value(dev, kernel, dims, width, x) },
        }
    }

    fn synchronize(dev: &HipDevice) -> Result<()> {
        // SAFETY: the stream is live.
        hip!(hipStreamSynchronize(dev.stream))
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
        let (n, len) = (src.len(), dst.len);
        if n != len {
            let what = format!("upload of {n} elements into a buffer of {len}");
            return Err(Error::LengthMismatch {
                rank: dev.ordinal,
                what,
            });
        }
        let (bytes, host) = (std::mem::size_of_val(src), src.as_ptr().cast_mut().cast());
        // SAFETY: `dst` holds `len` elements of T, as many as `src`.
        unsafe { copy(dev, dst.mem.ptr, host, bytes, false) }
    }

    fn download<T: Element>(dev: &HipDevice, src: &HipBuffer<T>) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len];
        // SAFETY: `src` holds `len` elements of T; `out` has room for them.
        unsafe {
            let bytes = std::mem::size_of_val(out.as_slice());
            copy(dev, src.mem.ptr, out.as_mut_ptr().cast(), bytes, true)
        }?;
        Ok(out)
    }
}

super::impl_typed_buffer!(Hip, HipBuffer);
