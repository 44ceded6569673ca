//! The batched all-reduce ([`KernelKind::AllReduceGroup`]): 1 to [`MAX_GROUP_CALLS`] sum
//! all-reduces of one dtype and width as one kernel, planned and launched on one rank.
//! Staged entries follow the entry table ([`GROUP_HEADER_BYTES`]) in the payload, in
//! whole packs.
//!
//! The descriptor is entry 0's with `count - 1` as its root. The later lengths travel in
//! each rank's entry table, which every block compares with its peers' after the Publish
//! barrier, before storing anything; a difference is [`Error::CallMismatch`]
//! (`CallField::Length`), abandoned only once the peers have compared too, so no payload
//! is reused while a peer still reads its table.

use crate::backend::{Backend, Kernel, KernelKind, WideArgs};
use crate::dispatch::{self, Algorithm};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::signal::{GroupArgs, GroupEntry, GROUP_HEADER_BYTES, MAX_GROUP_CALLS, PACK_BYTES};

use crate::comm::core::launch::PeerInputs;
use crate::comm::core::planning::check::Routed;
use crate::comm::core::planning::{CollectiveArgs, PeerReads, Plan};
use crate::comm::core::routing::Path;
use crate::comm::core::settings::Settings;
use crate::comm::core::Rank;
use crate::comm::AllReduceOptions;

/// A planned batch: the launch plan (the descriptor's source) and each entry's length
/// and payload offset.
pub(crate) struct GroupPlan {
    pub(crate) plan: Plan,
    /// Entries: 1 ..= `MAX_GROUP_CALLS`.
    pub(crate) count: usize,
    pub(crate) lengths: [u64; MAX_GROUP_CALLS],
    /// Byte offsets in the payload (whole packs, after the entry table).
    pub(crate) offsets: [u64; MAX_GROUP_CALLS],
    /// Elements of every entry together (0: nothing to launch).
    pub(crate) total_elements: usize,
}

impl Settings {
    /// Plans a batch of all-reduces of `dtype` with operator `op` and these element
    /// counts over groups of `group_size` (0 = the world): payload offsets, the scratch
    /// check, the grid.
    pub(crate) fn group_plan(
        &self,
        (dtype, op): (DType, ReduceOp),
        lengths: &[usize],
        group_size: usize,
        stage: bool,
    ) -> Result<GroupPlan> {
        let count = lengths.len();
        if count == 0 || count > MAX_GROUP_CALLS {
            return Err(Error::Unsupported(format!(
                "a batched all-reduce runs 1..={MAX_GROUP_CALLS} all-reduces, not {count}"
            )));
        }
        if !dtype.every_kernel() {
            return Err(Error::Unsupported(format!(
                "a batched all-reduce takes f32, f16 and bf16, not {}",
                dtype.name()
            )));
        }
        let width = self.group_width(group_size)?;
        let kind = KernelKind::AllReduceGroup;
        let mut offsets = [0u64; MAX_GROUP_CALLS];
        let too_large = || self.payload_too_large(kind, usize::MAX);
        let header_packs = GROUP_HEADER_BYTES / PACK_BYTES;
        let mut packs = header_packs;
        for (s, &n) in lengths.iter().enumerate() {
            offsets[s] = packs as u64;
            packs = (packs.checked_add(n.div_ceil(dtype.lanes()))).ok_or_else(too_large)?;
        }
        let needed = packs.checked_mul(PACK_BYTES).ok_or_else(too_large)?;
        // In bytes: each offset is at most `needed`.
        offsets.iter_mut().for_each(|o| *o *= PACK_BYTES as u64);
        // In place, or a group of one, needs no scratch.
        let staged = stage && width > 1;
        if staged && needed > self.layout.payload_bytes {
            return Err(self.payload_too_large(kind, needed));
        }
        // As one-stage, from the entries alone: two batches' grids differ only where their
        // lengths do.
        let blocks = dispatch::blocks_for(
            (packs - header_packs).saturating_mul((width - 1).max(1)),
            self.config.threads_per_block,
            self.max_blocks,
        );
        let (kernel, dims) = (Kernel { kind, dtype }, self.dims(blocks));
        Ok(GroupPlan {
            plan: Plan {
                stage_input: staged.into(),
                collective: CollectiveArgs {
                    root: (count - 1) as u32,
                    op,
                    ..CollectiveArgs::default()
                },
                ..Plan::new(kernel, Algorithm::OneStage, width, lengths[0], dims)
            },
            count,
            lengths: std::array::from_fn(|s| lengths.get(s).map_or(0, |&n| n as u64)),
            offsets,
            total_elements: lengths.iter().sum(),
        })
    }
}

