//! Zero copy on the per-rank `Comm`: symmetric (`alloc_symmetric`) and registered
//! (`register`) inputs read in place by the peers, every output checked against f64
//! and bit for bit against a `SingleController` on the same devices, inputs, algorithm
//! and grid (the all-reduce here, the other collectives in `collectives`); refusals;
//! lifetimes; and the same across processes.

pub mod collectives;
pub mod lifetimes;
pub mod processes;
pub mod refusals;

use peercomm::backend::{Backend, DeviceBufferMut, TypedBuffer};
use peercomm::{Algorithm, AllReduceOptions, Comm, DType, Element, ReduceOp, SingleController};

use super::common::collectives::assert_bits;
use super::common::{self, bits, group_sizes};
use super::{inputs, nan, seed, with_world, Placement};

/// Where a call's input lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// In a buffer of `Comm::alloc_symmetric`.
    Symmetric,
    /// In a plain buffer passed through `Comm::register`.
    Registered,
}

/// Lengths the cases cycle through: odd, so the last pack is partial for every dtype.
const LENGTHS: [usize; 5] = [1, 7, 1023, 4099, 65_537];
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Asserts `got`'s bits are `want`, the single controller's.
fn assert_same_bits<T: Element>(got: &[T], want: &[u32], what: &str) {
    let want: Vec<T> = want.iter().map(|&b| T::from_bits_u32(b)).collect();
    let what = format!("{what} (expected: the single controller's)");
    assert_bits(got, &want, &what);
}

/// A single controller over the devices the per-rank world of `world` ranks uses,
/// with the same configuration.
fn single_controller<B: Backend>(place: &Placement, world: usize) -> SingleController<B> {
    let ordinals: Vec<usize> = (0..world).map(|r| place.ordinal(r)).collect();
    SingleController::<B>::new(&ordinals, place.config(world)).expect("the single controller")
}

/// A symmetric buffer of 256 bytes to 1.25 KiB, allocated before a case's input so
/// that the input lies at an offset of its segment that changes from case to case
/// (the peers must add it to the segment's mapped base).
fn spacer<B: Backend>(comm: &Comm<B>, case: usize) -> peercomm::SymmetricBuffer<B, f32> {
    comm.alloc_symmetric::<f32>(64 * (1 + case % 5)).unwrap()
}

/// One all-reduce of the zero-copy matrix.
#[derive(Clone, Copy, Debug)]
struct ReduceCase {
    width: usize,
    algorithm: Algorithm,
    in_place: bool,
    input: Input,
    dtype: DType,
    len: usize,
    blocks: u32,
}

impl ReduceCase {
    fn options(&self) -> AllReduceOptions {
        AllReduceOptions::new()
            .group_size(self.width)
            .algorithm(self.algorithm)
            .blocks(self.blocks)
    }
}

/// Every group size x `algorithms` (Lamport only where it runs: the whole world and
/// groups of one) x in and out of place x symmetric and registered inputs x dtype;
/// lengths and grids (1 or 2 blocks) cycle through the cases.
fn reduce_cases(world: usize, algorithms: &[Algorithm]) -> Vec<ReduceCase> {
    let mut cases = Vec::new();
    for width in group_sizes(world) {
        for &algorithm in algorithms {
            if algorithm == Algorithm::Lamport && width != world && width != 1 {
                continue;
            }
            for in_place in [false, true] {
                for input in [Input::Symmetric, Input::Registered] {
                    for dtype in DTYPES {
                        let i = cases.len();
                        cases.push(ReduceCase {
                            width,
                            algorithm,
                            in_place,
                            input,
                            dtype,
                            len: LENGTHS[(i / 2 + i / 7) % LENGTHS.len()],
                            blocks: 1 + (i / 3 % 2) as u32,
                        });
                    }
                }
            }
        }
    }
    cases
}

/// What the single controller gave for one call: the algorithm, every rank's bits.
type Single = (Algorithm, Vec<Vec<u32>>);

fn single_reduce<B: Backend, T: Element>(
    comm: &SingleController<B>,
    c: &ReduceCase,
    ins: &[Vec<T>],
) -> Single {
    let alloc = |data: &dyn Fn(usize) -> Vec<T>| per_device(comm, data);
    let (mut bufs, mut outs) = (alloc(&|r| ins[r].clone()), alloc(&|_| nan(c.len)));
    let what = format!("single controller {c:?}");
    let algorithm = match c.in_place {
        true => comm.all_reduce_slices_in_place(&mut bufs, &ReduceOp::Sum, &c.options()),
        false => comm.all_reduce_slices(&bufs, &mut outs, &ReduceOp::Sum, &c.options()),
    };
    let algorithm = algorithm.expect(&what);
    if !c.in_place {
        bufs = outs;
    }
    comm.synchronize().expect(&what);
    (algorithm, bits_of(comm, &bufs))
}

