//! Buffers registered with a per-rank communicator, and where every group member's copy
//! of each is reached from this rank: a peer in this process at its own address, one in
//! another process through the IPC handle of its allocation (imported once per
//! allocation and peer). Registration ([`register_range`]) is collective, and so is any
//! refusal ([`crate::Error::CannotRegister`] on every rank, nothing registered).
//!
//! A kernel that gives up at its end barrier (a timeout) does not wait for the peers'
//! reads, so once a call may have read registered memory in place, a dropped
//! [`crate::Registered`]'s buffer is retired ([`Registry::retire`]) until a clean
//! synchronize or reinitialize ([`Registry::settle`]) or the teardown
//! ([`Registry::close`]).

use crate::error::lock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::backend::handle::process_token;
use crate::backend::{Backend, Descriptor};
use crate::bootstrap::Bootstrap;
use crate::comm::core::planning::InputPlace;
use crate::comm::zero_copy::exchange::{exchange, DESCRIPTOR_TIMEOUT};
use crate::error::Result;
use crate::os::descriptors::Listener;
use crate::signal::MAX_GPUS;

use super::records::{decode_all, first_refusal, refusal_of, refused, Offer};

/// Where every group member's input of one call is, read in place.
#[derive(Clone, Copy, Debug)]
pub(crate) struct InPlace {
    /// The call's input place for the descriptor.
    pub(crate) place: InputPlace,
    /// Member k's input, as this rank reaches it (world-indexed).
    pub(crate) inputs: [u64; MAX_GPUS],
}

/// One registered range on this rank.
struct Entry<B: Backend> {
    id: u64,
    base: u64,
    bytes: usize,
    /// `peers[k]`: group member k's range, as this rank reaches it.
    peers: [u64; MAX_GPUS],
    /// `seen_by[k]`: this rank's range, as group member k reaches it (0: not at all).
    seen_by: [u64; MAX_GPUS],
    /// Whether [`Registry::lookup`] finds it: a capture's registrations are found only
    /// by number ([`Registry::place_in`]), so that they change no other call's place.
    listed: bool,
    /// The imports it uses (shared with other entries of the same allocations).
    _imports: Vec<Arc<Import<B>>>,
}

impl<B: Backend> Entry<B> {
    /// Every member's input at `offset` in this range.
    fn place(&self, offset: u64) -> InPlace {
        let inputs = self.peers.map(|p| if p == 0 { 0 } else { p + offset });
        let place = InputPlace::Registered {
            registration: self.id,
            offset,
        };
        InPlace { place, inputs }
    }
}

/// A peer allocation mapped here.
struct Import<B: Backend> {
    handle: Vec<u8>,
    mapping: B::PeerMapping,
}

/// A retired buffer (held only to be dropped).
pub(crate) type RetiredBuffer = Box<dyn Send>;

/// Where buffers retired after the communicator's teardown go (the parking lot).
pub(crate) type Parker = Box<dyn Fn(RetiredBuffer) + Send + Sync>;

/// Buffers of dropped registrations that a peer may still read in place.
#[derive(Default)]
struct Retired {
    buffers: Vec<RetiredBuffer>,
    /// Set by [`Registry::close`]: `None` while the communicator lives; `Some(None)`
    /// after a teardown that every rank met (nothing can read any more); `Some(Some)`
    /// after one that parked its memory (later drops are parked alike).
    closed: Option<Option<Parker>>,
}

/// This rank's registered ranges.
pub(crate) struct Registry<B: Backend> {
    entries: Mutex<Vec<Entry<B>>>,
    /// Live imports by handle, so that an allocation is opened once per peer.
    imports: Mutex<Vec<Weak<Import<B>>>>,
    /// Registrations begun (the next one's number): taken once every rank has gathered
    /// its records, whatever the outcome after that, so that nothing sent for one that
    /// failed (a late descriptor) can pass for a later one's.
    made: Mutex<u64>,
    /// Where peers in other processes send this rank descriptors (bound on first use).
    channel: Mutex<Option<Listener>>,
    /// How long a registration waits for its peers' descriptors ([`exchange`]).
    descriptor_timeout: Duration,
    /// Whether a call since the last [`Registry::settle`] may read registered memory
    /// in place.
    in_flight: AtomicBool,
    /// Buffers kept until the peers' reads are known to be over.
    retired: Mutex<Retired>,
}

