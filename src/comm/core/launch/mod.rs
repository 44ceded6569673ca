//! Launching: the one place where kernel arguments are built and kernels enqueued.

use std::sync::atomic::Ordering;

use crate::backend::{Backend, KernelKind};
use crate::error::Result;
use crate::signal::{barrier_domain, AllReduceArgs, MAX_GPUS, PACK_BYTES};

use crate::comm::core::call;
use crate::comm::core::planning::{staging, Plan};
use crate::comm::core::settings::Settings;
use crate::comm::core::{Endpoint, Rank};

pub(crate) mod fault;
pub(crate) mod group;
pub(crate) mod status;

/// Where the peers read each rank's input.
#[derive(Clone, Copy)]
pub(crate) enum PeerInputs<'a> {
    /// Only this rank's input is known: what the peers read is staged (or pushed).
    Own(u64),
    /// Every world rank's input, read in place by the peers (one process).
    InPlace(&'a [u64; MAX_GPUS]),
}

/// The fused all-reduce + RMSNorm's residual (updated in place) and weight; 0 for others.
#[derive(Clone, Copy, Default)]
pub(crate) struct Fused {
    pub(crate) residual: u64,
    pub(crate) weight: u64,
}

impl Settings {
    /// The kernels' `stage_input` word for `plan`: 0 where nothing is staged, else how
    /// the kernel goes through the payload (the rule the planner checked).
    pub(crate) fn stage_word(&self, plan: &Plan) -> Result<u32> {
        if !plan.stage_input {
            return Ok(0);
        }
        let (kind, dtype) = (plan.kernel.kind, plan.kernel.dtype);
        let payload = self.layout.payload_bytes;
        let word = if kind == KernelKind::OneStage {
            let packs = plan.elements.div_ceil(dtype.lanes());
            staging::all_reduce(packs, payload).ok_or((packs * PACK_BYTES).min(2 * PACK_BYTES))
        } else {
            let hidden = plan.collective.hidden as usize;
            staging::collective(kind, dtype, plan.elements, plan.width, hidden, payload)
        };
        word.map_err(|needed| self.payload_too_large(kind, needed))
    }
}

impl<B: Backend> Rank<B> {
    /// Enqueues this rank's kernel of `plan` from `inputs` into `output`.
    pub(crate) fn launch(&self, plan: &Plan, inputs: PeerInputs<'_>, output: u64) -> Result<()> {
        self.launch_fused(plan, inputs, output, Fused::default())
    }

    /// As [`Rank::launch`], for the fused all-reduce + RMSNorm.
    pub(crate) fn launch_fused(
        &self,
        plan: &Plan,
        inputs: PeerInputs<'_>,
        output: u64,
        fused: Fused,
    ) -> Result<()> {
        self.endpoint
            .launch(&self.settings, plan, inputs, output, fused)
    }

    /// Counts a call of `plan` this rank does not launch (a single-controller launch on
    /// some ranks only), so every rank's call sequence stays the same.
    pub(crate) fn count_call(&self, plan: &Plan) {
        let domain = barrier_domain(plan.width, self.settings.world);
        self.endpoint.next_call(domain);
    }
}

impl<B: Backend> Endpoint<B> {
    /// Enqueues this rank's kernel of `plan`: the one place kernel arguments are built.
    pub(crate) fn launch(
        &self,
        settings: &Settings,
        plan: &Plan,
        inputs: PeerInputs<'_>,
        output: u64,
        fused: Fused,
    ) -> Result<()> {
        // Before the call is counted: a plan the payload cannot take launches nothing.
        let stage_input = settings.stage_word(plan)?;
        let Some((mut args, base)) = self.prologue(settings, plan, stage_input) else {
            return Ok(());
        };
        let (r, c) = (self.index, plan.collective);
        args.local_input = match inputs {
            PeerInputs::Own(p) => p,
            PeerInputs::InPlace(all) => all[r],
        };
        args.output = output;
        (args.root, args.hidden, args.epsilon) = (c.root, c.hidden, c.epsilon);
        (args.residual, args.weight) = (fused.residual, fused.weight);
        if !plan.stage_input {
            for k in 0..plan.width {
                args.inputs[k] = match inputs {
                    PeerInputs::InPlace(all) => all[base + k],
                    // Kernels that read no peer input (a group of one, Lamport,
                    // barriers) get only their own.
                    PeerInputs::Own(p) if base + k == r => p,
                    PeerInputs::Own(_) => 0,
                };
            }
        }
        if plan.overlap_previous {
            B::launch_overlapping(&self.device, plan.kernel, plan.dims, &args)
        } else {
            B::launch(&self.device, plan.kernel, plan.dims, &args)
        }
    }

    /// What every launch does first: counts the call in its barrier domain and builds
    /// the shared arguments (descriptor, group, signals, payloads; staged inputs read
    /// from the payloads), returned with the group's first world rank. `None` where fault
    /// injection leaves the launch out (counted as made: a late rank, not a skipped call).
    fn prologue(
        &self,
        settings: &Settings,
        plan: &Plan,
        stage_input: u32,
    ) -> Option<(AllReduceArgs, usize)> {
        let (r, width) = (self.index, plan.width);
        let domain = barrier_domain(width, settings.world);
        let seq = self.next_call(domain);
        if self.take_missing() {
            return None;
        }
        let base = r / width * width;
        let layout = &settings.layout;
        let payload_off = layout.payload_offset() as u64;
        let mut args = AllReduceArgs {
            num_elements: plan.elements as u64,
            timeout_ns: settings.timeout_ns(),
            lamport_slot_bytes: layout.lamport_slot_bytes as u32,
            group_rank: (r - base) as u32,
            group_width: width as u32,
            domain: domain as u32,
            world_rank: r as u32,
            stage_input,
            call: call::encode(plan, seq),
            ..Default::default()
        };
        for k in 0..width {
            let signal = self.peer_signals[base + k];
            args.signals[k] = signal;
            args.payloads[k] = signal + payload_off;
            if plan.stage_input {
                args.inputs[k] = signal + payload_off;
            }
        }
        Some((args, base))
    }

    /// The sequence number of the next call in barrier `domain`.
    pub(crate) fn next_call(&self, domain: usize) -> u64 {
        let seq = self.calls[domain].fetch_add(1, Ordering::Relaxed);
        self.skewed(seq)
    }

    /// Starts the call counts again (the signal was just initialised, on every rank).
    pub(crate) fn restart_calls(&self) {
        for c in &self.calls {
            c.store(0, Ordering::Relaxed);
        }
    }
}
