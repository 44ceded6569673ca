//! The symmetric pool's bookkeeping on one rank: its segments (each registered with every
//! peer) and their free ranges, handed out first fit.

use crate::error::lock;
use std::sync::{Arc, Mutex};

use crate::backend::Backend;
use crate::comm::zero_copy::registry::Registry;
use crate::error::Result;

/// Alignment of a symmetric buffer in its segment.
pub(crate) const ALIGN: u64 = 256;

/// One segment of the pool: its memory, registered with every peer.
pub(crate) struct Segment<B: Backend> {
    pub(crate) memory: B::Memory,
    pub(crate) bytes: u64,
    pub(crate) registration: u64,
    pub(crate) registry: Arc<Registry<B>>,
    /// Free ranges (offset, bytes), sorted and merged.
    pub(crate) free: Mutex<Vec<(u64, u64)>>,
    /// Ranges of dropped buffers, free from the next allocation on.
    pub(crate) dropped: Mutex<Vec<(u64, u64)>>,
}

impl<B: Backend> Drop for Segment<B> {
    fn drop(&mut self) {
        self.registry.remove(self.registration);
    }
}

impl<B: Backend> Segment<B> {
    /// The first free range that holds `bytes`.
    pub(crate) fn first_fit(&self, bytes: u64) -> Option<u64> {
        lock(&self.free)
            .iter()
            .find(|&&(_, n)| n >= bytes)
            .map(|&(o, _)| o)
    }
    /// Takes `[offset, offset + bytes)` out of the free range that starts at `offset`.
    pub(crate) fn take(&self, offset: u64, bytes: u64) {
        let mut free = lock(&self.free);
        if let Some(i) = free.iter().position(|&(o, _)| o == offset) {
            let (o, n) = free[i];
            if n == bytes {
                free.remove(i);
            } else {
                free[i] = (o + bytes, n - bytes);
            }
        }
    }
    /// Whether all of it is free (after [`Segment::reclaim`]).
    pub(crate) fn is_whole(&self) -> bool {
        *lock(&self.free) == [(0, self.bytes)]
    }
    /// Moves the dropped ranges into the free list (merging neighbours); whether there
    /// were any.
    pub(crate) fn reclaim(&self) -> bool {
        let dropped = std::mem::take(&mut *lock(&self.dropped));
        if dropped.is_empty() {
            return false;
        }
        let mut free = lock(&self.free);
        free.extend(dropped);
        free.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(free.len());
        for &(o, n) in free.iter() {
            match merged.last_mut() {
                Some((lo, ln)) if *lo + *ln == o => *ln += n,
                _ => merged.push((o, n)),
            }
        }
        *free = merged;
        true
    }
}

/// Moves every segment's dropped ranges into its free list, once this rank's work
/// queued before their drop is done.
pub(crate) fn reclaim<B: Backend>(segments: &[Arc<Segment<B>>], dev: &B::Device) -> Result<()> {
    // Every segment reclaims (no short circuit).
    if segments.iter().fold(false, |any, s| s.reclaim() | any) {
        B::synchronize(dev)?;
    }
    Ok(())
}

/// The symmetric pool of one rank: its segments.
pub(crate) type SymmetricPool<B> = Mutex<Vec<Arc<Segment<B>>>>;