impl<B: Backend> Registry<B> {
    /// A registry whose registrations wait for descriptors at most half the bootstrap's
    /// timeout (and at most [`DESCRIPTOR_TIMEOUT`]), so that a rank whose descriptor
    /// never came still reaches the gather where its peers wait for its verdict.
    pub(crate) fn new(bootstrap_timeout: Duration) -> Self {
        Registry {
            entries: Mutex::new(Vec::new()),
            imports: Mutex::new(Vec::new()),
            made: Mutex::new(0),
            channel: Mutex::new(None),
            descriptor_timeout: DESCRIPTOR_TIMEOUT.min(bootstrap_timeout / 2),
            in_flight: AtomicBool::new(false),
            retired: Mutex::new(Retired::default()),
        }
    }

    /// `f` of the listed registered range that holds all `bytes` bytes at `ptr` and
    /// their offset in it, if one does ([`Registry::note_in_place`]d).
    fn listed<R>(&self, ptr: u64, bytes: usize, f: impl FnOnce(&Entry<B>, u64) -> R) -> Option<R> {
        let entries = lock(&self.entries);
        // In u128: no range wraps (registered ranges were checked, an input was not).
        let end = u128::from(ptr) + bytes as u128;
        let e = entries
            .iter()
            .find(|e| e.listed && ptr >= e.base && end <= u128::from(e.base) + e.bytes as u128)?;
        self.note_in_place();
        Some(f(e, ptr - e.base))
    }

    /// The place of an input of `bytes` bytes at `ptr`, when a listed registered range
    /// holds all of it ([`Registry::note_in_place`]d).
    pub(crate) fn lookup(&self, ptr: u64, bytes: usize) -> Option<InPlace> {
        self.listed(ptr, bytes, |e, offset| e.place(offset))
    }

    /// Where each group member reaches the `bytes` bytes at `ptr` on this rank (its
    /// address, 0 for none), when a listed registered range holds all of them
    /// ([`Registry::note_in_place`]d): a send the peers read in place.
    pub(crate) fn seen_by(&self, ptr: u64, bytes: usize) -> Option<[u64; MAX_GPUS]> {
        self.listed(ptr, bytes, |e, offset| {
            e.seen_by.map(|b| if b == 0 { 0 } else { b + offset })
        })
    }

    /// The place at `offset` in registration `id` (listed or not), if it is live (as
    /// [`Registry::lookup`]).
    pub(crate) fn place_in(&self, id: u64, offset: u64) -> Option<InPlace> {
        let entries = lock(&self.entries);
        let e = entries.iter().find(|e| e.id == id)?;
        self.note_in_place();
        Some(e.place(offset))
    }

    /// A call that may read registered memory in place is (about to be) enqueued: a
    /// buffer dropped from now on is retired until [`Registry::settle`].
    pub(crate) fn note_in_place(&self) {
        self.in_flight.store(true, Ordering::SeqCst);
    }

    /// Takes `buffer` of a dropped registration: kept while a peer may still read it in
    /// place, else given back to be freed by the caller (outside the lock).
    pub(crate) fn retire(&self, buffer: RetiredBuffer) -> Option<RetiredBuffer> {
        let mut retired = lock(&self.retired);
        match &retired.closed {
            Some(Some(park)) => {
                park(buffer);
                None
            }
            Some(None) => Some(buffer),
            None if self.in_flight.load(Ordering::SeqCst) => {
                retired.buffers.push(buffer);
                None
            }
            None => Some(buffer),
        }
    }

    /// Every peer finished reading this rank's registered memory (a clean synchronize or
    /// reinitialize, on the issuing thread): frees the retired buffers.
    pub(crate) fn settle(&self) {
        let mut retired = lock(&self.retired);
        self.in_flight.store(false, Ordering::SeqCst);
        let freed = std::mem::take(&mut retired.buffers);
        drop(retired);
        drop(freed); // outside the lock
    }

