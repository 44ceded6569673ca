//! What a communicator is built with, and the options of one collective.

use std::time::Duration;

use crate::backend::DeviceIdentity;
use crate::bootstrap::HostId;
use crate::dispatch::Algorithm;
use crate::error::{Error, Result};
use crate::external::FallbackConfig;
#[cfg(feature = "fault-injection")]
use crate::external::Simulation;

/// Sizes and limits of a communicator.
///
/// # Memory footprint
/// Each rank allocates one signal allocation on its device and nothing else: a fixed
/// 8.28 MiB header (counters, arrivals with their call descriptors, Lamport state, error record), a Lamport region of
/// 3 generations x world-size slots x `lamport_slot_bytes`, and `payload_bytes`.
/// [`CommConfig::memory_footprint`] computes it before building,
/// `SingleController::memory_footprint` / `Comm::memory_footprint` after. Per rank:
///
/// | configuration | world 2 | world 4 | world 8 |
/// |---|---|---|---|
/// | default (1 MiB slot, 64 MiB payload) | 78.3 MiB | 84.3 MiB | 96.3 MiB |
/// | `for_largest_message(1 << 20, BF16)` (2 MiB payload, 1 MiB + 64 B slot) | 16.3 MiB | 22.3 MiB | 34.3 MiB |
/// | 48 MiB slot, 64 MiB payload (Lamport forced at 48 MiB) | 360.3 MiB | 648.3 MiB | 1224.3 MiB |
///
/// [`CommConfig::for_largest_message`] sizes the scratch from the largest message a
/// user will send; `SingleController::algorithm_for` / `Comm::algorithm_for` say whether
/// a message fits an algorithm, and if not, by how many bytes.
///
/// Built from [`CommConfig::default`] or [`CommConfig::for_largest_message`] and the
/// `with_*` methods (the type may gain fields, so it has no struct literal outside
/// the crate):
///
/// ```
/// use std::time::Duration;
/// use peercomm::CommConfig;
///
/// let config = CommConfig::default()
///     .with_payload_bytes(8 << 20)
///     .with_barrier_timeout(Some(Duration::from_secs(2)));
/// assert_eq!(config.payload_bytes, 8 << 20);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct CommConfig {
    /// Bytes of one Lamport slot: the largest message (per rank, rounded up to whole
    /// 16-byte packs) the Lamport algorithm takes. The region holds 3 x world-size slots
    /// per rank.
    pub lamport_slot_bytes: usize,
    /// Bytes of scratch per rank. A staged kernel (every per-rank call whose peers
    /// read its input, and an in-place one-stage call in one process) copies what its
    /// peers read into it; a message larger than the payload runs through it in chunks
    /// of half of it, pipelined (one half is staged while the peers read the other),
    /// one barrier more per chunk, with the same bits as staged whole. Chunks are whole
    /// 16-byte packs (per member's part for reduce-scatter and scatter) or, for the
    /// fused all-reduce + RMSNorm, whole rows, so a payload below two of them refuses
    /// the call ([`crate::Error::MessageTooLarge`]). The two-stage kernel needs one
    /// partition of the message whole (`Auto` prefers an algorithm whose scratch holds
    /// the message whole over chunks), and a batch of group calls all its entries
    /// (else they run one by one).
    pub payload_bytes: usize,
    /// A barrier (or a Lamport wait) that spins longer than this gives up and records
    /// [`crate::Error::BarrierTimeout`]; `None` waits forever.
    ///
    /// The error is reported within 2 x `barrier_timeout` (+ launch and copy latency),
    /// not within `barrier_timeout`: the block that gave up tells its group peers it
    /// will not touch their memory again, then waits at most one more
    /// `barrier_timeout` for each peer to say the same (the abandon protocol), so that
    /// its kernel cannot end, and the user free or reuse its buffers, while a late peer
    /// still reads them. A collective that a peer never makes therefore ends, and
    /// `synchronize` returns its error, at most 2 x `barrier_timeout` after the
    /// collective started on the device (later only by the launch, the stream's
    /// earlier work and the copy of the error record). Measured on one H200 with 2 s:
    /// 4.00 s. Each wait that a peer does satisfy in time starts the next wait's clock
    /// afresh, so a peer that is slow rather than absent can keep a collective running
    /// longer.
    ///
    /// The per-rank [`crate::Comm`] also keeps memory that a peer's kernel may still
    /// write into for 2 x `barrier_timeout` (plus a margin) past a drop whose peers did
    /// not all confirm the teardown, and with `None` until the process exits (see
    /// `Drop for Comm`). It requires `bootstrap_timeout >= barrier_timeout`.
    pub barrier_timeout: Option<Duration>,
    /// Upper bound of blocks per launch (at most `MAX_NUM_BLOCKS_UPPER_BOUND`); `None`
    /// derives it from the device's multiprocessor count.
    pub max_blocks: Option<u32>,
    /// Threads per block on GPUs (the host backend runs one thread per block).
    pub threads_per_block: u32,
    /// Testing aid: lets several ranks share one device, each with its own stream and
    /// signal buffer, so 4- and 8-rank schedules run on fewer GPUs. "One device" is
    /// one physical device, told by [`crate::Backend::identity`] (UUID, else PCI bus
    /// id), not by ordinal: processes isolated by `CUDA_VISIBLE_DEVICES`, each on its
    /// device 0, do not share and need no such permission. Every rank's blocks
    /// must be resident at once (ranks spin waiting for each other), so where k ranks
    /// share a device each gets at most multiprocessors / k blocks (whatever
    /// `max_blocks` says above that). Ranks in one process on one GPU also share its
    /// context: anything that waits for the whole context (a first use of a kernel
    /// module, `cuCtxSynchronize`, a non-stream-ordered allocation) while a peer's
    /// collective spins waiting for this rank stalls both until the barrier timeout, so
    /// load kernels and allocate before the ranks' first collective. Timings mean
    /// nothing then; ranks in different processes on one GPU time-slice (no MPS), a
    /// scheduling slice per barrier.
    /// On CUDA a shared GPU's default memory pool stops reusing memory across streams
    /// through internal dependencies (see `Backend::prepare_shared_device`): with ranks
    /// driven by different threads, such a dependency could make one rank's stream
    /// wait for another's that waits for it.
    pub allow_shared_devices: bool,
    /// How long the per-rank [`crate::Comm`] waits for the other ranks at setup and at
    /// each bootstrap step of re-initialisation. Dropping a `Comm` waits for the peers'
    /// teardown at most `TEARDOWN_BARRIER_TIMEOUT` (1 s), not this long (see
    /// `Drop for Comm`).
    ///
    /// [`crate::Comm::from_rank`] and [`crate::Comm::from_bootstrap`] refuse with
    /// [`crate::Error::InvalidConfig`] a `bootstrap_timeout` shorter than
    /// `barrier_timeout` (a `None` barrier timeout sets no floor): a rank that waits less
    /// on the host than its kernels wait on the device cannot tell a slow peer from a
    /// gone one. The single-controller [`crate::SingleController`] has no bootstrap and
    /// ignores this field.
    pub bootstrap_timeout: Duration,
    /// Where peer memory cannot serve (no working peer access, several hosts, more
    /// than `MAX_GPUS` ranks): hand the calls to NCCL/RCCL (the default) or refuse;
    /// and whether to route by message size (default: never). See
    /// the `external` module.
    pub fallback: FallbackConfig,
    /// For testing only: simulate missing peer access, a failed peer check, or ranks
    /// on several hosts (see [`Simulation`]). Only with the `fault-injection` feature.
    #[cfg(feature = "fault-injection")]
    pub simulate: Simulation,
    /// Single controller only: enqueue each rank's kernel of a collective from its own
    /// launch thread (rank 0's from the calling thread), all at once, instead of one
    /// rank after the other from the calling thread (default: on). A kernel launch
    /// costs the host a few microseconds (~3.5 us with CUDA), so in a loop over the
    /// ranks an eager call's host time grows with the world; in parallel it stays near
    /// one launch. The [`crate::SingleController`] starts one thread per rank but rank 0
    /// when it is built (world > 1), joined when it is dropped; between calls they
    /// spin for about 100 us, then sleep. Results, stream order and errors are the
    /// same either way. [`crate::SingleController::set_parallel_launch`] switches it at
    /// run time (this field is where it starts). The per-rank [`crate::Comm`] (one
    /// rank per thread or process, each launching its own) ignores it, and ranks need
    /// not agree on it (it is not among the fields they compare).
    pub parallel_launch: bool,
}

