//! [`Comm::device_comm`]: one rank's view of a symmetric or registered buffer for
//! kernels of the engine's own (the device API, `include/peercomm_device.h`).

use crate::backend::{Backend, DeviceBuffer};
use crate::bootstrap::{Bootstrap, ExchangeKind};
use crate::device::DeviceComm;
use crate::error::{Error, Result};
use crate::signal::{DeviceCommArgs, USER_DOMAIN};

use super::records::{decode, decode_all, encode, refusal_of, refused, DEVICE_COMM_RECORD};
use crate::comm::core::call::encode_user;
use crate::comm::core::planning::InputPlace;
use crate::comm::per_rank::{meta, Comm};

impl<B: Backend> Comm<B> {
    /// The [`DeviceComm`] of `buffer` for kernels of your own (collective: every rank
    /// passes its buffer of the same registration, at the same offset and of the same
    /// bytes: a symmetric buffer allocated alike, or a range of a buffer registered with
    /// [`Comm::register`]). Launch such a kernel on this rank's stream, the same kernel
    /// with the same grid on every rank; its barriers count in a bank of their own, so
    /// they never disturb the library's collectives, nor these theirs. A timeout or
    /// abort in it comes back from [`Comm::synchronize`] or [`Comm::check_errors`] as
    /// the same typed errors as the collectives', naming the peer.
    ///
    /// A buffer that is neither symmetric nor registered, or whose registration, offset
    /// or size differs on some rank, is [`Error::CannotRegister`] on every rank, naming
    /// the first rank that differs. Keep the buffer alive (and registered) until a
    /// [`Comm::synchronize`] after the last kernel that used the value. Peer memory
    /// across the whole world is needed (ranks of one host).
    pub fn device_comm<T: DeviceBuffer<B> + ?Sized>(&self, buffer: &T) -> Result<DeviceComm> {
        let core = &*self.core;
        let (rank, world) = (self.rank(), self.world_size());
        // This rank's own refusals (poisoned, another device, hosts apart) come back as
        // they are; a buffer in no registered range is told to every rank.
        let local = core
            .check_usable()
            .and_then(|_| core.check_buffer(buffer.device_ordinal(), "device_comm"))
            .and_then(|_| meta(buffer).bytes(rank, "device_comm"))
            .and_then(|bytes| match core.settings.world == world {
                true => Ok(bytes),
                false => Err(Error::Unsupported(
                    "device_comm between hosts (peer memory serves one host)".into(),
                )),
            });
        let found = local.as_ref().ok().and_then(|&bytes| {
            let (ptr, _access) = buffer.read_ptr(core.device());
            let place = self.registry.lookup(ptr, bytes)?;
            match place.place {
                InputPlace::Registered {
                    registration,
                    offset,
                } => Some((place, [1, registration, offset, bytes as u64])),
                InputPlace::Staged => None,
            }
        });
        let words = found.as_ref().map_or([0; 4], |f| f.1);
        let record = encode(DEVICE_COMM_RECORD, &words, refusal_of(&local).as_bytes());
        let gathered = self
            .exchanges
            .of(ExchangeKind::DeviceComm)
            .all_gather(&record);
        let places = decode_all(gathered, local.map(drop), |r, b| {
            let (w, text) = decode::<4>(r, b, DEVICE_COMM_RECORD)?;
            match text.is_empty() {
                true => Ok(w),
                false => Err(refused(r, String::from_utf8_lossy(text).into_owned())),
            }
        })?;
        if let Some(r) = places.iter().position(|p| p[0] == 0) {
            let reason = "its buffer is neither symmetric (alloc_symmetric) nor in a \
                          registered range (register)";
            return Err(refused(r, reason.into()));
        }
        if let Some(r) = places.iter().position(|p| *p != places[0]) {
            let reason = format!(
                "its buffer (registration, offset, bytes) is {:?} where rank 0's is {:?}: \
                 device_comm takes the same buffer on every rank",
                &places[r][1..],
                &places[0][1..]
            );
            return Err(refused(r, reason));
        }
        let (found, [_, registration, offset, bytes]) = found.expect("found on every rank");
        let e = &core.endpoint;
        let mut args = DeviceCommArgs {
            signals: [0; crate::signal::MAX_GPUS],
            buffers: found.inputs,
            bytes,
            timeout_ns: core.settings.timeout_ns(),
            group_rank: rank as u32,
            group_width: world as u32,
            domain: USER_DOMAIN,
            world_rank: rank as u32,
            call: encode_user(world, registration, offset, bytes),
        };
        args.signals[..world].copy_from_slice(&e.peer_signals[..world]);
        Ok(DeviceComm(args))
    }
}

impl Comm<crate::backend::host::Host> {
    /// Launches a kernel of your own, written in Rust, over `comm` on this rank's
    /// stream: `kernel` runs once per block of `blocks` (each on a thread of its own, as
    /// the host backend runs every kernel), with the device header's barriers
    /// ([`crate::backend::host::HostBlock::barrier`]), timeout, abort word and error
    /// records over the same signals. The device API's host contract: the logic of an
    /// engine's GPU kernel, checked without a GPU. As on a GPU, launch the same kernel
    /// with the same grid on every rank; a stopped wait comes back from
    /// [`Comm::synchronize`]. `comm` must be this communicator's
    /// ([`Comm::device_comm`]), else [`Error::Unsupported`].
    pub fn launch_host_kernel<F>(&self, comm: &DeviceComm, blocks: u32, kernel: F) -> Result<()>
    where
        F: Fn(
                &crate::backend::host::HostBlock,
            ) -> std::result::Result<(), crate::backend::host::Stopped>
            + Send
            + Sync
            + 'static,
    {
        let core = &*self.core;
        core.check_usable()?;
        let mine = comm.group_rank() == self.rank()
            && comm.0.signals[self.rank()] == core.endpoint.peer_signals[self.rank()];
        if !mine {
            return Err(Error::Unsupported(
                "a DeviceComm of another communicator or rank".into(),
            ));
        }
        // The grid the collectives' `blocks` option takes (the signal's counters).
        core.settings.blocks(Some(blocks), || blocks)?;
        // SAFETY: `comm` is this communicator's (checked above), whose drop drains the
        // stream the kernel runs on before its signals go.
        unsafe { crate::backend::host::launch_user_kernel(core.device(), comm, blocks, kernel) };
        Ok(())
    }
}
