//! Staged messages past the payload run in chunks (two pipelined halves) instead of
//! `MessageTooLarge`: all-reduces checked against f64, bit for bit against a payload
//! holding the whole message and across the group; the other collectives and the
//! fused call likewise; then late, missing and mismatched ranks. A staged message
//! takes one chunk or at least three (two halves fit whole).

use std::time::{Duration, Instant};

use peercomm::backend::Backend;
use peercomm::bootstrap::UniqueId;
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig, DType, Element, Error, ReduceOp};

use super::collectives::{check_call, check_fused};
use super::common::collectives::{assert_bits, Which};
use super::common::{bits, digest, seed, View};
use super::{common, inputs, Placement};

/// A small payload for the host: 4144 bytes, halves of 129 packs (odd, not a multiple
/// of 32); up to 259 packs are staged whole.
pub const SMALL_PAYLOAD: usize = 4144;
/// Halves of 2049 packs, more than 4 blocks x 512 threads: threads take several packs
/// and chunks are no multiple of the grid (the GPU runs).
pub const GRID_PAYLOAD: usize = 65_584;

/// Packs in one chunk (half the payload).
fn chunk_packs(payload: usize) -> usize {
    payload / 32
}

fn small_config(place: &Placement, world: usize, payload: usize) -> CommConfig {
    place
        .config(world)
        .with_payload_bytes(payload)
        // Lamport never fits, so Auto runs one-stage here.
        .with_lamport_slot_bytes(1024)
}

/// Holds every message of the suite whole.
fn big_config(place: &Placement, world: usize, payload: usize) -> CommConfig {
    place
        .config(world)
        .with_payload_bytes(128 * payload)
        .with_lamport_slot_bytes(1024)
}

/// Element counts: the largest staged whole, one more (3 chunks), 3 chunks exactly,
/// 3 chunks + 5 (4, partial last pack), and 41 chunks with a partial last pack.
fn lengths(payload: usize, lanes: usize) -> [usize; 5] {
    let whole = payload / 16 * lanes;
    let c = chunk_packs(payload) * lanes;
    [whole, whole + 1, 3 * c, 3 * c + 5, 40 * c + lanes + 3]
}

/// Chunks a message of `n` elements takes through `payload` (1: staged whole).
fn chunks(payload: usize, n: usize, lanes: usize) -> usize {
    let packs = n.div_ceil(lanes);
    if packs * 16 <= payload {
        1
    } else {
        packs.div_ceil(chunk_packs(payload))
    }
}

/// One all-reduce of `ins[rank]` at `shift` elements into the buffers, in place or not;
/// returns the `n` result elements after checking nothing before the view was written.
#[allow(clippy::too_many_arguments)]
fn run_one<B: Backend, T: Element>(
    comm: &Comm<B>,
    mine: &[T],
    shift: usize,
    in_place: bool,
    opts: &AllReduceOptions,
    expect: Algorithm,
    what: &str,
) -> Vec<T> {
    let dev = comm.device();
    let poison = T::from_f32(f32::NAN);
    let padded: Vec<T> = std::iter::repeat_n(poison, shift)
        .chain(mine.iter().copied())
        .collect();
    let mut send = B::alloc_from(dev, &padded).unwrap();
    let out = if in_place {
        let mut view = View::elements(&mut send, shift, mine.len());
        let ran = comm.all_reduce_in_place_with(&mut view, &ReduceOp::Sum, opts);
        assert_eq!(ran, Ok(expect), "{what}");
        comm.synchronize().expect(what);
        B::download(dev, &send).unwrap()
    } else {
        let mut recv = B::alloc_from(dev, &vec![poison; shift + mine.len()]).unwrap();
        let mut view_out = View::elements(&mut recv, shift, mine.len());
        let view_in = View::elements(&mut send, shift, mine.len());
        let ran = comm.all_reduce_with(&view_in, &mut view_out, &ReduceOp::Sum, opts);
        assert_eq!(ran, Ok(expect), "{what}");
        comm.synchronize().expect(what);
        let input = B::download(dev, &send).unwrap();
        assert_eq!(bits(&input), bits(&padded), "{what}: the input changed");
        B::download(dev, &recv).unwrap()
    };
    let holds = out[..shift].iter().all(|x| x.to_f32().is_nan());
    assert!(holds, "{what}: written before the view");
    out[shift..].to_vec()
}