impl CommConfig {
    /// With [`CommConfig::lamport_slot_bytes`].
    pub fn with_lamport_slot_bytes(mut self, bytes: usize) -> Self {
        self.lamport_slot_bytes = bytes;
        self
    }
    /// With [`CommConfig::payload_bytes`].
    pub fn with_payload_bytes(mut self, bytes: usize) -> Self {
        self.payload_bytes = bytes;
        self
    }
    /// With [`CommConfig::barrier_timeout`] (`None` waits forever).
    pub fn with_barrier_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.barrier_timeout = timeout;
        self
    }
    /// With [`CommConfig::max_blocks`] (`None` derives it from the device).
    pub fn with_max_blocks(mut self, max_blocks: Option<u32>) -> Self {
        self.max_blocks = max_blocks;
        self
    }
    /// With [`CommConfig::threads_per_block`].
    pub fn with_threads_per_block(mut self, threads: u32) -> Self {
        self.threads_per_block = threads;
        self
    }
    /// With [`CommConfig::allow_shared_devices`] (a testing aid).
    pub fn with_allow_shared_devices(mut self, allow: bool) -> Self {
        self.allow_shared_devices = allow;
        self
    }
    /// With [`CommConfig::bootstrap_timeout`].
    pub fn with_bootstrap_timeout(mut self, timeout: Duration) -> Self {
        self.bootstrap_timeout = timeout;
        self
    }
    /// With [`CommConfig::fallback`].
    pub fn with_fallback(mut self, fallback: FallbackConfig) -> Self {
        self.fallback = fallback;
        self
    }
    /// With [`CommConfig::simulate`] (testing only; `fault-injection` feature).
    #[cfg(feature = "fault-injection")]
    pub fn with_simulate(mut self, simulate: Simulation) -> Self {
        self.simulate = simulate;
        self
    }
    /// With [`CommConfig::parallel_launch`].
    pub fn with_parallel_launch(mut self, parallel: bool) -> Self {
        self.parallel_launch = parallel;
        self
    }

    /// The host identities the simulation gives the world ranks, if any (none
    /// without the `fault-injection` feature).
    pub(crate) fn simulated_hosts(&self) -> Option<&[HostId]> {
        #[cfg(feature = "fault-injection")]
        return self.simulate.hosts.as_deref();
        #[cfg(not(feature = "fault-injection"))]
        None
    }

    /// The multiprocessor count world rank `rank` reports: the simulated one, or
    /// `real`.
    pub(crate) fn multiprocessors_of(&self, rank: usize, real: usize) -> usize {
        #[cfg(feature = "fault-injection")]
        return self.simulate.multiprocessors_of(rank, real);
        #[cfg(not(feature = "fault-injection"))]
        {
            let _ = rank;
            real
        }
    }

    /// The identity world rank `rank` reports: the simulated physical device's (with
    /// the ordinal of `real`), or `real`.
    pub(crate) fn identity_of(&self, rank: usize, real: DeviceIdentity) -> DeviceIdentity {
        #[cfg(feature = "fault-injection")]
        return self.simulate.identity_of(rank, real);
        #[cfg(not(feature = "fault-injection"))]
        {
            let _ = rank;
            real
        }
    }

    /// Whether the simulation removes peer access between world ranks `a` and `b`.
    pub(crate) fn simulation_blocks_pair(&self, a: usize, b: usize) -> bool {
        #[cfg(feature = "fault-injection")]
        return self.simulate.blocks_pair(a, b);
        #[cfg(not(feature = "fault-injection"))]
        {
            let _ = (a, b);
            false
        }
    }

    /// Whether the simulation corrupts the peer check of world rank `rank`.
    pub(crate) fn simulation_fails_peer_check(&self, rank: usize) -> bool {
        #[cfg(feature = "fault-injection")]
        return self.simulate.fail_peer_check == Some(rank);
        #[cfg(not(feature = "fault-injection"))]
        {
            let _ = rank;
            false
        }
    }

    /// The simulation as the ranks compare it: `none`, or a hash of the switches.
    fn simulation_code(&self) -> String {
        #[cfg(feature = "fault-injection")]
        if self.simulate.is_active() {
            return format!("{:?}", self.simulate.code());
        }
        "none".to_string()
    }

    /// What the per-rank [`crate::Comm`] needs of the timeouts (see
    /// [`CommConfig::bootstrap_timeout`]): an [`Error::InvalidConfig`] naming the fields
    /// otherwise.
    pub(crate) fn check_per_rank_timeouts(&self) -> Result<()> {
        match self.barrier_timeout {
            Some(barrier) if self.bootstrap_timeout < barrier => {
                Err(Error::InvalidConfig(format!(
                    "CommConfig::bootstrap_timeout ({:?}) is shorter than \
                     CommConfig::barrier_timeout ({barrier:?}): a rank that waits less on \
                     the host than its kernels wait on the device cannot tell a slow peer \
                     from a gone one; make bootstrap_timeout at least barrier_timeout",
                    self.bootstrap_timeout
                )))
            }
            _ => Ok(()),
        }
    }
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
            bootstrap_timeout: Duration::from_secs(120),
            fallback: FallbackConfig::default(),
            #[cfg(feature = "fault-injection")]
            simulate: Simulation::default(),
            parallel_launch: true,
        }
    }
}

