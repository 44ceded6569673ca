//! The device API's headers, for kernels of your own that synchronise GPUs and reach
//! peers through peercomm's signals (`include/peercomm_device.h`, which includes
//! `include/peercomm_signal.h`, the layout).
//!
//! A build script of a crate that depends on peercomm finds the folder of both files in
//! `DEP_PEERCOMM_INCLUDE` (cargo's `links` metadata) and passes it to nvcc or hipcc as
//! `-I`; a run-time compiler (NVRTC, hiprtc) takes [`prelude`] before the kernel's
//! source. The headers include no host header: under NVRTC and hiprtc they define the
//! fixed-width integer types themselves.
//!
//! ```
//! let source = format!(
//!     "{}\nextern \"C\" __global__ void bump(unsigned* word) {{\n    \
//!      peercomm::st_release_sys(word, peercomm::ld_acquire_sys(word) + 1u);\n}}\n",
//!     peercomm::device::prelude()
//! );
//! assert!(source.contains("PEERCOMM_DEVICE_H"));
//! ```

use crate::signal::{DeviceCommArgs, MAX_GPUS};

pub use crate::protocol::BarrierKind;

/// One rank's view of one symmetric or registered buffer for kernels of your own
/// (`peercomm::DeviceComm` in the header): every group member's signal and buffer, this
/// rank's group rank, the barrier bank of user kernels and the descriptor its barriers
/// carry. A kernel argument as it is (on CUDA, cudarc's `DeviceRepr`; on HIP,
/// [`DeviceComm::as_kernel_arg`] in the kernel's parameter array). Made by `Comm::device_comm` (collective);
/// the rules a kernel keeps are written in the header, before `DeviceComm`.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct DeviceComm(pub(crate) DeviceCommArgs);

impl DeviceComm {
    /// This rank's index in the group.
    pub fn group_rank(&self) -> usize {
        self.0.group_rank as usize
    }
    /// Ranks in the group.
    pub fn group_width(&self) -> usize {
        self.0.group_width as usize
    }
    /// Bytes of the buffer (the same on every member).
    pub fn buffer_bytes(&self) -> usize {
        self.0.bytes as usize
    }
    /// The address of the value, for a launch API that takes kernel arguments by
    /// address (HIP's `hipModuleLaunchKernel` `kernelParams`, CUDA's `cuLaunchKernel`):
    /// valid while `self` is.
    pub fn as_kernel_arg(&self) -> *const std::ffi::c_void {
        (self as *const DeviceComm).cast()
    }
    /// Group member `member`'s buffer, as this rank's device reaches it.
    pub fn peer_buffer(&self, member: usize) -> Option<u64> {
        (member < self.group_width().min(MAX_GPUS)).then(|| self.0.buffers[member])
    }
}

impl std::fmt::Debug for DeviceComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceComm")
            .field("group_rank", &self.group_rank())
            .field("group_width", &self.group_width())
            .field("buffer_bytes", &self.buffer_bytes())
            .finish_non_exhaustive()
    }
}

/// `include/peercomm_signal.h`: the signal layout and the kernels' argument structs.
pub const SIGNAL_HEADER: &str = include_str!("../include/peercomm_signal.h");

/// `include/peercomm_device.h`: the device API (it includes [`SIGNAL_HEADER`] by name).
pub const DEVICE_HEADER: &str = include_str!("../include/peercomm_device.h");

/// The device API as one source for a run-time compiler: [`DEVICE_HEADER`] with its
/// `#include "peercomm_signal.h"` replaced by [`SIGNAL_HEADER`]. Put it before the
/// kernel's own source (which then includes neither header).
pub fn prelude() -> String {
    DEVICE_HEADER.replacen("#include \"peercomm_signal.h\"", SIGNAL_HEADER, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prelude_holds_both_headers_and_no_include() {
        let p = prelude();
        assert!(p.contains("#define PEERCOMM_SIGNAL_H"));
        assert!(p.contains("#define PEERCOMM_DEVICE_H"));
        let by_name = "#include \"peercomm_signal.h\"";
        assert!(
            !p.contains(by_name),
            "a run-time compiler has no include path"
        );
    }
}
