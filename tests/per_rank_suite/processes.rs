//! The per-rank communicator with one process per rank: rank 0 runs in the test, the
//! others are child processes of the test binary (`--exact per_rank_child`, parameters
//! in the environment); signal memory crosses through the backend's IPC. Each rank
//! checks its outputs and prints digests, which rank 0 compares per group. Isolated
//! processes open device 0 each (simulated on the host, `CUDA_VISIBLE_DEVICES` on CUDA).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use peercomm::backend::Backend;
use peercomm::bootstrap::UniqueId;
use peercomm::{
    Algorithm, AllReduceOptions, Comm, CommConfig, Error, FallbackConfig, ReduceOp, Simulation,
};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::{common, Placement};

const ROLE: &str = "PEERCOMM_TEST_ROLE";
const RANK: &str = "PEERCOMM_TEST_RANK";
const WORLD: &str = "PEERCOMM_TEST_WORLD";
const ID: &str = "PEERCOMM_TEST_ID";
const SEED: &str = "PEERCOMM_TEST_SEED";
pub(super) const VARIANT: &str = "PEERCOMM_TEST_VARIANT";

/// The process runs' configuration for `world` ranks placed by `devices`.
pub(super) fn config_for(devices: &Placement, world: usize) -> CommConfig {
    config()
        .with_max_blocks(Some(devices.max_blocks))
        .with_allow_shared_devices(world > devices.devices)
}

fn config() -> CommConfig {
    CommConfig::default()
        .with_lamport_slot_bytes(512 << 10)
        .with_payload_bytes(1 << 20)
        .with_barrier_timeout(Some(Duration::from_secs(20)))
        .with_max_blocks(Some(2))
        .with_bootstrap_timeout(Duration::from_secs(30))
}

fn env<T: std::str::FromStr>(name: &str) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} is not set"))
}

