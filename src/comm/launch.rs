//! Launching: the one place where kernel arguments are built and kernels enqueued.

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use crate::backend::Backend;
use crate::error::Result;
use crate::signal::{barrier_domain, AllReduceArgs, MAX_GPUS};

use super::plan::Plan;
use super::Communicator;

impl<B: Backend> Communicator<B> {
    pub(super) fn lock_launches(&self) -> MutexGuard<'_, ()> {
        self.launch_lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enqueues `plan` on every rank, atomically with respect to other callers. A
    /// failure after some ranks were launched poisons the communicator: those ranks
    /// wait for peers that will never come (until their timeout), so nothing may run
    /// before [`Communicator::reinitialize`].
    pub(super) fn launch_all(
        &self,
        plan: &Plan,
        inputs: &[u64; MAX_GPUS],
        outputs: &[u64; MAX_GPUS],
    ) -> Result<()> {
        let ranks: Vec<usize> = (0..self.world_size()).collect();
        self.launch_on(plan, &ranks, inputs, outputs)
    }

    pub(super) fn launch_on(
        &self,
        plan: &Plan,
        ranks: &[usize],
        inputs: &[u64; MAX_GPUS],
        outputs: &[u64; MAX_GPUS],
    ) -> Result<()> {
        let _launches = self.lock_launches();
        self.check_usable()?;
        for (i, &r) in ranks.iter().enumerate() {
            if let Err(e) = self.launch_rank(plan, r, inputs, outputs) {
                if i > 0 {
                    self.poisoned.store(true, Ordering::Release);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// The wait limit the kernels get, in nanoseconds (0 = never; saturates).
    pub(super) fn timeout_ns(&self) -> u64 {
        self.config.barrier_timeout.map_or(0, |t| {
            u64::try_from(t.as_nanos()).unwrap_or(u64::MAX).max(1)
        })
    }

    pub(super) fn launch_rank(
        &self,
        plan: &Plan,
        r: usize,
        inputs: &[u64; MAX_GPUS],
        outputs: &[u64; MAX_GPUS],
    ) -> Result<()> {
        let world = self.world_size();
        let width = plan.width;
        let base = r / width * width;
        let rank = &self.ranks[r];
        let payload_off = self.layout.payload_offset() as u64;
        let mut args = AllReduceArgs {
            local_input: inputs[r],
            output: outputs[r],
            num_elements: plan.elements as u64,
            timeout_ns: self.timeout_ns(),
            lamport_slot_bytes: self.layout.lamport_slot_bytes as u32,
            group_rank: (r - base) as u32,
            group_width: width as u32,
            domain: barrier_domain(width, world) as u32,
            world_rank: r as u32,
            stage_input: plan.stage_input as u32,
            ..Default::default()
        };
        for k in 0..width {
            let signal = rank.peer_signals[base + k];
            args.signals[k] = signal;
            args.payloads[k] = signal + payload_off;
            args.inputs[k] = if plan.stage_input {
                signal + payload_off
            } else {
                inputs[base + k]
            };
        }
        B::launch(&rank.device, plan.kernel, plan.dims, &args)
    }
}
