//! The fallback to the external library (NCCL, RCCL, the host stand-in), generic over
//! the backend: no P2P, failed peer checks, simulated hosts, size routing, "peer memory
//! or nothing" errors, size-independent results. Results are checked against the f64
//! reference and bitwise across ranks.

#![allow(dead_code)]

use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;

use peercomm::backend::Backend;
use peercomm::bootstrap::{HostId, UniqueId};
use peercomm::{
    unstable, Algorithm, AllReduceOptions, Comm, CommConfig, Element, Error, ReduceOp,
    SingleController,
};
use peercomm::{Fallback, FallbackConfig, Simulation, SizeRouting};

use super::common;

/// Where ranks run: `devices` devices, ranks in consecutive blocks (so that ranks of
/// one simulated host share a device, and each cross-host group spans devices).
pub struct Place {
    pub devices: usize,
    pub max_blocks: u32,
}

impl Place {
    pub fn ordinal(&self, rank: usize, world: usize) -> usize {
        if world <= self.devices {
            rank
        } else {
            rank * self.devices / world
        }
    }
    pub fn config(&self, world: usize) -> CommConfig {
        CommConfig::default()
            .with_lamport_slot_bytes(1 << 20)
            .with_payload_bytes(4 << 20)
            .with_barrier_timeout(Some(Duration::from_secs(30)))
            .with_max_blocks(Some(self.max_blocks))
            .with_bootstrap_timeout(Duration::from_secs(60))
            .with_allow_shared_devices(world > self.devices)
    }
}

/// Runs `body(rank, comm)` on one thread per rank of a per-rank world.
pub fn with_world<B: Backend, R: Send>(
    place: &Place,
    world: usize,
    config: &CommConfig,
    body: impl Fn(usize, Comm<B>) -> R + Sync,
) -> Vec<R> {
    try_world::<B, R>(place, world, config, |rank, comm| body(rank, comm.unwrap()))
}

