//! Zero copy for a capture's unregistered inputs (vLLM's `register_graph_buffers`):
//! [`Comm::register_inputs_of`] runs a pass to record them, registers them, and runs
//! it again with each call reading its input in place. The registrations are made for
//! the calls, not the buffers: the second pass's k-th unregistered input is the k-th
//! recorded one, found by number (never by [`Registry::lookup`]), so no other call's
//! place changes and ranks that alias buffers differently still pair call for call.

use std::sync::Arc;

use crate::backend::Backend;
use crate::bootstrap::{Bootstrap, ExchangeKind};
use crate::error::Result;

use super::records::{decode as decode_record, encode as encode_record, malformed, refused};
use super::records::{decode_all, record_word, refusal_of, take, CAPTURE_RECORD};
use super::registry::{register_range, Registry};
use crate::comm::per_rank::Comm;
use crate::comm::zero_copy::script::{Follow, Planning, Script, Step};

/// The registrations that the calls of a registered capture read their inputs through
/// ([`Comm::register_inputs_of`], `Comm::capture_registered` on CUDA): dropping it ends
/// them on this rank, so the graph must not be replayed after (`RegisteredGraph` holds
/// both).
pub struct CaptureInputs<B: Backend> {
    registry: Arc<Registry<B>>,
    ids: Vec<u64>,
    in_place: usize,
    staged: usize,
}

impl<B: Backend> CaptureInputs<B> {
    /// Registrations made for the capture (inputs that every rank passes at the same
    /// offset of an earlier call's input share one).
    pub fn registered(&self) -> usize {
        self.ids.len()
    }
    /// Calls of the kept pass whose peers read the input in place (through these
    /// registrations, or because it was registered or symmetric already).
    pub fn in_place_calls(&self) -> usize {
        self.in_place
    }
    /// Calls of the kept pass whose input is staged all the same (still right, only not
    /// zero-copy): the pass read an input the first did not (a buffer allocated inside
    /// it, other calls).
    pub fn staged_calls(&self) -> usize {
        self.staged
    }
    /// A replay of the graph they were made for is enqueued: its calls may read
    /// registered memory in place (see `Registry::note_in_place`).
    #[cfg(feature = "cuda")]
    pub(crate) fn note_replay(&self) {
        self.registry.note_in_place();
    }
}

impl<B: Backend> Drop for CaptureInputs<B> {
    fn drop(&mut self) {
        for &id in &self.ids {
            self.registry.remove(id);
        }
    }
}

impl<B: Backend> std::fmt::Debug for CaptureInputs<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureInputs")
            .field("registered", &self.ids.len())
            .field("in_place_calls", &self.in_place)
            .field("staged_calls", &self.staged)
            .finish()
    }
}

/// Puts the script back to `Off` however the pass ends (an error or a panic).
struct ScriptOff<'a>(&'a std::cell::RefCell<Script>);

impl Drop for ScriptOff<'_> {
    fn drop(&mut self) {
        *self.0.borrow_mut() = Script::Off;
    }
}

/// One rank's gathered record: its recorded inputs, or why it refuses.
fn encode(inputs: &[(u64, usize)], refusal: &str) -> Vec<u8> {
    let mut words = vec![inputs.len() as u64];
    for &(ptr, bytes) in inputs {
        words.extend([ptr, bytes as u64]);
    }
    encode_record(CAPTURE_RECORD, &words, refusal.as_bytes())
}

/// Rank `rank`'s recorded inputs from its record.
fn decode(rank: usize, b: &[u8]) -> Result<Vec<(u64, usize)>> {
    let ([count], rest) = decode_record(rank, b, CAPTURE_RECORD)?;
    let (pairs, refusal) = count
        .checked_mul(16)
        .and_then(|n| take(rest, n))
        .ok_or_else(|| malformed(rank, b))?;
    if !refusal.is_empty() {
        return Err(refused(rank, String::from_utf8_lossy(refusal).into_owned()));
    }
    let w = |c: &[u8], i| record_word(c, i).expect("16 bytes");
    let inputs = pairs.chunks_exact(16).map(|c| (w(c, 0), w(c, 1) as usize));
    Ok(inputs.collect())
}

