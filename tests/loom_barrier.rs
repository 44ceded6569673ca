//! A loom model check of the counter barrier: the very function the host backend runs
//! (`peercomm::protocol::barrier`), instantiated over loom's atomics instead of the
//! signal memory.
//!
//! Ranks are loom threads (2 and 3 ranks, and 4 with pair subgroups); each runs 1 or 2 blocks (a thread per block
//! where loom's thread limit allows, else a loop over the blocks); each block passes 3
//! consecutive barriers that alternate between the whole-world domain and the subgroup
//! domain on the same signal memory, with counters starting just below `u32::MAX` so
//! every run crosses the wrap. Loom explores the interleavings (and the values relaxed
//! loads may return) and fails on a deadlock or livelock (a spin that never ends), on
//! a data race, or on a failed assertion. Checked after each publishing barrier `k`:
//! every member of the group wrote its "phase j" value (for every `j <= k`) before its
//! own barrier `k`, so this block must see all of them: every peer has arrived at
//! barrier `k`, and data published before a release barrier is seen after it.
//!
//! Bounds: 2 ranks x 1 block is explored exhaustively (no preemption or spin bound).
//! The larger shapes are bounded so that CI (2 cores) finishes in well under a minute:
//! a preemption bound (loom's `LOOM_MAX_PREEMPTIONS` overrides it) and a spin bound
//! (see [`Spin`]; `PEERCOMM_LOOM_SPIN_BOUND` overrides it).
//!
//! Negative checks: the same barrier over a single-banked counter layout, over counter
//! banks shared between domains, with relaxed instead of release stores and with
//! relaxed instead of acquire loads must each be caught.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test --release --test loom_barrier`.

#![cfg(loom)]

use std::convert::Infallible;
use std::sync::atomic::Ordering;

use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU32;
use loom::sync::Arc;
use peercomm::barrier_domain;
use peercomm::protocol::{barrier, Backoff, BarrierSignals, BarrierSite, CounterCell};

/// Counters start here, so the three barriers of a domain cross `u32::MAX -> 0`.
const COUNTER_BASE: u32 = u32::MAX - 1;

/// A loom atomic as a counter cell (a newtype: both the trait and loom's type are
/// foreign to this crate). The variant rides along so that broken orderings can be
/// modelled.
struct Cell(AtomicU32, Variant);

impl CounterCell for Cell {
    fn load(&self, order: Ordering) -> u32 {
        match self.1 {
            Variant::RelaxedLoads => self.0.load(Ordering::Relaxed),
            _ => self.0.load(order),
        }
    }
    fn store(&self, value: u32, order: Ordering) {
        match self.1 {
            Variant::RelaxedStores => self.0.store(value, Ordering::Relaxed),
            _ => self.0.store(value, order),
        }
    }
}

/// The barrier as built (correct), or deliberately broken for the negative checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// As `include/peercomm_signal.h`: per domain, double-banked by parity.
    Correct,
    /// Broken: one bank for both parities.
    SingleBank,
    /// Broken: every domain shares domain 0's counters.
    SharedDomains,
    /// Broken: publishing barriers store with `Relaxed` instead of `Release`.
    RelaxedStores,
    /// Broken: the wait loads with `Relaxed` instead of `Acquire`.
    RelaxedLoads,
}

/// Which group a barrier spans.
#[derive(Clone, Copy, Debug)]
enum Span {
    /// The whole world (barrier domain 0).
    World,
    /// Groups of this width (`width < world`, dividing it).
    Groups(usize),
}

/// The model's shape.
#[derive(Clone, Copy, Debug)]
struct Scenario {
    ranks: usize,
    blocks: usize,
    /// One loom thread per (rank, block) instead of one per rank.
    thread_per_block: bool,
    /// The consecutive barriers every block passes: span and whether it publishes.
    steps: [(Span, bool); 3],
    variant: Variant,
    /// Loom's preemption bound (`None`: unbounded); `LOOM_MAX_PREEMPTIONS` overrides it.
    preemption_bound: Option<usize>,
    /// Failed loads per barrier call after which the execution stops branching
    /// (`None`: unbounded); `PEERCOMM_LOOM_SPIN_BOUND` overrides it.
    spin_bound: Option<u32>,
}

