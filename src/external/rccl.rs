//! RCCL (NCCL's C API in `librccl.so`), the HIP backend's external library. The first
//! use `dlopen`s it ([`RCCL_LIBRARY_ENV`], else `librccl.so.1`, `librccl.so`, then under
//! `$ROCM_PATH/lib` and `/opt/rocm/lib`): without RCCL, peercomm builds and runs and
//! gets [`Error::ExternalUnavailable`] naming what is missing.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::marker::PhantomData;
use std::sync::OnceLock;

use super::nccl_api::{NcclApi, NcclLike};
use super::Call;
use super::{ExternalLibrary, HasExternalLibrary};
use crate::backend::hip::{set_device, Hip, HipDevice};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// Environment variable naming the RCCL library to open instead of the defaults.
pub const RCCL_LIBRARY_ENV: &str = "PEERCOMM_RCCL_LIBRARY";

/// The HIP backend's external library is RCCL (see the module docs).
impl HasExternalLibrary for Hip {
    fn external_library() -> &'static dyn ExternalLibrary<Hip> {
        &NcclLike::<Api>(PhantomData)
    }
}

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

type Comm = *mut c_void;
type Status = c_int;
const SUCCESS: Status = 0;
const IN_PROGRESS: Status = 7;
/// `ncclRedOp_t` of an operator (NCCL's numbering, which RCCL shares).
fn rccl_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

/// Declares [`Api`] and `resolve`, which looks its entry points up by name in order.
macro_rules! api {
    ($($field:ident: $sym:literal fn($($a:ty),*) -> $r:ty;)*) => {
        /// RCCL: the entry points peercomm calls, resolved once.
        pub(crate) struct Api {
            $($field: unsafe extern "C" fn($($a),*) -> $r,)*
        }

        fn resolve(
            sym: impl Fn(&str) -> std::result::Result<*mut c_void, String>,
        ) -> std::result::Result<Api, String> {
            // SAFETY: each symbol is RCCL's (NCCL's C API), whose C signature the field's
            // type spells; a library of that name exporting these symbols is RCCL.
            unsafe { Ok(Api { $($field: cast(sym($sym)?),)* }) }
        }
    };
}

api! {
    get_unique_id: "ncclGetUniqueId" fn(*mut UniqueId) -> Status;
    comm_init_rank: "ncclCommInitRank" fn(*mut Comm, c_int, UniqueId, c_int) -> Status;
    comm_init_all: "ncclCommInitAll" fn(*mut Comm, c_int, *const c_int) -> Status;
    all_reduce: "ncclAllReduce"
        fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> Status;
    comm_abort: "ncclCommAbort" fn(Comm) -> Status;
    comm_get_async_error: "ncclCommGetAsyncError" fn(Comm, *mut Status) -> Status;
    group_start: "ncclGroupStart" fn() -> Status;
    group_end: "ncclGroupEnd" fn() -> Status;
    get_error_string: "ncclGetErrorString" fn(Status) -> *const c_char;
}

extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}
/// `RTLD_NOW | RTLD_LOCAL`.
const RTLD_NOW: c_int = 2;

/// A resolved symbol as the function pointer type `F`.
///
/// # Safety
/// `p` must be a function of exactly the signature `F` spells.
unsafe fn cast<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size (checked); the caller guarantees the signature.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

/// A C string's text, copied (`None` for NULL).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
unsafe fn c_text(p: *const c_char) -> Option<String> {
    // SAFETY: the caller's contract.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn last_dl_error() -> String {
    // SAFETY: dlerror returns NULL or a string valid until the next dl call on this thread.
    unsafe { c_text(dlerror()) }.unwrap_or_else(|| "unknown error".into())
}

/// The names tried in order when `PEERCOMM_RCCL_LIBRARY` is not set.
fn default_names() -> Vec<String> {
    let roots = std::env::var("ROCM_PATH")
        .ok()
        .into_iter()
        .chain(["/opt/rocm".into()]);
    let dirs = [String::new()]
        .into_iter()
        .chain(roots.map(|root| format!("{root}/lib/")));
    dirs.flat_map(|d| [format!("{d}librccl.so.1"), format!("{d}librccl.so")])
        .collect()
}

/// Opens the first of `names` that loads and resolves every symbol peercomm calls; the
/// error names each library tried and why it failed.
fn load_from(names: &[String]) -> std::result::Result<Api, String> {
    let mut tried = Vec::new();
    for name in names {
        let Ok(c_name) = CString::new(name.as_str()) else {
            tried.push(format!("{name:?}: not a valid file name"));
            continue;
        };
        // SAFETY: a NUL-terminated name; the handle is never closed (the functions are kept).
        let handle = unsafe { dlopen(c_name.as_ptr(), RTLD_NOW) };
        if handle.is_null() {
            tried.push(format!("{name}: {}", last_dl_error()));
            continue;
        }
        let sym = |s: &str| -> std::result::Result<*mut c_void, String> {
            let c = CString::new(s).expect("symbol names have no NUL");
            // SAFETY: a live handle and a NUL-terminated symbol name.
            let p = unsafe { dlsym(handle, c.as_ptr()) };
            if p.is_null() {
                Err(format!("{name} has no symbol {s}"))
            } else {
                Ok(p)
            }
        };
        match resolve(sym) {
            Ok(api) => return Ok(api),
            Err(e) => tried.push(e),
        }
    }
    Err(format!(
        "RCCL could not be loaded (install ROCm's rccl, or set {RCCL_LIBRARY_ENV}); tried {}",
        tried.join("; ")
    ))
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        let names = match std::env::var(RCCL_LIBRARY_ENV) {
            Ok(n) if !n.is_empty() => vec![n],
            _ => default_names(),
        };
        load_from(&names)
    })
    .as_ref()
    .map_err(|detail| Error::ExternalUnavailable {
        library: "rccl",
        detail: detail.clone(),
    })
}

