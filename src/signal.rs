//! The signal layout (bindgen's mirror of `include/peercomm_signal.h`, committed as
//! `src/signal_bindings.rs`) and the protocol's small pure functions.

#[allow(non_camel_case_types, non_upper_case_globals, dead_code, missing_docs)]
mod bindings {
    include!("signal_bindings.rs");
}

pub(crate) use bindings::peercomm_device_comm as DeviceCommArgs;
pub(crate) use bindings::peercomm_dtype as RawDType;
pub use bindings::{
    peercomm_allreduce_args as AllReduceArgs, peercomm_exchange_args as ExchangeArgs,
    peercomm_exchange_peer as ExchangePeer, peercomm_group_args as GroupArgs,
    peercomm_group_entry as GroupEntry, peercomm_signal as Signal,
};
pub(crate) use bindings::{
    PEERCOMM_KIND_USER as KIND_USER, PEERCOMM_LAMPORT_SENTINEL_STANDIN as LAMPORT_SENTINEL_STANDIN,
    PEERCOMM_USER_DOMAIN as USER_DOMAIN,
};

use std::ops::Range;

use crate::dtype::{DType, ReduceOp};

impl DType {
    /// The element type's code in the kernels' argument block (`peercomm_dtype`).
    #[allow(dead_code)]
    pub(crate) fn raw(self) -> RawDType {
        match self {
            DType::F32 => RawDType::PEERCOMM_DTYPE_F32,
            DType::F16 => RawDType::PEERCOMM_DTYPE_F16,
            DType::BF16 => RawDType::PEERCOMM_DTYPE_BF16,
            DType::F64 => RawDType::PEERCOMM_DTYPE_F64,
            DType::I8 => RawDType::PEERCOMM_DTYPE_I8,
            DType::U8 => RawDType::PEERCOMM_DTYPE_U8,
            DType::I32 => RawDType::PEERCOMM_DTYPE_I32,
            DType::U32 => RawDType::PEERCOMM_DTYPE_U32,
            DType::I64 => RawDType::PEERCOMM_DTYPE_I64,
            DType::U64 => RawDType::PEERCOMM_DTYPE_U64,
        }
    }
}

// A descriptor holds the dtype in 4 bits (word 2, bits 5-8).
const _: () = assert!(RawDType::PEERCOMM_DTYPE_U64 as u32 <= 0xf);

impl ReduceOp {
    /// The operator's code in a call descriptor (`PEERCOMM_OP_*`).
    pub(crate) fn raw(self) -> u32 {
        match self {
            ReduceOp::Sum => bindings::PEERCOMM_OP_SUM,
            ReduceOp::Prod => bindings::PEERCOMM_OP_PROD,
            ReduceOp::Max => bindings::PEERCOMM_OP_MAX,
            ReduceOp::Min => bindings::PEERCOMM_OP_MIN,
            ReduceOp::Avg => bindings::PEERCOMM_OP_AVG,
        }
    }

    /// The operator of code `raw`, if any.
    pub(crate) fn from_raw(raw: u32) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| o.raw() == raw)
    }

    /// The operator a call descriptor names (its kernels read it alike; an unknown
    /// code, which no descriptor holds, sums).
    pub(crate) fn of_call(call: &[u32; CALL_WORDS]) -> ReduceOp {
        ReduceOp::from_raw((call[2] >> CALL_OP_SHIFT) & 7).unwrap_or_default()
    }
}

/// A reduce's kind in the descriptor, as the kernels read it.
pub(crate) const KIND_REDUCE: u32 = bindings::PEERCOMM_KIND_REDUCE;

/// Where a call descriptor's word 2 holds the reduction operator.
pub(crate) const CALL_OP_SHIFT: u32 = bindings::PEERCOMM_CALL_OP_SHIFT;

/// Most GPUs one communicator spans.
pub const MAX_GPUS: usize = bindings::PEERCOMM_MAX_GPUS as usize;
/// Most thread blocks one collective launches per GPU (the counter banks are sized for it).
pub const MAX_NUM_BLOCKS_UPPER_BOUND: usize =
    bindings::PEERCOMM_MAX_NUM_BLOCKS_UPPER_BOUND as usize;
