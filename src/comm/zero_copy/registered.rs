//! Zero copy with buffers the user already has ([`Comm::register`]). Any buffer can be
//! registered on the host backend and among ranks of one process; across processes,
//! memory the driver can export ([`Backend::export_range`]: `cuMemAlloc` / `hipMalloc`,
//! a CUDA pool or `cuMemCreate` memory with the POSIX file-descriptor handle type, the
//! host backend's shared memory, every [`crate::SymmetricBuffer`]). Anything else is
//! [`Error::CannotRegister`] on every rank, the buffer given back.

use std::sync::Arc;

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut, TypedBuffer};
use crate::bootstrap::ExchangeKind;
use crate::dispatch::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};

use crate::comm::per_rank::Comm;
use crate::comm::zero_copy::registry::{register_range, Registry, RetiredBuffer};

/// A buffer registered with a per-rank [`Comm`] ([`Comm::register`]): it passes for
/// the buffer in every call (and derefs to it for reads) while every peer reaches it
/// in place. Dropping it (or [`Registered::into_inner`]) ends the registration on this
/// rank. A call pairing a registered input with another place on a peer is
/// [`crate::CallField::Inputs`], nothing read or written.
///
/// There is no `DerefMut` (safe code could swap another buffer in while the peers map
/// the old range): write through the range (`&mut registered` in a collective,
/// [`TypedBuffer::copy_from_host`], cudarc's `DevicePtrMut`), or take it back.
///
/// # When the buffer is freed
///
/// A kernel that gives up at its end barrier (a timeout) may leave a peer still
/// reading. So a `Registered` dropped after a call that may have read registered memory
/// in place is kept until the next [`Comm::synchronize`] that returns `Ok`, a
/// successful [`Comm::reinitialize`], or the teardown (freed where every rank met it,
/// else parked); otherwise it is freed at once. [`Registered::into_inner`] and
/// [`Comm::register_borrowed`] leave that wait to the caller. Replays of a plain
/// `Comm::capture` graph are not seen (a `RegisteredGraph`'s are): drop a buffer such
/// a graph reads only after a clean synchronize following the replays.
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
#[derive(thiserror::Error)]
#[error("{error}")]
#[non_exhaustive]
pub struct RegisterError<T> {
    /// Why (the same on every rank).
    #[source]
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

/// What [`Comm::register`] returns.
type RegisterResult<B, T> = std::result::Result<Registered<B, T>, RegisterError<T>>;

impl<T> From<RegisterError<T>> for Error {
    fn from(e: RegisterError<T>) -> Error {
        e.error
    }
}

impl<B: Backend> Comm<B> {
    /// Registers `buffer` with every rank (collective: one buffer of the same byte size
    /// on every rank, in the same order as the other registrations and
    /// [`Comm::alloc_symmetric`] calls), so that a collective whose input lies in it at
    /// the same offset on every rank reads it in place. Refusals are
    /// [`Error::CannotRegister`] on every rank, the buffer given back; one of this rank's
    /// own (another device, poisoned, [`Error::SizeOverflow`]) is that error here. Needs
    /// peer memory across the whole world. The buffer is owned so that a drop can keep
    /// it while a peer may still read it; for views use [`Comm::register_borrowed`].
    pub fn register<T>(&self, buffer: T) -> RegisterResult<B, T>
    where
        T: DeviceBuffer<B> + Send + 'static,
    {
        self.register_as(buffer, Some(|b: T| Box::new(b) as RetiredBuffer))
    }

    /// As [`Comm::register`], for a buffer that borrows memory owned elsewhere (a
    /// cudarc view): the caller keeps that memory (neither freed nor reused) until a
    /// [`Comm::synchronize`] that returns `Ok` after the last call that read it, a
    /// successful [`Comm::reinitialize`], or [`Comm::close`] returning `Ok`.
    pub fn register_borrowed<T: DeviceBuffer<B>>(&self, buffer: T) -> RegisterResult<B, T> {
        self.register_as(buffer, None)
    }

    fn register_as<T: DeviceBuffer<B>>(
        &self,
        buffer: T,
        retire: Option<fn(T) -> RetiredBuffer>,
    ) -> RegisterResult<B, T> {
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
        // A local refusal is still gathered, so that every rank refuses together. The
        // range must not wrap (that would register a few bytes of a huge buffer).
        let local = core
            .check_usable()
            .and_then(|_| core.check_buffer(buffer.device_ordinal(), "registered"))
            .and_then(|_| self.check_zero_copy())
            .and_then(|_| {
                let meta = crate::comm::per_rank::meta(buffer);
                let bytes = meta.bytes(self.rank(), "registered")?;
                let ptr = buffer.read_ptr(core.device()).0;
                let overflow = || Error::SizeOverflow {
                    what: format!(
                        "rank {}'s registered buffer of {bytes} bytes at {ptr:#x} (past the \
                         end of the address space)",
                        self.rank()
                    ),
                };
                let end = ptr.checked_add(bytes as u64);
                end.map(|_| (ptr, bytes)).ok_or_else(overflow)
            });
        let (ptr, bytes) = *local.as_ref().unwrap_or(&(0, 0));
        register_range(
            &self.registry,
            core.device(),
            &self.exchanges.of(ExchangeKind::Register),
            ptr,
            bytes,
            local.map(drop),
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

    /// Registrations on this rank (a [`Registered`] each, one per symmetric pool
    /// segment, those of live registered captures) and the peer allocations mapped for
    /// them: for checking that nothing leaks.
    pub fn registrations(&self) -> (usize, usize) {
        (self.registry.len(), self.registry.imports())
    }
}

impl<B: Backend, T> Registered<B, T> {
    /// Ends the registration on this rank and gives the buffer back: the caller neither
    /// frees nor writes it until the rule of [`Comm::register_borrowed`] holds.
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

/// Host copies into and out of the registered range (the wrapped buffer's own).
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
    //! cudarc's slice traits for registered buffers, forwarded to the wrapped one.
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
