//! Fault injection on [`Communicator`] (feature `fault-injection`): making a rank miss
//! a collective on purpose, so that users can test their own timeout handling.
//! Without the feature nothing here is public and no launch is ever left out.

use crate::backend::Backend;
#[cfg(feature = "fault-injection")]
use crate::error::{Error, Result};

use super::Communicator;

impl<B: Backend> Communicator<B> {
    /// Fault injection (feature `fault-injection`): the next collective launched
    /// through this communicator (an all-reduce or a barrier) is launched on every
    /// rank but `rank`. The others wait for it, give up after
    /// [`crate::CommConfig::barrier_timeout`], and [`Communicator::synchronize`]
    /// reports the timeout ([`Error::BarrierTimeout`], or [`Error::PeerAborted`] on a
    /// rank its peer told); then [`Communicator::reinitialize`] recovers. The call
    /// returns as if every rank had launched. Calling it for several ranks before one
    /// collective leaves all of them out. To make a rank late rather than absent, see
    /// [`Communicator::delay_rank`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use peercomm::backend::{host::Host, Backend};
    /// use peercomm::{Algorithm, AllReduceOptions, CommConfig, Communicator, Error};
    ///
    /// let config = CommConfig { barrier_timeout: Some(Duration::from_millis(200)), ..CommConfig::default() };
    /// let comm = Communicator::<Host>::new(&[0, 1], config)?;
    /// let mut bufs: Vec<_> = comm.ranks().iter().map(|r| Host::alloc_from(r.device(), &[1.0f32; 8]).unwrap()).collect();
    /// let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    /// comm.miss_next(1)?;
    /// comm.all_reduce_sum_slices_in_place(&mut bufs, &opts)?; // rank 1 never launches
    /// assert_eq!(comm.synchronize(), Err(Error::BarrierTimeout { rank: 0, block: 0, domain: 0, waiting_for: Some(1) }));
    /// comm.reinitialize()?;
    /// comm.all_reduce_sum_slices_in_place(&mut bufs, &opts)?;
    /// comm.synchronize()?;
    /// # Ok::<(), peercomm::Error>(())
    /// ```
    #[cfg(feature = "fault-injection")]
    pub fn miss_next(&self, rank: usize) -> Result<()> {
        self.fault_rank(rank)?.miss_next_launch();
        Ok(())
    }

    /// Fault injection (feature `fault-injection`): `rank`'s next collective publishes
    /// a call descriptor one ahead in the call sequence, as a rank that made one call
    /// more than its peers would. The call's group finds the difference at its first
    /// barrier (or Lamport header): [`Communicator::synchronize`] returns
    /// [`Error::CallMismatch`] and [`Communicator::rank_errors`] shows it on every rank
    /// of the group, nothing is written, and [`Communicator::reinitialize`] recovers. A
    /// group of one has nobody to compare with: its call runs as usual.
    #[cfg(feature = "fault-injection")]
    pub fn mismatch_next(&self, rank: usize) -> Result<()> {
        self.fault_rank(rank)?.skew_next_call();
        Ok(())
    }

    /// Rank `rank`, or the typed error for a rank outside the world.
    #[cfg(feature = "fault-injection")]
    fn fault_rank(&self, rank: usize) -> Result<&super::super::core::Endpoint<B>> {
        self.ranks.get(rank).map(|r| &r.endpoint).ok_or_else(|| {
            Error::InvalidDevices(format!(
                "rank {rank} is outside the world of {}",
                self.world_size()
            ))
        })
    }
}