/// This rank's share for dtype T (widths x lengths x in place x alignment x Auto and
/// one-stage, on both payloads); the chunked outputs' digests in call order.
fn calls_of<B: Backend, T: Element>(
    small: &Comm<B>,
    big: &Comm<B>,
    seed: u64,
    call: &mut usize,
) -> Vec<u64> {
    let (world, rank) = (small.world_size(), small.rank());
    let payload = small.config().payload_bytes;
    let lanes = 16 / T::DTYPE.size();
    let mut digests = Vec::new();
    for width in common::group_sizes(world) {
        for (i, &n) in lengths(payload, lanes).iter().enumerate() {
            for in_place in [false, true] {
                *call += 1;
                let ins = inputs::<T>(seed, *call, world, n);
                let shift = (i + usize::from(in_place)) % 2;
                let algorithm = [Algorithm::Auto, Algorithm::OneStage][i % 2];
                let opts = AllReduceOptions::new().group_size(width);
                let (opts, one) = (
                    opts.algorithm(algorithm),
                    opts.algorithm(Algorithm::OneStage),
                );
                let k = chunks(payload, n, lanes);
                let what = format!(
                    "chunked {:?} world {world} group {width} n {n} ({k} chunks) in place \
                     {in_place} shift {shift} {algorithm:?} rank {rank}",
                    T::DTYPE
                );
                assert_eq!(
                    small.algorithm_for(T::DTYPE, n, &opts, in_place),
                    Ok(Algorithm::OneStage),
                    "{what}"
                );
                let one_stage = Algorithm::OneStage;
                let got = run_one(small, &ins[rank], shift, in_place, &opts, one_stage, &what);
                let base = rank / width * width;
                let group = &ins[base..base + width];
                common::check_sums(group, &vec![got.clone(); width], width, &what);
                let whole = run_one(big, &ins[rank], 0, in_place, &one, one_stage, &what);
                assert_bits(&got, &whole, &format!("{what}: against the unchunked call"));
                digests.push(digest(&got));
            }
        }
    }
    digests
}

/// Runs `body(small, big)` on one thread per rank: each rank's communicators over the
/// small payload and over one that holds every message of the suite whole.
fn with_two_worlds<B: Backend, R: Send>(
    place: &Placement,
    world: usize,
    payload: usize,
    body: impl Fn(&Comm<B>, &Comm<B>) -> R + Sync,
) -> Vec<R> {
    let big_id = UniqueId::new().unwrap();
    let small = small_config(place, world, payload);
    super::world_threads(place, world, &small, &|_| {}, |rank, small, _| {
        let (dev, config) = (
            B::open(place.ordinal(rank)).unwrap(),
            big_config(place, world, payload),
        );
        body(
            &small,
            &Comm::<B>::from_rank(dev, rank, world, &big_id, config).unwrap(),
        )
    })
}

/// Checks that every rank's `digests[rank][c]` equals its group lead's, the group of
/// call `c` being `width_of(c)` wide.
fn compare_groups(digests: &[Vec<u64>], width_of: impl Fn(usize) -> usize, what: &str) {
    for (rank, mine) in digests.iter().enumerate() {
        assert_eq!(mine.len(), digests[0].len(), "{what}: calls of rank {rank}");
        for (c, &d) in mine.iter().enumerate() {
            let width = width_of(c);
            let lead = rank / width * width;
            assert_eq!(
                d, digests[lead][c],
                "{what}: call {c}: rank {rank}'s bits differ from rank {lead}'s (group {width})"
            );
        }
    }
}

