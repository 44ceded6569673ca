//! Rank processes that die or churn: a peer killed mid-collective or before a
//! registration gives typed errors in bounded time, and communicators built and
//! dropped in a loop leak no fd or mapping.

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

use peercomm::backend::Backend;
use peercomm::bootstrap::{TcpBootstrap, UniqueId};
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig, Error, ReduceOp};

use super::processes::{config_for, lines_of, spawn_with, ChildArgs};
use super::Placement;

/// The child roles of this module (`processes::child_main` hands them on); whether
/// `role` is one.
pub(super) fn child_role<B: Backend>(
    role: &str,
    (devices, rank, world, id, seed): ChildArgs,
) -> bool {
    match role {
        "killed" => {
            let dev = B::open(devices.ordinal(rank)).unwrap();
            let comm = Comm::<B>::from_rank(dev, rank, world, id, killed_config(devices)).unwrap();
            let dev = comm.device();
            let mut buf = B::alloc_buffer::<f32>(dev, 4096).unwrap();
            // Late into the call, then killed by the parent while rank 0 waits.
            comm.delay(Duration::from_secs(30)).unwrap();
            match KilledIn::ALL[seed as usize] {
                KilledIn::AllReduce => {
                    let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
                    comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &opts)
                        .unwrap();
                }
                KilledIn::Exchange => comm.send(&buf, 0).unwrap(),
                KilledIn::LamportMax => {
                    let opts = AllReduceOptions::new().algorithm(Algorithm::Lamport);
                    comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Max, &opts)
                        .unwrap();
                }
            }
            println!("READY");
            std::thread::sleep(Duration::from_secs(60));
        }
        "idle" => {
            // Joins, says so, and waits to be killed by the parent.
            let dev = B::open(devices.ordinal(rank)).unwrap();
            let _comm = Comm::<B>::from_rank(dev, rank, world, id, killed_config(devices)).unwrap();
            println!("READY");
            std::thread::sleep(Duration::from_secs(60));
        }
        "cycles" => {
            let boot =
                Arc::new(TcpBootstrap::connect(id, rank, world, Duration::from_secs(30)).unwrap());
            create_drop_cycles::<B>(devices, &boot, rank, WARM_UP);
            let before = open_files_and_maps();
            create_drop_cycles::<B>(devices, &boot, rank, seed as usize);
            print_counts(before);
        }
        _ => return false,
    }
    true
}

/// Both sides of the killed-process test: a short timeout.
fn killed_config(devices: &Placement) -> CommConfig {
    config_for(devices, 2).with_barrier_timeout(Some(Duration::from_millis(500)))
}

/// Waits until `child` prints READY, so that it is where the test wants it.
fn wait_for_ready(child: &mut Child) {
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.any(|l| l.map(|l| l.contains("READY")).unwrap_or(false)));
}

/// Drops `comm` beside a dead peer: it must not hang on it.
fn drop_beside_dead_peer<B: Backend>(comm: Comm<B>) {
    let dropped = Instant::now();
    drop(comm);
    assert!(
        dropped.elapsed() < Duration::from_secs(10),
        "dropping beside a dead peer took {:?}",
        dropped.elapsed()
    );
}

/// The call a killed peer dies in.
#[derive(Clone, Copy, Debug)]
enum KilledIn {
    /// A one-stage all-reduce.
    AllReduce,
    /// A send to rank 0, which receives (the exchange: the pair synchronises alone).
    Exchange,
    /// A Lamport all-reduce under `Max` (no barrier: the survivor polls for the peer's
    /// encoded packs).
    LamportMax,
}

impl KilledIn {
    const ALL: [KilledIn; 3] = [
        KilledIn::AllReduce,
        KilledIn::Exchange,
        KilledIn::LamportMax,
    ];
}

/// A rank killed mid-call (an all-reduce, a send to rank 0, a Lamport all-reduce under
/// `Max`): the survivor gets `BarrierTimeout` within twice the timeout, writes nothing,
/// refuses further calls, and drops without hanging.
pub fn killed_process_gives_a_typed_error<B: Backend>(devices: &Placement) {
    for (i, call) in KilledIn::ALL.into_iter().enumerate() {
        killed_in::<B>(devices, i, call);
    }
}

