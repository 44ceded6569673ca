//! The per-rank front door: [`Comm`], one rank in the thread or process that owns its
//! device, shaped like cudarc's `nccl::Comm`: a core plus its bootstrap. Each call
//! launches only this rank's kernel on its stream. Peers read each other's signal
//! allocations (inputs staged or pushed), or registered and symmetric inputs in place.

use std::sync::Arc;

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut, IntoDevice, KernelKind};
use crate::bootstrap::{Bootstrap, ExchangeKind, Exchanges, HostId, TcpBootstrap, UniqueId};
use crate::dispatch::Algorithm;
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};

use super::config::{compare_configs, encode_config};
use super::core::Rank;
use super::{AllReduceOptions, CommConfig};
use crate::comm::core::launch::{Fused, PeerInputs};
use crate::comm::core::planning::check::{check_overlaps, Meta, Routed, Span};
use crate::comm::core::planning::{PeerReads, Plan};
use crate::comm::core::routing::{self as route, RouteError};
use crate::comm::core::setup::connect;
use crate::comm::core::setup::RankProcesses;
use crate::comm::zero_copy::registry::{InPlace, Registry};

mod collectives;
mod exchange;
pub(crate) mod group;
mod lifecycle;
mod parking;

#[cfg(feature = "unstable")]
pub use parking::{free_expired_teardowns, parked_teardowns};

/// One rank of a communicator whose ranks live in different threads or processes
/// (the crate docs show two ranks in two threads).
///
/// `Comm` is [`Send`] but not [`Sync`]: two threads issuing collectives on one rank
/// would enqueue them in an order the peers cannot know (NCCL asks the same).
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<peercomm::Comm<peercomm::backend::host::Host>>();
/// ```
///
/// A call returns once enqueued, so what the kernels find shows later, as with NCCL:
/// per step, [`Comm::check_errors`] (no wait), [`Comm::synchronize`] only where the
/// engine waits anyway; [`Error::recovery`] says what to do on an error.
///
/// ```
/// # use peercomm::backend::{host::Host, Backend};
/// # use peercomm::{Comm, Error, Recovery, ReduceOp};
/// fn step(comm: &Comm<Host>, buf: &mut <Host as Backend>::Buffer<f32>) -> Result<(), Error> {
///     comm.all_reduce_in_place(buf, &ReduceOp::Sum)?; // enqueued, not done
///     // ... the engine's other work for this step ...
///     comm.check_errors() // no wait: an error found so far, if any
/// }
/// # let id = peercomm::bootstrap::UniqueId::new()?;
/// # let dev = Host::open(0)?;
/// # let comm = Comm::<Host>::from_rank(dev, 0, 1, &id, Default::default())?;
/// # let mut buf = Host::alloc_buffer::<f32>(comm.device(), 4)?;
/// match step(&comm, &mut buf) {
///     Ok(()) => {}
///     Err(e) if e.recovery() == Recovery::Reinitialize => comm.reinitialize()?, // on every rank
///     Err(e) => return Err(e), // FixCall, Rebuild, FixSetup: see Recovery
/// }
/// comm.synchronize()?; // where the engine waits anyway
/// # Ok::<(), Error>(())
/// ```
pub struct Comm<B: Backend> {
    /// The per-rank core; taken out by `Drop`, never used after.
    pub(crate) core: std::mem::ManuallyDrop<Rank<B>>,
    pub(crate) exchanges: Exchanges,
    hosts: Vec<HostId>,
    /// Set by the teardown, which `close` runs before `Drop` would run it again.
    torn_down: bool,
    /// Buffers registered with the peers, the symmetric pool's segments among them.
    pub(crate) registry: Arc<Registry<B>>,
    /// The symmetric pool.
    pub(crate) pool: crate::comm::zero_copy::pool::SymmetricPool<B>,
    /// What a registered capture's passes do with the inputs.
    pub(crate) script: std::cell::RefCell<crate::comm::zero_copy::script::Script>,
    /// Makes `Comm` `Send` but not `Sync`.
    _one_issuing_thread: std::marker::PhantomData<std::cell::Cell<()>>,
}

