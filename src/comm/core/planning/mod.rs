//! Planning: the algorithm, kernel and grid a validated call runs, and whether the
//! scratch holds it.

use crate::backend::{Kernel, KernelKind, LaunchDims};
use crate::dispatch::{self, Algorithm};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::signal::{LAMPORT_HEADER_BYTES, MAX_NUM_BLOCKS_UPPER_BOUND, PACK_BYTES};

use crate::comm::core::settings::Settings;
use crate::comm::AllReduceOptions;
use staging::message_bytes;

pub(crate) mod cache;
pub(crate) mod check;
pub(crate) mod collective;
pub(crate) mod sizing;
pub(crate) mod staging;

/// Where a call's kernels read the peers' inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PeerReads {
    /// In the peers' user buffers (one process): no staging, two-stage offered.
    UserBuffers,
    /// Only in the peers' signal allocations: inputs are staged into the payload.
    Payloads,
}

/// What a collective's kernel gets beside the all-reduce arguments.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct CollectiveArgs {
    pub(crate) root: u32,
    pub(crate) hidden: u32,
    pub(crate) epsilon: f32,
    /// The reducing collectives' operator (read from the call descriptor).
    pub(crate) op: ReduceOp,
}

/// What validation learned about one call.
#[derive(Clone, Copy)]
pub(crate) struct Plan {
    pub(crate) kernel: Kernel,
    pub(crate) algorithm: Algorithm,
    pub(crate) width: usize,
    pub(crate) elements: usize,
    /// The kernels' `stage_input` word: 0 where nothing is staged, else how the kernel
    /// goes through the payload (`staging`).
    pub(crate) stage_input: u32,
    pub(crate) dims: LaunchDims,
    /// Launch with programmatic dependent launch where the backend has it.
    pub(crate) overlap_previous: bool,
    /// Root, hidden size and epsilon of the collectives that have them.
    pub(crate) collective: CollectiveArgs,
    /// Where the peers read the input, for the call descriptor.
    pub(crate) input_place: InputPlace,
}

impl Plan {
    /// A plan of `kernel` on `dims` with nothing staged, no overlap and no collective
    /// arguments (callers set what differs).
    pub(crate) fn new(
        kernel: Kernel,
        algorithm: Algorithm,
        width: usize,
        elements: usize,
        dims: LaunchDims,
    ) -> Self {
        Plan {
            kernel,
            algorithm,
            width,
            elements,
            stage_input: 0,
            dims,
            overlap_previous: false,
            collective: CollectiveArgs::default(),
            input_place: InputPlace::Staged,
        }
    }
}

/// Where the peers read a call's input (compared by the call descriptor).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum InputPlace {
    /// Staged through the payloads, or not read in place by any peer.
    #[default]
    Staged,
    /// In place, at byte `offset` of registration `registration` on every rank.
    Registered { registration: u64, offset: u64 },
}

impl Settings {
    /// The barrier kernel over groups of `group_size`: one block, no data.
    pub(crate) fn barrier_plan(&self, group_size: usize) -> Result<Plan> {
        let (kind, dtype) = (KernelKind::Barrier, DType::F32);
        let kernel = Kernel { kind, dtype };
        let width = self.group_width(group_size)?;
        Ok(Plan::new(kernel, Algorithm::Auto, width, 0, self.dims(1)))
    }

    /// `blocks` blocks of the configured threads.
    pub(crate) fn dims(&self, blocks: u32) -> LaunchDims {
        let threads = self.config.threads_per_block;
        LaunchDims { blocks, threads }
    }

    /// The blocks a call asked for (checked), else `chosen()`.
    pub(crate) fn blocks(&self, asked: Option<u32>, chosen: impl FnOnce() -> u32) -> Result<u32> {
        match asked {
            Some(b) if b == 0 || b as usize > MAX_NUM_BLOCKS_UPPER_BOUND => {
                Err(Error::Unsupported(format!(
                    "blocks must be in 1..={MAX_NUM_BLOCKS_UPPER_BOUND}, not {b}"
                )))
            }
            Some(b) => Ok(b),
            None => Ok(chosen()),
        }
    }

    /// Whether Lamport may run over groups of `width`: only over the whole world of at
    /// least two ranks. Its state is per rank and shared by every width, so a subgroup
    /// would move its generations but not its siblings'; a group of one copies, keeping
    /// the sign of zero.
    pub(crate) fn lamport_allowed(&self, width: usize) -> bool {
        width == self.world && width > 1
    }

