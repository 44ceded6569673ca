//! External collectives: a library (NCCL, RCCL, or the [`host`] stand-in that CI tests
//! the routing with) runs the all-reduce where peer memory cannot serve (no peer access,
//! several hosts, more than [`crate::MAX_GPUS`] ranks), visibly (see [`Fallback`]).

use std::any::Any;
use std::sync::Arc;

use crate::backend::host::Host;
use crate::backend::Backend;
use crate::bootstrap::Bootstrap;
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;

/// Chained setters of a config: `fn name(arg: T) => field = value;` each.
macro_rules! setters {
    ($($(#[$m:meta])* fn $name:ident($arg:ident: $t:ty) => $field:ident = $value:expr;)*) => {
        $($(#[$m])* pub fn $name(mut self, $arg: $t) -> Self {
            self.$field = $value;
            self
        })*
    };
}
pub(crate) use setters;

pub mod host;
pub(crate) mod local;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(any(feature = "cuda", feature = "hip"))]
mod nccl_api;
#[cfg(feature = "hip")]
pub mod rccl;
#[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
mod simulate;
pub(crate) mod sub;

#[cfg(feature = "fault-injection")]
pub use simulate::Simulation;
#[cfg(not(feature = "fault-injection"))]
pub(crate) use simulate::Simulation;

/// What a communicator does where peer memory cannot serve it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Fallback {
    /// Hand those calls to the external library (NCCL, RCCL), visibly: they return
    /// [`crate::Algorithm::Nccl`] or [`crate::Algorithm::Hierarchical`].
    #[default]
    External,
    /// "Peer memory or nothing": a communicator peer memory cannot serve is a typed
    /// error at creation.
    Refuse,
}

/// Whether calls that peer memory could serve go to the external library by size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SizeRouting {
    /// Never (the default): results do not depend on the message size.
    #[default]
    Never,
    /// Where the dispatch table (`external_from`) says the external library is faster;
    /// the last bits of a result can then change with the message size.
    Table,
    /// Messages of at least this many bytes per rank (whole-world calls); same caveat.
    Above(usize),
}

/// The fallback settings of a communicator (part of [`crate::CommConfig`]; the same on
/// every rank).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct FallbackConfig {
    /// Fall back or refuse where peer memory cannot serve.
    pub fallback: Fallback,
    /// Opt-in routing by message size (default: never).
    pub by_size: SizeRouting,
}

impl FallbackConfig {
    /// "Peer memory or nothing": no fallback, no routing by size.
    pub fn peer_memory_only() -> Self {
        FallbackConfig {
            fallback: Fallback::Refuse,
            by_size: SizeRouting::Never,
        }
    }
    setters! {
        /// With [`FallbackConfig::fallback`].
        fn with_fallback(fallback: Fallback) => fallback = fallback;
        /// With [`FallbackConfig::by_size`].
        fn with_by_size(by_size: SizeRouting) => by_size = by_size;
    }
}

/// The arguments of one external all-reduce: send and receive addresses, elements,
/// element type, operator.
pub(crate) type Call = (u64, u64, usize, DType, ReduceOp);

/// One rank's handle on an external all-reduce over its group, as `ncclAllReduce`.
pub trait ExternalAllReduce<B: Backend>: Send + Sync {
    /// The library's name (`"nccl"`, `"rccl"`, `"host"`).
    #[cfg_attr(not(feature = "unstable"), allow(dead_code))]
    fn library(&self) -> &'static str;

    /// Enqueues the group's reduction `call` (send and receive addresses, which may be
    /// equal, element count, type, operator) on `dev`'s stream, in the library's own
    /// arithmetic. Every rank makes the same calls in order.
    ///
    /// # Safety
    /// Both addresses must hold at least the call's elements on `dev`, valid until the
    /// work enqueued on its stream has finished; `dev` is the device this handle was
    /// made for.
    unsafe fn all_reduce(&self, dev: &B::Device, call: Call) -> Result<()>;

    /// An error found after a call returned (reported once, by `synchronize`).
    fn take_async_error(&self) -> Result<()> {
        Ok(())
    }
}

/// A vendor's external collective library: makes the per-rank handles.
pub trait ExternalLibrary<B: Backend>: Send + Sync {
    /// The library's name (`"nccl"`, `"rccl"`, `"host"`).
    #[cfg_attr(not(feature = "unstable"), allow(dead_code))]
    fn name(&self) -> &'static str;