/// Starts rank `rank` of `world` in a child process running `role`, with `extra` in
/// its environment.
pub(super) fn spawn_with(
    role: &str,
    rank: usize,
    world: usize,
    id: &str,
    seed: u64,
    extra: &[(String, String)],
) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .envs(extra.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .args([
            "--exact",
            "per_rank_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .env(RANK, rank.to_string())
        .env(WORLD, world.to_string())
        .env(ID, id)
        .env(SEED, seed.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn a rank")
}

/// Input of `rank` for call `call`: the same in every process.
pub fn input(seed: u64, call: usize, rank: usize, len: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed ^ ((call as u64) << 20) ^ rank as u64);
    common::random_values::<f32>(&mut rng, len)
}

/// The calls every rank makes: (length, group size, algorithm, in place).
fn schedule(world: usize) -> Vec<(usize, usize, Algorithm, bool)> {
    let mut calls = Vec::new();
    for (i, len) in [1usize, 7, 1023, 4096, 65_537].into_iter().enumerate() {
        for group in common::group_sizes(world) {
            for algorithm in [Algorithm::Auto, Algorithm::OneStage, Algorithm::Lamport] {
                if algorithm == Algorithm::Lamport && group != world && group != 1 {
                    continue;
                }
                calls.push((len, group, algorithm, (i + group) % 2 == 0));
            }
        }
    }
    calls
}

/// A call's input, and its output unless it runs in place.
pub type SendRecv<B> = (
    <B as Backend>::Buffer<f32>,
    Option<<B as Backend>::Buffer<f32>>,
);

/// One rank's part of the checked schedule: all buffers first (an allocation among
/// in-flight collectives of ranks sharing a GPU can wait on them), then every call
/// back to back, then the checks; returns (call, digest) per call.
pub fn run_checked<B: Backend>(comm: &Comm<B>, seed: u64) -> Vec<(usize, u64)> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let calls = schedule(world);
    let mut buffers: Vec<SendRecv<B>> = calls
        .iter()
        .enumerate()
        .map(|(call, &(len, _, _, in_place))| {
            let mut send = B::alloc_buffer::<f32>(dev, len).unwrap();
            B::upload(dev, &input(seed, call, rank, len), &mut send).unwrap();
            let recv = (!in_place).then(|| {
                let mut recv = B::alloc_buffer::<f32>(dev, len).unwrap();
                B::upload(dev, &vec![f32::NAN; len], &mut recv).unwrap();
                recv
            });
            (send, recv)
        })
        .collect();
    for (&(_, group, algorithm, _), (send, recv)) in calls.iter().zip(&mut buffers) {
        let opts = AllReduceOptions::new()
            .group_size(group)
            .algorithm(algorithm);
        match recv {
            None => comm
                .all_reduce_in_place_with(send, &ReduceOp::Sum, &opts)
                .unwrap(),
            Some(recv) => comm
                .all_reduce_with(send, recv, &ReduceOp::Sum, &opts)
                .unwrap(),
        };
    }
    let kept: Vec<B::Buffer<f32>> = buffers
        .into_iter()
        .map(|(send, recv)| recv.unwrap_or(send))
        .collect();
    comm.synchronize().unwrap();
    let mut digests = Vec::new();
    for (call, (&(len, group, _, _), out)) in calls.iter().zip(&kept).enumerate() {
        let got = B::download(dev, out).unwrap();
        let base = rank / group * group;
        let ins: Vec<Vec<f32>> = (base..base + group)
            .map(|r| input(seed, call, r, len))
            .collect();
        common::check_sums(
            &ins,
            &vec![got.clone(); group],
            group,
            &format!("process rank {rank} call {call}"),
        );
        digests.push((call, common::digest(&got)));
    }
    // Point to point across processes where peer memory serves the world: a ring shift
    // in a group (one message of a payload region or less, one in chunks), each checked
    // against the sender's input.
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let peer_memory = !matches!(comm.world_path(), Algorithm::Nccl | Algorithm::Hierarchical);
    for (tag, len) in [(1000, 7), (1001, 3 << 20)]
        .into_iter()
        .filter(|_| peer_memory)
    {
        let mut send = B::alloc_buffer::<f32>(dev, len).unwrap();
        B::upload(dev, &input(seed, tag, rank, len), &mut send).unwrap();
        let mut recv = B::alloc_buffer::<f32>(dev, len).unwrap();
        B::upload(dev, &vec![f32::NAN; len], &mut recv).unwrap();
        let mut group = comm.group();
        group.send(&send, next).unwrap();
        group.recv(&mut recv, prev).unwrap();
        group.end().unwrap();
        comm.synchronize().unwrap();
        let got = common::bits(&B::download(dev, &recv).unwrap());
        let want = common::bits(&input(seed, tag, prev, len));
        assert!(
            got == want,
            "process rank {rank}: the ring shift of {len} from rank {prev}"
        );
    }
    digests
}

/// What a child role runs on: the placement, its rank, the world, the id and the seed.
pub(super) type ChildArgs<'a> = (&'a Placement, usize, usize, &'a UniqueId, u64);

/// In a child process: its role, rank, world, id and seed (`None` in the parent).
pub fn child_args() -> Option<(String, usize, usize, UniqueId, u64)> {
    let role = std::env::var(ROLE).ok()?;
    let id: UniqueId = env::<String>(ID).parse().unwrap();
    Some((role, env(RANK), env(WORLD), id, env(SEED)))
}

/// The child side: what a rank in another process does, by role. Each test binary
/// calls it from its `#[test] fn per_rank_child`; it does nothing in the parent.
pub fn child_main<B: Backend>(devices: &Placement) {
    let Some((role, rank, world, id, seed)) = child_args() else {
        return; // not a child: nothing to do
    };
    match role.as_str() {
        "checked" => {
            let dev = B::open(devices.ordinal(rank)).unwrap();
            let comm = Comm::<B>::from_rank(dev, rank, world, &id, config_for(devices, world));
            let comm = comm.unwrap();
            for (call, d) in run_checked(&comm, seed) {
                println!("DIGEST {call} {rank} {d}");
            }
        }
        "isolated" => {
            let variant: String = env(VARIANT);
            // Device 0, whatever the rank: the process sees only its own GPU.
            let config = isolated_config(devices, world, &variant);
            match Comm::<B>::from_rank(B::open(0).unwrap(), rank, world, &id, config) {
                Ok(comm) => {
                    println!("PATH {}", comm.world_path().name());
                    if variant.starts_with("blocked") {
                        println!("SUM {}", simple_sum(&comm));
                    } else {
                        for (call, d) in run_checked(&comm, seed) {
                            println!("DIGEST {call} {rank} {d}");
                        }
                    }
                }
                Err(e) => println!("ERROR {e}"),
            }
        }
        other => {
            let args = (devices, rank, world, &id, seed);
            let known = super::process_faults::child_role::<B>(other, args)
                || super::zero_copy::processes::child_role::<B>(other, args);
            assert!(known, "unknown role {other}");
        }
    }
}

/// The isolated runs' configuration: no shared devices, peer memory or nothing.
/// `variant`: `simulated`, `visible`, `blocked-refuse`, `blocked-fallback` (ranks 0
/// and 1 without peer access).
fn isolated_config(devices: &Placement, world: usize, variant: &str) -> CommConfig {
    let blocked = variant.starts_with("blocked");
    let mut simulate = Simulation::default();
    if variant != "visible" {
        simulate = simulate.with_physical_devices((0..world).collect());
    }
    if blocked {
        simulate = simulate.with_no_peer_access((0, 1));
    }
    config()
        .with_max_blocks(Some(devices.max_blocks))
        .with_allow_shared_devices(false)
        .with_fallback(if variant == "blocked-fallback" {
            FallbackConfig::default()
        } else {
            FallbackConfig::peer_memory_only()
        })
        .with_simulate(simulate)
}

/// An in-place all-reduce of `rank + 1` over 4099 f32, checked; `"ok"`.
fn simple_sum<B: Backend>(comm: &Comm<B>) -> &'static str {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let mut buf = B::alloc_from(dev, &vec![rank as f32 + 1.0; 4099]).unwrap();
    comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
    let want = (world * (world + 1) / 2) as f32;
    assert_eq!(B::download(dev, &buf).unwrap(), vec![want; 4099]);
    "ok"
}