/// Counter banks: one per group width, so barriers of different widths share none.
pub const NUM_BARRIER_DOMAINS: usize = bindings::PEERCOMM_NUM_BARRIER_DOMAINS as usize;
/// Generations of the Lamport region: one being written, one being read, one being cleared.
pub const LAMPORT_GENERATIONS: usize = bindings::PEERCOMM_LAMPORT_GENERATIONS as usize;
/// Alignment of the Lamport region and of the payload inside a signal allocation.
pub const REGION_ALIGN: usize = bindings::PEERCOMM_REGION_ALIGN as usize;
/// Most all-reduces one batched all-reduce kernel runs ([`GroupArgs::entries`]).
pub const MAX_GROUP_CALLS: usize = bindings::PEERCOMM_MAX_GROUP_CALLS as usize;
/// Bytes of one vector pack: the unit of the main loops and of the Lamport readiness test.
pub const PACK_BYTES: usize = 16;
/// `stage_input` of a kernel staging the whole message (less: a chunk's packs or rows).
pub const STAGE_WHOLE: u32 = bindings::PEERCOMM_STAGE_WHOLE;
/// Bytes of a batch's entry table (count, entries' lengths) at the start of each payload.
pub const GROUP_HEADER_BYTES: usize = bindings::PEERCOMM_GROUP_HEADER_BYTES as usize;
const _: () = assert!(
    GROUP_HEADER_BYTES == PACK_BYTES + 8 * MAX_GROUP_CALLS
        && GROUP_HEADER_BYTES.is_multiple_of(PACK_BYTES)
);

/// Index of the generation flag in `Signal::lamport_state`.
pub const LAMPORT_FLAG: usize = bindings::PEERCOMM_LAMPORT_FLAG as usize;
/// Index of the previous call's packs per slot in `Signal::lamport_state`.
pub const LAMPORT_PREV_PACKS: usize = bindings::PEERCOMM_LAMPORT_PREV_PACKS as usize;
/// Index of the block arrival counter in `Signal::lamport_state`.
pub const LAMPORT_ARRIVALS: usize = bindings::PEERCOMM_LAMPORT_ARRIVALS as usize;
/// Index of the previous call's group width in `Signal::lamport_state`.
pub const LAMPORT_PREV_WIDTH: usize = bindings::PEERCOMM_LAMPORT_PREV_WIDTH as usize;

/// Index of the error code in `Signal::error_state`.
pub const ERROR_CODE: usize = bindings::PEERCOMM_ERROR_CODE as usize;
/// Index of the rank that timed out in `Signal::error_state`.
pub const ERROR_RANK: usize = bindings::PEERCOMM_ERROR_RANK as usize;
/// Index of the block that timed out in `Signal::error_state`.
pub const ERROR_BLOCK: usize = bindings::PEERCOMM_ERROR_BLOCK as usize;
/// Index of the barrier domain that timed out in `Signal::error_state`.
pub const ERROR_DOMAIN: usize = bindings::PEERCOMM_ERROR_DOMAIN as usize;
/// Error code a barrier writes when it gives up waiting.
pub const ERROR_BARRIER_TIMEOUT: u32 = bindings::PEERCOMM_ERROR_BARRIER_TIMEOUT;
/// Error code a rank that gave up writes into its group peers' records.
pub const ERROR_PEER_ABORTED: u32 = bindings::PEERCOMM_ERROR_PEER_ABORTED;
/// Error code of a rank that found a peer making another call (its descriptor differs).
pub const ERROR_CALL_MISMATCH: u32 = bindings::PEERCOMM_ERROR_CALL_MISMATCH;
/// Code word value while the rest of an error record is being written.
pub const ERROR_WRITING: u32 = bindings::PEERCOMM_ERROR_WRITING;
/// Words of a call descriptor.
pub const CALL_WORDS: usize = bindings::PEERCOMM_CALL_WORDS as usize;
/// 16-byte packs of one barrier arrival (each: the counter, three descriptor words).
#[cfg_attr(not(feature = "unstable"), allow(dead_code))]
pub const CALL_PACKS: usize = bindings::PEERCOMM_CALL_PACKS as usize;
/// Packs at the end of every Lamport slot that hold the writer's descriptor.
pub const LAMPORT_HEADER_PACKS: usize = bindings::PEERCOMM_LAMPORT_HEADER_PACKS as usize;
/// Bytes of a Lamport slot's header (its last [`LAMPORT_HEADER_PACKS`] packs).
pub const LAMPORT_HEADER_BYTES: usize = LAMPORT_HEADER_PACKS * PACK_BYTES;
/// Index of the writer's descriptor in `Signal::error_detail`.
pub const DETAIL_MINE: usize = bindings::PEERCOMM_DETAIL_MINE as usize;
/// Index of the awaited world rank plus one in `Signal::error_detail`.
pub const DETAIL_AWAITED: usize = bindings::PEERCOMM_DETAIL_AWAITED as usize;
/// Index of the awaited rank's descriptor in `Signal::error_detail`.
pub const DETAIL_THEIRS: usize = bindings::PEERCOMM_DETAIL_THEIRS as usize;
/// Index of the flag saying the awaited rank's descriptor was read.
pub const DETAIL_THEIRS_VALID: usize = bindings::PEERCOMM_DETAIL_THEIRS_VALID as usize;
/// Words of `Signal::error_detail`.
pub const DETAIL_WORDS: usize = bindings::PEERCOMM_DETAIL_WORDS as usize;

