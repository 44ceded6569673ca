//! The single-controller communicator: one process drives every rank's device, with
//! one signal buffer per rank and the peer mappings. Split by responsibility:
//! `config` (what it is built with), `validate` (checks before anything runs),
//! `plan` (algorithm, kernel and grid), `launch` (the one place kernel arguments are
//! built).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::backend::{Backend, Kernel, KernelKind, LaunchDims, MemoryKind};
use crate::dispatch::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::signal::{SignalLayout, MAX_GPUS, NUM_BARRIER_DOMAINS};
use crate::tensor::{Tensor, TensorMut};

mod call;
#[cfg(feature = "cuda")]
mod capture;
mod collective;
mod config;
mod fault;
mod launch;
mod parking;
#[doc(hidden)]
pub use parking::{free_expired_teardowns, parked_teardowns};
mod peer_check;
mod peer_setup;
mod per_rank;
mod plan;
mod route;
mod settings;
mod single_collectives;
mod single_route;
mod sizing;
mod slices;
mod status;
mod validate;

use crate::backend::{p2p::enable_p2p, signal_init::init_signal_buffer_with_counter_base};
pub use collective::CollectiveOptions;
pub use config::{AllReduceOptions, CommConfig};
pub use per_rank::Comm;
use plan::Plan;
use settings::Settings;
use single_route::SingleRoute;
pub use sizing::MemoryFootprint;
pub(crate) use status::read_error_record;
use validate::{check_world, first_missing_peer_pair, Meta};

/// One rank of a communicator: its device (with its stream), its signal buffer and
/// where it reaches its peers' signals. The per-rank core: both the single-controller
/// [`Communicator`] and the per-rank [`crate::Comm`] launch through it.
pub struct Rank<B: Backend> {
    /// World rank.
    index: usize,
    device: B::Device,
    signal: B::Memory,
    /// `peer_signals[j]`: where this rank reaches rank j's signal.
    peer_signals: [u64; MAX_GPUS],
    /// Collective launches per barrier domain since the signal was last initialised:
    /// the sequence number of the call descriptor (see `call.rs`), the same on every
    /// rank of a group that makes the same calls (sibling groups count apart).
    calls: [std::sync::atomic::AtomicU32; NUM_BARRIER_DOMAINS],
    /// Fault injection: the next launch publishes the sequence number one ahead, as a
    /// rank that made one call more would.
    skew_next: AtomicBool,
    /// Fault injection: the next launch is left out (counted as made).
    missing: AtomicBool,
}

impl<B: Backend> Rank<B> {
    /// The device (for CUDA: its context and the stream collectives run on).
    pub fn device(&self) -> &B::Device {
        &self.device
    }
    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        B::ordinal(&self.device)
    }
    /// Device address of this rank's signal buffer.
    pub fn signal_ptr(&self) -> u64 {
        B::memory_ptr(&self.signal)
    }
}

/// A set of devices (at most 8, one process) that all-reduce together.
///
/// Collectives are enqueued on each rank's stream and return without waiting; call
/// [`Communicator::synchronize`] to wait and to collect device-side errors (a barrier
/// timeout is reported there on GPUs).
pub struct Communicator<B: Backend> {
    ranks: Vec<Rank<B>>,
    settings: Settings,
    poisoned: AtomicBool,
    group_depth: AtomicUsize,
    /// Held while a collective is enqueued on every rank (and while re-initialising):
    /// two threads sharing the communicator must not interleave their launches, or
    /// ranks would run collectives in different orders.
    launch_lock: Mutex<()>,
    /// Fault injection: ranks (a bit each) the next launch leaves out.
    /// Which calls peer memory serves and which the external library.
    route: SingleRoute<B>,
}

impl<B: Backend> Communicator<B> {
    /// Opens the devices with these ordinals and builds a communicator over them.
    pub fn new(ordinals: &[usize], config: CommConfig) -> Result<Self> {
        check_world(ordinals.len())?;
        let devices = ordinals
            .iter()
            .map(|&o| B::open(o))
            .collect::<Result<Vec<_>>>()?;
        Self::from_devices(devices, config)
    }

