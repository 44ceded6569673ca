//! What only a single controller checks before anything is launched: one tensor per
//! rank, the same dtype, shape and length everywhere, shapes that describe their
//! buffers, and whether the peers can reach the user buffers. Each rank's own side
//! (its device, its output's dtype and length) is the core's.

use crate::backend::{Backend, DeviceBuffer, KernelKind};
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;
use crate::tensor::shape_elements;

pub(super) use crate::comm::core::planning::check::Meta;
use crate::comm::core::planning::check::{check_overlaps, Span};

/// One role of a call's buffers for [`SingleController::check_overlaps`]: every rank's
/// address and bytes, the role's name, and whether the call writes it (at most four
/// roles a call).
pub(super) type Role<'a> = (
    &'a [u64; MAX_GPUS],
    &'a [usize; MAX_GPUS],
    &'static str,
    bool,
);

/// Every rank's bytes of buffers described by `metas` (the sizes checked).
pub(super) fn bytes_of(metas: impl IntoIterator<Item = Meta>) -> [usize; MAX_GPUS] {
    let mut bytes = [0; MAX_GPUS];
    for (b, m) in bytes.iter_mut().zip(metas) {
        *b = m.len.saturating_mul(m.dtype.size());
    }
    bytes
}
use super::SingleController;
use crate::comm::core::planning::Plan;
use crate::tensor::{TensorView, TensorViewMut};

/// What the core checks of a buffer.
pub(super) fn meta_of<B: Backend>(b: &(impl DeviceBuffer<B> + ?Sized)) -> Meta {
    Meta {
        dtype: b.dtype(),
        len: b.len(),
        ordinal: b.device_ordinal(),
    }
}

/// What the core checks of a shaped input.
pub(super) fn meta<B: Backend>(t: &TensorView<'_, B>) -> Meta {
    meta_of(t.data)
}

/// What the core checks of a shaped output.
pub(super) fn meta_mut<B: Backend>(t: &TensorViewMut<'_, B>) -> Meta {
    meta_of(&*t.data)
}

impl<B: Backend> SingleController<B> {
    pub(super) fn check_usable(&self) -> Result<()> {
        self.ranks.iter().try_for_each(|r| r.check_usable())
    }

    pub(super) fn check_count(&self, got: usize) -> Result<()> {
        if got != self.world_size() {
            return Err(Error::WrongTensorCount {
                expected: self.world_size(),
                got,
            });
        }
        Ok(())
    }

    pub(super) fn check_tensor(
        &self,
        rank: usize,
        m: &Meta,
        shape: &[usize],
        which: &'static str,
    ) -> Result<()> {
        if shape_elements(shape) != Some(m.len) {
            return Err(Error::LengthMismatch {
                rank,
                what: match shape_elements(shape) {
                    Some(n) => format!(
                        "{which} shape {shape:?} has {n} elements but its buffer {}",
                        m.len
                    ),
                    None => format!("{which} shape {shape:?} overflows usize"),
                },
            });
        }
        let expected = self.ranks[rank].ordinal();
        if m.ordinal != expected {
            return Err(Error::WrongDevice {
                rank,
                which,
                expected,
                got: m.ordinal,
            });
        }
        m.bytes(rank, which).map(drop)
    }