/// Which registration each recorded call reads through: `(kept index, offset)` per
/// call of every rank's list (`lists[rank][call]`, checked alike), and the calls whose
/// ranges are registered (kept). A call shares a kept call's registration where every
/// rank's input lies inside that rank's kept input at one and the same offset.
fn share(lists: &[Vec<(u64, usize)>]) -> (Vec<(usize, u64)>, Vec<usize>) {
    let calls = lists.first().map_or(0, Vec::len);
    let mut kept: Vec<usize> = Vec::new();
    let mut uses = Vec::with_capacity(calls);
    for k in 0..calls {
        let inside = |j: usize| -> Option<u64> {
            let (p0, _) = lists[0][j];
            let offset = lists[0][k].0.checked_sub(p0)?;
            lists
                .iter()
                .all(|l| {
                    let ((pj, bj), (pk, bk)) = (l[j], l[k]);
                    pk.checked_sub(pj) == Some(offset) && offset + bk as u64 <= bj as u64
                })
                .then_some(offset)
        };
        match kept
            .iter()
            .enumerate()
            .find_map(|(i, &j)| inside(j).map(|o| (i, o)))
        {
            Some(shared) => uses.push(shared),
            None => {
                uses.push((kept.len(), 0));
                kept.push(k);
            }
        }
    }
    (uses, kept)
}

/// Checks that every rank recorded the same number of inputs with the same sizes.
fn check_lists(lists: &[Vec<(u64, usize)>]) -> Result<()> {
    let first = &lists[0];
    for (r, l) in lists.iter().enumerate() {
        let why = if l.len() != first.len() {
            let (n, n0) = (l.len(), first.len());
            format!("its pass read {n} unregistered inputs where rank 0's read {n0}")
        } else if let Some(k) = (0..l.len()).find(|&k| l[k].1 != first[k].1) {
            let (b, b0) = (l[k].1, first[k].1);
            format!(
                "the input of its pass's unregistered call {k} is {b} bytes where rank 0's is {b0}"
            )
        } else {
            continue;
        };
        return Err(refused(r, why + ": every rank captures the same calls"));
    }
    Ok(())
}

impl<B: Backend> Comm<B> {
    /// Runs `pass` twice so that its calls read their inputs in place (collective, in
    /// the same order as the registrations and symmetric allocations): the first run
    /// (staged, its value dropped) records the unregistered inputs, they are registered
    /// with every peer, and the second reads each through its registration. Returns the
    /// second value and the registrations, which must outlive what the pass made of the
    /// calls. Where no call read an unregistered input, the pass runs once. The pass
    /// must be safe to run twice on the same buffers (not an explicit two-stage).
    ///
    /// Errors, on every rank: the pass's own (on its rank;
    /// [`crate::Error::CannotRegister`] naming it on the others), `CannotRegister` where
    /// ranks recorded different calls or an input cannot be registered, and
    /// [`crate::Error::Unsupported`] without peer memory. Nothing stays registered.
    pub fn register_inputs_of<T>(
        &self,
        pass: impl FnMut() -> Result<T>,
    ) -> Result<(T, CaptureInputs<B>)> {
        self.register_passes(pass, Planning::Staged)
    }