    /// Builds a communicator over already opened devices (rank i = `devices[i]`):
    /// enables peer access between all pairs, allocates and initialises the signal
    /// buffers.
    pub fn from_devices(devices: Vec<B::Device>, config: CommConfig) -> Result<Self> {
        let world = devices.len();
        check_world(world)?;
        let mut ordinals: Vec<usize> = devices.iter().map(B::ordinal).collect();
        ordinals.sort_unstable();
        let shared = ordinals.windows(2).any(|w| w[0] == w[1]);
        if shared && !config.allow_shared_devices {
            return Err(Error::InvalidDevices(format!(
                "a device appears twice: {ordinals:?}"
            )));
        }
        if shared {
            for d in &devices {
                B::prepare_shared_device(d)?;
            }
        }
        let arch = B::architecture(&devices[0])?;
        // The same grid on every rank: from the device with the fewest multiprocessors.
        let sms = devices
            .iter()
            .enumerate()
            .map(|(r, d)| {
                Ok(config
                    .simulate
                    .multiprocessors_of(r, B::multiprocessor_count(d)?))
            })
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .min()
            .unwrap_or(1);
        let (fallback, simulate) = (config.fallback, config.simulate.clone());
        let mut settings = Settings::new(config, arch, sms, world, true)?;
        let per_device = ordinals
            .chunk_by(|a, b| a == b)
            .map(<[usize]>::len)
            .max()
            .unwrap_or(1);
        settings.limit_for_shared_devices(sms, per_device);
        let layout = settings.layout;
        // Peer access, or (with the fallback on) the external library for the world.
        let blocked = simulate
            .no_peer_access
            .filter(|&(a, b)| a != b && a.max(b) < world);
        let p2p = blocked.is_none() && enable_p2p::<B>(&devices)?;
        if !p2p && fallback.fallback == crate::external::Fallback::Refuse {
            let (from, to) = match blocked {
                Some((a, b)) => (B::ordinal(&devices[a]), B::ordinal(&devices[b])),
                None => first_missing_peer_pair::<B>(&devices)?,
            };
            return Err(Error::P2pUnavailable { from, to });
        }
        let signals = devices
            .iter()
            .map(|d| B::alloc(d, layout.checked_total_bytes()?, MemoryKind::Signal))
            .collect::<Result<Vec<_>>>()?;
        let mut ranks: Vec<Rank<B>> = devices
            .into_iter()
            .zip(signals)
            .enumerate()
            .map(|(index, (device, signal))| Rank {
                index,
                device,
                signal,
                peer_signals: [0; MAX_GPUS],
                calls: Default::default(),
                skew_next: AtomicBool::new(false),
                missing: AtomicBool::new(false),
            })
            .collect();
        for i in 0..world {
            for j in 0..world {
                let addr = if i == j {
                    B::memory_ptr(&ranks[j].signal)
                } else if p2p {
                    B::map_peer(&ranks[i].device, &ranks[j].signal)?
                } else {
                    0
                };
                ranks[i].peer_signals[j] = addr;
            }
        }
        let comm = Communicator {
            ranks,
            settings,
            poisoned: AtomicBool::new(false),
            group_depth: AtomicUsize::new(0),
            launch_lock: Mutex::new(()),
            route: SingleRoute::peer(),
        };
        comm.reinitialize()?;
        comm.finish_routing(p2p, fallback, simulate.fail_peer_check)
    }