/// Every width x dtype x length through `payload`, in and out of place, aligned or
/// not: against f64, the unchunked call and across the group.
pub fn chunked_all_reduce<B: Backend>(place: &Placement, world: usize, payload: usize) {
    let seed = seed(&format!("per_rank_chunked_world_{world}_payload_{payload}"));
    let digests = with_two_worlds::<B, _>(place, world, payload, |small, big| {
        let mut call = 0;
        let mut d = calls_of::<B, f32>(small, big, seed, &mut call);
        d.extend(calls_of::<B, half::f16>(small, big, seed, &mut call));
        d.extend(calls_of::<B, half::bf16>(small, big, seed, &mut call));
        d
    });
    // The calls in order: per dtype, per width, per length, out of place then in place.
    let widths = common::group_sizes(world);
    let per_width = lengths(payload, 4).len() * 2;
    let width = |c| widths[c / per_width % widths.len()];
    compare_groups(&digests, width, "chunked all-reduce");
    let calls = digests[0].len();
    eprintln!("per_rank_chunked world {world} payload {payload}: {calls} calls per rank checked");
}

/// The staged collectives through `payload` (all-gather, reduce-scatter, broadcast,
/// scatter; roots first and last) on both communicators against exact references, then
/// the fused call over row runs (whole, 4-row chunks, 1-row chunks) against f64, the
/// unchunked call and across the group.
pub fn chunked_collectives<B: Backend>(place: &Placement, world: usize, payload: usize) {
    let seed = seed(&format!(
        "per_rank_chunked_collectives_{world}_payload_{payload}"
    ));
    let widths = common::group_sizes(world);
    let fused_cases: [(usize, usize); 4] = [(2, 256), (9, 256), (41, 256), (7, 1032)];
    let digests = with_two_worlds::<B, _>(place, world, payload, |small, big| {
        let mut call = 0;
        for &width in &widths {
            let last = width - 1;
            let broadcast = |root, in_place| Which::Broadcast { root, in_place };
            let (first, last_root) = (broadcast(0, false), broadcast(last, true));
            let scatters = [Which::Scatter { root: 0 }, Which::Scatter { root: last }];
            let roots = [first, last_root, scatters[0], scatters[1]];
            for which in [Which::AllGather, Which::ReduceScatter]
                .into_iter()
                .chain(roots)
            {
                // The same calls (the same inputs) on both communicators.
                let first = call;
                for comm in [small, big] {
                    call = first;
                    for &n in &lengths(payload, 4) {
                        check_call::<B, f32>(comm, seed, call, which, width, n);
                        call += 1;
                    }
                    for &n in &lengths(payload, 8) {
                        check_call::<B, half::f16>(comm, seed, call, which, width, n);
                        check_call::<B, half::bf16>(comm, seed, call + 1, which, width, n);
                        call += 2;
                    }
                }
            }
        }
        let mut digests = Vec::new();
        for &width in &widths {
            for &(tokens, hidden) in &fused_cases {
                for dtype in common::EVERY_KERNEL {
                    // f32 rows of half the elements: the same packs per row.
                    let row = hidden / if dtype == DType::F32 { 2 } else { 1 };
                    let fused =
                        |c| by_dtype!(dtype, check_fused::<B>(c, seed, call, width, tokens, row));
                    let pair = [small, big].map(fused);
                    assert_eq!(
                        pair[0], pair[1],
                        "fused {dtype:?} {tokens} rows of {hidden} x 16-bit group {width}: \
                         chunked and whole bits differ"
                    );
                    digests.push(pair[0]);
                    call += 1;
                }
            }
        }
        digests
    });
    let per_width = fused_cases.len() * common::EVERY_KERNEL.len();
    compare_groups(&digests, |c| widths[c / per_width], "chunked fused");
    eprintln!("per_rank_chunked_collectives world {world} payload {payload}: checked");
}

