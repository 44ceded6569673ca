//! Fault injection on one rank's launches (feature `fault-injection`): a launch left
//! out, a call published one ahead, a kernel that only waits. Without the feature the
//! launch path's two hooks are constants.

#[cfg(feature = "fault-injection")]
use std::{sync::atomic::AtomicBool, sync::atomic::Ordering, time::Duration};

use crate::backend::Backend;
#[cfg(feature = "fault-injection")]
use crate::backend::{Kernel, KernelKind, LaunchDims};
use crate::comm::core::launch::Endpoint;
#[cfg(feature = "fault-injection")]
use crate::{dtype::DType, error::Result, signal::AllReduceArgs};

/// Clears `flag`, returning whether it was set (a plain load first: the common path
/// writes nothing).
#[cfg(feature = "fault-injection")]
fn take(flag: &AtomicBool) -> bool {
    flag.load(Ordering::Relaxed) && flag.swap(false, Ordering::AcqRel)
}

#[cfg(feature = "fault-injection")]
impl<B: Backend> Endpoint<B> {
    /// `seq`, or one ahead of it if a skewed call was asked for (the request is cleared).
    #[inline]
    pub(super) fn skewed(&self, seq: u64) -> u64 {
        seq.wrapping_add(take(&self.faults.skew_next).into())
    }

    /// Whether this launch is left out (the request is cleared).
    #[inline]
    pub(super) fn take_missing(&self) -> bool {
        take(&self.faults.missing)
    }

    /// This rank's next launch is left out.
    pub(crate) fn miss_next_launch(&self) {
        self.faults.missing.store(true, Ordering::Release);
    }

    /// This rank's next launch publishes a call one ahead in the sequence, so its
    /// group gets [`crate::Error::CallMismatch`].
    pub(crate) fn skew_next_call(&self) {
        self.faults.skew_next.store(true, Ordering::Release);
    }

    /// Enqueues the delay kernel: one thread spins for `delay`, touching no memory.
    pub(crate) fn launch_delay(&self, delay: Duration) -> Result<()> {
        let args = AllReduceArgs {
            timeout_ns: u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX),
            ..Default::default()
        };
        let (kind, dtype, blocks, threads) = (KernelKind::Delay, DType::F32, 1, 32);
        let (kernel, dims) = (Kernel { kind, dtype }, LaunchDims { blocks, threads });
        B::launch(&self.device, kernel, dims, &args)
    }
}

#[cfg(not(feature = "fault-injection"))]
impl<B: Backend> Endpoint<B> {
    /// Without fault injection a call is never skewed.
    #[inline(always)]
    pub(super) fn skewed(&self, seq: u64) -> u64 {
        seq
    }

    /// Without fault injection no launch is left out.
    #[inline(always)]
    pub(super) fn take_missing(&self) -> bool {
        false
    }
}
