//! What a communicator is built with, and the options of one collective.

use crate::external::setters;
use std::time::Duration;

use crate::backend::DeviceIdentity;
use crate::bootstrap::HostId;
use crate::dispatch::Algorithm;
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};
use crate::external::FallbackConfig;
use crate::external::Simulation;

/// Sizes and limits of a communicator.
///
/// # Memory footprint
/// Each rank allocates one signal allocation on its device and nothing else: a fixed
/// 8.28 MiB header (counters, arrivals with their call descriptors, Lamport state, error
/// record), a Lamport region of 3 generations x world-size slots x `lamport_slot_bytes`,
/// and `payload_bytes`. [`CommConfig::memory_footprint`] computes it before building,
/// `SingleController::memory_footprint` / `Comm::memory_footprint` after. Per rank:
///
/// | configuration | world 2 | world 4 | world 8 |
/// |---|---|---|---|
/// | default (1 MiB slot, 64 MiB payload) | 78.3 MiB | 84.3 MiB | 96.3 MiB |
/// | `for_largest_message(1 << 20, BF16)` (2 MiB payload, 1 MiB + 64 B slot) | 16.3 MiB | 22.3 MiB | 34.3 MiB |
/// | 48 MiB slot, 64 MiB payload (Lamport forced at 48 MiB) | 360.3 MiB | 648.3 MiB | 1224.3 MiB |
///
/// Built from [`CommConfig::default`] or [`CommConfig::for_largest_message`] (scratch
/// sized for the largest message) and the `with_*` methods:
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
    /// Bytes of one Lamport slot: the largest message (per rank, in whole 16-byte
    /// packs) the Lamport algorithm takes. The region holds 3 x world-size slots.
    pub lamport_slot_bytes: usize,
    /// Bytes of scratch per rank, into which a staged kernel copies what its peers
    /// read. A larger message runs through it in chunks of half of it (whole packs, or
    /// rows for the fused RMSNorm; a payload below two is
    /// [`crate::Error::MessageTooLarge`]). Two-stage needs one partition whole, and a
    /// batch of group calls all its entries (else one by one).
    pub payload_bytes: usize,
    /// A barrier (or Lamport wait) that spins longer than this gives up and records
    /// [`crate::Error::BarrierTimeout`]; `None` waits forever.
    ///
    /// The error comes within 2 x `barrier_timeout` (+ launch latency): the block that
    /// gave up waits one more `barrier_timeout` for its peers to stop touching its
    /// memory (one H200, 2 s: 4.00 s). A wait satisfied in time restarts the clock. The
    /// per-rank [`crate::Comm`] keeps memory a peer may still write for that long past a
    /// drop whose peers did not all confirm the teardown (`None`: until exit).
    pub barrier_timeout: Option<Duration>,
    /// Upper bound of blocks per launch (at most `MAX_NUM_BLOCKS_UPPER_BOUND`); `None`
    /// derives it from the device's multiprocessor count.
    pub max_blocks: Option<u32>,
    /// Threads per block on GPUs (the host backend runs one thread per block).
    pub threads_per_block: u32,
    /// Testing aid: lets ranks share one device ([`crate::Backend::identity`]), each with
    /// its own stream and signal buffer and at most multiprocessors / k blocks (k ranks spin
    /// for each other). A whole-context wait (a module's first use, `cuCtxSynchronize`)
    /// while a peer spins stalls both until the barrier timeout: load kernels and allocate
    /// first. Timings mean nothing then.
    pub allow_shared_devices: bool,
    /// How long the per-rank [`crate::Comm`] waits for the other ranks at each
    /// bootstrap step (a drop at most 1 s); at least `barrier_timeout`
    /// ([`crate::Error::InvalidConfig`] otherwise), so that a rank tells a slow peer
    /// from a gone one. The [`crate::SingleController`] ignores it.
    pub bootstrap_timeout: Duration,
    /// Where peer memory cannot serve (no working peer access, several hosts, more
    /// than `MAX_GPUS` ranks): hand the calls to NCCL/RCCL (the default) or refuse;
    /// and whether to route by message size (default: never).
    pub fallback: FallbackConfig,
    /// For testing only: simulate missing peer access, a failed peer check, or ranks
    /// on several hosts (see [`Simulation`]). Only with the `fault-injection` feature.
    #[cfg(feature = "fault-injection")]
    pub simulate: Simulation,
    /// Single controller only: enqueue each rank's kernel from its own launch thread
    /// (rank 0's from the caller), all at once (default: on), so that a call's host
    /// time (~3.5 us a launch on CUDA) does not grow with the world. The threads spin
    /// ~100 us between calls, then sleep. Results and errors are the same either way;
    /// [`crate::SingleController::set_parallel_launch`] switches it at run time.
    pub parallel_launch: bool,
}

