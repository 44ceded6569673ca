//! A loom model check of the host backend's counter barrier
//! (`peercomm::unstable::protocol::barrier`) under the device kernels' orderings, the
//! weakest any backend uses ([`Ordered`]): start barrier relaxed; publishing barrier
//! release stores and acquire spin loads; end barrier relaxed.
//!
//! Ranks are loom threads (2, 3, and 4 with pair subgroups), 1 or 2 blocks each, passing
//! 3 barriers that mix the world and a subgroup domain on one signal memory, counters
//! starting below `u32::MAX` to cross the wrap. Loom fails on deadlock, livelock, a data
//! race or an assertion: after publishing barrier `k` every member's "phase j <= k" write
//! is visible; a peer cell read before an end barrier still holds its old value.
//! 2 ranks x 1 block is exhaustive; larger shapes bound preemptions
//! (`LOOM_MAX_PREEMPTIONS`) and spins ([`Spin`], `PEERCOMM_LOOM_SPIN_BOUND`). Negative
//! checks catch each broken [`Variant`].
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test --release --test loom_barrier`.

#![cfg(loom)]

use std::convert::Infallible;
use std::sync::atomic::Ordering;

use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU32;
use loom::sync::Arc;
use peercomm::unstable::barrier_domain;
use peercomm::unstable::protocol::{
    barrier, Backoff, BarrierKind, BarrierSignals, BarrierSite, CounterCell,
};

/// Counters start here, so the three barriers of a domain cross `u32::MAX -> 0`.
const COUNTER_BASE: u32 = u32::MAX - 1;

/// The kinds of barrier the kernels pass, as const-generic tags of [`Ordered`].
const START: u8 = 0;
const PUBLISH: u8 = 1;
const END: u8 = 2;

/// Which barrier a step is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Orders arrival only (before a kernel reads its peers' inputs).
    Start,
    /// Publishes data written before it (two-stage's middle barrier, the staged
    /// one-stage's start).
    Publish,
    /// Ends a collective: after it, peers may overwrite what this block read before it.
    End,
}

/// A loom atomic as a counter cell (a newtype: both the trait and loom's type are
/// foreign to this crate). The variant rides along so that broken orderings can be
/// modelled.
struct Cell(AtomicU32, Variant);

/// A counter cell as a barrier of kind `K` reaches it: the orderings are the device's
/// for that kind (see the module docs), whatever the function asks for.
#[repr(transparent)]
struct Ordered<const K: u8>(Cell);

impl<const K: u8> Ordered<K> {
    fn from_ref(cell: &Cell) -> &Self {
        // SAFETY: `Ordered<K>` is a `repr(transparent)` wrapper of `Cell`, so the two
        // have the same layout and a `&Cell` is a valid `&Ordered<K>`.
        unsafe { &*(cell as *const Cell as *const Self) }
    }

    /// The ordering a load or store of this kind of barrier uses. `asked` is what
    /// `protocol::barrier` asked for.
    fn order(&self, asked: Ordering, is_store: bool) -> Ordering {
        let variant = self.0 .1;
        match K {
            START => Ordering::Relaxed,
            END if variant == Variant::EndReleaseAcquire => asked_publish(is_store),
            END => Ordering::Relaxed,
            _ => match variant {
                Variant::RelaxedStores if is_store => Ordering::Relaxed,
                Variant::RelaxedLoads if !is_store => Ordering::Relaxed,
                _ => asked,
            },
        }
    }
}

/// The orderings of a publishing barrier: release stores, acquire loads.
fn asked_publish(is_store: bool) -> Ordering {
    if is_store {
        Ordering::Release
    } else {
        Ordering::Acquire
    }
}

impl<const K: u8> CounterCell for Ordered<K> {
    fn load(&self, order: Ordering) -> u32 {
        self.0 .0.load(self.order(order, false))
    }
    fn store(&self, value: u32, order: Ordering) {
        self.0 .0.store(value, self.order(order, true))
    }
}

/// The barrier as built (correct), or deliberately broken for the negative checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// As `include/peercomm_signal.h` and the kernels: per domain, double-banked by
    /// parity, device orderings.
    Correct,
    /// Broken: one bank for both parities.
    SingleBank,
    /// Broken: every domain shares domain 0's counters.
    SharedDomains,
    /// Broken: publishing barriers store with `Relaxed` instead of `Release`.
    RelaxedStores,
    /// Broken: publishing barriers' waits load with `Relaxed` instead of `Acquire`.
    RelaxedLoads,
    /// Broken: the end barrier is left out.
    MissingEndBarrier,
    /// The write-after-read cells are plain memory instead of atomics.
    PlainWarCells,
    /// Plain write-after-read cells behind an end barrier with release stores and
    /// acquire loads (what plain memory needs under the language model).
    EndReleaseAcquire,
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
    /// The consecutive barriers every block passes: span and kind.
    steps: [(Span, Kind); 3],
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
    fn plain_war_cells(&self) -> bool {
        matches!(
            self.variant,
            Variant::PlainWarCells | Variant::EndReleaseAcquire
        )
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
    /// `[rank][step][block]`: read by a peer before end barrier `step`, overwritten by
    /// its owner after it (atomics, relaxed, as device data loads are plain loads the
    /// hardware does not reorder after the barrier's store; see `run_rank`).
    war: Vec<AtomicU32>,
    /// The same cells as plain memory (variants `PlainWarCells`, `EndReleaseAcquire`).
    war_plain: Vec<UnsafeCell<u32>>,
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
        let ends = scenario.steps.iter().any(|&(_, k)| k == Kind::End);
        let war_cells = if ends { r * 3 * b } else { 0 };
        let (war, war_plain) = if scenario.plain_war_cells() {
            (
                Vec::new(),
                (0..war_cells).map(|_| UnsafeCell::new(0)).collect(),
            )
        } else {
            (
                (0..war_cells).map(|_| AtomicU32::new(0)).collect(),
                Vec::new(),
            )
        };
        World {
            scenario,
            domains,
            signals,
            data,
            war,
            war_plain,
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

    fn index(&self, rank: usize, step: usize, block: usize) -> usize {
        (rank * 3 + step) * self.scenario.blocks + block
    }

    fn data(&self, rank: usize, step: usize, block: usize) -> &UnsafeCell<u32> {
        &self.data[self.index(rank, step, block)]
    }

    /// Reads rank `rank`'s write-after-read cell of `step`, `block`.
    fn read_war(&self, rank: usize, step: usize, block: usize) -> u32 {
        let i = self.index(rank, step, block);
        if self.scenario.plain_war_cells() {
            // SAFETY (loom-checked): see `run_rank`; loom reports a race if the end
            // barrier does not order this read before the owner's write.
            self.war_plain[i].with(|p| unsafe { *p })
        } else {
            self.war[i].load(Ordering::Relaxed)
        }
    }

    /// Overwrites rank `rank`'s write-after-read cell of `step`, `block`.
    fn write_war(&self, rank: usize, step: usize, block: usize, value: u32) {
        let i = self.index(rank, step, block);
        if self.scenario.plain_war_cells() {
            // SAFETY (loom-checked): as in `read_war`.
            self.war_plain[i].with_mut(|p| unsafe { *p = value })
        } else {
            self.war[i].store(value, Ordering::Relaxed)
        }
    }
}

/// The value rank `rank`'s block `block` writes before barrier `step` (never 0).
fn tag(rank: usize, step: usize, block: usize) -> u32 {
    1 + (rank * 100 + step * 10 + block) as u32
}

/// One group's signals as group rank `m` reaches them (`base + m` in the world), for a
/// barrier of kind `K`.
struct Group<'a, const K: u8> {
    world: &'a World,
    base: usize,
}

impl<const K: u8> BarrierSignals for Group<'_, K> {
    type Cell = Ordered<K>;
    fn self_counter(&self, member: usize, domain: usize, block: usize, peer: usize) -> &Self::Cell {
        let w = self.world;
        let (b, r) = (w.scenario.blocks, w.scenario.ranks);
        Ordered::from_ref(
            &w.signals[self.base + member].self_counter[(w.slot(domain) * b + block) * r + peer],
        )
    }
    fn peer_counter(
        &self,
        member: usize,
        domain: usize,
        parity: usize,
        block: usize,
        writer: usize,
    ) -> &Self::Cell {
        let w = self.world;
        let (b, r) = (w.scenario.blocks, w.scenario.ranks);
        let parity = match w.scenario.variant {
            Variant::SingleBank => 0,
            _ => parity,
        };
        Ordered::from_ref(
            &w.signals[self.base + member].peer_counter
                [((w.slot(domain) * 2 + parity) * b + block) * r + writer],
        )
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

/// Passes one barrier of kind `K`.
fn pass<const K: u8>(world: &World, base: usize, site: BarrierSite, kind: BarrierKind) {
    let mut spin = Spin {
        failed: 0,
        bound: world.scenario.spin_bound,
    };
    barrier(
        &Group::<K> { world, base },
        site,
        kind.device_orderings(),
        &mut spin,
    )
    .unwrap_or_else(|never| match never {});
}

/// Rank `rank` runs `blocks` through the scenario's steps.
fn run_rank(world: &World, rank: usize, blocks: &[usize]) {
    let s = world.scenario;
    for (step, &(span, kind)) in s.steps.iter().enumerate() {
        let width = s.width(span);
        let base = rank / width * width;
        let me = rank - base;
        let domain = barrier_domain(width, s.ranks);
        for &block in blocks {
            // SAFETY (loom-checked): each cell is written once, by its owner, before
            // that owner's barrier `step`; readers only read it after a publishing
            // barrier of a later or the same step.
            world
                .data(rank, step, block)
                .with_mut(|p| unsafe { *p = tag(rank, step, block) });
            let site = BarrierSite {
                me,
                width,
                domain,
                block,
            };
            match kind {
                Kind::Start => pass::<START>(world, base, site, BarrierKind::Start),
                Kind::Publish => pass::<PUBLISH>(world, base, site, BarrierKind::Publish),
                Kind::End => {
                    // Write after read: this block reads the next member's cell before the
                    // end barrier, every member overwrites its own after it, so the read
                    // must return the old value. Loom does not model load buffering, so
                    // with relaxed end barriers this shows that no member leaves early, not
                    // that the orderings forbid that outcome: devices rely on their
                    // hardware there; plain memory needs release/acquire (variants
                    // `PlainWarCells`, `EndReleaseAcquire`).
                    let peer = base + (me + 1) % width;
                    let seen = world.read_war(peer, step, block);
                    if s.variant != Variant::MissingEndBarrier {
                        let kind = if s.variant == Variant::EndReleaseAcquire {
                            BarrierKind::Publish
                        } else {
                            BarrierKind::End
                        };
                        pass::<END>(world, base, site, kind);
                    }
                    world.write_war(rank, step, block, tag(rank, step, block));
                    assert_eq!(
                        seen, 0,
                        "write-after-read: rank {rank} block {block} read rank {peer}'s value \
                         {seen} before end barrier {step}, written after it"
                    );
                }
            }
            if kind == Kind::Publish {
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

/// A one-stage-like collective on the world around a subgroup publish: world start,
/// subgroup publish, world end.
fn steps_kernel(sub: usize) -> [(Span, Kind); 3] {
    [
        (Span::World, Kind::Start),
        (Span::Groups(sub), Kind::Publish),
        (Span::World, Kind::End),
    ]
}

/// A subgroup collective's end, then a whole-world start and publish (the next
/// collective on the same signal memory).
fn steps_end_then_world(sub: usize) -> [(Span, Kind); 3] {
    [
        (Span::Groups(sub), Kind::End),
        (Span::World, Kind::Start),
        (Span::World, Kind::Publish),
    ]
}

/// Subgroup, world, subgroup, every barrier publishing.
fn steps_all_publish(sub: usize) -> [(Span, Kind); 3] {
    [
        (Span::Groups(sub), Kind::Publish),
        (Span::World, Kind::Publish),
        (Span::Groups(sub), Kind::Publish),
    ]
}

/// The two-stage kernel on the world: start, publish, end.
fn steps_two_stage() -> [(Span, Kind); 3] {
    [
        (Span::World, Kind::Start),
        (Span::World, Kind::Publish),
        (Span::World, Kind::End),
    ]
}

/// A correct scenario, exhaustive (no bounds).
fn scenario(ranks: usize, blocks: usize, steps: [(Span, Kind); 3]) -> Scenario {
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
    steps: [(Span, Kind); 3],
    preemptions: usize,
    spins: u32,
) -> Scenario {
    Scenario {
        preemption_bound: Some(preemptions),
        spin_bound: Some(spins),
        ..scenario(ranks, blocks, steps)
    }
}

/// Runs `scenario` with the barrier's `variant`.
fn broken(variant: Variant, scenario: Scenario) {
    check(Scenario {
        variant,
        ..scenario
    });
}

/// Exhaustive: every interleaving and every value the loads may return.
#[test]
fn two_ranks_one_block() {
    check(scenario(2, 1, steps_kernel(1)));
    check(scenario(2, 1, steps_end_then_world(1)));
    check(scenario(2, 1, steps_all_publish(1)));
    check(scenario(2, 1, steps_two_stage()));
}

#[test]
fn two_ranks_two_blocks() {
    check(bounded(2, 2, steps_kernel(1), 2, 2));
}

#[test]
fn three_ranks_one_block() {
    check(bounded(3, 1, steps_kernel(1), 2, 2));
    check(bounded(3, 1, steps_all_publish(1), 2, 2));
    check(bounded(3, 1, steps_two_stage(), 1, 2));
}

/// Each rank's thread loops over its two blocks (six threads exceed loom's limit).
#[test]
fn three_ranks_two_blocks() {
    check(bounded(3, 2, steps_all_publish(1), 2, 2));
    // Two world barriers cost far more states: no preemptions (loom still explores
    // every non-preemptive schedule and every value the loads may return).
    check(bounded(3, 2, steps_kernel(1), 0, 2));
}

/// Negative check: with one bank for both parities, a fast rank's next-generation
/// store overwrites the value a slow rank still waits for, and loom finds the hang.
#[test]
#[should_panic(expected = "maximum number of branches")]
fn single_banked_counters_are_caught() {
    broken(
        Variant::SingleBank,
        scenario(2, 1, [(Span::World, Kind::Publish); 3]),
    );
}

/// Negative check: subgroup and world barriers on shared counters (the bug the
/// domains exist for) hang.
#[test]
#[should_panic(expected = "maximum number of branches")]
fn shared_domains_are_caught() {
    broken(Variant::SharedDomains, scenario(2, 1, steps_kernel(1)));
}

/// Negative check: a publishing barrier that stores relaxed publishes nothing.
#[test]
#[should_panic(expected = "Causality violation")]
fn relaxed_publishing_stores_are_caught() {
    broken(Variant::RelaxedStores, scenario(2, 1, steps_two_stage()));
}

/// Negative check: a publishing wait that loads relaxed acquires nothing.
#[test]
#[should_panic(expected = "Causality violation")]
fn relaxed_waits_are_caught() {
    broken(Variant::RelaxedLoads, scenario(2, 1, steps_two_stage()));
}

/// Negative check: without the end barrier a peer overwrites what this block is about
/// to read, and the write-after-read check fires.
#[test]
#[should_panic(expected = "write-after-read")]
fn missing_end_barrier_is_caught() {
    broken(Variant::MissingEndBarrier, scenario(2, 1, steps_kernel(1)));
}

/// Negative check (documents the limit of relaxed end barriers): a relaxed end barrier
/// does not order a block's plain read before a peer's later plain write under the
/// language model (no happens-before), so loom reports a race on plain memory. The
/// host backend reads its peers' inputs with plain loads, so its end barrier must
/// release and acquire (next test); the devices rely on their hardware order instead.
#[test]
#[should_panic(expected = "Causality violation")]
fn end_barrier_relaxed_guards_plain_memory_badly() {
    broken(Variant::PlainWarCells, scenario(2, 1, steps_kernel(1)));
}

/// An end barrier with release stores and acquire loads orders plain reads before the
/// peers' later plain writes.
#[test]
fn end_barrier_release_acquire_guards_plain_memory() {
    broken(Variant::EndReleaseAcquire, scenario(2, 1, steps_kernel(1)));
    broken(
        Variant::EndReleaseAcquire,
        bounded(3, 1, steps_two_stage(), 1, 2),
    );
}

/// Beyond the brief's shapes: subgroups of two ranks (sibling groups {0,1} and {2,3},
/// barrier domain 2) interleaved with the world. Four threads cost far more states:
/// no preemptions.
#[test]
fn four_ranks_pair_subgroups() {
    check(bounded(4, 1, steps_kernel(2), 0, 2));
    check(bounded(4, 1, steps_end_then_world(2), 0, 2));
    check(bounded(4, 1, steps_all_publish(2), 0, 2));
}

/// Negative check: pairs and world on shared counters (a barrier returns before its
/// peers arrived: loom reports the unsynchronised read of their data, or the hang).
#[test]
#[should_panic]
fn shared_domains_are_caught_with_pairs() {
    broken(Variant::SharedDomains, bounded(4, 1, steps_kernel(2), 0, 2));
}
