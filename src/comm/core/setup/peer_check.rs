//! The peer-access check at setup: links have reported P2P and returned garbage, so every
//! rank all-reduces a known pattern one-stage (peer reads) and Lamport (peer writes) and
//! compares each element with the exact sum. A wrong value or a timeout fails the check
//! (fallback, or [`crate::Error::PeerCheckFailed`]); with `barrier_timeout: None` a link
//! that loses writes could wait forever.

use crate::backend::Backend;
use crate::dispatch::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};

use crate::comm::core::launch::{Endpoint, Fused, PeerInputs};
use crate::comm::core::planning::PeerReads;
use crate::comm::core::settings::Settings;
use crate::comm::AllReduceOptions;

/// Elements of the check: a vector loop and a scalar tail.
const ELEMENTS: usize = 1027;

/// Rank `r`'s value at `i`: distinct per rank and position, exact in f32, and so is any
/// sum of up to `MAX_GPUS` of them.
fn pattern(r: usize, i: usize) -> f32 {
    ((r + 1) * 4096 + (i * 7919) % 4093) as f32
}

/// Compares a result with the exact sums; `corrupt` flips a bit of what was read first
/// (the test-only simulation of a bad link).
fn verdict(algorithm: Algorithm, mut got: Vec<f32>, width: usize, corrupt: bool) -> Option<String> {
    if corrupt {
        got[0] = f32::from_bits(got[0].to_bits() ^ 1);
    }
    got.iter().enumerate().find_map(|(i, &g)| {
        let want: f32 = (0..width).map(|r| pattern(r, i)).sum();
        (g.to_bits() != want.to_bits()).then(|| {
            format!(
                "{}: element {i} came back as {g} where the exact sum is {want}",
                algorithm.name()
            )
        })
    })
}

/// Runs the check on one rank (the whole group at once; inputs staged). `Ok(Some(why))`
/// when it failed; `Err` for failures not about the peers.
pub(crate) fn check_rank<B: Backend>(
    rank: &Endpoint<B>,
    settings: &Settings,
    corrupt: bool,
) -> Result<Option<String>> {
    let width = settings.world;
    if width == 1 {
        return Ok(None);
    }
    let me = rank.index;
    let dev = &rank.device;
    let mine: Vec<f32> = (0..ELEMENTS).map(|i| pattern(me, i)).collect();
    let mut send = B::alloc_buffer::<f32>(dev, ELEMENTS)?;
    B::upload(dev, &mine, &mut send)?;
    let mut failure = None;
    for (k, algorithm) in [Algorithm::OneStage, Algorithm::Lamport]
        .into_iter()
        .enumerate()
    {
        let opts = AllReduceOptions::new().algorithm(algorithm);
        let plan = match settings.plan(DType::F32, ELEMENTS, &opts, false, PeerReads::Payloads) {
            Ok(p) => p,
            // A Lamport slot too small for the check: the same on every rank.
            Err(Error::MessageTooLarge { .. }) => continue,
            Err(e) => return Err(e),
        };
        let mut recv = B::alloc_buffer::<f32>(dev, ELEMENTS)?;
        B::upload(dev, &[f32::NAN; ELEMENTS], &mut recv)?;
        let (input, in_guard) = crate::backend::DeviceBuffer::read_ptr(&send, dev);
        let (output, out_guard) = crate::backend::DeviceBufferMut::write_ptr(&mut recv, dev);
        let inputs = PeerInputs::Own(input);
        let launched = rank.launch(settings, &plan, inputs, output, Fused::default());
        drop((in_guard, out_guard));
        launched?;
        B::synchronize(dev)?;
        if let Some(e) = rank.read_error()? {
            return Ok(Some(format!("{}: {e}", algorithm.name())));
        }
        let got = B::download(dev, &recv)?;
        // A wrong value does not end the check early: the peers run every step, and a
        // rank that skipped one would make them wait out the barrier timeout.
        if let Some(why) = verdict(algorithm, got, width, corrupt && k == 0) {
            failure.get_or_insert(why);
        }
    }
    Ok(failure)
}
