//! The Lamport fused call through the per-rank `Comm` with the pools and checks of
//! tests/common/fused.rs (golden rows compared by digest across ranks); then calls
//! that differ between ranks: `CallMismatch` everywhere, nothing written.

use peercomm::backend::{Backend, TypedBuffer};
use peercomm::{Algorithm, AllReduceOptions, CollectiveOptions, Comm, Element, ReduceOp};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::agreement::{self, Call, Case};
use super::common::fused::{
    assert_golden, check_golden, digest, fused_config, offsets, FusedCase, FusedRows, Pool,
    ALGORITHMS,
};
use super::{nan, seed, with_world_config, Placement};

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
    let mut out = B::alloc_from(dev, &nan::<T>(span.len())).unwrap();
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
            let (d, b) = by_dtype!(case.dtype, check_case::<B>(&comm, &mut rng, case));
            digests.push(d);
            batches += b;
        }
        (digests, batches)
    });
    for (r, (digests, _)) in results.iter().enumerate() {
        let note = format!("{test}: rank {r}'s golden rows differ from rank 0's");
        assert_eq!(digests, &results[0].0, "{note}");
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

const HIDDEN: usize = 4096;

/// Every rank's fused call of `tokens` rows of [`HIDDEN`] under `algorithm`.
fn fused<B: Backend>(tokens: usize, algorithm: Algorithm) -> Call<B> {
    fused_shaped::<B>(tokens * HIDDEN, HIDDEN, 1e-5, algorithm)
}

fn lamport_all_reduce<B: Backend>(n: usize) -> Call<B> {
    Box::new(move |comm: &Comm<B>| {
        let dev = comm.device();
        let send = B::alloc_from(dev, &vec![half::bf16::ONE; n])?;
        let mut recv = B::alloc_from(dev, &vec![half::bf16::NAN; n])?;
        let opts = AllReduceOptions::new().algorithm(Algorithm::Lamport);
        comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &opts)?;
        comm.synchronize()
    })
}

/// The last rank makes another fused call: `CallMismatch` naming the field everywhere,
/// nothing written; after `reinitialize` a checked fused call works.
pub fn lamport_fused_mismatch<B: Backend>(place: &Placement, world: usize) {
    let config = agreement::short_waits(place, world);
    let lamport = |tokens| fused::<B>(tokens, Algorithm::Lamport);
    let cases: Vec<Case<B>> = cases![
        "Lamport fused, 8 tokens against 1", Length: lamport(8), lamport(1);
        "Lamport fused against one-stage fused (found when the waits give up)", Algorithm:
            lamport(8), fused::<B>(8, Algorithm::OneStage);
        "Lamport fused against the Lamport all-reduce", Collective:
            lamport(1), lamport_all_reduce::<B>(HIDDEN);
    ];

    // A matching call works again (its new residual checked).
    let again = |comm: &Comm<B>, _: &Call<B>| fused::<B>(2, Algorithm::Auto)(comm).unwrap();
    agreement::every_rank_mismatched(place, world, &config, &cases, again);
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
        let (out, res) = (out.to_host(dev)?, res.to_host(dev)?);
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
            let holds = out.iter().all(|x| x.is_finite());
            assert!(holds, "a fused output is not finite");
        }
        result
    })
}

/// Same element count but another row length or epsilon: `CallMismatch` naming it on
/// every rank, nothing written, both staged in chunks (one-stage) and pushed (Lamport).
pub fn fused_arguments_mismatch<B: Backend>(place: &Placement, world: usize) {
    let config = agreement::short_waits(place, world).with_payload_bytes(4096);
    let total = 1920;
    let cases: Vec<Case<B>> = [Algorithm::OneStage, Algorithm::Lamport]
        .into_iter()
        .flat_map(|algorithm| {
            let call = |hidden, epsilon| fused_shaped::<B>(total, hidden, epsilon, algorithm);
            cases![
                "rows of 64 against rows of 96", Hidden: call(64, 1e-5), call(96, 1e-5);
                "epsilon 1e-5 against 1e-6", Epsilon: call(64, 1e-5), call(64, 1e-6);
            ]
        })
        .collect();
    let again = |comm: &Comm<B>, usual: &Call<B>| usual(comm).unwrap();
    agreement::every_rank_mismatched(place, world, &config, &cases, again);
}
