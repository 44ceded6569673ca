//! Point-to-point calls on the per-rank path: `send` / `recv` alone and in groups (pairs,
//! a ring shift, pipeline stages), `all_to_all` and `all_to_all_v` (a mixture-of-experts
//! dispatch and combine: tokens x 7168 bf16, top-k routing with uneven counts, some
//! ranks receiving nothing), each output poisoned first and checked bit for bit against
//! what the peers sent; messages larger than a payload region run in chunks. A send
//! that does not match its receive is `CallMismatch` on both ranks with nothing received,
//! and bad arguments are typed errors with nothing launched.

use half::bf16;
use peercomm::backend::{Backend, TypedBuffer as _};
use peercomm::{Algorithm, CallField, CollectiveOptions, Comm, CommConfig, DType, Element, Error};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::agreement::short_waits;
use super::{common, in_step, with_world_config, Placement};

/// Rank `rank`'s message `tag` of `n` elements in the run of `seed`.
fn message<T: Element>(seed: u64, rank: usize, tag: usize, n: usize) -> Vec<T> {
    let mut rng = StdRng::seed_from_u64(seed ^ (rank * 1000 + tag) as u64);
    (0..n)
        .map(|_| T::from_f32(rng.random_range(-4.0f32..4.0)))
        .collect()
}

/// A value no message holds: what a receive buffer holds before the call writes it.
fn poison<T: Element>() -> T {
    T::from_f32(1.0e4)
}

/// The sizes each case runs: one element, odd lengths, and (with a small payload) more
/// than a payload region, which runs in chunks.
const SIZES: [usize; 4] = [1, 7, 4099, 70_001];

/// A configuration whose payload regions (payload / world) are small enough that the
/// larger sizes run in chunks.
fn small_payload(place: &Placement, world: usize) -> CommConfig {
    place.config(world).with_payload_bytes(64 << 10)
}

/// Pairs (0, 1), (2, 3), ...: the even rank sends, the odd one receives, then back;
/// every dtype the call takes, every size.
pub fn send_recv_checked<B: Backend>(place: &Placement, world: usize) {
    send_recv_of::<B, f32>(place, world);
    send_recv_of::<B, half::f16>(place, world);
    send_recv_of::<B, bf16>(place, world);
}

fn send_recv_of<B: Backend, T: Element>(place: &Placement, world: usize) {
    let seed = common::seed("point_to_point");
    let config = small_payload(place, world);
    with_world_config::<B, _>(place, world, &config, |rank, comm| {
        let dev = comm.device();
        let peer = rank ^ 1;
        if peer >= world {
            return;
        }
        for (tag, &n) in SIZES.iter().enumerate() {
            let what = format!(
                "{} world {world} rank {rank}, {n} elements",
                T::DTYPE.name()
            );
            let mine = message::<T>(seed, rank, tag, n);
            let send = B::alloc_from(dev, &mine).unwrap();
            let mut recv = B::alloc_from(dev, &vec![poison::<T>(); n]).unwrap();
            // The lower rank sends first, the higher receives first: no cycle.
            if rank < peer {
                comm.send(&send, peer).unwrap();
                comm.recv(&mut recv, peer).unwrap();
            } else {
                comm.recv(&mut recv, peer).unwrap();
                comm.send(&send, peer).unwrap();
            }
            comm.synchronize().unwrap();
            let got = recv.to_host(dev).unwrap();
            let want = message::<T>(seed, peer, tag, n);
            assert_eq!(common::bits(&got), common::bits(&want), "{what}");
        }
    });
}

