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

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::marker::PhantomData;
use std::ptr::null_mut;
use std::sync::Mutex;

use hip_sys::hiprt::{hipEvent_t, hipFunction_t, hipModule_t, hipStream_t};

use super::handle::{import_error, process_token, Reader, Writer};
use super::{Backend, DeviceBuffer, DeviceBufferMut, Kernel, LaunchDims, MemoryKind};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::signal::{AllReduceArgs, GroupArgs, MAX_NUM_BLOCKS_UPPER_BOUND};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/hip_code_objects.rs"));
}

/// A HIP status code, read as the plain integer the C ABI returns.
pub type HipStatus = i32;

/// Raw declarations of the HIP runtime functions this backend calls.
mod ffi {
    use super::*;

    pub const SUCCESS: HipStatus = 0;
    pub const ERROR_INVALID_VALUE: HipStatus = 1;
    pub const ERROR_NOT_INITIALIZED: HipStatus = 3;
    pub const ERROR_INSUFFICIENT_DRIVER: HipStatus = 35;
    pub const ERROR_NO_DEVICE: HipStatus = 100;
    pub const ERROR_PEER_ACCESS_ALREADY_ENABLED: HipStatus = 704;

    /// `hipStreamNonBlocking`.
    pub const STREAM_NON_BLOCKING: c_uint = 0x1;
    /// `hipEventDisableTiming`.
    pub const EVENT_DISABLE_TIMING: c_uint = 0x2;
    /// `hipDeviceMallocFinegrained`.
    pub const MALLOC_FINE_GRAINED: c_uint = 0x1;
    /// `hipDeviceMallocUncached` (ROCm 5.5+; absent from the HIP 5.2 headers).
    pub const MALLOC_UNCACHED: c_uint = 0x3;
    /// `hipIpcMemLazyEnablePeerAccess` as ROCm 6 and 7 define it (and CUDA).
    pub const IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 0x1;
    /// `hipIpcMemLazyEnablePeerAccess` as the HIP 5.x headers define it.
    pub const IPC_MEM_LAZY_ENABLE_PEER_ACCESS_HIP5: c_uint = 0x0;
    /// `HIP_IPC_HANDLE_SIZE`.
    pub const IPC_HANDLE_SIZE: usize = 64;

    /// `hipIpcMemHandle_t`: opaque bytes, passed by value.
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct IpcMemHandle {
        pub reserved: [c_char; IPC_HANDLE_SIZE],
    }

    /// `hipDeviceAttributeMultiprocessorCount` (63 in HIP 5.x, 6.x and 7.x).
    pub const ATTR_MULTIPROCESSOR_COUNT: c_int = 63;
    /// `hipDeviceAttributeWallClockRate` in kHz (ROCm 6+; 10017 there).
    pub const ATTR_WALL_CLOCK_RATE: c_int = 10017;

