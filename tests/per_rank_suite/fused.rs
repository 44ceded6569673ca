//! The Lamport fused call through the per-rank `Comm` with the pools and checks of
//! tests/common/fused.rs (golden rows compared by digest across ranks); then calls
//! that differ between ranks: `CallMismatch` everywhere, nothing written.

use peercomm::backend::{Backend, TypedBuffer};
use peercomm::{Algorithm, AllReduceOptions, CallField, CollectiveOptions, Comm, DType, Element};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::common::fused::{
    assert_golden, check_golden, digest, fused_config, offsets, FusedCase, FusedRows, Pool,
    ALGORITHMS,
};
use super::{agreement, in_step, seed, with_world_config, Placement};

/// One fused call on rows `[first, first + tokens)` under `algorithm`, fresh buffers,
/// after a synchronize.
fn run_rank<B: Backend, T: Element>(
    comm: &Comm<B>,
    pool: &Pool<T>,
    first: usize,
    tokens: usize,
    algorithm: Algorithm,
    what: &str,
) -> FusedRows<T> {
    let rank = comm.rank();
    let dev = comm.device();
    let span = pool.span(first, tokens);
    let input = B::alloc_from(dev, &pool.ins[rank][span.clone()]).unwrap();
    let weight = B::alloc_from(dev, &pool.weight).unwrap();
    let mut res = B::alloc_from(dev, &pool.residual[span.clone()]).unwrap();
    let mut out = B::alloc_from(dev, &vec![T::from_f32(f32::NAN); span.len()]).unwrap();
    let opts = CollectiveOptions::new().algorithm(algorithm);
    comm.all_reduce_residual_rms_norm(&input, &mut res, &weight, &mut out, pool.epsilon, &opts)
        .expect(what);
    comm.synchronize().expect(what);
    FusedRows {
        out: out.to_host(dev).unwrap(),
        res: res.to_host(dev).unwrap(),
    }
}

/// Every case over `world` ranks (threads); returns the batches each rank checked.
pub fn lamport_fused<B: Backend>(place: &Placement, world: usize, cases: &[FusedCase]) -> usize {
    let test = format!("per_rank_lamport_fused_world_{world}");
    let seed = seed(&test);
    let config = fused_config(place.config(world));
    let results = with_world_config::<B, _>(place, world, &config, |_rank, comm| {
        let mut digests = Vec::new();
        let mut batches = 0;
        for (i, case) in cases.iter().enumerate() {
            let mut rng = StdRng::seed_from_u64(seed ^ ((i as u64) << 40));
            let (d, b) = match case.dtype {
                DType::F32 => check_case::<B, f32>(&comm, &mut rng, case),
                DType::F16 => check_case::<B, half::f16>(&comm, &mut rng, case),
                DType::BF16 => check_case::<B, half::bf16>(&comm, &mut rng, case),
            };
            digests.push(d);
            batches += b;
        }
        (digests, batches)
    });
    for (r, (digests, _)) in results.iter().enumerate() {
        assert_eq!(
            digests, &results[0].0,
            "{test}: rank {r}'s golden rows differ from rank 0's"
        );
    }
    results[0].1
}

/// One case on this rank: the digest of its golden rows and the batches checked. Every
/// rank draws the same pool and offsets (one seed), so every rank makes the same calls.
fn check_case<B: Backend, T: Element>(
    comm: &Comm<B>,
    rng: &mut StdRng,
    case: &FusedCase,
) -> (u64, usize) {
    let (world, rank) = (comm.world_size(), comm.rank());
    let rows = *case.tokens.iter().max().unwrap();
    let pool = Pool::<T>::new(rng, world, rows, case.hidden);
    let what = format!(
        "per-rank fused {:?} world {world} {rows}x{} rank {rank}",
        T::DTYPE,
        case.hidden
    );
    let golden = run_rank(comm, &pool, 0, rows, Algorithm::OneStage, &what);
    check_golden(&pool, &golden, rank, &format!("{what} one-stage"));
    let mut batches = 0;
    for &tokens in case.tokens {
        for first in offsets(rng, rows, tokens) {
            for algorithm in ALGORITHMS {
                let what = format!(
                    "{what}: rows {first}..{} under {}",
                    first + tokens,
                    algorithm.name()
                );
                let got = run_rank(comm, &pool, first, tokens, algorithm, &what);
                assert_golden(&golden, &got, pool.span(first, tokens), &what);
                batches += 1;
            }
        }
    }
    (digest(&golden), batches)
}

