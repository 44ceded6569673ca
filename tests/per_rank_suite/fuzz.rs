//! The schedule fuzzer through the per-rank API, one thread and `Comm` per rank, one
//! seed (`PEERCOMM_SEED`) for all: random lengths, widths, algorithms (refused ones
//! write nothing), operators, in and out of place, -0.0 lanes, delays, one call in five
//! another collective. Batches run unsynchronised, then are checked against f64 and by group
//! digests. After about every other batch, one call over a type beyond f32 (f64 or an
//! integer: an all-reduce with its operator, or another collective), checked alone; after
//! some batches an exchange (a send/recv ring, pairs, or an all-to-all-v with random
//! counts) over any type, checked bit for bit. Now and then a deliberate mismatch must give `CallMismatch` everywhere and
//! `reinitialize()` recover. Ranks report different multiprocessor counts.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

use peercomm::backend::{Backend, DeviceBuffer, TypedBuffer};
use peercomm::Simulation;
use peercomm::{
    Algorithm, AllReduceOptions, CallField, CollectiveOptions, Comm, CommConfig, DType, Element,
    Error, ReduceOp,
};

use super::common::collectives::{assert_bits, expect, input_len, output_len, Which};
use super::{common, nan, processes, seed, with_world_config, Placement};

/// One call of the schedule, the same on every rank.
#[derive(Clone, Debug)]
struct Call {
    len: usize,
    group: usize,
    algorithm: Algorithm,
    /// The all-reduce's operator (a sum two calls in three).
    op: ReduceOp,
    in_place: bool,
    /// A rank made late before this call, and by how long.
    delay: Option<(usize, Duration)>,
    /// Whether the library must refuse it.
    refused: bool,
    /// One of the other collectives instead of an all-reduce (`len` per member).
    collective: Option<Which>,
}

fn schedule(seed: u64, world: usize, calls: usize) -> Vec<Call> {
    let mut rng = StdRng::seed_from_u64(seed);
    let groups = common::group_sizes(world);
    (0..calls)
        .map(|_| {
            let len = match rng.random_range(0..10) {
                0..=5 => rng.random_range(1..2048),
                6..=8 => rng.random_range(2048..65_536),
                _ => rng.random_range(65_536..262_144),
            };
            let group = groups[rng.random_range(0..groups.len())];
            let algorithm = super::ALL_ALGORITHMS[rng.random_range(0..4)];
            let op = match rng.random_range(0..3) {
                0 => ReduceOp::ALL[rng.random_range(1..ReduceOp::ALL.len())],
                _ => ReduceOp::Sum,
            };
            let refused = match algorithm {
                Algorithm::TwoStage => group > 1,
                // Lamport runs over the whole world only.
                Algorithm::Lamport => group > 1 && group < world,
                _ => false,
            };
            let ms = |ms| Duration::from_millis(ms);
            let delay = rng
                .random_bool(0.1)
                .then(|| (rng.random_range(0..world), ms(rng.random_range(0..3))));
            let collective = rng.random_bool(0.2).then(|| {
                let root = rng.random_range(0..group);
                let broadcast = |in_place| Which::Broadcast { root, in_place };
                let (gather, scatter) = (Which::AllGather, Which::Scatter { root });
                let reduce = Which::Reduce { root };
                [
                    gather,
                    Which::ReduceScatter,
                    broadcast(false),
                    scatter,
                    reduce,
                ][rng.random_range(0..5)]
            });
            // A scatter's root stages group x len elements: keep them within the payload.
            let len = match collective {
                Some(Which::Scatter { .. }) => len.min(262_144 / group),
                _ => len,
            };
            Call {
                len,
                group,
                algorithm,
                op,
                in_place: rng.random_bool(0.5),
                delay,
                refused: refused && collective.is_none(),
                collective,
            }
        })
        .collect()
}

/// Input of `rank` for call `call`: random, with some -0.0 lanes.
fn input(seed: u64, call: usize, rank: usize, len: usize) -> Vec<f32> {
    let mut v = processes::input(seed, call, rank, len);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed ^ ((call as u64) << 8));
    for x in v.iter_mut() {
        if rng.random_bool(0.05) {
            *x = -0.0; // the same lanes on every rank: their sum is -0.0 (or +0.0 on Lamport)
        }
    }
    v
}