    /// Checks one call's buffers on every rank against each other before anything is
    /// launched ([`check_overlaps`]): each role is every rank's address (0: the rank
    /// has none), bytes, name, and whether the call writes it. Returns whether some
    /// rank's input is its output, the very same range (allowed with `in_place`: the
    /// call then runs in place); any other overlap, across ranks too (one address
    /// space: the host backend, or devices that share memory), is
    /// [`Error::BuffersOverlap`].
    pub(super) fn check_overlaps(&self, roles: &[Role<'_>], in_place: bool) -> Result<bool> {
        let none = Span {
            rank: 0,
            which: "",
            ptr: 0,
            bytes: 0,
            written: false,
        };
        let mut spans = [none; 4 * MAX_GPUS];
        let mut n = 0;
        for &(ptrs, bytes, which, written) in roles {
            for r in (0..self.world_size()).filter(|&r| ptrs[r] != 0 && bytes[r] > 0) {
                spans[n] = Span {
                    rank: r,
                    which,
                    ptr: ptrs[r],
                    bytes: bytes[r],
                    written,
                };
                n += 1;
            }
        }
        check_overlaps(&spans[..n], in_place)
    }

    /// Checks every rank's tensor against its own buffer and against rank 0's. The
    /// rule for unequal sizes: element counts that differ (across ranks, between a
    /// shape and its buffer, or between an output and its input) are
    /// [`Error::LengthMismatch`]; [`Error::ShapeMismatch`] means the counts agree and
    /// only the shapes differ. So flat and shaped tensors give the same error for the
    /// same cause.
    pub(super) fn check_tensors(
        &self,
        metas: &[Meta],
        shapes: &[&[usize]],
        which: &'static str,
    ) -> Result<()> {
        for (r, (m, s)) in metas.iter().zip(shapes).enumerate() {
            if m.dtype != metas[0].dtype {
                return Err(Error::DTypeMismatch {
                    rank: r,
                    expected: metas[0].dtype,
                    got: m.dtype,
                });
            }
            self.check_tensor(r, m, s, which)?;
            if m.len != metas[0].len {
                return Err(Error::LengthMismatch {
                    rank: r,
                    what: format!(
                        "{which} has {} elements but rank 0's {}",
                        m.len, metas[0].len
                    ),
                });
            }
            if *s != shapes[0] {
                return Err(Error::ShapeMismatch {
                    rank: r,
                    expected: shapes[0].to_vec(),
                    got: s.to_vec(),
                });
            }
        }
        Ok(())
    }

    /// Rank r's pointer into `tensors[r]`, for reading, by rank; the accesses that keep
    /// the pointers valid go to `guards`.
    pub(super) fn read_ptrs<'a>(
        &'a self,
        tensors: &'a [TensorView<'_, B>],
        guards: &mut Vec<B::Access<'a>>,
    ) -> [u64; MAX_GPUS] {
        let mut ptrs = [0u64; MAX_GPUS];
        for (r, t) in tensors.iter().enumerate() {
            let (p, g) = t.data.read_ptr(self.ranks[r].device());
            ptrs[r] = p;
            guards.push(g);
        }
        ptrs
    }

    /// As [`SingleController::read_ptrs`], for writing.
    pub(super) fn write_ptrs<'a>(
        &'a self,
        tensors: &'a mut [TensorViewMut<'_, B>],
        guards: &mut Vec<B::Access<'a>>,
    ) -> [u64; MAX_GPUS] {
        let mut ptrs = [0u64; MAX_GPUS];
        for (r, t) in tensors.iter_mut().enumerate() {
            let (p, g) = t.data.write_ptr(self.ranks[r].device());
            ptrs[r] = p;
            guards.push(g);
        }
        ptrs
    }

    /// When the plan's peers read the user buffers at `ptrs` directly (one-stage
    /// without staging, two-stage), checks that each group peer's device can reach them.
    pub(super) fn check_peers_reach(
        &self,
        plan: &Plan,
        ptrs: &[u64; MAX_GPUS],
        which: &'static str,
    ) -> Result<()> {
        let direct = match plan.kernel.kind {
            KernelKind::OneStage => !plan.stage_input,
            KernelKind::TwoStage => true,
            KernelKind::AllGather
            | KernelKind::ReduceScatter
            | KernelKind::Broadcast
            | KernelKind::Scatter
            | KernelKind::AllReduceRmsNorm => !plan.stage_input,
            _ => false,
        };
        if !direct || plan.width == 1 {
            return Ok(());
        }
        // Ranks whose buffer nobody reads (the non-roots of a broadcast) pass 0.
        for (r, rank) in self.ranks.iter().enumerate().filter(|&(r, _)| ptrs[r] != 0) {
            let base = r / plan.width * plan.width;
            for peer in (base..base + plan.width).filter(|&p| p != r) {
                let peer_device = B::ordinal(self.ranks[peer].device());
                if let Some(detail) = B::peer_access_problem(rank.device(), ptrs[r], peer_device)? {
                    return Err(Error::BufferNotPeerAccessible {
                        rank: r,
                        which,
                        peer_device,
                        detail,
                    });
                }
            }
        }
        Ok(())
    }
}