    /// Ranks in the communicator.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }
    /// Rank `i`'s handle.
    pub fn rank(&self, i: usize) -> &Rank<B> {
        &self.ranks[i]
    }
    /// All ranks' handles.
    pub fn ranks(&self) -> &[Rank<B>] {
        &self.ranks
    }
    /// The signal layout (Lamport slot and payload sizes).
    pub fn layout(&self) -> SignalLayout {
        self.settings.layout
    }
    /// The configuration it was built with.
    pub fn config(&self) -> &CommConfig {
        &self.settings.config
    }
    /// Architecture of rank 0's device (keys the dispatch table).
    pub fn architecture(&self) -> &str {
        &self.settings.arch
    }
    /// Whether an earlier barrier timeout has disabled collectives.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// Waits for every rank's queued work, then reads every rank's error record: one
    /// small device-to-host copy per rank, so this costs more than a plain stream
    /// synchronisation. If a wait gave up, returns the root cause
    /// ([`Error::BarrierTimeout`] of the rank that timed out, else the
    /// [`Error::PeerAborted`] a rank was told) and poisons the communicator until
    /// [`Communicator::reinitialize`]. [`Communicator::wait`] only waits;
    /// [`Communicator::check_errors`] only reads the records, without waiting.
    ///
    /// A collective that a rank never makes (see `miss_next`) is reported within 2 x
    /// [`CommConfig::barrier_timeout`] (+ launch and copy latency) of its start on
    /// the streams, not within `barrier_timeout`: a wait gives up after
    /// `barrier_timeout`, then waits at most as long again for the peers to confirm
    /// they no longer read its rank's buffers (see the field's docs). With
    /// `barrier_timeout: None` it waits for as long as the rank stays away.
    pub fn synchronize(&self) -> Result<()> {
        self.wait()?;
        if let Err(e) = self.external_async_error() {
            self.poisoned.store(true, Ordering::Release);
            return Err(e);
        }
        self.check_device_errors()
    }

    /// Reads every rank's error record (waiting for its stream first); the root
    /// cause first: a timeout, else the abort a rank was told.
    fn check_device_errors(&self) -> Result<()> {
        self.report_records(|r| read_error_record::<B>(r))
    }

