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