/// Every tagged line a child printed (from its tag on: the harness may have put its own
/// text before it), until it exits.
pub(super) fn lines_of(child: &mut Child) -> Vec<String> {
    let tags = "DIGEST PATH SUM ERROR POOL SHAREABLE COUNTS CHANNEL";
    BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(|l| l.ok())
        .filter_map(|l| {
            let at = tags
                .split(' ')
                .filter_map(|t| l.find(&format!("{t} ")))
                .min();
            at.map(|at| l[at..].to_string())
        })
        .collect()
}

/// `world` isolated processes, each on device 0 but its own physical device: peer
/// memory over IPC serves them, sums right and bitwise equal. `visible`: `None`
/// simulates; `Some(var)` sets `var` to the r-th device for rank r's process.
pub fn isolated_world<B: Backend>(devices: &Placement, world: usize, visible: Option<&str>) {
    let seed = std::time::UNIX_EPOCH.elapsed().unwrap().as_nanos() as u64;
    let variant = visible.map_or("simulated", |_| "visible");
    eprintln!("isolated_world {world} ({variant}): seed {seed}");
    let id = UniqueId::new().unwrap();
    let text = id.to_string();
    let listed: Option<Vec<String>> = visible
        .and_then(|var| std::env::var(var).ok())
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let mut children: Vec<Child> = (1..world)
        .map(|r| {
            let mut extra = vec![(VARIANT.to_string(), variant.to_string())];
            if let Some(var) = visible {
                let device = listed
                    .as_ref()
                    .map_or_else(|| r.to_string(), |l| l[r].clone());
                extra.push((var.to_string(), device));
            }
            spawn_with("isolated", r, world, &text, seed, &extra)
        })
        .collect();
    let dev = B::open(0).unwrap();
    let comm =
        Comm::<B>::from_rank(dev, 0, world, &id, isolated_config(devices, world, variant)).unwrap();
    let note = "peer memory serves them";
    assert_eq!(comm.world_path(), Algorithm::Auto, "{note}");
    let mut all: Vec<(usize, usize, u64)> = run_checked(&comm, seed)
        .into_iter()
        .map(|(c, d)| (c, 0, d))
        .collect();
    for child in &mut children {
        let lines = lines_of(child);
        assert!(lines.contains(&"PATH auto".to_string()), "{lines:?}");
        all.extend(lines.iter().filter_map(|l| digest_line(l)));
        let status = child.wait().unwrap();
        assert!(status.success(), "a rank process failed: {status}");
    }
    drop(comm);
    let calls = compare_groups(world, &all);
    eprintln!("isolated_world {world} ({variant}): {calls} calls per rank checked");
}

/// Two isolated processes without peer access: `Fallback::Refuse` gives both ranks
/// `P2pUnavailable` naming both UUIDs; the default fallback sums right externally.
pub fn isolated_without_peer_access<B: Backend>(devices: &Placement) {
    use peercomm::DeviceIdentity;
    let uuids: Vec<String> = (0..2)
        .map(|p| DeviceIdentity::simulated(0, p).uuid_string().unwrap())
        .collect();
    for variant in ["blocked-refuse", "blocked-fallback"] {
        let id = UniqueId::new().unwrap();
        let extra = [(VARIANT.to_string(), variant.to_string())];
        let mut child = spawn_with("isolated", 1, 2, &id.to_string(), 1, &extra);
        let config = isolated_config(devices, 2, variant);
        let made = Comm::<B>::from_rank(B::open(0).unwrap(), 0, 2, &id, config);
        // The parent's part of the child's sum first: the child waits for it.
        let summed = made.as_ref().ok().map(simple_sum::<B>);
        let lines = lines_of(&mut child);
        assert!(child.wait().unwrap().success());
        if variant == "blocked-refuse" {
            let err = made.expect_err("refused");
            assert!(
                matches!(
                    err,
                    Error::P2pUnavailable {
                        from: 0,
                        to: 0,
                        from_rank: 0,
                        to_rank: 1,
                        ..
                    }
                ),
                "{err:?}"
            );
            let theirs = lines
                .iter()
                .find_map(|l| l.strip_prefix("ERROR "))
                .expect("the child's error");
            for text in [err.to_string(), theirs.to_string()] {
                assert!(text.contains("Simulation::no_peer_access"), "{text}");
                for u in &uuids {
                    assert!(text.contains(u.as_str()), "{u} missing from {text}");
                }
            }
            eprintln!("isolated_without_peer_access: {err}");
        } else {
            let comm = made.unwrap();
            assert_eq!(comm.world_path(), Algorithm::Nccl);
            assert_eq!(summed, Some("ok"));
            assert!(lines.contains(&"PATH nccl".to_string()), "{lines:?}");
            assert!(lines.contains(&"SUM ok".to_string()), "{lines:?}");
        }
    }
}