/// The barrier domain (counter bank) of groups of `width` ranks in a world of `world`:
/// 0 for the whole world, else the width, so two different widths never share a bank.
pub const fn barrier_domain(width: usize, world: usize) -> usize {
    if width == world {
        0
    } else {
        width
    }
}

/// The 32-bit words of a batch's entry table (see [`GROUP_HEADER_BYTES`]): the count,
/// three zeros, then each entry's element count (low, high half).
pub(crate) fn group_header_words(
    count: u32,
    elements: impl Fn(usize) -> u64,
) -> [u32; GROUP_HEADER_BYTES / 4] {
    let mut w = [0u32; GROUP_HEADER_BYTES / 4];
    w[0] = count;
    for s in 0..(count as usize).min(MAX_GROUP_CALLS) {
        let n = elements(s);
        w[4 + 2 * s] = n as u32;
        w[5 + 2 * s] = (n >> 32) as u32;
    }
    w
}

/// The descriptor an error record shows for one side of a batch whose entry tables
/// differ: `call` with the root field (word 2 bits 12-14: the count less one) set to
/// `count - 1` and the element count (words 3-4) to `elements`.
pub(crate) fn group_shown_call(
    call: [u32; CALL_WORDS],
    count: u32,
    elements: u64,
) -> [u32; CALL_WORDS] {
    let mut c = call;
    c[2] = (c[2] & !(7 << 12)) | (count.wrapping_sub(1) & 7) << 12;
    c[3] = elements as u32 & 0x7fff_ffff;
    c[4] = (elements >> 31) as u32 & 0x7fff_ffff;
    c
}

/// `(a + b) mod n` without overflow for any `a, b < n`; `n` must not be 0.
pub const fn circular_add(a: usize, b: usize, n: usize) -> usize {
    debug_assert!(n > 0);
    if n.is_power_of_two() {
        a.wrapping_add(b) & (n - 1)
    } else {
        let a = a % n;
        let b = b % n;
        // a + b < 2n may still overflow usize when n > usize::MAX / 2: subtract first.
        if a >= n - b {
            a - (n - b)
        } else {
            a + b
        }
    }
}

/// The elements of an `n`-element reduce-scatter input that group rank `rank` of
/// `width` receives: part `rank` of `width` consecutive parts, the first `n % width`
/// one element longer (a part may be empty).
///
/// ```
/// assert_eq!(peercomm::reduce_scatter_part(10, 4, 1), 3..6);
/// assert_eq!(peercomm::reduce_scatter_part(10, 4, 3), 8..10);
/// assert_eq!(peercomm::reduce_scatter_part(2, 4, 3), 2..2);
/// ```
pub fn reduce_scatter_part(n: usize, width: usize, rank: usize) -> Range<usize> {
    assert!(
        width > 0 && rank < width,
        "rank {rank} outside a group of {width}"
    );
    let (base, rem) = (n / width, n % width);
    let first = rank * base + rank.min(rem);
    first..first + base + usize::from(rank < rem)
}

/// Byte sizes and offsets of one rank's signal allocation:
/// `[Signal][Lamport region][payload]`. The Lamport region holds
/// `LAMPORT_GENERATIONS x lamport_slots` slots of `lamport_slot_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SignalLayout {
    /// Bytes of one Lamport slot (one source rank, one generation); a multiple of 16.
    pub lamport_slot_bytes: usize,
    /// Slots per Lamport generation: the world size (1..=`MAX_GPUS`).
    pub lamport_slots: usize,
    /// Bytes of the payload (scratch of the staged and two-stage kernels).
    pub payload_bytes: usize,
}

