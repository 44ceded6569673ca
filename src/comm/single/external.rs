//! The external library in a single controller: where routing sends a whole-world call
//! away from peer memory, one thread enqueues it on every rank's handle in one batch
//! (NCCL's `ncclCommInitAll` handles and group calls).

use crate::backend::Backend;
use crate::dispatch::Algorithm;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

use super::SingleController;

impl<B: Backend> SingleController<B> {
    /// Enqueues the external all-reduce on every rank (one batch); a failure once
    /// something was enqueued poisons the communicator.
    pub(super) fn run_external(
        &self,
        inputs: &[u64],
        outputs: &[u64],
        (elements, dtype, op): (usize, DType, ReduceOp),
    ) -> Result<Algorithm> {
        if self.ranks.iter().any(|r| r.route.external.is_none()) {
            return Err(Error::Unsupported("no external library".into()));
        }
        let _launches = self.lock_launches();
        self.check_usable()?;
        if elements == 0 {
            return Ok(Algorithm::Nccl);
        }
        let library = crate::external::library_of::<B>();
        library.group_start()?;
        let result = self.ranks.iter().enumerate().try_for_each(|(r, core)| {
            let Some(handle) = core.route.external.as_deref() else {
                return Ok(());
            };
            // SAFETY: the caller holds every rank's buffers (and their access guards)
            // for the call; handle r was made for rank r's device.
            unsafe {
                handle.all_reduce(core.device(), (inputs[r], outputs[r], elements, dtype, op))
            }
        });
        let ended = library.group_end();
        let result = result.and(ended).map(|()| Algorithm::Nccl);
        result.inspect_err(|e| self.poison(e))
    }
}
