//! The single-controller front door: [`SingleController`], one process driving every
//! rank's device through one core each (the per-rank setup over an in-process
//! bootstrap). Calls check every rank's buffers together, plan on the cores and launch
//! on each under one lock; the peers read user buffers in place.

#[cfg(feature = "fault-injection")]
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};

use crate::backend::{Backend, Kernel, KernelKind, LaunchDims};
use crate::bootstrap::{ExchangeKind, Exchanges, HostId};
use crate::dispatch::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::external::local::LocalBootstrap;
use crate::signal::{SignalLayout, MAX_GPUS};

use super::core::Rank;
use super::CommConfig;
use crate::comm::core::launch::PeerInputs;
use crate::comm::core::planning::Plan;
use crate::comm::core::setup::{self, connect, record, RankProcesses};

mod all_reduce;
mod collectives;
mod device_comm;
mod exchange;
mod external;
mod fault;
pub(crate) mod group;
mod launch;
mod launcher;
mod status;
mod validate;

/// A set of devices (at most 8, one process) that all-reduce together. Collectives are
/// enqueued on each rank's stream and return without waiting;
/// [`SingleController::synchronize`] waits and reports device-side errors.
pub struct SingleController<B: Backend> {
    /// One core per device: rank i drives `ranks[i]`.
    ranks: Vec<Rank<B>>,
    /// Held while a collective is enqueued on every rank (or re-initialising), so that
    /// two threads' launches never interleave; guards the launch pool.
    launch_lock: Mutex<launcher::Launches>,
    /// Fault injection: bit r set makes rank r's next launch fail
    /// ([`SingleController::fail_next_launch`]).
    #[cfg(feature = "fault-injection")]
    failing_launches: AtomicU32,
}