impl CommConfig {
    setters! {
        /// With [`CommConfig::lamport_slot_bytes`].
        fn with_lamport_slot_bytes(bytes: usize) => lamport_slot_bytes = bytes;
        /// With [`CommConfig::payload_bytes`].
        fn with_payload_bytes(bytes: usize) => payload_bytes = bytes;
        /// With [`CommConfig::barrier_timeout`] (`None` waits forever).
        fn with_barrier_timeout(timeout: Option<Duration>) => barrier_timeout = timeout;
        /// With [`CommConfig::max_blocks`] (`None` derives it from the device).
        fn with_max_blocks(max_blocks: Option<u32>) => max_blocks = max_blocks;
        /// With [`CommConfig::threads_per_block`].
        fn with_threads_per_block(threads: u32) => threads_per_block = threads;
        /// With [`CommConfig::allow_shared_devices`] (a testing aid).
        fn with_allow_shared_devices(allow: bool) => allow_shared_devices = allow;
        /// With [`CommConfig::bootstrap_timeout`].
        fn with_bootstrap_timeout(timeout: Duration) => bootstrap_timeout = timeout;
        /// With [`CommConfig::fallback`].
        fn with_fallback(fallback: FallbackConfig) => fallback = fallback;
        /// With [`CommConfig::simulate`] (testing only; `fault-injection` feature).
        ///
        /// ```
        /// use peercomm::{CommConfig, Simulation};
        ///
        /// let config = CommConfig::default().with_simulate(Simulation::default().with_no_peer_access((0, 1)));
        /// assert!(config.simulate.is_active());
        /// ```
        #[cfg(feature = "fault-injection")]
        fn with_simulate(simulate: Simulation) => simulate = simulate;
        /// With [`CommConfig::parallel_launch`].
        fn with_parallel_launch(parallel: bool) => parallel_launch = parallel;
    }

    /// The simulation (none without the `fault-injection` feature).
    fn simulation(&self) -> Option<&Simulation> {
        #[cfg(feature = "fault-injection")]
        return Some(&self.simulate).filter(|s| s.is_active());
        #[cfg(not(feature = "fault-injection"))]
        None
    }

    /// The host identities the simulation gives the world ranks, if any.
    pub(crate) fn simulated_hosts(&self) -> Option<&[HostId]> {
        self.simulation()?.hosts.as_deref()
    }

    /// The multiprocessor count world rank `rank` reports (simulated, or `real`).
    pub(crate) fn multiprocessors_of(&self, rank: usize, real: usize) -> usize {
        self.simulation()
            .map_or(real, |s| s.multiprocessors_of(rank, real))
    }

    /// The identity world rank `rank` reports (simulated, or `real`).
    pub(crate) fn identity_of(&self, rank: usize, real: DeviceIdentity) -> DeviceIdentity {
        match self.simulation() {
            Some(s) => s.identity_of(rank, real),
            None => real,
        }
    }

    /// Whether the simulation removes peer access between world ranks `a` and `b`.
    pub(crate) fn simulation_blocks_pair(&self, a: usize, b: usize) -> bool {
        self.simulation().is_some_and(|s| s.blocks_pair(a, b))
    }

