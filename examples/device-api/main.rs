//! Kernels of an engine's own on peercomm's device API: a one-stage all-reduce, an
//! all-reduce with a bias + GELU epilogue fused into it, and a mixture-of-experts
//! combine (each token's expert outputs weighted by the router's scores and summed on
//! the token's home rank), each over a `DeviceComm` of a symmetric buffer, one rank a
//! thread (or, with `--processes`, a process), every output checked against an f64
//! reference.
//!
//! ```text
//! cargo run --release --example device-api                  # host backend (host.rs)
//! cargo run --release --example device-api -- --world 4 --processes   # a process a rank
//! cargo run --release --features cuda --example device-api -- --backend cuda [--world 2]
//! ```
//!
//! On CUDA the kernels (kernels.cu) are compiled at run time with NVRTC through cudarc
//! from `peercomm::device::prelude()` (libnvrtc found as cudarc finds it, or at
//! `PEERCOMM_NVRTC`), launched with cudarc's launch builder on each rank's stream (ranks
//! may share a GPU), and timed against the library's own one-stage all-reduce and
//! against the unfused pair (all-reduce, then a bias + GELU kernel), CUDA graphs.

use std::f64::consts::PI;

use peercomm::{CommConfig, UniqueId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[cfg(feature = "cuda")]
mod cuda;
mod host;

/// What every rank's kernels take, the same on every rank (from one seed).
pub struct Case {
    /// Elements of the all-reduces.
    pub n: usize,
    /// Rank r's all-reduce input.
    pub x: Vec<Vec<f32>>,
    /// The bias of the fused epilogue.
    pub bias: Vec<f32>,
    /// Tokens per home rank and their hidden size (the combine).
    pub tokens: usize,
    pub hidden: usize,
    /// Expert e's outputs: `world x tokens` rows of `hidden` (row h * tokens + t: token t
    /// of home rank h; zero where the token did not go to expert e).
    pub y: Vec<Vec<f32>>,
    /// Home rank h's router scores: `tokens x world` (0 where not routed).
    pub scores: Vec<Vec<f32>>,
}

/// One rank's outputs: the one-stage sum, the fused all-reduce + bias + GELU, the
/// combine.
pub struct Outputs {
    pub sum: Vec<f32>,
    pub fused: Vec<f32>,
    pub combined: Vec<f32>,
}

/// GELU, tanh form (kernels.cu's `gelu`).
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh())
}

fn gelu64(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

impl Case {
    /// Each token of each home rank goes to `top_k` experts (consecutive ranks from a
    /// random one) with random positive scores summing to 1; the last expert gets no
    /// token where the world has more than two ranks.
    fn new(world: usize, n: usize, tokens: usize, hidden: usize, seed: u64) -> Case {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut vals =
            |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-2.0..2.0)).collect() };
        let x = (0..world).map(|_| vals(n)).collect();
        let bias = vals(n);
        let experts = if world > 2 { world - 1 } else { world };
        let top_k = experts.min(2);
        let mut y = vec![vec![0.0f32; world * tokens * hidden]; world];
        let mut scores = vec![vec![0.0f32; tokens * world]; world];
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
        for (h, home_scores) in scores.iter_mut().enumerate() {
            for t in 0..tokens {
                let first = rng.random_range(0..experts);
                let raw: Vec<f32> = (0..top_k).map(|_| rng.random_range(0.1..1.0)).collect();
                let total: f32 = raw.iter().sum();
                for (k, s) in raw.iter().enumerate() {
                    let e = (first + k) % experts;
                    home_scores[t * world + e] = s / total;
                    let row = (h * tokens + t) * hidden;
                    for j in 0..hidden {
                        y[e][row + j] = rng.random_range(-1.0..1.0);
                    }
                }
            }
        }
        Case {
            n,
            x,
            bias,
            tokens,
            hidden,
            y,
            scores,
        }
    }

    /// Rank `rank`'s outputs, as f64: the sum, the fused epilogue, the combine.
    fn reference(&self, rank: usize) -> [Vec<f64>; 3] {
        let world = self.x.len();
        let sum: Vec<f64> = (0..self.n)
            .map(|i| self.x.iter().map(|x| f64::from(x[i])).sum())
            .collect();
        let fused = sum
            .iter()
            .zip(&self.bias)
            .map(|(s, b)| gelu64(s + f64::from(*b)))
            .collect();
        let (tokens, hidden) = (self.tokens, self.hidden);
        let combined = (0..tokens * hidden)
            .map(|i| {
                let (t, j) = (i / hidden, i % hidden);
                (0..world)
                    .map(|e| {
                        let s = f64::from(self.scores[rank][t * world + e]);
                        s * f64::from(self.y[e][(rank * tokens + t) * hidden + j])
                    })
                    .sum()
            })
            .collect();
        [sum, fused, combined]
    }
}

