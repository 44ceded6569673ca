//! The Lamport fused all-reduce + residual + RMSNorm against the one-stage one, and
//! batch invariance, generic over the backend (the per-rank suite shares the pools).
//!
//! Each case draws a pool of token rows (random partials with -0.0 lanes and all--0.0
//! columns, which Lamport sends as +0.0; one residual and weight for every rank). The
//! pool runs once one-stage, checked against the f64 reference: the golden rows. Then
//! batches of every token count at several offsets run under OneStage, Lamport and
//! Auto, and every row must be its golden row bit for bit, output and residual.

use peercomm::backend::Backend;
use peercomm::{
    Algorithm, CollectiveOptions, CommConfig, DType, Element, ReduceOp, SingleController,
};
use rand::rngs::StdRng;
use rand::Rng;

use super::collectives::{assert_bits, check_rms_norm};
use super::{poisoned, random_values, upload, views, views_mut};

/// One shape family: a dtype, a hidden size and the token counts its batches take (the
/// largest is the pool).
#[derive(Clone, Copy, Debug)]
pub struct FusedCase {
    pub dtype: DType,
    pub hidden: usize,
    pub tokens: &'static [usize],
}

const DECODE_TOKENS: &[usize] = &[1, 8, 32, 128, 256];

/// The decode shapes: bf16 and f16, hidden 4096 and 8192, 1 to 256 tokens;
/// then small rows (fast, and more rows per block than blocks) and f32.
pub const DECODE_CASES: [FusedCase; 7] = [
    FusedCase {
        dtype: DType::BF16,
        hidden: 8192,
        tokens: DECODE_TOKENS,
    },
    FusedCase {
        dtype: DType::F16,
        hidden: 8192,
        tokens: DECODE_TOKENS,
    },
    FusedCase {
        dtype: DType::BF16,
        hidden: 4096,
        tokens: DECODE_TOKENS,
    },
    FusedCase {
        dtype: DType::F16,
        hidden: 4096,
        tokens: DECODE_TOKENS,
    },
    FusedCase {
        dtype: DType::BF16,
        hidden: 64,
        tokens: &[1, 3, 8, 17, 40],
    },
    FusedCase {
        dtype: DType::F16,
        hidden: 1032,
        tokens: &[1, 5, 32],
    },
    FusedCase {
        dtype: DType::F32,
        hidden: 1024,
        tokens: &[1, 8, 32],
    },
];

/// A configuration whose Lamport slot and payload hold the largest pool (256 x 8192
/// bf16), over `base`.
pub fn fused_config(base: CommConfig) -> CommConfig {
    base.with_lamport_slot_bytes((4 << 20) + 256)
        .with_payload_bytes(4 << 20)
}

/// The rows a case draws, for every rank.
pub struct Pool<T> {
    pub hidden: usize,
    pub rows: usize,
    /// Rank r's partial activations, `rows * hidden`.
    pub ins: Vec<Vec<T>>,
    pub residual: Vec<T>,
    pub weight: Vec<T>,
    pub epsilon: f32,
}

impl<T: Element> Pool<T> {
    /// Fresh random rows (see the module docs), the same for every caller of one seed.
    pub fn new(rng: &mut StdRng, world: usize, rows: usize, hidden: usize) -> Self {
        let n = rows * hidden;
        let mut ins: Vec<Vec<T>> = (0..world).map(|_| random_values::<T>(rng, n)).collect();
        let zero = T::from_f32(0.0);
        let neg_zero = T::from_f32(-0.0);
        for v in &mut ins {
            for x in v.iter_mut() {
                match rng.random_range(0..64) {
                    0 => *x = neg_zero,
                    1 => *x = zero,
                    _ => {}
                }
            }
        }
        // Columns that are -0.0 on every rank (the sum is +0.0 on every algorithm) and
        // -0.0 on all ranks but one.
        for e in (0..n).step_by(97) {
            for (q, v) in ins.iter_mut().enumerate() {
                if e % 2 == 0 || q != e % world {
                    v[e] = neg_zero;
                }
            }
        }
        let mut residual = random_values::<T>(rng, n);
        for x in residual.iter_mut().step_by(131) {
            *x = neg_zero;
        }
        let weight = random_values::<T>(rng, hidden);
        let epsilon = rng.random_range(1e-6f32..1e-3);
        Pool {
            hidden,
            rows,
            ins,
            residual,
            weight,
            epsilon,
        }
    }

    /// Elements of rows `[first, first + tokens)`.
    pub fn span(&self, first: usize, tokens: usize) -> std::ops::Range<usize> {
        first * self.hidden..(first + tokens) * self.hidden
    }
}

