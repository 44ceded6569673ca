//! Launching a planned collective on every core of a [`SingleController`], from the
//! launch pool ([`CommConfig::parallel_launch`]) or one rank after the other, under the
//! launch lock: a collective is enqueued on every rank before another's.

use std::any::Any;
use std::sync::{MutexGuard, Weak};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;
#[cfg(doc)]
use crate::CommConfig;

use super::launcher::{LaunchFn, Launcher, Launches, Outcomes};
use super::SingleController;
use crate::comm::core::launch::group::GroupPlan;
use crate::comm::core::launch::{Fused, PeerInputs};
use crate::comm::core::planning::Plan;

/// Every world rank, in order (the array's type keeps it `MAX_GPUS` long).
pub(super) const ALL_RANKS: [usize; MAX_GPUS] = [0, 1, 2, 3, 4, 5, 6, 7];

impl<B: Backend> SingleController<B> {
    pub(super) fn lock_launches(&self) -> MutexGuard<'_, Launches> {
        self.launch_lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Turns parallel launch ([`CommConfig::parallel_launch`]) on or off for the calls
    /// that follow; only a call's host time differs. On starts the launch threads if
    /// needed ([`crate::Error::Backend`] if the system refuses one); off leaves them
    /// parked until the drop. Waits for a call in progress on another thread.
    pub fn set_parallel_launch(&self, on: bool) -> Result<()> {
        let world = self.world_size();
        self.lock_launches().set_parallel(world, on, B::NAME)
    }

    /// Whether calls launch on the ranks in parallel (see
    /// [`SingleController::set_parallel_launch`]).
    pub fn parallel_launch(&self) -> bool {
        self.lock_launches().parallel
    }

    /// For tests: a weak handle on the launch pool's state (`None`: no pool), held by
    /// every launch thread until it ends, so it stops upgrading once they are joined.
    #[doc(hidden)]
    pub fn launch_pool_probe(&self) -> Option<Weak<dyn Any + Send + Sync>> {
        self.lock_launches().pool.as_ref().map(Launcher::probe)
    }

    /// Enqueues `plan` on every rank.
    pub(super) fn launch_all(
        &self,
        plan: &Plan,
        inputs: &[u64; MAX_GPUS],
        outputs: &[u64; MAX_GPUS],
    ) -> Result<()> {
        let ranks = &ALL_RANKS[..self.world_size()];
        self.launch_on(plan, ranks, PeerInputs::InPlace(inputs), outputs, None)
    }

    /// Enqueues `plan` on the cores `ranks` (with every rank's residual and weight for
    /// the fused all-reduce + RMSNorm); the others count the call, so that every rank's
    /// call sequence stays the same.
    pub(super) fn launch_on(
        &self,
        plan: &Plan,
        ranks: &[usize],
        inputs: PeerInputs<'_>,
        outputs: &[u64; MAX_GPUS],
        fused: Option<(&[u64; MAX_GPUS], &[u64; MAX_GPUS])>,
    ) -> Result<()> {
        self.launch_ranks(ranks, &|r| {
            let extra = fused.map_or(Fused::default(), |(residuals, weights)| Fused {
                residual: residuals[r],
                weight: weights[r],
            });
            self.ranks[r].launch(plan, inputs, outputs[r], extra)
        })?;
        for (r, core) in self.ranks.iter().enumerate() {
            if !ranks.contains(&r) {
                core.count_call(plan);
            }
        }
        Ok(())
    }

    /// Enqueues a batched all-reduce on every rank: `io[s]` holds entry s's inputs and
    /// outputs on every rank.
    pub(super) fn launch_group_on_all(
        &self,
        plan: &GroupPlan,
        io: &[(&[u64; MAX_GPUS], &[u64; MAX_GPUS])],
    ) -> Result<()> {
        self.launch_ranks(&ALL_RANKS[..self.world_size()], &|r| {
            // Entry s reads every rank's input in place (or stages its own, where the
            // plan says so) and writes this rank's output.
            let entries: Vec<(PeerInputs<'_>, u64)> = io
                .iter()
                .map(|&(ins, outs)| match plan.plan.stage_input != 0 {
                    true => (PeerInputs::Own(ins[r]), outs[r]),
                    false => (PeerInputs::InPlace(ins), outs[r]),
                })
                .collect();
            self.ranks[r].launch_group(plan, &entries)
        })
    }

    /// Runs `launch(r)` (after any injected failure) on every rank of `ranks` under the
    /// launch lock, atomically with respect to other callers. A failure on some rank once
    /// another was launched poisons the communicator: the launched ranks wait for peers
    /// that never come (until their timeout), so nothing may run before
    /// [`SingleController::reinitialize`]. A launch that panicked counts as failed; its
    /// panic is resumed after the poisoning. Returns the first failing rank's error.
    pub(super) fn launch_ranks(&self, ranks: &[usize], launch: &LaunchFn<'_>) -> Result<()> {
        let mut launches = self.lock_launches();
        self.check_usable()?;
        let launch = |r: usize| self.injected_launch_failure(r).and_then(|()| launch(r));
        let Outcomes { mut results, panic } = launches.run(ranks, &launch);
        let results = ranks.iter().filter_map(|&r| results[r].take());
        let (launched, first_error) = results.fold((false, None), |(l, first), res| match res {
            Ok(()) => (true, first),
            Err(e) => (l, first.or(Some(e))),
        });
        if launched {
            if let Some(e) = &first_error {
                self.poison(e);
            } else if panic.is_some() {
                self.poison(&Error::Backend {
                    backend: B::NAME,
                    call: "launch",
                    detail: "a rank's launch panicked".into(),
                });
            }
        }
        if let Some(panic) = panic {
            std::panic::resume_unwind(panic);
        }
        first_error.map_or(Ok(()), Err)
    }
}