/// A ring shift in one group (each rank sends to the next and receives from the one
/// before: no order of single calls avoids a cycle), then pipeline stages (rank r
/// receives from r - 1, then sends to r + 1, without a group).
pub fn ring_and_pipeline<B: Backend>(place: &Placement, world: usize) {
    let seed = common::seed("point_to_point");
    let config = small_payload(place, world);
    with_world_config::<B, _>(place, world, &config, |rank, comm| {
        let dev = comm.device();
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        for (tag, &n) in SIZES.iter().enumerate() {
            let send = B::alloc_from(dev, &message::<bf16>(seed, rank, tag, n)).unwrap();
            let mut recv = B::alloc_from(dev, &vec![poison::<bf16>(); n]).unwrap();
            let mut group = comm.group();
            group.send(&send, next).unwrap();
            group.recv(&mut recv, prev).unwrap();
            group.end().unwrap();
            comm.synchronize().unwrap();
            let want = message::<bf16>(seed, prev, tag, n);
            let got = recv.to_host(dev).unwrap();
            assert_eq!(
                common::bits(&got),
                common::bits(&want),
                "ring world {world} rank {rank}, {n}"
            );
        }
        // Pipeline: stage 0 makes the activations, each stage adds nothing and passes them on.
        let n = 70_001;
        let first = message::<f32>(seed, 0, 99, n);
        let mut act = B::alloc_from(dev, &vec![poison::<f32>(); n]).unwrap();
        if rank == 0 {
            act = B::alloc_from(dev, &first).unwrap();
        } else {
            comm.recv(&mut act, rank - 1).unwrap();
        }
        if rank + 1 < world {
            comm.send(&act, rank + 1).unwrap();
        }
        comm.synchronize().unwrap();
        let got = act.to_host(dev).unwrap();
        assert_eq!(
            common::bits(&got),
            common::bits(&first),
            "pipeline world {world} rank {rank}"
        );
    });
}

/// All-to-all in equal parts: part q of rank r's output is part r of rank q's input.
pub fn all_to_all_checked<B: Backend>(place: &Placement, world: usize) {
    let seed = common::seed("point_to_point");
    let config = small_payload(place, world);
    with_world_config::<B, _>(place, world, &config, |rank, comm| {
        let dev = comm.device();
        for (tag, &n) in SIZES.iter().enumerate() {
            let send = B::alloc_from(dev, &message::<f32>(seed, rank, tag, world * n)).unwrap();
            let mut recv = B::alloc_from(dev, &vec![poison::<f32>(); world * n]).unwrap();
            comm.all_to_all(&send, &mut recv).unwrap();
            comm.synchronize().unwrap();
            let got = common::bits(&recv.to_host(dev).unwrap());
            for q in 0..world {
                let theirs = common::bits(&message::<f32>(seed, q, tag, world * n));
                assert_eq!(
                    got[q * n..(q + 1) * n],
                    theirs[rank * n..(rank + 1) * n],
                    "all-to-all world {world} rank {rank}, {n} per part, part {q}"
                );
            }
        }
    });
}

/// Hidden size of the mixture-of-experts case (DeepSeek-V3's).
const HIDDEN: usize = 7168;

/// The router of the mixture-of-experts case, the same on every rank: `tokens` tokens
/// per rank, each sent to `top_k` of the world's ranks (experts live one per rank),
/// skewed so that the last rank receives nothing. Returns `counts[src][dst]`: tokens
/// rank src sends rank dst.
fn routing(world: usize, tokens: usize, top_k: usize) -> Vec<Vec<usize>> {
    let mut rng = StdRng::seed_from_u64(common::seed("moe_routing"));
    let experts = world.saturating_sub(1).max(1);
    let mut counts = vec![vec![0; world]; world];
    for row in counts.iter_mut() {
        for _ in 0..tokens {
            let first = rng.random_range(0..experts);
            for k in 0..top_k.min(experts) {
                row[(first + k) % experts] += 1;
            }
        }
    }
    counts
}

