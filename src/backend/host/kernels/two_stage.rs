//! The two-stage all-reduce on the host: a reduce-scatter of one partition per rank
//! into the own payload, then an all-gather of every partition from its payload.

use super::packs::{block_packs, lanes, pack_range, reduce_element, store};
use super::signals::barrier;
use super::wait::Stop;
use crate::dtype::Element;
use crate::protocol::BarrierKind;
use crate::signal::AllReduceArgs;

/// Packs per partition of the two-stage kernel.
pub(crate) fn two_stage_partition(packs: usize, width: usize) -> usize {
    packs.div_ceil(width)
}

pub(super) unsafe fn two_stage<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let l = lanes::<T>();
    let packs = n.div_ceil(l);
    let width = args.group_width as usize;
    let me = args.group_rank as usize;
    let part = two_stage_partition(packs, width);
    barrier(args, block, BarrierKind::Start)?;
    // Reduce-scatter: this rank reduces partition `me` into its own payload.
    let srcs = &args.inputs[..width];
    let first = me * part;
    for p in block_packs(first, (first + part).min(packs), block, blocks) {
        for e in pack_range::<T>(p, n) {
            store::<T>(
                args.payloads[me],
                e - first * l,
                reduce_element::<T>(srcs, e),
            );
        }
    }
    barrier(args, block, BarrierKind::Publish)?;
    // All-gather: block b reads what block b of rank q wrote (the per-block barrier
    // suffices), each rank from its own partition on, so readers spread over owners.
    for i in 0..width {
        let q = (me + i) % width;
        let first = q * part;
        for p in block_packs(first, (first + part).min(packs), block, blocks) {
            for e in pack_range::<T>(p, n) {
                let x = (args.payloads[q] as *const T)
                    .add(e - first * l)
                    .read_unaligned();
                (args.output as *mut T).add(e).write_unaligned(x);
            }
        }
    }
    barrier(args, block, BarrierKind::End)
}