/// What one rank calls in a mismatch case: enqueued, then synchronized; on an error its
/// output must still be NaN and its residual as uploaded.
type Call<B> = Box<dyn Fn(&Comm<B>) -> peercomm::Result<()> + Sync>;

const HIDDEN: usize = 4096;

fn fused<B: Backend>(tokens: usize, algorithm: Algorithm) -> Call<B> {
    Box::new(move |comm: &Comm<B>| {
        let dev = comm.device();
        let n = tokens * HIDDEN;
        let bf = half::bf16::from_f32;
        let residual: Vec<half::bf16> = (0..n).map(|e| bf(0.25 + (e % 7) as f32)).collect();
        let input = B::alloc_from(dev, &vec![bf(1.0 + comm.rank() as f32); n])?;
        let weight = B::alloc_from(dev, &vec![bf(0.5); HIDDEN])?;
        let mut res = B::alloc_from(dev, &residual)?;
        let mut out = B::alloc_from(dev, &vec![half::bf16::NAN; n])?;
        let opts = CollectiveOptions::new().algorithm(algorithm);
        comm.all_reduce_residual_rms_norm(&input, &mut res, &weight, &mut out, 1e-5, &opts)?;
        let result = comm.synchronize();
        if result.is_err() {
            let out = out.to_host(dev)?;
            assert!(
                out.iter().all(|x| x.is_nan()),
                "a mismatched fused call wrote {} output elements",
                out.iter().filter(|x| !x.is_nan()).count()
            );
            let res = res.to_host(dev)?;
            let changed = (0..n)
                .filter(|&e| res[e].to_bits() != residual[e].to_bits())
                .count();
            assert_eq!(changed, 0, "a mismatched fused call wrote the residual");
        } else {
            // Every element's sum is 1 + 2 + ... + world, and sum + residual is exact.
            let world = comm.world_size();
            let sum = (world * (world + 1) / 2) as f32;
            let res = res.to_host(dev)?;
            for e in 0..n {
                assert_eq!(res[e], bf(sum + residual[e].to_f32()), "new residual {e}");
            }
            assert!(out.to_host(dev)?.iter().all(|x| x.is_finite()));
        }
        result
    })
}

fn lamport_all_reduce<B: Backend>(n: usize) -> Call<B> {
    Box::new(move |comm: &Comm<B>| {
        let dev = comm.device();
        let send = B::alloc_from(dev, &vec![half::bf16::ONE; n])?;
        let mut recv = B::alloc_from(dev, &vec![half::bf16::NAN; n])?;
        let opts = AllReduceOptions::new().algorithm(Algorithm::Lamport);
        comm.all_reduce_sum_with(&send, &mut recv, &opts)?;
        comm.synchronize()
    })
}

/// The last rank makes another fused call: `CallMismatch` naming the field everywhere,
/// nothing written; after `reinitialize` a checked fused call works.
pub fn lamport_fused_mismatch<B: Backend>(place: &Placement, world: usize) {
    let config = agreement::short_waits(place, world);
    let cases: Vec<(&str, CallField, Call<B>, Call<B>)> = vec![
        (
            "Lamport fused, 8 tokens against 1",
            CallField::Length,
            fused::<B>(8, Algorithm::Lamport),
            fused::<B>(1, Algorithm::Lamport),
        ),
        (
            "Lamport fused against one-stage fused (found when the waits give up)",
            CallField::Algorithm,
            fused::<B>(8, Algorithm::Lamport),
            fused::<B>(8, Algorithm::OneStage),
        ),
        (
            "Lamport fused against the Lamport all-reduce",
            CallField::Collective,
            fused::<B>(1, Algorithm::Lamport),
            lamport_all_reduce::<B>(HIDDEN),
        ),
    ];
    let odd = world - 1;
    for (what, field, usual, other) in &cases {
        let errors = in_step::<B, _>(place, world, &config, |rank, comm, meet| {
            let call = if rank == odd { other } else { usual };
            let got = call(comm);
            meet.wait();
            comm.reinitialize().unwrap();
            // A matching call works again (its new residual checked).
            fused::<B>(2, Algorithm::Auto)(comm).unwrap();
            got
        });
        super::common::assert_every_rank_mismatched(&errors, *field, odd, what);
    }
}