    #[link(name = "amdhip64")]
    extern "C" {
        pub fn hipGetDeviceCount(count: *mut c_int) -> HipStatus;
        pub fn hipSetDevice(device: c_int) -> HipStatus;
        pub fn hipDeviceSynchronize() -> HipStatus;
        pub fn hipDeviceGetAttribute(value: *mut c_int, attr: c_int, device: c_int) -> HipStatus;
        pub fn hipRuntimeGetVersion(version: *mut c_int) -> HipStatus;
        pub fn hipGetErrorName(status: HipStatus) -> *const c_char;
        pub fn hipGetErrorString(status: HipStatus) -> *const c_char;
        pub fn hipDeviceCanAccessPeer(can: *mut c_int, device: c_int, peer: c_int) -> HipStatus;
        pub fn hipDeviceGetPCIBusId(bus_id: *mut c_char, len: c_int, device: c_int) -> HipStatus;
        pub fn hipDeviceEnablePeerAccess(peer: c_int, flags: c_uint) -> HipStatus;
        pub fn hipMalloc(ptr: *mut *mut c_void, bytes: usize) -> HipStatus;
        pub fn hipExtMallocWithFlags(
            ptr: *mut *mut c_void,
            bytes: usize,
            flags: c_uint,
        ) -> HipStatus;
        pub fn hipFree(ptr: *mut c_void) -> HipStatus;
        pub fn hipIpcGetMemHandle(handle: *mut IpcMemHandle, ptr: *mut c_void) -> HipStatus;
        pub fn hipIpcOpenMemHandle(
            ptr: *mut *mut c_void,
            handle: IpcMemHandle,
            flags: c_uint,
        ) -> HipStatus;
        pub fn hipIpcCloseMemHandle(ptr: *mut c_void) -> HipStatus;
        pub fn hipStreamCreateWithFlags(stream: *mut hipStream_t, flags: c_uint) -> HipStatus;
        pub fn hipStreamDestroy(stream: hipStream_t) -> HipStatus;
        pub fn hipStreamSynchronize(stream: hipStream_t) -> HipStatus;
        pub fn hipStreamWaitEvent(
            stream: hipStream_t,
            event: hipEvent_t,
            flags: c_uint,
        ) -> HipStatus;
        pub fn hipEventCreateWithFlags(event: *mut hipEvent_t, flags: c_uint) -> HipStatus;
        pub fn hipEventRecord(event: hipEvent_t, stream: hipStream_t) -> HipStatus;
        pub fn hipEventSynchronize(event: hipEvent_t) -> HipStatus;
        pub fn hipEventDestroy(event: hipEvent_t) -> HipStatus;
        pub fn hipMemsetD16Async(
            dst: *mut c_void,
            value: u16,
            count: usize,
            stream: hipStream_t,
        ) -> HipStatus;
        pub fn hipMemsetD32Async(
            dst: *mut c_void,
            value: c_int,
            count: usize,
            stream: hipStream_t,
        ) -> HipStatus;
        pub fn hipMemcpyHtoDAsync(
            dst: *mut c_void,
            src: *const c_void,
            bytes: usize,
            stream: hipStream_t,
        ) -> HipStatus;
        pub fn hipMemcpyDtoHAsync(
            dst: *mut c_void,
            src: *mut c_void,
            bytes: usize,
            stream: hipStream_t,
        ) -> HipStatus;
        pub fn hipMemcpyDtoH(dst: *mut c_void, src: *mut c_void, bytes: usize) -> HipStatus;
        pub fn hipModuleLoadData(module: *mut hipModule_t, image: *const c_void) -> HipStatus;
        pub fn hipModuleUnload(module: hipModule_t) -> HipStatus;
        pub fn hipModuleGetFunction(
            function: *mut hipFunction_t,
            module: hipModule_t,
            name: *const c_char,
        ) -> HipStatus;
        pub fn hipModuleGetGlobal(
            ptr: *mut *mut c_void,
            bytes: *mut usize,
            module: hipModule_t,
            name: *const c_char,
        ) -> HipStatus;
        #[allow(clippy::too_many_arguments)]
        pub fn hipModuleLaunchKernel(
            function: hipFunction_t,
            grid_x: c_uint,
            grid_y: c_uint,
            grid_z: c_uint,
            block_x: c_uint,
            block_y: c_uint,
            block_z: c_uint,
            shared_bytes: c_uint,
            stream: hipStream_t,
            params: *mut *mut c_void,
            extra: *mut *mut c_void,
        ) -> HipStatus;
    }

    // The dynamic linker: finds the versioned device-properties entry points of
    // whichever libamdhip64 is loaded (glibc exports dlsym from libc.so.6, and Rust's
    // std links libdl on older glibc).
    extern "C" {
        pub fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    }
    /// glibc's `RTLD_DEFAULT`: search the global scope.
    pub const RTLD_DEFAULT: *mut c_void = std::ptr::null_mut();
}