/// What one rank's fused call wrote: the output and the new residual.
#[derive(Clone)]
pub struct FusedRows<T> {
    pub out: Vec<T>,
    pub res: Vec<T>,
}

/// The offsets a batch of `tokens` takes in a pool of `rows`: the first rows, the last
/// ones, and one drawn (duplicates dropped).
pub fn offsets(rng: &mut StdRng, rows: usize, tokens: usize) -> Vec<usize> {
    let last = rows - tokens;
    let mut v = vec![0, last, rng.random_range(0..=last)];
    v.sort_unstable();
    v.dedup();
    v
}

/// Checks rank `rank`'s golden rows against the f64 reference of the unfused sequence.
pub fn check_golden<T: Element>(pool: &Pool<T>, golden: &FusedRows<T>, rank: usize, what: &str) {
    let world = pool.ins.len();
    check_rms_norm(
        &pool.ins,
        &pool.residual,
        &pool.weight,
        world,
        rank,
        pool.epsilon,
        &golden.out,
        &golden.res,
        what,
    );
}

/// Asserts that a batch's rows (`got`, rows `[first, first + tokens)` of the pool) are
/// the golden rows bit for bit.
pub fn assert_golden<T: Element>(
    golden: &FusedRows<T>,
    got: &FusedRows<T>,
    span: std::ops::Range<usize>,
    what: &str,
) {
    assert_bits(
        &got.out,
        &golden.out[span.clone()],
        &format!("{what}: output"),
    );
    assert_bits(
        &got.res,
        &golden.res[span],
        &format!("{what}: new residual"),
    );
}

/// A digest of rows, to compare ranks that live in other threads.
pub fn digest<T: Element>(rows: &FusedRows<T>) -> u64 {
    super::digest(&[&rows.out[..], &rows.res[..]].concat())
}

/// Enqueues a fused call on rows `span` of `pool` under `algorithm`, fresh buffers:
/// `[inputs, weights, residuals, outputs]` (the kernel reads all until the synchronize).
fn enqueue_rows<B: Backend, T: Element>(
    comm: &SingleController<B>,
    pool: &Pool<T>,
    span: std::ops::Range<usize>,
    algorithm: Algorithm,
    what: &str,
) -> [Vec<B::Buffer<T>>; 4] {
    let each = |rows: &dyn Fn(usize) -> Vec<T>| -> Vec<B::Buffer<T>> {
        let upload = |r| upload::<B, T>(comm.core(r).device(), &rows(r));
        (0..comm.world_size()).map(upload).collect()
    };
    let ins = each(&|r| pool.ins[r][span.clone()].to_vec());
    let ws = each(&|_| pool.weight.clone());
    let mut res = each(&|_| pool.residual[span.clone()].to_vec());
    let mut outs = each(&|_| vec![T::from_f32(f32::NAN); span.len()]);
    let (rt, o) = (&mut views_mut(&mut res), &mut views_mut(&mut outs));
    let opts = CollectiveOptions::new().algorithm(algorithm);
    comm.all_reduce_residual_rms_norm(&views(&ins), rt, &views(&ws), o, pool.epsilon, &opts)
        .expect(what);
    [ins, ws, res, outs]
}

/// One single-controller fused call on rows `[first, first + tokens)` under `algorithm`,
/// fresh buffers; every rank's rows after a synchronize.
pub fn run_fused<B: Backend, T: Element>(
    comm: &SingleController<B>,
    pool: &Pool<T>,
    first: usize,
    tokens: usize,
    algorithm: Algorithm,
    what: &str,
) -> Vec<FusedRows<T>> {
    let [_, _, res, outs] = enqueue_rows(comm, pool, pool.span(first, tokens), algorithm, what);
    comm.synchronize().expect(what);
    let dev = |r: usize| comm.core(r).device();
    (0..comm.world_size())
        .map(|r| FusedRows {
            out: B::download(dev(r), &outs[r]).expect("download"),
            res: B::download(dev(r), &res[r]).expect("download"),
        })
        .collect()
}

/// The algorithms every batch runs under.
pub const ALGORITHMS: [Algorithm; 3] = [Algorithm::OneStage, Algorithm::Lamport, Algorithm::Auto];

/// Every case on an open communicator of two or more ranks (whole world: where Lamport
/// runs), single controller. Returns the batches checked.
pub fn lamport_fused_matches_one_stage<B: Backend>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    cases: &[FusedCase],
) -> usize {
    let mut batches = 0;
    for case in cases {
        batches += for_dtype!(case.dtype, T => check_case::<B, T>(comm, rng, case));
    }
    batches
}