/// One all-reduce of a group call (see `Comm::group`), as every rank issues it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GroupedCall {
    pub(crate) dtype: DType,
    pub(crate) elements: usize,
    pub(crate) options: AllReduceOptions,
    pub(crate) in_place: bool,
}

/// How a group's calls are launched, in their order.
pub(crate) enum GroupStep {
    /// Calls `first .. first + plan.count` in one batched kernel.
    Batch { first: usize, plan: GroupPlan },
    /// Call `index` alone, as routed and planned.
    Alone { index: usize, routed: Routed },
}

/// Runs a group's steps in order with `run`, which launches one step and returns a
/// lone call's algorithm (a batch's entries run one-stage). The first failure stops
/// the group, calling `poison` first where an earlier step was launched: those launches
/// wait for peers whose calls never come.
pub(crate) fn run_group_steps(
    steps: Vec<GroupStep>,
    calls: usize,
    poison: impl FnOnce(&Error),
    mut run: impl FnMut(GroupStep) -> Result<Option<(usize, Algorithm)>>,
) -> Result<Vec<Algorithm>> {
    let mut algorithms = vec![Algorithm::OneStage; calls];
    let mut launched = false;
    for step in steps {
        match run(step) {
            Ok(Some((index, algorithm))) => algorithms[index] = algorithm,
            Ok(None) => {}
            Err(e) => {
                if launched {
                    poison(&e);
                }
                return Err(e);
            }
        }
        launched = true;
    }
    Ok(algorithms)
}