/// A call over a type beyond f32, f16 and bf16, the same on every rank.
#[derive(Clone, Copy, Debug)]
struct Typed {
    dtype: DType,
    group: usize,
    len: usize,
    op: ReduceOp,
    /// Another collective instead of an all-reduce.
    collective: Option<Which>,
}

/// Whether the ranks make a [`Typed`] call after batch `batch`, and which (drawn from
/// the seed).
fn typed_after(seed: u64, batch: usize, world: usize) -> Option<Typed> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x7479_7065 ^ ((batch as u64) << 20));
    if !rng.random_bool(0.5) {
        return None;
    }
    let groups = common::group_sizes(world);
    let group = groups[rng.random_range(0..groups.len())];
    let root = rng.random_range(0..group);
    let collective = [
        None,
        None,
        Some(Which::AllGather),
        Some(Which::ReduceScatter),
        Some(Which::Broadcast {
            root,
            in_place: rng.random_bool(0.5),
        }),
        Some(Which::Scatter { root }),
        Some(Which::Reduce { root }),
    ][rng.random_range(0..7)];
    Some(Typed {
        dtype: DType::ALL[rng.random_range(3..DType::ALL.len())],
        group,
        len: rng.random_range(1..20_000),
        op: ReduceOp::ALL[rng.random_range(0..ReduceOp::ALL.len())],
        collective,
    })
}

/// This rank's part of a [`Typed`] call, checked: the other collectives against the
/// reference, the all-reduce with its operator bit for bit (`Avg` over an integer
/// refused, nothing written).
fn typed_call<B: Backend, T: Element>(comm: &Comm<B>, seed: u64, call: usize, t: Typed) {
    if let Some(w) = t.collective {
        // A scatter's root stages group x len elements: keep them within the payload.
        let len = match w {
            Which::Scatter { .. } => t.len.min(65_536 / t.group).max(1),
            _ => t.len,
        };
        return super::collectives::check_call::<B, T>(comm, seed, call, w, t.group, len);
    }
    let (dev, world, rank) = (comm.device(), comm.world_size(), comm.rank());
    let what = format!("seed {seed} typed call {call} rank {rank}: {t:?}");
    let ins = super::inputs::<T>(seed, call, world, t.len);
    let send = B::alloc_from(dev, &ins[rank]).unwrap();
    let mut recv = B::alloc_from(dev, &nan::<T>(t.len)).unwrap();
    let opts = AllReduceOptions::new().group_size(t.group);
    let outcome = comm.all_reduce_with(&send, &mut recv, &t.op, &opts);
    comm.synchronize().unwrap();
    let got = B::download(dev, &recv).unwrap();
    if t.op == ReduceOp::Avg && !T::DTYPE.is_float() {
        assert!(
            matches!(outcome, Err(Error::Unsupported(_))),
            "{what}: {outcome:?}"
        );
        assert_bits(
            &got,
            &nan::<T>(t.len),
            &format!("{what}: a refused call wrote"),
        );
        return;
    }
    assert_eq!(
        outcome.unwrap_or_else(|e| panic!("{what}: {e}")),
        Algorithm::OneStage
    );
    let base = rank / t.group * t.group;
    let group: Vec<&Vec<T>> = ins[base..base + t.group].iter().collect();
    common::check_op(t.op, &group, &got, 0, &what);
}

/// A point-to-point call the ranks make between batches, the same on every rank.
#[derive(Clone, Debug)]
enum Exchange {
    /// A group: each rank sends `len` to the next and receives from the one before.
    Ring { len: usize },
    /// Ranks 2k and 2k + 1 swap `len` elements in a group (a last odd rank idles).
    Pairs { len: usize },
    /// `counts[r][q]`: what rank r sends rank q (some zero).
    AllToAllV { counts: Vec<Vec<usize>> },
}

