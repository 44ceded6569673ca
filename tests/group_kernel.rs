//! The batched all-reduce kernel on the host backend through `SingleController::group`
//! and `Comm::group`: worlds 2-4, every group size, f32/f16/bf16, batches of 1-8 entries.
//! Each entry must match, bit for bit, the in-order CPU reference and the same entry run
//! alone; refusals and mismatches (also in later entries only) write nothing.

mod common;
mod per_rank_suite;

use std::time::Duration;

use common::Zeros;
use peercomm::backend::host::{Host, HostBuffer, HostDevice};
use peercomm::backend::{Backend, DeviceBuffer, DeviceBufferMut, TypedBuffer};
use peercomm::{
    Algorithm, AllReduceOptions, CallField, Comm, CommConfig, DType, Element, Error, ReduceOp,
    SingleController,
};
use per_rank_suite::{in_step, Placement};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Entry lengths (0: an empty entry, which writes nothing).
const LENGTHS: [usize; 6] = [0, 1, 7, 8, 1000, 4099];

/// The batches of one (world, group size, dtype): every length alone, then batches of 2,
/// 5 and 8 entries cycling through the lengths from two starting points.
fn batches() -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = LENGTHS.iter().map(|&n| vec![n]).collect();
    for count in [2, 5, 8] {
        for start in [1, 4] {
            out.push(
                (0..count)
                    .map(|s| LENGTHS[(start + s) % LENGTHS.len()])
                    .collect(),
            );
        }
    }
    out
}

fn config(blocks: u32) -> CommConfig {
    CommConfig::default()
        .with_lamport_slot_bytes(1 << 20)
        .with_payload_bytes(4 << 20)
        .with_barrier_timeout(Some(Duration::from_secs(30)))
        .with_max_blocks(Some(blocks))
        .with_bootstrap_timeout(Duration::from_secs(30))
}

fn nan<T: Element>() -> T {
    T::from_f32(f32::NAN)
}

/// Every rank's input of every entry of a batch: `[entry][rank]`, random with zeros.
fn batch_inputs<T: Element>(rng: &mut StdRng, world: usize, lengths: &[usize]) -> Vec<Vec<Vec<T>>> {
    lengths
        .iter()
        .map(|&n| {
            let mut ins = common::random_inputs::<T>(rng, world, n);
            if n > 0 {
                common::sprinkle_zeros(rng, &mut ins, Zeros::ALL);
            }
            ins
        })
        .collect()
}

/// The in-order reference of rank `rank`'s output (bits): over two or more ranks the
/// f32 sum from +0.0 in group-rank order, rounded to T; a group of one copies.
fn reference_bits<T: Element>(ins: &[Vec<T>], width: usize, rank: usize) -> Vec<u32> {
    let g = rank / width * width;
    (0..ins[rank].len())
        .map(|e| {
            if width == 1 {
                ins[rank][e].to_bits_u32()
            } else {
                let acc = (g..g + width).fold(0.0f32, |acc, r| acc + ins[r][e].to_f32());
                T::from_f32(acc).to_bits_u32()
            }
        })
        .collect()
}

/// Rank `rank`'s entry `got` against the in-order reference and the one-stage result
/// `alone`, bit for bit.
fn check_entry<T: Element>(
    ins: &[Vec<T>],
    width: usize,
    rank: usize,
    got: &[T],
    alone: &[T],
    what: &str,
) {
    let expected = reference_bits(ins, width, rank);
    let got = common::bits(got);
    assert_eq!(got.len(), expected.len(), "{what}: length");
    if let Some(e) = (0..got.len()).find(|&e| got[e] != expected[e]) {
        panic!(
            "{what}: rank {rank}, element {e} of {}: {:#x}, the in-order reference {:#x}",
            got.len(),
            got[e],
            expected[e]
        );
    }
    assert_eq!(
        got,
        common::bits(alone),
        "{what}: rank {rank}: not the bits of one-stage alone"
    );
}

