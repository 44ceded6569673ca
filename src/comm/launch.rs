//! Launching: the one place where kernel arguments are built and kernels enqueued.

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use crate::backend::{Backend, Kernel, KernelKind, LaunchDims};
use crate::dtype::DType;
use crate::error::Result;
use crate::signal::{barrier_domain, AllReduceArgs, MAX_GPUS};

use super::plan::Plan;
use super::settings::Settings;
use super::{Communicator, Rank};

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
        let zeros = [0u64; MAX_GPUS];
        self.launch_on_fused(plan, ranks, inputs, outputs, &zeros, &zeros)
    }

    /// As `launch_on`, with every rank's residual and weight (the fused all-reduce +
    /// RMSNorm; zeros for every other kernel).
    pub(super) fn launch_on_fused(
        &self,
        plan: &Plan,
        ranks: &[usize],
        inputs: &[u64; MAX_GPUS],
        outputs: &[u64; MAX_GPUS],
        residuals: &[u64; MAX_GPUS],
        weights: &[u64; MAX_GPUS],
    ) -> Result<()> {
        // Where peer memory does not reach every device (the external fallback), only
        // groups of one launch.
        self.check_peer_group(plan.width)?;
        let _launches = self.lock_launches();
        self.check_usable()?;
        let missing = self.take_missing();
        for (i, &r) in ranks.iter().enumerate() {
            if missing & (1 << r) != 0 {
                continue;
            }
            let rank = &self.ranks[r];
            let launched = rank.launch_fused(
                &self.settings,
                plan,
                inputs,
                outputs[r],
                residuals[r],
                weights[r],
            );
            if let Err(e) = launched {
                if i > 0 {
                    self.poisoned.store(true, Ordering::Release);
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

impl<B: Backend> Rank<B> {
    /// Enqueues this rank's kernel of `plan`: the one place kernel arguments are
    /// built. `inputs` holds the user input of every world rank where the peers read
    /// user buffers (one process), else only this rank's; `output` is this rank's.
    pub(crate) fn launch(
        &self,
        settings: &Settings,
        plan: &Plan,
        inputs: &[u64; MAX_GPUS],
        output: u64,
    ) -> Result<()> {
        self.launch_fused(settings, plan, inputs, output, 0, 0)
    }

    /// As [`Rank::launch`], with the fused all-reduce + RMSNorm's `residual` (updated
    /// in place) and `weight` (0 for every other kernel).
    pub(crate) fn launch_fused(
        &self,
        settings: &Settings,
        plan: &Plan,
        inputs: &[u64; MAX_GPUS],
        output: u64,
        residual: u64,
        weight: u64,
    ) -> Result<()> {
        let r = self.index;
        let width = plan.width;
        let base = r / width * width;
        let layout = &settings.layout;
        let payload_off = layout.payload_offset() as u64;
        let mut args = AllReduceArgs {
            local_input: inputs[r],
            output,
            num_elements: plan.elements as u64,
            timeout_ns: settings.timeout_ns(),
            lamport_slot_bytes: layout.lamport_slot_bytes as u32,
            group_rank: (r - base) as u32,
            group_width: width as u32,
            domain: barrier_domain(width, settings.world) as u32,
            world_rank: r as u32,
            stage_input: plan.stage_input as u32,
            root: plan.collective.root,
            hidden: plan.collective.hidden,
            residual,
            weight,
            epsilon: plan.collective.epsilon,
            ..Default::default()
        };
        for k in 0..width {
            let signal = self.peer_signals[base + k];
            args.signals[k] = signal;
            args.payloads[k] = signal + payload_off;
            args.inputs[k] = if plan.stage_input {
                signal + payload_off
            } else {
                inputs[base + k]
            };
        }
        if plan.overlap_previous {
            B::launch_overlapping(&self.device, plan.kernel, plan.dims, &args)
        } else {
            B::launch(&self.device, plan.kernel, plan.dims, &args)
        }
    }

    /// Enqueues the fault-injection kernel: one thread spins for `delay`.
    pub(crate) fn launch_delay(&self, delay: std::time::Duration) -> Result<()> {
        let args = AllReduceArgs {
            timeout_ns: u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX),
            ..Default::default()
        };
        B::launch(
            &self.device,
            Kernel {
                kind: KernelKind::Delay,
                dtype: DType::F32,
            },
            LaunchDims {
                blocks: 1,
                threads: 32,
            },
            &args,
        )
    }
}
