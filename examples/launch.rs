//! A multi-process launch: a launcher starts one process per rank, and each rank builds
//! its own [`peercomm::Comm`], all-reduces, and checks the sum.
//!
//! ```text
//! cargo run --release --example launch -- --ranks 4 --elements 100000
//! cargo run --release --features cuda --example launch -- --ranks 2   # on CUDA GPUs
//! ```
//!
//! What an engine's launcher (torchrun, an inference server's supervisor, a job
//! script) does, and what this example does step by step:
//!
//! 1. **The launcher makes the id.** [`UniqueId::new`] binds a TCP listener on
//!    `127.0.0.1` at a free port (on `PEERCOMM_BOOTSTRAP_ADDR` when set, for ranks on
//!    other hosts) and draws a random secret. The launcher is not a rank, so it calls
//!    [`UniqueId::release`] before starting anything: that closes the listener, and
//!    rank 0, in its own process, binds the same address itself when it joins.
//! 2. **It starts one process per rank**, here its own binary again, with the rank, the
//!    world size and the id in the environment (`PEERCOMM_LAUNCH_RANK`,
//!    `PEERCOMM_LAUNCH_WORLD`, `PEERCOMM_LAUNCH_ID`: the id's text form, 80 hex
//!    digits), as torchrun passes `RANK` and `WORLD_SIZE`. Any private channel that
//!    carries the text or [`UniqueId::to_bytes`] works (a key-value store, MPI, a file
//!    of mode 0600), but not the command line: the id holds the secret, and every local
//!    user can read a process's arguments in `/proc/<pid>/cmdline`. Each rank checks
//!    that its own arguments do not hold the id.
//! 3. **Each rank opens its own device and joins.** On CUDA: device `rank % device
//!    count`, a stream of the rank's own, [`CudaDevice::from_stream`] (an engine passes
//!    the stream its model runs on); `CommConfig::allow_shared_devices` when ranks
//!    outnumber the devices. Every rank passes the same id and the same [`CommConfig`]
//!    to [`Comm::from_rank`], which returns once all ranks have joined, or with a typed
//!    error after `CommConfig::bootstrap_timeout`.
//! 4. **Collectives run on each rank's own stream**, with this rank's buffers only.
//!    A rank that dies or stops calling makes its peers' calls end with a typed error
//!    (a barrier timeout, a peer abort), not a hang. Errors arrive late, as with NCCL,
//!    so each step enqueues its all-reduce, then calls [`Comm::check_errors`] (no wait:
//!    it reads the error record), and [`Comm::synchronize`] only where the rank waits
//!    anyway, before reading the sum back. An error's [`peercomm::Error::recovery`]
//!    says what to do: a rank that gets `Reinitialize` could have every rank call
//!    `reinitialize` and go on; this example reports it and fails the job instead.
//!    Here each rank all-reduces a pattern with values fresh for every call and every
//!    run (drawn from a seed the launcher passes), compares the sum with a CPU
//!    reference, and prints one result line; the launcher prints one line per rank and
//!    exits non-zero if any rank failed (or did not finish within `--timeout`). A rank
//!    that gets `Ok` while a peer fails is still a failed job: a rank that made fewer
//!    calls than its peers gets `Ok` from each of them.
//!
//! Without the `cuda` feature (and with `--host`) the ranks run on the host reference
//! backend, whose devices are memory shared between the processes.
//!
//! [`CudaDevice::from_stream`]: https://docs.rs/peercomm/latest/peercomm/backend/cuda/struct.CudaDevice.html#method.from_stream

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitCode, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use peercomm::backend::host::Host;
use peercomm::backend::Backend;
use peercomm::bootstrap::UniqueId;
use peercomm::{AllReduceOptions, Comm, CommConfig, DType, Recovery, ReduceOp};