/// (call, rank, digest) of a `DIGEST call rank digest` line (the harness may print
/// "test per_rank_child ... " before it).
pub(super) fn digest_line(line: &str) -> Option<(usize, usize, u64)> {
    let f: Vec<&str> = line[line.find("DIGEST ")?..].split_whitespace().collect();
    Some((f[1].parse().ok()?, f[2].parse().ok()?, f[3].parse().ok()?))
}

/// Collects the `DIGEST` lines of a child's stdout, until it exits.
pub(super) fn digests_of(child: &mut Child) -> Vec<(usize, usize, u64)> {
    lines_of(child)
        .iter()
        .filter_map(|l| digest_line(l))
        .collect()
}

/// Checks that every rank of every call's group has the same digest as the group's
/// first rank, given (call, rank, digest) of every rank; returns the calls per rank.
pub fn compare_groups(world: usize, all: &[(usize, usize, u64)]) -> usize {
    let groups: Vec<usize> = schedule(world).iter().map(|c| c.1).collect();
    compare_group_digests(world, &groups, all)
}

/// As `compare_groups`, given each rank's (call, digest).
pub fn compare_ranks(world: usize, per_rank: &[Vec<(usize, u64)>]) -> usize {
    let all = per_rank.iter().enumerate();
    let all: Vec<_> = all
        .flat_map(|(r, d)| d.iter().map(move |&(c, h)| (c, r, h)))
        .collect();
    compare_groups(world, &all)
}

/// As `compare_groups`, call `c` over groups of `groups[c]`.
pub(super) fn compare_group_digests(
    world: usize,
    groups: &[usize],
    all: &[(usize, usize, u64)],
) -> usize {
    let by_call: HashMap<(usize, usize), u64> = all.iter().map(|&(c, r, d)| ((c, r), d)).collect();
    assert_eq!(by_call.len(), groups.len() * world, "a digest is missing");
    for (call, &group) in groups.iter().enumerate() {
        for rank in 0..world {
            let lead = rank / group * group;
            let note = format!("call {call}: rank {rank}'s bits differ from rank {lead}'s");
            assert_eq!(by_call[&(call, rank)], by_call[&(call, lead)], "{note}");
        }
    }
    groups.len()
}

/// Ranks 1.. as child processes running `role` (with `extra`), rank 0 here; every
/// rank's (call, rank, digest) once every child exited successfully.
pub(super) fn digest_world<B: Backend>(
    devices: &Placement,
    world: usize,
    role: &str,
    seed: u64,
    extra: &[(String, String)],
    rank0: impl FnOnce(&Comm<B>) -> Vec<(usize, u64)>,
) -> Vec<(usize, usize, u64)> {
    let id = UniqueId::new().unwrap();
    let text = id.to_string();
    let mut children: Vec<Child> = (1..world)
        .map(|r| spawn_with(role, r, world, &text, seed, extra))
        .collect();
    let dev = B::open(devices.ordinal(0)).unwrap();
    let comm = Comm::<B>::from_rank(dev, 0, world, &id, config_for(devices, world)).unwrap();
    let mut all: Vec<(usize, usize, u64)> =
        rank0(&comm).into_iter().map(|(c, d)| (c, 0, d)).collect();
    for child in &mut children {
        all.extend(digests_of(child));
        let status = child.wait().unwrap();
        assert!(status.success(), "a rank process failed: {status}");
    }
    all
}

/// Every rank checks the schedule; rank 0 compares the digests of every group.
pub fn checked_world<B: Backend>(devices: &Placement, world: usize) {
    let seed = common::seed(&format!("per_rank_processes world {world}"));
    let all = digest_world::<B>(devices, world, "checked", seed, &[], |comm| {
        run_checked(comm, seed)
    });
    let calls = compare_groups(world, &all);
    eprintln!("per_rank_processes world {world}: {calls} calls per rank, bits equal in groups");
}
