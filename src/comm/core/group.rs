//! The batched all-reduce kernel ([`KernelKind::AllReduceGroup`]) on the host side:
//! planning a batch and launching it on one rank. The group calls of both front doors
//! (`Comm::group`, `Communicator::group`) batch through it.
//!
//! # A batch
//! 1 to [`MAX_GROUP_CALLS`] all-reduces (sum) of one dtype over groups of one width run
//! as one kernel with one start and one end barrier. Entry s sits in every member's
//! payload at byte offset `offset_s`: entry 0 at 0, each next one after the previous
//! entry's elements rounded up to whole 16-byte packs. A group wider than one always
//! stages through the payload (also in one process), so the padded total must fit
//! `payload_bytes` ([`Error::MessageTooLarge`] naming it otherwise, nothing launched); a
//! group of one copies each input to its output directly. A zero-length entry is allowed
//! and writes nothing; a batch whose entries are all empty launches nothing (and, like an
//! empty all-reduce, is not counted in the call sequence). Every entry's bits are those
//! of a one-stage (staged) all-reduce of that entry alone.
//!
//! # The batch's call descriptor
//! One descriptor for the whole batch, built as [`super::call::encode`] builds any
//! call's, from the first entry plus the count:
//! - kind `AllReduceGroup`, the dtype, the group width, the blocks and the per-domain
//!   sequence number as for any call (the batch is one call in its barrier domain);
//! - the root field (3 bits, unused by an all-reduce) holds `count - 1`, so a rank that
//!   batches another number of calls is a [`Error::CallMismatch`] with
//!   `field: CallField::Root` (`"root 1"` against `"root 4"` for 2 against 5 entries);
//! - the element field holds entry 0's element count, XOR-ed in its top 8 bits (element
//!   count bits 31-38) with an 8-bit digest of the later entries' counts (0 for a batch
//!   of one). A different length in entry 0 is a `CallField::Length` mismatch showing
//!   entry 0's counts (plus the same digest times 2^31 on both sides, when there are
//!   later entries); a different length in a later entry changes the digest, and is a
//!   `CallField::Length` mismatch too, except for the 1 in 256 differences whose digests
//!   collide, which pass unnoticed (each rank then reduces at its own offsets, within
//!   the payloads: wrong sums, no fault). The descriptor has no room for more; the
//!   single controller compares every entry exactly on the host before launching.
//!
//! Those descriptor words travel and are compared as every call's do (barrier arrivals,
//! `current_call`, the error record), so a mismatch is a typed error on every rank,
//! nothing written. `call.rs` does not know the kind yet: a batch against another
//! collective is named `CallField::Collective` with the batch shown as "unknown kernel
//! 11".

use crate::backend::{Backend, Kernel, KernelKind, LaunchDims};
use crate::dispatch::{self, Algorithm};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::signal::{
    barrier_domain, AllReduceArgs, GroupArgs, GroupEntry, MAX_GROUP_CALLS,
    MAX_NUM_BLOCKS_UPPER_BOUND, PACK_BYTES,
};

use super::call;
use super::plan::{CollectiveArgs, Plan};
use super::settings::Settings;
use super::{Endpoint, Rank};

/// A planned batch: the launch plan (what the descriptor is built from) and each
/// entry's element count and payload offset.
pub(crate) struct GroupPlan {
    pub(crate) plan: Plan,
    /// Entries: 1 ..= `MAX_GROUP_CALLS`.
    pub(crate) count: usize,
    pub(crate) lengths: [u64; MAX_GROUP_CALLS],
    /// Byte offsets in the payload (whole packs).
    pub(crate) offsets: [u64; MAX_GROUP_CALLS],
    /// Elements of every entry together (0: nothing to launch).
    pub(crate) total_elements: usize,
}