/// A fused call of `total` elements in rows of `hidden` with `epsilon`, staged in
/// chunks where the payload is small, under `algorithm`: the [`Call`] of one rank.
fn fused_shaped<B: Backend>(
    total: usize,
    hidden: usize,
    epsilon: f32,
    algorithm: Algorithm,
) -> Call<B> {
    Box::new(move |comm: &Comm<B>| {
        let dev = comm.device();
        let bf = half::bf16::from_f32;
        let residual: Vec<half::bf16> = (0..total).map(|e| bf(0.25 + (e % 7) as f32)).collect();
        let input = B::alloc_from(dev, &vec![bf(1.0 + comm.rank() as f32); total])?;
        let weight = B::alloc_from(dev, &vec![bf(0.5); hidden])?;
        let mut res = B::alloc_from(dev, &residual)?;
        let mut out = B::alloc_from(dev, &vec![half::bf16::NAN; total])?;
        let opts = CollectiveOptions::new().algorithm(algorithm);
        comm.all_reduce_residual_rms_norm(&input, &mut res, &weight, &mut out, epsilon, &opts)?;
        let result = comm.synchronize();
        let out = out.to_host(dev)?;
        let res = res.to_host(dev)?;
        let written = out.iter().filter(|x| !x.is_nan()).count();
        let changed = (0..total)
            .filter(|&e| res[e].to_bits() != residual[e].to_bits())
            .count();
        if result.is_err() {
            assert_eq!(
                (written, changed),
                (0, 0),
                "a mismatched fused call wrote {written} output and {changed} residual elements"
            );
        } else {
            let world = comm.world_size();
            let sum = (world * (world + 1) / 2) as f32;
            let wrong = (0..total)
                .filter(|&e| res[e] != bf(sum + residual[e].to_f32()))
                .count();
            assert_eq!(wrong, 0, "{wrong}/{total} residual elements wrong");
        }
        result
    })
}

/// Same element count but another row length or epsilon: `CallMismatch` naming it on
/// every rank, nothing written, both staged in chunks (one-stage) and pushed (Lamport).
pub fn fused_arguments_mismatch<B: Backend>(place: &Placement, world: usize) {
    let config = agreement::short_waits(place, world).with_payload_bytes(4096);
    let total = 1920;
    let cases: Vec<(&str, CallField, Call<B>, Call<B>)> = [Algorithm::OneStage, Algorithm::Lamport]
        .into_iter()
        .flat_map(|algorithm| {
            [
                (
                    "rows of 64 against rows of 96",
                    CallField::Hidden,
                    fused_shaped::<B>(total, 64, 1e-5, algorithm),
                    fused_shaped::<B>(total, 96, 1e-5, algorithm),
                ),
                (
                    "epsilon 1e-5 against 1e-6",
                    CallField::Epsilon,
                    fused_shaped::<B>(total, 64, 1e-5, algorithm),
                    fused_shaped::<B>(total, 64, 1e-6, algorithm),
                ),
            ]
        })
        .collect();
    let odd = world - 1;
    for (what, field, usual, other) in &cases {
        let errors = in_step::<B, _>(place, world, &config, |rank, comm, meet| {
            let got = if rank == odd {
                other(comm)
            } else {
                usual(comm)
            };
            meet.wait();
            comm.reinitialize().unwrap();
            usual(comm).unwrap();
            got
        });
        super::common::assert_every_rank_mismatched(&errors, *field, odd, what);
    }
}
