//! Launching: the one place where kernel arguments are built and kernels enqueued.

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use crate::backend::{Backend, Kernel, KernelKind, LaunchDims};
use crate::dtype::DType;
use crate::error::Result;
use crate::signal::{barrier_domain, AllReduceArgs, MAX_GPUS};

use super::call;
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
        for (i, &r) in ranks.iter().enumerate() {
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
        // Ranks left out of this launch count it too, so that every rank's call
        // sequence stays the same.
        let domain = barrier_domain(plan.width, self.settings.world);
        for (r, rank) in self.ranks.iter().enumerate() {
            if !ranks.contains(&r) {
                rank.next_call(domain);
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
        let domain = barrier_domain(width, settings.world);
        let seq = self.next_call(domain);
        if self.take_missing() {
            // Fault injection: counted as made (a late rank, not one that skipped a
            // call), launched nowhere.
            return Ok(());
        }
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
            domain: domain as u32,
            world_rank: r as u32,
            stage_input: plan.stage_input as u32,
            root: plan.collective.root,
            hidden: plan.collective.hidden,
            residual,
            weight,
            epsilon: plan.collective.epsilon,
            call: call::encode(plan, seq),
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

    /// The sequence number of the next collective call in barrier `domain` (it counts
    /// every launch there).
    fn next_call(&self, domain: usize) -> u32 {
        let seq = self.calls[domain].fetch_add(1, Ordering::Relaxed);
        if self.skew_next.load(Ordering::Relaxed) && self.skew_next.swap(false, Ordering::AcqRel) {
            return seq.wrapping_add(1);
        }
        seq
    }

    /// Whether fault injection leaves this launch out (and clears the request).
    fn take_missing(&self) -> bool {
        self.missing.load(Ordering::Relaxed) && self.missing.swap(false, Ordering::AcqRel)
    }

    /// Fault injection: this rank's next launch is left out.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn miss_next_launch(&self) {
        self.missing.store(true, Ordering::Release);
    }

    /// Fault injection: this rank's next launch publishes a call one ahead in the
    /// sequence, so its group gets [`crate::Error::CallMismatch`].
    #[cfg(feature = "fault-injection")]
    pub(crate) fn skew_next_call(&self) {
        self.skew_next.store(true, Ordering::Release);
    }

    /// Starts the call counts again (the signal was just initialised, on every rank).
    pub(crate) fn restart_calls(&self) {
        for c in &self.calls {
            c.store(0, Ordering::Relaxed);
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