impl Scenario {
    fn width(&self, span: Span) -> usize {
        match span {
            Span::World => self.ranks,
            Span::Groups(w) => w,
        }
    }
    /// The counter-bank slots the model allocates: one per domain the steps use.
    fn domains(&self) -> Vec<usize> {
        let mut ds: Vec<usize> = self
            .steps
            .iter()
            .map(|&(span, _)| barrier_domain(self.width(span), self.ranks))
            .collect();
        ds.sort_unstable();
        ds.dedup();
        ds
    }
}

/// One rank's signal, cut down to the domains, blocks and ranks the model uses.
struct ModelSignal {
    /// `[domain slot][block][peer]`.
    self_counter: Vec<Cell>,
    /// `[domain slot][parity][block][writer]`.
    peer_counter: Vec<Cell>,
}

/// Everything the model's threads share.
struct World {
    scenario: Scenario,
    domains: Vec<usize>,
    signals: Vec<ModelSignal>,
    /// `[rank][step][block]`: written by that rank's block before that barrier.
    data: Vec<UnsafeCell<u32>>,
}

impl World {
    fn new(scenario: Scenario) -> Self {
        let domains = scenario.domains();
        let (n, b, r) = (domains.len(), scenario.blocks, scenario.ranks);
        let cells = |count: usize| -> Vec<Cell> {
            (0..count)
                .map(|_| Cell(AtomicU32::new(COUNTER_BASE), scenario.variant))
                .collect()
        };
        let signals = (0..r)
            .map(|_| ModelSignal {
                self_counter: cells(n * b * r),
                peer_counter: cells(n * 2 * b * r),
            })
            .collect();
        let data = (0..r * 3 * b).map(|_| UnsafeCell::new(0)).collect();
        World {
            scenario,
            domains,
            signals,
            data,
        }
    }

    fn slot(&self, domain: usize) -> usize {
        let domain = match self.scenario.variant {
            Variant::SharedDomains => self.domains[0],
            _ => domain,
        };
        self.domains
            .iter()
            .position(|&d| d == domain)
            .unwrap_or_else(|| panic!("domain {domain} is not modelled"))
    }

    fn data(&self, rank: usize, step: usize, block: usize) -> &UnsafeCell<u32> {
        &self.data[(rank * 3 + step) * self.scenario.blocks + block]
    }
}

/// The value rank `rank`'s block `block` writes before barrier `step` (never 0).
fn tag(rank: usize, step: usize, block: usize) -> u32 {
    1 + (rank * 100 + step * 10 + block) as u32
}

/// One group's signals as group rank `m` reaches them: `base + m` in the world.
struct Group<'a> {
    world: &'a World,
    base: usize,
}

impl BarrierSignals for Group<'_> {
    type Cell = Cell;
    fn self_counter(&self, member: usize, domain: usize, block: usize, peer: usize) -> &Cell {
        let w = self.world;
        let (b, r) = (w.scenario.blocks, w.scenario.ranks);
        &w.signals[self.base + member].self_counter[(w.slot(domain) * b + block) * r + peer]
    }
    fn peer_counter(
        &self,
        member: usize,
        domain: usize,
        parity: usize,
        block: usize,
        writer: usize,
    ) -> &Cell {
        let w = self.world;
        let (b, r) = (w.scenario.blocks, w.scenario.ranks);
        let parity = match w.scenario.variant {
            Variant::SingleBank => 0,
            _ => parity,
        };
        &w.signals[self.base + member].peer_counter
            [((w.slot(domain) * 2 + parity) * b + block) * r + writer]
    }
}