/// Name and message of a status, for any value (the runtime answers unknown codes
/// with its "unknown error" strings).
fn describe(status: HipStatus) -> String {
    // SAFETY: both functions accept any integer and return a pointer to a static
    // NUL-terminated string (or null, handled).
    let (name, text) = unsafe { (ffi::hipGetErrorName(status), ffi::hipGetErrorString(status)) };
    let read = |p: *const c_char| {
        if p.is_null() {
            "?".to_string()
        } else {
            // SAFETY: non-null pointers from the runtime point at static C strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let (name, text) = (read(name), read(text));
    if name == text {
        // HIP 5.x answers both with the name.
        format!("{name} ({status})")
    } else {
        format!("{name} ({status}): {text}")
    }
}

fn check(status: HipStatus, call: &'static str) -> Result<()> {
    if status == ffi::SUCCESS {
        Ok(())
    } else {
        Err(Error::Backend {
            backend: Hip::NAME,
            call,
            detail: describe(status),
        })
    }
}

pub(crate) fn set_device(ordinal: usize) -> Result<()> {
    // SAFETY: plain value argument; an invalid ordinal is reported as a status.
    check(
        unsafe { ffi::hipSetDevice(ordinal as c_int) },
        "hipSetDevice",
    )
}

fn attribute(ordinal: usize, attr: c_int) -> std::result::Result<c_int, HipStatus> {
    let mut value: c_int = 0;
    // SAFETY: `value` is a valid out pointer for the duration of the call.
    let status = unsafe { ffi::hipDeviceGetAttribute(&mut value, attr, ordinal as c_int) };
    if status == ffi::SUCCESS {
        Ok(value)
    } else {
        Err(status)
    }
}

/// Signature shared by `hipGetDeviceProperties`, `...R0000` and `...R0600`.
type GetDeviceProperties = unsafe extern "C" fn(*mut c_void, c_int) -> HipStatus;

/// Signature of `hipDeviceGetUuid` (`hipError_t (hipUUID*, hipDevice_t)`; `hipUUID` is
/// 16 bytes, `hipDevice_t` an `int`).
type GetUuid = unsafe extern "C" fn(*mut [c_char; 16], c_int) -> HipStatus;

/// The device's UUID, where the runtime exports `hipDeviceGetUuid` (looked up at run
/// time, as it is absent from older runtimes) and answers it; `None` otherwise, and the
/// PCI bus id tells devices apart.
fn device_uuid(ordinal: usize) -> Option<[u8; 16]> {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads.
    let f = unsafe { ffi::dlsym(ffi::RTLD_DEFAULT, c"hipDeviceGetUuid".as_ptr()) };
    if f.is_null() {
        return None;
    }
    // SAFETY: the symbol is HIP's hipDeviceGetUuid, whose C signature is `GetUuid`.
    let f: GetUuid = unsafe { std::mem::transmute(f) };
    let mut uuid: [c_char; 16] = [0; 16];
    // SAFETY: `uuid` is a writable 16-byte out pointer for the duration of the call.
    let status = unsafe { f(&mut uuid, ordinal as c_int) };
    (status == ffi::SUCCESS).then(|| uuid.map(|b| b as u8))
}

/// The device's PCI bus id as the runtime writes it (`0000:19:00.0`).
fn pci_bus_id(ordinal: usize) -> Result<String> {
    let mut text: [c_char; 64] = [0; 64];
    // SAFETY: `text` is writable for the length passed; the runtime NUL-terminates
    // what it writes within it.
    check(
        unsafe { ffi::hipDeviceGetPCIBusId(text.as_mut_ptr(), 64, ordinal as c_int) },
        "hipDeviceGetPCIBusId",
    )?;
    text[63] = 0;
    // SAFETY: NUL-terminated within the buffer (the last byte was just set to 0).
    Ok(unsafe { CStr::from_ptr(text.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// The device's `gcnArchName` (e.g. `gfx942:sramecc+:xnack-`).
///
/// `hipDeviceProp_t` was rearranged in ROCm 6: `hipGetDevicePropertiesR0600` fills
/// the new layout (name at byte 1160), while `hipGetDevicePropertiesR0000` and the
/// unversioned `hipGetDeviceProperties` symbol of the shared library fill the HIP 5
/// layout (name at byte 396). The entry points are looked up at run time, newest
/// first, and filled into a buffer larger than either layout, so neither a ROCm 5 nor
/// a ROCm 7 runtime can write past it.
fn gcn_arch_name(ordinal: usize) -> Result<String> {
    const CANDIDATES: [(&CStr, usize); 3] = [
        (c"hipGetDevicePropertiesR0600", 1160),
        (c"hipGetDevicePropertiesR0000", 396),
        (c"hipGetDeviceProperties", 396),
    ];
    let mut last = String::from("the HIP runtime exports no hipGetDeviceProperties* function");
    for (symbol, offset) in CANDIDATES {
        // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads.
        let f = unsafe { ffi::dlsym(ffi::RTLD_DEFAULT, symbol.as_ptr()) };
        if f.is_null() {
            continue;
        }
        // SAFETY: the symbol is one of HIP's device-properties functions, all of which
        // have the C signature `hipError_t (void* props, int device)`.
        let f: GetDeviceProperties = unsafe { std::mem::transmute(f) };
        // 8 KiB, 8-byte aligned: larger than every hipDeviceProp_t layout (about 1.5 KiB).
        let mut props = vec![0u64; 1024];
        // SAFETY: `props` is writable, aligned and larger than the structure written.
        let status = unsafe { f(props.as_mut_ptr().cast(), ordinal as c_int) };
        if status != ffi::SUCCESS {
            last = format!("{}: {}", symbol.to_string_lossy(), describe(status));
            continue;
        }
        // SAFETY: the buffer holds 8192 initialised bytes.
        let bytes: &[u8] = unsafe { std::slice::from_raw_parts(props.as_ptr().cast(), 8192) };
        let field = &bytes[offset..offset + 256];
        let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
        let name = String::from_utf8_lossy(&field[..end]).into_owned();
        if name.starts_with("gfx") {
            return Ok(name);
        }
        last = format!(
            "{} returned no gfx architecture name (read {name:?})",
            symbol.to_string_lossy()
        );
    }
    Err(Error::Backend {
        backend: Hip::NAME,
        call: "hipGetDeviceProperties",
        detail: last,
    })
}

/// A code object embedded in this build.
#[derive(Clone, Copy, Debug)]
pub struct EmbeddedCodeObject {
    /// Target id it was compiled for (`gfx90a`, `gfx942`, ...).
    pub target: &'static str,
    /// The compiler that built it (path and how it was found).
    pub compiler: &'static str,
    /// The ELF code object (what `hipModuleLoadData` takes).
    pub bytes: &'static [u8],
}

/// The code objects embedded at build time, one per architecture.
pub fn embedded_code_objects() -> impl Iterator<Item = EmbeddedCodeObject> {
    embedded::CODE_OBJECTS
        .iter()
        .map(|&(target, compiler, bytes)| EmbeddedCodeObject {
            target,
            compiler,
            bytes,
        })
}

/// Default architectures that were not built because no compiler at hand supported
/// them, with the compiler's reason.
pub fn skipped_architectures() -> &'static [(&'static str, &'static str)] {
    embedded::SKIPPED_ARCHS
}

/// The embedded code object for a device reporting `gcn_arch_name`: same processor,
/// and every target feature the code object was built with (`:xnack+` ...) present in
/// the device's name. Code objects built without features run in either mode.
fn code_object_for(gcn_arch_name: &str) -> Option<EmbeddedCodeObject> {
    let mut device = gcn_arch_name.split(':');
    let processor = device.next().unwrap_or("");
    let device_features: Vec<&str> = device.collect();
    embedded_code_objects().find(|co| {
        let mut target = co.target.split(':');
        target.next() == Some(processor) && target.all(|f| device_features.contains(&f))
    })
}

/// Version of the HIP runtime that is loaded (e.g. 60443483 for 6.4).
pub fn runtime_version() -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out pointer.
    check(
        unsafe { ffi::hipRuntimeGetVersion(&mut v) },
        "hipRuntimeGetVersion",
    )?;
    Ok(v)
}

/// The HIP backend (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct Hip;

/// One AMD GPU: its stream, its loaded kernels and what the runtime reports about it.
pub struct HipDevice {
    ordinal: usize,
    stream: hipStream_t,
    module: hipModule_t,
    /// Every kernel of [`Kernel::all`], resolved when the device is opened.
    functions: Vec<(Kernel, hipFunction_t)>,
    /// Other entry points (e.g. the flag ping-pong), resolved by symbol on first use.
    extra_functions: Mutex<Vec<(String, hipFunction_t)>>,
    gcn_arch_name: String,
    processor: String,
    code_object: EmbeddedCodeObject,
    compute_units: usize,
    wall_clock_khz: Option<u32>,
}

impl super::IntoDevice for HipDevice {
    type Backend = Hip;
    fn into_device(self) -> Result<HipDevice> {
        Ok(self)
    }
}

// SAFETY: the handles are owned by this value; HIP streams, modules and functions may be
// used from any host thread (the runtime synchronises internally), and every call sets
// the calling thread's current device first where HIP needs one.
unsafe impl Send for HipDevice {}
// SAFETY: as above; `&HipDevice` only enqueues work on the stream, which HIP allows
// from several threads at once.
unsafe impl Sync for HipDevice {}

impl std::fmt::Debug for HipDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipDevice")
            .field("ordinal", &self.ordinal)
            .field("gcn_arch_name", &self.gcn_arch_name)
            .field("code_object", &self.code_object.target)
            .field("compute_units", &self.compute_units)
            .finish()
    }
}

impl HipDevice {
    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    /// The full architecture name the runtime reports (e.g. `gfx942:sramecc+:xnack-`).
    pub fn gcn_arch_name(&self) -> &str {
        &self.gcn_arch_name
    }
    /// The target id of the embedded code object loaded on this device.
    pub fn code_object_target(&self) -> &'static str {
        self.code_object.target
    }
    /// Rate of the wall clock the kernels time barriers with, when the runtime
    /// reports it (ROCm 6+); otherwise the kernels assume 100 MHz.
    pub fn wall_clock_khz(&self) -> Option<u32> {
        self.wall_clock_khz
    }
    /// The raw `hipStream_t` collectives run on, for interoperation (e.g. to make
    /// another stream wait on it with the HIP API).
    pub fn stream_handle(&self) -> *mut c_void {
        self.stream.cast()
    }
    /// Records an event on this device's stream: it completes when everything
    /// enqueued so far (collectives included) has.
    pub fn record_event(&self) -> Result<HipEvent> {
        set_device(self.ordinal)?;
        let mut event: hipEvent_t = null_mut();
        // SAFETY: `event` is a valid out pointer.
        check(
            unsafe { ffi::hipEventCreateWithFlags(&mut event, ffi::EVENT_DISABLE_TIMING) },
            "hipEventCreateWithFlags",
        )?;
        let event = HipEvent { event };
        // SAFETY: both handles are live.
        check(
            unsafe { ffi::hipEventRecord(event.event, self.stream) },
            "hipEventRecord",
        )?;
        Ok(event)
    }
    /// Makes this device's stream wait (on the device, without blocking the host) until
    /// `event` has completed: how a producer stream's tensor is handed to a collective.
    pub fn wait_event(&self, event: &HipEvent) -> Result<()> {
        // SAFETY: both handles are live.
        check(
            unsafe { ffi::hipStreamWaitEvent(self.stream, event.event, 0) },
            "hipStreamWaitEvent",
        )
    }

    /// The loaded entry point of `kernel`.
    fn function(&self, kernel: Kernel) -> Result<hipFunction_t> {
        if let Some(&(_, f)) = self.functions.iter().find(|(k, _)| *k == kernel) {
            return Ok(f);
        }
        let symbol = kernel.symbol();
        let mut extra = self
            .extra_functions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(&(_, f)) = extra.iter().find(|(s, _)| *s == symbol) {
            return Ok(f);
        }
        let f = module_function(self.module, &symbol)?;
        extra.push((symbol, f));
        Ok(f)
    }
}

impl Drop for HipDevice {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; the handles are released regardless.
        let _ = set_device(self.ordinal);
        // SAFETY: the stream and module are owned by this value and not used again.
        unsafe {
            ffi::hipStreamSynchronize(self.stream);
            ffi::hipStreamDestroy(self.stream);
            ffi::hipModuleUnload(self.module);
        }
    }
}

