//! The per-rank core behind both front doors (the single controller holds one per
//! device, the per-rank `Comm` one): device, signals, agreed settings, routing, and the
//! only code that plans and launches kernels, so a call's checks hold for both.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::signal::barrier_domain;

pub(crate) mod call;
pub(crate) mod launch;
pub(crate) mod planning;
pub(crate) mod routing;
pub(crate) mod settings;
pub(crate) mod setup;

pub(crate) use launch::Endpoint;
use launch::{Fused, PeerInputs};
use planning::Plan;
use routing::Router;
use settings::Settings;

/// One rank of a communicator ([`crate::SingleController::rank`] shows its devices and
/// signals).
pub struct Rank<B: Backend> {
    pub(crate) endpoint: Endpoint<B>,
    pub(crate) settings: Settings,
    pub(crate) route: Router<B>,
    /// Peer signals imported from other processes; unmapped on drop (or parked).
    pub(crate) mappings: Vec<B::PeerMapping>,
    pub(crate) plans: planning::cache::PlanCache,
    poisoned: AtomicBool,
    /// The error that poisoned the rank (set with `poisoned`).
    poisoned_by: Mutex<Option<Error>>,
}

impl<B: Backend> Rank<B> {
    pub(crate) fn new(core: setup::PeerSetup<B>, route: Router<B>) -> Self {
        Rank {
            endpoint: core.endpoint,
            settings: core.settings,
            route,
            mappings: core.mappings,
            plans: planning::cache::PlanCache::default(),
            poisoned: AtomicBool::new(false),
            poisoned_by: Mutex::new(None),
        }
    }

    /// The device (for CUDA: its context and the stream collectives run on).
    pub fn device(&self) -> &B::Device {
        &self.endpoint.device
    }
    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        B::ordinal(&self.endpoint.device)
    }
    /// The most blocks a peer-memory launch uses by default: the group's fewest
    /// multiprocessors (or `CommConfig::max_blocks`), shared among ranks of one device.
    pub fn max_blocks(&self) -> u32 {
        self.settings.max_blocks
    }
    /// Device address of this rank's signal buffer.
    pub fn signal_ptr(&self) -> u64 {
        B::memory_ptr(&self.endpoint.signal)
    }

    /// Enqueues this rank's kernel of `plan` from `inputs` into `output` (`fused`: the
    /// fused all-reduce + RMSNorm's residual and weight, else the default).
    pub(crate) fn launch(
        &self,
        plan: &Plan,
        inputs: PeerInputs<'_>,
        output: u64,
        fused: Fused,
    ) -> Result<()> {
        (self.endpoint).launch(&self.settings, plan, inputs, output, fused)
    }

    /// Counts a call of `plan` this rank does not launch (a single-controller launch on
    /// some ranks only), so every rank's call sequence stays the same.
    pub(crate) fn count_call(&self, plan: &Plan) {
        let domain = barrier_domain(plan.width, self.settings.world);
        self.endpoint.next_call(domain);
    }

    /// Whether an earlier error disabled this rank's collectives.
    pub(crate) fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }
    /// Disables collectives until the signal is re-initialised, keeping the first
    /// `cause` for the `Poisoned` errors that follow.
    pub(crate) fn poison(&self, cause: &Error) {
        let mut first = self.poisoned_by.lock().unwrap_or_else(|e| e.into_inner());
        if first.is_none() {
            *first = Some(match cause {
                Error::Poisoned { first } => (**first).clone(),
                other => other.clone(),
            });
        }
        self.poisoned.store(true, Ordering::Release);
    }
    /// `Err(Poisoned)`, naming the first error, once an error disabled collectives.
    pub(crate) fn check_usable(&self) -> Result<()> {
        if !self.is_poisoned() {
            return Ok(());
        }
        // No cause: `unpoison` cleared it (cause first) after the flag was read.
        match &*self.poisoned_by.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(first) => Err(Error::Poisoned {
                first: Box::new(first.clone()),
            }),
            None => Ok(()),
        }
    }

    /// Waits for the stream, re-initialises the signal (barrier counters at `base`) and
    /// restarts the call sequence; the front door keeps peers away meanwhile.
    pub(crate) fn reset_signal(&self, base: u32) -> Result<()> {
        let e = &self.endpoint;
        B::synchronize(&e.device)?;
        crate::backend::signal_init::init_signal_buffer_with_counter_base::<B>(
            &e.device,
            &e.signal,
            self.settings.layout,
            base,
        )?;
        e.restart_calls();
        B::synchronize(&e.device)
    }

    /// Collectives are allowed again (after every rank's signal was reset).
    pub(crate) fn unpoison(&self) {
        *self.poisoned_by.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.poisoned.store(false, Ordering::Release);
    }
}