    /// Chooses the algorithm and grid and checks the scratch. With `PeerReads::Payloads`
    /// every input the peers read is staged, and two-stage is not offered.
    pub(crate) fn plan(
        &self,
        dtype: DType,
        elements: usize,
        options: &AllReduceOptions,
        in_place: bool,
        reads: PeerReads,
    ) -> Result<Plan> {
        check_op(dtype, options.op)?;
        let width = self.group_width(options.group_size)?;
        // Sizes below stay within usize once the padded message (<= isize::MAX) does.
        let padded = message_bytes(dtype, elements, &|| "an all-reduce".into())?;
        let packs = elements.div_ceil(dtype.lanes());
        let (slot, payload) = (self.layout.lamport_slot_bytes, self.layout.payload_bytes);
        let two_stage_need = packs.div_ceil(width) * PACK_BYTES;
        let direct = reads == PeerReads::UserBuffers;
        // Where the peers would read what this rank overwrites, or cannot reach it.
        let stages = in_place || !direct;
        // A Lamport slot holds the packs and, last, the header (the descriptor).
        let lamport_need = padded + LAMPORT_HEADER_BYTES;
        // Whether the scratch holds what `a` needs at once (staged one-stage beyond it
        // runs in chunks).
        let fits_whole = |a: Algorithm| match a {
            Algorithm::Lamport => lamport_need <= slot,
            Algorithm::TwoStage => two_stage_need <= payload,
            Algorithm::OneStage => !stages || width == 1 || padded <= payload,
            Algorithm::Auto | Algorithm::Nccl | Algorithm::Hierarchical => true,
        };
        let word = staging::all_reduce(packs, payload);
        let fits = |a: Algorithm| fits_whole(a) || (a == Algorithm::OneStage && word.is_some());
        let lamport_allowed = self.lamport_allowed(width);
        // The two-stage and Lamport kernels exist for f32, f16 and bf16 alone.
        let every_kernel = dtype.every_kernel();
        let algorithm = match options.algorithm {
            Algorithm::Auto => {
                let mut preferred = dispatch::choose(&self.arch, width, elements * dtype.size());
                if (preferred == Algorithm::Lamport && !lamport_allowed)
                    || (preferred == Algorithm::TwoStage && !direct)
                    || !every_kernel
                {
                    preferred = Algorithm::OneStage;
                }
                // Fall back to one the scratch holds whole, then to chunked one-stage.
                let candidates = [preferred, Algorithm::OneStage, Algorithm::TwoStage]
                    .into_iter()
                    .filter(|&a| (direct && every_kernel) || a != Algorithm::TwoStage);
                candidates
                    .clone()
                    .find(|&a| fits_whole(a))
                    .or_else(|| candidates.clone().find(|&a| fits(a)))
                    .unwrap_or(preferred)
            }
            a @ (Algorithm::Lamport | Algorithm::TwoStage) if !every_kernel => {
                return Err(Error::Unsupported(format!(
                    "the {} algorithm takes f32, f16 and bf16, not {}; use Auto or OneStage",
                    a.name(),
                    dtype.name()
                )))
            }
            Algorithm::Lamport if width == 1 => Algorithm::OneStage,
            Algorithm::Lamport if !lamport_allowed => {
                return Err(Error::Unsupported(format!(
                    "the Lamport algorithm runs only over the whole world (group_size 0 or \
                     {}), not over groups of {width}; use Auto or another algorithm",
                    self.world
                )))
            }
            Algorithm::Nccl | Algorithm::Hierarchical => {
                return Err(Error::Unsupported(format!(
                    "{} runs in the external library, which this communicator has not set up \
                     (it is set up when peer memory cannot serve, or with \
                     FallbackConfig::by_size)",
                    options.algorithm.name()
                )))
            }
            Algorithm::TwoStage if !direct && width > 1 => {
                return Err(Error::Unsupported(
                    "two-stage reads the peers' user buffers, which ranks in other processes \
                     cannot reach; use Auto, OneStage or Lamport"
                        .into(),
                ))
            }
            a => a,
        };
        if !fits(algorithm) {
            let (needed, available, setting) = match algorithm {
                Algorithm::Lamport => (lamport_need, slot, "lamport_slot_bytes"),
                Algorithm::TwoStage => (two_stage_need, payload, "payload_bytes"),
                // Chunked, a pack in each half of the payload would do.
                _ => (padded.min(2 * PACK_BYTES), payload, "payload_bytes"),
            };
            return Err(Error::MessageTooLarge {
                algorithm: algorithm.name(),
                needed,
                available,
                setting,
            });
        }
        let kind = algorithm.kernel_kind().expect("concrete algorithm");
        // A group of one waits for no one. A staged one-stage plan fits, so has a word.
        let staged = stages && kind == KernelKind::OneStage && width > 1;
        // The grid follows the remote traffic: each pack comes from width - 1 peers, so
        // each multiprocessor moves what it moves at width 2 (until every SM has one).
        let work_packs = match kind {
            KernelKind::TwoStage => packs.div_ceil(width),
            _ => packs,
        }
        .saturating_mul((width - 1).max(1));
        let blocks = self.blocks(options.blocks, || {
            dispatch::blocks_for(work_packs, self.config.threads_per_block, self.max_blocks)
        })?;
        let mut plan = Plan {
            stage_input: word.filter(|_| staged).unwrap_or(0),
            overlap_previous: options.overlap_previous,
            ..Plan::new(
                Kernel { kind, dtype },
                algorithm,
                width,
                elements,
                self.dims(blocks),
            )
        };
        plan.collective.op = options.op;
        Ok(plan)
    }
}