/// A HIP event (timing disabled) recorded by [`HipDevice::record_event`].
pub struct HipEvent {
    event: hipEvent_t,
}

// SAFETY: HIP events may be recorded, waited on and destroyed from any thread.
unsafe impl Send for HipEvent {}
// SAFETY: as above; `&HipEvent` only waits on the event.
unsafe impl Sync for HipEvent {}

impl HipEvent {
    /// Blocks the host until the event has completed.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is live.
        check(
            unsafe { ffi::hipEventSynchronize(self.event) },
            "hipEventSynchronize",
        )
    }
}

impl Drop for HipEvent {
    fn drop(&mut self) {
        // SAFETY: owned by this value; HIP defers the release until the event completes.
        unsafe { ffi::hipEventDestroy(self.event) };
    }
}

/// How an allocation was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HipAllocation {
    /// `hipMalloc`: coarse-grained device memory (data buffers).
    CoarseGrained,
    /// `hipExtMallocWithFlags(hipDeviceMallocUncached)`: not cached, coherent with the
    /// peers at every access (signal memory).
    Uncached,
    /// `hipExtMallocWithFlags(hipDeviceMallocFinegrained)`: the fallback for signal
    /// memory where the runtime rejects the uncached flag.
    FineGrained,
}

/// An owned device allocation.
pub struct HipMemory {
    ptr: u64,
    bytes: usize,
    ordinal: usize,
    allocation: HipAllocation,
}

