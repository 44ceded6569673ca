//! The one-stage all-reduce on the host: each rank sums every element of the group's
//! `inputs` in group-rank order; with `stage_input`, each block first copies its packs
//! of the own input into the own payload, which the peers read after the Publish barrier.

use super::packs::{copy_packs, reduce_packs};
use super::signals::{barrier, first_barrier};
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
    let staged = args.stage_input != 0;
    if staged {
        let own = args.payloads[args.group_rank as usize];
        copy_packs::<T>(args.local_input, own, n, block, blocks);
    }
    first_barrier(args, block, staged)?;
    let srcs = &args.inputs[..args.group_width as usize];
    reduce_packs::<T>(srcs, args.output, n, block, blocks);
    barrier(args, block, BarrierKind::End)
}