/// A buffer on each of `comm`'s devices, rank r's holding `data(r)`.
fn per_device<B: Backend, T: Element>(
    comm: &SingleController<B>,
    data: &dyn Fn(usize) -> Vec<T>,
) -> Vec<B::Buffer<T>> {
    let ranks = comm.cores().iter().enumerate();
    ranks
        .map(|(r, c)| B::alloc_from(c.device(), &data(r)).unwrap())
        .collect()
}

/// Every rank's bits of `bufs`, one buffer per rank of `comm`.
fn bits_of<B: Backend, T: Element>(
    comm: &SingleController<B>,
    bufs: &[B::Buffer<T>],
) -> Vec<Vec<u32>> {
    let ranks = comm.cores().iter().zip(bufs);
    ranks
        .map(|(c, b)| bits(&B::download(c.device(), b).unwrap()))
        .collect()
}

/// The all-reduce from `input` (in place, or into a fresh poisoned output), waited for;
/// `read` downloads the input buffer.
fn reduce_from<B: Backend, T: Element, I: DeviceBufferMut<B>>(
    comm: &Comm<B>,
    input: &mut I,
    c: &ReduceCase,
    what: &str,
    read: impl Fn(&I) -> Vec<T>,
) -> (Algorithm, Vec<T>) {
    let dev = comm.device();
    let mut out = B::alloc_from(dev, &nan::<T>(c.len)).unwrap();
    let ran = match c.in_place {
        true => comm.all_reduce_in_place_with(input, &ReduceOp::Sum, &c.options()),
        false => comm.all_reduce_with(&*input, &mut out, &ReduceOp::Sum, &c.options()),
    };
    let ran = ran.expect(what);
    comm.synchronize().expect(what);
    let got = if c.in_place {
        read(input)
    } else {
        B::download(dev, &out).unwrap()
    };
    (ran, got)
}

/// One case on this rank: its input in a symmetric or a registered buffer, checked
/// against the f64 reference and the single controller's bits and algorithm.
fn check_reduce<B: Backend, T: Element>(
    comm: &Comm<B>,
    seed: u64,
    case: usize,
    c: &ReduceCase,
    single: &Single,
) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let ins = inputs::<T>(seed, case, world, c.len);
    let what = format!("per-rank case {case} {c:?} world {world} rank {rank}");
    let (algorithm, got) = match c.input {
        Input::Symmetric => {
            let _spacer = spacer(comm, case);
            let mut buf = comm.alloc_symmetric::<T>(c.len).expect(&what);
            assert_ne!(buf.placement().1, 0, "{what}: inside its segment");
            buf.copy_from_host(dev, &ins[rank]).unwrap();
            reduce_from(comm, &mut buf, c, &what, |b| b.to_host(dev).unwrap())
        }
        Input::Registered => {
            let plain = B::alloc_from(dev, &ins[rank]).unwrap();
            let mut buf = comm.register(plain).expect(&what);
            reduce_from(comm, &mut buf, c, &what, |b| B::download(dev, b).unwrap())
        }
    };
    assert_eq!(algorithm, single.0, "{what}: the algorithm that ran");
    if c.algorithm != Algorithm::Auto && c.width > 1 {
        assert_eq!(algorithm, c.algorithm, "{what}: the forced algorithm");
    }
    let base = rank / c.width * c.width;
    let group = &ins[base..base + c.width];
    common::check_sums(group, &vec![got.clone(); c.width], c.width, &what);
    assert_same_bits(&got, &single.1[rank], &what);
}

/// Case (a), all-reduce: every case of `reduce_cases` from symmetric or registered
/// inputs matches f64 and the single controller's bits and algorithm; afterwards only
/// the pool's one segment is registered.
pub fn all_reduce_matches_single_controller<B: Backend>(
    place: &Placement,
    world: usize,
    algorithms: &[Algorithm],
) {
    let seed = seed(&format!("per_rank_zero_copy_all_reduce_world_{world}"));
    let cases = reduce_cases(world, algorithms);
    let single: Vec<Single> = {
        let comm = single_controller::<B>(place, world);
        cases
            .iter()
            .enumerate()
            .map(|(i, c)| {
                by_dtype!(
                    c.dtype,
                    single_reduce::<B>(&comm, c, &inputs(seed, i, world, c.len))
                )
            })
            .collect()
    };
    with_world::<B, _>(place, world, |_rank, comm| {
        for (i, c) in cases.iter().enumerate() {
            by_dtype!(c.dtype, check_reduce::<B>(&comm, seed, i, c, &single[i]));
        }
        assert_eq!(comm.registrations(), (1, 0), "the pool's segment, no more");
    });
    let n = cases.len();
    eprintln!("per_rank_zero_copy_all_reduce_world_{world}: {n} cases per rank, bit for bit");
}