/// The backend, the rank and the world size (not the device state).
impl<B: Backend> std::fmt::Debug for Comm<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("backend", &B::NAME)
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .finish_non_exhaustive()
    }
}

/// How the peers read an input whose place is `place` ([`Comm::place_of`]).
fn reads(place: &Option<InPlace>) -> PeerReads {
    place
        .as_ref()
        .map_or(PeerReads::Payloads, |_| PeerReads::UserBuffers)
}

/// What [`Comm`] knows of a buffer.
pub(crate) fn meta<B: Backend>(b: &(impl DeviceBuffer<B> + ?Sized)) -> Meta {
    Meta {
        dtype: b.dtype(),
        len: b.len(),
        ordinal: b.device_ordinal(),
    }
}

impl<B: Backend> Comm<B> {
    /// Rank `rank` of `world_size`, on `device`: the backend's device, or for CUDA
    /// cudarc's `Arc<CudaStream>` that collectives run on. Every rank passes the same
    /// `id` (from rank 0's [`UniqueId::new`]) and `config`; returns once all ranks have
    /// joined, or a typed error when one does not within `config.bootstrap_timeout`.
    pub fn from_rank<D: IntoDevice<Backend = B>>(
        device: D,
        rank: usize,
        world_size: usize,
        id: &UniqueId,
        config: CommConfig,
    ) -> Result<Self> {
        let device = device.into_device()?;
        route::check_world(world_size, &config)?;
        config.check_per_rank_timeouts()?;
        let bootstrap = TcpBootstrap::connect(id, rank, world_size, config.bootstrap_timeout)?;
        let hosts = bootstrap.host_ids().to_vec();
        Self::setup(device, Exchanges::new(Arc::new(bootstrap)), hosts, config)
    }

    /// As [`Comm::from_rank`], over the engine's own bootstrap (torch.distributed, MPI),
    /// which gives the rank and world size.
    pub fn from_bootstrap<D: IntoDevice<Backend = B>>(
        device: D,
        bootstrap: Box<dyn Bootstrap>,
        config: CommConfig,
    ) -> Result<Self> {
        let device = device.into_device()?;
        route::check_world(bootstrap.world_size(), &config)?;
        config.check_per_rank_timeouts()?;
        let exchanges = Exchanges::new(Arc::from(bootstrap));
        let hosts = exchanges
            .of(ExchangeKind::Setup)
            .all_gather(crate::bootstrap::host_identity().as_str().as_bytes())?
            .into_iter()
            .map(|h| HostId::new(String::from_utf8_lossy(&h).into_owned()))
            .collect();
        Self::setup(device, exchanges, hosts, config)
    }

    fn setup(
        device: B::Device,
        exchanges: Exchanges,
        hosts: Vec<HostId>,
        config: CommConfig,
    ) -> Result<Self> {
        let bootstrap = exchanges.of(ExchangeKind::Setup);
        compare_configs(&bootstrap.all_gather(&encode_config(&config))?)?;
        let hosts = match config.simulated_hosts() {
            Some(h) if h.len() != hosts.len() => {
                return Err(Error::InvalidConfig(format!(
                    "Simulation::hosts names {} hosts for {} ranks",
                    h.len(),
                    hosts.len()
                )))
            }
            Some(h) => h.to_vec(),
            None => hosts,
        };
        let core = connect::connect::<B>(
            device,
            Arc::new(bootstrap.clone()),
            Arc::new(exchanges.of(ExchangeKind::External)),
            &hosts,
            &config,
            RankProcesses::Anywhere,
        )?;
        // No rank launches before every rank is set up.
        bootstrap.barrier()?;
        Ok(Comm {
            core: std::mem::ManuallyDrop::new(core),
            exchanges,
            hosts,
            torn_down: false,
            registry: Arc::new(Registry::new(config.bootstrap_timeout)),
            pool: Default::default(),
            script: Default::default(),
            _one_issuing_thread: std::marker::PhantomData,
        })
    }

