//! The batched all-reduce kernel ([`KernelKind::AllReduceGroup`]) on the host side:
//! planning a batch and launching it on one rank. The group calls of both front doors
//! (`Comm::group`, `SingleController::group`) batch through it.
//!
//! # A batch
//! 1 to [`MAX_GROUP_CALLS`] all-reduces (sum) of one dtype over groups of one width run
//! as one kernel with one start and one end barrier. Entry s sits in every member's
//! payload at byte offset `offset_s`: entry 0 after the entry table (at
//! [`GROUP_HEADER_BYTES`], 80), each next one after the previous entry's elements rounded
//! up to whole 16-byte packs (the offsets also hand the packs out to the blocks). Where
//! the peers reach only each other's signals (the per-rank `Comm`), or where an entry's
//! output is its input, a group wider than one stages through the payload, so the table
//! and the padded entries together must fit `payload_bytes` ([`Error::MessageTooLarge`]
//! naming it otherwise, nothing launched). The single controller's batches of
//! out-of-place entries read every member's input in place instead
//! (`peercomm_group_args::peer_inputs`, its Start and End barriers as unstaged
//! one-stage's): no copy, no system-scope release and no table, since its host has
//! compared every rank's entries already. A group of one copies each input to its
//! output directly. A zero-length entry is allowed
//! and writes nothing; a batch whose entries are all empty launches nothing (and, like an
//! empty all-reduce, is not counted in the call sequence). Every entry's bits are those
//! of a one-stage (staged) all-reduce of that entry alone. The grid follows the entries
//! (the batch's packs, as the one-stage planner sizes one message's; a batch has no
//! `blocks` option).
//!
//! # The batch's call descriptor
//! One descriptor for the whole batch, built as [`crate::comm::core::call::encode`] builds any
//! call's, from the first entry plus the count:
//! - kind `AllReduceGroup`, the dtype, the group width, the blocks and the per-domain
//!   sequence number as for any call (the batch is one call in its barrier domain);
//! - the root field (3 bits, unused by an all-reduce) holds `count - 1`, so a rank that
//!   batches another number of calls is a [`Error::CallMismatch`] with
//!   `field: CallField::Root` (`"root 1"` against `"root 4"` for 2 against 5 entries);
//! - the element field holds entry 0's element count (exact, as any call's),
//!   so a different length in entry 0 is a `CallField::Length` mismatch showing entry 0's
//!   counts (`"300 elements"` against `"301 elements"`).
//!
//! The descriptor has no room for the later entries' lengths; the kernel compares them
//! exactly (next section). Those descriptor words travel and are compared as every
//! call's do (barrier arrivals, `current_call`, the error record), so a mismatch is a
//! typed error on every rank, nothing written. A batch against another collective is
//! `CallField::Collective` ("group of all-reduces" against, say, "all-reduce").
//!
//! # The entry tables: every length, exactly
//! In a staged group wider than one, every rank writes its entry table at the start of its own
//! payload while it stages (`PEERCOMM_GROUP_HEADER_BYTES` = 80 bytes, 32-bit words: word
//! 0 the count, words 1-3 zero, words 4 + 2s and 5 + 2s the low and high halves of entry
//! s's element count, 0 past the count; every block writes the same words). The Publish
//! barrier orders it before the peers read it, as it orders the staged data; after that
//! barrier every block compares every group peer's table with its own, the count and all
//! 8 lengths, before it stores anything.
//!
//! On any difference every rank finds one on its side (were each rank's table equal to
//! all of its peers', all would be equal), so every block of every rank records
//! [`Error::CallMismatch`] and abandons as on a barrier mismatch, skipping the reduce
//! and the End barrier: it tells its peers' same-index blocks it is done with their
//! payloads and waits (at most the barrier timeout; with none, not at all, as every
//! abandon) until each has said the same, which each does as soon as it has compared
//! the tables. So no rank's kernel ends, and no next call reuses its payload, while a
//! peer still reads its table, and no output is written. (Passing the End barrier
//! instead would not do: the record is the rank's abort word, which every wait polls.)
//!
//! The record names the first peer whose table differs (on a device, the first one
//! found) and shows, on each side, the batch's descriptor with that side's count in the
//! root field and the element count of the first entry whose lengths differ:
//! `field: CallField::Length` with `mine` / `theirs` `"999 elements"` against `"1000
//! elements"` for entry 2 of `[300, 7, 999, 0, 8]` against `[300, 7, 1000, 0, 8]`,
//! exactly. Counts cannot differ there (the root
//! field holds them exactly); were they to, the root would be named.
//!
//! A later entry's difference that also changes the grid (the grid follows the batch's
//! total packs) already differs in the descriptor's block count, and the Publish barrier
//! finds it. Between two batches that can only come from their lengths (`max_blocks` and
//! `threads_per_block` are agreed at setup; the count, width and dtype are compared
//! first), so [`crate::comm::core::call::first_difference`] names it `CallField::Length` too,
//! showing `"entries sized for 1 block"` against `"entries sized for 2 blocks"`.
//!
//! The single controller also compares every entry exactly on the host before
//! launching ([`Error::LengthMismatch`]); a group of one has no peer to compare with.

