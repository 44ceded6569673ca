//! One implementation of [`ExternalLibrary`] for the libraries with NCCL's C API: NCCL
//! (through cudarc) and RCCL (opened at run time) each give the calls ([`NcclApi`]).

use std::ffi::{c_char, c_int};
use std::marker::PhantomData;
use std::sync::Arc;

use super::{Call, ExternalAllReduce, ExternalLibrary};
use crate::backend::Backend;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};

/// The calls of NCCL's C API peercomm makes, each mapping its own errors.
pub(crate) trait NcclApi: Send + Sync + 'static {
    type B: Backend;
    /// `ncclComm_t`.
    type Comm: Copy;
    const NAME: &'static str;
    /// The loaded library, or [`crate::Error::ExternalUnavailable`].
    fn load() -> Result<&'static Self>;
    /// Makes `dev` current on this thread.
    fn bind(dev: &Dev<Self>) -> Result<()>;
    fn unique_id(&self) -> Result<[c_char; 128]>;
    fn init_rank(&self, world: c_int, id: [c_char; 128], rank: c_int) -> Result<Self::Comm>;
    fn init_all(&self, ordinals: &[c_int]) -> Result<Vec<Self::Comm>>;
    /// # Safety
    /// As [`ExternalAllReduce::all_reduce`]; `comm` was made for `dev`.
    unsafe fn all_reduce(&self, comm: Self::Comm, dev: &Dev<Self>, call: Call) -> Result<()>;
    /// # Safety
    /// `comm` is live and not used again.
    unsafe fn abort(&self, comm: Self::Comm);
    /// An error unless the call and the code it wrote are success or in progress.
    fn async_error(&self, comm: Self::Comm) -> Result<()>;
    /// `ncclGroupStart`, or `ncclGroupEnd` when `end`.
    fn group(&self, end: bool) -> Result<()>;
}

type Dev<L> = <<L as NcclApi>::B as Backend>::Device;

/// The [`ExternalLibrary`] of `L`.
pub(crate) struct NcclLike<L>(pub(crate) PhantomData<L>);

/// One rank's communicator; aborted on drop (never blocking, never panicking).
struct Handle<L: NcclApi> {
    api: &'static L,
    comm: L::Comm,
}

// SAFETY: a communicator may be used from any thread; peercomm's communicators
// serialise the calls on one rank, as NCCL requires.
unsafe impl<L: NcclApi> Send for Handle<L> {}
// SAFETY: as above.
unsafe impl<L: NcclApi> Sync for Handle<L> {}

impl<L: NcclApi> Drop for Handle<L> {
    fn drop(&mut self) {
        // SAFETY: initialised, dropped once, after its owner waited for its stream.
        unsafe { self.api.abort(self.comm) };
    }
}

impl<L: NcclApi> ExternalAllReduce<L::B> for Handle<L> {
    fn library(&self) -> &'static str {
        L::NAME
    }

    unsafe fn all_reduce(&self, dev: &Dev<L>, call: Call) -> Result<()> {
        L::bind(dev)?;
        // SAFETY: the caller's contract; the communicator was made for this device.
        unsafe { (self.api).all_reduce(self.comm, dev, call) }
    }

    fn take_async_error(&self) -> Result<()> {
        self.api.async_error(self.comm)
    }
}

impl<L: NcclApi> ExternalLibrary<L::B> for NcclLike<L> {
    fn name(&self) -> &'static str {
        L::NAME
    }

    fn check_available(&self) -> Result<()> {
        L::load().map(|_| ())
    }

    fn per_rank(
        &self,
        dev: &Dev<L>,
        bootstrap: Arc<dyn Bootstrap>,
        members: &[usize],
    ) -> Result<Box<dyn ExternalAllReduce<L::B>>> {
        let (api, id, index) =
            exchange_unique_id(L::NAME, &*bootstrap, members, L::load(), L::unique_id)?;
        L::bind(dev)?;
        let comm = api.init_rank(members.len() as c_int, id, index as c_int)?;
        Ok(Box::new(Handle { api, comm }))
    }

    fn single_controller(
        &self,
        devices: &[&Dev<L>],
    ) -> Result<Vec<Box<dyn ExternalAllReduce<L::B>>>> {
        let api = L::load()?;
        let ordinals: Vec<c_int> = devices.iter().map(|d| L::B::ordinal(d) as c_int).collect();
        Ok(api
            .init_all(&ordinals)?
            .into_iter()
            .map(|comm| Box::new(Handle { api, comm }) as Box<dyn ExternalAllReduce<L::B>>)
            .collect())
    }

    fn group_start(&self) -> Result<()> {
        L::load()?.group(false)
    }

    fn group_end(&self) -> Result<()> {
        L::load()?.group(true)
    }
}

/// The group leader's 128-byte unique id (made by `make_id` on the leader,
/// `members[0]`), gathered in one all-gather, and this rank's index in `members`.
/// Every rank takes part, even one whose library did not load (`loaded`), so that
/// the others fail with a bootstrap error instead of waiting.
fn exchange_unique_id<T: Copy>(
    library: &'static str,
    bootstrap: &dyn Bootstrap,
    members: &[usize],
    loaded: Result<T>,
    make_id: impl FnOnce(T) -> Result<[c_char; 128]>,
) -> Result<(T, [c_char; 128], usize)> {
    let (me, leader) = (bootstrap.rank(), members[0]);
    let mine: Vec<u8> = match (&loaded, me == leader) {
        (Ok(lib), true) => make_id(*lib)?.iter().map(|&c| c as u8).collect(),
        _ => Vec::new(),
    };
    let ids = bootstrap.all_gather(&mine)?;
    let lib = loaded?;
    if ids[leader].len() != 128 {
        return Err(Error::External {
            library,
            call: "ncclCommInitRank",
            detail: format!(
                "rank {leader} could not make an {} unique id",
                library.to_uppercase()
            ),
        });
    }
    let id = std::array::from_fn(|i| ids[leader][i] as c_char);
    let index = members.iter().position(|&m| m == me).expect("member");
    Ok((lib, id, index))
}
