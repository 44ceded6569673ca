//! The batched all-reduce kernel ([`KernelKind::AllReduceGroup`]) on the host side:
//! planning a batch, launching it on one rank, and two TEMPORARY test entry points
//! (`Communicator::all_reduce_sum_batch_for_tests`, `Comm::all_reduce_sum_batch_for_tests`)
//! that the real group API (NCCL-style `group_start` / `group_end` batching) will
//! replace. Kept in this one file while `src/comm/` is being restructured.
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

use std::sync::atomic::Ordering;

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut, Kernel, KernelKind, LaunchDims};
use crate::dispatch::{self, Algorithm};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::signal::{
    barrier_domain, AllReduceArgs, GroupArgs, GroupEntry, MAX_GROUP_CALLS,
    MAX_NUM_BLOCKS_UPPER_BOUND, PACK_BYTES,
};

use super::call;
use super::collective::CollectiveArgs;
use super::plan::Plan;
use super::settings::Settings;
use super::validate::Meta;
use super::{Comm, Communicator, Rank};

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
        let seq = self.group_call_number(domain);
        if self.group_call_left_out() {
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

    /// The call's sequence number in barrier `domain`: `Rank::next_call` (private to
    /// `launch.rs`), the same count and the same fault injection.
    fn group_call_number(&self, domain: usize) -> u32 {
        let seq = self.calls[domain].fetch_add(1, Ordering::Relaxed);
        if self.skew_next.load(Ordering::Relaxed) && self.skew_next.swap(false, Ordering::AcqRel) {
            return seq.wrapping_add(1);
        }
        seq
    }

    /// Whether fault injection leaves this launch out: `Rank::take_missing`.
    fn group_call_left_out(&self) -> bool {
        self.missing.load(Ordering::Relaxed) && self.missing.swap(false, Ordering::AcqRel)
    }
}

fn meta<B: Backend>(b: &(impl DeviceBuffer<B> + ?Sized)) -> Meta {
    Meta {
        dtype: b.dtype(),
        len: b.len(),
        ordinal: b.device_ordinal(),
    }
}

impl<B: Backend> Communicator<B> {
    /// TEMPORARY (replaced by the group API): sums a batch of all-reduces in one kernel
    /// per rank ([`KernelKind::AllReduceGroup`], see `src/comm/group_kernel.rs`).
    /// `inputs[s][r]` / `outputs[s][r]` are entry s's buffers of rank r: per entry one
    /// length on every rank (0 allowed), one dtype for the whole batch, 1..=8 entries.
    /// Every entry is checked on the host before anything runs.
    #[doc(hidden)]
    pub fn all_reduce_sum_batch_for_tests<S, R>(
        &self,
        inputs: &[Vec<S>],
        outputs: &mut [Vec<R>],
        group_size: usize,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        self.check_usable()?;
        if inputs.len() != outputs.len() || inputs.is_empty() {
            return Err(Error::Unsupported(format!(
                "a batch of {} input and {} output entries",
                inputs.len(),
                outputs.len()
            )));
        }
        for (ins, outs) in inputs.iter().zip(outputs.iter()) {
            self.check_count(ins.len())?;
            self.check_count(outs.len())?;
        }
        let dtype = inputs[0][0].dtype();
        for (s, (ins, outs)) in inputs.iter().zip(outputs.iter()).enumerate() {
            let first = ins[0].len();
            for (r, (i, o)) in ins.iter().zip(outs).enumerate() {
                let (im, om) = (meta::<B>(i), meta::<B>(o));
                self.check_tensor(r, &im, &[im.len], "input")?;
                self.check_tensor(r, &om, &[om.len], "output")?;
                for m in [&im, &om] {
                    if m.dtype != dtype {
                        return Err(Error::DTypeMismatch {
                            rank: r,
                            expected: dtype,
                            got: m.dtype,
                        });
                    }
                }
                if im.len != first {
                    return Err(Error::LengthMismatch {
                        rank: r,
                        what: format!(
                            "entry {s}: input has {} elements but rank 0's {first}",
                            im.len
                        ),
                    });
                }
                if om.len != im.len {
                    return Err(Error::LengthMismatch {
                        rank: r,
                        what: format!(
                            "entry {s}: output has {} elements but its input {}",
                            om.len, im.len
                        ),
                    });
                }
            }
        }
        let lengths: Vec<usize> = inputs.iter().map(|e| e[0].len()).collect();
        let group = self
            .settings
            .group_plan(dtype, &lengths, group_size, None)?;
        self.check_peer_group(group.plan.width)?;
        if group.total_elements == 0 {
            return Ok(());
        }
        let world = self.world_size();
        let ranks = &self.ranks;
        let mut guards = Vec::with_capacity(2 * world * group.count);
        let mut io = vec![[(0u64, 0u64); MAX_GROUP_CALLS]; world];
        for (s, ins) in inputs.iter().enumerate() {
            for (r, i) in ins.iter().enumerate() {
                let (p, g) = i.read_ptr(&ranks[r].device);
                io[r][s].0 = p;
                guards.push(g);
            }
        }
        for (s, outs) in outputs.iter_mut().enumerate() {
            for (r, o) in outs.iter_mut().enumerate() {
                let (p, g) = o.write_ptr(&ranks[r].device);
                io[r][s].1 = p;
                guards.push(g);
            }
        }
        let result = {
            let _launches = self.lock_launches();
            self.check_usable().and_then(|_| {
                for (r, rank) in ranks.iter().enumerate() {
                    if let Err(e) = rank.launch_group(&self.settings, &group, &io[r][..group.count])
                    {
                        if r > 0 {
                            // The ranks before wait for peers that will never come.
                            self.poisoned.store(true, Ordering::Release);
                        }
                        return Err(e);
                    }
                }
                Ok(())
            })
        };
        drop(guards);
        result
    }
}