    /// The communicator's teardown: gives back the retired buffers, for the caller to
    /// free (`park` `None`: every rank met the teardown; later drops free at once) or to
    /// park with the rank's memory (later drops go to `park`).
    pub(crate) fn close(&self, park: Option<Parker>) -> Vec<RetiredBuffer> {
        let mut retired = lock(&self.retired);
        self.in_flight.store(false, Ordering::SeqCst);
        retired.closed = Some(park);
        std::mem::take(&mut retired.buffers)
    }

    /// Forgets registration `id` (this rank only): its imports are unmapped once no
    /// other registration uses them, after this rank's queued work.
    pub(crate) fn remove(&self, id: u64) {
        let gone: Vec<Entry<B>> = lock(&self.entries).extract_if(.., |e| e.id == id).collect();
        drop(gone);
        lock(&self.imports).retain(|w| w.strong_count() > 0);
    }

    /// Registered ranges on this rank.
    pub(crate) fn len(&self) -> usize {
        lock(&self.entries).len()
    }

    /// Peer allocations mapped here for the registrations.
    pub(crate) fn imports(&self) -> usize {
        lock(&self.imports)
            .iter()
            .filter(|w| w.strong_count() > 0)
            .count()
    }

    /// The live import of `handle`, or a new one (`descriptor`: the one that came with
    /// the handle; closed here when the allocation is already mapped).
    fn import(
        &self,
        dev: &B::Device,
        handle: &[u8],
        descriptor: Option<Descriptor>,
    ) -> Result<Arc<Import<B>>> {
        let mut imports = lock(&self.imports);
        if let Some(live) = imports
            .iter()
            .filter_map(Weak::upgrade)
            .find(|i| i.handle == handle)
        {
            return Ok(live);
        }
        let import = Arc::new(Import {
            handle: handle.to_vec(),
            mapping: B::import_range(dev, handle, descriptor)?,
        });
        imports.retain(|w| w.strong_count() > 0);
        imports.push(Arc::downgrade(&import));
        Ok(import)
    }
}