/// Whether the ranks make an [`Exchange`] after batch `batch`: its element type and
/// shape (drawn from the seed; any type, lengths past a payload region at times).
fn exchange_after(seed: u64, batch: usize, world: usize) -> Option<(DType, Exchange)> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x7032_7032 ^ ((batch as u64) << 20));
    if world < 2 || !rng.random_bool(0.4) {
        return None;
    }
    let dtype = DType::ALL[rng.random_range(0..DType::ALL.len())];
    let mut len = || match rng.random_range(0..4) {
        0 => rng.random_range(1..16),
        3 => rng.random_range(100_000..400_000),
        _ => rng.random_range(16..20_000),
    };
    let shape = match batch % 3 {
        0 => Exchange::Ring { len: len() },
        1 => Exchange::Pairs { len: len() },
        _ => {
            let mut count = || {
                if rng.random_bool(0.3) {
                    0
                } else {
                    rng.random_range(1..5000)
                }
            };
            let counts = (0..world)
                .map(|_| (0..world).map(|_| count()).collect())
                .collect();
            Exchange::AllToAllV { counts }
        }
    };
    Some((dtype, shape))
}

/// This rank's part of an [`Exchange`] (call number `call`), every received element
/// checked bit for bit against what its sender sent, outputs poisoned first.
fn exchange_call<B: Backend, T: Element>(comm: &Comm<B>, seed: u64, call: usize, x: &Exchange) {
    let (dev, world, rank) = (comm.device(), comm.world_size(), comm.rank());
    let what = format!("seed {seed} exchange {call} rank {rank}: {:?}", T::DTYPE);
    // (what this rank sends each rank, what it receives from each) in elements.
    let (sends, recvs): (Vec<usize>, Vec<usize>) = match x {
        Exchange::Ring { len } => (
            (0..world)
                .map(|q| if q == (rank + 1) % world { *len } else { 0 })
                .collect(),
            (0..world)
                .map(|q| if (q + 1) % world == rank { *len } else { 0 })
                .collect(),
        ),
        Exchange::Pairs { len } => {
            let peer = rank ^ 1;
            let n = |q: usize| if q == peer && peer < world { *len } else { 0 };
            ((0..world).map(n).collect(), (0..world).map(n).collect())
        }
        Exchange::AllToAllV { counts } => (
            counts[rank].clone(),
            (0..world).map(|q| counts[q][rank]).collect(),
        ),
    };
    let total = |v: &[usize]| v.iter().sum::<usize>();
    let mine: Vec<T> = super::inputs::<T>(seed ^ rank as u64, call, 1, total(&sends)).remove(0);
    let send = B::alloc_from(dev, &mine).unwrap();
    let mut recv = B::alloc_from(dev, &nan::<T>(total(&recvs))).unwrap();
    match x {
        Exchange::AllToAllV { .. } => comm.all_to_all_v(&send, &sends, &mut recv, &recvs),
        _ => {
            let mut group = comm.group();
            let to = sends.iter().position(|&n| n > 0);
            let from = recvs.iter().position(|&n| n > 0);
            if let Some(q) = to {
                group.send(&send, q).unwrap();
            }
            if let Some(q) = from {
                group.recv(&mut recv, q).unwrap();
            }
            group.end().map(drop)
        }
    }
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    comm.synchronize().unwrap_or_else(|e| panic!("{what}: {e}"));
    let got = B::download(dev, &recv).unwrap();
    let mut at = 0;
    for q in 0..world {
        let n = recvs[q];
        if n == 0 {
            continue;
        }
        let (theirs_to, theirs) = match x {
            Exchange::AllToAllV { counts } => (counts[q].clone(), counts[q].iter().sum()),
            _ => (vec![n; 1], n),
        };
        let sent: Vec<T> = super::inputs::<T>(seed ^ q as u64, call, 1, theirs).remove(0);
        let start = match x {
            Exchange::AllToAllV { .. } => theirs_to[..rank].iter().sum(),
            _ => 0,
        };
        assert_bits(
            &got[at..at + n],
            &sent[start..start + n],
            &format!("{what}: from rank {q}"),
        );
        at += n;
    }
}