impl<B: Backend> Comm<B> {
    /// TEMPORARY (replaced by the group API): this rank's part of a batch of
    /// all-reduces run as one kernel ([`KernelKind::AllReduceGroup`], see
    /// `src/comm/group_kernel.rs`): entry s sums `sends[s]` over the group into
    /// `recvs[s]`. Every rank of the group passes the same number of entries with the
    /// same lengths (0 allowed), in one dtype; a rank that does not gets
    /// [`Error::CallMismatch`] from [`Comm::synchronize`] on every rank (see the module
    /// docs for what the descriptor covers), nothing written. Peer memory must serve the
    /// whole world (no external routing). Takes no lock: `Comm` is not `Sync`, so no
    /// other thread can launch or re-initialise on this rank meanwhile.
    #[doc(hidden)]
    pub fn all_reduce_sum_batch_for_tests<S, R>(
        &self,
        sends: &[S],
        recvs: &mut [R],
        group_size: usize,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        if self.settings.world != self.world_size() {
            return Err(Error::Unsupported(
                "the batched all-reduce runs where peer memory serves the whole world".into(),
            ));
        }
        if sends.len() != recvs.len() || sends.is_empty() {
            return Err(Error::Unsupported(format!(
                "a batch of {} inputs and {} outputs",
                sends.len(),
                recvs.len()
            )));
        }
        let rank = self.rank();
        let expected = B::ordinal(&self.rank.device);
        let dtype = sends[0].dtype();
        for (s, (i, o)) in sends.iter().zip(recvs.iter()).enumerate() {
            for (m, which) in [(meta::<B>(i), "input"), (meta::<B>(o), "output")] {
                if m.ordinal != expected {
                    return Err(Error::WrongDevice {
                        rank,
                        which,
                        expected,
                        got: m.ordinal,
                    });
                }
                if m.dtype != dtype {
                    return Err(Error::DTypeMismatch {
                        rank,
                        expected: dtype,
                        got: m.dtype,
                    });
                }
            }
            if o.len() != i.len() {
                return Err(Error::LengthMismatch {
                    rank,
                    what: format!(
                        "entry {s}: output has {} elements but its input {}",
                        o.len(),
                        i.len()
                    ),
                });
            }
        }
        let lengths: Vec<usize> = sends.iter().map(|b| b.len()).collect();
        let group = self
            .settings
            .group_plan(dtype, &lengths, group_size, None)?;
        if group.total_elements == 0 {
            return Ok(());
        }
        let dev = &self.rank.device;
        let mut guards = Vec::with_capacity(2 * group.count);
        let mut io = [(0u64, 0u64); MAX_GROUP_CALLS];
        for (s, i) in sends.iter().enumerate() {
            let (p, g) = i.read_ptr(dev);
            io[s].0 = p;
            guards.push(g);
        }
        for (s, o) in recvs.iter_mut().enumerate() {
            let (p, g) = o.write_ptr(dev);
            io[s].1 = p;
            guards.push(g);
        }
        let result = self
            .rank
            .launch_group(&self.settings, &group, &io[..group.count]);
        drop(guards);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CommConfig;

    fn settings(world: usize, payload_bytes: usize) -> Settings {
        let config = CommConfig {
            payload_bytes,
            ..CommConfig::default()
        };
        Settings::new(config, "sm_90".into(), 132, world, false).unwrap()
    }

    #[test]
    fn offsets_are_whole_packs_one_after_another() {
        let s = settings(4, 1 << 20);
        let g = s
            .group_plan(DType::F32, &[5, 0, 1, 8, 4099], 0, None)
            .unwrap();
        assert_eq!(g.count, 5);
        assert_eq!(&g.offsets[..5], &[0, 32, 32, 48, 80]);
        assert_eq!(&g.lengths[..5], &[5, 0, 1, 8, 4099]);
        assert_eq!(g.total_elements, 5 + 1 + 8 + 4099);
        assert!(g.plan.stage_input);
        assert_eq!(g.plan.collective.root, 4);
        let h = s.group_plan(DType::BF16, &[9, 7], 0, None).unwrap();
        assert_eq!(&h.offsets[..2], &[0, 32]);
    }

    #[test]
    fn the_grid_follows_the_batch_like_one_stage() {
        let s = settings(2, 4 << 20);
        // 8 x 4 KiB of f32: 2048 packs, 4 blocks of 512 threads at width 2 (one-stage
        // gives 1 block to each 4 KiB message alone).
        let g = s.group_plan(DType::F32, &[1024; 8], 0, None).unwrap();
        assert_eq!(g.plan.dims.blocks, 4);
        let one = s
            .plan(
                DType::F32,
                8 * 1024,
                &crate::AllReduceOptions::new().algorithm(Algorithm::OneStage),
                false,
            )
            .unwrap();
        assert_eq!(g.plan.dims.blocks, one.dims.blocks);
        let wide = settings(8, 64 << 20);
        let big = wide.group_plan(DType::F32, &[1 << 20; 8], 0, None).unwrap();
        assert_eq!(big.plan.dims.blocks, 132, "capped as the planner caps");
    }

    #[test]
    fn a_batch_larger_than_the_payload_is_refused() {
        let s = settings(2, 4096);
        assert!(s.group_plan(DType::F32, &[512, 512], 0, None).is_ok());
        match s.group_plan(DType::F32, &[512, 513], 0, None) {
            Err(Error::MessageTooLarge {
                needed: 4112,
                available: 4096,
                setting: "payload_bytes",
                ..
            }) => {}
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a batch of 4112 bytes fit 4096"),
        }
        // A group of one copies directly: no payload needed.
        assert!(s.group_plan(DType::F32, &[4096; 8], 1, None).is_ok());
        for count in [0usize, 9] {
            let lengths = vec![1; count];
            assert!(matches!(
                s.group_plan(DType::F32, &lengths, 0, None),
                Err(Error::Unsupported(_))
            ));
        }
    }

    #[test]
    fn the_descriptor_sees_the_count_and_every_length() {
        let s = settings(2, 1 << 20);
        let words = |lengths: &[usize]| {
            let g = s.group_plan(DType::F32, lengths, 0, None).unwrap();
            call::encode(&g.plan, 3)
        };
        let base = words(&[100, 200, 300]);
        assert_eq!(words(&[100]), {
            let g = s.group_plan(DType::F32, &[100], 0, None).unwrap();
            assert_eq!(g.plan.elements, 100, "a batch of one: its length");
            call::encode(&g.plan, 3)
        });
        let field = |other: &[usize]| call::first_difference(base, words(other)).map(|d| d.0);
        use crate::CallField;
        assert_eq!(field(&[100, 200, 300]), None);
        assert_eq!(field(&[101, 200, 300]), Some(CallField::Length));
        assert_eq!(field(&[100, 200]), Some(CallField::Root));
        assert_eq!(field(&[100, 200, 300, 0]), Some(CallField::Root));
        // Later entries through the digest (these differences do not collide).
        assert_eq!(field(&[100, 201, 300]), Some(CallField::Length));
        assert_eq!(field(&[100, 300, 200]), Some(CallField::Length));
        assert_eq!(field(&[100, 200, 4396]), Some(CallField::Length));
        // The digest misses few differences: of 4096 other lengths of the last entry,
        // about 1 in 256 collide.
        let missed = (0..4096)
            .filter(|&n| n != 300 && field(&[100, 200, n]).is_none())
            .count();
        assert!(missed < 4096 / 100, "{missed} collisions");
    }
}
