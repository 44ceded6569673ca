//! The per-rank communicator: one rank, created in the thread or process that owns its
//! device, shaped like cudarc's `nccl::Comm`. Ranks find each other through a
//! [`Bootstrap`] (by default TCP from a [`UniqueId`]), exchange their signal
//! allocations as IPC handles (or plain addresses when they share a process), and
//! from then on each call launches only this rank's kernel on this rank's stream.
//!
//! Kernels read peer data only from the peers' signal allocations: an input the peers
//! need is staged into this rank's payload first (one-stage), or pushed into the
//! peers' Lamport regions (Lamport). User buffers are never exported, so they need no
//! registration and every call is capturable in a CUDA graph.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut};
use crate::bootstrap::{Bootstrap, HostId, TcpBootstrap, UniqueId};
use crate::dispatch::Algorithm;
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;
use crate::{backend::signal_init::init_signal_buffer_with_counter_base, SignalLayout};

use super::route::{self, Path, RouteError, Router};
use super::settings::Settings;
use super::{read_error_record, AllReduceOptions, CommConfig, Rank};

mod collectives;

/// One rank of a communicator whose ranks live in different threads or processes.
///
/// ```
/// use peercomm::backend::{host::Host, Backend};
/// use peercomm::bootstrap::UniqueId;
/// use peercomm::{AllReduceOptions, Comm, CommConfig};
///
/// let id = UniqueId::new()?; // made by rank 0, sent to the others (string or bytes)
/// let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
///     let workers: Vec<_> = (0..2)
///         .map(|rank| {
///             s.spawn(move || {
///                 let dev = Host::open(rank).unwrap();
///                 let comm = Comm::<Host>::from_rank(dev, rank, 2, &id, CommConfig::default()).unwrap();
///                 let mut send = Host::alloc_buffer::<f32>(comm.device(), 4).unwrap();
///                 Host::upload(comm.device(), &[rank as f32 + 1.0; 4], &mut send).unwrap();
///                 let mut recv = Host::alloc_buffer::<f32>(comm.device(), 4).unwrap();
///                 comm.all_reduce_sum(&send, &mut recv, &AllReduceOptions::new()).unwrap();
///                 comm.synchronize().unwrap();
///                 Host::download(comm.device(), &recv).unwrap()
///             })
///         })
///         .collect();
///     workers.into_iter().map(|w| w.join().unwrap()).collect()
/// });
/// assert_eq!(sums, vec![vec![3.0; 4]; 2]);
/// # Ok::<(), peercomm::bootstrap::BootstrapError>(())
/// ```
///
/// # One issuing thread per rank
///
/// `Comm` is [`Send`] (move it to the thread that drives its rank) but not [`Sync`]:
/// two threads issuing collectives on one rank would enqueue them in an order the
/// peers cannot know, and pair one thread's call with another's on the peers. NCCL
/// asks the same of its communicators; here the compiler enforces it. (A call made out
/// of order still cannot pass silently: the call descriptor's sequence number makes it
/// a [`Error::CallMismatch`].)
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<peercomm::Comm<peercomm::backend::host::Host>>();
/// ```
pub struct Comm<B: Backend> {
    /// Taken out by `Drop` (freed, or its signal parked): never used after it.
    pub(super) rank: std::mem::ManuallyDrop<Rank<B>>,
    pub(super) settings: Settings,
    bootstrap: Arc<dyn Bootstrap>,
    hosts: Vec<HostId>,
    /// Which calls peer memory serves and which the external library (`rank` and
    /// `settings` describe the peer-memory core: the world, this host's ranks, or
    /// this rank alone).
    route: Router<B>,
    /// Peer signals imported from other processes; unmapped on drop after the
    /// teardown barrier, or parked with this rank's signal (see `Drop`).
    mappings: Vec<B::PeerMapping>,
    pub(super) poisoned: AtomicBool,
    /// Held while a collective is enqueued, so two threads sharing this rank cannot
    /// interleave their launches with a re-initialisation.
    launch_lock: Mutex<()>,
    torn_down: AtomicBool,
    /// Makes `Comm` `Send` but not `Sync` (see "One issuing thread per rank").
    _one_issuing_thread: std::marker::PhantomData<std::cell::Cell<()>>,
}