use crate::backend::{Backend, Kernel, KernelKind, LaunchDims};
use crate::dispatch::{self, Algorithm};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::signal::{
    barrier_domain, AllReduceArgs, GroupArgs, GroupEntry, GROUP_HEADER_BYTES, MAX_GROUP_CALLS,
    PACK_BYTES,
};

use crate::comm::core::call;
use crate::comm::core::launch::PeerInputs;
use crate::comm::core::planning::{CollectiveArgs, Plan};
use crate::comm::core::settings::Settings;
use crate::comm::core::{Endpoint, Rank};

/// A planned batch: the launch plan (what the descriptor is built from) and each
/// entry's element count and payload offset.
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
    /// Plans a batch of all-reduces of `dtype` with these element counts over groups of
    /// `group_size` (0 = the world): payload offsets after the entry table, the scratch
    /// check, the grid (from the batch's packs, as the one-stage planner sizes one
    /// message's, capped alike) and the plan the descriptor is built from.
    pub(crate) fn group_plan(
        &self,
        dtype: DType,
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
        let width = self.group_width(group_size)?;
        let kind = KernelKind::AllReduceGroup;
        let mut offsets = [0u64; MAX_GROUP_CALLS];
        let too_large = || Error::MessageTooLarge {
            algorithm: kind.name(),
            needed: usize::MAX,
            available: self.layout.payload_bytes,
            setting: "payload_bytes",
        };
        // The entries' packs, after the entry table's.
        let header_packs = GROUP_HEADER_BYTES / PACK_BYTES;
        let mut packs = header_packs;
        for (s, &n) in lengths.iter().enumerate() {
            offsets[s] = packs
                .checked_mul(PACK_BYTES)
                .and_then(|b| u64::try_from(b).ok())
                .ok_or_else(too_large)?;
            packs = packs
                .checked_add(n.div_ceil(dtype.lanes()))
                .ok_or_else(too_large)?;
        }
        let needed = packs.checked_mul(PACK_BYTES).ok_or_else(too_large)?;
        // A staged group wider than one stages the table and every entry into the
        // payload; in place, or a group of one, needs no scratch.
        let staged = stage && width > 1;
        if staged && needed > self.layout.payload_bytes {
            return Err(Error::MessageTooLarge {
                algorithm: kind.name(),
                needed,
                available: self.layout.payload_bytes,
                setting: "payload_bytes",
            });
        }
        // As one-stage: each of the entries' packs comes from width - 1 peers. From the
        // entries alone, so two batches' grids differ only where their lengths do.
        let blocks = dispatch::blocks_for(
            (packs - header_packs).saturating_mul((width - 1).max(1)),
            self.config.threads_per_block,
            self.max_blocks,
        );
        let mut lens = [0u64; MAX_GROUP_CALLS];
        for (l, &n) in lens.iter_mut().zip(lengths) {
            *l = n as u64;
        }
        Ok(GroupPlan {
            plan: Plan {
                kernel: Kernel { kind, dtype },
                algorithm: Algorithm::OneStage,
                width,
                elements: lengths[0],
                stage_input: staged,
                dims: LaunchDims {
                    blocks,
                    threads: self.config.threads_per_block,
                },
                overlap_previous: false,
                input_place: Default::default(),
                collective: CollectiveArgs {
                    root: (count - 1) as u32,
                    ..CollectiveArgs::default()
                },
            },
            count,
            lengths: lens,
            offsets,
            total_elements: lengths.iter().sum(),
        })
    }
}