/// The backend and the world size (not the devices' state).
impl<B: Backend> std::fmt::Debug for SingleController<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SingleController")
            .field("backend", &B::NAME)
            .field("world_size", &self.world_size())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> SingleController<B> {
    /// Opens the devices with these ordinals and builds a communicator over them.
    pub fn new(ordinals: &[usize], config: CommConfig) -> Result<Self> {
        check_world(ordinals.len())?;
        let devices = ordinals
            .iter()
            .map(|&o| B::open(o))
            .collect::<Result<Vec<_>>>()?;
        Self::from_devices(devices, config)
    }

    /// Builds a communicator over opened devices (rank i = `devices[i]`), setting up
    /// every core at once, one thread each. One physical device given twice (by
    /// [`Backend::identity`]) is `Error::InvalidDevices`, unless
    /// `CommConfig::allow_shared_devices`.
    pub fn from_devices(devices: Vec<B::Device>, config: CommConfig) -> Result<Self> {
        let world = devices.len();
        check_world(world)?;
        if !config.allow_shared_devices {
            let ids = devices
                .iter()
                .enumerate()
                .map(|(r, d)| setup::identity_of::<B>(d, r, &config))
                .collect::<Result<Vec<_>>>()?;
            for (a, ia) in ids.iter().enumerate() {
                for (b, ib) in ids.iter().enumerate().skip(a + 1) {
                    if record::same_identity(ia, ib, true) {
                        return Err(record::shared_device_error(a, ia, b, ib));
                    }
                }
            }
        }
        let hosts = vec![HostId::new("this process"); world];
        let bootstraps = LocalBootstrap::world(world, config.bootstrap_timeout);
        let mut made: Vec<Result<Rank<B>>> = std::thread::scope(|s| {
            let workers: Vec<_> = devices
                .into_iter()
                .zip(bootstraps)
                .map(|(device, bootstrap)| {
                    let (hosts, config) = (&hosts, &config);
                    s.spawn(move || {
                        let bootstrap = Arc::new(bootstrap);
                        let exchanges = Exchanges::new(bootstrap.clone());
                        let core = connect::connect::<B>(
                            device,
                            Arc::new(exchanges.of(ExchangeKind::Setup)),
                            Arc::new(exchanges.of(ExchangeKind::External)),
                            hosts,
                            config,
                            RankProcesses::OneProcess,
                        );
                        if core.is_err() {
                            bootstrap.abort();
                        }
                        core
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| {
                    w.join().unwrap_or_else(|_| {
                        Err(Error::InvalidDevices("a rank's setup panicked".into()))
                    })
                })
                .collect()
        });
        // A rank that gave up ends its peers' waits: report its cause, not theirs.
        let cause = |c: &Result<Rank<B>>| matches!(c, Err(e) if !matches!(e, Error::Bootstrap(_)));
        if let Some(i) = made.iter().position(cause) {
            made.swap(0, i);
        }
        let mut ranks = made.into_iter().collect::<Result<Vec<_>>>()?;
        if connect::needs_external(&ranks[0], world) {
            let devices: Vec<&B::Device> = ranks.iter().map(Rank::device).collect();
            let handles = crate::external::library_of::<B>().single_controller(&devices)?;
            for (core, handle) in ranks.iter_mut().zip(handles) {
                core.route.external = Some(handle);
            }
        }
        let mut launches = launcher::Launches {
            pool: None,
            parallel: false,
        };
        launches.set_parallel(world, config.parallel_launch, B::NAME)?;
        Ok(SingleController {
            ranks,
            launch_lock: Mutex::new(launches),
            #[cfg(feature = "fault-injection")]
            failing_launches: AtomicU32::new(0),
        })
    }

    /// Ranks in the communicator.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }
    /// Rank `i`'s core: its device, signal and grid (a per-rank [`crate::Comm::rank`]
    /// is a number; this is the rank itself).
    pub fn core(&self, i: usize) -> &Rank<B> {
        &self.ranks[i]
    }
    /// All ranks' cores.
    pub fn cores(&self) -> &[Rank<B>] {
        &self.ranks
    }
    /// Rank `i`'s core: the older name of [`SingleController::core`].
    #[deprecated(note = "renamed `core` (a per-rank `Comm::rank` is a number)")]
    pub fn rank(&self, i: usize) -> &Rank<B> {
        self.core(i)
    }
    /// All ranks' cores: the older name of [`SingleController::cores`].
    #[deprecated(note = "renamed `cores`")]
    pub fn ranks(&self) -> &[Rank<B>] {
        self.cores()
    }
    /// The signal layout (Lamport slot and payload sizes).
    pub fn layout(&self) -> SignalLayout {
        self.ranks[0].settings.layout
    }
    /// The configuration it was built with.
    pub fn config(&self) -> &CommConfig {
        &self.ranks[0].settings.config
    }
    /// Architecture of rank 0's device (keys the dispatch table).
    pub fn architecture(&self) -> &str {
        &self.ranks[0].settings.arch
    }
    /// Whether an earlier error has disabled collectives (see [`Error::Poisoned`]).
    pub fn is_poisoned(&self) -> bool {
        self.ranks.iter().any(Rank::is_poisoned)
    }
    /// How whole-world calls run: `Auto` when peer memory serves the world (its
    /// algorithms, as the dispatch table picks), `Nccl` when the external library does.
    pub fn world_path(&self) -> Algorithm {
        self.ranks[0].route.world_path()
    }

    /// Disables collectives on every rank until [`SingleController::reinitialize`];
    /// `cause` is what later calls' [`Error::Poisoned`] names.
    fn poison(&self, cause: &Error) {
        for r in &self.ranks {
            r.poison(cause);
        }
    }

    /// Waits for every rank's queued work, then reads every rank's error record. If a
    /// wait gave up, returns the root cause ([`Error::BarrierTimeout`] of the rank that
    /// timed out, else the [`Error::PeerAborted`] a rank was told) and poisons the
    /// communicator until [`SingleController::reinitialize`]. A collective a rank never
    /// makes is reported within 2 x [`CommConfig::barrier_timeout`] of its start.
    pub fn synchronize(&self) -> Result<()> {
        self.wait()?;
        let external = self.ranks.iter().map(Rank::take_external_error);
        external
            .collect::<Result<()>>()
            .inspect_err(|e| self.poison(e))?;
        self.report_records(Rank::read_error)
    }

    /// Reads every rank's record with `read` and reports the root cause, poisoning.
    fn report_records(&self, read: impl Fn(&Rank<B>) -> Result<Option<Error>>) -> Result<()> {
        // An aborting rank writes its own record before its peers' `PeerAborted`, so a
        // scan that met only aborts may have passed the aborter's rank just before it
        // wrote: one more scan then finds the cause.
        let mut first_abort = None;
        for _ in 0..2 {
            for r in &self.ranks {
                match read(r)? {
                    Some(e @ Error::PeerAborted { .. }) => {
                        first_abort.get_or_insert(e);
                    }
                    Some(e) => {
                        self.poison(&e);
                        return Err(e);
                    }
                    None => {}
                }
            }
            if first_abort.is_none() {
                return Ok(());
            }
        }
        let e = first_abort.expect("an abort was seen");
        self.poison(&e);
        Err(e)
    }

    /// Waits for all ranks, then resets every signal buffer to a new communicator's
    /// state: how a poisoned communicator is brought back.
    pub fn reinitialize(&self) -> Result<()> {
        self.reinitialize_with_counter_base(0)
    }

    /// As [`SingleController::reinitialize`], with every barrier counter starting at `base`
    /// (tests start near `u32::MAX` to cross the wrap).
    #[doc(hidden)]
    pub fn reinitialize_with_counter_base(&self, base: u32) -> Result<()> {
        let _launches = self.lock_launches();
        for r in &self.ranks {
            B::synchronize(r.device())?;
        }
        for r in &self.ranks {
            r.reset_signal(base)?;
        }
        for r in &self.ranks {
            r.unpoison();
        }
        Ok(())
    }

    /// A start and an end barrier over each group, and nothing else.
    pub fn barrier(&self, group_size: usize) -> Result<()> {
        let ranks: Vec<usize> = (0..self.world_size()).collect();
        self.barrier_on_ranks(group_size, &ranks)
    }

    /// The barrier kernel on the listed ranks only (the others never arrive: the
    /// timeout path's test).
    #[doc(hidden)]
    pub fn barrier_on_ranks(&self, group_size: usize, ranks: &[usize]) -> Result<()> {
        self.check_usable()?;
        let plan = self.ranks[0].barrier_plan(group_size)?;
        if let Some(r) = ranks.iter().find(|&&r| r >= self.world_size()) {
            let outside = format!("rank {r} is outside the world");
            return Err(Error::InvalidDevices(outside));
        }
        let zeros = [0u64; MAX_GPUS];
        self.launch_on(&plan, ranks, PeerInputs::InPlace(&zeros), &zeros, None)
    }

    /// Enqueues `iters` flag round trips between ranks 0 and 1 (through the first word
    /// of their payloads), to time the cross-GPU flag latency. Needs a world of 2 or more.
    #[doc(hidden)]
    pub fn launch_flag_ping_pong(&self, iters: u32) -> Result<()> {
        self.check_usable()?;
        if self.world_size() < 2 {
            return Err(Error::Unsupported(
                "the flag ping-pong needs two ranks".into(),
            ));
        }
        self.ranks[0].barrier_plan(0)?;
        let payload_off = self.layout().payload_offset() as u64;
        for r in &self.ranks[..2] {
            B::memset_d32(r.device(), r.signal_ptr() + payload_off, 0, 1)?;
        }
        for r in &self.ranks[..2] {
            B::synchronize(r.device())?;
        }
        let kind = KernelKind::PingPong;
        let kernel = Kernel {
            kind,
            dtype: DType::F32,
        };
        let dims = LaunchDims {
            blocks: 1,
            threads: 32,
        };
        let plan = Plan::new(kernel, Algorithm::Auto, 2, iters as usize, dims);
        let zeros = [0u64; MAX_GPUS];
        self.launch_on(&plan, &[0, 1], PeerInputs::InPlace(&zeros), &zeros, None)
    }
}

/// A single controller drives 1 to `MAX_GPUS` devices.
fn check_world(world: usize) -> Result<()> {
    if world == 0 || world > MAX_GPUS {
        return Err(Error::InvalidWorldSize {
            got: world,
            max: MAX_GPUS,
        });
    }
    Ok(())
}

/// The single controller's old name.
#[deprecated(note = "renamed `SingleController` (one process driving every GPU)")]
pub type Communicator<B> = SingleController<B>;
