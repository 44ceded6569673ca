//! The `Hip` backend type, status checks, device queries and the embedded code objects.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr::null_mut;

use hip_sys::hiprt::{hipFunction_t, hipModule_t};

use super::super::Backend;
use crate::error::{Error, Result};

use super::ffi::{self, HipStatus};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/hip_code_objects.rs"));
}

/// The HIP backend (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct Hip;

/// Name and message of a status, for any value (the runtime answers unknown codes
/// with its "unknown error" strings).
pub(super) fn describe(status: HipStatus) -> String {
    // SAFETY: both accept any integer and return a static C string (or null, handled).
    let (name, text) = unsafe { (ffi::hipGetErrorName(status), ffi::hipGetErrorString(status)) };
    let read = |p: *const c_char| match p.is_null() {
        true => "?".to_string(),
        // SAFETY: non-null pointers from the runtime point at static C strings.
        false => unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned(),
    };
    let (name, text) = (read(name), read(text));
    if name == text {
        // HIP 5.x answers both with the name.
        format!("{name} ({status})")
    } else {
        format!("{name} ({status}): {text}")
    }
}

/// An [`Error::Backend`] of HIP's `call`.
pub(super) fn backend_err(call: &'static str, detail: String) -> Error {
    Error::Backend {
        backend: Hip::NAME,
        call,
        detail,
    }
}

/// `Ok` for success, else the error of `call` answering `status`.
pub(super) fn check(status: HipStatus, call: &'static str) -> Result<()> {
    match status {
        ffi::SUCCESS => Ok(()),
        _ => Err(backend_err(call, describe(status))),
    }
}

pub(crate) fn set_device(ordinal: usize) -> Result<()> {
    // SAFETY: plain value argument; an invalid ordinal is reported as a status.
    hip!(hipSetDevice(ordinal as c_int))
}

pub(super) fn attribute(ordinal: usize, attr: c_int) -> std::result::Result<c_int, HipStatus> {
    let mut value: c_int = 0;
    // SAFETY: `value` is a valid out pointer for the duration of the call.
    let status = unsafe { ffi::hipDeviceGetAttribute(&mut value, attr, ordinal as c_int) };
    (status == ffi::SUCCESS).then_some(value).ok_or(status)
}

/// Signature shared by `hipGetDeviceProperties`, `...R0000` and `...R0600`.
type GetDeviceProperties = unsafe extern "C" fn(*mut c_void, c_int) -> HipStatus;

/// Signature of `hipDeviceGetUuid` (`hipUUID` is 16 bytes, `hipDevice_t` an `int`).
type GetUuid = unsafe extern "C" fn(*mut [c_char; 16], c_int) -> HipStatus;

/// The device's UUID where the runtime exports `hipDeviceGetUuid` (older ones do not)
/// and answers it; else `None`, and the PCI bus id tells devices apart.
pub(super) fn device_uuid(ordinal: usize) -> Option<[u8; 16]> {
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
pub(super) fn pci_bus_id(ordinal: usize) -> Result<String> {
    let mut text: [c_char; 64] = [0; 64];
    let (out, device) = (text.as_mut_ptr(), ordinal as c_int);
    // SAFETY: `text` is writable for the length passed.
    hip!(hipDeviceGetPCIBusId(out, 64, device))?;
    let text = text.map(|c| c as u8);
    let end = text.iter().position(|&b| b == 0).unwrap_or(63);
    Ok(String::from_utf8_lossy(&text[..end]).into_owned())
}

/// The device-properties entry points, newest first, with the offset of `gcnArchName`
/// in the `hipDeviceProp_t` each writes (ROCm 6 rearranged it).
const PROPERTIES: [(&CStr, usize); 3] = [
    (c"hipGetDevicePropertiesR0600", 1160),
    (c"hipGetDevicePropertiesR0000", 396),
    (c"hipGetDeviceProperties", 396),
];

/// The device's `gcnArchName` (e.g. `gfx942:sramecc+:xnack-`), through the first entry
/// point of [`PROPERTIES`] the runtime exports, into a buffer larger than every layout.
pub(super) fn gcn_arch_name(ordinal: usize) -> Result<String> {
    let mut last = String::from("the HIP runtime exports no hipGetDeviceProperties* function");
    for (symbol, offset) in PROPERTIES {
        // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads.
        let f = unsafe { ffi::dlsym(ffi::RTLD_DEFAULT, symbol.as_ptr()) };
        if f.is_null() {
            continue;
        }
        // SAFETY: each device-properties entry point is `hipError_t (void* props, int dev)`.
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
    Err(backend_err("hipGetDeviceProperties", last))
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

/// The embedded code object for `gcn_arch_name`: same processor, and every feature it
/// was built with (`:xnack+` ...) in the device's name (none: either mode).
pub(super) fn code_object_for(gcn_arch_name: &str) -> Option<EmbeddedCodeObject> {
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
    hip!(hipRuntimeGetVersion(&mut v))?;
    Ok(v)
}

/// Resolves an entry point of a loaded module by its exported name.
pub(super) fn module_function(module: hipModule_t, symbol: &str) -> Result<hipFunction_t> {
    let name =
        CString::new(symbol).map_err(|_| Error::Unsupported(format!("kernel {symbol:?}")))?;
    let mut f: hipFunction_t = null_mut();
    // SAFETY: valid out pointer, live module, NUL-terminated name.
    let status = unsafe { ffi::hipModuleGetFunction(&mut f, module, name.as_ptr()) };
    match status {
        ffi::SUCCESS => Ok(f),
        _ => Err(backend_err(
            "hipModuleGetFunction",
            format!("{symbol}: {}", describe(status)),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Kernel;

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
        let found: Vec<String> = PROPERTIES
            .map(|(s, _)| s)
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