fn check(api: &Api, status: Status, call: &'static str) -> Result<()> {
    if status == SUCCESS {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static string (or NULL) for any code.
    let detail = match unsafe { c_text((api.get_error_string)(status)) } {
        Some(text) => format!("status {status}: {text}"),
        None => format!("status {status}"),
    };
    Err(Error::External {
        library: "rccl",
        call,
        detail,
    })
}

/// RCCL's `ncclDataType_t` codes (NCCL's numbering).
fn rccl_dtype(dtype: DType) -> c_int {
    match dtype {
        DType::F16 => 6,
        DType::F32 => 7,
        DType::BF16 => 9,
        DType::I8 => 0,
        DType::U8 => 1,
        DType::I32 => 2,
        DType::U32 => 3,
        DType::I64 => 4,
        DType::U64 => 5,
        DType::F64 => 8,
    }
}

impl NcclApi for Api {
    type B = Hip;
    type Comm = Comm;
    const NAME: &'static str = "rccl";

    fn load() -> Result<&'static Self> {
        api()
    }

    fn bind(dev: &HipDevice) -> Result<()> {
        set_device(dev.ordinal())
    }

    fn unique_id(&self) -> Result<[c_char; 128]> {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: RCCL writes one id.
        let status = unsafe { (self.get_unique_id)(&mut id) };
        check(self, status, "ncclGetUniqueId").map(|()| id.internal)
    }

    fn init_rank(&self, world: c_int, internal: [c_char; 128], rank: c_int) -> Result<Comm> {
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: RCCL initialises `comm` on success.
        let status =
            unsafe { (self.comm_init_rank)(&mut comm, world, UniqueId { internal }, rank) };
        check(self, status, "ncclCommInitRank").map(|()| comm)
    }

    fn init_all(&self, ordinals: &[c_int]) -> Result<Vec<Comm>> {
        let (mut comms, n) = (vec![std::ptr::null_mut(); ordinals.len()], ordinals.len());
        // SAFETY: one slot per device.
        let status =
            unsafe { (self.comm_init_all)(comms.as_mut_ptr(), n as c_int, ordinals.as_ptr()) };
        check(self, status, "ncclCommInitAll").map(|()| comms)
    }

    unsafe fn all_reduce(&self, comm: Self::Comm, dev: &HipDevice, call: Call) -> Result<()> {
        let (send, recv, n, dtype, op) = call;
        let (s, r, t) = (
            send as *const c_void,
            recv as *mut c_void,
            rccl_dtype(dtype),
        );
        // SAFETY: the caller's contract (both ranges on this device, `comm` made for it).
        let status =
            unsafe { (self.all_reduce)(s, r, n, t, rccl_op(op), comm, dev.stream_handle()) };
        check(self, status, "ncclAllReduce")
    }

    unsafe fn abort(&self, comm: Comm) {
        // SAFETY: the caller's contract.
        let _ = unsafe { (self.comm_abort)(comm) };
    }

    fn async_error(&self, comm: Comm) -> Result<()> {
        let mut code = SUCCESS;
        // SAFETY: a live communicator; RCCL writes one status.
        let r = unsafe { (self.comm_get_async_error)(comm, &mut code) };
        for c in [r, code] {
            if c != SUCCESS && c != IN_PROGRESS {
                check(self, c, "ncclCommGetAsyncError")?;
            }
        }
        Ok(())
    }

    fn group(&self, end: bool) -> Result<()> {
        // SAFETY: no arguments.
        match end {
            false => check(self, unsafe { (self.group_start)() }, "ncclGroupStart"),
            true => check(self, unsafe { (self.group_end)() }, "ncclGroupEnd"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_named() {
        let err = load_from(&["/nonexistent/librccl.so.1".into()])
            .err()
            .unwrap();
        assert!(err.contains("/nonexistent/librccl.so.1"), "{err}");
        assert!(err.contains(RCCL_LIBRARY_ENV), "{err}");
    }

    #[test]
    fn a_library_without_the_symbols_is_refused() {
        // libc loads everywhere peercomm does, and exports none of RCCL's symbols.
        let err = load_from(&["libc.so.6".into()]).err().unwrap();
        assert!(err.contains("has no symbol ncclGetUniqueId"), "{err}");
    }
}