fn check_case<B: Backend, T: Element>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    case: &FusedCase,
) -> usize {
    let world = comm.world_size();
    let rows = *case.tokens.iter().max().unwrap();
    let pool = Pool::<T>::new(rng, world, rows, case.hidden);
    let what = format!("fused {:?} world {world} {rows}x{}", T::DTYPE, case.hidden);
    let golden = run_fused(comm, &pool, 0, rows, Algorithm::OneStage, &what);
    for r in 0..world {
        check_golden(&pool, &golden[r], r, &format!("{what} one-stage rank {r}"));
        assert_golden(
            &golden[0],
            &golden[r],
            0..rows * case.hidden,
            &format!("{what}: rank {r} against rank 0"),
        );
    }
    let mut batches = 0;
    for &tokens in case.tokens {
        for first in offsets(rng, rows, tokens) {
            for algorithm in ALGORITHMS {
                let what = format!(
                    "{what}: rows {first}..{} under {}",
                    first + tokens,
                    algorithm.name()
                );
                let got = run_fused(comm, &pool, first, tokens, algorithm, &what);
                for r in 0..world {
                    let span = pool.span(first, tokens);
                    assert_golden(&golden[r], &got[r], span, &format!("{what} rank {r}"));
                }
                batches += 1;
            }
        }
    }
    batches
}

/// A single-controller fused call enqueued and not yet synchronized: its buffers.
struct Pending<B: Backend, T: Element> {
    pool: Pool<T>,
    res: Vec<B::Buffer<T>>,
    outs: Vec<B::Buffer<T>>,
    // Read by the kernel until the synchronize.
    _keep: [Vec<B::Buffer<T>>; 2],
}

/// Enqueues a fused call over the whole pool under `algorithm`, without synchronizing.
fn enqueue_fused<B: Backend, T: Element>(
    comm: &SingleController<B>,
    pool: Pool<T>,
    algorithm: Algorithm,
) -> Pending<B, T> {
    let span = pool.span(0, pool.rows);
    let [ins, ws, res, outs] = enqueue_rows(comm, &pool, span, algorithm, "enqueue a fused call");
    Pending {
        pool,
        res,
        outs,
        _keep: [ins, ws],
    }
}

/// The Lamport all-reduce and fused kernel share each rank's Lamport state: rounds of
/// both, of changing sizes, back to back, each checked against the reference (fused
/// also against one-stage, bit for bit).
pub fn lamport_kinds_interleave<B: Backend>(comm: &SingleController<B>, rng: &mut StdRng) {
    let world = comm.world_size();
    let ranks = comm.cores();
    let dev = |r: usize| ranks[r].device();
    let shapes = [(8, 4096), (1, 8192), (40, 64), (3, 1032), (32, 4096)];
    let lens = [100_003, 7, 65_536, 4099, 1];
    let mut fused = Vec::new();
    let mut reduced = Vec::new();
    for round in 0..2 {
        for (i, (&(tokens, hidden), &len)) in shapes.iter().zip(&lens).enumerate() {
            let pool = Pool::<half::bf16>::new(rng, world, tokens, hidden);
            fused.push(enqueue_fused::<B, _>(comm, pool, Algorithm::Lamport));
            let ins = super::random_inputs::<f32>(rng, world, len);
            let send = super::on_ranks(comm, |r, d| upload::<B, f32>(d, &ins[r]));
            let mut recv = super::on_ranks(comm, |_, d| poisoned::<B, f32>(d, len));
            let opts = peercomm::AllReduceOptions::new().algorithm(Algorithm::Lamport);
            comm.all_reduce(
                &views(&send),
                &mut views_mut(&mut recv),
                &ReduceOp::Sum,
                &opts,
            )
            .unwrap_or_else(|e| panic!("round {round} call {i}: {e}"));
            reduced.push((ins, send, recv));
        }
    }
    comm.synchronize().expect("interleaved Lamport calls");
    for (i, (ins, _send, recv)) in reduced.iter().enumerate() {
        let outs = super::on_ranks(comm, |r, d| B::download(d, &recv[r]).unwrap());
        super::check_sums(ins, &outs, world, &format!("interleaved all-reduce {i}"));
    }
    for (i, p) in fused.iter().enumerate() {
        let what = format!("interleaved fused {i} ({}x{})", p.pool.rows, p.pool.hidden);
        let alone = run_fused(comm, &p.pool, 0, p.pool.rows, Algorithm::OneStage, &what);
        for (r, alone) in alone.iter().enumerate() {
            let got = FusedRows {
                out: B::download(dev(r), &p.outs[r]).unwrap(),
                res: B::download(dev(r), &p.res[r]).unwrap(),
            };
            check_golden(&p.pool, &got, r, &format!("{what} rank {r}"));
            assert_golden(alone, &got, 0..got.out.len(), &format!("{what} rank {r}"));
        }
    }
}
