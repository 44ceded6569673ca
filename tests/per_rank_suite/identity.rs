//! Devices told apart by identity (UUID, else PCI bus id), not ordinal; physical
//! devices simulated on the host backend. Isolation is served by peer memory; a shared
//! physical device is refused without `allow_shared_devices` and caps the grid with it.

use peercomm::backend::Backend;
use peercomm::bootstrap::UniqueId;
use peercomm::Simulation;
use peercomm::{
    Algorithm, AllReduceOptions, Comm, CommConfig, DeviceIdentity, Error, FallbackConfig, ReduceOp,
    SingleController,
};

use super::{common, processes, Placement};

/// A communicator per rank on one thread each (rank r on `ordinals[r]`), `body` run on
/// those made; each rank's result or creation error.
fn try_world<B: Backend, R: Send>(
    ordinals: &[usize],
    config: &CommConfig,
    body: impl Fn(usize, Comm<B>) -> R + Sync,
) -> Vec<Result<R, Error>> {
    let world = ordinals.len();
    let id = UniqueId::new().unwrap();
    std::thread::scope(|s| {
        let workers: Vec<_> = ordinals
            .iter()
            .enumerate()
            .map(|(rank, &ordinal)| {
                let (id, body, config) = (&id, &body, config.clone());
                s.spawn(move || {
                    let dev = B::open(ordinal).unwrap();
                    Comm::<B>::from_rank(dev, rank, world, id, config).map(|c| body(rank, c))
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    })
}

/// The suite's configuration with these physical devices, no shared devices allowed
/// and no fallback (a refusal or a silent fallback fails the test).
fn config_on(place: &Placement, world: usize, physical: &[usize]) -> CommConfig {
    place
        .config(world)
        .with_allow_shared_devices(false)
        .with_fallback(FallbackConfig::peer_memory_only())
        .with_simulate(Simulation::default().with_physical_devices(physical.to_vec()))
}

/// Every rank on device 0 but its own physical device: peer memory serves the world,
/// uncapped, and the checked schedule is right and bitwise equal.
pub fn isolated_threads<B: Backend>(place: &Placement, world: usize) {
    let seed = super::seed("isolated_threads");
    let physical: Vec<usize> = (0..world).collect();
    let config = config_on(place, world, &physical);
    let digests = try_world::<B, _>(&vec![0; world], &config, |_, comm| {
        assert_eq!(comm.world_path(), Algorithm::Auto);
        assert_eq!(comm.max_blocks(), place.max_blocks);
        processes::run_checked(&comm, seed)
    });
    let digests = digests.into_iter().enumerate();
    let digests: Vec<_> = digests
        .map(|(r, d)| d.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect();
    let calls = processes::compare_ranks(world, &digests);
    eprintln!("isolated_threads world {world}: {calls} calls per rank checked");
}

/// Two ranks on one physical device that their ordinals hide are refused on every rank
/// without `allow_shared_devices`, naming both ranks, ordinals and the UUID.
pub fn real_sharing_is_refused<B: Backend>(place: &Placement) {
    let uuid = |p| DeviceIdentity::simulated(0, p).uuid_string().unwrap();
    for (ordinals, physical, pair, ords) in [
        (vec![0, 1], vec![5, 5], (0, 1), (0, 1)),
        (vec![0, 0], vec![2, 2], (0, 1), (0, 0)),
        (vec![0, 1, 2], vec![0, 1, 0], (0, 2), (0, 2)),
    ] {
        let world = ordinals.len();
        let config = config_on(place, world, &physical);
        let shared = physical[pair.0];
        for (rank, made) in try_world::<B, _>(&ordinals, &config, |_, _| ())
            .into_iter()
            .enumerate()
        {
            let err = made.expect_err("refused");
            let text = err.to_string();
            let invalid = matches!(err, Error::InvalidDevices(_));
            assert!(invalid, "rank {rank}: {err:?}");
            for part in [
                format!("ranks {} and {}", pair.0, pair.1),
                format!("rank {} on device {} ({}", pair.0, ords.0, uuid(shared)),
                format!("rank {} on device {} ({}", pair.1, ords.1, uuid(shared)),
                "allow_shared_devices".to_string(),
            ] {
                assert!(text.contains(&part), "rank {rank}: {part:?} not in {text}");
            }
        }
    }
    // Without a simulation: one device opened twice is one identity.
    let config = place.config(2).with_allow_shared_devices(false);
    for made in try_world::<B, _>(&[0, 0], &config, |_, _| ()) {
        let text = made.expect_err("refused").to_string();
        assert!(text.contains("same physical device"), "{text}");
    }
}

/// With `allow_shared_devices` shared devices work and the grid is capped at
/// multiprocessors / ranks per device (4 simulated: 2 blocks shared, 4 alone).
pub fn allowed_sharing_caps_the_grid<B: Backend>(place: &Placement) {
    for (physical, per_device) in [
        (vec![0, 0, 1, 1], 2),
        (vec![3, 3, 3, 3], 4),
        (vec![0, 1, 2, 3], 1),
    ] {
        let world = physical.len();
        let config = config_on(place, world, &physical)
            .with_allow_shared_devices(true)
            .with_max_blocks(None)
            .with_simulate(
                Simulation::default()
                    .with_physical_devices(physical.clone())
                    .with_multiprocessors(vec![4; world]),
            );
        let n = 10_007;
        let mut rng = common::rng("allowed_sharing_caps_the_grid");
        let ins = common::random_inputs::<f32>(&mut rng, world, n);
        // Every rank on device 0: only the identities tell the devices.
        let outs = try_world::<B, _>(&vec![0; world], &config, |rank, comm| {
            assert_eq!(comm.max_blocks(), 4 / per_device as u32, "{physical:?}");
            let dev = comm.device();
            let mut buf = B::alloc_from(dev, &ins[rank]).unwrap();
            let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
            comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &opts)
                .unwrap();
            comm.synchronize().unwrap();
            B::download(dev, &buf).unwrap()
        });
        let outs: Vec<Vec<f32>> = outs.into_iter().map(Result::unwrap).collect();
        common::check_sums(&ins, &outs, world, &format!("shared {physical:?}"));
    }
}

/// The single controller uses the same identities: two handles of device 0 as two
/// devices work; devices 0 and 1 as one are refused, naming both ranks.
pub fn single_controller_uses_identities<B: Backend>(place: &Placement) {
    let comm = SingleController::<B>::new(&[0, 0], config_on(place, 2, &[0, 1])).unwrap();
    let mut bufs: Vec<B::Buffer<f32>> = comm
        .cores()
        .iter()
        .enumerate()
        .map(|(r, rank)| B::alloc_from(rank.device(), &[r as f32 + 1.0; 513]).unwrap())
        .collect();
    let ran = comm
        .all_reduce_slices_in_place(&mut bufs, &ReduceOp::Sum, &AllReduceOptions::new())
        .unwrap();
    assert_ne!(ran, Algorithm::Nccl);
    comm.synchronize().unwrap();
    for (rank, buf) in comm.cores().iter().zip(&bufs) {
        assert_eq!(B::download(rank.device(), buf).unwrap(), vec![3.0; 513]);
    }
    drop(bufs);
    drop(comm);
    let err =
        SingleController::<B>::new(&[0, 1], config_on(place, 2, &[7, 7])).expect_err("refused");
    let text = err.to_string();
    let uuid = DeviceIdentity::simulated(0, 7).uuid_string().unwrap();
    assert!(text.contains("ranks 0 and 1"), "{text}");
    assert!(text.contains(&uuid), "{text}");
}
