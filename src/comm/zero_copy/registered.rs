//! Zero copy on the per-rank [`Comm`] with buffers the user already has:
//! [`Comm::register`] (collective) maps every rank's buffer into every peer, and from
//! then on a call whose input lies in a registered buffer reads the peers' inputs in
//! place, with the single controller's kernels: no staging copy, two-stage offered,
//! the same bits as the single controller for the same inputs. The registration lasts
//! as long as the returned [`Registered`], which owns the buffer and gives it back
//! with [`Registered::into_inner`]. A dropped `Registered` whose buffer a peer may
//! still read is kept until that is over (see [`Registered`]).
//!
//! What can be registered: on the host backend and for ranks of one process, any
//! buffer (the peers reach it at its own address); across processes, memory the driver
//! can export ([`Backend::export_range`]): `cuMemAlloc` / `hipMalloc` memory (IPC
//! handles, sent as bytes), CUDA memory from a stream-ordered pool made with the POSIX
//! file descriptor handle type and CUDA virtual memory (`cuMemCreate`) that requested
//! it (file descriptors, sent over the communicator's Unix-socket channel, Linux), the
//! host backend's shared memory (a descriptor as well), and every
//! [`crate::SymmetricBuffer`]. Memory from a pool without a shareable handle type
//! (cudarc's default allocations where the driver has pools), virtual memory made
//! without one, and heap memory cannot be: that is [`Error::CannotRegister`] on every
//! rank, and the buffer comes back in the [`RegisterError`].
//!
//! The descriptor channel: each rank listens on an abstract Unix socket of a random
//! name, gathered over the bootstrap with its process id and a random nonce; a sender
//! checks with `SO_PEERCRED` that the listener is the peer's process and of this user,
//! and a receiver checks the same of each connection as soon as it accepts it (one of
//! another user or process is closed unread), then the nonce it echoes, reading the
//! connections side by side with a 2 s deadline each, so that no other connection (the
//! socket's name is visible to every local user) can delay a registration. Both sides
//! give up after 30 s, or half of `CommConfig::bootstrap_timeout` where that is
//! shorter (a peer that dies mid-registration makes it fail on every rank instead of
//! hanging). Whether every rank got its descriptors is gathered before any rank
//! returns, so the outcome is the same on every rank; a registration that fails once
//! every rank has gathered its records uses up its number, so nothing sent for it can
//! pass for a later one's.

use std::sync::Arc;

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut, TypedBuffer};
use crate::bootstrap::ExchangeKind;
use crate::dispatch::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};

use crate::comm::per_rank::Comm;
use crate::comm::zero_copy::registry::{register_range, Registry, RetiredBuffer};

/// A buffer registered with a per-rank [`Comm`] ([`Comm::register`]): the buffer
/// itself (it passes for it in every call, and derefs to it for reads), while every
/// peer reaches it in place. Dropping it (or [`Registered::into_inner`]) ends the
/// registration on this rank; the peers' mappings of it close when they end theirs. A
/// call that pairs a registered input on one rank with an unregistered one (or another
/// place) on a peer is [`crate::CallField::Inputs`], nothing read or written.
///
/// The registered range cannot change under the registration: there is no `&mut` to
/// the buffer inside (no `DerefMut`), since safe code could then swap another buffer in
/// while the peers still map the old range. Writes go through the buffer's range
/// instead: pass `&mut registered` to a collective (it is a [`DeviceBufferMut`]), copy
/// into it with [`TypedBuffer::copy_from_host`], or on CUDA hand it to cudarc (its
/// `DevicePtrMut`, for copies and the user's kernels). To change the buffer, take it
/// back with [`Registered::into_inner`] and register again.
///
/// # When the buffer is freed
///
/// A peer's kernel reads the buffer in place until it passes its end barrier, and
/// this rank's kernel waits there for it, unless it gives up (a barrier timeout): then
/// the peer may still be reading. So memory a peer may still read is not freed before
/// this rank knows every peer finished reading it: dropping a `Registered` made by
/// [`Comm::register`] after a call that may have read registered memory in place, and
/// before the next [`Comm::synchronize`] that returns `Ok` (every end barrier of this
/// rank's calls completed), keeps the buffer (retired) until that synchronize, a
/// successful [`Comm::reinitialize`] (every rank's queued work is done), or the
/// communicator's teardown (freed where every rank met it, else parked with the rest
/// of this rank's memory; see `Drop for Comm`). [`Comm::check_errors`] does not wait,
/// so it frees nothing. A drop with no such call since the last clean synchronize
/// frees the buffer at once. [`Registered::into_inner`] and [`Comm::register_borrowed`]
/// leave that to the caller. Replays of a CUDA graph from `Comm::capture` are not
/// seen by the communicator (those of a `RegisteredGraph` are): drop a `Registered`
/// that such a graph reads after a [`Comm::synchronize`] that returns `Ok` after the
/// replays.
///
/// ```compile_fail
/// use peercomm::backend::{host::Host, Backend};
/// fn swap(reg: &mut peercomm::Registered<Host, <Host as Backend>::Buffer<f32>>,
///         other: <Host as Backend>::Buffer<f32>) {
///     // Would leave the registration on the old range: does not compile.
///     let _old = std::mem::replace(&mut **reg, other);
/// }
/// ```
pub struct Registered<B: Backend, T> {
    /// `Some` until taken back.
    buffer: Option<T>,
    registry: Arc<Registry<B>>,
    id: u64,
    /// Boxes the buffer for the registry's retired list on drop ([`Comm::register`]);
    /// `None` where the caller keeps the memory ([`Comm::register_borrowed`]).
    retire: Option<fn(T) -> RetiredBuffer>,
}