impl std::fmt::Debug for HipMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipMemory")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .field("ordinal", &self.ordinal)
            .field("allocation", &self.allocation)
            .finish()
    }
}

impl HipMemory {
    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// How it was allocated.
    pub fn allocation(&self) -> HipAllocation {
        self.allocation
    }
    /// Ordinal of the device holding it.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl Drop for HipMemory {
    fn drop(&mut self) {
        // SAFETY: allocated by this backend and owned by this value; hipFree waits for
        // the device work that may still use it.
        unsafe { ffi::hipFree(self.ptr as *mut c_void) };
    }
}

/// Magic of a HIP IPC handle.
const IPC_MAGIC: &[u8; 4] = b"pchi";
/// Version of the HIP IPC handle layout.
const IPC_VERSION: u32 = 1;
/// Bytes of a HIP IPC handle: header 8, exporter's process token 8, size 8,
/// `hipIpcMemHandle_t` 64.
const IPC_HANDLE_BYTES: usize = 88;

/// Another process's allocation mapped into this one with `hipIpcOpenMemHandle`
/// ([`Backend::import_memory`]). Dropping it synchronises the importing device (kernels
/// there may still use the memory) and closes the mapping with `hipIpcCloseMemHandle`;
/// errors are ignored there, never panicked on.
pub struct HipPeerMapping {
    ptr: u64,
    bytes: usize,
    ordinal: usize,
}

impl HipPeerMapping {
    /// Bytes of the exported allocation.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Ordinal of the importing device.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl std::fmt::Debug for HipPeerMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipPeerMapping")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl Drop for HipPeerMapping {
    fn drop(&mut self) {
        // Work that may still use the mapping must finish first. Errors cannot be
        // reported from drop.
        let _ = set_device(self.ordinal);
        // SAFETY: `ptr` came from hipIpcOpenMemHandle on this device and is closed once
        // (drop), after the device's work.
        unsafe {
            ffi::hipDeviceSynchronize();
            ffi::hipIpcCloseMemHandle(self.ptr as *mut c_void);
        }
    }
}

/// A typed device buffer on one AMD GPU.
pub struct HipBuffer<T: Element> {
    mem: HipMemory,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> std::fmt::Debug for HipBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipBuffer")
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .field("mem", &self.mem)
            .finish()
    }
}

impl<T: Element> HipBuffer<T> {
    /// Device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.mem.ptr
    }
}

// SAFETY: the pointer, length, dtype and device come from the allocation itself.

unsafe impl<T: Element> DeviceBuffer<Hip> for HipBuffer<T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_ordinal(&self) -> usize {
        self.mem.ordinal
    }
    fn read_ptr<'a>(&'a self, _dev: &'a HipDevice) -> (u64, ()) {
        (self.mem.ptr, ())
    }
}