impl SignalLayout {
    /// Checks the sizes: slots in `1..=MAX_GPUS`, the slot a multiple of 16 bytes below
    /// 4 GiB (a u32 in the kernels), the whole within `isize::MAX` bytes.
    pub fn validate(&self) -> crate::Result<()> {
        if self.lamport_slots == 0 || self.lamport_slots > MAX_GPUS {
            return Err(crate::Error::InvalidConfig(format!(
                "lamport_slots must be in 1..={MAX_GPUS} (the world size), not {}",
                self.lamport_slots
            )));
        }
        if !self.lamport_slot_bytes.is_multiple_of(PACK_BYTES)
            || self.lamport_slot_bytes > u32::MAX as usize
        {
            return Err(crate::Error::InvalidConfig(format!(
                "lamport_slot_bytes must be a multiple of {PACK_BYTES} below 4 GiB, not {}",
                self.lamport_slot_bytes
            )));
        }
        self.checked_total_bytes().map(|_| ())
    }
    /// Offset of the Lamport region from the start of the allocation.
    pub const fn lamport_offset(&self) -> usize {
        align_up(std::mem::size_of::<Signal>(), REGION_ALIGN)
    }
    /// Bytes of the whole Lamport region (all generations, all slots). Only meaningful
    /// for a layout that passed [`SignalLayout::validate`].
    pub const fn lamport_region_bytes(&self) -> usize {
        LAMPORT_GENERATIONS * self.lamport_slots * self.lamport_slot_bytes
    }
    /// Offset of the payload from the start of the allocation. Only meaningful for a
    /// layout that passed [`SignalLayout::validate`].
    pub const fn payload_offset(&self) -> usize {
        let end = self.lamport_offset() + self.lamport_region_bytes();
        align_up(end, REGION_ALIGN)
    }
    /// Bytes of the whole allocation, or a typed error when the sizes overflow.
    pub fn checked_total_bytes(&self) -> crate::Result<usize> {
        let too_large = || {
            crate::Error::InvalidConfig(format!(
                "a signal allocation with lamport_slot_bytes {} and payload_bytes {} does \
                 not fit in the address space",
                self.lamport_slot_bytes, self.payload_bytes
            ))
        };
        let region = LAMPORT_GENERATIONS
            .checked_mul(self.lamport_slots)
            .and_then(|x| x.checked_mul(self.lamport_slot_bytes))
            .ok_or_else(too_large)?;
        // With room for both alignments, so the unchecked sums below cannot wrap.
        self.lamport_offset()
            .checked_add(region)
            .and_then(|x| x.checked_add(REGION_ALIGN))
            .and_then(|x| x.checked_add(self.payload_bytes))
            .and_then(|x| x.checked_add(REGION_ALIGN))
            .filter(|&x| x <= isize::MAX as usize)
            .ok_or_else(too_large)?;
        Ok(align_up(
            self.payload_offset() + self.payload_bytes,
            REGION_ALIGN,
        ))
    }
}

