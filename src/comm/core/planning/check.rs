//! One rank's side of a call, checked before anything launches (buffers' device, dtype,
//! length and overlaps, a root), and the planning entry points of both front doors.

use crate::backend::Backend;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

use super::staging::message_bytes;
use crate::comm::core::planning::cache::Shape;
use crate::comm::core::planning::collective::{reduce_scatter_part, Collective, CollectiveOptions};
use crate::comm::core::planning::{PeerReads, Plan};
use crate::comm::core::routing::Path;
use crate::comm::core::Rank;
use crate::comm::AllReduceOptions;

/// One buffer of a call as [`check_overlaps`] sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    /// The rank whose buffer it is.
    pub(crate) rank: usize,
    /// Its role (`"input"`, `"output"`, `"residual"`, `"weight"`).
    pub(crate) which: &'static str,
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
    /// Whether the call writes it.
    pub(crate) written: bool,
}

impl Span {
    fn end(&self) -> u128 {
        u128::from(self.ptr) + self.bytes as u128
    }
    fn overlaps(&self, other: &Span) -> bool {
        self.bytes > 0
            && other.bytes > 0
            && u128::from(self.ptr) < other.end()
            && u128::from(other.ptr) < self.end()
    }
}

/// Every pair of a call's buffers with a written one must be disjoint, except (with
/// `in_place`) a rank's input and output of exactly one range, which runs in place
/// (returns whether found). Any other overlap is [`Error::BuffersOverlap`] (it would give
/// a wrong result with `Ok`).
pub(crate) fn check_overlaps(spans: &[Span], in_place: bool) -> Result<bool> {
    let mut aliased = false;
    for (i, a) in spans.iter().enumerate() {
        for b in spans[i + 1..].iter().filter(|b| a.written || b.written) {
            if !a.overlaps(b) {
                continue;
            }
            let exact = a.ptr == b.ptr && a.bytes == b.bytes;
            let own_pair = a.rank == b.rank && a.written != b.written;
            let input_output =
                [a.which, b.which].contains(&"input") && [a.which, b.which].contains(&"output");
            if in_place && exact && own_pair && input_output {
                aliased = true;
                continue;
            }
            let shown = |s: &Span| match spans.iter().any(|o| o.rank != s.rank) {
                true => format!(
                    "rank {}'s {} ({} bytes at {:#x})",
                    s.rank, s.which, s.bytes, s.ptr
                ),
                false => format!("its {} ({} bytes at {:#x})", s.which, s.bytes, s.ptr),
            };
            let why = match in_place && own_pair && input_output {
                true => "only the very same range runs in place",
                false => "the buffers of a call must not overlap",
            };
            return Err(Error::BuffersOverlap {
                rank: a.rank.min(b.rank),
                what: format!("{} overlaps {}: {why}", shown(a), shown(b)),
            });
        }
    }
    Ok(aliased)
}

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
    /// Away from them (the external library, or across hosts), with the operator.
    Away(Path, ReduceOp),
}

impl Meta {
    /// Its bytes, checked ([`message_bytes`]); `rank` and `which` name it in the error.
    pub(crate) fn bytes(&self, rank: usize, which: &str) -> Result<usize> {
        let what = || format!("rank {rank}'s {which} buffer");
        message_bytes(self.dtype, self.len, &what)?;
        Ok(self.len * self.dtype.size())
    }
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

    /// Usable, both buffers on this device, one dtype, sizes a buffer can have.
    pub(crate) fn check_pair(&self, send: &Meta, recv: &Meta) -> Result<()> {
        self.check_usable()?;
        self.check_buffer(send.ordinal, "input")?;
        self.check_buffer(recv.ordinal, "output")?;
        self.check_dtype(send.dtype, recv.dtype)?;
        send.bytes(self.world_rank(), "input")?;
        recv.bytes(self.world_rank(), "output")?;
        Ok(())
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

    /// Routes and plans an all-reduce of `elements` of `dtype` on this rank (cached).
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
        // Before routing, which multiplies the length by the element size.
        message_bytes(dtype, elements, &|| "an all-reduce".into())?;
        super::check_op(dtype, options.op)?;
        match self.route.path(dtype, elements, options)? {
            Path::Peer(local) => {
                let plan = self
                    .settings
                    .plan(dtype, elements, &local, in_place, reads)?;
                self.plans.put(shape, plan);
                Ok(Routed::Peer(plan))
            }
            path => Ok(Routed::Away(path, options.op)),
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

    /// Whether this rank is the root of its broadcast or scatter group (the root checked
    /// first); a root must pass its input.
    pub(crate) fn check_root(
        &self,
        (has, what): (bool, &str),
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<bool> {
        let (width, _) = self.collective_width(options)?;
        if root >= width {
            return Err(Error::InvalidRoot { root, width });
        }
        let is_root = self.world_rank() % width == root;
        if is_root && !has {
            return Err(Error::Unsupported(format!(
                "rank {} is the root: it passes its {what}",
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

#[cfg(test)]
mod tests {
    use super::*;

    fn span(rank: usize, which: &'static str, ptr: u64, bytes: usize) -> Span {
        let written = which != "input" && which != "weight";
        Span {
            rank,
            which,
            ptr,
            bytes,
            written,
        }
    }

    /// Disjoint ranges pass; the exact alias of a rank's input and output passes only
    /// where the call has an in-place form (and says so); any other overlap, across
    /// ranks and between outputs too, is refused; reads may overlap; empty ranges and
    /// ranges at the top of the address space never wrap.
    #[test]
    fn overlaps_are_refused_but_the_exact_alias() {
        let input = span(0, "input", 0x1000, 4096);
        let top = span(0, "input", u64::MAX - 15, 16);
        let weight = span(0, "weight", 0x100, 64);
        let out = |rank, ptr, bytes| span(rank, "output", ptr, bytes);
        // Two spans, in place, and whether the input and output alias where it passes.
        for ([a, b], in_place, want) in [
            ([input, out(0, 0x2000, 4096)], true, Some(false)),
            ([input, out(0, 0x1000, 4096)], true, Some(true)),
            ([input, out(0, 0x1000, 4096)], false, None),
            ([input, out(0, 0x1004, 4096)], true, None),
            ([input, out(0, 0x0ffc, 8)], true, None),
            ([input, out(0, 0x1000, 4092)], true, None),
            ([input, out(1, 0x1000, 4096)], true, None),
            // Two outputs, exact or not; a residual over a weight.
            ([out(0, 0x8000, 64), out(1, 0x8000, 64)], true, None),
            ([weight, span(0, "residual", 0x120, 64)], true, None),
            // Reads overlap freely; empty ranges overlap nothing; nothing wraps.
            ([input, span(1, "input", 0x1000, 4096)], false, Some(false)),
            ([input, out(0, 0x1000, 0)], false, Some(false)),
            ([top, out(0, 0, 16)], false, Some(false)),
            ([top, out(0, u64::MAX, 1)], false, None),
        ] {
            match (check_overlaps(&[a, b], in_place), want) {
                (Ok(aliased), Some(w)) => assert_eq!(aliased, w, "{a:?} {b:?}"),
                (Err(Error::BuffersOverlap { rank: 0, what }), None) => {
                    assert!(what.contains(a.which), "{what}")
                }
                (got, _) => panic!("{a:?} {b:?} (in place {in_place}): {got:?}"),
            }
        }
    }
}