/// A checksum of what every rank's configuration must agree on (FNV-1a).
pub(crate) fn config_checksum(config: &CommConfig) -> u64 {
    let timeout = config
        .barrier_timeout
        .map_or(0, |t| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX));
    let [fallback, by_size, above] = config.fallback.code();
    let fields = [
        config.lamport_slot_bytes as u64,
        config.payload_bytes as u64,
        timeout,
        config.max_blocks.map_or(u64::MAX, u64::from),
        u64::from(config.threads_per_block),
        u64::from(config.allow_shared_devices),
        fallback,
        by_size,
        above,
        config.simulate.code(),
    ];
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for byte in fields.iter().flat_map(|f| f.to_le_bytes()) {
        h = (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl<B: Backend> Comm<B> {
    /// Rank `rank` of `world_size`, on `device` (opened by this thread or process,
    /// for CUDA with the stream collectives should run on:
    /// `CudaDevice::from_stream`). Every rank calls this with the same `id` (made by
    /// rank 0 with [`UniqueId::new`] and sent to the others) and the same `config`;
    /// it returns once all ranks have joined, or with a typed error when one does not
    /// come within `config.bootstrap_timeout`.
    pub fn from_rank(
        device: B::Device,
        rank: usize,
        world_size: usize,
        id: &UniqueId,
        config: CommConfig,
    ) -> Result<Self> {
        route::check_world(world_size, &config)?;
        config.check_per_rank_timeouts()?;
        let bootstrap = TcpBootstrap::connect(
            id,
            rank,
            world_size,
            config_checksum(&config),
            config.bootstrap_timeout,
        )?;
        let hosts = bootstrap.host_ids().to_vec();
        Self::setup(device, Box::new(bootstrap), hosts, config)
    }

    /// As [`Comm::from_rank`], over a bootstrap the engine brings (its own store:
    /// torch.distributed, MPI, an RPC layer): rank and world size come from it.
    pub fn from_bootstrap(
        device: B::Device,
        bootstrap: Box<dyn Bootstrap>,
        config: CommConfig,
    ) -> Result<Self> {
        route::check_world(bootstrap.world_size(), &config)?;
        config.check_per_rank_timeouts()?;
        let hosts = bootstrap
            .all_gather(crate::bootstrap::host_identity().as_str().as_bytes())?
            .into_iter()
            .map(|h| HostId::new(String::from_utf8_lossy(&h).into_owned()))
            .collect();
        Self::setup(device, bootstrap, hosts, config)
    }

    fn setup(
        device: B::Device,
        bootstrap: Box<dyn Bootstrap>,
        hosts: Vec<HostId>,
        config: CommConfig,
    ) -> Result<Self> {
        let bootstrap: Arc<dyn Bootstrap> = Arc::from(bootstrap);
        let hosts = match &config.simulate.hosts {
            Some(h) if h.len() != hosts.len() => {
                return Err(Error::InvalidConfig(format!(
                    "Simulation::hosts names {} hosts for {} ranks",
                    h.len(),
                    hosts.len()
                )))
            }
            Some(h) => h.clone(),
            None => hosts,
        };
        let (core, route) = route::connect::<B>(device, bootstrap.clone(), &hosts, &config)?;
        // No rank launches before every rank is set up.
        bootstrap.barrier()?;
        Ok(Comm {
            rank: std::mem::ManuallyDrop::new(core.rank),
            settings: core.settings,
            bootstrap,
            hosts,
            mappings: core.mappings,
            route,
            poisoned: AtomicBool::new(false),
            launch_lock: Mutex::new(()),
            torn_down: AtomicBool::new(false),
            _one_issuing_thread: std::marker::PhantomData,
        })
    }

    /// This rank's index in the world.
    pub fn rank(&self) -> usize {
        self.route.world_rank
    }
    /// Ranks in the world.
    pub fn world_size(&self) -> usize {
        self.route.world
    }
    /// How whole-world calls run: `OneStage`/`TwoStage`/`Lamport` are all possible
    /// when this returns `Auto` (peer memory serves the world); `Nccl` when the
    /// external library serves it; `Hierarchical` when the ranks span hosts.
    pub fn world_path(&self) -> Algorithm {
        self.route.world_path()
    }
    /// The device (for CUDA: its context and the stream collectives run on).
    pub fn device(&self) -> &B::Device {
        &self.rank.device
    }
    /// Each rank's host identity, as the bootstrap saw it.
    pub fn hosts(&self) -> &[HostId] {
        &self.hosts
    }
    /// The signal layout (Lamport slot and payload sizes).
    pub fn layout(&self) -> SignalLayout {
        self.settings.layout
    }
    /// The configuration it was built with.
    pub fn config(&self) -> &CommConfig {
        &self.settings.config
    }
    /// Whether an earlier error has disabled collectives until [`Comm::reinitialize`].
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// Sums `send` over each group into `recv`, on this rank's stream; returns at once
    /// with the algorithm that runs. Every rank of the group must make the same call
    /// (same dtype, length, options) in the same order, as with NCCL. Unlike NCCL, a
    /// rank that does not gets a typed error instead of a wrong sum: the kernels
    /// compare each peer's call descriptor at the first barrier, and
    /// [`Comm::synchronize`] returns [`Error::CallMismatch`] naming the peer and the
    /// field on every rank, with nothing written. A rank whose peers never make the call
    /// gets [`Error::BarrierTimeout`] naming the rank it waited for.
    pub fn all_reduce_sum<S, R>(
        &self,
        send: &S,
        recv: &mut R,
        options: &AllReduceOptions,
    ) -> Result<Algorithm>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.check_usable()?;
        self.check_buffer(send.device_ordinal(), "input")?;
        self.check_buffer(recv.device_ordinal(), "output")?;
        if send.dtype() != recv.dtype() {
            return Err(Error::DTypeMismatch {
                rank: self.rank(),
                expected: send.dtype(),
                got: recv.dtype(),
            });
        }
        if send.len() != recv.len() {
            return Err(Error::LengthMismatch {
                rank: self.rank(),
                what: format!(
                    "output has {} elements but its input {}",
                    recv.len(),
                    send.len()
                ),
            });
        }
        let options = match self.route.path(send.dtype(), send.len(), options)? {
            Path::Peer(local) => local,
            path => {
                let dev = &self.rank.device;
                let (input, in_guard) = send.read_ptr(dev);
                let (output, out_guard) = recv.write_ptr(dev);
                let result =
                    self.run_routed(path, input, output, send.len(), send.dtype(), options);
                drop((in_guard, out_guard));
                return result;
            }
        };
        let plan = self
            .settings
            .plan(send.dtype(), send.len(), &options, false)?;
        if plan.elements == 0 {
            return Ok(plan.algorithm);
        }
        let dev = &self.rank.device;
        let (input, in_guard) = send.read_ptr(dev);
        let (output, out_guard) = recv.write_ptr(dev);
        let mut inputs = [0u64; MAX_GPUS];
        inputs[self.rank.index] = input;
        let result =
            self.launch_collective(|| self.rank.launch(&self.settings, &plan, &inputs, output));
        drop((in_guard, out_guard));
        result.map(|_| plan.algorithm)
    }

    /// Sums `buf` over each group in place. As [`Comm::all_reduce_sum`].
    pub fn all_reduce_sum_in_place<R>(
        &self,
        buf: &mut R,
        options: &AllReduceOptions,
    ) -> Result<Algorithm>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.check_usable()?;
        self.check_buffer(buf.device_ordinal(), "in-place")?;
        let options = match self.route.path(buf.dtype(), buf.len(), options)? {
            Path::Peer(local) => local,
            path => {
                let (len, dtype) = (buf.len(), buf.dtype());
                let (ptr, guard) = buf.write_ptr(&self.rank.device);
                let result = self.run_routed(path, ptr, ptr, len, dtype, options);
                drop(guard);
                return result;
            }
        };
        let plan = self.settings.plan(buf.dtype(), buf.len(), &options, true)?;
        if plan.elements == 0 {
            return Ok(plan.algorithm);
        }
        let (ptr, guard) = buf.write_ptr(&self.rank.device);
        let mut inputs = [0u64; MAX_GPUS];
        inputs[self.rank.index] = ptr;
        let result =
            self.launch_collective(|| self.rank.launch(&self.settings, &plan, &inputs, ptr));
        drop(guard);
        result.map(|_| plan.algorithm)
    }

    /// A start and an end barrier over this rank's group, on its stream (groups that
    /// peer memory serves only).
    pub fn barrier(&self, group_size: usize) -> Result<()> {
        self.check_usable()?;
        let options = AllReduceOptions::new().group_size(group_size);
        let group_size = match self.route.path(crate::DType::F32, 0, &options)? {
            Path::Peer(local) => local.group_size,
            _ => {
                return Err(Error::Unsupported(
                    "a device barrier needs peer memory between the group's ranks".into(),
                ))
            }
        };
        let plan = self.settings.barrier_plan(group_size)?;
        let zeros = [0u64; MAX_GPUS];
        self.launch_collective(|| self.rank.launch(&self.settings, &plan, &zeros, 0))
    }

    /// Fault injection: this rank's next collective starts `delay` late (a kernel that
    /// spins on its stream). See [`crate::Communicator::delay_rank`].
    pub fn delay(&self, delay: Duration) -> Result<()> {
        self.launch(|| self.rank.launch_delay(delay))
    }

    /// Waits for this rank's queued work, then reads its error record (a small
    /// device-to-host copy, so this costs more than a stream synchronisation): a wait
    /// that gave up on this rank returns [`Error::BarrierTimeout`], a peer that gave up
    /// [`Error::PeerAborted`], and the communicator refuses collectives until
    /// [`Comm::reinitialize`]. [`Comm::wait`] only waits; [`Comm::check_errors`] only
    /// reads the record, without waiting.
    ///
    /// A collective that a peer never makes is reported within 2 x
    /// [`CommConfig::barrier_timeout`] (+ launch and copy latency) of its start on
    /// this rank's stream, not within `barrier_timeout`: the wait gives up after
    /// `barrier_timeout`, then waits at most as long again for the peers to confirm
    /// they no longer read this rank's buffers (see the field's docs). With
    /// `barrier_timeout: None` it waits for as long as the peer stays away.
    pub fn synchronize(&self) -> Result<()> {
        self.wait()?;
        if let Err(e) = self.route.take_async_error() {
            self.poisoned.store(true, Ordering::Release);
            return Err(e);
        }
        self.report(read_error_record::<B>(&self.rank)?)
    }

    /// Brings every rank back to the state of a new communicator after an error: a
    /// collective call (every rank calls it), through the bootstrap. Fails with a
    /// bootstrap error when a rank is gone; then the communicator must be rebuilt.
    pub fn reinitialize(&self) -> Result<()> {
        let _launches = self.launch_lock.lock().unwrap_or_else(|e| e.into_inner());
        B::synchronize(&self.rank.device)?;
        // Nobody may still touch a signal while it is being reset, nor launch before
        // every signal is reset.
        self.bootstrap.barrier()?;
        init_signal_buffer_with_counter_base::<B>(
            &self.rank.device,
            &self.rank.signal,
            self.settings.layout,
            0,
        )?;
        self.rank.restart_calls();
        B::synchronize(&self.rank.device)?;
        self.bootstrap.barrier()?;
        self.poisoned.store(false, Ordering::Release);
        Ok(())
    }

    /// Runs a call the router sent away from this rank's peer-memory kernels; a
    /// failure once something was enqueued poisons the communicator.
    fn run_routed(
        &self,
        path: Path,
        input: u64,
        output: u64,
        elements: usize,
        dtype: crate::DType,
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        let _launches = self.launch_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.check_usable()?;
        let r = &self.rank;
        match route::run(
            &self.route,
            path,
            r,
            &self.settings,
            input,
            output,
            elements,
            dtype,
            options.blocks,
        ) {
            Ok(a) => Ok(a),
            Err(RouteError::Validation(e)) => Err(e),
            Err(RouteError::Launched(e)) => {
                self.poisoned.store(true, Ordering::Release);
                Err(e)
            }
        }
    }

    fn check_usable(&self) -> Result<()> {
        if self.is_poisoned() {
            Err(Error::Poisoned)
        } else {
            Ok(())
        }
    }

    fn check_buffer(&self, ordinal: usize, which: &'static str) -> Result<()> {
        let expected = B::ordinal(&self.rank.device);
        if ordinal != expected {
            return Err(Error::WrongDevice {
                rank: self.rank(),
                which,
                expected,
                got: ordinal,
            });
        }
        Ok(())
    }

    fn launch(&self, f: impl FnOnce() -> Result<()>) -> Result<()> {
        let _launches = self.launch_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.check_usable()?;
        f()
    }

    /// As `launch`, for a collective (one that fault injection may leave out: the
    /// rank's launch does that).
    fn launch_collective(&self, f: impl FnOnce() -> Result<()>) -> Result<()> {
        self.launch(f)
    }
}

