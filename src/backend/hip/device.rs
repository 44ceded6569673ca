//! `HipDevice` (stream, loaded kernels, what the runtime reports), opening it, launching
//! on it; `HipEvent`.

use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::Mutex;

use hip_sys::hiprt::{hipEvent_t, hipFunction_t, hipModule_t, hipStream_t};

use super::super::{Backend, Kernel, LaunchDims};
use crate::error::{Error, Result};
use crate::signal::MAX_NUM_BLOCKS_UPPER_BOUND;

use super::ffi;
use super::runtime::*;

/// One AMD GPU: its stream, its loaded kernels and what the runtime reports about it.
pub struct HipDevice {
    pub(super) ordinal: usize,
    pub(super) stream: hipStream_t,
    pub(super) module: hipModule_t,
    /// Every kernel of [`Kernel::all`], resolved when the device is opened.
    pub(super) functions: Vec<(Kernel, hipFunction_t)>,
    /// Other entry points (e.g. the flag ping-pong), resolved by symbol on first use.
    pub(super) extra_functions: Mutex<Vec<(String, hipFunction_t)>>,
    pub(super) gcn_arch_name: String,
    pub(super) processor: String,
    pub(super) code_object: EmbeddedCodeObject,
    pub(super) compute_units: usize,
    pub(super) wall_clock_khz: Option<u32>,
}

impl super::super::IntoDevice for HipDevice {
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
        let (mut event, flags): (hipEvent_t, _) = (null_mut(), ffi::EVENT_DISABLE_TIMING);
        // SAFETY: `event` is a valid out pointer.
        hip!(hipEventCreateWithFlags(&mut event, flags))?;
        let event = HipEvent { event };
        // SAFETY: both handles are live.
        hip!(hipEventRecord(event.event, self.stream))?;
        Ok(event)
    }
    /// Makes this device's stream wait (on the device, without blocking the host) until
    /// `event` has completed: how a producer stream's tensor is handed to a collective.
    pub fn wait_event(&self, event: &HipEvent) -> Result<()> {
        // SAFETY: both handles are live.
        hip!(hipStreamWaitEvent(self.stream, event.event, 0))
    }

    /// The loaded entry point of `kernel`.
    pub(super) fn function(&self, kernel: Kernel) -> Result<hipFunction_t> {
        if let Some(&(_, f)) = self.functions.iter().find(|(k, _)| *k == kernel.exported()) {
            return Ok(f);
        }
        let (symbol, extra) = (kernel.symbol(), &self.extra_functions);
        let mut extra = extra.lock().unwrap_or_else(|e| e.into_inner());
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
    pub(super) event: hipEvent_t,
}

// SAFETY: HIP events may be recorded, waited on and destroyed from any thread.
unsafe impl Send for HipEvent {}
// SAFETY: as above; `&HipEvent` only waits on the event.
unsafe impl Sync for HipEvent {}

impl HipEvent {
    /// Blocks the host until the event has completed.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is live.
        hip!(hipEventSynchronize(self.event))
    }
}

impl Drop for HipEvent {
    fn drop(&mut self) {
        // SAFETY: owned by this value; HIP defers the release until the event completes.
        unsafe { ffi::hipEventDestroy(self.event) };
    }
}

