//! Launching: a rank's endpoint, and the one place where kernel arguments are built and
//! kernels enqueued.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::Backend;
use crate::error::Result;
use crate::signal::{barrier_domain, AllReduceArgs, MAX_GPUS, NUM_BARRIER_DOMAINS};

use crate::comm::core::call;
use crate::comm::core::planning::Plan;
use crate::comm::core::settings::Settings;

pub(crate) mod exchange;
pub(crate) mod fault;
pub(crate) mod group;
pub(crate) mod status;

/// Where one rank is: device and stream, signal, its peers' signals, its call counts.
pub(crate) struct Endpoint<B: Backend> {
    /// Rank in its peer-memory group (the world, or its host's ranks).
    pub(crate) index: usize,
    pub(crate) device: B::Device,
    pub(crate) signal: B::Memory,
    /// `peer_signals[j]`: where this rank reaches group rank j's signal.
    pub(crate) peer_signals: [u64; MAX_GPUS],
    /// Launches per barrier domain since the signal was initialised (the descriptor's
    /// sequence number).
    pub(crate) calls: [AtomicU64; NUM_BARRIER_DOMAINS],
    /// Exchange launches with each world rank since the signal was initialised (the
    /// pair descriptor's sequence number).
    pub(crate) pair_calls: [AtomicU64; MAX_GPUS],
    #[cfg(feature = "fault-injection")]
    faults: Faults,
}

/// A rank's pending faults (`launch::fault`).
#[cfg(feature = "fault-injection")]
#[derive(Default)]
struct Faults {
    /// The next launch publishes the sequence number one ahead.
    skew_next: std::sync::atomic::AtomicBool,
    /// The next launch is left out (counted as made).
    missing: std::sync::atomic::AtomicBool,
}

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

impl<B: Backend> Endpoint<B> {
    /// A rank at `index` of its group, reaching its group's signals at `peer_signals`.
    pub(crate) fn new(
        index: usize,
        device: B::Device,
        signal: B::Memory,
        peer_signals: [u64; MAX_GPUS],
    ) -> Self {
        Endpoint {
            index,
            device,
            signal,
            peer_signals,
            calls: Default::default(),
            pair_calls: Default::default(),
            #[cfg(feature = "fault-injection")]
            faults: Default::default(),
        }
    }

    /// Enqueues this rank's kernel of `plan` from `inputs` into `output`.
    pub(crate) fn launch(
        &self,
        settings: &Settings,
        plan: &Plan,
        inputs: PeerInputs<'_>,
        output: u64,
        fused: Fused,
    ) -> Result<()> {
        let Some((mut args, base)) = self.prologue(settings, plan) else {
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
        if plan.stage_input == 0 {
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

    /// Counts the call in its barrier domain and builds the shared arguments (staged
    /// inputs read from the payloads), with the group's first world rank. `None` where
    /// fault injection leaves the launch out (counted: a late rank, not a skipped call).
    fn prologue(&self, settings: &Settings, plan: &Plan) -> Option<(AllReduceArgs, usize)> {
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
            stage_input: plan.stage_input,
            call: call::encode(plan, seq),
            ..Default::default()
        };
        for k in 0..width {
            let signal = self.peer_signals[base + k];
            args.signals[k] = signal;
            args.payloads[k] = signal + payload_off;
            if plan.stage_input != 0 {
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
        for c in self.calls.iter().chain(&self.pair_calls) {
            c.store(0, Ordering::Relaxed);
        }
    }
}