/// How long dropping a [`Comm`] waits for the other ranks' teardown: about a second,
/// whatever `CommConfig::bootstrap_timeout` says, so that a drop whose peer is gone
/// (or never drops) returns at once, as cudarc's does. A drop that does not hear from
/// every rank in time parks its memory instead of freeing it (see `Drop for Comm`).
const TEARDOWN_BARRIER_TIMEOUT: Duration = Duration::from_secs(1);

/// Margin past 2 x `barrier_timeout` that parked memory is kept: room for a peer's
/// kernel that was queued (behind up to this much earlier work on its stream) when
/// this rank dropped, and for host threads that a loaded machine schedules late.
const PARK_MARGIN: Duration = Duration::from_secs(10);

/// Until when memory parked at `now` is kept: 2 x `barrier_timeout` + [`PARK_MARGIN`]
/// later; `None` (until the process exits) when the kernels' waits never end or the
/// sum does not fit in an `Instant`.
fn park_deadline(
    now: std::time::Instant,
    barrier_timeout: Option<Duration>,
) -> Option<std::time::Instant> {
    let kernel = barrier_timeout?.checked_mul(2)?;
    now.checked_add(kernel.checked_add(PARK_MARGIN)?)
}

impl<B: Backend> Drop for Comm<B> {
    /// Tears this rank down without freeing memory that a peer's kernel may still write
    /// into. Never panics, and returns within about a second (`TEARDOWN_BARRIER_TIMEOUT`)
    /// after this rank's own queued work, whatever the peers do:
    ///
    /// 1. Waits for this rank's stream.
    /// 2. Meets the other ranks in a teardown barrier through the bootstrap
    ///    ([`Bootstrap::barrier_within`]), bounded by `TEARDOWN_BARRIER_TIMEOUT` (1 s),
    ///    not by `CommConfig::bootstrap_timeout`.
    /// 3. If every rank met it, every rank has drained its stream too, so no kernel of
    ///    the group runs or is queued: the signal allocation and the peer mappings are
    ///    freed at once (in stream order). Likewise when no peer shares this rank's
    ///    peer memory (a world of one, or calls served by the external library).
    /// 4. Otherwise a peer is gone or late, and this rank cannot tell which: its kernels
    ///    may still store into this rank's signal (barrier arrivals, Lamport data, the
    ///    error record and abort word, the abandon protocol's confirmation). The signal
    ///    and the mappings are parked in a process-wide lot for 2 x
    ///    `CommConfig::barrier_timeout` + `PARK_MARGIN` (10 s) from the end of the
    ///    barrier, and freed by a later `Comm` drop once that has passed; with
    ///    `barrier_timeout: None` (waits that never end) they stay until the process
    ///    exits. Nothing runs in the background, and the drop never waits for the
    ///    deadline.
    ///
    /// Guaranteed: a peer's kernel that is running when this rank drops, or that
    /// starts within `PARK_MARGIN` of the park (it was queued behind less than that
    /// much work), never writes memory this rank freed. Once this rank has stopped,
    /// the first wait of that kernel that needs this rank gives up within
    /// `barrier_timeout` (in a group of more than two, after at most one wait that
    /// another peer satisfies late), and the block's last store into this rank's
    /// signal is the abandon confirmation at that point: at most 2 x `barrier_timeout`
    /// after the kernel started or this rank dropped, whichever is later. A peer that
    /// also drops meets this rank in the barrier or finds it gone, and parks or frees
    /// the same way.
    ///
    /// Not guaranteed: a peer must not start new collectives after a rank of its group
    /// has dropped. Such a collective cannot complete: its waits for this rank give up
    /// after `barrier_timeout`, [`Comm::synchronize`] on that peer returns
    /// [`Error::BarrierTimeout`] (or [`Error::PeerAborted`]) within 2 x
    /// `barrier_timeout`, its communicator is poisoned, and [`Comm::reinitialize`]
    /// fails with a bootstrap error, so it must be dropped too. Its kernel stores into
    /// this rank's signal; that is safe while the signal is parked (it starts within
    /// `PARK_MARGIN` of the park), and afterwards, for ranks that share a process,
    /// writes memory this rank freed. With `barrier_timeout: None` such a kernel never
    /// ends.
    fn drop(&mut self) {
        if self.torn_down.swap(true, Ordering::AcqRel) {
            return;
        }
        // SAFETY: taken here, once; nothing reads `self.rank` after this (the other
        // fields' drops do not use it).
        let rank = unsafe { std::mem::ManuallyDrop::take(&mut self.rank) };
        let mappings = std::mem::take(&mut self.mappings);
        let (world, peers) = (self.route.world, self.settings.world);
        let bootstrap = &self.bootstrap;
        let confirmed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let idle = B::synchronize(&rank.device).is_ok();
            // Always met, even after a failed wait: the peers are waiting for it.
            let met = world == 1 || bootstrap.barrier_within(TEARDOWN_BARRIER_TIMEOUT).is_ok();
            idle && met
        }))
        .unwrap_or(false);
        if confirmed || peers == 1 {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                drop(mappings);
                drop(rank);
            }));
            super::parking::free_expired();
        } else {
            let Rank { device, signal, .. } = rank;
            let until = park_deadline(
                std::time::Instant::now(),
                self.settings.config.barrier_timeout,
            );
            super::parking::park(Box::new((signal, mappings)), until);
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(device)));
        }
    }
}

#[cfg(test)]
mod teardown_tests {
    use super::*;

    #[test]
    fn park_deadline_is_twice_the_barrier_timeout_plus_the_margin() {
        let now = std::time::Instant::now();
        let t = Duration::from_secs(3);
        assert_eq!(park_deadline(now, Some(t)), Some(now + 2 * t + PARK_MARGIN));
        assert_eq!(park_deadline(now, None), None);
        assert_eq!(park_deadline(now, Some(Duration::MAX)), None);
        assert_eq!(park_deadline(now, Some(Duration::MAX / 2)), None);
    }
}
