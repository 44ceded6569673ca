//! The one-stage all-reduce on the host ([`one_stage`]): each rank sums every element
//! of the group's `inputs` in group-rank order (with `stage_input`, each block first
//! copies its packs of the own input into the own payload, which the peers read after
//! the publishing barrier), block b taking the packs b, b + blocks, ... between the
//! first barrier and the end barrier.

use super::packs::{block_packs, lanes, pack_range, reduce_element, store};
use super::signals::barrier;
use super::wait::Stop;
use crate::dtype::Element;
use crate::protocol::BarrierKind;
use crate::signal::AllReduceArgs;

pub(super) unsafe fn one_stage<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let packs = n.div_ceil(lanes::<T>());
    let me = args.group_rank as usize;
    let staged = args.stage_input != 0;
    if staged {
        // Copy this block's share of the own input into the own payload, which the
        // peers read after the (then publishing) start barrier.
        for p in block_packs(0, packs, block, blocks) {
            for e in pack_range::<T>(p, n) {
                (args.payloads[me] as *mut T)
                    .add(e)
                    .write_unaligned((args.local_input as *const T).add(e).read_unaligned());
            }
        }
    }
    let first = if staged {
        BarrierKind::Publish
    } else {
        BarrierKind::Start
    };
    barrier(args, block, first)?;
    let srcs = &args.inputs[..args.group_width as usize];
    for p in block_packs(0, packs, block, blocks) {
        for e in pack_range::<T>(p, n) {
            store::<T>(args.output, e, reduce_element::<T>(srcs, e));
        }
    }
    barrier(args, block, BarrierKind::End)
}
