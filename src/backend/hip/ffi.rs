//! Raw declarations of the HIP runtime functions this backend calls and their status type.

use std::ffi::{c_char, c_int, c_uint, c_void};

use hip_sys::hiprt::{hipEvent_t, hipFunction_t, hipModule_t, hipStream_t};

/// A HIP status code, read as the plain integer the C ABI returns.
pub type HipStatus = i32;

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

/// A device or host address.
type Ptr = *mut c_void;
type Stream = hipStream_t;
type Name = *const c_char;

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
    pub fn hipMalloc(ptr: *mut Ptr, bytes: usize) -> HipStatus;
    pub fn hipExtMallocWithFlags(ptr: *mut Ptr, bytes: usize, flags: c_uint) -> HipStatus;
    pub fn hipFree(ptr: Ptr) -> HipStatus;
    pub fn hipIpcGetMemHandle(handle: *mut IpcMemHandle, ptr: Ptr) -> HipStatus;
    pub fn hipIpcOpenMemHandle(ptr: *mut Ptr, handle: IpcMemHandle, flags: c_uint) -> HipStatus;
    pub fn hipIpcCloseMemHandle(ptr: Ptr) -> HipStatus;
    pub fn hipStreamCreateWithFlags(stream: *mut hipStream_t, flags: c_uint) -> HipStatus;
    pub fn hipStreamDestroy(stream: hipStream_t) -> HipStatus;
    pub fn hipStreamSynchronize(stream: hipStream_t) -> HipStatus;
    pub fn hipStreamWaitEvent(stream: hipStream_t, event: hipEvent_t, flags: c_uint) -> HipStatus;
    pub fn hipEventCreateWithFlags(event: *mut hipEvent_t, flags: c_uint) -> HipStatus;
    pub fn hipEventRecord(event: hipEvent_t, stream: hipStream_t) -> HipStatus;
    pub fn hipEventSynchronize(event: hipEvent_t) -> HipStatus;
    pub fn hipEventDestroy(event: hipEvent_t) -> HipStatus;
    pub fn hipMemsetD16Async(dst: Ptr, value: u16, count: usize, stream: Stream) -> HipStatus;
    pub fn hipMemsetD32Async(dst: Ptr, value: c_int, count: usize, stream: Stream) -> HipStatus;
    pub fn hipMemcpyHtoDAsync(dst: Ptr, src: *const c_void, n: usize, s: Stream) -> HipStatus;
    pub fn hipMemcpyDtoHAsync(dst: Ptr, src: Ptr, bytes: usize, stream: Stream) -> HipStatus;
    pub fn hipMemcpyDtoH(dst: Ptr, src: Ptr, bytes: usize) -> HipStatus;
    pub fn hipMemGetAddressRange(base: *mut Ptr, size: *mut usize, ptr: Ptr) -> HipStatus;
    pub fn hipModuleLoadData(module: *mut hipModule_t, image: *const c_void) -> HipStatus;
    pub fn hipModuleUnload(module: hipModule_t) -> HipStatus;
    pub fn hipModuleGetFunction(f: *mut hipFunction_t, m: hipModule_t, name: Name) -> HipStatus;
    pub fn hipModuleGetGlobal(p: *mut Ptr, n: *mut usize, m: hipModule_t, name: Name) -> HipStatus;
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
        params: *mut Ptr,
        extra: *mut Ptr,
    ) -> HipStatus;
}

// The dynamic linker finds the versioned device-properties entry points (glibc's libc
// exports dlsym; std links libdl on older glibc).
extern "C" {
    pub fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}
/// glibc's `RTLD_DEFAULT`: search the global scope.
pub const RTLD_DEFAULT: *mut c_void = std::ptr::null_mut();
