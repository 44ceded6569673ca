//! NCCL through cudarc, the CUDA backend's external library. libnccl is looked for
//! before cudarc loads it: a missing one is [`Error::ExternalUnavailable`], not a panic.

use std::ffi::{c_char, c_int};
use std::marker::PhantomData;
use std::sync::OnceLock;

use cudarc::nccl::{result, sys};

use super::nccl_api::{NcclApi, NcclLike};
use super::Call;
use super::{ExternalLibrary, HasExternalLibrary};
use crate::backend::cuda::{load_first_of, Cuda, CudaDevice};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// NCCL (see the module docs).
pub(crate) struct Nccl;

/// The CUDA backend's external library is NCCL.
impl HasExternalLibrary for Cuda {
    fn external_library() -> &'static dyn ExternalLibrary<Cuda> {
        &NcclLike::<Nccl>(PhantomData)
    }
}

fn describe(code: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let text = unsafe { sys::ncclGetErrorString(code) };
    if text.is_null() {
        format!("{code:?}")
    } else {
        // SAFETY: non-null, NUL-terminated, static (see above).
        let s = unsafe { std::ffi::CStr::from_ptr(text) };
        format!("{code:?}: {}", s.to_string_lossy())
    }
}

fn nccl_err(call: &'static str) -> impl FnOnce(result::NcclError) -> Error {
    move |e| Error::External {
        library: "nccl",
        call,
        detail: describe(e.0),
    }
}

fn driver_err(call: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    move |e| Error::External {
        library: "nccl",
        call,
        detail: e.to_string(),
    }
}

/// Loads libnccl once (see [`load`]).
fn loaded() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(load)
        .clone()
        .map_err(|detail| Error::ExternalUnavailable {
            library: "nccl",
            detail,
        })
}

/// Looks for libnccl before asking cudarc (whose loader panics on a missing library)
/// for its version; a panic cudarc still raises is caught and reported.
fn load() -> std::result::Result<(), String> {
    if !linked_into_process() {
        load_first_of("NCCL", "NCCL", &libnccl_names())?;
    }
    let r = std::panic::catch_unwind(|| {
        let mut version = 0;
        // SAFETY: ncclGetVersion writes one int.
        unsafe { sys::ncclGetVersion(&mut version) }
    });
    match r {
        Ok(sys::ncclResult_t::ncclSuccess) => Ok(()),
        Ok(code) => Err(describe(code)),
        Err(_) => Err("the NCCL library (libnccl) could not be loaded by cudarc".into()),
    }
}

/// Names cudarc's loader tries for NCCL on this platform.
fn libnccl_names() -> Vec<String> {
    use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
    let mut names = vec![format!("{DLL_PREFIX}nccl{DLL_SUFFIX}")];
    for version in ["13", "12", "11", "10", "9", "1", "2"] {
        names.push(format!("{DLL_PREFIX}nccl{DLL_SUFFIX}.{version}"));
    }
    names
}

/// Whether NCCL's symbols are already in the process.
fn linked_into_process() -> bool {
    #[cfg(unix)]
    let this = Some(libloading::os::unix::Library::this());
    #[cfg(windows)]
    let this = libloading::os::windows::Library::this().ok();
    #[cfg(not(any(unix, windows)))]
    let this: Option<libloading::Library> = None;
    // SAFETY: the symbol is only looked up, never called through this type.
    this.is_some_and(|lib| unsafe { lib.get::<*const ()>(b"ncclGetVersion\0") }.is_ok())
}

fn nccl_dtype(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::I8 => sys::ncclDataType_t::ncclInt8,
        DType::U8 => sys::ncclDataType_t::ncclUint8,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
        DType::U32 => sys::ncclDataType_t::ncclUint32,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
        DType::U64 => sys::ncclDataType_t::ncclUint64,
    }
}

impl NcclApi for Nccl {
    type B = Cuda;
    type Comm = sys::ncclComm_t;
    const NAME: &'static str = "nccl";

