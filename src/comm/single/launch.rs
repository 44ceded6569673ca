//! Launching a planned collective on several cores of a [`Communicator`] at once.

use std::sync::MutexGuard;

use crate::backend::Backend;
use crate::error::Result;
use crate::signal::MAX_GPUS;

use super::super::core::group::GroupPlan;
use super::super::core::launch::{Fused, PeerInputs};
use super::super::core::plan::Plan;
use super::Communicator;

impl<B: Backend> Communicator<B> {
    pub(super) fn lock_launches(&self) -> MutexGuard<'_, ()> {
        self.launch_lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enqueues `plan` on every rank, atomically with respect to other callers.
    pub(super) fn launch_all(
        &self,
        plan: &Plan,
        inputs: &[u64; MAX_GPUS],
        outputs: &[u64; MAX_GPUS],
    ) -> Result<()> {
        let ranks: Vec<usize> = (0..self.world_size()).collect();
        self.launch_on(plan, &ranks, PeerInputs::InPlace(inputs), outputs, None)
    }

    /// Enqueues `plan` on the cores `ranks` (with every rank's residual and weight for
    /// the fused all-reduce + RMSNorm), atomically with respect to other callers. A
    /// failure after some ranks were launched poisons the communicator: those ranks
    /// wait for peers that will never come (until their timeout), so nothing may run
    /// before [`Communicator::reinitialize`].
    pub(super) fn launch_on(
        &self,
        plan: &Plan,
        ranks: &[usize],
        inputs: PeerInputs<'_>,
        outputs: &[u64; MAX_GPUS],
        fused: Option<(&[u64; MAX_GPUS], &[u64; MAX_GPUS])>,
    ) -> Result<()> {
        let _launches = self.lock_launches();
        self.check_usable()?;
        for (i, &r) in ranks.iter().enumerate() {
            let core = &self.ranks[r];
            let extra = fused.map_or(Fused::default(), |(residuals, weights)| Fused {
                residual: residuals[r],
                weight: weights[r],
            });
            if let Err(e) = core.launch_fused(plan, inputs, outputs[r], extra) {
                if i > 0 {
                    self.poison();
                }
                return Err(e);
            }
        }
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
    /// output) pairs. Poisons on a failure after the first rank, as `launch_on`.
    pub(super) fn launch_group_on_all(
        &self,
        plan: &GroupPlan,
        io: &[(&[u64; MAX_GPUS], &[u64; MAX_GPUS])],
    ) -> Result<()> {
        let _launches = self.lock_launches();
        self.check_usable()?;
        for (r, core) in self.ranks.iter().enumerate() {
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
            if let Err(e) = core.launch_group(plan, &entries) {
                if r > 0 {
                    self.poison();
                }
                return Err(e);
            }
        }
        Ok(())
    }
}