impl<B: Backend> Rank<B> {
    /// Enqueues this rank's batched all-reduce of `group`: entry s reads `io[s].0` (this
    /// rank's input, or every rank's where the batch reads in place), writes `io[s].1`.
    pub(crate) fn launch_group(
        &self,
        group: &GroupPlan,
        io: &[(PeerInputs<'_>, u64)],
    ) -> Result<()> {
        if io.len() != group.count {
            return Err(Error::Unsupported(format!(
                "{} buffer pairs for a batch of {}",
                io.len(),
                group.count
            )));
        }
        let plan = &group.plan;
        let in_place = plan.width > 1 && plan.stage_input == 0;
        if in_place && io.iter().any(|(i, _)| matches!(i, PeerInputs::Own(_))) {
            return Err(Error::Unsupported(
                "a batch read in place needs every member's input".into(),
            ));
        }
        let e = &self.endpoint;
        let Some((mut all, base)) = e.prologue(&self.settings, plan) else {
            return Ok(());
        };
        all.num_elements = group.total_elements as u64;
        let (r, width) = (e.index, plan.width);
        let mut args = GroupArgs {
            all,
            count: group.count as u32,
            ..Default::default()
        };
        for (s, &(inputs, output)) in io.iter().enumerate() {
            let input = match inputs {
                PeerInputs::Own(p) => p,
                PeerInputs::InPlace(all) => {
                    args.peer_inputs[s][..width].copy_from_slice(&all[base..base + width]);
                    all[r]
                }
            };
            args.entries[s] = GroupEntry {
                input,
                output,
                elements: group.lengths[s],
                offset: group.offsets[s],
            };
        }
        B::launch_wide(&e.device, plan.kernel, plan.dims, WideArgs::Group(&args))
    }

    /// Splits a group's calls into launches: consecutive peer-memory all-reduces of one
    /// dtype (f32, f16 or bf16), operator and width with algorithm and grid left to peercomm
    /// run as one batch (up to [`MAX_GROUP_CALLS`] that fit the payload); every other call
    /// runs alone. Every rank
    /// decides the same, from the calls alone.
    pub(crate) fn plan_grouped(
        &self,
        calls: &[GroupedCall],
        reads: PeerReads,
    ) -> Result<Vec<GroupStep>> {
        // The batched kernel takes f32, f16 and bf16: the other dtypes run alone.
        let batchable = |c: &GroupedCall| {
            c.dtype.every_kernel()
                && matches!(c.options.algorithm, Algorithm::Auto | Algorithm::OneStage)
                && c.options.blocks.is_none()
                && !c.options.overlap_previous
        };
        let local_width = |c: &GroupedCall| -> Result<Option<usize>> {
            Ok(match self.route.path(c.dtype, c.elements, &c.options)? {
                Path::Peer(local) => Some(local.group_size),
                _ => None,
            })
        };
        let mut steps = Vec::new();
        let mut i = 0;
        while i < calls.len() {
            let c = &calls[i];
            if let (true, Some(group_size)) = (batchable(c), local_width(c)?) {
                let mut lengths = vec![c.elements];
                // Staged where the peers read only payloads, or where an entry's output
                // is its input (the peers would read what this rank overwrites).
                let mut stage = reads == PeerReads::Payloads || c.in_place;
                let mut plan = None;
                for next in &calls[i + 1..] {
                    if lengths.len() == MAX_GROUP_CALLS
                        || next.dtype != c.dtype
                        || next.options.op != c.options.op
                        || !batchable(next)
                        || local_width(next)? != Some(group_size)
                    {
                        break;
                    }
                    lengths.push(next.elements);
                    let stage_with = stage || next.in_place;
                    match self.settings.group_plan(
                        (c.dtype, c.options.op),
                        &lengths,
                        group_size,
                        stage_with,
                    ) {
                        Ok(p) => {
                            plan = Some(p);
                            stage = stage_with;
                        }
                        Err(_) => {
                            lengths.pop();
                            break;
                        }
                    }
                }
                if let Some(plan) = plan {
                    let count = plan.count;
                    steps.push(GroupStep::Batch { first: i, plan });
                    i += count;
                    continue;
                }
            }
            let routed =
                self.plan_all_reduce(c.dtype, c.elements, &c.options, c.in_place, reads)?;
            steps.push(GroupStep::Alone { index: i, routed });
            i += 1;
        }
        Ok(steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::CommConfig;

    fn settings(payload_bytes: usize, world: usize) -> Settings {
        let config = CommConfig::default()
            .with_payload_bytes(payload_bytes)
            .with_max_blocks(Some(2));
        Settings::new(config, "sm_90".into(), 8, world).unwrap()
    }

    /// Entries follow the table, which counts in a staged batch's payload bound; the
    /// descriptor holds entry 0's exact length and the count.
    #[test]
    fn entries_follow_the_table_and_fit_with_it() {
        let s = settings(64 << 10, 2);
        let plan = |lengths: &[usize], group_size, stage| {
            s.group_plan((DType::F32, ReduceOp::Max), lengths, group_size, stage)
        };
        let g = plan(&[5, 0, 8, 1], 0, true).unwrap();
        assert_eq!(GROUP_HEADER_BYTES, 80);
        assert_eq!(&g.offsets[..4], &[80, 112, 112, 144]);
        assert_eq!((g.plan.elements, g.plan.collective.root), (5, 3));
        assert_eq!(g.plan.collective.op, ReduceOp::Max);
        let big = plan(&[(1 << 33) + 5, 1], 1, true).unwrap();
        assert_eq!(big.plan.elements, (1 << 33) + 5);
        // The table and the entries fill the payload exactly; one pack more does not fit.
        let fill = ((64 << 10) - GROUP_HEADER_BYTES) / 4;
        assert_eq!(plan(&[fill - 4, 4], 0, true).unwrap().plan.stage_input, 1);
        match plan(&[fill - 4, 5], 0, true) {
            Err(Error::MessageTooLarge { needed, .. }) => assert_eq!(needed, (64 << 10) + 16),
            other => panic!("{:?}", other.map(|g| g.count)),
        }
        // A group of one stages nothing, nor does a batch read in place.
        assert!(plan(&[fill, 5], 1, true).is_ok());
        assert_eq!(plan(&[fill, 5], 0, false).unwrap().plan.stage_input, 0);
    }
}