pub(super) fn open(ordinal: usize) -> Result<HipDevice> {
    let count = <Hip as Backend>::device_count()?;
    if count == 0 {
        let detail = "hipGetDeviceCount reported 0 devices".into();
        return Err(Error::NoDevice {
            backend: Hip::NAME,
            detail,
        });
    } else if ordinal >= count {
        let e = format!("HIP device {ordinal} does not exist ({count} visible)");
        return Err(Error::InvalidDevices(e));
    }
    set_device(ordinal)?;
    let gcn_arch_name = gcn_arch_name(ordinal)?;
    let processor = gcn_arch_name.split(':').next().unwrap_or("").to_string();
    let code_object = code_object_for(&gcn_arch_name).ok_or_else(|| {
        let built: Vec<&str> = embedded_code_objects().map(|c| c.target).collect();
        let skipped = skipped_architectures()
            .iter()
            .map(|(a, why)| format!("{a} ({why})"));
        let skipped = skipped.collect::<Vec<_>>().join(", ");
        let skipped = match skipped.is_empty() {
            true => skipped,
            false => format!(" (not built: {skipped})"),
        };
        Error::Unsupported(format!(
            "HIP device {ordinal} is {gcn_arch_name}, and this build of peercomm embeds code \
             objects for {built:?} only{skipped}; rebuild with PEERCOMM_HIP_ARCHS={processor} \
             (see docs/amd.md)"
        ))
    })?;
    let compute_units = attribute(ordinal, ffi::ATTR_MULTIPROCESSOR_COUNT)
        .map_err(|s| backend_err("hipDeviceGetAttribute(MultiprocessorCount)", describe(s)))?;

    let (mut stream, flags): (hipStream_t, _) = (null_mut(), ffi::STREAM_NON_BLOCKING);
    // SAFETY: `stream` is a valid out pointer.
    hip!(hipStreamCreateWithFlags(&mut stream, flags))?;
    // The ELF reader wants an aligned image; embedded bytes are only 1-aligned.
    let image: Vec<u64> = (code_object.bytes.chunks(8))
        .map(|c| u64::from_ne_bytes(std::array::from_fn(|i| c.get(i).copied().unwrap_or(0))))
        .collect();
    let mut module: hipModule_t = null_mut();
    // SAFETY: valid out pointer; `image`, a whole code object, outlives the call.
    let loaded = unsafe { ffi::hipModuleLoadData(&mut module, image.as_ptr().cast()) };
    if loaded != ffi::SUCCESS {
        // SAFETY: created above, unused.
        unsafe { ffi::hipStreamDestroy(stream) };
        let (target, loaded) = (code_object.target, describe(loaded));
        let detail = format!("the {target} code object on {gcn_arch_name}: {loaded}");
        return Err(backend_err("hipModuleLoadData", detail));
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
        compute_units: compute_units.max(1) as usize,
        wall_clock_khz: None,
    };
    // From here on `device`'s Drop releases the stream and module on any error.
    for kernel in Kernel::all() {
        let f = module_function(device.module, &kernel.symbol())?;
        device.functions.push((kernel, f));
    }
    // The kernels time barriers with the constant-rate wall clock; tell them its rate
    // where the runtime reports it (ROCm 6+), else they assume 100 MHz.
    if let Ok(khz @ 1..) = attribute(ordinal, ffi::ATTR_WALL_CLOCK_RATE) {
        let (mut ptr, mut bytes) = (null_mut(), 0usize);
        let (module, name) = (device.module, c"peercomm_wall_clock_khz".as_ptr());
        // SAFETY: valid out pointers, live module, NUL-terminated name.
        hip!(hipModuleGetGlobal(&mut ptr, &mut bytes, module, name))?;
        if bytes == std::mem::size_of::<u32>() {
            Hip::write(&device, ptr as u64, &(khz as u32).to_ne_bytes())?;
            device.wall_clock_khz = Some(khz as u32);
        }
    }
    Ok(device)
}

/// Copies `bytes` between device address `device` and host memory `host` (to the host
/// when `to_host`) on the rank's stream, and waits.
///
/// # Safety
/// `device` must be a device range and `host` host memory of at least `bytes`.
pub(super) unsafe fn copy(
    dev: &HipDevice,
    device: u64,
    host: *mut c_void,
    bytes: usize,
    to_host: bool,
) -> Result<()> {
    set_device(dev.ordinal)?;
    let (d, s) = (device as *mut c_void, dev.stream);
    // SAFETY: the caller's contract; `host` is not used until the stream is synchronised.
    match to_host {
        true => hip!(hipMemcpyDtoHAsync(host, d, bytes, s)),
        false => hip!(hipMemcpyHtoDAsync(d, host, bytes, s)),
    }?;
    // SAFETY: the stream is live.
    hip!(hipStreamSynchronize(dev.stream))
}

/// Launches `kernel` on `dev`'s stream with `args` as its one by-value parameter, after
/// checking the grid (`group_width`: the threads of a block's first wavefront that do
/// the barrier's counter work must exist).
///
/// # Safety
/// `A` must be the kernel's parameter type (`peercomm_allreduce_args` or
/// `peercomm_group_args`), built from live allocations of the documented layout.
pub(super) unsafe fn launch_by_value<A: Copy>(
    dev: &HipDevice,
    kernel: Kernel,
    dims: LaunchDims,
    group_width: u32,
    args: &A,
) -> Result<()> {
    if dims.blocks == 0
        || dims.blocks as usize > MAX_NUM_BLOCKS_UPPER_BOUND
        || dims.threads == 0
        || dims.threads > 512
        || group_width > dims.threads
    {
        return Err(Error::Unsupported(format!(
            "HIP launch of {} with {} blocks of {} threads: blocks must be in 1..={}, threads \
             in 1..=512 (the kernels' launch bound) and at least the group width",
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
    hip!(hipModuleLaunchKernel(
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
        null_mut()
    ))
}