/// The element field of a batch's descriptor (see the module docs): entry 0's count,
/// its bits 31-38 XOR-ed with an 8-bit digest (FNV-1a) of the later entries' counts.
fn descriptor_elements(lengths: &[usize]) -> usize {
    let first = lengths[0] as u64;
    if lengths.len() == 1 {
        return first as usize;
    }
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for byte in lengths[1..].iter().flat_map(|&n| (n as u64).to_le_bytes()) {
        h = (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    let digest = (h ^ (h >> 8) ^ (h >> 16) ^ (h >> 32)) & 0xff;
    (first ^ (digest << 31)) as usize
}

impl Settings {
    /// Plans a batch of all-reduces of `dtype` with these element counts over groups of
    /// `group_size` (0 = the world): payload offsets, the scratch check, the grid (from
    /// the batch's packs, as the one-stage planner sizes one message's, capped alike),
    /// and the plan the descriptor is built from.
    pub(crate) fn group_plan(
        &self,
        dtype: DType,
        lengths: &[usize],
        group_size: usize,
        blocks: Option<u32>,
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
        let mut packs = 0usize;
        let too_large = || Error::MessageTooLarge {
            algorithm: kind.name(),
            needed: usize::MAX,
            available: self.layout.payload_bytes,
            setting: "payload_bytes",
        };
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
        // A group wider than one stages every entry into the payload; a group of one
        // copies directly.
        let staged = width > 1;
        if staged && needed > self.layout.payload_bytes {
            return Err(Error::MessageTooLarge {
                algorithm: kind.name(),
                needed,
                available: self.layout.payload_bytes,
                setting: "payload_bytes",
            });
        }
        let blocks = match blocks {
            Some(b) if b == 0 || b as usize > MAX_NUM_BLOCKS_UPPER_BOUND => {
                return Err(Error::Unsupported(format!(
                    "blocks must be in 1..={MAX_NUM_BLOCKS_UPPER_BOUND}, not {b}"
                )))
            }
            Some(b) => b,
            // As one-stage: each pack comes from width - 1 peers.
            None => dispatch::blocks_for(
                packs.saturating_mul((width - 1).max(1)),
                self.config.threads_per_block,
                self.max_blocks,
            ),
        };
        let mut lens = [0u64; MAX_GROUP_CALLS];
        for (l, &n) in lens.iter_mut().zip(lengths) {
            *l = n as u64;
        }
        Ok(GroupPlan {
            plan: Plan {
                kernel: Kernel { kind, dtype },
                algorithm: Algorithm::OneStage,
                width,
                elements: descriptor_elements(lengths),
                stage_input: staged,
                dims: LaunchDims {
                    blocks,
                    threads: self.config.threads_per_block,
                },
                overlap_previous: false,
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
        blocks: Option<u32>,
    ) -> Result<GroupPlan> {
        self.settings.group_plan(dtype, lengths, group_size, blocks)
    }

    /// Enqueues this rank's batched all-reduce of `group` (see
    /// [`Endpoint::launch_group`]).
    pub(crate) fn launch_group(&self, group: &GroupPlan, io: &[(u64, u64)]) -> Result<()> {
        self.endpoint.launch_group(&self.settings, group, io)
    }
}

impl<B: Backend> Endpoint<B> {
    /// Enqueues this rank's batched all-reduce of `group`: entry s reads `io[s].0` and
    /// writes `io[s].1` (this rank's buffers). Counts the call in its barrier domain and
    /// honours fault injection exactly as [`Rank::launch_fused`] does.
    pub(crate) fn launch_group(
        &self,
        settings: &Settings,
        group: &GroupPlan,
        io: &[(u64, u64)],
    ) -> Result<()> {
        if io.len() != group.count {
            return Err(Error::Unsupported(format!(
                "{} buffer pairs for a batch of {}",
                io.len(),
                group.count
            )));
        }
        let plan = &group.plan;
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
        for (s, &(input, output)) in io.iter().enumerate() {
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
        routed: super::check::Routed,
    },
}

impl<B: Backend> Rank<B> {
    /// Splits a group's calls into launches: consecutive all-reduces that peer memory
    /// serves, of one dtype and one group width, with the algorithm and grid left to
    /// peercomm (`Auto` or `OneStage`, no `blocks`, no overlap), run as one batched
    /// kernel of up to [`MAX_GROUP_CALLS`] whose staged inputs fit the payload; every
    /// other call runs alone, as it would outside a group. Every rank decides the same,
    /// from the calls alone (the same on every rank, or the descriptors differ).
    pub(crate) fn plan_grouped(
        &self,
        calls: &[GroupedCall],
        reads: super::plan::PeerReads,
    ) -> Result<Vec<GroupStep>> {
        let batchable = |c: &GroupedCall| {
            matches!(c.options.algorithm, Algorithm::Auto | Algorithm::OneStage)
                && c.options.blocks.is_none()
                && !c.options.overlap_previous
        };
        let local_width = |c: &GroupedCall| -> Result<Option<usize>> {
            Ok(match self.route.path(c.dtype, c.elements, &c.options)? {
                super::route::Path::Peer(local) => Some(local.group_size),
                _ => None,
            })
        };
        let mut steps = Vec::new();
        let mut i = 0;
        while i < calls.len() {
            let c = &calls[i];
            if let (true, Some(group_size)) = (batchable(c), local_width(c)?) {
                let mut lengths = vec![c.elements];
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
                    match self.plan_group(c.dtype, &lengths, group_size, None) {
                        Ok(p) => plan = Some(p),
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
