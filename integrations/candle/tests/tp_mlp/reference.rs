//! Fresh inputs and the f64 host reference of every collective, shared by the
//! collective and graph-capture tests.

use candle_core::{DType, Device, Tensor};
use peercomm_candle::mlp::random_input;
use peercomm_candle::ReduceOp;

/// Every operator.
pub const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Avg,
];

/// The element types peercomm takes.
pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Rank `rank`'s input of call `call`: `[rows, cols]` uniform in [-1, 1), rounded to
/// `dtype`, on the host (fresh for every call, rank and seed).
pub fn input(
    seed: u64,
    call: u64,
    rank: usize,
    (rows, cols): (usize, usize),
    dtype: DType,
) -> Tensor {
    let s = seed ^ (call << 20) ^ ((rank as u64) << 8) ^ 0x5eed;
    random_input(rows, cols, dtype, s, &Device::Cpu).unwrap()
}

/// A tensor's elements as f64, read back to the host.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// `shape` of NaN in `dtype` on `device`: an output poisoned before a call.
pub fn poisoned(shape: &[usize], dtype: DType, device: &Device) -> Tensor {
    Tensor::full(f32::NAN, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(device)
        .unwrap()
}

/// The elementwise reduction of `inputs` (one per rank, rank order) with `op`, in f64.
pub fn reduce(op: ReduceOp, inputs: &[Vec<f64>]) -> Vec<f64> {
    let n = inputs[0].len();
    (0..n)
        .map(|i| {
            let mut it = inputs.iter().map(|v| v[i]);
            let first = it.next().unwrap();
            let r = it.fold(first, |a, b| match op {
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Prod => a * b,
                ReduceOp::Max => a.max(b),
                ReduceOp::Min => a.min(b),
                other => panic!("no reference for {other:?}"),
            });
            if op == ReduceOp::Avg {
                r / inputs.len() as f64
            } else {
                r
            }
        })
        .collect()
}

/// Checks `got` against the f64 `want`: within the rounding of the f32 arithmetic and
/// one rounding to `dtype` (exact for Max and Min); a NaN (a poisoned element left
/// unwritten) always fails.
pub fn check(got: &[f64], want: &[f64], dtype: DType, op: Option<ReduceOp>, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: element count");
    let rel = match dtype {
        DType::F32 => 2f64.powi(-22),
        DType::F16 => 2f64.powi(-10),
        _ => 2f64.powi(-7),
    };
    let exact = matches!(op, None | Some(ReduceOp::Max) | Some(ReduceOp::Min));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if exact {
            g == w
        } else {
            (g - w).abs() <= rel * w.abs() + 1e-7
        };
        assert!(ok, "{what}: element {i} is {g}, the f64 reference {w}");
    }
}
