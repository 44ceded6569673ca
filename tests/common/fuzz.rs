//! The schedule fuzzer, generic over the backend: seeded sequences of all-reduces
//! (forced algorithms and `Auto`, every group width, all dtypes, 1 element to a few MiB,
//! -0.0 lanes, in and out of place, block counts, delayed ranks), one call in five
//! another collective ([`COLLECTIVE_PROBABILITY`]), and now and then a rank a call ahead
//! (`mismatch_next`: `CallMismatch` everywhere, nothing written, `reinitialize` recovers).
//! Batches are enqueued with no host synchronisation, then checked
//! ([`super::Call::check`]).
//!
//! Replay with `PEERCOMM_SEED=<seed>`; `PEERCOMM_FUZZ_CALLS` sets the number of calls,
//! `PEERCOMM_FUZZ_TRACE=1` prints each call as it is enqueued.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use peercomm::backend::{Backend, TypedBuffer};
use peercomm::{
    Algorithm, AllReduceOptions, CallField, CollectiveOptions, CommConfig, DType, Element, Error,
    ReduceOp, Result, SingleController,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{group_sizes, random_inputs, sprinkle_zeros, Call, Placement, Prepared, Zeros};

/// Share of the drawn calls that are one of the other collectives (all-gather,
/// reduce-scatter, broadcast, scatter, all-to-all in equal parts or by a count matrix)
/// instead of an all-reduce.
pub const COLLECTIVE_PROBABILITY: f64 = 0.2;

/// Largest forced Lamport message of the fuzzer (its communicators' slot holds it and
/// the 16-byte header).
pub const FUZZ_LAMPORT_SLOT: usize = 1 << 20;
/// Payload of the fuzzer's communicators (in-place one-stage stages the whole message).
pub const FUZZ_PAYLOAD: usize = 4 << 20;

/// The fuzzer's communicator configuration.
pub fn fuzz_config(max_blocks: Option<u32>) -> CommConfig {
    CommConfig::default()
        .with_lamport_slot_bytes(FUZZ_LAMPORT_SLOT + 64)
        .with_payload_bytes(FUZZ_PAYLOAD)
        .with_barrier_timeout(Some(Duration::from_secs(30)))
        .with_max_blocks(max_blocks)
}

/// `PEERCOMM_FUZZ_CALLS` if set, else `default`.
pub fn calls_from_env(default: usize) -> usize {
    std::env::var("PEERCOMM_FUZZ_CALLS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// How the fuzzer draws its calls.
#[derive(Clone, Debug)]
pub struct Knobs {
    /// Calls in all.
    pub calls: usize,
    /// Most calls enqueued between two synchronizes.
    pub max_batch: usize,
    /// Probability of a `delay_rank` before a call.
    pub delay_probability: f64,
    /// Longest delay (drawn uniformly from 0 to this, in whole milliseconds).
    pub max_delay_ms: u64,
    /// Largest message per rank, in bytes.
    pub max_bytes: usize,
    /// Explicit block counts are drawn from `1..=max_explicit_blocks`.
    pub max_explicit_blocks: u32,
    /// Probability that a subgroup call (1 < width < world) forces Lamport, which must
    /// be refused.
    pub illegal_lamport_probability: f64,
    /// Probability, after a batch, of a world call in which one rank publishes a call
    /// out of sequence (every rank must report `CallMismatch`).
    pub mismatch_probability: f64,
}

impl Knobs {
    /// Defaults for `calls` calls.
    pub fn new(calls: usize) -> Self {
        Knobs {
            calls,
            max_batch: 24,
            delay_probability: 0.1,
            max_delay_ms: 3,
            max_bytes: 3 << 20,
            max_explicit_blocks: 4,
            illegal_lamport_probability: 0.08,
            mismatch_probability: 0.05,
        }
    }
}

/// One drawn call (before its inputs are).
#[derive(Clone, Copy, Debug)]
pub struct Draw {
    pub dtype: DType,
    pub len: usize,
    pub in_place: bool,
    pub zeros: Zeros,
    pub opts: AllReduceOptions,
    /// The operator: a sum two calls in three.
    pub op: ReduceOp,
}

impl Draw {
    /// The call drawn, with random inputs for every rank.
    pub fn prepare<B: Backend>(
        &self,
        comm: &SingleController<B>,
        rng: &mut StdRng,
    ) -> Box<dyn Call<B>> {
        for_dtype!(self.dtype, T => {
            let mut ins = random_inputs::<T>(rng, comm.world_size(), self.len);
            sprinkle_zeros(rng, &mut ins, self.zeros);
            let mut call = Prepared::<B, T>::new(comm, ins, self.in_place, self.opts);
            call.op = self.op;
            Box::new(call)
        })
    }
}

/// Draws a message size: mostly small, sometimes large, often odd.
fn draw_bytes(rng: &mut StdRng, max_bytes: usize) -> usize {
    let upper = match rng.random_range(0..100) {
        0..=44 => 256,
        45..=74 => 16 << 10,
        75..=91 => 256 << 10,
        92..=97 => 1 << 20,
        _ => max_bytes,
    };
    rng.random_range(1..=upper.min(max_bytes))
}

/// Draws one call for a world of `world` ranks.
pub fn draw(rng: &mut StdRng, world: usize, knobs: &Knobs) -> Draw {
    // One call in five over a type beyond f32, f16 and bf16 (one-stage only: a two-stage
    // or Lamport request, or Avg over an integer, must be refused).
    let dtype = match rng.random_bool(0.2) {
        true => DType::ALL[rng.random_range(3..DType::ALL.len())],
        false => DType::ALL[rng.random_range(0..3)],
    };
    let widths = group_sizes(world);
    let width = if rng.random_bool(0.5) {
        world
    } else {
        widths[rng.random_range(0..widths.len())]
    };
    // The whole world may be asked for as 0 or as its width.
    let group_size = if width == world && rng.random_bool(0.5) {
        0
    } else {
        width
    };
    let algorithm = if width > 1 && width < world {
        if rng.random_bool(knobs.illegal_lamport_probability) {
            Algorithm::Lamport
        } else {
            [Algorithm::Auto, Algorithm::OneStage, Algorithm::TwoStage][rng.random_range(0..3)]
        }
    } else {
        match rng.random_range(0..10) {
            0..=2 => Algorithm::Auto,
            3..=4 => Algorithm::OneStage,
            5..=6 => Algorithm::TwoStage,
            _ => Algorithm::Lamport,
        }
    };
    let size = dtype.size();
    let mut len = (draw_bytes(rng, knobs.max_bytes) / size).max(1);
    if algorithm == Algorithm::Lamport && width == world {
        len = len.min(FUZZ_LAMPORT_SLOT / size);
    }
    let zeros = match rng.random_range(0..10) {
        0..=5 => Zeros::NONE,
        6..=7 => Zeros::LANES,
        _ => Zeros::ALL,
    };
    let mut opts = AllReduceOptions::new()
        .group_size(group_size)
        .algorithm(algorithm);
    if rng.random_bool(0.2) {
        opts = opts.blocks(rng.random_range(1..=knobs.max_explicit_blocks));
    }
    let op = match rng.random_range(0..3) {
        0 => ReduceOp::ALL[rng.random_range(1..ReduceOp::ALL.len())],
        _ => ReduceOp::Sum,
    };
    Draw {
        dtype,
        len,
        in_place: rng.random_bool(0.5),
        zeros,
        opts,
        op,
    }
}

/// One call of a batch, its inputs uploaded: the call, the delay before it (rank and
/// how long) and how it was drawn.
type Planned<B> = (Box<dyn Call<B>>, Option<(usize, Duration)>, Draw);

/// What a fuzz run did.
#[derive(Debug, Default)]
pub struct Report {
    pub seed: u64,
    pub checked: usize,
    pub requested: BTreeMap<&'static str, usize>,
    pub ran: BTreeMap<&'static str, usize>,
    pub refused: usize,
    /// The other collectives checked, by name.
    pub collectives: BTreeMap<&'static str, usize>,
    pub delays: usize,
    pub in_place: usize,
    pub with_zeros: usize,
    pub batches: usize,
    pub bytes: usize,
    /// Mismatched calls made on purpose, each reported on every rank.
    pub mismatches: usize,
    /// Batches issued through a group.
    pub groups: usize,
    pub elapsed: Duration,
}

/// A whole-world in-place all-reduce where rank `odd` is a call ahead: `CallMismatch {
/// field: Sequence }` everywhere, nothing written, `reinitialize()` recovers.
fn mismatched_call<B: Backend>(comm: &SingleController<B>, rng: &mut StdRng, what: &str) {
    let world = comm.world_size();
    let odd = rng.random_range(0..world);
    let len = rng.random_range(1..=5000usize);
    let algorithm = super::REQUESTS[rng.random_range(0..4usize)];
    let ins = random_inputs::<f32>(rng, world, len);
    let mut bufs: Vec<B::Buffer<f32>> = comm
        .cores()
        .iter()
        .zip(&ins)
        .map(|(r, x)| B::alloc_from(r.device(), x).unwrap())
        .collect();
    comm.mismatch_next(odd).unwrap();
    let opts = AllReduceOptions::new().algorithm(algorithm);
    comm.all_reduce_slices_in_place(&mut bufs, &ReduceOp::Sum, &opts)
        .unwrap_or_else(|e| panic!("{what}: the mismatched call was refused: {e}"));
    let errors = comm.rank_errors().unwrap();
    for (rank, e) in errors.iter().enumerate() {
        let sequence = Some(CallField::Sequence);
        assert!(
            matches!(e, Some(Error::CallMismatch { field, .. }) if Some(*field) == sequence),
            "{what}: rank {odd} one call ahead ({algorithm:?}, {len} f32): rank {rank} \
             reported {e:?}"
        );
        let now = bufs[rank].to_host(comm.cores()[rank].device()).unwrap();
        assert!(
            now.iter()
                .zip(&ins[rank])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: rank {rank}'s buffer was written by a mismatched call"
        );
    }
    comm.reinitialize().unwrap();
}

/// Runs the fuzzer over `placement` (see the module docs) and prints what it checked.
pub fn fuzz<B: Backend>(
    test: &str,
    placement: &Placement,
    max_blocks: Option<u32>,
    knobs: &Knobs,
) -> Report {
    let seed = super::seed(test);
    let mut rng = StdRng::seed_from_u64(seed);
    let comm = placement.open::<B>(fuzz_config(max_blocks));
    let world = comm.world_size();
    let trace = std::env::var_os("PEERCOMM_FUZZ_TRACE").is_some();
    let started = Instant::now();
    let mut report = Report {
        seed,
        ..Report::default()
    };
    while report.checked < knobs.calls {
        let n = rng
            .random_range(1..=knobs.max_batch)
            .min(knobs.calls - report.checked);
        let mut batch: Vec<Planned<B>> = Vec::with_capacity(n);
        for _ in 0..n {
            let d = draw(&mut rng, world, knobs);
            // Now and then one of the other collectives, on the same barrier domains.
            let call = if rng.random_bool(COLLECTIVE_PROBABILITY) {
                let mut opts = CollectiveOptions::new().group_size(d.opts.group_size);
                opts.blocks = d.opts.blocks;
                let width = Some(d.opts.group_size).filter(|&g| g > 0).unwrap_or(world);
                let bytes = d.len * d.dtype.size();
                super::collectives::fuzz_call(&comm, &mut rng, d.dtype, width, opts, bytes)
            } else {
                d.prepare(&comm, &mut rng)
            };
            let delay = rng.random_bool(knobs.delay_probability).then(|| {
                (
                    rng.random_range(0..world),
                    Duration::from_millis(rng.random_range(0..=knobs.max_delay_ms)),
                )
            });
            batch.push((call, delay, d));
        }
        // Every fourth batch goes through a group (all-reduces launched at its end).
        let in_group = report.batches % 4 == 2;
        let slots = {
            let mut group = in_group.then(|| comm.group());
            let mut grouped = Vec::new();
            let mut slots: Vec<Option<Result<Algorithm>>> = Vec::with_capacity(n);
            for (i, (call, delay, _)) in batch.iter_mut().enumerate() {
                if let Some((rank, by)) = *delay {
                    comm.delay_rank(rank, by).expect("delay_rank");
                }
                if trace {
                    eprintln!(
                        "{test}: batch {} call {i}: {}, delay {delay:?}{}",
                        report.batches,
                        call.describe(world),
                        if group.is_some() { ", in a group" } else { "" }
                    );
                }
                match group.as_mut() {
                    Some(g) if call.groupable() => match call.add_to_group(g) {
                        Ok(()) => {
                            grouped.push(i);
                            slots.push(None);
                        }
                        Err(e) => slots.push(Some(Err(e))),
                    },
                    _ => slots.push(Some(call.enqueue(&comm))),
                }
            }
            if let Some(g) = group {
                let algorithms = g
                    .end()
                    .unwrap_or_else(|e| panic!("{test} (PEERCOMM_SEED={seed}): group end: {e}"));
                for (&i, a) in grouped.iter().zip(algorithms) {
                    slots[i] = Some(Ok(a));
                }
            }
            slots
        };
        report.groups += usize::from(in_group);
        let outcomes: Vec<Result<Algorithm>> = slots
            .into_iter()
            .map(|o| o.expect("every call ran"))
            .collect();
        comm.synchronize().unwrap_or_else(|e| {
            panic!(
                "{test} (PEERCOMM_SEED={seed}): synchronize after batch {} of {n} calls: {e}",
                report.batches
            )
        });
        for (i, ((call, delay, d), outcome)) in batch.iter().zip(&outcomes).enumerate() {
            let delayed = delay.map(|(r, by)| format!(", rank {r} delayed by {by:?}"));
            let zeros = (d.zeros.lane > 0.0).then(|| format!(", zeros {:?}", d.zeros));
            let (delayed, zeros) = (delayed.unwrap_or_default(), zeros.unwrap_or_default());
            let desc = call.describe(world);
            let batch = report.batches;
            let what = format!(
                "{test} (PEERCOMM_SEED={seed}), batch {batch}, call {i} of {n}: {desc}{delayed}\
                 {zeros}"
            );
            call.check(&comm, outcome, &what);
            if let Some(name) = call.collective() {
                *report.collectives.entry(name).or_default() += 1;
            } else {
                *report.requested.entry(d.opts.algorithm.name()).or_default() += 1;
                match outcome {
                    Ok(a) => *report.ran.entry(a.name()).or_default() += 1,
                    Err(_) => report.refused += 1,
                }
            }
            report.delays += delay.is_some() as usize;
            report.in_place += d.in_place as usize;
            report.with_zeros += (d.zeros.lane > 0.0) as usize;
            report.bytes += call.bytes();
            report.checked += 1;
        }
        report.batches += 1;
        // Drawn, and at least once every 25 batches, so a long run always has some.
        let forced = knobs.mismatch_probability > 0.0 && report.batches % 25 == 10;
        if world >= 2 && (rng.random_bool(knobs.mismatch_probability) || forced) {
            let what = format!(
                "{test} (PEERCOMM_SEED={seed}), after batch {}",
                report.batches
            );
            mismatched_call(&comm, &mut rng, &what);
            report.mismatches += 1;
        }
    }
    report.elapsed = started.elapsed();
    let shared = if placement.shared { " (shared)" } else { "" };
    eprintln!(
        "{test}: world {world} on devices {:?}{shared}: {report:?}",
        placement.ordinals
    );
    if knobs.calls >= 300 {
        for a in ["auto", "one_stage", "two_stage", "lamport"] {
            let requested = report.requested.contains_key(a);
            assert!(requested, "{test}: the fuzzer never requested {a}");
        }
        if world >= 2 {
            assert!(
                report.ran.contains_key("lamport"),
                "{test}: Lamport never ran"
            );
        }
        assert!(report.delays > 0, "{test}: no rank was ever delayed");
        assert!(report.groups > 0, "{test}: no batch went through a group");
        if world >= 2 && knobs.mismatch_probability > 0.0 && report.batches >= 25 {
            assert!(report.mismatches > 0, "{test}: no mismatched call was made");
        }
    }
    report
}

/// The same schedule and inputs through two backends, compared bit for bit. `Auto` may
/// pick differently per architecture, so no all--0.0 elements (Lamport gives +0.0).
pub fn differential<A: Backend, B: Backend>(
    test: &str,
    a: &SingleController<A>,
    b: &SingleController<B>,
    calls: usize,
) {
    assert_eq!(a.world_size(), b.world_size());
    let world = a.world_size();
    let mut rng = super::rng(test);
    let knobs = Knobs {
        max_bytes: 1 << 20,
        ..Knobs::new(calls)
    };
    for i in 0..calls {
        let mut d = draw(&mut rng, world, &knobs);
        if d.opts.algorithm == Algorithm::Auto && d.zeros.column > 0.0 {
            d.zeros = Zeros::LANES;
        }
        let what = format!("{test}, call {i}");
        for_dtype!(d.dtype, T => differential_call::<A, B, T>(a, b, &mut rng, &d, &what));
    }
    eprintln!(
        "{test}: {calls} calls, world {world}, {} and {} agree bit for bit",
        A::NAME,
        B::NAME
    );
}

fn differential_call<A: Backend, B: Backend, T: Element>(
    a: &SingleController<A>,
    b: &SingleController<B>,
    rng: &mut StdRng,
    d: &Draw,
    what: &str,
) {
    let world = a.world_size();
    let mut ins = random_inputs::<T>(rng, world, d.len);
    sprinkle_zeros(rng, &mut ins, d.zeros);
    let mut pa = Prepared::<A, T>::new(a, ins.clone(), d.in_place, d.opts);
    let mut pb = Prepared::<B, T>::new(b, ins, d.in_place, d.opts);
    let what = format!("{what}: {}", pa.describe(world));
    let oa = pa.enqueue(a);
    let ob = pb.enqueue(b);
    a.synchronize()
        .unwrap_or_else(|e| panic!("{what}: {}: {e}", A::NAME));
    b.synchronize()
        .unwrap_or_else(|e| panic!("{what}: {}: {e}", B::NAME));
    pa.check(a, &oa, &format!("{what} on {}", A::NAME));
    pb.check(b, &ob, &format!("{what} on {}", B::NAME));
    if oa.is_err() {
        return;
    }
    let (ra, rb) = (pa.results(a), pb.results(b));
    for r in 0..world {
        for e in 0..d.len {
            assert_eq!(
                ra[r][e].to_bits_u32(),
                rb[r][e].to_bits_u32(),
                "{what}: rank {r}, element {e}: {} gives {:?} ({}), {} gives {:?} ({})",
                A::NAME,
                ra[r][e],
                oa.as_ref().unwrap().name(),
                B::NAME,
                rb[r][e],
                ob.as_ref().unwrap().name()
            );
        }
    }
}