/// Loom's spin: yield, so the model schedules the others and terminates.
///
/// Choosing the next thread after a yield costs no preemption, so with two or more
/// spinners loom can alternate between them forever (an infinite schedule in which the
/// thread they wait for never runs). With a spin bound `n`, after `n` failed loads in
/// one barrier call the execution stops branching (`loom::skip_branch`) and finishes on
/// loom's default schedule, which runs the least-yielded thread, so the awaited peer
/// makes progress. A wait that can never end (a broken barrier) still spins forever
/// there and fails the model on loom's branch limit. Like the preemption bound, this
/// bounds the check: executions that branch after a long wait are not explored.
struct Spin {
    failed: u32,
    bound: Option<u32>,
}

impl Backoff for Spin {
    type Timeout = Infallible;
    fn wait(&mut self) -> Result<(), Infallible> {
        self.failed += 1;
        if Some(self.failed) == self.bound {
            loom::skip_branch();
        }
        loom::hint::spin_loop();
        Ok(())
    }
}

/// Rank `rank` runs `blocks` through the scenario's steps.
fn run_rank(world: &World, rank: usize, blocks: &[usize]) {
    let s = world.scenario;
    for (step, &(span, publish)) in s.steps.iter().enumerate() {
        let width = s.width(span);
        let base = rank / width * width;
        let group = Group { world, base };
        let domain = barrier_domain(width, s.ranks);
        for &block in blocks {
            // SAFETY (loom-checked): each cell is written once, by its owner, before
            // that owner's barrier `step`; readers only read it after a publishing
            // barrier of a later or the same step.
            world
                .data(rank, step, block)
                .with_mut(|p| unsafe { *p = tag(rank, step, block) });
            let site = BarrierSite {
                me: rank - base,
                width,
                domain,
                block,
            };
            barrier(
                &group,
                site,
                publish,
                &mut Spin {
                    failed: 0,
                    bound: s.spin_bound,
                },
            )
            .unwrap_or_else(|never| match never {});
            if publish {
                for peer in base..base + width {
                    for earlier in 0..=step {
                        let got = world.data(peer, earlier, block).with(|p| unsafe { *p });
                        assert_eq!(
                            got,
                            tag(peer, earlier, block),
                            "rank {rank} block {block} after barrier {step}: \
                             rank {peer}'s phase-{earlier} value not visible"
                        );
                    }
                }
            }
        }
    }
}

/// Runs the scenario under loom.
fn check(mut scenario: Scenario) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = scenario.preemption_bound;
    }
    if let Some(n) = std::env::var("PEERCOMM_LOOM_SPIN_BOUND")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        scenario.spin_bound = Some(n);
    }
    let units: Vec<(usize, Vec<usize>)> = (0..scenario.ranks)
        .flat_map(|r| {
            if scenario.thread_per_block {
                (0..scenario.blocks)
                    .map(|b| (r, vec![b]))
                    .collect::<Vec<_>>()
            } else {
                vec![(r, (0..scenario.blocks).collect())]
            }
        })
        .collect();
    assert!(
        units.len() <= loom::MAX_THREADS,
        "{scenario:?}: too many threads"
    );
    let started = std::time::Instant::now();
    let executions = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = executions.clone();
    builder.check(move || {
        counted.fetch_add(1, Ordering::Relaxed);
        let world = Arc::new(World::new(scenario));
        let handles: Vec<_> = units[1..]
            .iter()
            .cloned()
            .map(|(rank, blocks)| {
                let world = world.clone();
                loom::thread::spawn(move || run_rank(&world, rank, &blocks))
            })
            .collect();
        // The first unit runs on the model's main thread (one thread fewer to model).
        run_rank(&world, units[0].0, &units[0].1);
        for h in handles {
            h.join().unwrap();
        }
    });
    eprintln!(
        "{scenario:?} (preemption bound {:?}): {} executions in {:.1?}",
        builder.preemption_bound,
        executions.load(Ordering::Relaxed),
        started.elapsed()
    );
}

/// World, subgroup, world: a start barrier that only orders arrival, then two
/// publishing ones (the pattern of the one-stage and two-stage kernels).
fn steps_start_then_publish(sub: usize) -> [(Span, bool); 3] {
    [
        (Span::World, false),
        (Span::Groups(sub), true),
        (Span::World, true),
    ]
}

