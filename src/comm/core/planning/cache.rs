//! The all-reduce plans of one rank's last few call shapes: a decode step repeats a few
//! shapes thousands of times, and a plan depends only on the shape and the fixed
//! settings. Only plans that succeeded are kept (an error is planned again).

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::comm::AllReduceOptions;
use crate::dtype::DType;

use crate::comm::core::planning::{PeerReads, Plan};

/// Shapes kept: a transformer layer all-reduces one or two shapes per step.
const SLOTS: usize = 4;

/// What an all-reduce's plan depends on, besides the rank's fixed state.
#[derive(Clone, Copy, PartialEq)]
pub(crate) struct Shape {
    pub(crate) dtype: DType,
    pub(crate) elements: usize,
    pub(crate) options: AllReduceOptions,
    pub(crate) in_place: bool,
    pub(crate) reads: PeerReads,
}

/// Up to [`SLOTS`] (shape, plan) pairs, the oldest replaced first.
#[derive(Default)]
pub(crate) struct PlanCache {
    slots: Mutex<VecDeque<(Shape, Plan)>>,
}

impl PlanCache {
    /// The plan kept for `shape`, if any; never waits (the caller plans instead).
    pub(crate) fn get(&self, shape: &Shape) -> Option<Plan> {
        let slots = self.slots.try_lock().ok()?;
        slots
            .iter()
            .find(|(s, _)| s == shape)
            .map(|&(_, plan)| plan)
    }

    /// Keeps `plan` for `shape` (skipped where another thread holds the cache).
    pub(crate) fn put(&self, shape: Shape, plan: Plan) {
        let Ok(mut slots) = self.slots.try_lock() else {
            return;
        };
        if !slots.iter().any(|(s, _)| *s == shape) {
            if slots.len() == SLOTS {
                slots.pop_front();
            }
            slots.push_back((shape, plan));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::core::settings::Settings;
    use crate::comm::CommConfig;
    use crate::dispatch::Algorithm;

    fn shape(elements: usize, algorithm: Algorithm) -> Shape {
        Shape {
            dtype: DType::BF16,
            elements,
            options: AllReduceOptions::new().algorithm(algorithm),
            in_place: false,
            reads: PeerReads::Payloads,
        }
    }

    /// A kept plan serves exactly its shape; another shape, or one evicted, plans again.
    #[test]
    fn keeps_the_plans_of_the_last_shapes_only() {
        let settings = Settings::new(CommConfig::default(), "sm_90".into(), 8, 2).unwrap();
        let plan = |s: &Shape| {
            settings
                .plan(s.dtype, s.elements, &s.options, s.in_place, s.reads)
                .unwrap()
        };
        let cache = PlanCache::default();
        let a = shape(4096, Algorithm::Auto);
        assert!(cache.get(&a).is_none());
        cache.put(a, plan(&a));
        let kept = cache.get(&a).expect("kept");
        assert_eq!(kept.elements, 4096);
        assert_eq!(kept.algorithm, plan(&a).algorithm);
        assert!(cache.get(&shape(4097, Algorithm::Auto)).is_none());
        assert!(cache.get(&shape(4096, Algorithm::OneStage)).is_none());
        for n in 1..=SLOTS {
            let s = shape(4096 + 16 * n, Algorithm::Auto);
            cache.put(s, plan(&s));
        }
        assert!(cache.get(&a).is_none(), "the oldest shape is replaced");
        let last = shape(4096 + 16 * SLOTS, Algorithm::Auto);
        assert_eq!(cache.get(&last).unwrap().elements, last.elements);
    }
}
