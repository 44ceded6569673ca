//! Running a call the router sent away from the peer-memory kernels: the external
//! library over the world, or across hosts (peer memory inside each host).

use crate::backend::Backend;
use crate::dispatch::Algorithm;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

use crate::comm::core::launch::{Fused, PeerInputs};
use crate::comm::core::planning::PeerReads;
use crate::comm::core::routing::{Path, RouteError};
use crate::comm::core::Rank;
use crate::comm::AllReduceOptions;

impl<B: Backend> Rank<B> {
    /// Runs, on this rank, a call its router sent away from the peer-memory kernels:
    /// `elements` elements of `dtype` from `input` into `output` (may be equal), with
    /// the operator and blocks of `options`.
    pub(crate) fn run_routed(
        &self,
        path: Path,
        input: u64,
        output: u64,
        elements: usize,
        dtype: DType,
        options: &AllReduceOptions,
    ) -> std::result::Result<Algorithm, RouteError> {
        let external = self.route.external.as_deref().ok_or_else(|| {
            RouteError::Validation(Error::Unsupported("no external library".into()))
        })?;
        let dev = &self.endpoint.device;
        let settings = &self.settings;
        match path {
            Path::Peer(_) => unreachable!("peer calls are not routed"),
            Path::External => {
                if elements > 0 {
                    // SAFETY: the caller holds both buffers (and their access guards)
                    // for the call, on this rank's device.
                    unsafe {
                        external.all_reduce(dev, (input, output, elements, dtype, options.op))
                    }
                    .map_err(RouteError::Launched)?;
                }
                Ok(Algorithm::Nccl)
            }
            Path::Hierarchical => {
                if elements == 0 {
                    return Ok(Algorithm::Hierarchical);
                }
                if dtype.size() == 1 {
                    // (c) fills whole 16- or 32-bit words.
                    let why = format!("a hierarchical all-reduce of {}", dtype.name());
                    return Err(RouteError::Validation(Error::Unsupported(why)));
                }
                let mut opts = AllReduceOptions::new().with_op(options.op);
                opts.blocks = options.blocks;
                let plan = |opts, in_place| {
                    let p = settings.plan(dtype, elements, &opts, in_place, PeerReads::Payloads);
                    p.map_err(RouteError::Validation)
                };
                // The gather sums (see (c)) whatever the operator.
                let gather_opts = opts.with_op(ReduceOp::Sum);
                let (first, gather) = (plan(opts, input == output)?, plan(gather_opts, true)?);
                let (lo, hi) = slice(elements, settings.world, self.endpoint.index);
                let size = dtype.size() as u64;
                // (a) the host's reduction, over peer memory.
                self.launch(&first, PeerInputs::Own(input), output, Fused::default())
                    .map_err(RouteError::Launched)?;
                // (b) this rank's slice across hosts, in the external library.
                let step = || -> Result<()> {
                    // Every rank makes the call, an empty slice too, so the library
                    // sees the same calls everywhere.
                    let at = output + lo as u64 * size;
                    // SAFETY: [lo, hi) lies inside the output the caller holds.
                    unsafe { external.all_reduce(dev, (at, at, hi - lo, dtype, options.op)) }?;
                    // (c) the gather inside the host: every other slice is -0.0 (the
                    // wide and integer types: zero), so the peer sum copies each slice
                    // bit for bit (x + -0.0 == x; its start +0.0 + x makes a -0.0
                    // slice +0.0 either way).
                    fill_negative_zero::<B>(dev, output, 0, lo, dtype)?;
                    fill_negative_zero::<B>(dev, output, hi, elements, dtype)?;
                    self.launch(&gather, PeerInputs::Own(output), output, Fused::default())
                };
                step().map_err(RouteError::Launched)?;
                Ok(Algorithm::Hierarchical)
            }
        }
    }

    /// Reports (once) an error the external library found after a call returned.
    pub(crate) fn take_external_error(&self) -> Result<()> {
        self.route
            .external
            .as_ref()
            .map_or(Ok(()), |e| e.take_async_error())
    }
}

/// The slice `[lo, hi)` of `elements` that local rank `k` of `local` reduces across
/// hosts, in whole packs of 16-bit elements.
fn slice(elements: usize, local: usize, k: usize) -> (usize, usize) {
    const GRAIN: usize = 8;
    let chunk = elements.div_ceil(GRAIN).div_ceil(local) * GRAIN;
    let lo = (k * chunk).min(elements);
    (lo, (lo + chunk).min(elements))
}

/// Writes -0.0 into elements `[from, to)` of the buffer at `base`, on the stream.
fn fill_negative_zero<B: Backend>(
    dev: &B::Device,
    base: u64,
    from: usize,
    to: usize,
    dtype: DType,
) -> Result<()> {
    if to <= from {
        return Ok(());
    }
    let at = base + (from * dtype.size()) as u64;
    match dtype {
        DType::F32 => B::memset_d32(dev, at, 0x8000_0000, to - from),
        DType::F16 | DType::BF16 => B::memset_d16(dev, at, 0x8000, to - from),
        // Zero words: the integers' identity, and f64's as -0.0 (see (c)).
        d if d.size() >= 4 => B::memset_d32(dev, at, 0, (to - from) * d.size() / 4),
        d => Err(Error::Unsupported(format!("filling {} elements", d.name()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_every_element_once() {
        for elements in [0, 1, 7, 8, 9, 63, 1000, 1027] {
            for local in 1..=8 {
                let mut next = 0;
                for k in 0..local {
                    let (lo, hi) = slice(elements, local, k);
                    assert!(lo <= hi);
                    if hi > lo {
                        assert_eq!(lo, next);
                        assert_eq!(lo % 8, 0);
                        next = hi;
                    }
                }
                assert_eq!(next, elements);
            }
        }
    }
}