impl<B: Backend> Rank<B> {
    /// Plans a batch of all-reduces on this rank (see [`Settings::group_plan`]).
    pub(crate) fn plan_group(
        &self,
        dtype: DType,
        lengths: &[usize],
        group_size: usize,
        stage: bool,
    ) -> Result<GroupPlan> {
        self.settings.group_plan(dtype, lengths, group_size, stage)
    }

    /// Enqueues this rank's batched all-reduce of `group` (see
    /// [`Endpoint::launch_group`]).
    pub(crate) fn launch_group(
        &self,
        group: &GroupPlan,
        io: &[(PeerInputs<'_>, u64)],
    ) -> Result<()> {
        self.endpoint.launch_group(&self.settings, group, io)
    }
}

impl<B: Backend> Endpoint<B> {
    /// Enqueues this rank's batched all-reduce of `group`: entry s reads `io[s].0` (this
    /// rank's input, or every world rank's where the batch reads in place) and writes
    /// `io[s].1` (this rank's output). Counts the call in its barrier domain and honours
    /// fault injection exactly as [`Rank::launch_fused`] does.
    pub(crate) fn launch_group(
        &self,
        settings: &Settings,
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
        let in_place = plan.width > 1 && !plan.stage_input;
        if in_place && io.iter().any(|(i, _)| matches!(i, PeerInputs::Own(_))) {
            return Err(Error::Unsupported(
                "a batch read in place needs every member's input".into(),
            ));
        }
        let r = self.index;
        let width = plan.width;
        let domain = barrier_domain(width, settings.world);
        let seq = self.next_call(domain);
        if self.take_missing() {
            // Fault injection: counted as made, launched nowhere.
            return Ok(());
        }
        let base = r / width * width;
        let layout = &settings.layout;
        let payload_off = layout.payload_offset() as u64;
        let mut all = AllReduceArgs {
            num_elements: group.total_elements as u64,
            timeout_ns: settings.timeout_ns(),
            lamport_slot_bytes: layout.lamport_slot_bytes as u32,
            group_rank: (r - base) as u32,
            group_width: width as u32,
            domain: domain as u32,
            world_rank: r as u32,
            stage_input: plan.stage_input as u32,
            call: call::encode(plan, seq),
            ..Default::default()
        };
        for k in 0..width {
            let signal = self.peer_signals[base + k];
            all.signals[k] = signal;
            all.payloads[k] = signal + payload_off;
            all.inputs[k] = if plan.stage_input {
                signal + payload_off
            } else {
                0
            };
        }
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
        B::launch_group(&self.device, plan.kernel, plan.dims, &args)
    }
}

/// One all-reduce of a group call (see `Comm::group`), as every rank issues it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GroupedCall {
    pub(crate) dtype: DType,
    pub(crate) elements: usize,
    pub(crate) options: crate::comm::AllReduceOptions,
    pub(crate) in_place: bool,
}

/// How a group's calls are launched, in their order.
pub(crate) enum GroupStep {
    /// Calls `first .. first + plan.count` in one batched kernel.
    Batch { first: usize, plan: GroupPlan },
    /// Call `index` alone, as routed and planned.
    Alone {
        index: usize,
        routed: crate::comm::core::planning::check::Routed,
    },
}

/// Runs a group's steps in order with `run`, which launches one step and returns the
/// algorithm of a call run alone (`Some((index, algorithm))`; a batch's entries run
/// one-stage). The first failure stops the group; where an earlier step was launched
/// already, `poison` is called with it first: those launches wait for peers whose calls
/// never come. The one step loop of both front doors' group guards.
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
    /// Splits a group's calls into launches: consecutive all-reduces that peer memory
    /// serves, of one dtype and one group width, with the algorithm and grid left to
    /// peercomm (`Auto` or `OneStage`, no `blocks`, no overlap), run as one batched
    /// kernel of up to [`MAX_GROUP_CALLS`] (whose entry table and staged inputs fit the
    /// payload, where it stages); every other call runs alone, as it would outside a
    /// group. A batch reads the inputs in place where `reads` allows and no entry is
    /// in place. Every rank decides the same, from the calls alone (the same on every
    /// rank, or the descriptors differ).
    pub(crate) fn plan_grouped(
        &self,
        calls: &[GroupedCall],
        reads: crate::comm::core::planning::PeerReads,
    ) -> Result<Vec<GroupStep>> {
        let batchable = |c: &GroupedCall| {
            matches!(c.options.algorithm, Algorithm::Auto | Algorithm::OneStage)
                && c.options.blocks.is_none()
                && !c.options.overlap_previous
        };
        let local_width = |c: &GroupedCall| -> Result<Option<usize>> {
            Ok(match self.route.path(c.dtype, c.elements, &c.options)? {
                crate::comm::core::routing::Path::Peer(local) => Some(local.group_size),
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
                let mut stage =
                    reads == crate::comm::core::planning::PeerReads::Payloads || c.in_place;
                let mut plan = None;
                for next in &calls[i + 1..] {
                    if lengths.len() == MAX_GROUP_CALLS
                        || next.dtype != c.dtype
                        || !batchable(next)
                        || local_width(next)? != Some(group_size)
                    {
                        break;
                    }
                    lengths.push(next.elements);
                    let stage_with = stage || next.in_place;
                    match self.plan_group(c.dtype, &lengths, group_size, stage_with) {
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
        let config = CommConfig {
            payload_bytes,
            max_blocks: Some(2),
            ..CommConfig::default()
        };
        Settings::new(config, "sm_90".into(), 8, world).unwrap()
    }

    /// The entries follow the entry table, and the table counts in the payload bound of
    /// a staged batch; the descriptor holds entry 0's exact length and the count.
    #[test]
    fn entries_follow_the_table_and_fit_with_it() {
        let s = settings(64 << 10, 2);
        let g = s.group_plan(DType::F32, &[5, 0, 8, 1], 0, true).unwrap();
        assert_eq!(GROUP_HEADER_BYTES, 80);
        assert_eq!(&g.offsets[..4], &[80, 112, 112, 144]);
        assert_eq!(g.plan.elements, 5);
        assert_eq!(g.plan.collective.root, 3);
        let big = s
            .group_plan(DType::F32, &[(1 << 33) + 5, 1], 1, true)
            .unwrap();
        assert_eq!(big.plan.elements, (1 << 33) + 5);
        // The table and the entries fill the payload exactly; one pack more does not fit.
        let fill = ((64 << 10) - GROUP_HEADER_BYTES) / 4;
        assert!(s.group_plan(DType::F32, &[fill - 4, 4], 0, true).is_ok());
        match s.group_plan(DType::F32, &[fill - 4, 5], 0, true) {
            Err(Error::MessageTooLarge { needed, .. }) => assert_eq!(needed, (64 << 10) + 16),
            other => panic!("{:?}", other.map(|g| g.count)),
        }
        // A group of one stages nothing, nor does a batch read in place.
        assert!(s.group_plan(DType::F32, &[fill, 5], 1, true).is_ok());
        let in_place = s.group_plan(DType::F32, &[fill, 5], 0, false).unwrap();
        assert!(!in_place.plan.stage_input);
        assert!(
            s.group_plan(DType::F32, &[fill - 4, 4], 0, true)
                .unwrap()
                .plan
                .stage_input
        );
    }
}
