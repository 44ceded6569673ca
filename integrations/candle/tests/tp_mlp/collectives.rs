//! Every collective of `CandleComm` against the f64 host reference: two ranks (on GPUs
//! 0 and 1, or sharing GPU 0), every operator and element type, every form (allocating,
//! into a poisoned output, in place), fresh inputs for every call; then the typed
//! errors of the new methods, with nothing written.

use candle_core::{DType, Device, IndexOp, Tensor};
use peercomm_candle::{
    AllReduceOptions, CandleComm, CollectiveOptions, CommConfig, Error, ReduceOp, UniqueId,
};

use super::reference::{check, input, poisoned, reduce, values, DTYPES, OPS};
use super::{gpus, placement, seed};

const SHAPE: (usize, usize) = (6, 37);

/// What one rank checks, call by call, given every rank's inputs of that call.
struct Ctx<'a> {
    comm: &'a CandleComm,
    dev: &'a Device,
    rank: usize,
    world: usize,
    seed: u64,
    call: u64,
}

impl Ctx<'_> {
    /// Every rank's fresh input of the next call (host), and this rank's on its device,
    /// starting inside its storage (rows 1.. of a larger tensor).
    fn next(&mut self, dtype: DType) -> (Vec<Vec<f64>>, Tensor) {
        self.call += 1;
        let all: Vec<Tensor> = (0..self.world)
            .map(|r| input(self.seed, self.call, r, SHAPE, dtype))
            .collect();
        let padded = Tensor::cat(&[&all[self.rank].i(0..1).unwrap(), &all[self.rank]], 0)
            .unwrap()
            .to_device(self.dev)
            .unwrap();
        let mine = padded.i(1..).unwrap();
        (all.iter().map(values).collect(), mine)
    }

    fn what(&self, c: &str, dtype: DType) -> String {
        format!("rank {} call {} {c} {dtype:?}", self.rank, self.call)
    }

    /// The last call's output `t` as f64, after the rank's stream has finished it and
    /// its kernels reported no error (a failed call leaves its output unwritten).
    fn result(&self, t: &Tensor) -> Vec<f64> {
        let (rank, call) = (self.rank, self.call);
        (self.comm.synchronize()).unwrap_or_else(|e| panic!("rank {rank} call {call}: {e}"));
        values(t)
    }

    fn all_reduce(&mut self, dtype: DType, op: ReduceOp) {
        let comm = self.comm;
        let (ins, x) = self.next(dtype);
        let y = comm.all_reduce(&x, &op).unwrap();
        assert_eq!((y.dims(), y.dtype()), (x.dims(), dtype));
        check(
            &self.result(&y),
            &reduce(op, &ins),
            dtype,
            Some(op),
            &self.what(&format!("all_reduce {op:?}"), dtype),
        );

        let (ins, x) = self.next(dtype);
        let opts = AllReduceOptions::new();
        let y = comm.all_reduce_with(&x, &op, &opts).unwrap();
        check(
            &self.result(&y),
            &reduce(op, &ins),
            dtype,
            Some(op),
            &self.what("all_reduce_with", dtype),
        );

        let (ins, x) = self.next(dtype);
        let out = poisoned(x.dims(), dtype, self.dev);
        comm.all_reduce_into(&x, &out, &op).unwrap();
        check(
            &self.result(&out),
            &reduce(op, &ins),
            dtype,
            Some(op),
            &self.what("all_reduce_into", dtype),
        );

        let (ins, x) = self.next(dtype);
        let out = poisoned(x.dims(), dtype, self.dev);
        comm.all_reduce_into_with(&x, &out, &op, &opts).unwrap();
        check(
            &self.result(&out),
            &reduce(op, &ins),
            dtype,
            Some(op),
            &self.what("all_reduce_into_with", dtype),
        );

        // The same tensor as input and output: in place.
        let (ins, x) = self.next(dtype);
        comm.all_reduce_into(&x, &x, &op).unwrap();
        check(
            &self.result(&x),
            &reduce(op, &ins),
            dtype,
            Some(op),
            &self.what("all_reduce_into (same)", dtype),
        );

        let (ins, x) = self.next(dtype);
        comm.all_reduce_in_place(&x, &op).unwrap();
        check(
            &self.result(&x),
            &reduce(op, &ins),
            dtype,
            Some(op),
            &self.what("all_reduce_in_place", dtype),
        );

        let (ins, x) = self.next(dtype);
        comm.all_reduce_in_place_with(&x, &op, &opts).unwrap();
        check(
            &self.result(&x),
            &reduce(op, &ins),
            dtype,
            Some(op),
            &self.what("all_reduce_in_place_with", dtype),
        );
    }

    /// This rank's rows of the reduction of `ins`.
    fn part(&self, op: ReduceOp, ins: &[Vec<f64>]) -> Vec<f64> {
        let all = reduce(op, ins);
        let n = all.len() / self.world;
        all[self.rank * n..(self.rank + 1) * n].to_vec()
    }

    fn reduce_scatter(&mut self, dtype: DType, op: ReduceOp) {
        let comm = self.comm;
        let part_dims = [SHAPE.0 / self.world, SHAPE.1];
        let (ins, x) = self.next(dtype);
        let y = comm.reduce_scatter(&x, &op).unwrap();
        assert_eq!((y.dims(), y.dtype()), (&part_dims[..], dtype));
        check(
            &self.result(&y),
            &self.part(op, &ins),
            dtype,
            Some(op),
            &self.what(&format!("reduce_scatter {op:?}"), dtype),
        );

        let (ins, x) = self.next(dtype);
        let opts = CollectiveOptions::new();
        let y = comm.reduce_scatter_with(&x, &op, &opts).unwrap();
        check(
            &self.result(&y),
            &self.part(op, &ins),
            dtype,
            Some(op),
            &self.what("reduce_scatter_with", dtype),
        );

        let (ins, x) = self.next(dtype);
        let out = poisoned(&part_dims, dtype, self.dev);
        comm.reduce_scatter_into(&x, &out, &op).unwrap();
        check(
            &self.result(&out),
            &self.part(op, &ins),
            dtype,
            Some(op),
            &self.what("reduce_scatter_into", dtype),
        );

        let (ins, x) = self.next(dtype);
        let out = poisoned(&part_dims, dtype, self.dev);
        comm.reduce_scatter_into_with(&x, &out, &op, &opts).unwrap();
        check(
            &self.result(&out),
            &self.part(op, &ins),
            dtype,
            Some(op),
            &self.what("reduce_scatter_into_with", dtype),
        );
    }

    fn all_gather(&mut self, dtype: DType) {
        let comm = self.comm;
        let dims = [SHAPE.0 * self.world, SHAPE.1];
        let (ins, x) = self.next(dtype);
        let y = comm.all_gather(&x).unwrap();
        assert_eq!((y.dims(), y.dtype()), (&dims[..], dtype));
        check(
            &self.result(&y),
            &ins.concat(),
            dtype,
            None,
            &self.what("all_gather", dtype),
        );

        let (ins, x) = self.next(dtype);
        let opts = CollectiveOptions::new();
        let y = comm.all_gather_with(&x, &opts).unwrap();
        check(
            &self.result(&y),
            &ins.concat(),
            dtype,
            None,
            &self.what("all_gather_with", dtype),
        );

        let (ins, x) = self.next(dtype);
        let out = poisoned(&dims, dtype, self.dev);
        comm.all_gather_into(&x, &out).unwrap();
        check(
            &self.result(&out),
            &ins.concat(),
            dtype,
            None,
            &self.what("all_gather_into", dtype),
        );

        let (ins, x) = self.next(dtype);
        let out = poisoned(&dims, dtype, self.dev);
        comm.all_gather_into_with(&x, &out, &opts).unwrap();
        check(
            &self.result(&out),
            &ins.concat(),
            dtype,
            None,
            &self.what("all_gather_into_with", dtype),
        );
    }

    fn broadcast(&mut self, dtype: DType, root: usize) {
        let comm = self.comm;
        let opts = CollectiveOptions::new();
        let what = |s: &Self, c: &str| s.what(&format!("{c} from {root}"), dtype);
        let (ins, x) = self.next(dtype);
        let y = comm.broadcast(&x, root).unwrap();
        assert_eq!((y.dims(), y.dtype()), (x.dims(), dtype));
        check(
            &self.result(&y),
            &ins[root],
            dtype,
            None,
            &what(self, "broadcast"),
        );

        let (ins, x) = self.next(dtype);
        let y = comm.broadcast_with(&x, root, &opts).unwrap();
        check(
            &self.result(&y),
            &ins[root],
            dtype,
            None,
            &what(self, "broadcast_with"),
        );

        let (ins, x) = self.next(dtype);
        let out = poisoned(x.dims(), dtype, self.dev);
        comm.broadcast_into(&x, &out, root).unwrap();
        check(
            &self.result(&out),
            &ins[root],
            dtype,
            None,
            &what(self, "broadcast_into"),
        );

        let (ins, x) = self.next(dtype);
        let out = poisoned(x.dims(), dtype, self.dev);
        comm.broadcast_into_with(&x, &out, root, &opts).unwrap();
        check(
            &self.result(&out),
            &ins[root],
            dtype,
            None,
            &what(self, "broadcast_into_with"),
        );

        let (ins, x) = self.next(dtype);
        comm.broadcast_in_place(&x, root).unwrap();
        check(
            &self.result(&x),
            &ins[root],
            dtype,
            None,
            &what(self, "broadcast_in_place"),
        );

        let (ins, x) = self.next(dtype);
        comm.broadcast_in_place_with(&x, root, &opts).unwrap();
        check(
            &self.result(&x),
            &ins[root],
            dtype,
            None,
            &what(self, "broadcast_in_place_with"),
        );
    }
}