// SAFETY: the pointer, length, dtype and device come from the allocation itself.

unsafe impl<T: Element> DeviceBufferMut<Hip> for HipBuffer<T> {
    fn write_ptr<'a>(&'a mut self, _dev: &'a HipDevice) -> (u64, ()) {
        (self.mem.ptr, ())
    }
}

/// Resolves an entry point of a loaded module by its exported name.
fn module_function(module: hipModule_t, symbol: &str) -> Result<hipFunction_t> {
    let name =
        CString::new(symbol).map_err(|_| Error::Unsupported(format!("kernel {symbol:?}")))?;
    let mut f: hipFunction_t = null_mut();
    // SAFETY: valid out pointer, live module, NUL-terminated name.
    let status = unsafe { ffi::hipModuleGetFunction(&mut f, module, name.as_ptr()) };
    if status != ffi::SUCCESS {
        return Err(Error::Backend {
            backend: Hip::NAME,
            call: "hipModuleGetFunction",
            detail: format!("{symbol}: {}", describe(status)),
        });
    }
    Ok(f)
}

fn allocate(ordinal: usize, bytes: usize, kind: MemoryKind) -> Result<HipMemory> {
    set_device(ordinal)?;
    let bytes = bytes.max(1);
    let mut ptr: *mut c_void = null_mut();
    let allocation = match kind {
        MemoryKind::Plain => {
            // SAFETY: `ptr` is a valid out pointer.
            check(unsafe { ffi::hipMalloc(&mut ptr, bytes) }, "hipMalloc")?;
            HipAllocation::CoarseGrained
        }
        MemoryKind::Signal | MemoryKind::SharedSignal => {
            // SAFETY: `ptr` is a valid out pointer.
            let uncached =
                unsafe { ffi::hipExtMallocWithFlags(&mut ptr, bytes, ffi::MALLOC_UNCACHED) };
            if uncached == ffi::SUCCESS {
                HipAllocation::Uncached
            } else {
                ptr = null_mut();
                // SAFETY: as above.
                let fine = unsafe {
                    ffi::hipExtMallocWithFlags(&mut ptr, bytes, ffi::MALLOC_FINE_GRAINED)
                };
                if fine != ffi::SUCCESS {
                    return Err(Error::Backend {
                        backend: Hip::NAME,
                        call: "hipExtMallocWithFlags",
                        detail: format!(
                            "{bytes} bytes of signal memory on device {ordinal}: uncached: {}; \
                             fine-grained: {}",
                            describe(uncached),
                            describe(fine)
                        ),
                    });
                }
                HipAllocation::FineGrained
            }
        }
    };
    Ok(HipMemory {
        ptr: ptr as u64,
        bytes,
        ordinal,
        allocation,
    })
}

/// Launches `kernel` on `dev`'s stream with `args` as its one by-value parameter, after
/// checking the grid (`group_width`: the threads of a block's first wavefront that do
/// the barrier's counter work must exist).
///
/// # Safety
/// `A` must be the kernel's parameter type (`peercomm_allreduce_args` or
/// `peercomm_group_args`), built from live allocations of the documented layout.
unsafe fn launch_by_value<A: Copy>(
    dev: &HipDevice,
    kernel: Kernel,
    dims: LaunchDims,
    group_width: u32,
    args: &A,
) -> Result<()> {
    if dims.blocks == 0
        || dims.blocks as usize > MAX_NUM_BLOCKS_UPPER_BOUND
        || dims.threads == 0
        || dims.threads > 1024
        || group_width > dims.threads
    {
        return Err(Error::Unsupported(format!(
            "HIP launch of {} with {} blocks of {} threads: blocks must be in 1..={}, threads \
             in 1..=1024 and at least the group width",
            kernel.symbol(),
            dims.blocks,
            dims.threads,
            MAX_NUM_BLOCKS_UPPER_BOUND
        )));
    }
    let function = dev.function(kernel)?;
    set_device(dev.ordinal)?;
    // The kernels take the argument struct by value; HIP copies it at launch.
    let mut by_value = *args;
    let mut params = [(&mut by_value as *mut A).cast::<c_void>()];
    // SAFETY: the function belongs to the device's loaded module, its one parameter is
    // an `A` by value (the caller's contract), and `params` points at a live copy of it
    // for the duration of the call.
    check(
        unsafe {
            ffi::hipModuleLaunchKernel(
                function,
                dims.blocks,
                1,
                1,
                dims.threads,
                1,
                1,
                0,
                dev.stream,
                params.as_mut_ptr(),
                null_mut(),
            )
        },
        "hipModuleLaunchKernel",
    )
}

