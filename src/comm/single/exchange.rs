//! The single controller's all-to-all: every rank's part of an exchange
//! (`core::launch::exchange`), launched rank by rank from one thread.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;

use super::SingleController;
use crate::comm::core::launch::exchange::{PeerOps, Transfer};
use crate::tensor::{TensorView, TensorViewMut};

impl<B: Backend> SingleController<B> {
    /// All-to-all in equal parts: `inputs[r]` and `outputs[r]` hold `world x n` elements;
    /// part q of rank r's input (elements `[q * n, (q + 1) * n)`) lands at part r of rank
    /// q's output, as the per-rank [`crate::Comm::all_to_all`].
    pub fn all_to_all(
        &self,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
    ) -> Result<()> {
        let first = self.check_inputs(inputs, "input")?;
        let world = self.world_size();
        if first.len % world != 0 {
            let what = format!(
                "all-to-all input of {} elements: not a multiple of the world ({world})",
                first.len
            );
            return Err(Error::LengthMismatch { rank: 0, what });
        }
        let counts = vec![vec![first.len / world; world]; world];
        self.all_to_all_v(inputs, outputs, &counts)
    }

    /// All-to-all with a count per pair of ranks (a mixture-of-experts dispatch or
    /// combine): `counts[r][q]` elements of `inputs[r]` go to rank q, taken in rank order
    /// (rank r's part for q starts after its parts for the ranks below q), and land in
    /// `outputs[q]` in the senders' rank order. Each input holds at least the sum of its
    /// row of `counts`, each output at least the sum of its column; only those are
    /// touched. Every tensor has one element type.
    pub fn all_to_all_v(
        &self,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        counts: &[Vec<usize>],
    ) -> Result<()> {
        self.check_usable()?;
        let world = self.world_size();
        if self.ranks[0].settings.world != world {
            return Err(Error::Unsupported(
                "all-to-all where peer memory does not serve the world".into(),
            ));
        }
        self.check_count(inputs.len())?;
        self.check_count(outputs.len())?;
        self.check_count(counts.len())?;
        let dtype = super::validate::meta(inputs[0].data).dtype;
        let row = |r: usize| counts[r].iter().try_fold(0usize, |a, &n| a.checked_add(n));
        let column = |q: usize| counts.iter().try_fold(0usize, |a, c| a.checked_add(c[q]));
        for (r, row) in counts.iter().enumerate() {
            if row.len() != world {
                let what = format!("{} counts for a world of {world}", row.len());
                return Err(Error::LengthMismatch { rank: r, what });
            }
        }
        for r in 0..world {
            let (i, o) = (inputs[r].data, &*outputs[r].data);
            for (m, shape, which, needed) in [
                (super::validate::meta(i), &inputs[r].shape, "input", row(r)),
                (
                    super::validate::meta(o),
                    &outputs[r].shape,
                    "output",
                    column(r),
                ),
            ] {
                self.check_tensor(r, &m, shape, which)?;
                if m.dtype != dtype {
                    return Err(Error::DTypeMismatch {
                        rank: r,
                        expected: dtype,
                        got: m.dtype,
                    });
                }
                if needed.is_none_or(|n| n > m.len) {
                    let what = format!(
                        "the all-to-all counts need more than its {which}'s {} elements",
                        m.len
                    );
                    return Err(Error::LengthMismatch { rank: r, what });
                }
            }
        }
        let ins = self.reads(inputs.iter().map(|t| t.data).enumerate());
        let outs = self.writes(outputs.iter_mut().map(|t| &mut *t.data).enumerate());
        let roles = [(&ins, "input", false), (&outs, "output", true)];
        self.check_overlaps(&roles, false)?;
        let size = dtype.size();
        let ops: Vec<[PeerOps; MAX_GPUS]> = (0..world)
            .map(|r| {
                let mut ops = [PeerOps::default(); MAX_GPUS];
                let (mut sent, mut received) = (0, 0);
                for (q, op) in ops.iter_mut().enumerate().take(world) {
                    let (s, g) = (counts[r][q], counts[q][r]);
                    op.send = Some(Transfer {
                        ptr: ins.at[r] + (sent * size) as u64,
                        dtype,
                        elements: s,
                    });
                    op.recv = Some(Transfer {
                        ptr: outs.at[r] + (received * size) as u64,
                        dtype,
                        elements: g,
                    });
                    (sent, received) = (sent + s, received + g);
                }
                ops
            })
            .collect();
        let ranks = &super::launch::ALL_RANKS[..world];
        self.launch_ranks(ranks, &|r| self.ranks[r].exchange(&ops[r]))
    }
}