impl Ctx<'_> {
    /// All-to-all in equal parts (allocating and into a poisoned output), then with row
    /// counts per rank (rank r sends rank q `(r + 2q) % 3` rows, in rank order), each checked against the senders' rows, bit for bit.
    fn all_to_all(&mut self, dtype: DType) {
        let comm = self.comm;
        let (rank, world) = (self.rank, self.world);
        let (rows, row) = SHAPE;
        let part = rows / world * row;
        // Rows of rank q for this rank: part `rank` of q's input.
        let equal = |ins: &[Vec<f64>]| -> Vec<f64> {
            (0..world)
                .flat_map(|q| ins[q][rank * part..(rank + 1) * part].to_vec())
                .collect()
        };
        let (ins, x) = self.next(dtype);
        let y = comm.all_to_all(&x).unwrap();
        assert_eq!((y.dims(), y.dtype()), (x.dims(), dtype));
        check(
            &self.result(&y),
            &equal(&ins),
            dtype,
            None,
            &self.what("all_to_all", dtype),
        );
        let (ins, x) = self.next(dtype);
        let out = poisoned(x.dims(), dtype, self.dev);
        comm.all_to_all_into(&x, &out).unwrap();
        check(
            &self.result(&out),
            &equal(&ins),
            dtype,
            None,
            &self.what("all_to_all_into", dtype),
        );

        // Rank r sends rank q (r + 2q) % 3 rows (some none), taken in rank order.
        let count = |r: usize, q: usize| (r + 2 * q) % 3;
        let send: Vec<usize> = (0..world).map(|q| count(rank, q)).collect();
        let recv: Vec<usize> = (0..world).map(|q| count(q, rank)).collect();
        let (ins, x) = self.next(dtype);
        let x = x.narrow(0, 0, send.iter().sum()).unwrap();
        let want: Vec<f64> = (0..world)
            .flat_map(|q| {
                let start = (0..rank).map(|s| count(q, s)).sum::<usize>() * row;
                ins[q][start..start + count(q, rank) * row].to_vec()
            })
            .collect();
        let y = comm.all_to_all_v(&x, &send, &recv).unwrap();
        assert_eq!(y.dims(), &[recv.iter().sum::<usize>(), row][..]);
        check(
            &self.result(&y),
            &want,
            dtype,
            None,
            &self.what("all_to_all_v", dtype),
        );
        let out = poisoned(y.dims(), dtype, self.dev);
        comm.all_to_all_v_into(&x, &out, &send, &recv).unwrap();
        check(
            &self.result(&out),
            &want,
            dtype,
            None,
            &self.what("all_to_all_v_into", dtype),
        );
        // Counts that do not add up to dim 0: refused before anything runs.
        let wrong: Vec<usize> = send.iter().map(|c| c + 1).collect();
        assert!(matches!(
            comm.all_to_all_v(&x, &wrong, &recv),
            Err(Error::RowCounts { .. })
        ));
    }
}