/// Dispatch and combine of a mixture-of-experts layer: each rank sends each token's row
/// to its experts' ranks (`all_to_all_v`, the router's uneven counts), then the ranks
/// send the rows back with the transposed counts; the round trip gives every rank its
/// own rows, bit for bit, and the dispatch's output is the senders' rows in rank order.
pub fn all_to_all_v_moe<B: Backend>(place: &Placement, world: usize) {
    let seed = common::seed("point_to_point");
    let config = place.config(world);
    let counts = routing(world, 24, 2);
    with_world_config::<B, _>(place, world, &config, |rank, comm| {
        let dev = comm.device();
        let send_rows: Vec<usize> = counts[rank].clone();
        let recv_rows: Vec<usize> = (0..world).map(|q| counts[q][rank]).collect();
        let elems = |rows: &[usize]| rows.iter().map(|r| r * HIDDEN).collect::<Vec<_>>();
        let (send_counts, recv_counts) = (elems(&send_rows), elems(&recv_rows));
        let total_send: usize = send_counts.iter().sum();
        let total_recv: usize = recv_counts.iter().sum();
        let mine = message::<bf16>(seed, rank, 0, total_send);
        let send = B::alloc_from(dev, &mine).unwrap();
        let mut dispatched = B::alloc_from(dev, &vec![poison::<bf16>(); total_recv]).unwrap();
        comm.all_to_all_v(&send, &send_counts, &mut dispatched, &recv_counts)
            .unwrap();
        comm.synchronize().unwrap();
        // What each sender's rows for this rank are, in rank order.
        let got = common::bits(&dispatched.to_host(dev).unwrap());
        let mut at = 0;
        for q in 0..world {
            let theirs = common::bits(&message::<bf16>(
                seed,
                q,
                0,
                counts[q].iter().sum::<usize>() * HIDDEN,
            ));
            let start = counts[q][..rank].iter().sum::<usize>() * HIDDEN;
            let n = recv_counts[q];
            assert_eq!(
                got[at..at + n],
                theirs[start..start + n],
                "dispatch world {world} rank {rank} from {q}"
            );
            at += n;
        }
        // Combine: the experts send the rows back.
        let mut back = B::alloc_from(dev, &vec![poison::<bf16>(); total_send]).unwrap();
        comm.all_to_all_v(&dispatched, &recv_counts, &mut back, &send_counts)
            .unwrap();
        comm.synchronize().unwrap();
        let round_trip = common::bits(&back.to_host(dev).unwrap());
        assert_eq!(
            round_trip,
            common::bits(&mine),
            "round trip world {world} rank {rank}"
        );
        if rank == world - 1 && world > 1 {
            assert_eq!(total_recv, 0, "the last rank's expert gets no tokens");
        }
    });
}

/// `all_to_all_v` whose parts start at every offset modulo 16 bytes in the send and the
/// receive buffers (u8, bf16 and f32 parts of uneven, odd counts, from one element to
/// more than a few packs, and parts of about 20,000 elements that span several payload
/// chunks, blocks and iterations of a thread): each part lands bit for bit, in rank
/// order.
pub fn all_to_all_v_unaligned<B: Backend>(place: &Placement, world: usize) {
    fn case<B: Backend, T: Element>(comm: &Comm<B>, seed: u64, world: usize, rank: usize) {
        let dev = comm.device();
        for round in 0..8 {
            // counts[src][dst], the same on every rank; the last rounds' parts span
            // several payload chunks, blocks and iterations of every thread.
            let big = if round >= 6 { 20_000 } else { 0 };
            let count = |src: usize, dst: usize| {
                1 + (src * 7 + dst * 5 + round * 11) % 37 + 200 * (round % 2) + big
            };
            let send_counts: Vec<usize> = (0..world).map(|q| count(rank, q)).collect();
            let recv_counts: Vec<usize> = (0..world).map(|q| count(q, rank)).collect();
            let tag = 100 + round;
            let mine = message::<T>(seed, rank, tag, send_counts.iter().sum());
            let send = B::alloc_from(dev, &mine).unwrap();
            let total: usize = recv_counts.iter().sum();
            let mut recv = B::alloc_from(dev, &vec![poison::<T>(); total]).unwrap();
            comm.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)
                .unwrap();
            comm.synchronize().unwrap();
            let got = recv.to_host(dev).unwrap();
            let mut at = 0;
            for (q, &n) in recv_counts.iter().enumerate() {
                let theirs = message::<T>(seed, q, tag, (0..world).map(|d| count(q, d)).sum());
                let start: usize = (0..rank).map(|d| count(q, d)).sum();
                assert_eq!(
                    common::bits64(&got[at..at + n]),
                    common::bits64(&theirs[start..start + n]),
                    "{} world {world} rank {rank} round {round}: part from {q}",
                    T::DTYPE.name()
                );
                at += n;
            }
        }
    }
    let seed = common::seed("point_to_point_unaligned");
    let config = small_payload(place, world);
    with_world_config::<B, _>(place, world, &config, |rank, comm| {
        case::<B, u8>(&comm, seed, world, rank);
        case::<B, bf16>(&comm, seed, world, rank);
        case::<B, f32>(&comm, seed, world, rank);
    });
}