    fn load() -> Result<&'static Self> {
        loaded().map(|()| &Nccl)
    }

    fn bind(dev: &CudaDevice) -> Result<()> {
        dev.context()
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))
    }

    fn unique_id(&self) -> Result<[c_char; 128]> {
        let id = result::get_uniqueid().map_err(nccl_err("ncclGetUniqueId"))?;
        Ok(id.internal)
    }

    fn init_rank(&self, world: c_int, internal: [c_char; 128], rank: c_int) -> Result<Self::Comm> {
        let (mut comm, id) = (
            std::mem::MaybeUninit::uninit(),
            sys::ncclUniqueId { internal },
        );
        // SAFETY: NCCL initialises `comm` on success.
        unsafe { result::comm_init_rank(comm.as_mut_ptr(), world, id, rank) }
            .map_err(nccl_err("ncclCommInitRank"))?;
        // SAFETY: initialised by the successful call above.
        Ok(unsafe { comm.assume_init() })
    }

    fn init_all(&self, ordinals: &[c_int]) -> Result<Vec<Self::Comm>> {
        let mut comms = vec![std::ptr::null_mut(); ordinals.len()];
        // SAFETY: `comms` has one slot per device in `ordinals`.
        unsafe {
            result::comm_init_all(comms.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr())
        }
        .map_err(nccl_err("ncclCommInitAll"))?;
        Ok(comms)
    }

    unsafe fn all_reduce(&self, comm: Self::Comm, dev: &CudaDevice, call: Call) -> Result<()> {
        let (send, recv, n, dtype, op) = call;
        let (s, r, t) = (send as *const _, recv as *mut _, nccl_dtype(dtype));
        let op = match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Prod => sys::ncclRedOp_t::ncclProd,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
            ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
            ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        };
        let stream = dev.stream().cu_stream() as _;
        // SAFETY: the caller's contract (both ranges on this device, `comm` made for it).
        unsafe { result::all_reduce(s, r, n, t, op, comm, stream) }
            .map(|_| ())
            .map_err(nccl_err("ncclAllReduce"))
    }

    unsafe fn abort(&self, comm: Self::Comm) {
        // SAFETY: the caller's contract.
        let _ = unsafe { result::comm_abort(comm) };
    }

    fn async_error(&self, comm: Self::Comm) -> Result<()> {
        let mut code = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator; NCCL writes one result code.
        let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut code) };
        for c in [r, code] {
            if c != sys::ncclResult_t::ncclSuccess && c != sys::ncclResult_t::ncclInProgress {
                return Err(nccl_err("ncclCommGetAsyncError")(result::NcclError(c)));
            }
        }
        Ok(())
    }

    fn group(&self, end: bool) -> Result<()> {
        let (r, call) = match end {
            true => (result::group_end(), "ncclGroupEnd"),
            false => (result::group_start(), "ncclGroupStart"),
        };
        r.map(drop).map_err(nccl_err(call))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Looking for NCCL leaves the panic hook alone (it stays installed and hears every
    /// other thread's panic); without NCCL the probe fails without a panic.
    #[test]
    fn loading_nccl_leaves_the_panic_hook_alone() {
        const NAME: &str = "nccl-hook-test-panicker";
        let previous = Arc::new(std::panic::take_hook());
        let (heard, from_loader) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let loader_id = std::thread::current().id();
        let (hook_previous, hook_heard, hook_loader) =
            (previous.clone(), heard.clone(), from_loader.clone());
        std::panic::set_hook(Box::new(move |info| {
            let me = std::thread::current();
            if me.name() == Some(NAME) {
                hook_heard.fetch_add(1, Ordering::SeqCst);
                return;
            }
            if me.id() == loader_id {
                hook_loader.fetch_add(1, Ordering::SeqCst);
            }
            hook_previous(info);
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let until = stop.clone();
        let panicker = std::thread::Builder::new().name(NAME.into());
        let panicker = panicker.spawn(move || {
            let mut thrown = 0usize;
            while !until.load(Ordering::SeqCst) || thrown == 0 {
                let _ = std::panic::catch_unwind(|| panic!("expected"));
                thrown += 1;
            }
            thrown
        });
        let results: Vec<_> = (0..20).map(|_| super::load()).collect();
        stop.store(true, Ordering::SeqCst);
        let thrown = panicker.unwrap().join().unwrap();
        let heard_during = heard.load(Ordering::SeqCst);
        // The hook is still ours: one more panic reaches it.
        let _ = std::thread::Builder::new()
            .name(NAME.into())
            .spawn(|| std::panic::catch_unwind(|| panic!("after")))
            .unwrap()
            .join();
        let heard_after = heard.load(Ordering::SeqCst);
        let _ = std::panic::take_hook();
        let previous = Arc::try_unwrap(previous).unwrap_or_else(|_| panic!("hook still shared"));
        std::panic::set_hook(previous);
        assert_eq!(
            heard_during,
            thrown,
            "{} of another thread's {thrown} panics never reached the installed hook",
            thrown - heard_during
        );
        assert_eq!(heard_after, thrown + 1, "the installed hook was replaced");
        if results.iter().any(|r| r.is_err()) && !super::linked_into_process() {
            // No NCCL here: the probe said so before cudarc could panic.
            assert_eq!(from_loader.load(Ordering::SeqCst), 0, "{results:?}");
            assert!(results[0].as_ref().unwrap_err().contains("looked for"));
        }
    }
}
