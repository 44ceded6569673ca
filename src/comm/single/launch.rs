//! Launching a planned collective on every core of a [`SingleController`]: from the
//! launch pool ([`CommConfig::parallel_launch`]) or one rank after the other, under
//! the launch lock, so that a collective is enqueued on every rank before another's.

use std::any::Any;
use std::sync::{MutexGuard, Weak};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;
#[cfg(doc)]
use crate::CommConfig;

use super::launcher::{spawn_error, LaunchFn, Launcher, Launches, Outcomes};
use super::SingleController;
use crate::comm::core::launch::group::GroupPlan;
use crate::comm::core::launch::{Fused, PeerInputs};
use crate::comm::core::planning::Plan;

/// Every world rank, in order: `&ALL_RANKS[..world]` is the whole world.
pub(super) const ALL_RANKS: [usize; MAX_GPUS] = {
    let mut all = [0; MAX_GPUS];
    let mut r = 0;
    while r < MAX_GPUS {
        all[r] = r;
        r += 1;
    }
    all
};

impl<B: Backend> SingleController<B> {
    pub(super) fn lock_launches(&self) -> MutexGuard<'_, Launches> {
        self.launch_lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Turns parallel launch ([`CommConfig::parallel_launch`]) on or off for the calls
    /// that follow; only a call's host time differs. Turning it on starts the launch
    /// threads if needed ([`crate::Error::Backend`] if the system refuses one); off
    /// leaves them parked until the drop. Waits for a call in progress on another
    /// thread; changes nothing in a world of one.
    pub fn set_parallel_launch(&self, on: bool) -> Result<()> {
        let world = self.world_size();
        self.lock_launches()
            .set_parallel(world, on)
            .map_err(|e| spawn_error(B::NAME, &e))
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

    /// Enqueues `plan` on every rank, atomically with respect to other callers.
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
    /// the fused all-reduce + RMSNorm), atomically with respect to other callers. A
    /// failure on some rank once another was launched poisons the communicator: the
    /// launched ranks wait for peers that will never come (until their timeout), so
    /// nothing may run before [`SingleController::reinitialize`].
    pub(super) fn launch_on(
        &self,
        plan: &Plan,
        ranks: &[usize],
        inputs: PeerInputs<'_>,
        outputs: &[u64; MAX_GPUS],
        fused: Option<(&[u64; MAX_GPUS], &[u64; MAX_GPUS])>,
    ) -> Result<()> {
        let mut launches = self.lock_launches();
        self.check_usable()?;
        let launch = |r: usize| {
            self.injected_launch_failure(r)?;
            let extra = fused.map_or(Fused::default(), |(residuals, weights)| Fused {
                residual: residuals[r],
                weight: weights[r],
            });
            self.ranks[r].launch_fused(plan, inputs, outputs[r], extra)
        };
        let outcomes = self.launch_each(&mut launches, ranks, &launch);
        self.settle(ranks, outcomes)?;
        // Ranks left out of this launch count it too, so that every rank's call
        // sequence stays the same.
        for (r, core) in self.ranks.iter().enumerate() {
            if !ranks.contains(&r) {
                core.count_call(plan);
            }
        }
        Ok(())
    }

    /// Enqueues a batched all-reduce on every rank: `io[r]` holds rank r's (input,
    /// output) pairs. Poisons on a failure once some rank was launched, as `launch_on`.
    pub(super) fn launch_group_on_all(
        &self,
        plan: &GroupPlan,
        io: &[(&[u64; MAX_GPUS], &[u64; MAX_GPUS])],
    ) -> Result<()> {
        let mut launches = self.lock_launches();
        self.check_usable()?;
        let launch = |r: usize| {
            self.injected_launch_failure(r)?;
            // Entry s reads every rank's input in place (or stages its own, where the
            // plan says so) and writes this rank's output.
            let entries: Vec<(PeerInputs<'_>, u64)> = io
                .iter()
                .map(|&(ins, outs)| {
                    let inputs = if plan.plan.stage_input {
                        PeerInputs::Own(ins[r])
                    } else {
                        PeerInputs::InPlace(ins)
                    };
                    (inputs, outs[r])
                })
                .collect();
            self.ranks[r].launch_group(plan, &entries)
        };
        let ranks = &ALL_RANKS[..self.world_size()];
        let outcomes = self.launch_each(&mut launches, ranks, &launch);
        self.settle(ranks, outcomes)
    }

    /// Runs `launch(r)` for every rank r of `ranks` (world ranks, each once) under the
    /// launch lock (`launches`, held by the caller): at once through the pool where
    /// parallel launch is on, each rank's outcome kept; else in order on this thread,
    /// stopping at the first failure (the ranks after it are not launched), as a
    /// single thread does.
    pub(super) fn launch_each(
        &self,
        launches: &mut Launches,
        ranks: &[usize],
        launch: &LaunchFn<'_>,
    ) -> Outcomes {
        if let Some(pool) = launches.parallel_pool() {
            if ranks.len() > 1 {
                let mask = ranks.iter().fold(0u32, |m, &r| m | 1 << r);
                return pool.run(mask, launch);
            }
        }
        let mut outcomes = Outcomes {
            results: Default::default(),
            panic: None,
        };
        for &r in ranks {
            let result = launch(r);
            let failed = result.is_err();
            outcomes.results[r] = Some(result);
            if failed {
                break;
            }
        }
        outcomes
    }

    /// What a launch on `ranks` returns: the first failing rank's error (in the order
    /// of `ranks`), after poisoning the communicator if another rank was launched (a
    /// launch that panicked counts as failed; its panic is resumed here, after the
    /// poisoning).
    fn settle(&self, ranks: &[usize], outcomes: Outcomes) -> Result<()> {
        let mut results = outcomes.results;
        let mut launched = false;
        let mut first_error = None;
        for &r in ranks {
            match results[r].take() {
                Some(Ok(())) => launched = true,
                Some(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                None => {}
            }
        }
        if launched {
            if let Some(e) = &first_error {
                self.poison(e);
            } else if outcomes.panic.is_some() {
                self.poison(&Error::Backend {
                    backend: B::NAME,
                    call: "launch",
                    detail: "a rank's launch panicked".into(),
                });
            }
        }
        if let Some(panic) = outcomes.panic {
            std::panic::resume_unwind(panic);
        }
        first_error.map_or(Ok(()), Err)
    }
}