impl Backend for Hip {
    const NAME: &'static str = "hip";
    type Device = HipDevice;
    type Memory = HipMemory;
    type Access<'a> = ();
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
        let count = Self::device_count()?;
        if count == 0 {
            return Err(Error::NoDevice {
                backend: Hip::NAME,
                detail: "hipGetDeviceCount reported 0 devices".into(),
            });
        }
        if ordinal >= count {
            return Err(Error::InvalidDevices(format!(
                "HIP device {ordinal} does not exist ({count} visible)"
            )));
        }
        set_device(ordinal)?;
        let gcn_arch_name = gcn_arch_name(ordinal)?;
        let processor = gcn_arch_name.split(':').next().unwrap_or("").to_string();
        let code_object = code_object_for(&gcn_arch_name).ok_or_else(|| {
            let built: Vec<&str> = embedded_code_objects().map(|c| c.target).collect();
            let skipped: Vec<String> = skipped_architectures()
                .iter()
                .map(|(a, why)| format!("{a} ({why})"))
                .collect();
            Error::Unsupported(format!(
                "HIP device {ordinal} is {gcn_arch_name}, and this build of peercomm embeds code \
                 objects for {built:?} only{}; rebuild with PEERCOMM_HIP_ARCHS={processor} \
                 (see docs/amd.md)",
                if skipped.is_empty() {
                    String::new()
                } else {
                    format!(" (not built: {})", skipped.join(", "))
                }
            ))
        })?;
        let compute_units = attribute(ordinal, ffi::ATTR_MULTIPROCESSOR_COUNT)
            .map_err(|s| Error::Backend {
                backend: Hip::NAME,
                call: "hipDeviceGetAttribute(MultiprocessorCount)",
                detail: describe(s),
            })?
            .max(1) as usize;