/// Refuses an operator the element type does not take (`Avg` over an integer), before
/// anything launches.
pub(crate) fn check_op(dtype: DType, op: ReduceOp) -> Result<()> {
    if op.takes(dtype) {
        return Ok(());
    }
    Err(Error::Unsupported(format!(
        "the {} operator takes floating-point types, not {}",
        op.name(),
        dtype.name()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signal::STAGE_WHOLE;
    use crate::CommConfig;
    use Algorithm::{Auto, Lamport, OneStage, TwoStage};
    use PeerReads::{Payloads, UserBuffers};

    fn settings(world: usize) -> Settings {
        Settings::new(CommConfig::default(), "sm_90".into(), 132, world).unwrap()
    }

    /// The plan of an f32 all-reduce of `elements` run by `algorithm`.
    fn plan(s: &Settings, elements: usize, algorithm: Algorithm, in_place: bool) -> Plan {
        let opts = AllReduceOptions::new().algorithm(algorithm);
        s.plan(DType::F32, elements, &opts, in_place, UserBuffers)
            .unwrap()
    }

    #[test]
    fn ranks_sharing_a_device_get_a_grid_that_fits_together() {
        let mut s = settings(4);
        s.limit_for_shared_devices(132, 1);
        assert_eq!(s.max_blocks, 132);
        s.limit_for_shared_devices(132, 2);
        assert_eq!(s.max_blocks, 66);
        assert_eq!(plan(&s, 1 << 24, OneStage, false).dims.blocks, 66);
        let mut few = settings(2);
        few.max_blocks = 4;
        few.limit_for_shared_devices(132, 2);
        assert_eq!(few.max_blocks, 4, "an explicit smaller cap stays");
        let mut crowded = settings(8);
        crowded.limit_for_shared_devices(4, 8);
        assert_eq!(crowded.max_blocks, 1, "at least one block");
    }

    /// 64 KiB of f32 (4096 packs) is 8 blocks of 512 threads at width 2, growing with the
    /// peers each pack comes from; two-stage works on a partition of packs / width; capped
    /// at one block per multiprocessor.
    #[test]
    fn the_grid_grows_with_the_remote_traffic_of_the_width() {
        for (algorithm, elements, per_width) in [
            (OneStage, 16384, &[(2, 8), (4, 24), (8, 56)][..]),
            (Lamport, 16384, &[(2, 8), (4, 24), (8, 56)]),
            (TwoStage, 16384, &[(2, 4), (8, 7)]),
            (OneStage, 1 << 24, &[(8, 132)]),
        ] {
            for &(width, blocks) in per_width {
                let p = plan(&settings(width), elements, algorithm, false);
                assert_eq!(p.dims.blocks, blocks, "{algorithm:?} {elements} at {width}");
            }
        }
    }

    /// A staged one-stage call the payload cannot hold is planned in chunks; Auto prefers
    /// an algorithm whose scratch holds it whole; a payload without a pack per half
    /// refuses it, naming the 32 bytes chunks need.
    #[test]
    fn a_staged_call_past_the_payload_is_planned_in_chunks() {
        let config = |bytes| {
            CommConfig::default()
                .with_payload_bytes(bytes)
                .with_lamport_slot_bytes(1024)
        };
        let s = Settings::new(config(4096), "sm_90".into(), 132, 2).unwrap();
        let one = AllReduceOptions::new().algorithm(OneStage);
        for (reads, in_place) in [(Payloads, false), (Payloads, true), (UserBuffers, true)] {
            for (elements, word) in [(1024, STAGE_WHOLE), (1025, 128), (1 << 20, 128)] {
                let p = s.plan(DType::F32, elements, &one, in_place, reads).unwrap();
                let what = format!("{elements} {reads:?} {in_place}");
                assert_eq!((p.algorithm, p.stage_input), (OneStage, word), "{what}");
            }
        }
        // Out of place in one process nothing is staged.
        assert_eq!(plan(&s, 1 << 20, OneStage, false).stage_input, 0);
        // Auto in place in one process: two-stage's partition fits whole, so it wins
        // over chunks; past it, one-stage in chunks.
        assert_eq!(plan(&s, 2048, Auto, true).algorithm, TwoStage);
        let p = plan(&s, 4096, Auto, true);
        assert_eq!((p.algorithm, p.stage_input), (OneStage, 128));
        // A half of no pack.
        let tiny = Settings::new(config(16), "sm_90".into(), 132, 2).unwrap();
        match tiny.plan(DType::F32, 8, &one, false, Payloads) {
            Err(Error::MessageTooLarge {
                needed: 32,
                available: 16,
                setting: "payload_bytes",
                ..
            }) => {}
            other => panic!("a 16-byte payload: {:?}", other.map(|p| p.algorithm)),
        }
        assert!(tiny.plan(DType::F32, 4, &one, false, Payloads).is_ok());
    }

    /// The dtypes beyond f32, f16 and bf16 run one-stage under `Auto` (in place too, where
    /// two-stage would win), refuse two-stage and Lamport by name, and `Avg` over an
    /// integer is refused before any plan.
    #[test]
    fn other_dtypes_run_one_stage() {
        let s = settings(4);
        for dtype in DType::ALL.into_iter().filter(|d| !d.every_kernel()) {
            for (elements, in_place) in [(7, false), (2048, true), (1 << 20, false)] {
                let p = plan_dtype(&s, dtype, elements, Auto, in_place);
                assert_eq!(p.unwrap().algorithm, OneStage, "{dtype:?} {elements}");
            }
            for algorithm in [TwoStage, Lamport] {
                match plan_dtype(&s, dtype, 64, algorithm, false) {
                    Err(Error::Unsupported(m)) => assert!(m.contains(dtype.name()), "{m}"),
                    other => panic!("{dtype:?} {algorithm:?}: {:?}", other.map(|p| p.algorithm)),
                }
            }
            let avg = AllReduceOptions::new().with_op(ReduceOp::Avg);
            let got = s.plan(dtype, 64, &avg, false, UserBuffers);
            assert_eq!(got.is_ok(), dtype.is_float(), "{dtype:?} avg");
            // The fused all-reduce + RMSNorm takes f32, f16 and bf16.
            use collective::{Collective, CollectiveOptions};
            let fused = Collective::AllReduceRmsNorm {
                hidden: 64,
                epsilon: 1e-6,
            };
            let opts = CollectiveOptions::new();
            match s.collective_plan(fused, dtype, 128, &opts, UserBuffers) {
                Err(Error::Unsupported(m)) => assert!(m.contains(dtype.name()), "{m}"),
                other => panic!("fused {dtype:?}: {:?}", other.map(|p| p.algorithm)),
            }
            let scatter = Collective::ReduceScatter;
            let avg = opts.with_op(ReduceOp::Avg);
            let got = s.collective_plan(scatter, dtype, 128, &avg, UserBuffers);
            assert_eq!(
                got.is_ok(),
                dtype.is_float(),
                "{dtype:?} reduce-scatter avg"
            );
        }
    }

    fn plan_dtype(
        s: &Settings,
        dtype: DType,
        elements: usize,
        algorithm: Algorithm,
        in_place: bool,
    ) -> Result<Plan> {
        let opts = AllReduceOptions::new().algorithm(algorithm);
        s.plan(dtype, elements, &opts, in_place, UserBuffers)
    }

    /// The sign-of-zero rule: a group of one never runs Lamport (which sends -0.0 as
    /// +0.0), whatever the request, architecture, world or size: the copy keeps every bit.
    #[test]
    fn a_group_of_one_never_runs_lamport() {
        for arch in ["host", "sm_90", "sm_80", "gfx942", "gfx90a", "unknown"] {
            for world in 1..=crate::MAX_GPUS {
                let settings = Settings::new(CommConfig::default(), arch.into(), 8, world).unwrap();
                // The other dtypes refuse Lamport (a test below).
                for dtype in DType::ALL.into_iter().filter(|d| d.every_kernel()) {
                    for elements in [1, 7, 4096, 65_536, 1 << 20] {
                        for (algorithm, in_place) in
                            [Auto, Lamport].map(|a| [(a, false), (a, true)]).concat()
                        {
                            let opts = AllReduceOptions::new().group_size(1).algorithm(algorithm);
                            let p = settings.plan(dtype, elements, &opts, in_place, UserBuffers);
                            let what = format!("{arch}, world {world}, {elements} x {dtype:?}");
                            let (a, stage) = p.map(|p| (p.algorithm, p.stage_input)).unwrap();
                            assert_eq!((a, stage), (OneStage, 0), "{what}, {algorithm:?}");
                        }
                    }
                }
            }
        }
    }
}