/// Registers `[ptr, ptr + bytes)` of this rank with every rank of `group`; returns the
/// registration's number, the same on every rank. `local` is this rank's own verdict on
/// the range: an error there is still gathered, so that this rank returns it and every
/// peer [`crate::Error::CannotRegister`] naming this rank. `listed`: whether
/// [`Registry::lookup`] finds the range. A range a same-process peer's device cannot
/// reach ([`Backend::peer_access_problem`]) is refused on every rank, not left to fault.
pub(crate) fn register_range<B: Backend>(
    registry: &Registry<B>,
    dev: &B::Device,
    group: &dyn Bootstrap,
    ptr: u64,
    bytes: usize,
    local: Result<()>,
    listed: bool,
) -> Result<u64> {
    let (me, n) = (group.rank(), group.world_size());
    // Held to the end: one registration at a time.
    let mut made = lock(&registry.made);
    let id = *made;
    let mine = Offer {
        process: process_token(),
        ordinal: B::ordinal(dev) as u64,
        id,
        ptr,
        bytes: bytes as u64,
        refusal: refusal_of(&local),
    };
    let gathered = group.all_gather(&mine.encode());
    if gathered.is_ok() {
        // Every rank gathered this registration's records: each takes its number,
        // whatever comes next (see `Registry::made`).
        *made += 1;
    }
    let offers = decode_all(gathered, local, Offer::decode)?;
    first_refusal(offers.iter().map(|o| &o.refusal)).map_or(Ok(()), Err)?;
    // Every rank checks every offer, so every rank refuses alike.
    let first = &offers[0];
    for (r, o) in offers.iter().enumerate() {
        let (what, theirs, ours) = if o.id != first.id {
            ("has made", o.id, first.id)
        } else if o.bytes != first.bytes {
            ("registers", o.bytes, first.bytes)
        } else {
            continue;
        };
        return Err(refused(
            r,
            format!(
                "it {what} {theirs} (registrations, or bytes) where rank 0 {what} {ours}: \
                 every rank registers (and allocates symmetric buffers) of the same sizes \
                 in the same order"
            ),
        ));
    }
    let remote: Vec<bool> = offers.iter().map(|o| o.process != mine.process).collect();
    // Handles only where some rank is in another process (every rank decides alike).
    let (mut received, mut problem) = if remote.iter().any(|&r| r) {
        exchange::<B>(
            dev,
            group,
            &registry.channel,
            (mine.id, registry.descriptor_timeout),
            (ptr, bytes),
            &remote,
        )
        .map(|(received, problem)| (received, problem.unwrap_or_default()))?
    } else {
        ((0..n).map(|_| None).collect(), String::new())
    };
    let mut peers = [0u64; MAX_GPUS];
    let mut imports = Vec::new();
    for (r, o) in offers.iter().enumerate() {
        if !problem.is_empty() {
            break; // This rank refuses: nothing more to check or import.
        }
        let reached = if r == me {
            Ok(o.ptr)
        } else if o.process == mine.process {
            // The peer reads this rank's range at its address: may its device?
            match B::peer_access_problem(dev, ptr, o.ordinal as usize) {
                Ok(None) => Ok(o.ptr),
                Ok(Some(detail)) => Err(format!(
                    "its buffer is not reachable from device {} (rank {r}'s): {detail}; \
                     allocate it with cuMemAlloc or from the device's default memory pool, \
                     or grant the peer access",
                    o.ordinal
                )),
                Err(e) => Err(format!("checking rank {r}'s access failed: {e}")),
            }
        } else {
            let got = received[r]
                .take()
                .expect("every rank in another process sent");
            match registry.import(dev, &got.handle, got.descriptor) {
                Ok(i) => {
                    let addr = B::mapping_ptr(&i.mapping) + got.offset;
                    imports.push(i);
                    Ok(addr)
                }
                Err(e) => Err(format!("mapping rank {r}'s buffer here failed: {e}")),
            }
        };
        match reached {
            Ok(p) => peers[r] = p,
            Err(e) => problem = e,
        }
    }
    // Every rank learns whether any import failed, and where each peer reaches its
    // range: each record is the ranges this rank reached (8 bytes each), then the
    // problem (empty: none).
    let mut record: Vec<u8> = peers.iter().flat_map(|p| p.to_le_bytes()).collect();
    record.extend_from_slice(problem.as_bytes());
    let records = group.all_gather(&record)?;
    let reached = MAX_GPUS * 8;
    if let Some((r, _)) = records.iter().enumerate().find(|(_, x)| x.len() < reached) {
        return Err(refused(r, "a malformed registration record".into()));
    }
    first_refusal(records.iter().map(|x| &x[reached..])).map_or(Ok(()), Err)?;
    let mut seen_by = [0u64; MAX_GPUS];
    for (k, x) in records.iter().enumerate().take(MAX_GPUS) {
        let at = &x[me * 8..me * 8 + 8];
        seen_by[k] = u64::from_le_bytes(at.try_into().expect("8 bytes"));
    }
    lock(&registry.entries).push(Entry {
        id,
        base: ptr,
        bytes,
        peers,
        seen_by,
        listed,
        _imports: imports,
    });
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    /// A failed registration uses up its number on every rank.
    #[test]
    fn a_failed_registration_uses_up_its_number() {
        use crate::backend::host::Host;
        use crate::external::local::LocalBootstrap;

        let world = LocalBootstrap::world(2, std::time::Duration::from_secs(10));
        let ids: Vec<(bool, bool, u64)> = std::thread::scope(|s| {
            let ranks: Vec<_> = world
                .iter()
                .map(|boot| {
                    s.spawn(move || {
                        let rank = boot.rank();
                        let dev = Host::open(rank).unwrap();
                        let registry = Registry::<Host>::new(Duration::from_secs(60));
                        let memory = vec![0u8; 4096];
                        let ptr = memory.as_ptr() as u64;
                        // Sizes that differ: refused on every rank.
                        let unequal =
                            register_range(&registry, &dev, boot, ptr, 1024 + rank, Ok(()), true);
                        // A local refusal on rank 1: refused on every rank.
                        let local = if rank == 1 {
                            Err(Error::Unsupported("a local refusal".into()))
                        } else {
                            Ok(())
                        };
                        let refused = register_range(&registry, &dev, boot, ptr, 1024, local, true);
                        let next = register_range(&registry, &dev, boot, ptr, 1024, Ok(()), true);
                        (unequal.is_err(), refused.is_err(), next.unwrap())
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(ids, vec![(true, true, 2), (true, true, 2)]);
    }
}