        let mut stream: hipStream_t = null_mut();
        // SAFETY: `stream` is a valid out pointer.
        check(
            unsafe { ffi::hipStreamCreateWithFlags(&mut stream, ffi::STREAM_NON_BLOCKING) },
            "hipStreamCreateWithFlags",
        )?;
        // The ELF reader wants an aligned image; embedded bytes are only 1-aligned.
        let mut image = vec![0u64; code_object.bytes.len().div_ceil(8)];
        // SAFETY: `image` has room for all the bytes; the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                code_object.bytes.as_ptr(),
                image.as_mut_ptr().cast::<u8>(),
                code_object.bytes.len(),
            )
        };
        let mut module: hipModule_t = null_mut();
        // SAFETY: `module` is a valid out pointer and `image` a complete code object
        // that outlives the call (HIP copies it).
        let loaded = unsafe { ffi::hipModuleLoadData(&mut module, image.as_ptr().cast()) };
        if loaded != ffi::SUCCESS {
            // SAFETY: created above, unused.
            unsafe { ffi::hipStreamDestroy(stream) };
            return Err(Error::Backend {
                backend: Hip::NAME,
                call: "hipModuleLoadData",
                detail: format!(
                    "the {} code object on {gcn_arch_name}: {}",
                    code_object.target,
                    describe(loaded)
                ),
            });
        }
        let mut device = HipDevice {
            ordinal,
            stream,
            module,
            functions: Vec::new(),
            extra_functions: Mutex::new(Vec::new()),
            gcn_arch_name,
            processor,
            code_object,
            compute_units,
            wall_clock_khz: None,
        };
        // From here on `device`'s Drop releases the stream and module on any error.
        for kernel in Kernel::all() {
            let f = module_function(device.module, &kernel.symbol())?;
            device.functions.push((kernel, f));
        }
        // The kernels time barriers with the constant-rate wall clock; tell them its rate
        // where the runtime reports it (ROCm 6+), else they assume 100 MHz.
        if let Ok(khz) = attribute(ordinal, ffi::ATTR_WALL_CLOCK_RATE) {
            if khz > 0 {
                let mut ptr: *mut c_void = null_mut();
                let mut bytes = 0usize;
                // SAFETY: valid out pointers, live module, NUL-terminated name.
                check(
                    unsafe {
                        ffi::hipModuleGetGlobal(
                            &mut ptr,
                            &mut bytes,
                            device.module,
                            c"peercomm_wall_clock_khz".as_ptr(),
                        )
                    },
                    "hipModuleGetGlobal",
                )?;
                let value = khz as u32;
                if bytes == std::mem::size_of::<u32>() {
                    // SAFETY: `ptr` is the 4-byte device global; `value` lives until the
                    // stream is synchronised below.
                    check(
                        unsafe {
                            ffi::hipMemcpyHtoDAsync(
                                ptr,
                                (&value as *const u32).cast(),
                                bytes,
                                device.stream,
                            )
                        },
                        "hipMemcpyHtoDAsync",
                    )?;
                    Self::synchronize(&device)?;
                    device.wall_clock_khz = Some(value);
                }
            }
        }
        Ok(device)
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
        set_device(mem.ordinal)?;
        let mut handle = ffi::IpcMemHandle {
            reserved: [0; ffi::IPC_HANDLE_SIZE],
        };
        // SAFETY: `handle` is a valid out pointer; `ptr` is the base of a live
        // allocation of this device.
        check(
            unsafe { ffi::hipIpcGetMemHandle(&mut handle, mem.ptr as *mut c_void) },
            "hipIpcGetMemHandle",
        )?;
        Ok(Writer::new(IPC_MAGIC, IPC_VERSION)
            .u64(process_token())
            .u64(mem.bytes as u64)
            .bytes(&handle.reserved.map(|c| c as u8))
            .finish())
    }

    fn import_memory(dev: &HipDevice, handle: &[u8]) -> Result<HipPeerMapping> {
        let mut r = Reader::open(Hip::NAME, handle, IPC_MAGIC, IPC_VERSION, IPC_HANDLE_BYTES)?;
        let (token, bytes, raw) = (r.u64(), r.u64(), r.array::<{ ffi::IPC_HANDLE_SIZE }>());
        if token == process_token() {
            return Err(Error::Unsupported(
                "hip: import_memory: this process exported the handle: HIP IPC cannot open a \
                 handle in the process that exported it; within one process use the \
                 allocation's own address (map_peer)"
                    .into(),
            ));
        }
        let bytes = usize::try_from(bytes)
            .map_err(|_| import_error(Hip::NAME, format!("size {bytes} does not fit here")))?;
        set_device(dev.ordinal)?;
        let ipc = ffi::IpcMemHandle {
            reserved: raw.map(|b| b as c_char),
        };
        let open = |flags: c_uint| {
            let mut ptr: *mut c_void = null_mut();
            // SAFETY: `ptr` is a valid out pointer; the runtime validates the handle.
            let status = unsafe { ffi::hipIpcOpenMemHandle(&mut ptr, ipc, flags) };
            (status, ptr)
        };
        // ROCm 6 and 7 require the flag to be their hipIpcMemLazyEnablePeerAccess (1)
        // and reject anything else as an invalid value; HIP 5.x headers define it as 0.
        let (mut status, mut ptr) = open(ffi::IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
        if status == ffi::ERROR_INVALID_VALUE {
            (status, ptr) = open(ffi::IPC_MEM_LAZY_ENABLE_PEER_ACCESS_HIP5);
        }
        if status != ffi::SUCCESS {
            return Err(Error::Backend {
                backend: Hip::NAME,
                call: "hipIpcOpenMemHandle",
                detail: format!(
                    "{}: the exporter may have freed the memory or exited, or run on another \
                     host or with other devices visible",
                    describe(status)
                ),
            });
        }
        Ok(HipPeerMapping {
            ptr: ptr as u64,
            bytes,
            ordinal: dev.ordinal,
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_embedded_code_object_exports_every_kernel() {
        for co in embedded_code_objects() {
            assert!(
                co.bytes.starts_with(b"\x7fELF"),
                "{} is not an ELF",
                co.target
            );
            for k in Kernel::all() {
                let sym = k.symbol();
                let kd = format!("{sym}.kd\0");
                assert!(
                    co.bytes.windows(kd.len()).any(|w| w == kd.as_bytes()),
                    "{}: no kernel descriptor for {sym}",
                    co.target
                );
            }
        }
    }

    #[test]
    fn code_objects_are_matched_by_processor_and_features() {
        let targets: Vec<&str> = embedded_code_objects().map(|c| c.target).collect();
        if targets.contains(&"gfx942") {
            let co = code_object_for("gfx942:sramecc+:xnack-").expect("gfx942 matches");
            assert_eq!(co.target, "gfx942");
        }
        if targets.contains(&"gfx90a") {
            assert_eq!(code_object_for("gfx90a").unwrap().target, "gfx90a");
            assert_eq!(
                code_object_for("gfx90a:sramecc+:xnack+").unwrap().target,
                "gfx90a"
            );
        }
        assert!(code_object_for("gfx1100").is_none());
        assert!(code_object_for("gfx94").is_none());
    }

    #[test]
    fn a_device_properties_entry_point_resolves() {
        // The runtime is linked, so at least one versioned or unversioned entry point
        // is found through the dynamic linker.
        let found: Vec<String> = [
            c"hipGetDevicePropertiesR0600",
            c"hipGetDevicePropertiesR0000",
            c"hipGetDeviceProperties",
        ]
        .into_iter()
        // SAFETY: dlsym only reads the NUL-terminated name.
        .filter(|s| !unsafe { ffi::dlsym(ffi::RTLD_DEFAULT, s.as_ptr()) }.is_null())
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
        eprintln!("device-properties entry points: {found:?}");
        assert!(!found.is_empty());
        if Hip::device_count().is_err() {
            // Without a GPU the query fails with a status, not a crash.
            let e = gcn_arch_name(0).unwrap_err();
            eprintln!("gcn_arch_name(0) without a GPU: {e}");
        }
    }

    #[test]
    fn unknown_status_codes_are_described_not_trusted() {
        // A code no HIP version defines must format without UB or panic.
        let s = describe(123_456);
        assert!(s.contains("123456"), "{s}");
    }
}