/// Rounds `x` up to a multiple of `align` (a power of two).
pub const fn align_up(x: usize, align: usize) -> usize {
    (x + align - 1) & !(align - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Asserts the offset of every named field of `$t`.
    macro_rules! offsets {
        ($t:ty; $($f:ident $o:expr),* $(,)?) => {
            $(assert_eq!(offset_of!($t, $f), $o, stringify!($f));)*
        };
    }

    #[test]
    fn signal_layout_is_pinned() {
        let (d, b, g) = (NUM_BARRIER_DOMAINS, MAX_NUM_BLOCKS_UPPER_BOUND, MAX_GPUS);
        assert_eq!((g, b, d), (8, 1024, 8));
        // Arrivals of 4 packs of 16 bytes: counter and three descriptor words each.
        assert_eq!((CALL_WORDS, CALL_PACKS, LAMPORT_HEADER_PACKS), (12, 4, 4));
        offsets! { Signal;
            self_counter 0, peer_counter d * b * g * 4, peer_counter 262_144,
            lamport_state 262_144 + d * 2 * b * g * 16 * CALL_PACKS, lamport_state 8_650_752,
            error_state 8_650_768, error_detail 8_650_784, current_call 8_650_896,
            quit 8_650_912, exchange_source 8_650_912 + b * g * 4, exchange_source 8_683_680,
            user_grid 8_683_680 + g * 8, reserved 8_683_680 + g * 8 + 8,
        }
        assert_eq!(offset_of!(Signal, peer_counter) % 16, 0);
        assert_eq!(offset_of!(Signal, current_call) % 16, 0);
        assert_eq!(size_of::<Signal>(), 8_683_776);
        assert_eq!(size_of::<Signal>() % REGION_ALIGN, 0);
    }

    #[test]
    fn allreduce_args_layout_is_pinned() {
        offsets! { AllReduceArgs;
            inputs 0, payloads 64, signals 128, local_input 192, output 200,
            num_elements 208, timeout_ns 216, lamport_slot_bytes 224, group_rank 228,
            group_width 232, domain 236, world_rank 240, stage_input 244, root 248,
            hidden 252, residual 256, weight 264, epsilon 272, call 276,
        }
        assert_eq!(size_of::<AllReduceArgs>(), 328);
    }

    #[test]
    fn group_args_layout_is_pinned() {
        assert_eq!(MAX_GROUP_CALLS, 8);
        offsets! { GroupEntry; input 0, output 8, elements 16, offset 24 }
        assert_eq!(size_of::<GroupEntry>(), 32);
        // The all-reduce arguments first, unchanged, so a kernel reads them in place.
        offsets! { GroupArgs; all 0, count 328, pad 332, entries 336, peer_inputs 336 + 8 * 32 }
        assert_eq!(size_of::<GroupArgs>(), 336 + 8 * 32 + 8 * 8 * 8); // 1104
        assert_eq!(std::mem::align_of::<GroupArgs>(), 8);
    }

    #[test]
    fn exchange_args_layout_is_pinned() {
        offsets! { ExchangePeer; send 0, send_bytes 8, recv 16, recv_bytes 24, blocks 32, call 36, pad 84,
        send_remote 88 }
        assert_eq!(size_of::<ExchangePeer>(), 96);
        offsets! { ExchangeArgs; all 0, peers 328 }
        assert_eq!(size_of::<ExchangeArgs>(), 328 + 8 * 96); // 1096
        assert_eq!(std::mem::align_of::<ExchangeArgs>(), 8);
    }

    #[test]
    fn region_offsets() {
        for slots in [0, 2, 8, MAX_GPUS + 1] {
            let l = SignalLayout {
                lamport_slot_bytes: 4096,
                lamport_slots: slots,
                payload_bytes: 1000,
            };
            if slots == 0 || slots > MAX_GPUS {
                assert!(l.validate().is_err(), "{slots} slots");
                continue;
            }
            assert_eq!(l.lamport_offset(), 8_683_776);
            assert_eq!(l.lamport_region_bytes(), 3 * slots * 4096);
            assert_eq!(l.payload_offset(), 8_683_776 + 3 * slots * 4096);
            assert_eq!(l.checked_total_bytes().unwrap(), l.payload_offset() + 1024);
        }
    }

    #[test]
    fn barrier_domains_are_disjoint_per_width() {
        for world in 1..=MAX_GPUS {
            let mut seen = std::collections::HashMap::new();
            for width in (1..=world).filter(|w| world % w == 0) {
                let d = barrier_domain(width, world);
                assert!(d < NUM_BARRIER_DOMAINS);
                assert_ne!(d, USER_DOMAIN as usize, "user kernels' bank, world {world}");
                let shared = seen.insert(d, width);
                assert!(
                    shared.is_none(),
                    "world {world}: width {width} shares bank {d}"
                );
            }
            assert_eq!(barrier_domain(world, world), 0);
        }
    }

    #[test]
    fn circular_add_matches_modular_arithmetic_exhaustively() {
        for n in 1..=64usize {
            for a in 0..n {
                for b in 0..n {
                    assert_eq!(circular_add(a, b, n), (a + b) % n, "a={a} b={b} n={n}");
                }
            }
        }
        // Near the top of usize, where a naive a + b would overflow.
        let n = usize::MAX - 2;
        assert_eq!(circular_add(n - 1, n - 1, n), n - 2);
        let n = 1usize << (usize::BITS - 1);
        assert_eq!(circular_add(n - 1, n - 1, n), n - 2);
    }
}