impl<B: Backend, T> std::fmt::Debug for Registered<B, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// A failed [`Comm::register`]: the error, and the buffer given back.
#[non_exhaustive]
pub struct RegisterError<T> {
    /// Why (the same on every rank).
    pub error: Error,
    /// The buffer, unregistered.
    pub buffer: T,
}

impl<T> std::fmt::Debug for RegisterError<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisterError")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<T> std::fmt::Display for RegisterError<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl<T> std::error::Error for RegisterError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<T> From<RegisterError<T>> for Error {
    fn from(e: RegisterError<T>) -> Error {
        e.error
    }
}

impl<B: Backend> Comm<B> {
    /// Registers `buffer` with every rank (collective: every rank registers one buffer
    /// of the same byte size, in the same order as its other registrations and
    /// [`Comm::alloc_symmetric`] calls). From then on a collective whose input lies in
    /// it (the whole buffer or a part at the same offset on every rank) reads it in
    /// place on the peers. Refusals are [`Error::CannotRegister`] on every rank, with
    /// the buffer given back; a buffer this rank refuses by itself (on another device
    /// than its own, or a poisoned communicator) is that error here and
    /// `CannotRegister` naming this rank on the peers, which stay in step; so is a
    /// buffer whose length in bytes no buffer can span ([`Error::SizeOverflow`] here).
    /// Needs peer memory across the whole world ([`Comm::world_path`] is `Auto`).
    ///
    /// The buffer is owned (`'static`), so that a drop while a peer may still read it
    /// can keep it until that is over (see [`Registered`]); a buffer that borrows
    /// memory owned elsewhere (a cudarc view) is registered with
    /// [`Comm::register_borrowed`].
    pub fn register<T>(&self, buffer: T) -> std::result::Result<Registered<B, T>, RegisterError<T>>
    where
        T: DeviceBuffer<B> + Send + 'static,
    {
        self.register_as(buffer, Some(|b: T| Box::new(b) as RetiredBuffer))
    }

    /// As [`Comm::register`], for a buffer that borrows memory owned elsewhere (a
    /// cudarc view, a view of the engine's own allocator): dropping the returned
    /// [`Registered`] ends the registration but cannot keep that memory. The caller
    /// keeps it (neither freed nor reused) until this rank knows every peer finished
    /// reading it: a [`Comm::synchronize`] that returns `Ok` after the last call that
    /// read it, a successful [`Comm::reinitialize`], or a teardown that every rank met
    /// ([`Comm::close`] returning `Ok`). Memory freed earlier may still be read by a
    /// peer whose kernel this rank's timed-out call left running.
    pub fn register_borrowed<T>(
        &self,
        buffer: T,
    ) -> std::result::Result<Registered<B, T>, RegisterError<T>>
    where
        T: DeviceBuffer<B>,
    {
        self.register_as(buffer, None)
    }

    fn register_as<T: DeviceBuffer<B>>(
        &self,
        buffer: T,
        retire: Option<fn(T) -> RetiredBuffer>,
    ) -> std::result::Result<Registered<B, T>, RegisterError<T>> {
        match self.register_buffer(&buffer) {
            Ok(id) => Ok(Registered {
                buffer: Some(buffer),
                registry: self.registry.clone(),
                id,
                retire,
            }),
            Err(error) => Err(RegisterError { error, buffer }),
        }
    }

    fn register_buffer<T: DeviceBuffer<B>>(&self, buffer: &T) -> Result<u64> {
        let core = &*self.core;
        // A local refusal is still gathered, so that every rank refuses together.
        let local = core
            .check_usable()
            .and_then(|_| core.check_buffer(buffer.device_ordinal(), "registered"))
            .and_then(|_| self.check_zero_copy());
        // Bytes that a buffer can span, in a range that does not wrap the address
        // space (a wrapped size would register a few bytes of a huge buffer).
        let (local, ptr, bytes) = match local.and_then(|_| {
            let meta = crate::comm::per_rank::meta(buffer);
            let bytes = meta.bytes(self.rank(), "registered")?;
            let ptr = buffer.read_ptr(core.device()).0;
            match ptr.checked_add(bytes as u64) {
                Some(_) => Ok((ptr, bytes)),
                None => Err(Error::SizeOverflow {
                    what: format!(
                        "rank {}'s registered buffer of {bytes} bytes at {ptr:#x} (past the \
                         end of the address space)",
                        self.rank()
                    ),
                }),
            }
        }) {
            Ok((ptr, bytes)) => (Ok(()), ptr, bytes),
            Err(e) => (Err(e), 0, 0),
        };
        register_range(
            &self.registry,
            core.device(),
            &self.exchanges.of(ExchangeKind::Register),
            ptr,
            bytes,
            local,
            true,
        )
    }