fn killed_in<B: Backend>(devices: &Placement, i: usize, call: KilledIn) {
    let id = UniqueId::new().unwrap();
    let mut child = spawn_with("killed", 1, 2, &id.to_string(), i as u64, &[]);
    let cfg = killed_config(devices);
    let timeout = cfg.barrier_timeout.unwrap();
    let comm = Comm::<B>::from_rank(B::open(devices.ordinal(0)).unwrap(), 0, 2, &id, cfg).unwrap();
    let dev = comm.device();
    let mut out = B::alloc_buffer::<f32>(dev, 4096).unwrap();
    B::upload(dev, &[f32::NAN; 4096], &mut out).unwrap();
    let mut input = B::alloc_buffer::<f32>(dev, 4096).unwrap();
    B::upload(dev, &[1.0; 4096], &mut input).unwrap();
    // Wait until the child has queued its (late) call, then kill it.
    wait_for_ready(&mut child);
    let start = Instant::now();
    let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    let mut make_call = || match call {
        KilledIn::AllReduce => comm
            .all_reduce_with(&input, &mut out, &ReduceOp::Sum, &opts)
            .map(drop),
        KilledIn::Exchange => comm.recv(&mut out, 1),
        KilledIn::LamportMax => {
            let lamport = AllReduceOptions::new().algorithm(Algorithm::Lamport);
            comm.all_reduce_with(&input, &mut out, &ReduceOp::Max, &lamport)
                .map(drop)
        }
    };
    make_call().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    match comm.synchronize() {
        Err(Error::BarrierTimeout { rank: 0, .. }) => {}
        other => panic!("{call:?}: expected a barrier timeout on rank 0, got {other:?}"),
    }
    let elapsed = start.elapsed();
    let holds = elapsed < 2 * timeout + Duration::from_secs(2);
    assert!(holds, "{call:?}: the timeout took {elapsed:?}");
    match make_call() {
        Err(Error::Poisoned { first }) if matches!(*first, Error::BarrierTimeout { .. }) => {}
        other => panic!("{call:?}: expected Poisoned by the barrier timeout, got {other:?}"),
    }
    assert!(
        B::download(dev, &out).unwrap().iter().all(|x| x.is_nan()),
        "{call:?}: written"
    );
    drop_beside_dead_peer(comm);
}

/// A peer killed before `register` / `register_inputs_of`: each returns a typed error
/// in bounded time, hands the buffer back, registers nothing; the drop does not hang.
pub fn registration_beside_a_killed_peer<B: Backend>(devices: &Placement) {
    let id = UniqueId::new().unwrap();
    let mut child = spawn_with("idle", 1, 2, &id.to_string(), 1, &[]);
    let cfg = killed_config(devices);
    let timeout = cfg.barrier_timeout.unwrap();
    let comm = Comm::<B>::from_rank(B::open(devices.ordinal(0)).unwrap(), 0, 2, &id, cfg).unwrap();
    wait_for_ready(&mut child);
    child.kill().unwrap();
    child.wait().unwrap();
    let dev = comm.device();
    let input = B::alloc_from(dev, &[1.0f32; 4096]).unwrap();
    let mut out = B::alloc_from(dev, &[f32::NAN; 4096]).unwrap();
    let bound = 2 * timeout + Duration::from_secs(5);

    let start = Instant::now();
    let refused = comm
        .register(input)
        .expect_err("a registration beside a dead peer");
    let holds = start.elapsed() < bound;
    assert!(holds, "register took {:?}", start.elapsed());
    eprintln!("register beside a killed peer: {}", refused.error);
    assert!(
        matches!(refused.error, Error::Bootstrap(_)),
        "register: the closed connection, got {:?}",
        refused.error
    );
    let input = refused.buffer;
    assert_eq!(comm.registrations(), (0, 0));

    let start = Instant::now();
    let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    let outcome =
        comm.register_inputs_of(|| comm.all_reduce_with(&input, &mut out, &ReduceOp::Sum, &opts));
    let error = match outcome {
        Ok(_) => panic!("register_inputs_of beside a dead peer returned Ok"),
        Err(e) => e,
    };
    let holds = start.elapsed() < bound;
    assert!(holds, "register_inputs_of took {:?}", start.elapsed());
    eprintln!("register_inputs_of beside a killed peer: {error}");
    assert!(
        matches!(
            error,
            Error::Bootstrap(_) | Error::BarrierTimeout { .. } | Error::PeerAborted { .. }
        ),
        "register_inputs_of: the dead peer named, got {error:?}"
    );
    assert_eq!(comm.registrations(), (0, 0));
    // Whatever the first pass enqueued gives up on the dead peer: a typed error, and
    // nothing written into the output.
    assert!(comm.synchronize().is_err());
    assert!(B::download(dev, &out).unwrap().iter().all(|x| x.is_nan()));
    drop_beside_dead_peer(comm);
}

/// Open file descriptors and mapped ranges of this process.
pub(super) fn open_files_and_maps() -> (usize, usize) {
    let fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
    let maps = std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count();
    (fds, maps)
}

