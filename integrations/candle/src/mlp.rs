//! A tensor-parallel MLP block (Llama's gated feed-forward) in candle: the model the
//! example measures and the tests check.
//!
//! `y = down(silu(gate(x)) * up(x))`. Across `world` ranks the gate and up projections
//! are split by output rows (column-parallel: each rank computes `intermediate / world`
//! channels, no communication), the down projection by input columns (row-parallel:
//! each rank's product is a partial sum of `y`), and one all-reduce of the
//! `[tokens, hidden]` partial sums finishes the block.

use candle_core::{DType, Device, Result, Tensor};

/// Shape of the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpShape {
    /// Model width (rows of the activations).
    pub hidden: usize,
    /// Width of the gated layer; must be divisible by the number of ranks.
    pub intermediate: usize,
}

impl MlpShape {
    /// Llama-3-8B: hidden 4096, intermediate 14336.
    pub const LLAMA3_8B: MlpShape = MlpShape {
        hidden: 4096,
        intermediate: 14336,
    };
}

/// Weights of the whole block (or of one rank's shard), as candle stores `Linear`
/// weights: `[out, in]`.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// `[intermediate, hidden]` (a shard: `[intermediate / world, hidden]`).
    pub gate: Tensor,
    /// `[intermediate, hidden]` (a shard: `[intermediate / world, hidden]`).
    pub up: Tensor,
    /// `[hidden, intermediate]` (a shard: `[hidden, intermediate / world]`).
    pub down: Tensor,
}

impl Mlp {
    /// Weights drawn uniformly from `±sqrt(3 / fan_in)` (unit variance through each
    /// projection) by a seeded generator on the host, so every rank and the single-GPU
    /// reference see the same numbers; stored on `device` in `dtype`.
    pub fn random(shape: MlpShape, dtype: DType, seed: u64, device: &Device) -> Result<Self> {
        let (h, i) = (shape.hidden, shape.intermediate);
        let gate = uniform(&[i, h], (3.0 / h as f32).sqrt(), seed, dtype, device)?;
        let up = uniform(&[i, h], (3.0 / h as f32).sqrt(), seed ^ 1, dtype, device)?;
        let down = uniform(&[h, i], (3.0 / i as f32).sqrt(), seed ^ 2, dtype, device)?;
        Ok(Mlp { gate, up, down })
    }

    /// Rank `rank`'s shard of `world` (gate and up: rows; down: columns), copied to
    /// `device` as contiguous tensors.
    pub fn shard(&self, rank: usize, world: usize, device: &Device) -> Result<Self> {
        let inter = self.gate.dim(0)?;
        if world == 0 || rank >= world || !inter.is_multiple_of(world) {
            candle_core::bail!("cannot take shard {rank} of {world} of {inter} channels");
        }
        let n = inter / world;
        let take = |t: &Tensor, dim: usize| -> Result<Tensor> {
            t.narrow(dim, rank * n, n)?.contiguous()?.to_device(device)
        };
        Ok(Mlp {
            gate: take(&self.gate, 0)?,
            up: take(&self.up, 0)?,
            down: take(&self.down, 1)?,
        })
    }

    /// `down(silu(gate(x)) * up(x))` for `x: [tokens, hidden]`. On a shard this is the
    /// rank's partial sum, to be all-reduced.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = x.matmul(&self.gate.t()?)?;
        let up = x.matmul(&self.up.t()?)?;
        let act = (gate.silu()? * up)?;
        act.matmul(&self.down.t()?)
    }
}

/// Activations `[tokens, hidden]` drawn uniformly from `[-1, 1)` by the same seeded
/// generator as [`Mlp::random`].
pub fn random_input(
    tokens: usize,
    hidden: usize,
    dtype: DType,
    seed: u64,
    device: &Device,
) -> Result<Tensor> {
    uniform(&[tokens, hidden], 1.0, seed, dtype, device)
}

/// A tensor of `dims` drawn uniformly from `[-scale, scale)` (SplitMix64).
fn uniform(dims: &[usize], scale: f32, seed: u64, dtype: DType, device: &Device) -> Result<Tensor> {
    let n: usize = dims.iter().product();
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5851_f42d_4c95_7f2d;
    let data: Vec<f32> = (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            // 24 random bits -> [0, 1) -> [-scale, scale).
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(data, dims, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

/// How far a result is from the reference, computed in f64 on the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Comparison {
    /// Largest `|got - want|`.
    pub max_abs: f64,
    /// Root mean square of `want`.
    pub rms: f64,
    /// Largest `|got - want| / (RTOL * |want| + ATOL * rms)`: at most 1 when every
    /// element is within bf16 tolerance (NaN when either side has a NaN).
    pub worst: f64,
}

impl Comparison {
    /// Relative tolerance: 2^-6, four bf16 roundings (2^-8 each, at worst).
    pub const RTOL: f64 = 1.0 / 64.0;
    /// Absolute tolerance, in units of the reference's root mean square: 2^-4. An output
    /// near zero can be the difference of two partial sums a few times the rms, each
    /// rounded to bf16 before the all-reduce adds them.
    pub const ATOL: f64 = 1.0 / 16.0;

    /// Compares `got` with `want` (same element count, any float dtype).
    pub fn new(got: &Tensor, want: &Tensor) -> Result<Self> {
        let g = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        let w = want.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        if g.len() != w.len() {
            candle_core::bail!("comparing {} elements with {}", g.len(), w.len());
        }
        let rms = (w.iter().map(|v| v * v).sum::<f64>() / w.len().max(1) as f64).sqrt();
        let (mut max_abs, mut worst) = (0.0f64, 0.0f64);
        for (a, b) in g.iter().zip(&w) {
            let d = (a - b).abs();
            let r = d / (Self::RTOL * b.abs() + Self::ATOL * rms);
            if d.is_nan() || r.is_nan() {
                return Ok(Comparison {
                    max_abs: f64::NAN,
                    rms,
                    worst: f64::NAN,
                });
            }
            max_abs = max_abs.max(d);
            worst = worst.max(r);
        }
        Ok(Comparison {
            max_abs,
            rms,
            worst,
        })
    }

    /// Whether every element is within tolerance (and the reference is not all zeros,
    /// which would make any comparison meaningless).
    pub fn passes(&self) -> bool {
        self.rms > 0.0 && self.worst <= 1.0
    }
}