    /// [`Comm::register_inputs_of`], its first pass planned as `planning` says.
    pub(crate) fn register_passes<T>(
        &self,
        mut pass: impl FnMut() -> Result<T>,
        planning: Planning,
    ) -> Result<(T, CaptureInputs<B>)> {
        self.check_zero_copy()?;
        let core = &*self.core;
        let first = core.check_usable().and_then(|()| {
            let _off = ScriptOff(&self.script);
            *self.script.borrow_mut() = Script::Record(Vec::new(), planning);
            let value = pass();
            let recorded = match std::mem::take(&mut *self.script.borrow_mut()) {
                Script::Record(inputs, _) => inputs,
                _ => Vec::new(),
            };
            value.map(|v| (v, recorded))
        });
        let mine = first.as_ref().map_or(Vec::new(), |(_, i)| i.clone());
        let bootstrap = self.exchanges.of(ExchangeKind::Capture);
        let gathered = bootstrap.all_gather(&encode(&mine, &refusal_of(&first)));
        let (value, _) = first?;
        let lists = decode_all(gathered, Ok(()), decode)?;
        check_lists(&lists)?;
        let mut inputs = CaptureInputs {
            registry: self.registry.clone(),
            ids: Vec::new(),
            in_place: 0,
            staged: 0,
        };
        if mine.is_empty() {
            return Ok((value, inputs));
        }
        drop(value);
        let (uses, kept) = share(&lists);
        for &k in &kept {
            let (ptr, bytes) = mine[k];
            // Every rank fails the same registration alike; `inputs` ends the ones made.
            let id = register_range(
                &self.registry,
                core.device(),
                &bootstrap,
                ptr,
                bytes,
                Ok(()),
                false,
            )?;
            inputs.ids.push(id);
        }
        let steps = mine
            .iter()
            .zip(&uses)
            .map(|(&(ptr, bytes), &(kept, offset))| Step {
                ptr,
                bytes,
                id: inputs.ids[kept],
                offset,
            })
            .collect();
        let _off = ScriptOff(&self.script);
        *self.script.borrow_mut() = Script::Follow(Follow::new(steps));
        let value = pass()?;
        if let Script::Follow(f) = &*self.script.borrow() {
            inputs.in_place = f.in_place;
            inputs.staged = f.staged;
        }
        Ok((value, inputs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::zero_copy::records::{refused_by, REGISTER_RECORD};

    #[test]
    fn records_round_trip_and_carry_refusals() {
        let inputs = vec![(0x1000, 256), (0x2000, 64)];
        assert_eq!(decode(1, &encode(&inputs, "")).unwrap(), inputs);
        assert_eq!(
            refused_by(decode(2, &encode(&inputs, "it failed")), 2),
            "it failed"
        );
        let mut short = encode(&inputs, "");
        short.truncate(40);
        refused_by(decode(0, &short), 0);
        let register = encode_record(REGISTER_RECORD, &[0, 0], b"");
        let reason = refused_by(decode(1, &register), 1);
        assert!(reason.contains("registered capture"), "{reason}");
    }

    /// Sharing: the same buffer on every rank shares; a rank that aliases where its
    /// peer does not, or a different offset per rank, does not.
    #[test]
    fn calls_share_only_where_every_rank_agrees() {
        // Call 1 is call 0's buffer on both ranks; call 2 is inside call 0's at 64 on
        // both; call 3 aliases call 0 on rank 0 only; call 4 is inside at different
        // offsets.
        #[rustfmt::skip]
        let rank0 = vec![(0x1000, 256), (0x1000, 256), (0x1040, 64), (0x1000, 256), (0x1010, 16)];
        #[rustfmt::skip]
        let rank1 = vec![(0x9000, 256), (0x9000, 256), (0x9040, 64), (0x5000, 256), (0x9020, 16)];
        let (uses, kept) = share(&[rank0, rank1]);
        assert_eq!(kept, vec![0, 3, 4]);
        assert_eq!(uses, vec![(0, 0), (0, 0), (0, 64), (1, 0), (2, 0)]);
    }

    #[test]
    fn lists_must_agree_in_length_and_sizes() {
        let a = vec![(0x1000, 256)];
        assert!(check_lists(&[a.clone(), a.clone()]).is_ok());
        refused_by(check_lists(&[a.clone(), vec![]]), 1);
        refused_by(check_lists(&[a, vec![(0x1000, 128)]]), 1);
    }
}
