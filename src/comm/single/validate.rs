//! What only a single controller checks (every rank's tensors against each other, shapes
//! against buffers, the peers' reach of user buffers), and every rank's pointers of one
//! role of a call. Each rank's own side (device, dtype, sizes) is the core's check.

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut, KernelKind};
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;
use crate::tensor::{shape_elements, TensorView, TensorViewMut};

use super::SingleController;
pub(super) use crate::comm::core::planning::check::Meta;
use crate::comm::core::planning::check::{check_overlaps, Span};
use crate::comm::core::planning::Plan;
pub(super) use crate::comm::per_rank::meta;

/// Every rank's address and bytes of one role of a call (0: the rank has none), and the
/// accesses that keep the addresses valid until it drops. Each buffer is tracked on its
/// own rank's stream only: the peers read rank j's buffer between their start and end
/// barriers, which rank j's kernel spans, so rank j's waits and records cover them.
pub(super) struct Ptrs<'a, B: Backend> {
    pub(super) at: [u64; MAX_GPUS],
    pub(super) bytes: [usize; MAX_GPUS],
    _access: [Option<B::Access<'a>>; MAX_GPUS],
}

impl<'a, B: Backend> Ptrs<'a, B> {
    fn new() -> Self {
        Ptrs {
            at: [0; MAX_GPUS],
            bytes: [0; MAX_GPUS],
            _access: std::array::from_fn(|_| None),
        }
    }