/// A mismatched call the ranks make on purpose: rank `odd` differs in `field`.
#[derive(Clone, Copy, Debug)]
struct Mismatch {
    odd: usize,
    field: CallField,
    len: usize,
}

/// Whether the ranks make a mismatched call after batch `batch`, and which (the same
/// on every rank: drawn from the seed).
fn mismatch_after(seed: u64, batch: usize, world: usize) -> Option<Mismatch> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6d69_736d ^ ((batch as u64) << 20));
    if world < 2 || !rng.random_bool(0.12) {
        return None;
    }
    let field = [
        CallField::Length,
        CallField::Root,
        CallField::Collective,
        CallField::Blocks,
        CallField::Sequence,
        CallField::Op,
    ][rng.random_range(0..6usize)];
    Some(Mismatch {
        odd: rng.random_range(0..world),
        field,
        len: rng.random_range(2..5000),
    })
}

/// Every rank's part of a mismatched call; returns what `synchronize` said, after
/// checking that nothing was written.
fn mismatched_call<B: Backend>(comm: &Comm<B>, rank: usize, m: Mismatch) -> peercomm::Result<()> {
    let dev = comm.device();
    let odd = rank == m.odd;
    let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    let opts = CollectiveOptions::new();
    let len = if m.field == CallField::Length && odd {
        m.len - 1
    } else {
        m.len
    };
    let send = B::alloc_from(dev, &vec![rank as f32 + 0.5; len]).unwrap();
    // An all-gather's output holds every member's part; the others' one message.
    let gathers = m.field == CallField::Collective && !odd;
    let out_len = len * if gathers { comm.world_size() } else { 1 };
    let mut recv = B::alloc_from(dev, &nan::<f32>(out_len)).unwrap();
    let enqueued = match m.field {
        CallField::Root => comm.broadcast_with(Some(&send), &mut recv, usize::from(odd), &opts),
        CallField::Collective if odd => comm.broadcast_with(Some(&send), &mut recv, 0, &opts),
        CallField::Collective => comm.all_gather_with(&send, &mut recv, &opts),
        field => {
            if field == CallField::Sequence && odd {
                comm.mismatch_next();
            }
            let opts = match field {
                CallField::Blocks => one.blocks(if odd { 1 } else { 2 }),
                _ => one,
            };
            let op = match field {
                CallField::Op if odd => ReduceOp::Min,
                _ => ReduceOp::Sum,
            };
            comm.all_reduce_with(&send, &mut recv, &op, &opts).map(drop)
        }
    };
    // The other collectives must enqueue; an all-reduce may refuse at once.
    let all_reduce = !matches!(m.field, CallField::Root | CallField::Collective);
    assert!(all_reduce || enqueued.is_ok(), "rank {rank}: {enqueued:?}");
    let e = comm.synchronize();
    let untouched = || recv.to_host(dev).unwrap().iter().all(|x| x.is_nan());
    let holds = e.is_ok() || untouched();
    assert!(holds, "rank {rank}: a mismatched call wrote its output");
    enqueued.and(e)
}

/// The fuzzer's configuration: the suite's, with simulated multiprocessor counts that
/// differ between ranks and the grid left to peercomm.
fn fuzz_config(place: &Placement, world: usize) -> CommConfig {
    place.config(world).with_max_blocks(None).with_simulate(
        Simulation::default()
            .with_multiprocessors((0..world).map(|r| 2 + (r * 5 + 1) % 3).collect()),
    )
}

