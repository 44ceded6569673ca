//! One rank's side of a call, checked before anything is launched (its buffers'
//! device, dtypes and lengths, a broadcast's root), and the two planning entry points
//! every front door goes through: the all-reduce (routed, then planned) and the other
//! collectives. What only a single controller can check (every rank's tensors
//! together) is in its own front door.

use crate::backend::Backend;
use crate::dtype::DType;
use crate::error::{Error, Result};

use super::collective::{reduce_scatter_part, Collective, CollectiveOptions};
use super::plan::{PeerReads, Plan};
use super::plan_cache::Shape;
use super::route::Path;
use super::Rank;
use crate::comm::AllReduceOptions;

/// What a front door knows of one buffer of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Meta {
    pub(crate) dtype: DType,
    pub(crate) len: usize,
    pub(crate) ordinal: usize,
}

/// How an all-reduce runs on a rank.
pub(crate) enum Routed {
    /// The peer-memory kernels, with this plan.
    Peer(Plan),
    /// Away from them (the external library, or across hosts).
    Away(Path),
}

impl<B: Backend> Rank<B> {
    /// This rank's index in the world (what errors name).
    pub(crate) fn world_rank(&self) -> usize {
        self.route.world_rank
    }

    /// A buffer on another device than this rank's is [`Error::WrongDevice`].
    pub(crate) fn check_buffer(&self, ordinal: usize, which: &'static str) -> Result<()> {
        let expected = self.ordinal();
        if ordinal != expected {
            return Err(Error::WrongDevice {
                rank: self.world_rank(),
                which,
                expected,
                got: ordinal,
            });
        }
        Ok(())
    }

    /// `got` must be the call's `expected` dtype.
    pub(crate) fn check_dtype(&self, expected: DType, got: DType) -> Result<()> {
        if expected != got {
            return Err(Error::DTypeMismatch {
                rank: self.world_rank(),
                expected,
                got,
            });
        }
        Ok(())
    }

    /// `which` must have `expected` elements (`None`: the rule overflowed).
    pub(crate) fn check_len(
        &self,
        got: usize,
        expected: Option<usize>,
        which: &str,
        rule: &str,
    ) -> Result<()> {
        if expected != Some(got) {
            return Err(Error::LengthMismatch {
                rank: self.world_rank(),
                what: match expected {
                    Some(e) => format!("{which} has {got} elements but must have {e} ({rule})"),
                    None => format!("{which}: {rule} overflows usize"),
                },
            });
        }
        Ok(())
    }

    /// Usable, both buffers on this rank's device, one dtype.
    pub(crate) fn check_pair(&self, send: &Meta, recv: &Meta) -> Result<()> {
        self.check_usable()?;
        self.check_buffer(send.ordinal, "input")?;
        self.check_buffer(recv.ordinal, "output")?;
        self.check_dtype(send.dtype, recv.dtype)
    }

    /// An all-reduce's buffers: a pair of one length.
    pub(crate) fn check_all_reduce(&self, send: &Meta, recv: &Meta) -> Result<()> {
        self.check_pair(send, recv)?;
        if send.len != recv.len {
            return Err(Error::LengthMismatch {
                rank: self.world_rank(),
                what: format!(
                    "output has {} elements but its input {}",
                    recv.len, send.len
                ),
            });
        }
        Ok(())
    }

    /// Routes and plans an all-reduce of `elements` of `dtype` on this rank.
    pub(crate) fn plan_all_reduce(
        &self,
        dtype: DType,
        elements: usize,
        options: &AllReduceOptions,
        in_place: bool,
        reads: PeerReads,
    ) -> Result<Routed> {
        let shape = Shape {
            dtype,
            elements,
            options: *options,
            in_place,
            reads,
        };
        if let Some(plan) = self.plans.get(&shape) {
            return Ok(Routed::Peer(plan));
        }
        match self.route.path(dtype, elements, options)? {
            Path::Peer(local) => {
                let plan = self
                    .settings
                    .plan(dtype, elements, &local, in_place, reads)?;
                self.plans.put(shape, plan);
                Ok(Routed::Peer(plan))
            }
            path => Ok(Routed::Away(path)),
        }
    }

    /// The group width of a collective other than the all-reduce (peer memory only),
    /// and the options in the peer-memory group's numbering.
    pub(crate) fn collective_width(
        &self,
        options: &CollectiveOptions,
    ) -> Result<(usize, CollectiveOptions)> {
        let local = self.route.local_collective(options)?;
        Ok((self.settings.group_width(local.group_size)?, local))
    }

    /// Plans a collective other than the all-reduce on this rank.
    pub(crate) fn plan_collective(
        &self,
        which: Collective,
        dtype: DType,
        elements: usize,
        options: &CollectiveOptions,
        reads: PeerReads,
    ) -> Result<Plan> {
        let (_, local) = self.collective_width(options)?;
        self.settings
            .collective_plan(which, dtype, elements, &local, reads)
    }

    /// Whether this rank is the root of its broadcast or scatter group (a valid root
    /// is checked first); a root must pass its input.
    pub(crate) fn check_root(
        &self,
        has_input: bool,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<bool> {
        let (width, _) = self.collective_width(options)?;
        if root >= width {
            return Err(Error::InvalidRoot { root, width });
        }
        let is_root = self.world_rank() % width == root;
        if is_root && !has_input {
            return Err(Error::Unsupported(format!(
                "rank {} is the root: it passes its input",
                self.world_rank()
            )));
        }
        Ok(is_root)
    }

    /// This rank's part of an `n`-element reduce-scatter input.
    pub(crate) fn reduce_scatter_len(
        &self,
        n: usize,
        options: &CollectiveOptions,
    ) -> Result<usize> {
        let (width, _) = self.collective_width(options)?;
        Ok(reduce_scatter_part(n, width, self.world_rank() % width).len())
    }
}

impl<B: Backend> Rank<B> {
    /// The barrier kernel over groups of `group_size` (groups that peer memory serves
    /// only).
    pub(crate) fn barrier_plan(&self, group_size: usize) -> Result<Plan> {
        let options = AllReduceOptions::new().group_size(group_size);
        match self.route.path(DType::F32, 0, &options)? {
            Path::Peer(local) => self.settings.barrier_plan(local.group_size),
            _ => Err(Error::Unsupported(
                "a device barrier needs peer memory between the group's ranks".into(),
            )),
        }
    }
}
