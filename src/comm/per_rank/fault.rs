//! Fault injection on [`Comm`] (feature `fault-injection`), so that users can test their
//! own timeout and error handling.

use std::time::Duration;

use crate::backend::Backend;
use crate::error::Result;

use super::Comm;

impl<B: Backend> Comm<B> {
    /// Fault injection: this rank's next collective returns as if launched and launches
    /// nothing. Its peers time out ([`crate::CommConfig::barrier_timeout`]) and this rank
    /// gets their [`crate::Error::PeerAborted`]; every rank then calls
    /// [`Comm::reinitialize`].
    pub fn miss_next(&self) {
        self.core.endpoint.miss_next_launch();
    }

    /// Fault injection: this rank's next collective publishes a descriptor one ahead in
    /// the sequence; its group gets [`crate::Error::CallMismatch`].
    pub fn mismatch_next(&self) {
        self.core.endpoint.skew_next_call();
    }

    /// Fault injection: this rank's next collective starts `delay` late (a kernel that
    /// spins, touching no memory).
    pub fn delay(&self, delay: Duration) -> Result<()> {
        self.core.check_usable()?;
        self.core.endpoint.launch_delay(delay)
    }
}