/// Runs `calls` calls in batches of up to `batch` on `world` threads.
pub fn fuzz_threads<B: Backend>(place: &Placement, world: usize, calls: usize, batch: usize) {
    let seed = seed(&format!("per_rank_fuzz_world_{world}"));
    let plan = schedule(seed, world, calls);
    let started = std::time::Instant::now();
    let config = fuzz_config(place, world);
    let mismatches = (0..plan.len().div_ceil(batch))
        .filter_map(|b| mismatch_after(seed, b, world))
        .count();
    let typed = (0..plan.len().div_ceil(batch))
        .filter_map(|b| typed_after(seed, b, world))
        .count();
    let exchanges = (0..plan.len().div_ceil(batch))
        .filter_map(|b| exchange_after(seed, b, world))
        .count();
    let results = with_world_config::<B, _>(place, world, &config, |rank, comm| {
        let dev = comm.device();
        let mut digests = Vec::new();
        for (first, chunk) in plan.chunks(batch).enumerate().map(|(i, c)| (i * batch, c)) {
            let mut bufs: Vec<processes::SendRecv<B>> = chunk
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let (len, out_len, in_place) = match c.collective {
                        Some(w) => {
                            let len = input_len(w, c.group, c.len);
                            (len, output_len(w, c.group, rank, len), false)
                        }
                        None => (c.len, c.len, c.in_place),
                    };
                    let send = B::alloc_from(dev, &input(seed, first + i, rank, len)).unwrap();
                    let recv = (!in_place).then(|| B::alloc_from(dev, &nan(out_len)).unwrap());
                    (send, recv)
                })
                .collect();
            // Every third batch goes through a group (the same on every rank): its
            // all-reduces are launched at the group's end, batched where they can be;
            // the other collectives are launched as they come.
            let ran = {
                let mut group = (first / batch % 3 == 1).then(|| comm.group());
                let mut grouped = Vec::new();
                let mut ran: Vec<Option<peercomm::Result<Algorithm>>> = Vec::new();
                for (i, (c, (send, recv))) in chunk.iter().zip(&mut bufs).enumerate() {
                    if let Some((late, by)) = c.delay {
                        if late == rank {
                            comm.delay(by).unwrap();
                        }
                    }
                    if let Some(w) = c.collective {
                        let recv = recv.as_mut().expect("collectives run out of place");
                        let opts = CollectiveOptions::new().group_size(c.group);
                        let root = |r: usize| {
                            (rank % c.group == r).then_some(&*send as &dyn DeviceBuffer<B>)
                        };
                        let done = match w {
                            Which::AllGather => comm.all_gather_with(send, recv, &opts),
                            Which::ReduceScatter => {
                                comm.reduce_scatter_with(send, recv, &ReduceOp::Sum, &opts)
                            }
                            Which::Broadcast { root: r, .. } => {
                                comm.broadcast_with(root(r), recv, r, &opts)
                            }
                            Which::Scatter { root: r } => {
                                comm.scatter_with(root(r), recv, r, &opts)
                            }
                            Which::Reduce { root: r } => {
                                comm.reduce_with(send, Some(recv), &ReduceOp::Sum, r, &opts)
                            }
                        };
                        ran.push(Some(done.map(|()| Algorithm::OneStage)));
                        continue;
                    }
                    let opts = AllReduceOptions::new()
                        .group_size(c.group)
                        .algorithm(c.algorithm);
                    if let Some(g) = group.as_mut() {
                        let added = match recv {
                            None => g.all_reduce_in_place_with(send, &c.op, &opts),
                            Some(recv) => g.all_reduce_with(&*send, recv, &c.op, &opts),
                        };
                        match added {
                            Ok(()) => {
                                grouped.push(i);
                                ran.push(None);
                            }
                            Err(e) => ran.push(Some(Err(e))),
                        }
                        continue;
                    }
                    ran.push(Some(match recv {
                        None => comm.all_reduce_in_place_with(send, &c.op, &opts),
                        Some(recv) => comm.all_reduce_with(send, recv, &c.op, &opts),
                    }));
                }
                if let Some(g) = group {
                    let algorithms = g
                        .end()
                        .unwrap_or_else(|e| panic!("seed {seed}: group: {e}"));
                    for (&i, a) in grouped.iter().zip(algorithms) {
                        ran[i] = Some(Ok(a));
                    }
                }
                ran
            };
            let ran: Vec<peercomm::Result<Algorithm>> = ran
                .into_iter()
                .map(|o| o.expect("every call ran"))
                .collect();
            comm.synchronize().unwrap();
            for (i, ((c, (send, recv)), outcome)) in chunk.iter().zip(&bufs).zip(ran).enumerate() {
                let call = first + i;
                let what = format!("seed {seed} call {call} rank {rank}: {c:?}");
                let out = recv.as_ref().unwrap_or(send);
                let got = B::download(dev, out).unwrap();
                if let Some(w) = c.collective {
                    outcome.unwrap_or_else(|e| panic!("{what}: {e}"));
                    let len = input_len(w, c.group, c.len);
                    let ins: Vec<Vec<f32>> =
                        (0..world).map(|r| input(seed, call, r, len)).collect();
                    assert_bits(&got, &expect(w, &ins, c.group, rank), &what);
                    continue;
                }
                if c.refused {
                    let holds = matches!(outcome, Err(Error::Unsupported(_)));
                    assert!(holds, "{what}: {outcome:?}");
                    let untouched = if c.in_place {
                        input(seed, call, rank, c.len)
                    } else {
                        vec![f32::NAN; c.len]
                    };
                    assert_bits(&got, &untouched, &format!("{what}: a refused call wrote"));
                    continue;
                }
                let algorithm = outcome.unwrap_or_else(|e| panic!("{what}: {e}"));
                let base = rank / c.group * c.group;
                let ins: Vec<Vec<f32>> = (base..base + c.group)
                    .map(|r| input(seed, call, r, c.len))
                    .collect();
                if c.op == ReduceOp::Sum {
                    common::check_result(
                        &ins,
                        &vec![got.clone(); c.group],
                        c.group,
                        algorithm,
                        &what,
                    );
                } else {
                    common::check_op(c.op, &ins.iter().collect::<Vec<_>>(), &got, 0, &what);
                }
                digests.push((call, rank, common::digest(&got)));
            }
            if let Some(t) = typed_after(seed, first / batch, world) {
                // Call numbers past the schedule's, one per batch.
                let call = plan.len() + first / batch;
                by_dtype!(t.dtype, typed_call::<B>(&comm, seed, call, t));
            }
            if let Some((dtype, x)) = exchange_after(seed, first / batch, world) {
                // Call numbers past the typed calls'.
                let call = 2 * plan.len() + first / batch;
                by_dtype!(dtype, exchange_call::<B>(&comm, seed, call, &x));
            }
            if let Some(m) = mismatch_after(seed, first / batch, world) {
                let what = format!("seed {seed} after call {first}, rank {rank}: {m:?}");
                let started = std::time::Instant::now();
                let got = mismatched_call(&comm, rank, m);
                if std::env::var_os("PEERCOMM_FUZZ_TRACE").is_some() {
                    eprintln!("{what}: {got:?} after {:?}", started.elapsed());
                }
                match got {
                    Err(Error::CallMismatch { field, peer, .. }) => {
                        assert_eq!(field, m.field, "{what}");
                        let holds = (rank == m.odd) != (peer == m.odd);
                        assert!(holds, "{what}: names rank {peer}");
                    }
                    other => panic!("{what}: got {other:?}, not a CallMismatch"),
                }
                comm.reinitialize().unwrap();
            }
        }
        digests
    });
    // Every member of a group has the same bits as the group's first member.
    let all: std::collections::HashMap<(usize, usize), u64> = results
        .iter()
        .flatten()
        .map(|&(c, r, d)| ((c, r), d))
        .collect();
    let mut checked = 0;
    let collectives = plan.iter().filter(|c| c.collective.is_some()).count();
    for (call, c) in plan
        .iter()
        .enumerate()
        .filter(|(_, c)| !c.refused && c.collective.is_none())
    {
        for rank in 0..world {
            let lead = rank / c.group * c.group;
            let note = format!("seed {seed} call {call}: rank {rank} differs from {lead}");
            assert_eq!(all[&(call, rank)], all[&(call, lead)], "{note}");
        }
        checked += 1;
    }
    eprintln!(
        "per_rank_fuzz world {world}: PEERCOMM_SEED={seed}: {checked} all-reduces and {collectives} other collectives checked on every rank, {} refused as specified, {typed} calls over f64 and the integers, {exchanges} send / recv or all-to-all-v exchanges, {mismatches} mismatched calls each reported on every rank, multiprocessors {:?} (grid left to peercomm), in {:.1?}",
        plan.len() - checked - collectives,
        config.simulate.multiprocessors,
        started.elapsed()
    );
}