/// Options of one all-reduce, built from [`AllReduceOptions::new`] and its chained
/// setters (the type may gain fields, so it has no struct literal outside the crate).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AllReduceOptions {
    /// Width of the groups that reduce together: 0 means the whole world; otherwise it
    /// must divide the world size, and ranks `[k*w, (k+1)*w)` form group `k`.
    pub group_size: usize,
    /// Algorithm, or `Auto` for the dispatch table.
    pub algorithm: Algorithm,
    /// Blocks per launch; `None` lets peercomm choose.
    pub blocks: Option<u32>,
    /// Let the collective's launch overlap the tail of the kernel before it on the
    /// stream (programmatic dependent launch, NVIDIA sm_90+; elsewhere a plain launch).
    /// The collective still waits for that kernel's results before reading anything,
    /// so results are unchanged. Off by default.
    pub overlap_previous: bool,
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
    /// Whether the launch may overlap the previous kernel's tail (see the field).
    pub fn overlap_previous(mut self, overlap: bool) -> Self {
        self.overlap_previous = overlap;
        self
    }
}

/// Every field the ranks must agree on, by name, with its value as text (what a
/// mismatch names). Not `bootstrap_timeout` nor `parallel_launch`: each rank's host
/// side, which its peers never see.
pub(crate) fn config_fields(config: &CommConfig) -> Vec<(&'static str, String)> {
    vec![
        ("lamport_slot_bytes", config.lamport_slot_bytes.to_string()),
        ("payload_bytes", config.payload_bytes.to_string()),
        ("barrier_timeout", format!("{:?}", config.barrier_timeout)),
        ("max_blocks", format!("{:?}", config.max_blocks)),
        ("threads_per_block", config.threads_per_block.to_string()),
        (
            "allow_shared_devices",
            config.allow_shared_devices.to_string(),
        ),
        ("fallback", format!("{:?}", config.fallback)),
        ("simulate", config.simulation_code()),
    ]
}