    /// Registered buffers need peer memory across the whole world.
    pub(crate) fn check_zero_copy(&self) -> Result<()> {
        if self.world_path() != Algorithm::Auto {
            return Err(Error::Unsupported(format!(
                "registered and symmetric buffers need peer memory across the whole world; \
                 this communicator's world runs {}",
                self.world_path().name()
            )));
        }
        Ok(())
    }

    /// Buffers registered on this rank (a [`Registered`] each, one per pool segment of
    /// the symmetric buffers, and those of live registered captures,
    /// [`crate::CaptureInputs::registered`]), and the peer allocations mapped here for
    /// them: for checking that nothing leaks.
    pub fn registrations(&self) -> (usize, usize) {
        (self.registry.len(), self.registry.imports())
    }
}

impl<B: Backend, T> Registered<B, T> {
    /// Ends the registration on this rank and gives the buffer back: it is then the
    /// caller's, and so is the rule a drop of the `Registered` would have kept. A peer
    /// may still read the buffer in place after a call of this rank that gave up (a
    /// barrier timeout), so the caller keeps it (neither frees nor writes it) until a
    /// [`Comm::synchronize`] that returns `Ok` after the last call that read it, a
    /// successful [`Comm::reinitialize`], or a teardown that every rank met
    /// ([`Comm::close`] returning `Ok`).
    pub fn into_inner(mut self) -> T {
        self.registry.remove(self.id);
        self.buffer.take().expect("present until taken")
    }
    fn get(&self) -> &T {
        self.buffer.as_ref().expect("present until taken")
    }
    /// The buffer inside, for forwarding its own writing methods only: never handed
    /// out (see the type's docs).
    fn get_mut(&mut self) -> &mut T {
        self.buffer.as_mut().expect("present until taken")
    }
}

impl<B: Backend, T> std::ops::Deref for Registered<B, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.get()
    }
}

/// Ends the registration on this rank; the buffer is freed at once, or retired while
/// a peer may still read it (see "When the buffer is freed").
impl<B: Backend, T> Drop for Registered<B, T> {
    fn drop(&mut self) {
        let Some(buffer) = self.buffer.take() else {
            return;
        };
        self.registry.remove(self.id);
        match self.retire {
            // Freed outside the registry's lock.
            Some(boxed) => drop(self.registry.retire(boxed(buffer))),
            None => drop(buffer),
        }
    }
}

// SAFETY: every answer is the wrapped buffer's, which upholds the trait's contract.
unsafe impl<B: Backend, T: DeviceBuffer<B>> DeviceBuffer<B> for Registered<B, T> {
    fn dtype(&self) -> DType {
        self.get().dtype()
    }
    fn len(&self) -> usize {
        self.get().len()
    }
    fn device_ordinal(&self) -> usize {
        self.get().device_ordinal()
    }
    fn read_ptr<'a>(&'a self, dev: &'a B::Device) -> (u64, B::Access<'a>) {
        self.get().read_ptr(dev)
    }
}

// SAFETY: as above.
unsafe impl<B: Backend, T: DeviceBufferMut<B>> DeviceBufferMut<B> for Registered<B, T> {
    fn write_ptr<'a>(&'a mut self, dev: &'a B::Device) -> (u64, B::Access<'a>) {
        self.get_mut().write_ptr(dev)
    }
}

/// Host copies into and out of the registered range (the wrapped buffer's own, which
/// writes its range and cannot replace the buffer).
impl<B: Backend, T: TypedBuffer<B>> TypedBuffer<B> for Registered<B, T> {
    type Elem = T::Elem;
    fn copy_from_host(&mut self, dev: &B::Device, src: &[T::Elem]) -> Result<()> {
        self.get_mut().copy_from_host(dev, src)
    }
    fn to_host(&self, dev: &B::Device) -> Result<Vec<T::Elem>> {
        self.get().to_host(dev)
    }
}

#[cfg(feature = "cuda")]
mod cuda_traits {
    //! cudarc's slice traits for registered buffers, forwarded to the wrapped one, so
    //! that cudarc's copies and the user's kernels write the registered range (the
    //! buffer itself is never handed out mutably).
    use std::sync::Arc;

    use cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

    use super::Registered;
    use crate::backend::cuda::Cuda;

    impl<E, T: DeviceSlice<E>> DeviceSlice<E> for Registered<Cuda, T> {
        fn len(&self) -> usize {
            self.get().len()
        }
        fn stream(&self) -> &Arc<CudaStream> {
            self.get().stream()
        }
    }

    impl<E, T: DevicePtr<E>> DevicePtr<E> for Registered<Cuda, T> {
        fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
            self.get().device_ptr(stream)
        }
    }

    impl<E, T: DevicePtrMut<E>> DevicePtrMut<E> for Registered<Cuda, T> {
        fn device_ptr_mut<'a>(
            &'a mut self,
            stream: &'a CudaStream,
        ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
            self.get_mut().device_ptr_mut(stream)
        }
    }
}