/// Set in a rank's process: its rank. Its absence marks the launcher.
const RANK_ENV: &str = "PEERCOMM_LAUNCH_RANK";
/// The world size.
const WORLD_ENV: &str = "PEERCOMM_LAUNCH_WORLD";
/// The communicator's id, as text.
const ID_ENV: &str = "PEERCOMM_LAUNCH_ID";
/// The seed of this run's values.
const SEED_ENV: &str = "PEERCOMM_LAUNCH_SEED";
/// Prefix of the line on which a rank reports to the launcher.
const RESULT_LINE: &str = "PEERCOMM_LAUNCH_RESULT ";

const USAGE: &str =
    "usage: launch [--ranks N] [--elements N] [--iters N] [--timeout SECONDS] [--host]
  --ranks     processes (ranks) to start, default 2
  --elements  f32 elements per rank and call, default 1048576
  --iters     all-reduces per rank, each with fresh values, default 3
  --timeout   seconds the launcher waits for the ranks, default 120
  --host      run on the host backend even when built with the `cuda` feature";

#[derive(Clone, Debug)]
struct Args {
    ranks: usize,
    elements: usize,
    iters: usize,
    timeout: Duration,
    host: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        ranks: 2,
        elements: 1 << 20,
        iters: 3,
        timeout: Duration::from_secs(120),
        host: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<usize, String> {
            let v = it.next().ok_or(format!("{name} needs a value"))?;
            v.parse()
                .map_err(|_| format!("{name}: `{v}` is not a whole number"))
        };
        match flag.as_str() {
            "--ranks" => args.ranks = value("--ranks")?,
            "--elements" => args.elements = value("--elements")?,
            "--iters" => args.iters = value("--iters")?,
            "--timeout" => args.timeout = Duration::from_secs(value("--timeout")? as u64),
            "--host" => args.host = true,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if args.ranks == 0 || args.elements == 0 || args.iters == 0 {
        return Err("--ranks, --elements and --iters must be at least 1".into());
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(why) => {
            if !why.is_empty() {
                eprintln!("launch: {why}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match std::env::var(RANK_ENV) {
        Ok(rank) => rank_main(&args, &rank),
        Err(_) => launcher_main(&args),
    }
}

// ---------------------------------------------------------------------------------
// The launcher.

/// A started rank: its process and the threads draining its output.
struct Started {
    child: Child,
    stdout: JoinHandle<Vec<String>>,
    stderr: JoinHandle<String>,
}

fn launcher_main(args: &Args) -> ExitCode {
    let backend = if use_cuda(args) { "cuda" } else { "host" };
    // Step 1: the id, made here, released because rank 0 runs in another process.
    let id = match UniqueId::new() {
        Ok(id) => id,
        Err(e) => {
            eprintln!("launch: making the id failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    id.release();
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    println!(
        "launch: {} ranks on the {backend} backend, {} all-reduces of {} f32 each, \
         rank 0 at {}, seed {seed}",
        args.ranks,
        args.iters,
        args.elements,
        id.addr()
    );

    // Step 2: one process per rank, this binary again, with the same arguments.
    let exe = std::env::current_exe().expect("the path of this executable");
    let mut started: Vec<Result<Started, String>> = Vec::new();
    for rank in 0..args.ranks {
        let spawned = Command::new(&exe)
            .args(std::env::args_os().skip(1))
            .env(RANK_ENV, rank.to_string())
            .env(WORLD_ENV, args.ranks.to_string())
            .env(ID_ENV, id.to_string())
            .env(SEED_ENV, seed.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        started.push(match spawned {
            Ok(mut child) => {
                let out = child.stdout.take().expect("piped stdout");
                let mut err = child.stderr.take().expect("piped stderr");
                Ok(Started {
                    child,
                    stdout: std::thread::spawn(move || {
                        BufReader::new(out).lines().map_while(Result::ok).collect()
                    }),
                    stderr: std::thread::spawn(move || {
                        let mut s = String::new();
                        let _ = err.read_to_string(&mut s);
                        s
                    }),
                })
            }
            Err(e) => Err(format!("could not be started: {e}")),
        });
    }

    // Wait for every rank, as a launcher does: when one fails, the others get a few
    // seconds to end on their own (they report a typed error once they notice), then
    // are killed, as are ranks still running at the timeout.
    let ended = wait_all(&mut started, args.timeout);
    let mut failed = 0;
    for (rank, (s, end)) in started.into_iter().zip(ended).enumerate() {
        let line = match s {
            Err(why) => Err(why),
            Ok(s) => {
                let pid = s.child.id();
                let out = s.stdout.join().unwrap_or_default();
                let err = s.stderr.join().unwrap_or_default();
                let report = out.iter().find_map(|l| l.strip_prefix(RESULT_LINE));
                match (end, report) {
                    (End::Exited(st), Some(report)) if st.success() => {
                        Ok(format!("pid {pid}, {report}"))
                    }
                    (end, _) => {
                        let how = match end {
                            End::Exited(st) => format!("pid {pid} exited with {st}"),
                            End::Killed(why) => format!("pid {pid} killed: {why}"),
                        };
                        let last = err
                            .lines()
                            .rev()
                            .find(|l| !l.trim().is_empty())
                            .unwrap_or("(nothing on stderr)");
                        Err(format!("{how}: {}", last.trim()))
                    }
                }
            }
        };
        match line {
            Ok(report) => println!("rank {rank}/{}: ok: {report}", args.ranks),
            Err(why) => {
                failed += 1;
                println!("rank {rank}/{}: FAILED: {why}", args.ranks);
            }
        }
    }
    if failed == 0 {
        println!("launch: all {} ranks passed", args.ranks);
        ExitCode::SUCCESS
    } else {
        println!("launch: {failed} of {} ranks failed", args.ranks);
        ExitCode::FAILURE
    }
}

/// How a rank's process ended.
enum End {
    Exited(std::process::ExitStatus),
    /// Killed by the launcher, and why.
    Killed(String),
}

/// How long the other ranks get to end on their own once one has failed.
const GRACE: Duration = Duration::from_secs(3);

/// Waits for every started rank; kills those still running `GRACE` after the first
/// failure or at `timeout`. One entry per rank (a rank that could not be started
/// counts as a failure and gets a placeholder).
fn wait_all(started: &mut [Result<Started, String>], timeout: Duration) -> Vec<End> {
    let deadline = Instant::now() + timeout;
    let mut ended: Vec<Option<End>> = started.iter().map(|_| None).collect();
    let mut first_failure: Option<(usize, Instant)> = started
        .iter()
        .position(Result::is_err)
        .map(|rank| (rank, Instant::now()));
    loop {
        let mut running = false;
        for (rank, s) in started.iter_mut().enumerate() {
            let (Ok(s), None) = (s, &ended[rank]) else {
                continue;
            };
            match s.child.try_wait() {
                Ok(Some(status)) => {
                    if !status.success() && first_failure.is_none() {
                        first_failure = Some((rank, Instant::now()));
                    }
                    ended[rank] = Some(End::Exited(status));
                }
                Ok(None) => running = true,
                Err(e) => ended[rank] = Some(End::Killed(format!("waiting for it failed: {e}"))),
            }
        }
        if !running {
            break;
        }
        let why = match first_failure {
            Some((rank, at)) if at.elapsed() >= GRACE => Some(format!(
                "still running {} s after rank {rank} failed",
                GRACE.as_secs()
            )),
            _ if Instant::now() >= deadline => Some(format!(
                "did not finish within {} s (--timeout)",
                timeout.as_secs()
            )),
            _ => None,
        };
        if let Some(why) = why {
            for (rank, s) in started.iter_mut().enumerate() {
                if let (Ok(s), None) = (s, &ended[rank]) {
                    let _ = s.child.kill();
                    let _ = s.child.wait();
                    ended[rank] = Some(End::Killed(why.clone()));
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    ended
        .into_iter()
        .map(|e| e.unwrap_or_else(|| End::Killed("not started".into())))
        .collect()
}

// ---------------------------------------------------------------------------------
// A rank.

fn rank_main(args: &Args, rank: &str) -> ExitCode {
    match run_rank(args, rank) {
        Ok(report) => {
            println!("{RESULT_LINE}{report}");
            ExitCode::SUCCESS
        }
        Err(why) => {
            eprintln!("rank {rank}: {why}");
            ExitCode::FAILURE
        }
    }
}

fn env<T: std::str::FromStr>(name: &str) -> Result<T, String> {
    let v = std::env::var(name).map_err(|_| format!("{name} is not set"))?;
    v.parse()
        .map_err(|_| format!("{name}: `{v}` does not parse"))
}

fn use_cuda(args: &Args) -> bool {
    cfg!(feature = "cuda") && !args.host
}

fn run_rank(args: &Args, rank: &str) -> Result<String, String> {
    let rank: usize = rank
        .parse()
        .map_err(|_| format!("{RANK_ENV}: `{rank}` does not parse"))?;
    let world: usize = env(WORLD_ENV)?;
    let seed: u64 = env(SEED_ENV)?;
    // Step 3: the id from the launcher (in the environment, which other users cannot
    // read, unlike the command line), this rank's device.
    let text = env::<String>(ID_ENV)?;
    check_not_in_arguments(&text)?;
    let id: UniqueId = text.parse().map_err(|e| format!("{ID_ENV}: {e}"))?;
    if use_cuda(args) {
        #[cfg(feature = "cuda")]
        return cuda::run(args, rank, world, &id, seed);
    }
    let devices = Host::device_count().map_err(|e| e.to_string())?;
    let device = Host::open(rank % devices).map_err(|e| format!("opening host device: {e}"))?;
    all_reduce_checked::<Host>(device, args, rank, world, devices, &id, seed)
}

/// Fails if this process's command line holds `secret` (Linux: `/proc/self/cmdline`,
/// which every local user can read).
fn check_not_in_arguments(secret: &str) -> Result<(), String> {
    match std::fs::read("/proc/self/cmdline") {
        Ok(cmdline)
            if cmdline
                .windows(secret.len())
                .any(|w| w == secret.as_bytes()) =>
        {
            Err(
                "the UniqueId is on this rank's command line, where every local user can \
                 read it: pass it in the environment or a file of mode 0600"
                    .into(),
            )
        }
        _ => Ok(()),
    }
}

/// What a rank's error line says to do, from [`peercomm::Error::recovery`].
fn advice(e: &peercomm::Error) -> &'static str {
    match e.recovery() {
        Recovery::FixCall => "FixCall: nothing ran; change the call",
        Recovery::Reinitialize => "Reinitialize: every rank calls Comm::reinitialize",
        Recovery::Rebuild => "Rebuild: every rank drops its Comm; relaunch with a new id",
        Recovery::FixSetup => "FixSetup: change the configuration or the launch",
        _ => "unknown: relaunch",
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use cudarc::driver::CudaContext;
    use peercomm::backend::cuda::{Cuda, CudaDevice};

    /// Device `rank % count`, with a stream of this rank's own (an engine passes the
    /// stream its model runs on).
    pub fn run(
        args: &Args,
        rank: usize,
        world: usize,
        id: &UniqueId,
        seed: u64,
    ) -> Result<String, String> {
        // Counting through peercomm first: a missing driver is a typed error here,
        // before cudarc is asked to load it.
        let devices = Cuda::device_count().map_err(|e| e.to_string())?;
        if devices == 0 {
            return Err("no CUDA device (run with --host for the host backend)".into());
        }
        let ctx = CudaContext::new(rank % devices).map_err(|e| format!("CUDA context: {e}"))?;
        let stream = ctx.new_stream().map_err(|e| format!("CUDA stream: {e}"))?;
        let device = CudaDevice::from_stream(stream).map_err(|e| e.to_string())?;
        all_reduce_checked::<Cuda>(device, args, rank, world, devices, id, seed)
    }
}

/// Element `i` of `rank`'s input to call `iter`: a multiple of 1/8 in [-125, 125], so
/// every partial sum of up to 2^17 ranks is exact in f32 and the sum has one right
/// answer whatever order the ranks are added in.
fn value(seed: u64, iter: usize, rank: usize, i: usize) -> f32 {
    let mut x = seed ^ ((iter as u64) << 48) ^ ((rank as u64) << 32) ^ i as u64;
    // splitmix64
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    ((x % 2001) as i32 - 1000) as f32 / 8.0
}

/// Step 3 and 4 on any backend: join, then `args.iters` all-reduces (odd ones in
/// place), each checked against the sum computed here on the CPU.
fn all_reduce_checked<B: Backend>(
    device: B::Device,
    args: &Args,
    rank: usize,
    world: usize,
    devices: usize,
    id: &UniqueId,
    seed: u64,
) -> Result<String, String> {
    let start = Instant::now();
    let n = args.elements;
    let config = CommConfig::for_largest_message(n, DType::F32)
        .map_err(|e| e.to_string())?
        .with_allow_shared_devices(world > devices);
    let comm = Comm::<B>::from_rank(device, rank, world, id, config)
        .map_err(|e| format!("Comm::from_rank: {e} (recovery: {})", advice(&e)))?;
    let dev = comm.device();
    let where_ = match B::architecture(dev) {
        Ok(arch) if arch != B::NAME => format!("{} device {} ({arch})", B::NAME, B::ordinal(dev)),
        _ => format!("{} device {}", B::NAME, B::ordinal(dev)),
    };
    let fail = |what: &str, e: peercomm::Error| {
        format!("{what} on {where_}: {e} (recovery: {})", advice(&e))
    };
    // Buffers are made before the first collective (ranks sharing a GPU: an allocation
    // can wait for the device, and so for a peer that waits for this rank).
    let mut send = B::alloc_buffer::<f32>(dev, n).map_err(|e| fail("alloc", e))?;
    let mut recv = B::alloc_buffer::<f32>(dev, n).map_err(|e| fail("alloc", e))?;
    let options = AllReduceOptions::new();
    let mut algorithms = Vec::new();
    for iter in 0..args.iters {
        let input: Vec<f32> = (0..n).map(|i| value(seed, iter, rank, i)).collect();
        B::upload(dev, &input, &mut send).map_err(|e| fail("upload", e))?;
        let in_place = iter % 2 == 1;
        let algorithm = if in_place {
            comm.all_reduce_in_place_with(&mut send, &ReduceOp::Sum, &options)
        } else {
            B::upload(dev, &vec![f32::NAN; n], &mut recv).map_err(|e| fail("upload", e))?;
            comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &options)
        }
        .map_err(|e| fail("all_reduce", e))?;
        // Each step: a check that does not wait (an engine does its other work here),
        // then `synchronize` where the rank waits anyway, before reading the sum back.
        comm.check_errors().map_err(|e| fail("check_errors", e))?;
        comm.synchronize().map_err(|e| fail("synchronize", e))?;
        let got = B::download(dev, if in_place { &send } else { &recv })
            .map_err(|e| fail("download", e))?;
        // The CPU reference: every rank's input, rebuilt from the seed.
        let mut wrong = 0usize;
        let mut first_wrong = None;
        for (i, &g) in got.iter().enumerate() {
            let want: f32 = (0..world).map(|r| value(seed, iter, r, i)).sum();
            if g != want {
                wrong += 1;
                first_wrong.get_or_insert((i, g, want));
            }
        }
        if let Some((i, g, want)) = first_wrong {
            return Err(format!(
                "call {iter} ({algorithm:?}{}) on {where_}: {wrong} of {n} sums wrong, \
                 first at element {i}: {g} where the CPU reference is {want}",
                if in_place { ", in place" } else { "" }
            ));
        }
        algorithms.push(format!("{algorithm:?}"));
    }
    algorithms.dedup();
    Ok(format!(
        "{where_}, {} all-reduces of {n} f32 ({}), sums equal the CPU reference, {:.1} ms",
        args.iters,
        algorithms.join(", "),
        start.elapsed().as_secs_f64() * 1e3
    ))
}
