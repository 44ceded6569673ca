//! What backends launch and export: kernel kinds, launch dimensions, memory kinds,
//! exported ranges. Public only under the `unstable` feature (`crate::unstable`).

use crate::dispatch::Algorithm;
use crate::dtype::DType;

/// A file descriptor that travels between processes beside an exported handle
/// ([`ExportedRange::descriptor`]).
#[cfg(unix)]
pub type Descriptor = std::os::fd::OwnedFd;
/// Elsewhere than Unix no descriptor exists: an empty type.
#[cfg(not(unix))]
#[derive(Debug)]
pub enum Descriptor {}

/// A range of this process's memory exported for another process
/// ([`Backend::export_range`](super::Backend::export_range)).
#[derive(Debug)]
pub struct ExportedRange {
    /// The handle record, sent as bytes
    /// ([`Backend::export_memory`](super::Backend::export_memory)'s).
    pub handle: Vec<u8>,
    /// The range's offset in the exported allocation.
    pub offset: u64,
    /// A descriptor to send beside the handle, where the memory is exported only as one
    /// (CUDA pools and virtual-memory allocations, host shared files); `None`: the
    /// handle alone maps it.
    pub descriptor: Option<Descriptor>,
}

/// What a device allocation is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Ordinary device memory.
    Plain,
    /// Signal memory: counters and flags that peers write and spin on. Uncached or
    /// fine-grained where the vendor distinguishes (AMD), so spins see peers' stores.
    Signal,
    /// As `Signal`, allocated so that other processes can map it
    /// ([`Backend::export_memory`](super::Backend::export_memory)).
    SharedSignal,
    /// Ordinary (cached) memory that other processes can map: the symmetric buffers'
    /// pool (`Comm::alloc_symmetric`).
    SharedData,
}

