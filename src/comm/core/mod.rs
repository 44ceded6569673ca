//! The per-rank core behind both front doors (the single controller holds one per
//! device, the per-rank `Comm` one): device, signals, agreed settings, routing, and the
//! only code that plans and launches kernels, so a call's checks hold for both.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::signal::{MAX_GPUS, NUM_BARRIER_DOMAINS};

pub(crate) mod call;
pub(crate) mod launch;
pub(crate) mod planning;
pub(crate) mod routing;
pub(crate) mod settings;
pub(crate) mod setup;

use routing::Router;
use settings::Settings;

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
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: launch::fault::Faults,
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
            #[cfg(feature = "fault-injection")]
            faults: Default::default(),
        }
    }
}

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