/// A receive of another length or type than the send, or from another rank: every rank
/// of the pair gets `CallMismatch` on the field, nothing received; after `reinitialize`
/// the pair exchanges again.
pub fn send_recv_mismatch<B: Backend>(place: &Placement) {
    let seed = common::seed("point_to_point");
    let world = 2;
    let config = short_waits(place, world);
    let cases: [(&str, CallField, usize, DType); 2] = [
        ("another length", CallField::Length, 99, DType::F32),
        ("another type", CallField::DType, 100, DType::BF16),
    ];
    for (what, field, recv_len, recv_dtype) in cases {
        let results = in_step::<B, _>(place, world, &config, |rank, comm, meet| {
            let dev = comm.device();
            let got = if rank == 0 {
                let send = B::alloc_from(dev, &message::<f32>(seed, 0, 0, 100)).unwrap();
                comm.send(&send, 1).and_then(|()| comm.synchronize())
            } else {
                let out = match recv_dtype {
                    DType::BF16 => receive_poisoned::<B, bf16>(comm, recv_len),
                    _ => receive_poisoned::<B, f32>(comm, recv_len),
                };
                let (got, untouched) = out;
                assert!(untouched, "{what}: the receive wrote its buffer");
                got
            };
            meet.wait();
            comm.reinitialize().unwrap();
            let n = 33;
            if rank == 0 {
                let send = B::alloc_from(dev, &message::<f32>(seed, 0, 1, n)).unwrap();
                comm.send(&send, 1).unwrap();
            } else {
                let mut recv = B::alloc_from(dev, &vec![poison::<f32>(); n]).unwrap();
                comm.recv(&mut recv, 0).unwrap();
                comm.synchronize().unwrap();
                let want = common::bits(&message::<f32>(seed, 0, 1, n));
                assert_eq!(
                    common::bits(&recv.to_host(dev).unwrap()),
                    want,
                    "{what}: after reinitialize"
                );
            }
            comm.synchronize().unwrap();
            got
        });
        common::assert_every_rank_mismatched(&results, field, 1, what);
    }
}

/// Receives `n` elements of `T` from rank 0 into a poisoned buffer; the result and
/// whether the buffer still holds only the poison.
fn receive_poisoned<B: Backend, T: Element>(
    comm: &Comm<B>,
    n: usize,
) -> (peercomm::Result<()>, bool) {
    let dev = comm.device();
    let mut recv = B::alloc_from(dev, &vec![poison::<T>(); n]).unwrap();
    let got = comm.recv(&mut recv, 0).and_then(|()| comm.synchronize());
    let untouched =
        (recv.to_host(dev).unwrap().iter()).all(|x| x.to_bits_u32() == poison::<T>().to_bits_u32());
    (got, untouched)
}