    /// This rank's index in the world.
    pub fn rank(&self) -> usize {
        self.core.route.world_rank
    }
    /// Ranks in the world.
    pub fn world_size(&self) -> usize {
        self.core.route.world
    }
    /// Reduces `send` with `op` over the world into `recv` on this rank's stream
    /// (cudarc's `Comm::all_reduce`); returns at once with the algorithm that runs.
    /// Every rank makes the same calls in the same order, as with NCCL: calls that
    /// differ (the operator included) are [`Error::CallMismatch`] on every rank, nothing
    /// written; a call the peers never make is [`Error::BarrierTimeout`] here.
    pub fn all_reduce<S, R>(&self, send: &S, recv: &mut R, op: &ReduceOp) -> Result<Algorithm>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.all_reduce_with(send, recv, op, &AllReduceOptions::new())
    }

    /// As [`Comm::all_reduce`], with options (group size, algorithm, blocks). The very
    /// same `send` and `recv` range runs in place; ranges that overlap otherwise are
    /// [`Error::BuffersOverlap`], this rank's alone (its peers time out).
    pub fn all_reduce_with<S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<Algorithm>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        let core = &*self.core;
        core.check_all_reduce(&meta(send), &meta(&*recv))?;
        let bytes = send.len() * send.dtype().size();
        let (input, _in_access) = send.read_ptr(core.device());
        let (output, _out_access) = recv.write_ptr(core.device());
        let roles = [
            (input, bytes, "input", false),
            (output, bytes, "output", true),
        ];
        let in_place = self.check_overlaps(roles, true)?;
        let options = options.with_op(*op);
        self.plan_and_run(input, output, bytes, send.dtype(), &options, in_place)
    }

    /// Reduces `buf` with `op` over the world in place. As [`Comm::all_reduce`].
    pub fn all_reduce_in_place<R>(&self, buf: &mut R, op: &ReduceOp) -> Result<Algorithm>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.all_reduce_in_place_with(buf, op, &AllReduceOptions::new())
    }

    /// Reduces `buf` with `op` over each group in place, with options. As
    /// [`Comm::all_reduce_with`].
    pub fn all_reduce_in_place_with<R>(
        &self,
        buf: &mut R,
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<Algorithm>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        let core = &*self.core;
        core.check_usable()?;
        core.check_buffer(buf.device_ordinal(), "in-place")?;
        let dtype = buf.dtype();
        let bytes = meta(&*buf).bytes(self.rank(), "in-place")?;
        let (ptr, _access) = buf.write_ptr(core.device());
        self.plan_and_run(ptr, ptr, bytes, dtype, &options.with_op(*op), true)
    }

    /// The sum: `all_reduce(send, recv, &ReduceOp::Sum)`.
    #[deprecated(note = "use `all_reduce(send, recv, &ReduceOp::Sum)` (cudarc's signature)")]
    pub fn all_reduce_sum<S, R>(&self, send: &S, recv: &mut R) -> Result<Algorithm>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.all_reduce(send, recv, &ReduceOp::Sum)
    }

    /// The sum with options: `all_reduce_with(send, recv, &ReduceOp::Sum, options)`.
    #[deprecated(note = "use `all_reduce_with(send, recv, &ReduceOp::Sum, options)`")]
    pub fn all_reduce_sum_with<S, R>(
        &self,
        send: &S,
        recv: &mut R,
        options: &AllReduceOptions,
    ) -> Result<Algorithm>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.all_reduce_with(send, recv, &ReduceOp::Sum, options)
    }

    /// The sum in place: `all_reduce_in_place(buf, &ReduceOp::Sum)`.
    #[deprecated(note = "use `all_reduce_in_place(buf, &ReduceOp::Sum)`")]
    pub fn all_reduce_sum_in_place<R>(&self, buf: &mut R) -> Result<Algorithm>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.all_reduce_in_place(buf, &ReduceOp::Sum)
    }

    /// The sum in place with options:
    /// `all_reduce_in_place_with(buf, &ReduceOp::Sum, options)`.
    #[deprecated(note = "use `all_reduce_in_place_with(buf, &ReduceOp::Sum, options)`")]
    pub fn all_reduce_sum_in_place_with<R>(
        &self,
        buf: &mut R,
        options: &AllReduceOptions,
    ) -> Result<Algorithm>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.all_reduce_in_place_with(buf, &ReduceOp::Sum, options)
    }

    /// [`check_overlaps`] on this rank's `(address, bytes, role, written)` buffers.
    pub(super) fn check_overlaps<const N: usize>(
        &self,
        buffers: [(u64, usize, &'static str, bool); N],
        in_place: bool,
    ) -> Result<bool> {
        let rank = self.rank();
        let spans = buffers.map(|(ptr, bytes, which, written)| Span {
            rank,
            which,
            ptr,
            bytes,
            written,
        });
        check_overlaps(&spans, in_place)
    }

    /// Where the peers read an input of `bytes` bytes at `ptr`: in place from a
    /// registered (or symmetric, or captured) buffer; `None`: from the payload.
    pub(super) fn place_of(&self, ptr: u64, bytes: usize) -> Option<InPlace> {
        let listed = self.registry.lookup(ptr, bytes);
        self.script
            .borrow_mut()
            .place(&self.registry, ptr, bytes, listed)
    }

    /// Routes, plans and runs an all-reduce of `bytes` bytes of `dtype`.
    fn plan_and_run(
        &self,
        input: u64,
        output: u64,
        bytes: usize,
        dtype: crate::DType,
        options: &AllReduceOptions,
        in_place: bool,
    ) -> Result<Algorithm> {
        let place = self.place_of(input, bytes);
        let len = bytes / dtype.size();
        let routed = (self.core).plan_all_reduce(dtype, len, options, in_place, reads(&place))?;
        self.run(routed, input, &place, output, len, dtype, options)
    }

    /// Launches a planned all-reduce, or runs it where the router sent it.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        routed: Routed,
        input: u64,
        place: &Option<InPlace>,
        output: u64,
        elements: usize,
        dtype: crate::DType,
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        self.core.check_usable()?;
        match routed {
            Routed::Peer(plan) => {
                self.enqueue(plan, input, place, output, Fused::default())?;
                Ok(plan.algorithm)
            }
            Routed::Away(path, _) => {
                match self
                    .core
                    .run_routed(path, input, output, elements, dtype, options)
                {
                    Ok(a) => Ok(a),
                    Err(RouteError::Validation(e)) => Err(e),
                    Err(RouteError::Launched(e)) => {
                        self.core.poison(&e);
                        Err(e)
                    }
                }
            }
        }
    }

    /// Launches this rank's kernel of `plan` (nothing for an empty one) from `input`,
    /// which the peers read where `place` says, into `output`.
    fn enqueue(
        &self,
        mut plan: Plan,
        input: u64,
        place: &Option<InPlace>,
        output: u64,
        fused: Fused,
    ) -> Result<()> {
        if plan.elements == 0 {
            return Ok(());
        }
        let inputs = match place {
            Some(p) => PeerInputs::InPlace(&p.inputs),
            None => PeerInputs::Own(input),
        };
        // A plan whose peers read registered inputs in place carries their place, so
        // that a peer reading from elsewhere is a descriptor mismatch.
        let in_place_reads = plan.stage_input == 0
            && plan.width > 1
            && !matches!(
                plan.kernel.kind,
                KernelKind::Lamport
                    | KernelKind::LamportRmsNorm
                    | KernelKind::Barrier
                    | KernelKind::PingPong
                    | KernelKind::Delay
                    | KernelKind::AllReduceGroup
            );
        if let (true, Some(p)) = (in_place_reads, place) {
            plan.input_place = p.place;
        }
        self.core.check_usable()?;
        self.core.launch(&plan, inputs, output, fused)
    }

    /// A start and an end barrier over this rank's group, on its stream (groups that
    /// peer memory serves only).
    pub fn barrier(&self, group_size: usize) -> Result<()> {
        let core = &*self.core;
        core.check_usable()?;
        let plan = core.barrier_plan(group_size)?;
        core.launch(&plan, PeerInputs::Own(0), 0, Fused::default())
    }
}
