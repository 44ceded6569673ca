//! Fault injection on [`Comm`] (feature `fault-injection`): making this rank miss a
//! collective, publish a mismatched call, or start late, so that users can test their
//! own timeout and error handling. Without the feature nothing here exists.

#[cfg(feature = "fault-injection")]
use std::time::Duration;

use crate::backend::Backend;
#[cfg(feature = "fault-injection")]
use crate::error::Result;

use super::Comm;

impl<B: Backend> Comm<B> {
    /// Fault injection (feature `fault-injection`): this rank's next collective call
    /// (an all-reduce or a barrier) returns as if it had launched, and launches
    /// nothing. Its group peers wait for it, give up after
    /// [`crate::CommConfig::barrier_timeout`] and report the timeout from
    /// [`Comm::synchronize`]; this rank's own record then holds the
    /// [`crate::Error::PeerAborted`] a peer sent it. Every rank then calls
    /// [`Comm::reinitialize`] to recover.
    #[cfg(feature = "fault-injection")]
    pub fn miss_next(&self) {
        self.core.endpoint.miss_next_launch();
    }

    /// Fault injection (feature `fault-injection`): this rank's next collective
    /// publishes a call descriptor one ahead in the call sequence (see
    /// [`crate::SingleController::mismatch_next`]): its group gets [`crate::Error::CallMismatch`].
    #[cfg(feature = "fault-injection")]
    pub fn mismatch_next(&self) {
        self.core.endpoint.skew_next_call();
    }

    /// Fault injection (feature `fault-injection`): this rank's next collective starts
    /// `delay` late (a kernel that spins on its stream and touches no memory). See
    /// [`crate::SingleController::delay_rank`].
    #[cfg(feature = "fault-injection")]
    pub fn delay(&self, delay: Duration) -> Result<()> {
        self.core.check_usable()?;
        self.core.endpoint.launch_delay(delay)
    }
}