    /// Reads every rank's record with `read` and reports the root cause, poisoning.
    fn report_records(&self, read: impl Fn(&Rank<B>) -> Result<Option<Error>>) -> Result<()> {
        let mut first_abort = None;
        for r in &self.ranks {
            match read(r)? {
                Some(e @ Error::PeerAborted { .. }) => {
                    first_abort.get_or_insert(e);
                }
                Some(e) => {
                    self.poisoned.store(true, Ordering::Release);
                    return Err(e);
                }
                None => {}
            }
        }
        match first_abort {
            Some(e) => {
                self.poisoned.store(true, Ordering::Release);
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Waits for all ranks, then zeroes every signal buffer and refills the Lamport
    /// regions with the sentinel: the state of a new communicator. This is how a
    /// communicator poisoned by a timeout is brought back.
    pub fn reinitialize(&self) -> Result<()> {
        self.reinitialize_with_counter_base(0)
    }

    /// As [`Communicator::reinitialize`], with every barrier counter starting at `base`
    /// (tests start near `u32::MAX` to cross the wrap).
    #[doc(hidden)]
    pub fn reinitialize_with_counter_base(&self, base: u32) -> Result<()> {
        let _launches = self.lock_launches();
        for r in &self.ranks {
            B::synchronize(&r.device)?;
        }
        for r in &self.ranks {
            init_signal_buffer_with_counter_base::<B>(
                &r.device,
                &r.signal,
                self.settings.layout,
                base,
            )?;
            r.restart_calls();
        }
        for r in &self.ranks {
            B::synchronize(&r.device)?;
        }
        self.poisoned.store(false, Ordering::Release);
        Ok(())
    }

    /// Starts a batch of collectives. Collectives inside a batch are launched as they
    /// are called (the batch is a correct no-op kept for NCCL-style call sites).
    pub fn group_start(&self) {
        self.group_depth.fetch_add(1, Ordering::AcqRel);
    }

    /// Ends a batch started by [`Communicator::group_start`].
    pub fn group_end(&self) -> Result<()> {
        self.group_depth
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| d.checked_sub(1))
            .map(|_| ())
            .map_err(|_| Error::Unsupported("group_end without group_start".into()))
    }

    /// Sums `inputs[r]` over each group into `outputs[r]` (one tensor per rank, same
    /// dtype, shape and length everywhere). Returns the algorithm that ran.
    pub fn all_reduce_sum(
        &self,
        inputs: &[Tensor<'_, B>],
        outputs: &mut [TensorMut<'_, B>],
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        self.check_usable()?;
        self.check_count(inputs.len())?;
        self.check_count(outputs.len())?;
        let metas: Vec<Meta> = inputs
            .iter()
            .map(|t| Meta {
                dtype: t.data.dtype(),
                len: t.data.len(),
                ordinal: t.data.device_ordinal(),
            })
            .collect();
        let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
        self.check_tensors(&metas, &shapes, "input")?;
        for (r, (o, i)) in outputs.iter().zip(inputs).enumerate() {
            let om = Meta {
                dtype: o.data.dtype(),
                len: o.data.len(),
                ordinal: o.data.device_ordinal(),
            };
            self.check_tensor(r, &om, &o.shape, "output")?;
            if om.dtype != metas[r].dtype {
                return Err(Error::DTypeMismatch {
                    rank: r,
                    expected: metas[r].dtype,
                    got: om.dtype,
                });
            }
            if om.len != metas[r].len {
                return Err(Error::LengthMismatch {
                    rank: r,
                    what: format!(
                        "output has {} elements but its input {}",
                        om.len, metas[r].len
                    ),
                });
            }
            if o.shape != i.shape {
                return Err(Error::ShapeMismatch {
                    rank: r,
                    expected: i.shape.clone(),
                    got: o.shape.clone(),
                });
            }
        }
        if self.routes_external(metas[0].dtype, metas[0].len, options)? {
            let ranks = &self.ranks;
            let mut guards = Vec::with_capacity(2 * ranks.len());
            let mut ins = Vec::with_capacity(ranks.len());
            let mut outs = Vec::with_capacity(ranks.len());
            for (r, t) in inputs.iter().enumerate() {
                let (p, g) = t.data.read_ptr(&ranks[r].device);
                ins.push(p);
                guards.push(g);
            }
            for (r, t) in outputs.iter_mut().enumerate() {
                let (p, g) = t.data.write_ptr(&ranks[r].device);
                outs.push(p);
                guards.push(g);
            }
            let result = self.run_external(&ins, &outs, metas[0].len, metas[0].dtype);
            drop(guards);
            return result;
        }
        let plan = self
            .settings
            .plan(metas[0].dtype, metas[0].len, options, false)?;
        if plan.elements == 0 {
            return Ok(plan.algorithm);
        }
        self.launch_collective(&plan, inputs, outputs)
            .map(|_| plan.algorithm)
    }

    /// Sums `tensors[r]` over each group in place. Returns the algorithm that ran.
    pub fn all_reduce_sum_in_place(
        &self,
        tensors: &mut [TensorMut<'_, B>],
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        self.check_usable()?;
        self.check_count(tensors.len())?;
        let metas: Vec<Meta> = tensors
            .iter()
            .map(|t| Meta {
                dtype: t.data.dtype(),
                len: t.data.len(),
                ordinal: t.data.device_ordinal(),
            })
            .collect();
        let shapes: Vec<Vec<usize>> = tensors.iter().map(|t| t.shape.clone()).collect();
        let shape_refs: Vec<&[usize]> = shapes.iter().map(|s| s.as_slice()).collect();
        self.check_tensors(&metas, &shape_refs, "in-place")?;
        if self.routes_external(metas[0].dtype, metas[0].len, options)? {
            let ranks = &self.ranks;
            let mut guards = Vec::with_capacity(ranks.len());
            let mut ptrs = Vec::with_capacity(ranks.len());
            for (r, t) in tensors.iter_mut().enumerate() {
                let (p, g) = t.data.write_ptr(&ranks[r].device);
                ptrs.push(p);
                guards.push(g);
            }
            let result = self.run_external(&ptrs, &ptrs, metas[0].len, metas[0].dtype);
            drop(guards);
            return result;
        }
        let plan = self
            .settings
            .plan(metas[0].dtype, metas[0].len, options, true)?;
        if plan.elements == 0 {
            return Ok(plan.algorithm);
        }
        let ranks = &self.ranks;
        let mut guards = Vec::with_capacity(ranks.len());
        let mut ptrs = [0u64; MAX_GPUS];
        for (r, t) in tensors.iter_mut().enumerate() {
            let (p, g) = t.data.write_ptr(&ranks[r].device);
            ptrs[r] = p;
            guards.push(g);
        }
        let result = self
            .check_peers_reach(&plan, &ptrs, "in-place")
            .and_then(|_| self.launch_all(&plan, &ptrs, &ptrs));
        drop(guards);
        result.map(|_| plan.algorithm)
    }

    /// A start and an end barrier over each group, and nothing else.
    pub fn barrier(&self, group_size: usize) -> Result<()> {
        let ranks: Vec<usize> = (0..self.world_size()).collect();
        self.barrier_on_ranks(group_size, &ranks)
    }

    /// Launches the barrier kernel on the listed ranks only: the others never arrive,
    /// which is how the timeout path is tested.
    #[doc(hidden)]
    pub fn barrier_on_ranks(&self, group_size: usize, ranks: &[usize]) -> Result<()> {
        self.check_usable()?;
        let plan = self.settings.barrier_plan(group_size)?;
        self.check_peer_group(plan.width)?;
        let zeros = [0u64; MAX_GPUS];
        for &r in ranks {
            if r >= self.world_size() {
                return Err(Error::InvalidDevices(format!(
                    "rank {r} is outside the world"
                )));
            }
        }
        self.launch_on(&plan, ranks, &zeros, &zeros)
    }

    /// Fault injection: enqueues on `rank`'s stream a kernel that spins for `delay` and
    /// touches no memory, so that rank's next collective starts late. This is how the
    /// tests skew ranks in time, and how a user can test their own timeout handling
    /// (a delay longer than [`CommConfig::barrier_timeout`] makes the other ranks give
    /// up). Capturable in a CUDA graph like any launch.
    pub fn delay_rank(&self, rank: usize, delay: Duration) -> Result<()> {
        if rank >= self.world_size() {
            return Err(Error::InvalidDevices(format!(
                "rank {rank} is outside the world of {}",
                self.world_size()
            )));
        }
        let _launches = self.lock_launches();
        self.ranks[rank].launch_delay(delay)
    }

    /// Enqueues `iters` flag round trips between ranks 0 and 1 (one thread each, through
    /// the first word of their payloads): time it with the backend's events to measure
    /// the cross-GPU flag latency. Needs a world of at least 2.
    #[doc(hidden)]
    pub fn launch_flag_ping_pong(&self, iters: u32) -> Result<()> {
        self.check_usable()?;
        if self.world_size() < 2 {
            return Err(Error::Unsupported(
                "the flag ping-pong needs two ranks".into(),
            ));
        }
        self.check_peer_group(2)?;
        let payload_off = self.settings.layout.payload_offset() as u64;
        for r in 0..2 {
            B::memset_d32(
                &self.ranks[r].device,
                self.ranks[r].signal_ptr() + payload_off,
                0,
                1,
            )?;
        }
        for r in 0..2 {
            B::synchronize(&self.ranks[r].device)?;
        }
        let plan = Plan {
            kernel: Kernel {
                kind: KernelKind::PingPong,
                dtype: DType::F32,
            },
            algorithm: Algorithm::Auto,
            width: 2,
            elements: iters as usize,
            stage_input: false,
            dims: LaunchDims {
                blocks: 1,
                threads: 32,
            },
            overlap_previous: false,
            collective: Default::default(),
        };
        let zeros = [0u64; MAX_GPUS];
        self.launch_on(&plan, &[0, 1], &zeros, &zeros)
    }
}
