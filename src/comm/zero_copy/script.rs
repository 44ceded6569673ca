//! What the passes of a registered capture ([`crate::Comm::register_inputs_of`]) do with
//! each call's input: the first records it, the second reads it through its registration.

use crate::backend::Backend;
use crate::comm::zero_copy::registry::{InPlace, Registry};

/// What the current pass of `Comm::register_inputs_of` does with an input.
#[derive(Default)]
pub(crate) enum Script {
    /// No registered capture: inputs are placed by the listed registrations only.
    #[default]
    Off,
    /// The first pass: the unregistered inputs (address, bytes), in call order, and how
    /// its calls are planned.
    Record(Vec<(u64, usize)>, Planning),
    /// The second pass: the recorded inputs' registrations, taken in order.
    Follow(Follow),
}

/// How the first pass plans the calls it records.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Planning {
    /// Staged, as they are: the pass runs (a backend without capture).
    Staged,
    /// As if read in place (rank `.0`'s own input at its address, the peers' at 0): the
    /// pass is a capture thrown away unlaunched, so that two-stage is accepted in both.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    InPlace(usize),
}

/// The second pass's script and what it found.
pub(crate) struct Follow {
    steps: Vec<Step>,
    next: usize,
    pub(crate) in_place: usize,
    pub(crate) staged: usize,
}

impl Follow {
    /// The second pass of `steps`, nothing found yet.
    pub(crate) fn new(steps: Vec<Step>) -> Self {
        Follow {
            steps,
            next: 0,
            in_place: 0,
            staged: 0,
        }
    }
}

/// A recorded input and where it is read in place.
pub(crate) struct Step {
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
    pub(crate) id: u64,
    pub(crate) offset: u64,
}

impl Script {
    /// The place of an input of `bytes` bytes at `ptr`, given `listed`, what the listed
    /// registrations say of it.
    pub(crate) fn place<B: Backend>(
        &mut self,
        registry: &Registry<B>,
        ptr: u64,
        bytes: usize,
        listed: Option<InPlace>,
    ) -> Option<InPlace> {
        match self {
            Script::Off => listed,
            Script::Follow(f) if listed.is_some() => {
                f.in_place += 1;
                listed
            }
            _ if listed.is_some() || bytes == 0 => listed,
            Script::Record(inputs, planning) => {
                inputs.push((ptr, bytes));
                match *planning {
                    Planning::Staged => None,
                    Planning::InPlace(rank) => {
                        let mut inputs = [0u64; crate::signal::MAX_GPUS];
                        inputs[rank] = ptr;
                        // Planned as read in place; never launched.
                        let place = Default::default();
                        Some(InPlace { place, inputs })
                    }
                }
            }
            Script::Follow(f) => {
                let step = f.steps.get(f.next);
                let step = step.filter(|s| s.ptr == ptr && s.bytes == bytes);
                let place = step.and_then(|s| registry.place_in(s.id, s.offset));
                if place.is_some() {
                    f.next += 1;
                    f.in_place += 1;
                } else {
                    f.staged += 1;
                }
                place
            }
        }
    }
}