/// A chunked call (41 chunks of f32) with a late rank (completes, right), a missing
/// rank (rank 0 `BarrierTimeout` within 2 x timeout, rank 1 `PeerAborted`, nothing
/// written, `reinitialize` recovers), and a rank one call ahead (`CallMismatch`).
pub fn chunked_faults<B: Backend>(place: &Placement, world: usize) {
    let timeout = Duration::from_millis(400);
    let config = small_config(place, world, SMALL_PAYLOAD).with_barrier_timeout(Some(timeout));
    let seed = seed("per_rank_chunked_faults");
    let n = 40 * chunk_packs(SMALL_PAYLOAD) * 4 + 7;
    assert!(chunks(SMALL_PAYLOAD, n, 4) > 40);
    let opts = &AllReduceOptions::new().algorithm(Algorithm::OneStage);
    super::with_world_config::<B, _>(place, world, &config, |rank, comm| {
        let dev = comm.device();
        let inputs = |call| inputs::<f32>(seed, call, world, n);
        let check = |ins: &[Vec<f32>], got: &B::Buffer<f32>, what: &str| {
            let got = B::download(dev, got).unwrap();
            let what = format!("{what}, rank {rank}");

            common::check_sums(ins, &vec![got; world], world, &what);
        };
        // Late, within the timeout.
        let ins = inputs(1);
        let send = B::alloc_from(dev, &ins[rank]).unwrap();
        let mut recv = B::alloc_from(dev, &vec![f32::NAN; n]).unwrap();
        if rank == 1 {
            comm.delay(timeout / 2).unwrap();
        }
        comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, opts)
            .unwrap();
        comm.synchronize().unwrap();
        check(&ins, &recv, "late");

        // Rank 1 misses the call.
        let ins = inputs(2);
        let send = B::alloc_from(dev, &ins[rank]).unwrap();
        let mut recv = B::alloc_from(dev, &vec![f32::NAN; n]).unwrap();
        if rank == 1 {
            comm.miss_next();
        }
        let started = Instant::now();
        let ran = comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, opts);
        assert_eq!(ran, Ok(Algorithm::OneStage));

        if rank != 1 {
            match comm.synchronize() {
                Err(Error::BarrierTimeout { waiting_for, .. }) => {
                    assert_eq!(waiting_for, Some(1), "rank {rank}")
                }
                // A rank whose peer (not rank 1) timed out first.
                Err(Error::PeerAborted { .. }) if rank != 0 => {}
                other => panic!("rank {rank}: expected a timeout, got {other:?}"),
            }
            let elapsed = started.elapsed();
            let holds = elapsed < 2 * timeout + Duration::from_secs(2);
            assert!(holds, "rank {rank}: the error came after {elapsed:?}");
        } else {
            // Rank 1 launched nothing; its record gets the abort.
            let err = super::first_error(&comm, started + 10 * timeout);
            assert!(matches!(err, Error::PeerAborted { rank: 1, .. }), "{err:?}");
        }
        let holds = B::download(dev, &recv).unwrap().iter().all(|x| x.is_nan());
        assert!(holds, "rank {rank}: a call that timed out wrote");
        comm.reinitialize().unwrap();
        let ins = inputs(3);
        let mut buf = B::alloc_from(dev, &ins[rank]).unwrap();
        comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, opts)
            .unwrap();
        comm.synchronize().unwrap();
        check(&ins, &buf, "recovered");

        // Rank 1's call is one ahead in the sequence.
        let ins = inputs(4);
        let send = B::alloc_from(dev, &ins[rank]).unwrap();
        let mut recv = B::alloc_from(dev, &vec![f32::NAN; n]).unwrap();
        if rank == 1 {
            comm.mismatch_next();
        }
        comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, opts)
            .unwrap();
        match comm.synchronize() {
            Err(Error::CallMismatch { .. }) => {}
            // A rank that the mismatch reached only through a peer's abort.
            Err(Error::PeerAborted { .. }) if world > 2 => {}
            other => panic!("rank {rank}: expected a call mismatch, got {other:?}"),
        }
        let holds = B::download(dev, &recv).unwrap().iter().all(|x| x.is_nan());
        assert!(holds, "rank {rank}: a mismatched call wrote");
        comm.reinitialize().unwrap();
    });
}