    fn set(&mut self, r: usize, m: Meta, (ptr, access): (u64, B::Access<'a>)) {
        self.at[r] = ptr;
        self.bytes[r] = m.len.saturating_mul(m.dtype.size());
        self._access[r] = Some(access);
    }
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

    /// Rank `rank`'s tensor: its shape describes its buffer (`len` elements).
    pub(super) fn check_shape(rank: usize, len: usize, shape: &[usize], which: &str) -> Result<()> {
        match shape_elements(shape) {
            Some(n) if n == len => Ok(()),
            n => Err(Error::LengthMismatch {
                rank,
                what: match n {
                    Some(n) => {
                        format!("{which} shape {shape:?} has {n} elements but its buffer {len}")
                    }
                    None => format!("{which} shape {shape:?} overflows usize"),
                },
            }),
        }
    }

    /// Rank `rank`'s tensor: its shape describes its buffer, on its rank's device, of a
    /// size a buffer can have.
    pub(super) fn check_tensor(
        &self,
        rank: usize,
        m: &Meta,
        shape: &[usize],
        which: &'static str,
    ) -> Result<()> {
        Self::check_shape(rank, m.len, shape, which)?;
        self.ranks[rank].check_buffer(m.ordinal, which)?;
        m.bytes(rank, which).map(drop)
    }

    /// Checks each `(rank, buffer, shape)` ([`None`]: flat) with
    /// [`SingleController::check_tensor`] and against the first one (`first`, say "rank
    /// 0's"); returns the first's metadata. Element counts that differ (across ranks,
    /// or a shape against its buffer) are [`Error::LengthMismatch`];
    /// [`Error::ShapeMismatch`] means the counts agree and only the shapes differ, so
    /// flat and shaped tensors give the same error for the same cause.
    pub(super) fn check_alike<'s>(
        &self,
        tensors: impl IntoIterator<Item = (usize, Meta, Option<&'s [usize]>)>,
        which: &'static str,
        first: &str,
    ) -> Result<Meta> {
        let mut tensors = tensors.into_iter().peekable();
        let Some(&(_, m0, s0)) = tensors.peek() else {
            return Err(Error::WrongTensorCount {
                expected: self.world_size(),
                got: 0,
            });
        };
        for (r, m, s) in tensors {
            self.ranks[r].check_dtype(m0.dtype, m.dtype)?;
            self.check_tensor(r, &m, s.unwrap_or(&[m.len]), which)?;
            if m.len != m0.len {
                return Err(Error::LengthMismatch {
                    rank: r,
                    what: format!("{which} has {} elements but {first} {}", m.len, m0.len),
                });
            }
            if s != s0 {
                return Err(Error::ShapeMismatch {
                    rank: r,
                    expected: s0.unwrap_or_default().to_vec(),
                    got: s.unwrap_or_default().to_vec(),
                });
            }
        }
        Ok(m0)
    }

    /// Usable, one tensor per rank, alike ([`SingleController::check_alike`]): rank 0's.
    pub(super) fn check_inputs(
        &self,
        tensors: &[TensorView<'_, B>],
        which: &'static str,
    ) -> Result<Meta> {
        self.check_usable()?;
        self.check_count(tensors.len())?;
        let shaped = tensors.iter().enumerate();
        let all = shaped.map(|(r, t)| (r, meta(t.data), Some(&t.shape[..])));
        self.check_alike(all, which, "rank 0's")
    }

    /// As [`SingleController::check_inputs`], for tensors a call writes in place.
    pub(super) fn check_in_place(&self, tensors: &[TensorViewMut<'_, B>]) -> Result<Meta> {
        self.check_usable()?;
        self.check_count(tensors.len())?;
        let shaped = tensors.iter().enumerate();
        let all = shaped.map(|(r, t)| (r, meta(&*t.data), Some(&t.shape[..])));
        self.check_alike(all, "in-place", "rank 0's")
    }

    /// As [`SingleController::check_inputs`], for flat buffers.
    pub(super) fn check_flat<T: DeviceBuffer<B>>(
        &self,
        bufs: &[T],
        which: &'static str,
    ) -> Result<Meta> {
        self.check_usable()?;
        self.check_count(bufs.len())?;
        let flat = bufs.iter().enumerate().map(|(r, b)| (r, meta(b), None));
        self.check_alike(flat, which, "rank 0's")
    }

    /// An all-reduce's flat buffers: inputs alike, each output its input's pair (the
    /// core's check). Returns rank 0's input.
    pub(super) fn check_slices<S, R>(&self, inputs: &[S], outputs: &[R]) -> Result<Meta>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        let first = self.check_flat(inputs, "input")?;
        self.check_count(outputs.len())?;
        for (r, (i, o)) in inputs.iter().zip(outputs).enumerate() {
            self.ranks[r].check_all_reduce(&meta(i), &meta(o))?;
        }
        Ok(first)
    }

    /// Checks one call's buffers on every rank against each other before anything is
    /// launched ([`check_overlaps`]): each role is its buffers, name, and whether the
    /// call writes it. Returns whether some rank's input is its output,
    /// the very same range (allowed with `in_place`: the call runs in place); any other
    /// overlap, across ranks too (one address space: the host backend, or devices that
    /// share memory), is [`Error::BuffersOverlap`].
    pub(super) fn check_overlaps(
        &self,
        roles: &[(&Ptrs<'_, B>, &'static str, bool)],
        in_place: bool,
    ) -> Result<bool> {
        let none = Span {
            rank: 0,
            which: "",
            ptr: 0,
            bytes: 0,
            written: false,
        };
        let mut spans = [none; 4 * MAX_GPUS];
        let mut n = 0;
        for &(p, which, written) in roles {
            for r in (0..self.world_size()).filter(|&r| p.at[r] != 0 && p.bytes[r] > 0) {
                spans[n] = Span {
                    rank: r,
                    which,
                    ptr: p.at[r],
                    bytes: p.bytes[r],
                    written,
                };
                n += 1;
            }
        }
        check_overlaps(&spans[..n], in_place)
    }

    /// Each `(rank, buffer)`'s address for reading, on that rank's device.
    pub(super) fn reads<'a, T>(
        &'a self,
        bufs: impl IntoIterator<Item = (usize, &'a T)>,
    ) -> Ptrs<'a, B>
    where
        T: DeviceBuffer<B> + ?Sized + 'a,
    {
        let mut ptrs = Ptrs::new();
        for (r, b) in bufs {
            ptrs.set(r, meta(b), b.read_ptr(self.ranks[r].device()));
        }
        ptrs
    }

    /// As [`SingleController::reads`], for writing.
    pub(super) fn writes<'a, T>(
        &'a self,
        bufs: impl IntoIterator<Item = (usize, &'a mut T)>,
    ) -> Ptrs<'a, B>
    where
        T: DeviceBufferMut<B> + ?Sized + 'a,
    {
        let mut ptrs = Ptrs::new();
        for (r, b) in bufs {
            let m = meta(&*b);
            ptrs.set(r, m, b.write_ptr(self.ranks[r].device()));
        }
        ptrs
    }

    /// Where the plan's peers read the user buffers at `ptrs` directly (one-stage or a
    /// collective without staging, two-stage), checks that each group peer's device can
    /// reach them. Ranks whose buffer nobody reads (a broadcast's non-roots) pass 0.
    pub(super) fn check_peers_reach(
        &self,
        plan: &Plan,
        ptrs: &[u64; MAX_GPUS],
        which: &'static str,
    ) -> Result<()> {
        let direct = match plan.kernel.kind {
            KernelKind::TwoStage => true,
            KernelKind::OneStage
            | KernelKind::Reduce
            | KernelKind::AllGather
            | KernelKind::ReduceScatter
            | KernelKind::Broadcast
            | KernelKind::Scatter
            | KernelKind::AllReduceRmsNorm => plan.stage_input == 0,
            _ => false,
        };
        if !direct || plan.width == 1 {
            return Ok(());
        }
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