/// As [`with_world`], handing the body what `Comm::from_rank` returned.
pub fn try_world<B: Backend, R: Send>(
    place: &Place,
    world: usize,
    config: &CommConfig,
    body: impl Fn(usize, peercomm::Result<Comm<B>>) -> R + Sync,
) -> Vec<R> {
    let id = UniqueId::new().unwrap();
    std::thread::scope(|s| {
        let body = &body;
        let workers: Vec<_> = (0..world)
            .map(|rank| {
                let (id, config) = (&id, config.clone());
                s.spawn(move || {
                    let dev = B::open(place.ordinal(rank, world)).unwrap();
                    body(rank, Comm::<B>::from_rank(dev, rank, world, id, config))
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    })
}

/// Checks outputs against the f64 group sums (room for two roundings, as hierarchical
/// sums round twice) and bit for bit across each group.
pub fn check<T: Element>(ins: &[Vec<T>], outs: &[Vec<T>], width: usize, what: &str) {
    common::check_sums_within(ins, outs, width, what, |_, abs| {
        common::eps(T::DTYPE) * abs + width as f64 * f32::EPSILON as f64 * abs + 1e-7
    });
}

/// Rank `rank`'s input of call `call` (fresh random values, every rank can rebuild).
pub fn input<T: Element>(seed: u64, call: usize, rank: usize, len: usize) -> Vec<T> {
    let mut rng = StdRng::seed_from_u64(seed ^ ((call as u64) << 24) ^ rank as u64);
    common::random_values::<T>(&mut rng, len)
}

/// One all-reduce on a per-rank communicator, output poisoned first; returns what ran
/// and this rank's result.
pub fn call<B: Backend, T: Element>(
    comm: &Comm<B>,
    mine: &[T],
    options: &AllReduceOptions,
    in_place: bool,
) -> peercomm::Result<(Algorithm, Vec<T>)> {
    let dev = comm.device();
    let mut send = B::alloc_buffer::<T>(dev, mine.len())?;
    B::upload(dev, mine, &mut send)?;
    let ran = if in_place {
        comm.all_reduce_in_place_with(&mut send, &ReduceOp::Sum, options)
    } else {
        let mut recv = B::alloc_buffer::<T>(dev, mine.len())?;
        B::upload(dev, &vec![T::from_f32(f32::NAN); mine.len()], &mut recv)?;
        let ran = comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, options);
        if ran.is_ok() {
            comm.synchronize()?;
        }
        return ran.map(|a| (a, B::download(dev, &recv).unwrap()));
    }?;
    comm.synchronize()?;
    Ok((ran, B::download(dev, &send)?))
}

/// A checked schedule (scalar tails, three dtypes, in and out of place): whole-world
/// calls return `world_algorithm`, calls over groups of `local` a peer algorithm.
pub fn checked_schedule<B: Backend>(
    place: &Place,
    world: usize,
    config: &CommConfig,
    world_algorithm: Algorithm,
    local: Option<usize>,
    test: &str,
) {
    let seed = common::seed(test);
    let lens = [1usize, 9, 1027, 65_537];
    let results = with_world::<B, _>(place, world, config, |rank, comm| {
        assert_eq!(comm.world_path(), world_algorithm, "rank {rank}");
        let mut outs: Vec<(usize, usize, Vec<u32>)> = Vec::new();
        for (c, &len) in lens.iter().enumerate() {
            let mut groups = vec![0];
            groups.extend(local.filter(|&l| l < world));
            for (g, &group) in groups.iter().enumerate() {
                let opts = AllReduceOptions::new().group_size(group);
                let in_place = (c + g) % 2 == 1;
                let call_id = c * 8 + g;
                macro_rules! one {
                    ($t:ty, $k:expr) => {{
                        let mine = input::<$t>(seed, call_id * 3 + $k, rank, len);
                        let (ran, got) = call::<B, $t>(&comm, &mine, &opts, in_place)
                            .unwrap_or_else(|e| panic!("rank {rank} len {len} group {group}: {e}"));
                        if group == 0 {
                            assert_eq!(ran, world_algorithm, "len {len}");
                        } else {
                            assert!(Algorithm::ALL.contains(&ran), "group {group}: {ran:?}");
                        }
                        outs.push((
                            call_id * 3 + $k,
                            group,
                            got.iter().map(|x| x.to_bits_u32()).collect(),
                        ));
                    }};
                }
                one!(f32, 0);
                one!(half::bf16, 1);
                one!(half::f16, 2);
            }
        }
        outs
    });
    // Rebuild every rank's inputs and check each call's outputs.
    for (i, &(call_id, group, _)) in results[0].iter().enumerate() {
        let width = if group == 0 { world } else { group };
        let len = results[0][i].2.len();
        let what = format!("{test}: call {call_id} (group {group}, len {len})");
        macro_rules! verify {
            ($t:ty, $from:expr) => {{
                let ins: Vec<Vec<$t>> = (0..world)
                    .map(|r| input::<$t>(seed, call_id, r, len))
                    .collect();
                let outs: Vec<Vec<$t>> = results
                    .iter()
                    .map(|r| r[i].2.iter().map(|&b| $from(b)).collect())
                    .collect();
                check(&ins, &outs, width, &what);
            }};
        }
        match call_id % 3 {
            0 => verify!(f32, f32::from_bits),
            1 => verify!(half::bf16, |b: u32| half::bf16::from_bits(b as u16)),
            _ => verify!(half::f16, |b: u32| half::f16::from_bits(b as u16)),
        }
    }
    eprintln!("{test}: {} calls per rank checked", results[0].len());
}

fn config_with(place: &Place, world: usize, simulate: Simulation) -> CommConfig {
    place.config(world).with_simulate(simulate)
}

/// Device-level peer access missing between ranks 0 and 1: the whole world runs in the
/// external library (`Nccl`), groups of one still copy on the device.
pub fn no_peer_access<B: Backend>(place: &Place, world: usize) {
    let config = config_with(
        place,
        world,
        Simulation::default().with_no_peer_access((0, 1)),
    );
    let test = "no_peer_access";
    checked_schedule::<B>(place, world, &config, Algorithm::Nccl, Some(1), test);
}

/// The peer check reads garbage on rank 1: the same fallback.
pub fn failed_peer_check<B: Backend>(place: &Place, world: usize) {
    let config = config_with(place, world, Simulation::default().with_fail_peer_check(1));
    let test = "failed_peer_check";
    checked_schedule::<B>(place, world, &config, Algorithm::Nccl, Some(1), test);
}

/// Ranks on `hosts` simulated hosts of `world / hosts` ranks each: hierarchical when a
/// host has several ranks (groups inside a host stay on peer memory), else `Nccl`.
pub fn simulated_hosts<B: Backend>(place: &Place, world: usize, hosts: usize) {
    let local = world / hosts;
    let config = config_with(place, world, Simulation::split_hosts(world, hosts));
    let expect = if local > 1 {
        Algorithm::Hierarchical
    } else {
        Algorithm::Nccl
    };
    let test = format!("simulated_hosts_{world}_as_{hosts}");
    checked_schedule::<B>(place, world, &config, expect, Some(local), &test);
}

/// "Peer memory or nothing": each capability case is a typed error on every rank.
pub fn refuse_keeps_typed_errors<B: Backend>(place: &Place) {
    let world = 2;
    let refuse = |simulate: Simulation| {
        config_with(place, world, simulate).with_fallback(FallbackConfig::peer_memory_only())
    };
    let errors = |simulate| try_world::<B, _>(place, world, &refuse(simulate), |_, c| c.err());
    for e in errors(Simulation::default().with_no_peer_access((0, 1))) {
        assert!(matches!(e, Some(Error::P2pUnavailable { .. })), "{e:?}");
    }
    for e in errors(Simulation::default().with_fail_peer_check(1)) {
        match e {
            Some(Error::PeerCheckFailed { ranks, detail }) => {
                assert_eq!(ranks, vec![1]);
                assert!(detail.contains("exact sum"), "{detail}");
            }
            other => panic!("expected PeerCheckFailed, got {other:?}"),
        }
    }
    for e in errors(Simulation::split_hosts(2, 2)) {
        let several_hosts =
            matches!(&e, Some(Error::Unsupported(m)) if m.contains("several hosts"));
        assert!(several_hosts, "{e:?}");
    }
}

/// With the default configuration the first `n` elements of messages of `n` and `k*n`
/// come out bit for bit equal, across the sizes where the dispatch switches.
pub fn size_invariant_by_default<B: Backend>(place: &Place, world: usize) {
    let seed = common::seed("size_invariant_by_default");
    let config = place.config(world);
    with_world::<B, _>(place, world, &config, |rank, comm| {
        assert_eq!(comm.world_path(), Algorithm::Auto);
        for (c, (n, k)) in [(1000usize, 2usize), (40_000, 4), (100_000, 3)]
            .into_iter()
            .enumerate()
        {
            let long = input::<half::bf16>(seed, c, rank, n * k);
            let (a_short, short) =
                call::<B, _>(&comm, &long[..n], &AllReduceOptions::new(), false).unwrap();
            let (a_long, got) =
                call::<B, _>(&comm, &long, &AllReduceOptions::new(), false).unwrap();
            for e in 0..n {
                assert_eq!(
                    short[e].to_bits(),
                    got[e].to_bits(),
                    "element {e}: {n} elements ({a_short:?}) against {} ({a_long:?})",
                    n * k
                );
            }
            if rank == 0 {
                eprintln!(
                    "size_invariant: {n} bf16 ran {a_short:?}, {} ran {a_long:?}",
                    n * k
                );
            }
        }
    });
}

/// Opted-in routing: `Above(bytes)` sends large whole-world messages to the external
/// library; `Table` follows `dispatch::external_from`.
pub fn by_size_when_opted_in<B: Backend>(place: &Place, world: usize) {
    let seed = common::seed("by_size_when_opted_in");
    for (t, by_size) in [SizeRouting::Above(64 << 10), SizeRouting::Table]
        .into_iter()
        .enumerate()
    {
        let config = place.config(world).with_fallback(
            FallbackConfig::default()
                .with_fallback(Fallback::External)
                .with_by_size(by_size),
        );
        let outs = with_world::<B, _>(place, world, &config, |rank, comm| {
            let arch = B::architecture(comm.device()).unwrap();
            let threshold = match by_size {
                SizeRouting::Above(b) => Some(b),
                _ => unstable::external_from(&arch, world),
            };
            let mut outs = Vec::new();
            for (c, len) in [1027usize, 16_385, 300_001].into_iter().enumerate() {
                let mine = input::<f32>(seed, t * 8 + c, rank, len);
                let (ran, got) =
                    call::<B, f32>(&comm, &mine, &AllReduceOptions::new(), c % 2 == 1).unwrap();
                let external = threshold.is_some_and(|b| len * 4 >= b);
                assert_eq!(
                    ran == Algorithm::Nccl,
                    external,
                    "{by_size:?} len {len}: {ran:?}"
                );
                // Forced, whatever the size.
                let nccl = AllReduceOptions::new().algorithm(Algorithm::Nccl);
                let (forced, _) = call::<B, f32>(&comm, &mine, &nccl, false).unwrap();
                assert_eq!(forced, Algorithm::Nccl);
                outs.push(got);
            }
            outs
        });
        for (c, len) in [1027usize, 16_385, 300_001].into_iter().enumerate() {
            let ins: Vec<Vec<f32>> = (0..world)
                .map(|r| input::<f32>(seed, t * 8 + c, r, len))
                .collect();
            let got: Vec<Vec<f32>> = outs.iter().map(|o| o[c].clone()).collect();
            check(&ins, &got, world, &format!("by_size {by_size:?} len {len}"));
        }
    }
}

/// The single-controller communicator: forced no-P2P and a failed check fall back to
/// the external library's single-controller form; "peer memory or nothing" refuses.
pub fn single_controller<B: Backend>(ordinals: &[usize]) {
    let world = ordinals.len();
    let mut rng = common::rng("single_controller_fallback");
    let no_peer_access = Simulation::default().with_no_peer_access((0, 1));
    let failed_check = Simulation::default().with_fail_peer_check(world - 1);
    for (name, sim) in [
        ("no peer access", no_peer_access),
        ("failed peer check", failed_check),
    ] {
        let config = common::suite_config(Some(4)).with_simulate(sim.clone());
        let comm = SingleController::<B>::new(ordinals, config.clone()).unwrap();
        assert_eq!(comm.world_path(), Algorithm::Nccl, "{name}");
        // Device-side work over peer memory is refused, not launched.
        assert!(
            matches!(comm.barrier(0), Err(Error::Unsupported(_))),
            "{name}"
        );
        for len in [1usize, 1027, 65_537] {
            let ins = common::random_inputs::<f32>(&mut rng, world, len);
            let mut bufs = common::on_ranks(&comm, |r, d| common::upload::<B, f32>(d, &ins[r]));
            let mut outs = common::on_ranks(&comm, |_, d| common::poisoned::<B, f32>(d, len));
            let download = |bufs: &[B::Buffer<f32>]| {
                common::on_ranks(&comm, |r, d| B::download(d, &bufs[r]).unwrap())
            };
            let os = &mut common::views_mut(&mut outs);
            let ran = comm.all_reduce(
                &common::views(&bufs),
                os,
                &ReduceOp::Sum,
                &AllReduceOptions::new(),
            );
            let ran = ran.unwrap();
            assert_eq!(ran, Algorithm::Nccl, "{name}");
            comm.synchronize().unwrap();
            let what = format!("single controller, {name}, len {len}");
            check(&ins, &download(&outs), world, &what);
            // The slice form routes the same way (in place, on the inputs).
            let ran = comm
                .all_reduce_slices_in_place(&mut bufs, &ReduceOp::Sum, &AllReduceOptions::new())
                .unwrap();
            assert_eq!(ran, Algorithm::Nccl, "{name}: slice form");
            comm.synchronize().unwrap();
            let what = format!("slice form, {name}, len {len}");
            check(&ins, &download(&bufs), world, &what);
        }
        let refused = SingleController::<B>::new(
            ordinals,
            config.with_fallback(FallbackConfig::peer_memory_only()),
        );
        assert!(
            matches!(
                refused.as_ref().err(),
                Some(Error::P2pUnavailable { .. } | Error::PeerCheckFailed { .. })
            ),
            "{name}: {:?}",
            refused.err()
        );
    }
}

/// A world larger than `MAX_GPUS` on one host: everything in the external library (with
/// the fallback on), `InvalidWorldSize` without.
pub fn world_beyond_max_gpus<B: Backend>(place: &Place) {
    let world = peercomm::MAX_GPUS + 1;
    let config = place.config(world);
    let test = "world_beyond_max_gpus";
    checked_schedule::<B>(place, world, &config, Algorithm::Nccl, Some(1), test);
    let id = UniqueId::new().unwrap();
    let config = config.with_fallback(FallbackConfig::peer_memory_only());
    let refused = Comm::<B>::from_rank(B::open(0).unwrap(), 0, world, &id, config).err();
    assert!(
        matches!(refused, Some(Error::InvalidWorldSize { .. })),
        "{refused:?}"
    );
    let _ = id.release();
}

/// Host identities really come from the bootstrap unless simulated: a simulation list
/// of the wrong length is a typed error.
pub fn simulated_hosts_must_name_every_rank<B: Backend>(place: &Place) {
    let sim = Simulation::default().with_hosts(vec![HostId::new("a")]);
    let errs = try_world::<B, _>(place, 2, &config_with(place, 2, sim), |_, c| c.err());
    for e in errs {
        assert!(matches!(e, Some(Error::InvalidConfig(_))), "{e:?}");
    }
}

/// The other collectives use peer memory only: a group inside a simulated host works;
/// the whole world (or no peer access) is `Unsupported`, nothing written.
pub fn other_collectives_stay_on_peer_memory<B: Backend>(place: &Place) {
    use peercomm::CollectiveOptions;
    let world = 4;
    let seed = common::seed("other_collectives_stay_on_peer_memory");
    let config = config_with(place, world, Simulation::split_hosts(world, 2));
    let n = 37;
    with_world::<B, _>(place, world, &config, |rank, comm| {
        let dev = comm.device();
        let send = common::upload::<B, f32>(dev, &input::<f32>(seed, 0, rank, n));
        let mut recv = common::poisoned::<B, f32>(dev, 2 * n);
        let mut wide = common::poisoned::<B, f32>(dev, world * n);
        let err = comm
            .all_gather_with(&send, &mut wide, &CollectiveOptions::new())
            .unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{err}");
        comm.all_gather_with(&send, &mut recv, &CollectiveOptions::new().group_size(2))
            .unwrap();
        comm.synchronize().unwrap();
        assert!(B::download(dev, &wide).unwrap().iter().all(|x| x.is_nan()));
        let got = B::download(dev, &recv).unwrap();
        let base = rank / 2 * 2;
        for q in 0..2 {
            let theirs = input::<f32>(seed, 0, base + q, n);
            assert_eq!(
                &got[q * n..(q + 1) * n],
                &theirs[..],
                "rank {rank}, member {q}"
            );
        }
    });
}