/// Subgroup, world, subgroup, every barrier publishing.
fn steps_all_publish(sub: usize) -> [(Span, bool); 3] {
    [
        (Span::Groups(sub), true),
        (Span::World, true),
        (Span::Groups(sub), true),
    ]
}

/// A correct scenario, exhaustive (no bounds).
fn scenario(ranks: usize, blocks: usize, steps: [(Span, bool); 3]) -> Scenario {
    Scenario {
        ranks,
        blocks,
        thread_per_block: ranks * blocks < loom::MAX_THREADS,
        steps,
        variant: Variant::Correct,
        preemption_bound: None,
        spin_bound: None,
    }
}

/// The same, bounded.
fn bounded(
    ranks: usize,
    blocks: usize,
    steps: [(Span, bool); 3],
    preemptions: usize,
    spins: u32,
) -> Scenario {
    Scenario {
        preemption_bound: Some(preemptions),
        spin_bound: Some(spins),
        ..scenario(ranks, blocks, steps)
    }
}

/// Exhaustive: every interleaving and every value the loads may return.
#[test]
fn two_ranks_one_block() {
    check(scenario(2, 1, steps_start_then_publish(1)));
    check(scenario(2, 1, steps_all_publish(1)));
}

#[test]
fn two_ranks_two_blocks() {
    check(bounded(2, 2, steps_start_then_publish(1), 2, 2));
}

#[test]
fn three_ranks_one_block() {
    check(bounded(3, 1, steps_start_then_publish(1), 2, 2));
    check(bounded(3, 1, steps_all_publish(1), 2, 2));
}

/// Each rank's thread loops over its two blocks (six threads exceed loom's limit).
#[test]
fn three_ranks_two_blocks() {
    check(bounded(3, 2, steps_all_publish(1), 2, 2));
    // Two world barriers cost far more states: no preemptions (loom still explores
    // every non-preemptive schedule and every value the loads may return).
    check(bounded(3, 2, steps_start_then_publish(1), 0, 2));
}

/// Negative check: with one bank for both parities, a fast rank's next-generation
/// store overwrites the value a slow rank still waits for, and loom finds the hang.
#[test]
#[should_panic(expected = "maximum number of branches")]
fn single_banked_counters_are_caught() {
    check(Scenario {
        variant: Variant::SingleBank,
        ..scenario(2, 1, [(Span::World, true); 3])
    });
}

/// Negative check: subgroup and world barriers on shared counters (the bug the
/// domains exist for) hang.
#[test]
#[should_panic(expected = "maximum number of branches")]
fn shared_domains_are_caught() {
    check(Scenario {
        variant: Variant::SharedDomains,
        ..scenario(2, 1, steps_start_then_publish(1))
    });
}

/// Negative check: a publishing barrier that stores relaxed publishes nothing.
#[test]
#[should_panic(expected = "Causality violation")]
fn relaxed_publishing_stores_are_caught() {
    check(Scenario {
        variant: Variant::RelaxedStores,
        ..scenario(2, 1, steps_start_then_publish(1))
    });
}

/// Negative check: a wait that loads relaxed acquires nothing.
#[test]
#[should_panic(expected = "Causality violation")]
fn relaxed_waits_are_caught() {
    check(Scenario {
        variant: Variant::RelaxedLoads,
        ..scenario(2, 1, steps_start_then_publish(1))
    });
}

/// Beyond the brief's shapes: subgroups of two ranks (sibling groups {0,1} and {2,3},
/// barrier domain 2) interleaved with the world. Four threads cost far more states:
/// no preemptions.
#[test]
fn four_ranks_pair_subgroups() {
    check(bounded(4, 1, steps_start_then_publish(2), 0, 2));
    check(bounded(4, 1, steps_all_publish(2), 0, 2));
}

/// Negative check: pairs and world on shared counters (a barrier returns before its
/// peers arrived: loom reports the unsynchronised read of their data, or the hang).
#[test]
#[should_panic]
fn shared_domains_are_caught_with_pairs() {
    check(Scenario {
        variant: Variant::SharedDomains,
        ..bounded(4, 1, steps_start_then_publish(2), 0, 2)
    });
}
