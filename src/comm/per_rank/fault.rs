//! Fault injection on [`Comm`] (feature `fault-injection`): see
//! `crate::Communicator::miss_next` for what it is for.

use crate::backend::Backend;

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
    /// [`crate::Communicator::mismatch_next`]): its group gets [`crate::Error::CallMismatch`].
    #[cfg(feature = "fault-injection")]
    pub fn mismatch_next(&self) {
        self.core.endpoint.skew_next_call();
    }
}
