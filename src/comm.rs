//! The communicator: one signal buffer per rank, the peer mappings, validation, the
//! dispatch and the launches.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::backend::{Backend, Kernel, KernelKind, LaunchDims, MemoryKind};
use crate::dispatch::{self, Algorithm};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::signal::{
    barrier_domain, AllReduceArgs, Signal, SignalLayout, ERROR_BLOCK, ERROR_CODE, ERROR_DOMAIN,
    ERROR_PEER_ABORTED, ERROR_RANK, MAX_GPUS, MAX_NUM_BLOCKS_UPPER_BOUND, PACK_BYTES,
};
use crate::tensor::{shape_elements, Tensor, TensorMut};
use crate::{enable_p2p, init_signal_buffer_with_counter_base};

/// Sizes and limits of a communicator.
#[derive(Clone, Debug)]
pub struct CommConfig {
    /// Bytes of one Lamport slot: the largest message (per rank, rounded up to 16 bytes)
    /// the Lamport algorithm takes. The region holds 3 x 8 slots per rank.
    pub lamport_slot_bytes: usize,
    /// Bytes of scratch per rank: the staged one-stage kernel (in-place) needs the
    /// whole message, the two-stage kernel one partition of it.
    pub payload_bytes: usize,
    /// A barrier (or a Lamport wait) that spins longer than this gives up and records
    /// [`Error::BarrierTimeout`]; `None` waits forever.
    pub barrier_timeout: Option<Duration>,
    /// Upper bound of blocks per launch (at most `MAX_NUM_BLOCKS_UPPER_BOUND`); `None`
    /// derives it from the device's multiprocessor count.
    pub max_blocks: Option<u32>,
    /// Threads per block on GPUs (the host backend runs one thread per block).
    pub threads_per_block: u32,
    /// Testing aid: lets several ranks share one device, each with its own stream and
    /// signal buffer, so 4- and 8-rank schedules run on fewer GPUs. Every rank's blocks
    /// must be resident at once (ranks spin waiting for each other), so keep
    /// `max_blocks` small (for example 4) when this is on. Timings mean nothing then.
    pub allow_shared_devices: bool,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            lamport_slot_bytes: 1 << 20,
            payload_bytes: 64 << 20,
            barrier_timeout: Some(Duration::from_secs(10)),
            max_blocks: None,
            threads_per_block: 512,
            allow_shared_devices: false,
        }
    }
}

/// Options of one all-reduce.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllReduceOptions {
    /// Width of the groups that reduce together: 0 means the whole world; otherwise it
    /// must divide the world size, and ranks `[k*w, (k+1)*w)` form group `k`.
    pub group_size: usize,
    /// Algorithm, or `Auto` for the dispatch table.
    pub algorithm: Algorithm,
    /// Blocks per launch; `None` lets peercomm choose.
    pub blocks: Option<u32>,
}

impl AllReduceOptions {
    /// Whole world, automatic algorithm.
    pub fn new() -> Self {
        Self::default()
    }
    /// With a group size.
    pub fn group_size(mut self, group_size: usize) -> Self {
        self.group_size = group_size;
        self
    }
    /// With an algorithm.
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }
    /// With a block count.
    pub fn blocks(mut self, blocks: u32) -> Self {
        self.blocks = Some(blocks);
        self
    }
}

/// One rank of a communicator: its device (with its stream) and its signal buffer.
pub struct Rank<B: Backend> {
    device: B::Device,
    signal: B::Memory,
    /// `peer_signals[j]`: where this rank reaches rank j's signal.
    peer_signals: [u64; MAX_GPUS],
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
    layout: SignalLayout,
    config: CommConfig,
    arch: String,
    max_blocks: u32,
    poisoned: AtomicBool,
    group_depth: AtomicUsize,
    /// Held while a collective is enqueued on every rank (and while re-initialising):
    /// two threads sharing the communicator must not interleave their launches, or
    /// ranks would run collectives in different orders.
    launch_lock: Mutex<()>,
}

/// What validation learned about one call.
struct Plan {
    kernel: Kernel,
    algorithm: Algorithm,
    width: usize,
    elements: usize,
    stage_input: bool,
    dims: LaunchDims,
}