/// Bad arguments are typed errors, nothing launched: a peer outside the world, counts
/// that do not fit their buffer or name another world, a send to itself without its
/// receive; an exchange of nothing is a no-op, and a group dropped unended runs nothing.
pub fn bad_arguments<B: Backend>(place: &Placement) {
    let world = 2;
    with_world_config::<B, _>(place, world, &place.config(world), |rank, comm| {
        let dev = comm.device();
        let a = B::alloc_from(dev, &[1.0f32; 8]).unwrap();
        let mut b = B::alloc_from(dev, &[poison::<f32>(); 8]).unwrap();
        assert!(matches!(
            comm.send(&a, 2),
            Err(Error::InvalidPeer { peer: 2, world: 2 })
        ));
        assert!(matches!(
            comm.recv(&mut b, 5),
            Err(Error::InvalidPeer { .. })
        ));
        let too_many = comm.all_to_all_v(&a, &[5, 4], &mut b, &[4, 4]);
        assert!(
            matches!(too_many, Err(Error::LengthMismatch { .. })),
            "{too_many:?}"
        );
        let other_world = comm.all_to_all_v(&a, &[4, 4, 0], &mut b, &[4, 4]);
        assert!(
            matches!(other_world, Err(Error::LengthMismatch { .. })),
            "{other_world:?}"
        );
        let odd = B::alloc_from(dev, &[1.0f32; 7]).unwrap();
        assert!(matches!(
            comm.all_to_all(&odd, &mut b),
            Err(Error::LengthMismatch { .. })
        ));
        let itself = comm.send(&a, rank);
        assert!(matches!(itself, Err(Error::Unsupported(_))), "{itself:?}");
        {
            // A second send to one peer starts a second exchange; dropped, nothing runs.
            let mut group = comm.group();
            group.send(&a, 1 - rank).unwrap();
            group.send(&a, 1 - rank).unwrap();
            assert_eq!(group.len(), 2);
        }
        let nothing = comm.all_to_all_v(&a, &[0, 0], &mut b, &[0, 0]);
        assert!(nothing.is_ok(), "an exchange of nothing: {nothing:?}");
        comm.synchronize().unwrap();
        assert!(
            b.to_host(dev)
                .unwrap()
                .iter()
                .all(|&x| x == poison::<f32>()),
            "rank {rank}: written"
        );
    });
}

/// Two ranks that both send and neither receives: `CallMismatch` on the element type
/// (each side says the other sends nothing) on both, nothing written; a send to a rank
/// that receives from another (world 3): the sender's wait times out naming that rank,
/// every other rank is told (`PeerAborted`), after the barrier timeout, and nothing is
/// received. After `reinitialize` the ranks exchange again.
pub fn unmatched_sends<B: Backend>(place: &Placement) {
    let seed = common::seed("point_to_point");
    let config = short_waits(place, 2);
    let results = in_step::<B, _>(place, 2, &config, |rank, comm, meet| {
        let dev = comm.device();
        let send = B::alloc_from(dev, &message::<f32>(seed, rank, 0, 64)).unwrap();
        let got = comm.send(&send, 1 - rank).and_then(|()| comm.synchronize());
        meet.wait();
        comm.reinitialize().unwrap();
        got
    });
    common::assert_every_rank_mismatched(&results, CallField::DType, 1, "both send");

    let world = 3;
    let config = short_waits(place, world);
    let results = in_step::<B, _>(place, world, &config, |rank, comm, meet| {
        let dev = comm.device();
        let send = B::alloc_from(dev, &message::<f32>(seed, rank, 1, 64)).unwrap();
        let mut recv = B::alloc_from(dev, &vec![poison::<f32>(); 64]).unwrap();
        // Rank 0 sends to rank 1, which receives from rank 2, which sends to rank 1.
        let got = match rank {
            0 => comm.send(&send, 1),
            1 => comm.recv(&mut recv, 2),
            _ => comm.send(&send, 1),
        };
        let first = got.and_then(|()| comm.synchronize());
        meet.wait();
        // Rank 0's record reaches every rank: a later wait reports it.
        let later = comm.synchronize();
        meet.wait();
        comm.reinitialize().unwrap();
        let received = recv.to_host(dev).unwrap();
        (first, later, received)
    });
    match &results[0].0 {
        Err(Error::BarrierTimeout { waiting_for, .. }) => assert_eq!(*waiting_for, Some(1)),
        other => panic!("rank 0: {other:?}, not a timeout waiting for rank 1"),
    }
    for (rank, (first, later, _)) in results.iter().enumerate().skip(1) {
        let told = matches!(first, Err(Error::PeerAborted { .. }))
            || matches!(later, Err(Error::PeerAborted { .. }));
        assert!(
            told,
            "rank {rank}: {first:?} then {later:?}, never PeerAborted"
        );
    }
    // Rank 1's receive from rank 2 may have completed before the abort: it holds rank
    // 2's message then, else the poison.
    let want = common::bits(&message::<f32>(seed, 2, 1, 64));
    let got = common::bits(&results[1].2);
    let poisoned = common::bits(&vec![poison::<f32>(); 64]);
    assert!(
        got == want || got == poisoned,
        "rank 1 received something else"
    );
}