#[test]
fn collectives_match_the_f64_reference() {
    let Some(n) = gpus("collectives_match_the_f64_reference") else {
        return;
    };
    let (ordinals, config) = placement(n);
    let world = ordinals.len();
    eprintln!("ranks on GPUs {ordinals:?}");
    let seed = seed("collectives_match_the_f64_reference");
    let id = UniqueId::new().unwrap();
    let calls: Vec<u64> = std::thread::scope(|s| {
        let workers: Vec<_> = ordinals
            .iter()
            .enumerate()
            .map(|(rank, &ordinal)| {
                let (id, config) = (&id, config.clone());
                s.spawn(move || {
                    // Every tensor is made on the host and copied over, and read back
                    // the same way: no candle kernel runs between the collectives, so no
                    // lazy module load waits behind a peer's spinning collective.
                    let dev = Device::new_cuda_with_stream(ordinal).unwrap();
                    let comm = CandleComm::from_rank(&dev, rank, world, id, config).unwrap();
                    let mut ctx = Ctx {
                        comm: &comm,
                        dev: &dev,
                        rank,
                        world,
                        seed,
                        call: 0,
                    };
                    for dtype in DTYPES {
                        for op in OPS {
                            ctx.all_reduce(dtype, op);
                            ctx.reduce_scatter(dtype, op);
                        }
                        ctx.all_gather(dtype);
                        for root in 0..world {
                            ctx.broadcast(dtype, root);
                        }
                        ctx.all_to_all(dtype);
                    }
                    // Refused alike on every rank before anything is launched (no rank
                    // waits for another): a dim 0 the world does not divide, a scalar.
                    let odd = input(seed, 0, rank, (world + 1, 3), DType::F32)
                        .to_device(&dev)
                        .unwrap();
                    assert!(matches!(
                        comm.reduce_scatter(&odd, &ReduceOp::Sum),
                        Err(Error::NotDivisible { rows, width }) if rows == world + 1 && width == world
                    ));
                    let scalar = Tensor::new(1f32, &dev).unwrap();
                    assert!(matches!(comm.all_gather(&scalar), Err(Error::Scalar)));
                    assert!(matches!(
                        comm.reduce_scatter(&scalar, &ReduceOp::Max),
                        Err(Error::Scalar)
                    ));
                    // Every call completed: the peers agree on the call sequence.
                    comm.synchronize().unwrap();
                    ctx.call
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    eprintln!(
        "collectives_match_the_f64_reference: {} calls checked per rank",
        calls[0]
    );
}

/// One rank's tensors checked after a refused call: their bits unchanged.
fn unchanged(t: &Tensor, before: &[f64], what: &str) {
    let after = values(t);
    let same = after
        .iter()
        .zip(before)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "{what}: a refused call wrote");
}

#[test]
fn new_methods_refuse_bad_tensors_with_typed_errors() {
    let test = "new_methods_refuse_bad_tensors_with_typed_errors";
    let Some(_) = gpus(test) else {
        return;
    };
    let seed = seed(test);
    let dev = Device::new_cuda_with_stream(0).unwrap();
    let id = UniqueId::new().unwrap();
    let comm = CandleComm::from_rank(&dev, 0, 1, &id, CommConfig::default()).unwrap();
    let x = input(seed, 1, 0, (4, 6), DType::F32)
        .to_device(&dev)
        .unwrap();
    let out = poisoned(&[4, 6], DType::F32, &dev);
    let (x0, out0) = (values(&x), values(&out));
    let sum = ReduceOp::Sum;
    let o = CollectiveOptions::new();

    // Not contiguous, on the host, a dtype peercomm does not take: every form.
    let transposed = x.t().unwrap();
    let on_cpu = x.to_device(&Device::Cpu).unwrap();
    let f64s = x.to_dtype(DType::F64).unwrap();
    for (bad, name) in [
        (&transposed, "transposed"),
        (&on_cpu, "host"),
        (&f64s, "f64"),
    ] {
        let results: Vec<Result<(), Error>> = vec![
            comm.all_reduce(bad, &sum).map(drop),
            comm.all_reduce_into(bad, &out, &sum).map(drop),
            comm.all_reduce_into(&x, bad, &sum).map(drop),
            comm.all_reduce_in_place(bad, &sum).map(drop),
            comm.all_gather(bad).map(drop),
            comm.all_gather_into(bad, &out),
            comm.reduce_scatter(bad, &sum).map(drop),
            comm.reduce_scatter_into(bad, &out, &sum),
            comm.broadcast(bad, 0).map(drop),
            comm.broadcast_into(bad, &out, 0),
            comm.broadcast_in_place(bad, 0),
        ];
        for (k, r) in results.into_iter().enumerate() {
            let ok = match name {
                "transposed" => matches!(r, Err(Error::NotContiguous { .. })),
                "host" => matches!(r, Err(Error::NotCuda { .. })),
                _ => matches!(r, Err(Error::UnsupportedDType(DType::F64))),
            };
            assert!(ok, "{name}, call {k}: {r:?}");
        }
    }
    // Outputs that do not fit the input.
    let half = poisoned(&[4, 6], DType::F16, &dev);
    assert!(matches!(
        comm.all_reduce_into(&x, &half, &sum),
        Err(Error::DTypeMismatch {
            input: DType::F32,
            output: DType::F16
        })
    ));
    let wide = poisoned(&[4, 7], DType::F32, &dev);
    for r in [
        comm.all_reduce_into(&x, &wide, &sum).map(drop),
        comm.all_gather_into(&x, &wide),
        comm.reduce_scatter_into(&x, &wide, &sum),
        comm.broadcast_into(&x, &wide, 0),
    ] {
        assert!(
            matches!(&r, Err(Error::ShapeMismatch { expected, got }) if expected == &[4, 6] && got == &[4, 7]),
            "{r:?}"
        );
    }
    // An output sharing the input's storage without being its elements.
    let big = input(seed, 2, 0, (8, 6), DType::F32)
        .to_device(&dev)
        .unwrap();
    let big0 = values(&big);
    let (a, b) = (big.i(0..4).unwrap(), big.i(2..6).unwrap());
    assert!(matches!(
        comm.all_reduce_into(&a, &b, &sum),
        Err(Error::OutputAliasesInput)
    ));
    let (a, b) = (big.i(0..4).unwrap(), big.i(4..8).unwrap());
    assert!(matches!(
        comm.broadcast_into(&a, &b, 0),
        Err(Error::OutputAliasesInput)
    ));
    // peercomm's own checks come through typed: a group size that does not divide 1, a
    // root outside the group.
    let bad_group = CollectiveOptions::new().group_size(2);
    assert!(matches!(
        comm.all_gather_with(&x, &bad_group),
        Err(Error::Peercomm(peercomm::Error::InvalidGroupSize { .. }))
    ));
    assert!(matches!(
        comm.reduce_scatter_into_with(&x, &out, &sum, &bad_group),
        Err(Error::Peercomm(peercomm::Error::InvalidGroupSize { .. }))
    ));
    assert!(matches!(
        comm.all_reduce_into_with(&x, &out, &sum, &AllReduceOptions::new().group_size(2)),
        Err(Error::Peercomm(peercomm::Error::InvalidGroupSize { .. }))
    ));
    assert!(matches!(
        comm.broadcast_into_with(&x, &out, 1, &o),
        Err(Error::Peercomm(peercomm::Error::InvalidRoot { .. }))
    ));
    comm.synchronize().unwrap();
    unchanged(&x, &x0, "input");
    unchanged(&out, &out0, "output");
    unchanged(&big, &big0, "shared storage");

    // A world of one: every collective copies its input, every dtype.
    for dtype in DTYPES {
        let x = input(seed, 3, 0, (4, 6), dtype).to_device(&dev).unwrap();
        let want = values(&x);
        for op in [ReduceOp::Prod, ReduceOp::Avg] {
            check(
                &values(&comm.all_reduce(&x, &op).unwrap()),
                &want,
                dtype,
                None,
                "world 1 all_reduce",
            );
            check(
                &values(&comm.reduce_scatter(&x, &op).unwrap()),
                &want,
                dtype,
                None,
                "world 1 reduce_scatter",
            );
        }
        check(
            &values(&comm.all_gather(&x).unwrap()),
            &want,
            dtype,
            None,
            "world 1 all_gather",
        );
        check(
            &values(&comm.broadcast(&x, 0).unwrap()),
            &want,
            dtype,
            None,
            "world 1 broadcast",
        );
    }
}