/// Checks `got` against `want` (f64) within `tolerance` relative to the magnitude
/// (plus as much absolute); the worst error.
fn check(what: &str, got: &[f32], want: &[f64], tolerance: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs() / (1.0 + w.abs());
        assert!(err <= tolerance, "{what}[{i}]: {g} against {w}");
        worst = worst.max(err);
    }
    worst
}

struct Args {
    backend: String,
    world: usize,
    processes: bool,
}

fn args() -> Args {
    let mut a = Args {
        backend: "host".into(),
        world: 2,
        processes: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--backend" => a.backend = value(),
            "--world" => a.world = value().parse().expect("--world N"),
            "--processes" => a.processes = true,
            other => {
                panic!("unknown argument {other} (--backend host|cuda, --world N, --processes)")
            }
        }
    }
    a
}

/// Set in the rank processes of `--processes`: the rank, and the id's text.
const RANK_ENV: &str = "PEERCOMM_DEVICE_API_RANK";
const ID_ENV: &str = "PEERCOMM_DEVICE_API_ID";

/// The case every rank runs (the same from the seed in every thread and process).
fn case_for(a: &Args) -> Case {
    let (n, tokens, hidden) = match a.backend.as_str() {
        "host" => (40_000, 8, 256),
        _ => (1 << 20, 64, 7168),
    };
    Case::new(a.world, n, tokens, hidden, 0xd0_1ce_u64)
}

/// Rank `rank`'s kernels on `backend`; its outputs.
fn rank_main(rank: usize, world: usize, id: &UniqueId, backend: &str, case: &Case) -> Outputs {
    let config = CommConfig::default().with_allow_shared_devices(true);
    match backend {
        "host" => {
            use peercomm::backend::{host::Host, Backend};
            let dev = Host::open(rank).expect("a host device");
            let comm =
                peercomm::Comm::from_rank(dev, rank, world, id, config).expect("a communicator");
            host::run(&comm, case).expect("the host kernels")
        }
        #[cfg(feature = "cuda")]
        "cuda" => cuda::run(rank, world, id, config, case),
        other => panic!("backend {other}: host, or cuda (with --features cuda)"),
    }
}

/// Checks rank `rank`'s outputs against the f64 reference and says so.
fn report(rank: usize, case: &Case, out: &Outputs) {
    let [sum, fused, combined] = case.reference(rank);
    let w = [
        check("one-stage sum", &out.sum, &sum, 1e-5),
        check("all-reduce + bias + GELU", &out.fused, &fused, 1e-5),
        check("mixture-of-experts combine", &out.combined, &combined, 1e-5),
    ];
    println!(
        "rank {rank}: one-stage sum, all-reduce + bias + GELU and the MoE combine match \
         the f64 reference (worst relative errors {:.1e}, {:.1e}, {:.1e})",
        w[0], w[1], w[2]
    );
}

fn main() -> std::process::ExitCode {
    let a = args();
    let world = a.world;
    let case = case_for(&a);
    if let Ok(rank) = std::env::var(RANK_ENV) {
        // A rank process of --processes.
        let rank: usize = rank.parse().expect("the rank");
        let id: UniqueId = std::env::var(ID_ENV)
            .expect("the id")
            .parse()
            .expect("an id");
        report(rank, &case, &rank_main(rank, world, &id, &a.backend, &case));
        return std::process::ExitCode::SUCCESS;
    }
    let id = UniqueId::new().expect("a unique id");
    if a.processes {
        // One process per rank, this binary again; rank 0 runs in a child, so the id's
        // listener goes first.
        id.release();
        let exe = std::env::current_exe().expect("this executable");
        let children: Vec<_> = (0..world)
            .map(|rank| {
                std::process::Command::new(&exe)
                    .args(std::env::args_os().skip(1))
                    .env(RANK_ENV, rank.to_string())
                    .env(ID_ENV, id.to_string())
                    .spawn()
                    .expect("a rank process")
            })
            .collect();
        let failed = children
            .into_iter()
            .map(|mut c| c.wait().map_or(true, |s| !s.success()))
            .filter(|&f| f)
            .count();
        if failed > 0 {
            eprintln!("{failed} of {world} rank processes failed");
            return std::process::ExitCode::FAILURE;
        }
        println!("{world} rank processes checked their outputs");
        return std::process::ExitCode::SUCCESS;
    }
    let outputs: Vec<Outputs> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let (id, case, backend) = (&id, &case, &a.backend);
                s.spawn(move || rank_main(rank, world, id, backend, case))
            })
            .collect();
        ranks
            .into_iter()
            .map(|r| r.join().expect("a rank"))
            .collect()
    });
    for (rank, out) in outputs.iter().enumerate() {
        report(rank, &case, out);
    }
    std::process::ExitCode::SUCCESS
}