/// An all-to-all-v whose ranks 0 and 1 disagree on a count (world 3, a long barrier
/// timeout): `CallMismatch` on the length for those two, and rank 2, whose pairs
/// matched, is told at once (`PeerAborted`), long before the timeout. After
/// `reinitialize` the three exchange again.
pub fn a_mismatched_pair_stops_the_others<B: Backend>(place: &Placement) {
    let world = 3;
    let timeout = std::time::Duration::from_secs(20);
    let config = place.config(world).with_barrier_timeout(Some(timeout));
    let results = in_step::<B, _>(place, world, &config, |rank, comm, meet| {
        let dev = comm.device();
        let send = B::alloc_from(dev, &[rank as f32; 12]).unwrap();
        let mut recv = B::alloc_from(dev, &[poison::<f32>(); 13]).unwrap();
        let mut recv_counts = vec![4, 4, 4];
        if rank == 1 {
            recv_counts[0] = 5; // rank 0 sends 4
        }
        let start = std::time::Instant::now();
        let got = comm
            .all_to_all_v(&send, &[4, 4, 4], &mut recv, &recv_counts)
            .and_then(|()| comm.synchronize());
        let took = start.elapsed();
        meet.wait();
        comm.reinitialize().unwrap();
        let mut again = B::alloc_from(dev, &[poison::<f32>(); 12]).unwrap();
        comm.all_to_all(&send, &mut again).unwrap();
        comm.synchronize().unwrap();
        let want: Vec<f32> = (0..world).flat_map(|q| vec![q as f32; 4]).collect();
        assert_eq!(
            again.to_host(dev).unwrap(),
            want,
            "rank {rank} after reinitialize"
        );
        (got, took)
    });
    for (rank, (got, took)) in results.iter().enumerate() {
        match (rank, got) {
            (0 | 1, Err(Error::CallMismatch { field, .. })) => {
                assert_eq!(*field, CallField::Length, "rank {rank}")
            }
            (2, Err(Error::PeerAborted { .. })) => {}
            _ => panic!("rank {rank}: {got:?}"),
        }
        assert!(
            *took < timeout / 2,
            "rank {rank} waited {took:?} (timeout {timeout:?})"
        );
    }
}