/// Declares [`KernelKind`] from the one list of kernel families (symbol name, whether
/// exported for every [`DType`]); discriminants (the descriptor's kind) follow its order.
macro_rules! kernel_kinds {
    ($($(#[$doc:meta])* $kind:ident = $name:literal, $every_dtype:literal;)*) => {
        /// Which kernel family a launch runs.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum KernelKind {
            $($(#[$doc])* $kind,)*
        }

        impl KernelKind {
            /// Every kind, in the order of its discriminant.
            pub(crate) const ALL: &'static [KernelKind] = &[$(KernelKind::$kind),*];

            /// Name used in kernel symbols and reports.
            pub const fn name(self) -> &'static str {
                match self {
                    $(KernelKind::$kind => $name,)*
                }
            }

            /// Whether the device code exports it for every dtype (else f32 only).
            const fn every_dtype(self) -> bool {
                match self {
                    $(KernelKind::$kind => $every_dtype,)*
                }
            }
        }
    };
}

kernel_kinds! {
    /// Every rank reads every peer's input and reduces the whole message.
    OneStage = "one_stage", true;
    /// Reduce-scatter into the payload, barrier, all-gather from the peers' payloads.
    TwoStage = "two_stage", true;
    /// Barrier-free: data carries its own readiness (the -0.0 sentinel).
    Lamport = "lamport", true;
    /// A start and an end barrier and nothing else (also the timeout probe).
    Barrier = "barrier", true;
    /// Ranks 0 and 1 bounce a flag `num_elements` times through their payloads: the
    /// cross-GPU flag round trip. f32 only.
    PingPong = "pingpong", false;
    /// Spins for `timeout_ns` nanoseconds, touching no memory: a rank made late on
    /// purpose (fault injection). f32 only.
    Delay = "delay", false;
    /// All-gather: every group member gets every member's input, in group-rank order.
    AllGather = "all_gather", true;
    /// Reduce-scatter (sum): group rank r gets part r of the sum
    /// ([`crate::reduce_scatter_part`]).
    ReduceScatter = "reduce_scatter", true;
    /// Broadcast of the root's input to every group member.
    Broadcast = "broadcast", true;
    /// Scatter: group rank r gets part r of the root's input.
    Scatter = "scatter", true;
    /// All-reduce, residual add and RMSNorm in one kernel, row by row.
    AllReduceRmsNorm = "allreduce_rmsnorm", true;
    /// Up to [`crate::signal::MAX_GROUP_CALLS`] all-reduces of one dtype in one kernel,
    /// each entry's bits those of a one-stage all-reduce of it alone
    /// ([`Backend::launch_group`](super::Backend::launch_group)).
    AllReduceGroup = "allreduce_group", true;
    /// The fused kernel without a barrier, through the Lamport slots, with the same bits
    /// as [`KernelKind::AllReduceRmsNorm`]. Whole world of two or more ranks, the
    /// message plus its header within one slot.
    LamportRmsNorm = "lamport_rmsnorm", true;
    /// Reduce: the one-stage all-reduce, whose result only the root stores
    /// (`PEERCOMM_KIND_REDUCE`, which the one-stage kernel reads from the descriptor).
    Reduce = "reduce", true;
    /// Sends and receives between pairs of ranks (send / recv, all-to-all), each pair
    /// synchronised alone; it moves bytes, so it is exported once (as `f32`) and serves
    /// every dtype ([`Backend::launch_wide`](super::Backend::launch_wide)).
    Exchange = "exchange", false;
}

// The kernels read a reduce's kind from the descriptor.
const _: () = assert!(KernelKind::Reduce as u32 == crate::signal::KIND_REDUCE);

impl KernelKind {
    /// The family whose exported kernel runs this one: a reduce runs the one-stage one.
    pub(crate) const fn runs_as(self) -> KernelKind {
        match self {
            KernelKind::Reduce => KernelKind::OneStage,
            k => k,
        }
    }
}

impl Algorithm {
    /// The kernel family (`None` for `Auto` and the paths that are not one kernel).
    pub(crate) const fn kernel_kind(self) -> Option<KernelKind> {
        match self {
            Algorithm::Auto | Algorithm::Nccl | Algorithm::Hierarchical => None,
            Algorithm::OneStage => Some(KernelKind::OneStage),
            Algorithm::TwoStage => Some(KernelKind::TwoStage),
            Algorithm::Lamport => Some(KernelKind::Lamport),
        }
    }
}

/// One kernel entry point: a family and an element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kernel {
    /// The family.
    pub kind: KernelKind,
    /// The element type it reduces.
    pub dtype: DType,
}

impl Kernel {
    /// Every kernel the backends resolve: every family for `f32`, `f16` and `bf16` (the
    /// families not [exported for every dtype](KernelKind) for `f32` alone); for the other
    /// dtypes the one-stage all-reduce, reduce-scatter, all-gather, broadcast and scatter
    /// (several of them share one symbol: see [`Kernel::symbol`]).
    pub fn all() -> impl Iterator<Item = Kernel> {
        let exported = KernelKind::ALL.iter().filter(|k| k.runs_as() == **k);
        exported.flat_map(|&kind| {
            let dtypes: &[DType] = if kind.every_dtype() {
                &DType::ALL
            } else {
                &[DType::F32]
            };
            let dtypes = dtypes.iter().filter(move |d| kind.takes(**d));
            dtypes.map(move |&dtype| Kernel { kind, dtype })
        })
    }
    /// The kernel that runs it, as [`Kernel::all`] lists it (a reduce runs the
    /// one-stage kernel of its dtype): the key of a backend's table of loaded kernels.
    #[cfg_attr(not(any(feature = "cuda", feature = "hip")), allow(dead_code))]
    pub(crate) fn exported(self) -> Kernel {
        Kernel {
            kind: self.kind.runs_as(),
            dtype: self.dtype,
        }
    }
    /// Its exported symbol, e.g. `peercomm_two_stage_bf16`. The data-movement families
    /// (all-gather, broadcast, scatter) copy raw bits: a dtype other than `f32`, `f16`,
    /// `bf16` runs the kernel of its size (`u8` for 1 byte, `f32` for 4, `u64` for 8).
    pub fn symbol(self) -> String {
        let kind = self.kind.runs_as();
        let dtype = match (
            kind.moves_only(),
            self.dtype.every_kernel(),
            self.dtype.size(),
        ) {
            (true, false, 1) => DType::U8,
            (true, false, 4) => DType::F32,
            (true, false, _) => DType::U64,
            _ => self.dtype,
        };
        format!("peercomm_{}_{}", kind.name(), dtype.name())
    }
}

impl KernelKind {
    /// Whether it only moves data, bits unchanged (all-gather, broadcast, scatter).
    const fn moves_only(self) -> bool {
        matches!(
            self,
            KernelKind::AllGather | KernelKind::Broadcast | KernelKind::Scatter
        )
    }

    /// Whether the device code serves `dtype` with it: every kind `f32`, `f16`, `bf16`;
    /// the other dtypes the one-stage all-reduce (and reduce), reduce-scatter, the
    /// data-movement kinds and the kinds not exported per dtype.
    pub(crate) const fn takes(self, dtype: DType) -> bool {
        dtype.every_kernel()
            || !self.every_dtype()
            || self.moves_only()
            || matches!(
                self,
                KernelKind::OneStage | KernelKind::Reduce | KernelKind::ReduceScatter
            )
    }
}

/// Grid of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchDims {
    /// Blocks (at most `MAX_NUM_BLOCKS_UPPER_BOUND`).
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
}

/// The 32-bit word the Lamport region is filled with: the f32 -0.0 pattern, which no
/// producer writes (a Sum's or Avg's -0.0 lane is sent as +0.0, a Prod's, Max's or Min's
/// word of these bits as `LAMPORT_SENTINEL_STANDIN`). Readiness is tested per 32-bit
/// word, which 16-byte stores never tear.
pub const LAMPORT_SENTINEL: u32 = 0x8000_0000;

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel a call may launch (every kind with every dtype it takes; the kinds
    /// exported for f32 alone, with f32) is in the table the backends load, under
    /// [`Kernel::exported`]: a reduce of any dtype finds its one-stage kernel (a CUDA run
    /// found it missing before this key).
    #[test]
    fn every_launchable_kernel_is_loaded() {
        let loaded: Vec<Kernel> = Kernel::all().collect();
        for &kind in KernelKind::ALL {
            let dtypes = DType::ALL.iter().filter(|&&d| kind.takes(d));
            for &dtype in dtypes.filter(|&&d| kind.every_dtype() || d == DType::F32) {
                let k = Kernel { kind, dtype };
                let exported = k.exported();
                assert!(loaded.contains(&exported), "{kind:?} {dtype:?}: not loaded");
                assert_eq!(exported.symbol(), k.symbol(), "{kind:?} {dtype:?}");
            }
        }
    }
}
