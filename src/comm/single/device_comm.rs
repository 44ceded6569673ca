//! [`SingleController::device_comms`]: every rank's view of the engine's buffers for
//! kernels of its own (the device API), and the host contract's launch on every rank.

use crate::backend::{Backend, DeviceBuffer};
use crate::device::DeviceComm;
use crate::error::{Error, Result};
use crate::signal::{DeviceCommArgs, MAX_GPUS, USER_DOMAIN};

use super::SingleController;
use crate::comm::core::call::encode_user;

impl<B: Backend> SingleController<B> {
    /// Each rank's [`DeviceComm`] over `buffers` (one per rank, on its device, of the
    /// same bytes), for kernels of your own: rank r's value reaches every rank's buffer
    /// in place (one process: the peers map each other's memory) and synchronises in the
    /// user kernels' barrier bank. Launch on rank r's stream the kernel with rank r's
    /// value, the same kernel and grid on every rank. A wrong count, another length, a
    /// buffer on another device or one a peer cannot reach is an error, nothing made.
    pub fn device_comms(&self, buffers: &[&dyn DeviceBuffer<B>]) -> Result<Vec<DeviceComm>> {
        let world = self.ranks.len();
        if buffers.len() != world {
            return Err(Error::LengthMismatch {
                rank: 0,
                what: format!("{} buffers for {world} ranks", buffers.len()),
            });
        }
        let mut ptrs = [0u64; MAX_GPUS];
        let mut bytes = 0;
        for (r, (rank, b)) in self.ranks.iter().zip(buffers).enumerate() {
            rank.check_usable()?;
            rank.check_buffer(b.device_ordinal(), "device_comms")?;
            let n = crate::comm::per_rank::meta(*b).bytes(r, "device_comms")?;
            if r > 0 && n != bytes {
                let what = format!("{n} bytes where rank 0's buffer has {bytes}");
                return Err(Error::LengthMismatch { rank: r, what });
            }
            bytes = n;
            ptrs[r] = b.read_ptr(rank.device()).0;
        }
        for (r, rank) in self.ranks.iter().enumerate() {
            for peer in self
                .ranks
                .iter()
                .enumerate()
                .filter(|&(q, _)| q != r)
                .map(|p| p.1)
            {
                let peer_device = B::ordinal(peer.device());
                if let Some(detail) = B::peer_access_problem(rank.device(), ptrs[r], peer_device)? {
                    return Err(Error::BufferNotPeerAccessible {
                        rank: r,
                        which: "device_comms",
                        peer_device,
                        detail,
                    });
                }
            }
        }
        let call = encode_user(world, u64::MAX >> 2, 0, bytes as u64);
        let timeout_ns = self.ranks[0].settings.timeout_ns();
        Ok((0..world)
            .map(|r| {
                let mut signals = [0u64; MAX_GPUS];
                signals[..world].copy_from_slice(&self.ranks[r].endpoint.peer_signals[..world]);
                DeviceComm(DeviceCommArgs {
                    signals,
                    buffers: ptrs,
                    bytes: bytes as u64,
                    timeout_ns,
                    group_rank: r as u32,
                    group_width: world as u32,
                    domain: USER_DOMAIN,
                    world_rank: r as u32,
                    call,
                })
            })
            .collect())
    }
}

impl SingleController<crate::backend::host::Host> {
    /// Launches a kernel of your own, written in Rust, on every rank: `kernel` runs once
    /// per block of `blocks` on rank r's stream over `comms[r]` (from
    /// [`SingleController::device_comms`]), as `Comm::launch_host_kernel` does for one
    /// rank. A stopped wait comes back from [`SingleController::synchronize`].
    pub fn launch_host_kernels<F>(&self, comms: &[DeviceComm], blocks: u32, kernel: F) -> Result<()>
    where
        F: Fn(
                &crate::backend::host::HostBlock,
            ) -> std::result::Result<(), crate::backend::host::Stopped>
            + Clone
            + Send
            + Sync
            + 'static,
    {
        let world = self.ranks.len();
        let ours = comms.len() == world
            && comms.iter().enumerate().all(|(r, c)| {
                c.group_rank() == r && c.0.signals[r] == self.ranks[r].endpoint.peer_signals[r]
            });
        if !ours {
            return Err(Error::Unsupported(
                "device communicators of another single controller".into(),
            ));
        }
        // The grid the collectives' `blocks` option takes (the signal's counters).
        self.ranks[0].settings.blocks(Some(blocks), || blocks)?;
        for (rank, comm) in self.ranks.iter().zip(comms) {
            rank.check_usable()?;
            // SAFETY: `comm` is this controller's (checked above), whose drop drains
            // every rank's stream before the signals go.
            unsafe {
                crate::backend::host::launch_user_kernel(
                    rank.device(),
                    comm,
                    blocks,
                    kernel.clone(),
                )
            };
        }
        Ok(())
    }
}