    /// Whether the library can be used here ([`crate::Error::ExternalUnavailable`] if not).
    #[cfg_attr(not(feature = "unstable"), allow(dead_code))]
    fn check_available(&self) -> Result<()>;

    /// This rank's handle for the group of world ranks `members` (in group order).
    /// Every world rank calls it at once, each with its own group (one all-gather).
    fn per_rank(
        &self,
        dev: &B::Device,
        bootstrap: Arc<dyn Bootstrap>,
        members: &[usize],
    ) -> Result<Box<dyn ExternalAllReduce<B>>>;

    /// One handle per device (rank i = `devices[i]`) for a single controller, called
    /// between [`ExternalLibrary::group_start`] and [`ExternalLibrary::group_end`].
    fn single_controller(
        &self,
        devices: &[&B::Device],
    ) -> Result<Vec<Box<dyn ExternalAllReduce<B>>>>;

    /// Starts a batch of calls on several handles from one thread (`ncclGroupStart`).
    fn group_start(&self) -> Result<()> {
        Ok(())
    }

    /// Ends the batch: the calls are launched together (`ncclGroupEnd`).
    fn group_end(&self) -> Result<()> {
        Ok(())
    }
}

/// The external collective library of a backend (NCCL, RCCL, the host stand-in).
///
/// ```
/// use peercomm::backend::host::Host;
/// use peercomm::unstable::HasExternalLibrary; // feature `unstable`
///
/// let library = Host::external_library();
/// assert_eq!(library.name(), "host");
/// library.check_available()?;
/// # Ok::<(), peercomm::Error>(())
/// ```
pub trait HasExternalLibrary: Backend {
    /// The backend's external library.
    fn external_library() -> &'static dyn ExternalLibrary<Self>;
}

/// The external library of backend `B`, or [`Unavailable`] (needs only `B: Backend`).
///
/// ```
/// use peercomm::backend::host::Host;
///
/// assert_eq!(peercomm::unstable::library_of::<Host>().name(), "host"); // feature `unstable`
/// ```
pub fn library_of<B: Backend>() -> &'static dyn ExternalLibrary<B> {
    /// `L`'s library when `L` is `B` (a type comparison through [`Any`]).
    fn registered<L: HasExternalLibrary, B: Backend>() -> Option<&'static dyn ExternalLibrary<B>> {
        let library: &'static dyn ExternalLibrary<L> = L::external_library();
        (&library as &dyn Any)
            .downcast_ref::<&'static dyn ExternalLibrary<B>>()
            .copied()
    }
    static NONE: Unavailable = Unavailable {
        library: "none",
        reason: "peercomm knows no external library for this backend",
    };
    let found = registered::<Host, B>();
    #[cfg(feature = "cuda")]
    let found = found.or_else(registered::<crate::backend::cuda::Cuda, B>);
    #[cfg(feature = "hip")]
    let found = found.or_else(registered::<crate::backend::hip::Hip, B>);
    found.unwrap_or(&NONE)
}

/// A library that is not there: every use is [`crate::Error::ExternalUnavailable`].
pub struct Unavailable {
    /// The library's name.
    pub library: &'static str,
    /// Why it is not there.
    pub reason: &'static str,
}

impl Unavailable {
    fn error(&self) -> crate::Error {
        crate::Error::ExternalUnavailable {
            library: self.library,
            detail: self.reason.into(),
        }
    }
}

impl<B: Backend> ExternalLibrary<B> for Unavailable {
    fn name(&self) -> &'static str {
        self.library
    }
    fn check_available(&self) -> Result<()> {
        Err(self.error())
    }
    fn per_rank(
        &self,
        _dev: &B::Device,
        _bootstrap: Arc<dyn Bootstrap>,
        _members: &[usize],
    ) -> Result<Box<dyn ExternalAllReduce<B>>> {
        Err(self.error())
    }
    fn single_controller(
        &self,
        _devices: &[&B::Device],
    ) -> Result<Vec<Box<dyn ExternalAllReduce<B>>>> {
        Err(self.error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every backend of the crate finds its own library through `library_of`.
    #[test]
    fn library_of_finds_each_backends_library() {
        assert_eq!(library_of::<Host>().name(), "host");
        #[cfg(feature = "cuda")]
        assert_eq!(library_of::<crate::backend::cuda::Cuda>().name(), "nccl");
        #[cfg(feature = "hip")]
        assert_eq!(library_of::<crate::backend::hip::Hip>().name(), "rccl");
    }
}