// ---------------------------------------------------------------------------------
// Single controller.

/// One batch through the single controller's group, entries marked in `in_place`
/// reducing their receive buffers in place; each entry checked against the references.
fn single_controller_case<T: Element>(
    comm: &SingleController<Host>,
    rng: &mut StdRng,
    width: usize,
    lengths: &[usize],
    in_place: &[bool],
) {
    let world = comm.world_size();
    let what = format!(
        "single controller world {world}, groups of {width}, {:?} x {lengths:?}, in place \
         {in_place:?}",
        T::DTYPE
    );
    let ins = batch_inputs::<T>(rng, world, lengths);
    let dev = |r: usize| comm.core(r).device();
    let upload = |e: &[Vec<T>]| -> Vec<HostBuffer<T>> {
        e.iter()
            .enumerate()
            .map(|(r, v)| Host::alloc_from(dev(r), v).unwrap())
            .collect()
    };
    let poisoned = |n: usize| upload(&vec![vec![nan::<T>(); n]; world]);
    let sends: Vec<_> = ins.iter().map(|e| upload(e)).collect();
    // In-place entries start as their inputs; the others are poisoned.
    let mut recvs: Vec<_> = (0..lengths.len())
        .map(|s| match in_place[s] {
            true => upload(&ins[s]),
            false => poisoned(lengths[s]),
        })
        .collect();
    let opts = AllReduceOptions::new().group_size(width);
    let mut group = comm.group();
    for (s, recv) in recvs.iter_mut().enumerate() {
        match in_place[s] {
            true => group.all_reduce_slices_in_place_with(recv, &ReduceOp::Sum, &opts),
            false => group.all_reduce_slices_with(&sends[s], recv, &ReduceOp::Sum, &opts),
        }
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    let ran = group.end().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(ran.len(), lengths.len(), "{what}");
    comm.synchronize().unwrap_or_else(|e| panic!("{what}: {e}"));
    let alone_opts = opts.algorithm(Algorithm::OneStage);
    for (s, entry) in ins.iter().enumerate() {
        let mut alone = poisoned(lengths[s]);
        comm.all_reduce_slices(&sends[s], &mut alone, &ReduceOp::Sum, &alone_opts)
            .unwrap();
        comm.synchronize().unwrap();
        let got: Vec<Vec<T>> = (0..world)
            .map(|r| recvs[s][r].to_host(dev(r)).unwrap())
            .collect();
        let what = format!("{what}, entry {s}");
        if lengths[s] > 0 {
            common::check_result(entry, &got, width, Algorithm::OneStage, &what);
        }
        for r in 0..world {
            let one = alone[r].to_host(dev(r)).unwrap();
            check_entry(entry, width, r, &got[r], &one, &what);
        }
    }
}

fn single_controller_batches(world: usize) {
    let mut rng = common::rng(&format!("group_kernel_single_world_{world}"));
    let ordinals: Vec<usize> = (0..world).collect();
    let comm = SingleController::<Host>::new(&ordinals, config(3)).unwrap();
    let mut batches_run = 0;
    for width in common::group_sizes(world) {
        for lengths in batches() {
            let flat = vec![false; lengths.len()];
            single_controller_case::<f32>(&comm, &mut rng, width, &lengths, &flat);
            single_controller_case::<half::f16>(&comm, &mut rng, width, &lengths, &flat);
            single_controller_case::<half::bf16>(&comm, &mut rng, width, &lengths, &flat);
            batches_run += 3;
        }
    }
    eprintln!("single controller world {world}: {batches_run} batches checked");
}

tests! {
    single_controller_batches_world_2 => single_controller_batches(2);
    single_controller_batches_world_3 => single_controller_batches(3);
    single_controller_batches_world_4 => single_controller_batches(4);
}

/// Single controller: host checks (`LengthMismatch`), the payload bound, and fault
/// injection (`mismatch_next`, `miss_next`) write nothing; `reinitialize` recovers.
#[test]
fn single_controller_refusals_and_faults() {
    let world = 2;
    let config = config(2)
        .with_payload_bytes(64 << 10)
        .with_barrier_timeout(Some(Duration::from_millis(500)));
    let comm = SingleController::<Host>::new(&[0, 1], config).unwrap();
    let dev = |r: usize| comm.core(r).device();
    let bufs = |lengths: &[Vec<usize>], value: f32| -> Vec<Vec<HostBuffer<f32>>> {
        lengths
            .iter()
            .map(|per_rank| {
                per_rank
                    .iter()
                    .enumerate()
                    .map(|(r, &n)| Host::alloc_from(dev(r), &vec![value; n]).unwrap())
                    .collect()
            })
            .collect()
    };
    // Asserts `holds` of every element of every entry.
    let every = |recvs: &[Vec<HostBuffer<f32>>], holds: fn(&f32) -> bool, what: &str| {
        for (s, e) in recvs.iter().enumerate() {
            for (r, b) in e.iter().enumerate() {
                let host = b.to_host(dev(r)).unwrap();
                assert!(host.iter().all(holds), "{what}: entry {s} of rank {r}");
            }
        }
    };
    let untouched = |recvs: &[Vec<HostBuffer<f32>>], what: &str| {
        every(recvs, |x| x.is_nan(), &format!("{what}: written"))
    };
    // Rank 1's entry 1 is longer.
    let uneven = vec![vec![10, 10], vec![20, 21]];
    let mut recvs = bufs(&uneven, f32::NAN);
    let got = single_group(&comm, &bufs(&uneven, 1.0), &mut recvs, 0);
    assert!(
        matches!(got, Err(Error::LengthMismatch { rank: 1, .. })),
        "{got:?}"
    );
    untouched(&recvs, "uneven");
    // 2 x 8192 f32 + 1 after the 80-byte entry table: past the payload together, so
    // the group batches what fits and runs the rest alone.
    let big = vec![vec![8192; 2], vec![8192; 2], vec![1; 2]];
    let mut recvs = bufs(&big, f32::NAN);
    single_group(&comm, &bufs(&big, 1.0), &mut recvs, 0).unwrap();
    comm.synchronize().unwrap();
    every(&recvs, |&x| x == 2.0, "too large");
    let fits = vec![vec![8192; 2], vec![0; 2]];
    let sends = bufs(&fits, 1.0);
    // A skewed descriptor on rank 1.
    let mut recvs = bufs(&fits, f32::NAN);
    comm.mismatch_next(1).unwrap();
    single_group(&comm, &sends, &mut recvs, 0).unwrap();
    let got = comm.synchronize();
    assert!(
        matches!(&got, Err(Error::CallMismatch { field, .. }) if *field == CallField::Sequence),
        "{got:?}"
    );
    for (r, e) in comm.rank_errors().unwrap().into_iter().enumerate() {
        assert!(
            matches!(e, Some(Error::CallMismatch { .. })),
            "rank {r}: {e:?}"
        );
    }
    untouched(&recvs, "skewed");
    comm.reinitialize().unwrap();
    // Rank 0 left out.
    comm.miss_next(0).unwrap();
    single_group(&comm, &sends, &mut recvs, 0).unwrap();
    let got = comm.synchronize();
    let timed_out =
        matches!(&got, Err(Error::BarrierTimeout { waiting_for: w, .. }) if *w == Some(0));
    assert!(
        timed_out || matches!(got, Err(Error::PeerAborted { .. })),
        "{got:?}"
    );
    untouched(&recvs, "left out");
    comm.reinitialize().unwrap();
    single_group(&comm, &sends, &mut recvs, 0).unwrap();
    comm.synchronize().unwrap();
    for (r, b) in recvs[0].iter().enumerate() {
        assert_eq!(b.to_host(dev(r)).unwrap(), vec![world as f32; 8192]);
    }
}

/// The single controller reads a batch's inputs in place unless an entry is in place
/// (peers would read what this rank overwrites), then it stages; both give the reference
/// bits, for batches past the payload and mixed batches at every group size of world 4.
#[test]
fn single_controller_batches_read_in_place_or_stage_for_in_place_entries() {
    let world = 4;
    let config = config(2).with_payload_bytes(16 << 10);
    let comm = SingleController::<Host>::new(&[0, 1, 2, 3], config).unwrap();
    let mut rng = common::rng("group_kernel_single_in_place");
    for width in common::group_sizes(world) {
        // 3 x 4099 f32 = 48 KiB, three times the payload: read in place, one batch.
        // [in place, out of place, in place]: staged, 3 x 1000 f32 fit.
        for (lengths, in_place) in [
            (vec![4099, 4099, 4099], vec![false, false, false]),
            (vec![1000, 7, 1000], vec![true, false, true]),
            (vec![8, 1, 0, 1000], vec![false, true, false, false]),
        ] {
            single_controller_case::<f32>(&comm, &mut rng, width, &lengths, &in_place);
        }
    }
}

// ---------------------------------------------------------------------------------
// Per rank: one thread per rank, `Comm` over the TCP bootstrap of a `UniqueId`.

/// A batch through the single controller's group: entry s is one all-reduce of the
/// group, over groups of `width`.
fn single_group<S: DeviceBuffer<Host>, R: DeviceBufferMut<Host>>(
    comm: &SingleController<Host>,
    sends: &[Vec<S>],
    recvs: &mut [Vec<R>],
    width: usize,
) -> peercomm::Result<()> {
    let opts = AllReduceOptions::new().group_size(width);
    let mut group = comm.group();
    for (send, recv) in sends.iter().zip(recvs.iter_mut()) {
        group.all_reduce_slices_with(send, recv, &ReduceOp::Sum, &opts)?;
    }
    group.end().map(|_| ())
}

/// A batch through a per-rank group.
fn rank_group<S: DeviceBuffer<Host>, R: DeviceBufferMut<Host>>(
    comm: &Comm<Host>,
    sends: &[S],
    recvs: &mut [R],
    width: usize,
) -> peercomm::Result<()> {
    let opts = AllReduceOptions::new().group_size(width);
    let mut group = comm.group();
    for (send, recv) in sends.iter().zip(recvs.iter_mut()) {
        group.all_reduce_with(send, recv, &ReduceOp::Sum, &opts)?;
    }
    group.end().map(|_| ())
}

/// One host buffer per length, filled with `value`.
fn filled<T: Element>(dev: &HostDevice, lengths: &[usize], value: T) -> Vec<HostBuffer<T>> {
    lengths
        .iter()
        .map(|&n| Host::alloc_from(dev, &vec![value; n]).unwrap())
        .collect()
}

/// One thread per rank, rank r on host device r (`max_blocks` comes from `config`).
const HOST: Placement = Placement {
    devices: peercomm::MAX_GPUS,
    max_blocks: 2,
};

/// One batch on one rank: every rank draws every rank's inputs from the same seed.
fn per_rank_case<T: Element>(comm: &Comm<Host>, seed: u64, width: usize, lengths: &[usize]) {
    let (world, rank) = (comm.world_size(), comm.rank());
    let what = format!(
        "per rank world {world}, groups of {width}, {:?} x {lengths:?}",
        T::DTYPE
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let ins = batch_inputs::<T>(&mut rng, world, lengths);
    let dev = comm.device();
    let sends: Vec<HostBuffer<T>> = ins
        .iter()
        .map(|e| Host::alloc_from(dev, &e[rank]).unwrap())
        .collect();
    let mut recvs = filled(dev, lengths, nan::<T>());
    rank_group(comm, &sends, &mut recvs, width).unwrap_or_else(|e| panic!("{what}: {e}"));
    comm.synchronize()
        .unwrap_or_else(|e| panic!("{what}: rank {rank}: {e}"));
    let mut alone = filled(dev, lengths, nan::<T>());
    let opts = AllReduceOptions::new()
        .algorithm(Algorithm::OneStage)
        .group_size(width);
    for (send, out) in sends.iter().zip(alone.iter_mut()) {
        comm.all_reduce_with(send, out, &ReduceOp::Sum, &opts)
            .unwrap();
    }
    comm.synchronize().unwrap();
    for (s, entry) in ins.iter().enumerate() {
        let got = recvs[s].to_host(dev).unwrap();
        let one = alone[s].to_host(dev).unwrap();
        let what = format!("{what}, entry {s}");
        check_entry(entry, width, rank, &got, &one, &what);
    }
}

fn per_rank_batches(world: usize) {
    let seed = common::seed(&format!("group_kernel_per_rank_world_{world}"));
    let checked = in_step::<Host, _>(&HOST, world, &config(2), |_rank, comm, _meet| {
        // Every rank derives the same seed for each case.
        let mut seeds = (1u64..).map(|case| seed ^ case.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        for width in common::group_sizes(world) {
            for lengths in batches() {
                let mut next = || seeds.next().unwrap();
                per_rank_case::<f32>(comm, next(), width, &lengths);
                per_rank_case::<half::f16>(comm, next(), width, &lengths);
                per_rank_case::<half::bf16>(comm, next(), width, &lengths);
            }
        }
        common::group_sizes(world).len() * batches().len() * 3
    });
    let checked = checked[0];
    eprintln!("per rank world {world}: {checked} batches checked on every rank");
}

tests! {
    per_rank_batches_world_2 => per_rank_batches(2);
    per_rank_batches_world_3 => per_rank_batches(3);
    per_rank_batches_world_4 => per_rank_batches(4);
}

/// Waits for this rank's batch, then checks nothing of its outputs was written when it
/// failed.
fn batch_untouched(comm: &Comm<Host>, lengths: &[usize]) -> peercomm::Result<()> {
    let dev = comm.device();
    let (sends, mut recvs) = (filled(dev, lengths, 1.0f32), filled(dev, lengths, f32::NAN));
    rank_group(comm, &sends, &mut recvs, 0)?;
    let result = comm.synchronize();
    if result.is_err() {
        for (s, b) in recvs.iter().enumerate() {
            let written = b.to_host(dev)?.iter().filter(|x| !x.is_nan()).count();
            assert_eq!(
                written, 0,
                "a failed batch wrote {written} elements of entry {s}"
            );
        }
    } else {
        let world = comm.world_size() as f32;
        for b in &recvs {
            assert!(b.to_host(dev)?.iter().all(|&x| x == world));
        }
    }
    result
}

/// An ordinary one-stage all-reduce of `n` f32 on this rank, checked like a batch.
fn plain_untouched(comm: &Comm<Host>, n: usize) -> peercomm::Result<()> {
    let dev = comm.device();
    let send = Host::alloc_from(dev, &vec![1.0f32; n])?;
    let mut recv = Host::alloc_from(dev, &vec![f32::NAN; n])?;
    let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &opts)?;
    let result = comm.synchronize();
    if result.is_err() {
        assert!(recv.to_host(dev)?.iter().all(|x| x.is_nan()));
    }
    result
}

/// The last rank makes another batch (or call): every rank gets `CallMismatch` naming the
/// field, nothing written; `reinitialize` recovers.
fn per_rank_mismatches(world: usize) {
    let config = config(2).with_barrier_timeout(Some(Duration::from_millis(1500)));
    let usual = [300, 7, 1000, 0, 8];
    // (what, the field named, the odd rank's batch); `None`: a plain all-reduce of 300
    // against the others' batch [300, 7].
    use CallField::{Collective, Length, Root};
    let cases: [(&str, CallField, Option<&[usize]>); 6] = [
        ("length of entry 0", Length, Some(&[301, 7, 1000, 0, 8])),
        ("length of entry 2", Length, Some(&[300, 7, 999, 0, 8])),
        ("last length", Length, Some(&[300, 7, 1000, 0, 9])),
        ("entries swapped", Length, Some(&[300, 1000, 7, 0, 8])),
        ("another count", Root, Some(&usual[..4])),
        ("batch / plain", Collective, None),
    ];
    let odd = world - 1;
    for (what, field, other) in &cases {
        let got = in_step::<Host, _>(&HOST, world, &config, |rank, comm, meet| {
            let got = match (rank == odd, other) {
                (true, Some(other)) => batch_untouched(comm, other),
                (true, None) => plain_untouched(comm, 300),
                (false, Some(_)) => batch_untouched(comm, &usual),
                (false, None) => batch_untouched(comm, &[300, 7]),
            };
            meet.wait();
            comm.reinitialize().unwrap();
            batch_untouched(comm, &[5, 0, 4099]).unwrap();
            got
        });
        common::assert_every_rank_mismatched(&got, *field, odd, &format!("world {world}, {what}"));
    }
}

tests! {
    per_rank_mismatches_world_2 => per_rank_mismatches(2);
    per_rank_mismatches_world_3 => per_rank_mismatches(3);
}

/// Per rank: a group past the payload batches what fits and runs the rest alone; a batch
/// that exactly fits (with the 80-byte entry table) runs next.
#[test]
fn per_rank_group_past_the_payload_is_split() {
    let config = config(2).with_payload_bytes(64 << 10);
    in_step::<Host, _>(&HOST, 2, &config, |_rank, comm, _meet| {
        batch_untouched(comm, &[8192, 8192, 1]).unwrap();
        batch_untouched(comm, &[8192, 8192 - 20]).unwrap();
    });
}

// ---------------------------------------------------------------------------------
// Every length, exactly: ranks whose batches differ in one later entry only.

/// An 8-bit digest of the later entries' lengths (FNV-1a folded): pairs it cannot tell
/// apart prove the kernel compares every length.
fn narrow_digest(later: &[usize]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for byte in later.iter().flat_map(|&n| (n as u64).to_le_bytes()) {
        h = (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    (h ^ (h >> 8) ^ (h >> 16) ^ (h >> 32)) & 0xff
}

/// Two entry tables that differ in entry `entry` (>= 1) only, and what the error shows.
struct Pair {
    usual: Vec<usize>,
    other: Vec<usize>,
    entry: usize,
    /// The difference changes the grid too (the descriptors' block counts differ).
    grid: bool,
}

/// A table of `count` entries whose first fills the grid (f32: more than 1024 packs at
/// any width, so 2 blocks under `max_blocks` 2 whatever the later entries are).
fn filling_table(rng: &mut StdRng, count: usize) -> Vec<usize> {
    let mut t = vec![rng.random_range(4100..6000)];
    t.extend((1..count).map(|_| rng.random_range(0..3000)));
    t
}

/// `collisions` pairs `narrow_digest` cannot tell apart, `random` random pairs, then
/// `grids` pairs whose difference also changes the grid (1 block against 2).
fn later_entry_pairs(
    rng: &mut StdRng,
    collisions: usize,
    random: usize,
    grids: usize,
) -> Vec<Pair> {
    let mut pairs = Vec::new();
    while pairs.len() < collisions + random {
        let count = rng.random_range(2..=8);
        let usual = filling_table(rng, count);
        let entry = rng.random_range(1..usual.len());
        let digest = narrow_digest(&usual[1..]);
        let collide = pairs.len() < collisions;
        for _ in 0..10_000 {
            let mut other = usual.clone();
            other[entry] = rng.random_range(0..3000);
            if other[entry] != usual[entry] && (!collide || narrow_digest(&other[1..]) == digest) {
                pairs.push(Pair {
                    usual,
                    other,
                    entry,
                    grid: false,
                });
                break;
            }
        }
    }
    for _ in 0..grids {
        // At most 8 x 25 packs: 1 block at width 2 and 3; the other's entry alone more
        // than 512 packs: 2 blocks.
        let usual: Vec<usize> = (0..rng.random_range(2..=8))
            .map(|_| rng.random_range(0..100))
            .collect();
        let entry = rng.random_range(1..usual.len());
        let mut other = usual.clone();
        other[entry] = rng.random_range(2100..3000);
        pairs.push(Pair {
            usual,
            other,
            entry,
            grid: true,
        });
    }
    pairs
}

/// Per rank: for every pair, one rank batches the other table; every rank gets
/// `CallMismatch(Length)` naming the odd rank and the differing lengths (or grids),
/// nothing written; `reinitialize` recovers.
fn per_rank_later_entry_mismatches(world: usize) {
    let mut rng = common::rng(&format!("group_kernel_later_entries_world_{world}"));
    let pairs = later_entry_pairs(&mut rng, 12, 24, 4);
    for p in pairs.iter().filter(|p| !p.grid) {
        assert!(p.usual.len() >= 2 && p.usual[p.entry] != p.other[p.entry]);
    }
    let collisions = pairs
        .iter()
        .filter(|p| narrow_digest(&p.usual[1..]) == narrow_digest(&p.other[1..]))
        .count();
    assert!(collisions >= 12, "{collisions} digest collisions");
    let config = config(2).with_barrier_timeout(Some(Duration::from_millis(1500)));
    let got = in_step::<Host, _>(&HOST, world, &config, |rank, comm, meet| {
        let mut got = Vec::new();
        for (i, p) in pairs.iter().enumerate() {
            let odd = i % world;
            let table = if rank == odd { &p.other } else { &p.usual };
            // A failed check must not leave the other ranks waiting at `meet`.
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                batch_untouched(comm, table)
            }));
            got.push(run.map_err(|e| {
                e.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            }));
            meet.wait();
            comm.reinitialize().unwrap();
        }
        batch_untouched(comm, &[5, 0, 4099]).unwrap();
        got
    });
    for (rank, results) in got.into_iter().enumerate() {
        for (i, (p, got)) in pairs.iter().zip(results).enumerate() {
            let odd = i % world;
            let what = format!(
                "world {world}, pair {i} (rank {odd} batches {:?} against {:?})",
                p.other, p.usual
            );
            let (mine, theirs) = if rank == odd {
                (&p.other, &p.usual)
            } else {
                (&p.usual, &p.other)
            };
            let shown = |t: &Vec<usize>| match (p.grid, *t == p.usual) {
                (true, true) => "entries sized for 1 block".to_string(),
                (true, false) => "entries sized for 2 blocks".to_string(),
                (false, _) => format!("{} elements", t[p.entry]),
            };
            let expected = (shown(mine), shown(theirs));
            let got = got.unwrap_or_else(|e| panic!("{what}: rank {rank}: {e}"));
            match got {
                Err(Error::CallMismatch {
                    rank: r,
                    peer,
                    field: CallField::Length,
                    mine,
                    theirs,
                }) => {
                    assert_eq!(r, rank, "{what}");
                    assert_eq!(peer == odd, rank != odd, "{what}: rank {rank}: peer {peer}");
                    assert_eq!((mine, theirs), expected, "{what}: rank {rank}");
                }
                other => panic!("{what}: rank {rank} got {other:?}, not a length mismatch"),
            }
        }
    }
    eprintln!(
        "world {world}: {} pairs ({collisions} narrow-digest collisions), every rank got \
         CallMismatch(Length), nothing written",
        pairs.len()
    );
}

tests! {
    per_rank_later_entry_mismatches_world_2 => per_rank_later_entry_mismatches(2);
    per_rank_later_entry_mismatches_world_3 => per_rank_later_entry_mismatches(3);
}

/// Guards against the matrix silently shrinking.
#[test]
fn the_matrix_covers_every_dtype() {
    assert_eq!(DType::ALL.len(), 10);
    assert_eq!(batches().len(), 12);
}