/// The `_with` forms (world 4): over groups of two, peers and counts are members of the
/// rank's group (an all-to-all and a pair exchange inside each group, checked bit for
/// bit, blocks asked alike); blocks asked differently by the two ranks of a pair are
/// `CallMismatch` on the blocks, nothing received; a peer outside the group, a group
/// size that does not divide the world and another algorithm are typed errors.
pub fn options_and_groups<B: Backend>(place: &Placement) {
    let seed = common::seed("point_to_point_options");
    let world = 4;
    let halves = CollectiveOptions::new().group_size(2);
    with_world_config::<B, _>(place, world, &small_payload(place, world), |rank, comm| {
        let dev = comm.device();
        let (base, member) = (rank / 2 * 2, rank % 2);
        for (tag, &n) in SIZES.iter().enumerate() {
            let send = B::alloc_from(dev, &message::<f32>(seed, rank, tag, 2 * n)).unwrap();
            let mut recv = B::alloc_from(dev, &vec![poison::<f32>(); 2 * n]).unwrap();
            comm.all_to_all_with(&send, &mut recv, &halves).unwrap();
            comm.synchronize().unwrap();
            let got = common::bits(&recv.to_host(dev).unwrap());
            for q in 0..2 {
                let theirs = common::bits(&message::<f32>(seed, base + q, tag, 2 * n));
                assert_eq!(
                    got[q * n..(q + 1) * n],
                    theirs[member * n..(member + 1) * n],
                    "group all-to-all rank {rank}, {n} per part, member {q}"
                );
            }
            // The pair in the group swaps, with three blocks asked by both.
            let opts = halves.blocks(3);
            let mut back = B::alloc_from(dev, &vec![poison::<f32>(); 2 * n]).unwrap();
            let mut group = comm.group();
            group.send_with(&send, 1 - member, &opts).unwrap();
            group.recv_with(&mut back, 1 - member, &opts).unwrap();
            group.end().unwrap();
            comm.synchronize().unwrap();
            let want = message::<f32>(seed, base + 1 - member, tag, 2 * n);
            assert_eq!(
                common::bits(&back.to_host(dev).unwrap()),
                common::bits(&want),
                "group pair rank {rank}, {n}"
            );
        }
        let a = B::alloc_from(dev, &[1.0f32; 8]).unwrap();
        let mut b = B::alloc_from(dev, &[poison::<f32>(); 8]).unwrap();
        assert!(matches!(
            comm.send_with(&a, 2, &halves),
            Err(Error::InvalidPeer { peer: 2, world: 2 })
        ));
        let uneven = comm.all_to_all_with(&a, &mut b, &CollectiveOptions::new().group_size(3));
        assert!(uneven.is_err(), "group size 3 of 4: {uneven:?}");
        let two_stage = CollectiveOptions::new().algorithm(Algorithm::TwoStage);
        let other = comm.recv_with(&mut b, 1 - member, &two_stage);
        assert!(matches!(other, Err(Error::Unsupported(_))), "{other:?}");
        let counts = comm.all_to_all_v_with(&a, &[4, 4, 0, 0], &mut b, &[4, 4], &halves);
        assert!(
            matches!(counts, Err(Error::LengthMismatch { .. })),
            "counts for the world over groups: {counts:?}"
        );
        comm.synchronize().unwrap();
        assert_eq!(
            b.to_host(dev).unwrap(),
            vec![poison::<f32>(); 8],
            "rank {rank}: written"
        );
    });

    let config = short_waits(place, 2);
    let results = in_step::<B, _>(place, 2, &config, |rank, comm, meet| {
        let dev = comm.device();
        let got = if rank == 0 {
            let send = B::alloc_from(dev, &[1.0f32; 64]).unwrap();
            let opts = CollectiveOptions::new().blocks(2);
            comm.send_with(&send, 1, &opts)
                .and_then(|()| comm.synchronize())
        } else {
            let (got, untouched) = receive_poisoned::<B, f32>(comm, 64);
            assert!(
                untouched,
                "blocks asked differently: the receive wrote its buffer"
            );
            got
        };
        meet.wait();
        comm.reinitialize().unwrap();
        got
    });
    common::assert_every_rank_mismatched(&results, CallField::Blocks, 1, "blocks differ");
}

