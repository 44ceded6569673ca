//! What a communicator is built with, and the options of one collective.

use std::time::Duration;

use crate::backend::DeviceIdentity;
use crate::bootstrap::HostId;
use crate::dispatch::Algorithm;
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
/// [`CommConfig::for_largest_message`] sizes the scratch from the largest message;
/// `algorithm_for` says whether a message fits an algorithm, and if not, by how much.
/// Built from [`CommConfig::default`] or [`CommConfig::for_largest_message`] and the
/// `with_*` methods (no struct literal outside the crate):
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
    /// read. A larger message runs through it in pipelined chunks of half of it (one
    /// barrier more per chunk, the same bits); chunks are whole 16-byte packs (per
    /// member's part for reduce-scatter and scatter) or whole rows for the fused
    /// RMSNorm, so a payload below two of them is [`crate::Error::MessageTooLarge`].
    /// Two-stage needs one partition whole (`Auto` prefers an algorithm that holds the
    /// message whole), and a batch of group calls all its entries (else one by one).
    pub payload_bytes: usize,
    /// A barrier (or Lamport wait) that spins longer than this gives up and records
    /// [`crate::Error::BarrierTimeout`]; `None` waits forever.
    ///
    /// The error comes within 2 x `barrier_timeout` (+ launch and copy latency): the
    /// block that gave up tells its peers it will not touch their memory again, then
    /// waits at most one more `barrier_timeout` for each peer to say the same, so that
    /// its buffers are not freed while a late peer still reads them (measured on one
    /// H200 with 2 s: 4.00 s). A wait satisfied in time restarts the clock, so a slow
    /// peer can keep a collective running longer. The per-rank [`crate::Comm`] keeps
    /// memory a peer may still write for 2 x `barrier_timeout` (plus a margin) past a
    /// drop whose peers did not all confirm the teardown (`None`: until exit).
    pub barrier_timeout: Option<Duration>,
    /// Upper bound of blocks per launch (at most `MAX_NUM_BLOCKS_UPPER_BOUND`); `None`
    /// derives it from the device's multiprocessor count.
    pub max_blocks: Option<u32>,
    /// Threads per block on GPUs (the host backend runs one thread per block).
    pub threads_per_block: u32,
    /// Testing aid: lets several ranks share one physical device (told by
    /// [`crate::Backend::identity`], not by ordinal), each with its own stream and
    /// signal buffer. Ranks spin waiting for each other, so where k ranks share a
    /// device each gets at most multiprocessors / k blocks. Ranks in one process on one
    /// GPU share its context: anything that waits for the whole context (a kernel
    /// module's first use, `cuCtxSynchronize`, a non-stream-ordered allocation) while a
    /// peer spins stalls both until the barrier timeout, so load kernels and allocate
    /// first. Timings mean nothing then. On CUDA a shared GPU's default memory pool
    /// stops reusing memory across streams (`Backend::prepare_shared_device`), which
    /// could make one rank's stream wait for another's that waits for it.
    pub allow_shared_devices: bool,
    /// How long the per-rank [`crate::Comm`] waits for the other ranks at setup and at
    /// each bootstrap step of re-initialisation (a drop waits for the peers' teardown
    /// at most 1 s). Shorter than `barrier_timeout` is [`crate::Error::InvalidConfig`]:
    /// a rank that waits less on the host than its kernels on the device cannot tell a
    /// slow peer from a gone one. The [`crate::SingleController`] ignores it.
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
    /// (rank 0's from the caller), all at once, instead of one after the other
    /// (default: on). A launch costs the host a few microseconds (~3.5 us with CUDA),
    /// so in a loop a call's host time grows with the world. The threads (one per rank
    /// but rank 0) live as long as the controller and spin ~100 us between calls, then
    /// sleep. Results, stream order and errors are the same either way;
    /// [`crate::SingleController::set_parallel_launch`] switches it at run time. Ranks
    /// need not agree on it.
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
    ///
    /// ```
    /// use peercomm::{CommConfig, Simulation};
    ///
    /// let config = CommConfig::default().with_simulate(Simulation::default().with_no_peer_access((0, 1)));
    /// assert!(config.simulate.is_active());
    /// ```
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

    /// The multiprocessor count world rank `rank` reports: the simulated one, or
    /// `real`.
    pub(crate) fn multiprocessors_of(&self, rank: usize, real: usize) -> usize {
        self.simulation()
            .map_or(real, |s| s.multiprocessors_of(rank, real))
    }

    /// The identity world rank `rank` reports: the simulated physical device's (with
    /// the ordinal of `real`), or `real`.
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
        ("simulate", config.simulation_text()),
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
