//! Fault injection on [`SingleController`] (feature `fault-injection`): a rank misses a
//! collective, publishes a mismatched call, starts late or fails its launch, so that
//! users can test their own error handling. Without the feature none of it exists.

#[cfg(feature = "fault-injection")]
use std::time::Duration;

use crate::backend::Backend;
#[cfg(feature = "fault-injection")]
use crate::error::{Error, Result};

#[cfg(feature = "fault-injection")]
use super::launch::ALL_RANKS;
use super::SingleController;

#[cfg(feature = "fault-injection")]
impl<B: Backend> SingleController<B> {
    /// Fault injection (feature `fault-injection`): the next collective (or barrier) is
    /// launched on every rank but `rank` (several calls leave several out), returning
    /// as if all had launched. The others give up after
    /// [`crate::CommConfig::barrier_timeout`], [`SingleController::synchronize`]
    /// reports [`Error::BarrierTimeout`] (or [`Error::PeerAborted`]), and
    /// [`SingleController::reinitialize`] recovers. For a late rank see
    /// [`SingleController::delay_rank`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use peercomm::backend::{host::Host, Backend};
    /// use peercomm::{Algorithm, AllReduceOptions, CommConfig, ReduceOp, SingleController, Error};
    ///
    /// let config = CommConfig::default().with_barrier_timeout(Some(Duration::from_millis(200)));
    /// let comm = SingleController::<Host>::new(&[0, 1], config)?;
    /// let mut bufs: Vec<_> = comm.cores().iter().map(|r| Host::alloc_from(r.device(), &[1.0f32; 8]).unwrap()).collect();
    /// let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    /// comm.miss_next(1)?;
    /// comm.all_reduce_slices_in_place(&mut bufs, &ReduceOp::Sum, &opts)?; // rank 1 never launches
    /// assert_eq!(comm.synchronize(), Err(Error::BarrierTimeout { rank: 0, block: 0, domain: 0, waiting_for: Some(1) }));
    /// comm.reinitialize()?;
    /// comm.all_reduce_slices_in_place(&mut bufs, &ReduceOp::Sum, &opts)?;
    /// comm.synchronize()?;
    /// # Ok::<(), peercomm::Error>(())
    /// ```
    pub fn miss_next(&self, rank: usize) -> Result<()> {
        self.fault_rank(rank)?.miss_next_launch();
        Ok(())
    }

    /// Fault injection (feature `fault-injection`): `rank`'s next collective publishes
    /// a call descriptor one ahead in the sequence, as a rank that made one call more.
    /// Its group finds it at the first barrier: [`Error::CallMismatch`] on every rank
    /// of the group, nothing written, [`SingleController::reinitialize`] recovers (a
    /// group of one runs as usual).
    pub fn mismatch_next(&self, rank: usize) -> Result<()> {
        self.fault_rank(rank)?.skew_next_call();
        Ok(())
    }

    /// Fault injection (feature `fault-injection`): enqueues on `rank`'s stream a
    /// kernel that spins for `delay`, touching no memory, so its next collective
    /// starts late (longer than [`crate::CommConfig::barrier_timeout`]: the others give
    /// up). Capturable in a CUDA graph.
    pub fn delay_rank(&self, rank: usize, delay: Duration) -> Result<()> {
        let endpoint = self.fault_rank(rank)?;
        let _launches = self.lock_launches();
        endpoint.launch_delay(delay)
    }

    /// Fault injection (feature `fault-injection`): the delay kernel on every rank,
    /// launched as a collective is; with a zero `delay` it times the launch path alone.
    /// Delays wait for nobody, so a failure poisons nothing: the first failing rank's
    /// error is returned.
    pub fn delay_all(&self, delay: Duration) -> Result<()> {
        let mut launches = self.lock_launches();
        let launch = |r: usize| self.ranks[r].endpoint.launch_delay(delay);
        let ranks = &ALL_RANKS[..self.world_size()];
        let outcomes = launches.run(ranks, &launch);
        if let Some(panic) = outcomes.panic {
            std::panic::resume_unwind(panic);
        }
        let mut results = outcomes.results;
        ranks
            .iter()
            .find_map(|&r| results[r].take().and_then(Result::err))
            .map_or(Ok(()), Err)
    }

    /// Fault injection (feature `fault-injection`): `rank`'s next launch fails before
    /// it is enqueued, as one the driver refused: [`Error::Backend`] (`call:
    /// "launch"`), and since other ranks were launched, the communicator is poisoned
    /// until [`SingleController::reinitialize`] (not in a world of one).
    pub fn fail_next_launch(&self, rank: usize) -> Result<()> {
        self.fault_rank(rank)?;
        self.failing_launches
            .fetch_or(1 << rank, std::sync::atomic::Ordering::AcqRel);
        Ok(())
    }

    /// The injected failure of rank `r`'s launch, if asked for (clearing the request).
    pub(super) fn injected_launch_failure(&self, r: usize) -> Result<()> {
        use std::sync::atomic::Ordering;
        let bit = 1u32 << r;
        if self.failing_launches.load(Ordering::Relaxed) & bit == 0
            || self.failing_launches.fetch_and(!bit, Ordering::AcqRel) & bit == 0
        {
            return Ok(());
        }
        Err(Error::Backend {
            backend: B::NAME,
            call: "launch",
            detail: format!(
                "fault injection: rank {r}'s launch was made to fail \
                 (SingleController::fail_next_launch)"
            ),
        })
    }

    /// Rank `rank`, or the typed error for a rank outside the world.
    fn fault_rank(&self, rank: usize) -> Result<&super::super::core::Endpoint<B>> {
        self.ranks.get(rank).map(|r| &r.endpoint).ok_or_else(|| {
            Error::InvalidDevices(format!(
                "rank {rank} is outside the world of {}",
                self.world_size()
            ))
        })
    }
}

#[cfg(not(feature = "fault-injection"))]
impl<B: Backend> SingleController<B> {
    /// Without fault injection no launch is made to fail.
    #[inline(always)]
    pub(super) fn injected_launch_failure(&self, _r: usize) -> crate::error::Result<()> {
        Ok(())
    }
}