/// 1000 communicators built and dropped over one bootstrap, each with a small
/// all-reduce, by `rank` in lock step with its peer.
fn create_drop_cycles<B: Backend>(
    devices: &Placement,
    boot: &Arc<TcpBootstrap>,
    rank: usize,
    cycles: usize,
) {
    let cfg = config_for(devices, 2)
        .with_lamport_slot_bytes(4096)
        .with_payload_bytes(64 << 10)
        // A short park (2 x 2 s + the margin) for a drop the machine starved.
        .with_barrier_timeout(Some(Duration::from_secs(2)));
    for _ in 0..cycles {
        let dev = B::open(devices.ordinal(rank)).unwrap();
        let comm = Comm::<B>::from_bootstrap(dev, Box::new(boot.clone()), cfg.clone()).unwrap();
        let mut local = B::alloc_buffer::<f32>(comm.device(), 16).unwrap();
        B::upload(comm.device(), &[1.0; 16], &mut local).unwrap();
        comm.all_reduce_in_place_with(&mut local, &ReduceOp::Sum, &AllReduceOptions::new())
            .unwrap();
        comm.synchronize().unwrap();
        assert_eq!(B::download(comm.device(), &local).unwrap(), vec![2.0; 16]);
    }
}

/// Cycles before the counts are taken: the first ones fill caches that stay (glibc
/// keeps the stacks of exited threads mapped for reuse, up to a bound).
const WARM_UP: usize = 50;

/// 1000 create/drop cycles of a two-process communicator leak no mapping or fd, both
/// ranks in child processes (so tests beside it cannot move the counts); teardowns
/// parked by a starved peer are freed at their deadline before counting.
// `B` and `devices` are the children's.
#[allow(clippy::extra_unused_type_parameters)]
pub fn create_drop_cycles_leak_nothing<B: Backend>(_devices: &Placement, cycles: usize) {
    let test = "per_rank_create_drop_cycles_leak_nothing";
    counts_stay_flat(test, "cycles", cycles, &[]);
}

/// In a child after its cycles: frees the teardowns a starved drop parked (at their
/// deadline: freed, not leaked), then prints `COUNTS` of open files and maps before
/// and now, and how many were parked.
pub(super) fn print_counts(before: (usize, usize)) {
    let (parked, until) = peercomm::unstable::parked_teardowns();
    if let Some(until) = until {
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
        peercomm::unstable::free_expired_teardowns();
    }
    std::thread::sleep(Duration::from_millis(200)); // freed streams' threads exit
    let after = open_files_and_maps();
    let (b, a) = (before, after);
    println!("COUNTS {} {} {} {} {parked}", b.0, b.1, a.0, a.1);
}

/// Both ranks of a two-process world run `role` (`cycles` as the seed, `extra` in the
/// environment); each one's open files and maps (its `COUNTS`) may grow by 16 at most.
pub(super) fn counts_stay_flat(test: &str, role: &str, cycles: usize, extra: &[(String, String)]) {
    let id = UniqueId::new().unwrap();
    let _ = id.release(); // rank 0 runs in a child: it binds the address itself
    let mut children: Vec<Child> = (0..2)
        .map(|rank| spawn_with(role, rank, 2, &id.to_string(), cycles as u64, extra))
        .collect();
    // Each child's whole output (stopping early would break its pipe).
    let counts: Vec<Vec<usize>> = children
        .iter_mut()
        .map(|child| {
            let lines = lines_of(child);
            let c = lines.iter().find_map(|l| l.strip_prefix("COUNTS "));
            let c = c.expect("the child's counts").split_whitespace();
            c.map(|x| x.parse().unwrap()).collect()
        })
        .collect();
    for child in &mut children {
        assert!(child.wait().unwrap().success(), "a rank process failed");
    }
    for (rank, c) in counts.iter().enumerate() {
        let [fds, maps] = [(c[0], c[2]), (c[1], c[3])];
        let parked = c[4]; // teardowns parked, then freed at their deadline
        eprintln!(
            "{test}: {cycles} cycles; rank {rank} fds {fds:?}, maps {maps:?}, parked {parked}"
        );
        // A leak would grow by about `cycles` (a mapping per import, a file per export);
        // after the warm-up the thread-stack cache and malloc arenas are in place.

        let holds = fds.1 <= fds.0 + 16;
        assert!(holds, "rank {rank} fds: {fds:?} after {cycles} cycles");
        let holds = maps.1 <= maps.0 + 16;
        assert!(holds, "rank {rank} maps: {maps:?} after {cycles} cycles");
    }
}