/// The fields as the ranks exchange them: `name=value` lines.
pub(crate) fn encode_config(config: &CommConfig) -> Vec<u8> {
    config_fields(config)
        .into_iter()
        .map(|(name, value)| format!("{name}={value}\n"))
        .collect::<String>()
        .into_bytes()
}

/// Compares every rank's encoded configuration with rank 0's: an
/// [`Error::InvalidConfig`] naming each field that differs, with both values.
pub(crate) fn compare_configs(all: &[Vec<u8>]) -> Result<()> {
    let parse = |bytes: &[u8]| -> Vec<(String, String)> {
        String::from_utf8_lossy(bytes)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    };
    let Some(first) = all.first().map(|b| parse(b)) else {
        return Ok(());
    };
    let mut differences = Vec::new();
    for (rank, bytes) in all.iter().enumerate().skip(1) {
        let theirs = parse(bytes);
        for (name, want) in &first {
            match theirs.iter().find(|(n, _)| n == name) {
                Some((_, got)) if got == want => {}
                Some((_, got)) => differences.push(format!(
                    "rank {rank} has {name} = {got} where rank 0 has {want}"
                )),
                None => differences.push(format!(
                    "rank {rank} sent no {name} (another peercomm version?)"
                )),
            }
        }
    }
    if differences.is_empty() {
        return Ok(());
    }
    Err(Error::InvalidConfig(format!(
        "the ranks' configurations differ: {}; every rank must pass the same CommConfig",
        differences.join("; ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configuration_mismatch_names_the_fields() {
        let a = CommConfig::default();
        let b = a
            .clone()
            .with_payload_bytes(a.payload_bytes * 2)
            .with_barrier_timeout(None);
        assert_eq!(
            compare_configs(&[encode_config(&a), encode_config(&a)]),
            Ok(())
        );
        let e = compare_configs(&[encode_config(&a), encode_config(&a), encode_config(&b)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 2 has payload_bytes = "), "{e}");
        assert!(
            e.contains("rank 2 has barrier_timeout = None where rank 0 has Some("),
            "{e}"
        );
        assert!(!e.contains("lamport_slot_bytes"), "{e}");
    }
}