    /// Whether the simulation corrupts the peer check of world rank `rank`.
    pub(crate) fn simulation_fails_peer_check(&self, rank: usize) -> bool {
        self.simulation()
            .is_some_and(|s| s.fail_peer_check == Some(rank))
    }

    /// The simulation as the ranks compare it: `none`, or its switches.
    fn simulation_text(&self) -> String {
        self.simulation()
            .map_or_else(|| "none".to_string(), |s| format!("{s:?}"))
    }

    /// [`CommConfig::bootstrap_timeout`] at least `barrier_timeout`, for the per-rank
    /// [`crate::Comm`].
    pub(crate) fn check_per_rank_timeouts(&self) -> Result<()> {
        let Some(barrier) = self.barrier_timeout.filter(|&b| self.bootstrap_timeout < b) else {
            return Ok(());
        };
        Err(Error::InvalidConfig(format!(
            "CommConfig::bootstrap_timeout ({:?}) is shorter than CommConfig::barrier_timeout \
             ({barrier:?}): a rank that waits less on the host than its kernels wait on the \
             device cannot tell a slow peer from a gone one; make bootstrap_timeout at least \
             barrier_timeout",
            self.bootstrap_timeout
        )))
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

/// Options of one all-reduce, built from [`AllReduceOptions::new`] and its setters.
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
    /// Let the launch overlap the tail of the kernel before it on the stream
    /// (programmatic dependent launch, NVIDIA sm_90+), which it still waits for before
    /// reading anything. Off by default.
    pub overlap_previous: bool,
    /// The operator, which the methods take as an argument (cudarc's order).
    pub(crate) op: ReduceOp,
}

impl AllReduceOptions {
    /// Whole world, automatic algorithm.
    pub fn new() -> Self {
        Self::default()
    }
    setters! {
        /// With a group size.
        fn group_size(group_size: usize) => group_size = group_size;
        /// With an algorithm.
        fn algorithm(algorithm: Algorithm) => algorithm = algorithm;
        /// With a block count.
        fn blocks(blocks: u32) => blocks = Some(blocks);
        /// Whether the launch may overlap the previous kernel's tail (see the field).
        fn overlap_previous(overlap: bool) => overlap_previous = overlap;
    }
    /// These options with the operator of the call.
    pub(crate) fn with_op(self, op: ReduceOp) -> Self {
        AllReduceOptions { op, ..self }
    }
}

/// Every field the ranks must agree on as they exchange it: `name=value` lines (what a
/// mismatch names). Not `bootstrap_timeout` nor `parallel_launch`: each rank's host
/// side, which its peers never see.
pub(crate) fn encode_config(c: &CommConfig) -> Vec<u8> {
    let fields = [
        ("lamport_slot_bytes", c.lamport_slot_bytes.to_string()),
        ("payload_bytes", c.payload_bytes.to_string()),
        ("barrier_timeout", format!("{:?}", c.barrier_timeout)),
        ("max_blocks", format!("{:?}", c.max_blocks)),
        ("threads_per_block", c.threads_per_block.to_string()),
        ("allow_shared_devices", c.allow_shared_devices.to_string()),
        ("fallback", format!("{:?}", c.fallback)),
        ("simulate", c.simulation_text()),
    ];
    fields
        .map(|(name, value)| format!("{name}={value}\n"))
        .concat()
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
        let (a, b) = (encode_config(&a), encode_config(&b));
        assert_eq!(compare_configs(&[a.clone(), a.clone()]), Ok(()));
        let e = compare_configs(&[a.clone(), a, b]).unwrap_err().to_string();
        assert!(e.contains("rank 2 has payload_bytes = "), "{e}");
        assert!(
            e.contains("rank 2 has barrier_timeout = None where rank 0 has Some("),
            "{e}"
        );
        assert!(!e.contains("lamport_slot_bytes"), "{e}");
    }
}