struct Meta {
    dtype: DType,
    len: usize,
    ordinal: usize,
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
        if !config.allow_shared_devices && ordinals.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::InvalidDevices(format!(
                "a device appears twice: {ordinals:?}"
            )));
        }
        let layout = SignalLayout {
            lamport_slot_bytes: config.lamport_slot_bytes,
            payload_bytes: config.payload_bytes,
        };
        layout.validate()?;
        if config.threads_per_block == 0
            || config.threads_per_block > 512
            || config.threads_per_block % 64 != 0
        {
            return Err(Error::Unsupported(format!(
                "threads_per_block must be a multiple of 64 in 64..=512 (the kernels' launch bound), not {}",
                config.threads_per_block
            )));
        }
        if !enable_p2p::<B>(&devices)? {
            let (from, to) = first_missing_peer_pair::<B>(&devices)?;
            return Err(Error::P2pUnavailable { from, to });
        }
        let signals = devices
            .iter()
            .map(|d| B::alloc(d, layout.checked_total_bytes()?, MemoryKind::Signal))
            .collect::<Result<Vec<_>>>()?;
        let mut ranks: Vec<Rank<B>> = devices
            .into_iter()
            .zip(signals)
            .map(|(device, signal)| Rank {
                device,
                signal,
                peer_signals: [0; MAX_GPUS],
            })
            .collect();
        for i in 0..world {
            for j in 0..world {
                let addr = if i == j {
                    B::memory_ptr(&ranks[j].signal)
                } else {
                    B::map_peer(&ranks[i].device, &ranks[j].signal)?
                };
                ranks[i].peer_signals[j] = addr;
            }
        }
        let arch = B::architecture(&ranks[0].device)?;
        let sms = B::multiprocessor_count(&ranks[0].device)?;
        let max_blocks = config
            .max_blocks
            .unwrap_or(sms as u32)
            .clamp(1, MAX_NUM_BLOCKS_UPPER_BOUND as u32);
        let comm = Communicator {
            ranks,
            layout,
            config,
            arch,
            max_blocks,
            poisoned: AtomicBool::new(false),
            group_depth: AtomicUsize::new(0),
            launch_lock: Mutex::new(()),
        };
        comm.reinitialize()?;
        Ok(comm)
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
        self.layout
    }
    /// The configuration it was built with.
    pub fn config(&self) -> &CommConfig {
        &self.config
    }
    /// Architecture of rank 0's device (keys the dispatch table).
    pub fn architecture(&self) -> &str {
        &self.arch
    }
    /// Whether an earlier barrier timeout has disabled collectives.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// Waits for every rank's queued collectives, then reads every rank's error record
    /// (a small device-to-host copy per rank). If a wait gave up, returns the root
    /// cause ([`Error::BarrierTimeout`] of the rank that timed out, else the
    /// [`Error::PeerAborted`] a rank was told) and poisons the communicator until
    /// [`Communicator::reinitialize`].
    pub fn synchronize(&self) -> Result<()> {
        for r in &self.ranks {
            B::synchronize(&r.device)?;
        }
        self.check_device_errors()
    }

    /// Reads every rank's error record (waiting for its stream first).
    fn check_device_errors(&self) -> Result<()> {
        let off = std::mem::offset_of!(Signal, error_state);
        let mut first_abort = None;
        for (rank, r) in self.ranks.iter().enumerate() {
            let mut raw = [0u8; 16];
            B::read(&r.device, B::memory_ptr(&r.signal) + off as u64, &mut raw)?;
            let word = |i: usize| u32::from_le_bytes(raw[i * 4..i * 4 + 4].try_into().unwrap());
            match word(ERROR_CODE) {
                0 => {}
                ERROR_PEER_ABORTED => {
                    first_abort.get_or_insert(Error::PeerAborted {
                        rank,
                        by: word(ERROR_RANK) as usize,
                        block: word(ERROR_BLOCK) as usize,
                        domain: word(ERROR_DOMAIN) as usize,
                    });
                }
                _ => {
                    self.poisoned.store(true, Ordering::Release);
                    return Err(Error::BarrierTimeout {
                        rank: word(ERROR_RANK) as usize,
                        block: word(ERROR_BLOCK) as usize,
                        domain: word(ERROR_DOMAIN) as usize,
                    });
                }
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
            init_signal_buffer_with_counter_base::<B>(&r.device, &r.signal, self.layout, base)?;
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
        let plan = self.plan(metas[0].dtype, metas[0].len, options, false)?;
        if plan.elements == 0 {
            return Ok(plan.algorithm);
        }
        let ranks = &self.ranks;
        let mut guards = Vec::with_capacity(2 * ranks.len());
        let mut in_ptrs = [0u64; MAX_GPUS];
        let mut out_ptrs = [0u64; MAX_GPUS];
        // Each buffer is tracked on its own rank's stream only: peers read rank j's input
        // between their start and end barriers, which rank j's kernel spans, so the
        // waits and records on rank j's stream also cover the peers' reads.
        for (r, t) in inputs.iter().enumerate() {
            let (p, g) = t.data.read_ptr(&ranks[r].device);
            in_ptrs[r] = p;
            guards.push(g);
        }
        for (r, t) in outputs.iter_mut().enumerate() {
            let (p, g) = t.data.write_ptr(&ranks[r].device);
            out_ptrs[r] = p;
            guards.push(g);
        }
        let result = self
            .check_peers_reach(&plan, &in_ptrs, "input")
            .and_then(|_| self.launch_all(&plan, &in_ptrs, &out_ptrs));
        drop(guards);
        result.map(|_| plan.algorithm)
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
        let plan = self.plan(metas[0].dtype, metas[0].len, options, true)?;
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
        let width = self.group_width(group_size)?;
        let plan = Plan {
            kernel: Kernel {
                kind: KernelKind::Barrier,
                dtype: DType::F32,
            },
            algorithm: Algorithm::Auto,
            width,
            elements: 0,
            stage_input: false,
            dims: LaunchDims {
                blocks: 1,
                threads: self.config.threads_per_block,
            },
        };
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
        let args = AllReduceArgs {
            timeout_ns: u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX),
            ..Default::default()
        };
        let _launches = self.lock_launches();
        B::launch(
            &self.ranks[rank].device,
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
        let payload_off = self.layout.payload_offset() as u64;
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
        };
        let zeros = [0u64; MAX_GPUS];
        self.launch_on(&plan, &[0, 1], &zeros, &zeros)
    }

    fn check_usable(&self) -> Result<()> {
        if self.is_poisoned() {
            Err(Error::Poisoned)
        } else {
            Ok(())
        }
    }

    fn check_count(&self, got: usize) -> Result<()> {
        if got != self.world_size() {
            return Err(Error::WrongTensorCount {
                expected: self.world_size(),
                got,
            });
        }
        Ok(())
    }

    fn check_tensor(
        &self,
        rank: usize,
        m: &Meta,
        shape: &[usize],
        which: &'static str,
    ) -> Result<()> {
        if shape_elements(shape) != Some(m.len) {
            return Err(Error::LengthMismatch {
                rank,
                what: match shape_elements(shape) {
                    Some(n) => format!(
                        "{which} shape {shape:?} has {n} elements but its buffer {}",
                        m.len
                    ),
                    None => format!("{which} shape {shape:?} overflows usize"),
                },
            });
        }
        let expected = self.ranks[rank].ordinal();
        if m.ordinal != expected {
            return Err(Error::WrongDevice {
                rank,
                which,
                expected,
                got: m.ordinal,
            });
        }
        Ok(())
    }

    fn check_tensors(
        &self,
        metas: &[Meta],
        shapes: &[&[usize]],
        which: &'static str,
    ) -> Result<()> {
        for (r, (m, s)) in metas.iter().zip(shapes).enumerate() {
            if m.dtype != metas[0].dtype {
                return Err(Error::DTypeMismatch {
                    rank: r,
                    expected: metas[0].dtype,
                    got: m.dtype,
                });
            }
            if *s != shapes[0] {
                return Err(Error::ShapeMismatch {
                    rank: r,
                    expected: shapes[0].to_vec(),
                    got: s.to_vec(),
                });
            }
            self.check_tensor(r, m, s, which)?;
        }
        Ok(())
    }

    fn group_width(&self, group_size: usize) -> Result<usize> {
        let world = self.world_size();
        let width = if group_size == 0 { world } else { group_size };
        if width > world || world % width != 0 {
            return Err(Error::InvalidGroupSize { group_size, world });
        }
        Ok(width)
    }

    /// Chooses the algorithm and grid, and checks the scratch it needs.
    fn plan(
        &self,
        dtype: DType,
        elements: usize,
        options: &AllReduceOptions,
        in_place: bool,
    ) -> Result<Plan> {
        let width = self.group_width(options.group_size)?;
        let bytes = elements * dtype.size();
        let packs = elements.div_ceil(dtype.lanes());
        let padded = packs * PACK_BYTES;
        let slot = self.layout.lamport_slot_bytes;
        let payload = self.layout.payload_bytes;
        let two_stage_need = packs.div_ceil(width) * PACK_BYTES;
        let fits = |a: Algorithm| match a {
            Algorithm::Lamport => padded <= slot,
            Algorithm::TwoStage => two_stage_need <= payload,
            Algorithm::OneStage => !in_place || width == 1 || padded <= payload,
            Algorithm::Auto => true,
        };
        // Lamport runs only over the whole world of at least two ranks: its state is
        // per rank and shared by every width, so a subgroup call would move one group's
        // generations and not its siblings' (see the own-slot rule in the header). A
        // group of one needs no peers: it copies, keeping the sign of zero.
        let lamport_allowed = width == self.world_size() && width > 1;
        let algorithm = match options.algorithm {
            Algorithm::Auto => {
                let mut preferred = dispatch::choose(&self.arch, width, bytes);
                if preferred == Algorithm::Lamport && !lamport_allowed {
                    preferred = Algorithm::OneStage;
                }
                // Fall back towards the algorithms that need less scratch.
                [preferred, Algorithm::OneStage, Algorithm::TwoStage]
                    .into_iter()
                    .find(|&a| fits(a))
                    .unwrap_or(preferred)
            }
            Algorithm::Lamport if width == 1 => Algorithm::OneStage,
            Algorithm::Lamport if !lamport_allowed => {
                return Err(Error::Unsupported(format!(
                    "the Lamport algorithm runs only over the whole world (group_size 0 or \
                     {}), not over groups of {width}; use Auto or another algorithm",
                    self.world_size()
                )))
            }
            a => a,
        };
        if !fits(algorithm) {
            let (needed, available) = match algorithm {
                Algorithm::Lamport => (padded, slot),
                Algorithm::TwoStage => (two_stage_need, payload),
                _ => (padded, payload),
            };
            return Err(Error::MessageTooLarge {
                algorithm: algorithm.name(),
                needed,
                available,
            });
        }
        let kind = algorithm.kernel_kind().expect("concrete algorithm");
        // A group of one never waits for anyone; the staging copy is only needed when
        // peers read the input while the own rank overwrites it.
        let stage_input = in_place && kind == KernelKind::OneStage && width > 1;
        let work_packs = match kind {
            KernelKind::TwoStage => packs.div_ceil(width),
            _ => packs,
        };
        let blocks = match options.blocks {
            Some(b) => {
                if b == 0 || b as usize > MAX_NUM_BLOCKS_UPPER_BOUND {
                    return Err(Error::Unsupported(format!(
                        "blocks must be in 1..={MAX_NUM_BLOCKS_UPPER_BOUND}, not {b}"
                    )));
                }
                b
            }
            None => {
                dispatch::blocks_for(work_packs, self.config.threads_per_block, self.max_blocks)
            }
        };
        Ok(Plan {
            kernel: Kernel { kind, dtype },
            algorithm,
            width,
            elements,
            stage_input,
            dims: LaunchDims {
                blocks,
                threads: self.config.threads_per_block,
            },
        })
    }

    /// When the plan's peers read the user buffers at `ptrs` directly (one-stage
    /// without staging, two-stage), checks that each group peer's device can reach them.
    fn check_peers_reach(
        &self,
        plan: &Plan,
        ptrs: &[u64; MAX_GPUS],
        which: &'static str,
    ) -> Result<()> {
        let direct = match plan.kernel.kind {
            KernelKind::OneStage => !plan.stage_input,
            KernelKind::TwoStage => true,
            _ => false,
        };
        if !direct || plan.width == 1 {
            return Ok(());
        }
        for (r, rank) in self.ranks.iter().enumerate() {
            let base = r / plan.width * plan.width;
            for peer in (base..base + plan.width).filter(|&p| p != r) {
                let peer_dev = &self.ranks[peer].device;
                if let Some(detail) = B::peer_access_problem(&rank.device, ptrs[r], peer_dev)? {
                    return Err(Error::BufferNotPeerAccessible {
                        rank: r,
                        which,
                        peer_device: B::ordinal(peer_dev),
                        detail,
                    });
                }
            }
        }
        Ok(())
    }

    fn lock_launches(&self) -> MutexGuard<'_, ()> {
        self.launch_lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enqueues `plan` on every rank, atomically with respect to other callers. A
    /// failure after some ranks were launched poisons the communicator: those ranks
    /// wait for peers that will never come (until their timeout), so nothing may run
    /// before [`Communicator::reinitialize`].
    fn launch_all(
        &self,
        plan: &Plan,
        inputs: &[u64; MAX_GPUS],
        outputs: &[u64; MAX_GPUS],
    ) -> Result<()> {
        let ranks: Vec<usize> = (0..self.world_size()).collect();
        self.launch_on(plan, &ranks, inputs, outputs)
    }

    fn launch_on(
        &self,
        plan: &Plan,
        ranks: &[usize],
        inputs: &[u64; MAX_GPUS],
        outputs: &[u64; MAX_GPUS],
    ) -> Result<()> {
        let _launches = self.lock_launches();
        self.check_usable()?;
        for (i, &r) in ranks.iter().enumerate() {
            if let Err(e) = self.launch_rank(plan, r, inputs, outputs) {
                if i > 0 {
                    self.poisoned.store(true, Ordering::Release);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// The wait limit the kernels get, in nanoseconds (0 = never; saturates).
    fn timeout_ns(&self) -> u64 {
        self.config.barrier_timeout.map_or(0, |t| {
            u64::try_from(t.as_nanos()).unwrap_or(u64::MAX).max(1)
        })
    }

    fn launch_rank(
        &self,
        plan: &Plan,
        r: usize,
        inputs: &[u64; MAX_GPUS],
        outputs: &[u64; MAX_GPUS],
    ) -> Result<()> {
        let world = self.world_size();
        let width = plan.width;
        let base = r / width * width;
        let rank = &self.ranks[r];
        let payload_off = self.layout.payload_offset() as u64;
        let mut args = AllReduceArgs {
            local_input: inputs[r],
            output: outputs[r],
            num_elements: plan.elements as u64,
            timeout_ns: self.timeout_ns(),
            lamport_slot_bytes: self.layout.lamport_slot_bytes as u32,
            group_rank: (r - base) as u32,
            group_width: width as u32,
            domain: barrier_domain(width, world) as u32,
            world_rank: r as u32,
            stage_input: plan.stage_input as u32,
            ..Default::default()
        };
        for k in 0..width {
            let signal = rank.peer_signals[base + k];
            args.signals[k] = signal;
            args.payloads[k] = signal + payload_off;
            args.inputs[k] = if plan.stage_input {
                signal + payload_off
            } else {
                inputs[base + k]
            };
        }
        B::launch(&rank.device, plan.kernel, plan.dims, &args)
    }
}

fn check_world(world: usize) -> Result<()> {
    if world == 0 || world > MAX_GPUS {
        return Err(Error::InvalidWorldSize {
            got: world,
            max: MAX_GPUS,
        });
    }
    Ok(())
}

fn first_missing_peer_pair<B: Backend>(devices: &[B::Device]) -> Result<(usize, usize)> {
    for a in devices {
        for b in devices {
            if B::ordinal(a) != B::ordinal(b) && !B::can_access_peer(a, b)? {
                return Ok((B::ordinal(a), B::ordinal(b)));
            }
        }
    }
    Ok((0, 0))
}