/// Sends read in place (world `world`, payload regions small enough that the larger
/// sizes run in chunks): an all-to-all from a symmetric buffer, a ring shift from a
/// symmetric buffer beside plain ones (even ranks send from the pool, odd ranks from
/// plain memory: the receiver cannot tell), and an uneven all-to-all-v from a registered
/// buffer; every output poisoned first and checked bit for bit.
pub fn in_place_sends<B: Backend>(place: &Placement, world: usize) {
    let seed = common::seed("point_to_point_in_place");
    let config = small_payload(place, world);
    with_world_config::<B, _>(place, world, &config, |rank, comm| {
        let dev = comm.device();
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        for (tag, &n) in SIZES.iter().enumerate() {
            let what = |call: &str| format!("{call}: world {world} rank {rank}, {n} a part");
            let mine = message::<f32>(seed, rank, tag, world * n);
            let mut sym = comm.alloc_symmetric::<f32>(world * n).unwrap();
            sym.copy_from_host(dev, &mine).unwrap();
            let mut recv = B::alloc_from(dev, &vec![poison::<f32>(); world * n]).unwrap();
            comm.all_to_all(&sym, &mut recv).unwrap();
            comm.synchronize().unwrap();
            let got = common::bits(&recv.to_host(dev).unwrap());
            for q in 0..world {
                let theirs = common::bits(&message::<f32>(seed, q, tag, world * n));
                let (part, theirs_part) = (q * n..(q + 1) * n, rank * n..(rank + 1) * n);
                assert_eq!(got[part], theirs[theirs_part], "{}", what("all-to-all"));
            }

            let plain = B::alloc_from(dev, &mine).unwrap();
            let mut ring = B::alloc_from(dev, &vec![poison::<f32>(); world * n]).unwrap();
            let mut group = comm.group();
            match rank % 2 {
                0 => group.send(&sym, next).unwrap(),
                _ => group.send(&plain, next).unwrap(),
            }
            group.recv(&mut ring, prev).unwrap();
            group.end().unwrap();
            comm.synchronize().unwrap();
            let want = common::bits(&message::<f32>(seed, prev, tag, world * n));
            let got = common::bits(&ring.to_host(dev).unwrap());
            assert_eq!(got, want, "{}", what("ring shift"));

            // Uneven: rank r sends rank q (r + q) % 3 * n elements.
            let count = |r: usize, q: usize| (r + q) % 3 * n;
            let sends: Vec<usize> = (0..world).map(|q| count(rank, q)).collect();
            let recvs: Vec<usize> = (0..world).map(|q| count(q, rank)).collect();
            let data = message::<f32>(seed, rank, tag + 10, 3 * world * n);
            let registered = comm.register(B::alloc_from(dev, &data).unwrap()).unwrap();
            let total: usize = recvs.iter().sum();
            let mut out = B::alloc_from(dev, &vec![poison::<f32>(); total.max(1)]).unwrap();
            comm.all_to_all_v(&registered, &sends, &mut out, &recvs)
                .unwrap();
            comm.synchronize().unwrap();
            let got = common::bits(&out.to_host(dev).unwrap());
            let mut at = 0;
            for q in 0..world {
                let theirs = common::bits(&message::<f32>(seed, q, tag + 10, 3 * world * n));
                let start: usize = (0..rank).map(|r| count(q, r)).sum();
                let len = count(q, rank);
                assert_eq!(
                    got[at..at + len],
                    theirs[start..start + len],
                    "{} from {q}",
                    what("registered all-to-all-v")
                );
                at += len;
            }
        }
    });
}

/// A send read in place that no rank receives (world 2, rank 1 makes no call): rank 0's
/// wait times out (`BarrierTimeout` naming rank 1) within twice the timeout (the block
/// also waits, bounded, for the peer that might read its buffer); after `reinitialize`
/// the pair exchanges from the same symmetric buffer again.
pub fn unreceived_in_place_send<B: Backend>(place: &Placement) {
    let config = short_waits(place, 2);
    let timeout = config.barrier_timeout.unwrap();
    let results = in_step::<B, _>(place, 2, &config, |rank, comm, meet| {
        let dev = comm.device();
        let mut sym = comm.alloc_symmetric::<f32>(64).unwrap();
        sym.copy_from_host(dev, &[rank as f32 + 1.0; 64]).unwrap();
        let start = std::time::Instant::now();
        let got = match rank {
            0 => comm.send(&sym, 1).and_then(|()| comm.synchronize()),
            _ => Ok(()),
        };
        let took = start.elapsed();
        meet.wait();
        comm.reinitialize().unwrap();
        let mut recv = B::alloc_from(dev, &[poison::<f32>(); 64]).unwrap();
        let mut group = comm.group();
        group.send(&sym, 1 - rank).unwrap();
        group.recv(&mut recv, 1 - rank).unwrap();
        group.end().unwrap();
        comm.synchronize().unwrap();
        let want = vec![(2 - rank) as f32; 64];
        assert_eq!(
            recv.to_host(dev).unwrap(),
            want,
            "rank {rank} after reinitialize"
        );
        (got, took)
    });
    match &results[0].0 {
        Err(Error::BarrierTimeout { waiting_for, .. }) => assert_eq!(*waiting_for, Some(1)),
        other => panic!("rank 0: {other:?}, not a timeout waiting for rank 1"),
    }
    let took = results[0].1;
    let bound = 2 * timeout + std::time::Duration::from_secs(2);
    assert!(took < bound, "rank 0 took {took:?} (timeout {timeout:?})");
}
