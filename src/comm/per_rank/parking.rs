//! The parking lot: memory a peer's kernel may still write into, kept past the drop of
//! its communicator until a deadline past which no such kernel runs (`None`: process
//! exit). Nothing runs in the background: a drop that met its peers calls
//! [`free_expired_teardowns`]. [`park`] never frees (releasing a GPU's memory can wait for its
//! kernels, past a parking drop's bound). Freeing happens outside the lock and catches
//! a panic in an item's drop.

use std::sync::Mutex;
use std::time::Instant;

/// One parked item (held only to be dropped) and when it may be freed (`None`:
/// never).
struct Entry {
    until: Option<Instant>,
    _item: Box<dyn Send>,
}

/// Items kept alive until their deadlines (see the module docs).
pub(crate) struct ParkingLot {
    entries: Mutex<Vec<Entry>>,
}

impl ParkingLot {
    /// An empty lot.
    pub(crate) const fn new() -> Self {
        ParkingLot {
            entries: Mutex::new(Vec::new()),
        }
    }

    /// Keeps `item` until `until` (`None`: until the process exits); frees nothing.
    pub(crate) fn park(&self, item: Box<dyn Send>, until: Option<Instant>) {
        self.lock().push(Entry { until, _item: item });
    }

    /// Frees the items whose deadline is at or before `now`; returns how many.
    pub(crate) fn free_expired_at(&self, now: Instant) -> usize {
        let expired = take_expired(&mut self.lock(), now);
        let n = expired.len();
        free(expired);
        n
    }

    /// Items parked now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        // A panic while the lock was held (in `Vec::push`, out of memory) leaves the
        // vector valid.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Moves the entries expired at `now` out of `entries`.
fn take_expired(entries: &mut Vec<Entry>, now: Instant) -> Vec<Entry> {
    let all = std::mem::take(entries).into_iter();
    let (expired, kept) = all.partition(|e| e.until.is_some_and(|t| t <= now));
    *entries = kept;
    expired
}

/// Drops each entry, catching a panic in its drop.
fn free(entries: Vec<Entry>) {
    for entry in entries {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(entry)));
    }
}

/// The process-wide lot the per-rank communicators park in.
static LOT: ParkingLot = ParkingLot::new();

/// Parks `item` in the process-wide lot until `until` (`None`: process exit).
pub(crate) fn park(item: Box<dyn Send>, until: Option<Instant>) {
    LOT.park(item, until);
}

/// How many teardowns the process-wide lot holds, and the latest deadline among them
/// (`None` when one is kept until exit, or nothing is parked). For leak checks: what a
/// drop parked is not a leak until its deadline has passed.
#[doc(hidden)]
#[cfg_attr(not(feature = "unstable"), allow(dead_code))]
pub fn parked_teardowns() -> (usize, Option<Instant>) {
    let entries = LOT.lock();
    let untils = entries.iter().map(|e| e.until).collect::<Option<Vec<_>>>();
    (entries.len(), untils.and_then(|u| u.into_iter().max()))
}

/// Frees the expired teardowns of the process-wide lot now; returns how many.
#[doc(hidden)]
pub fn free_expired_teardowns() -> usize {
    LOT.free_expired_at(Instant::now())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// Counts its drops.
    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Panics when dropped.
    struct Bomb;
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("a parked item's drop panicked");
        }
    }

    #[test]
    fn frees_entries_once_their_deadline_has_passed() {
        let lot = ParkingLot::new();
        let freed = Arc::new(AtomicUsize::new(0));
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let item = || Box::new(Counted(freed.clone())) as Box<dyn Send>;
        lot.park(item(), Some(t0 + 2 * s));
        lot.park(item(), Some(t0 + 5 * s));
        lot.park(item(), None);
        assert_eq!((lot.len(), freed.load(Ordering::SeqCst)), (3, 0));
        // Nothing has expired yet.
        assert_eq!(lot.free_expired_at(t0 + s), 0);
        assert_eq!(freed.load(Ordering::SeqCst), 0);
        // The first deadline passes; a deadline is inclusive.
        assert_eq!(lot.free_expired_at(t0 + 2 * s), 1);
        assert_eq!((lot.len(), freed.load(Ordering::SeqCst)), (2, 1));
        // Parking frees nothing, not even what has expired: a drop that parks must not
        // wait for a device to go idle.
        lot.park(item(), Some(t0 + 3 * s));
        assert_eq!((lot.len(), freed.load(Ordering::SeqCst)), (3, 1));
        // An entry without a deadline stays however late it is.
        assert_eq!(lot.free_expired_at(t0 + 1000 * s), 2);
        assert_eq!((lot.len(), freed.load(Ordering::SeqCst)), (1, 3));
        assert_eq!(lot.free_expired_at(t0 + 1_000_000 * s), 0);
    }

    #[test]
    fn a_panicking_drop_is_contained() {
        let lot = ParkingLot::new();
        let freed = Arc::new(AtomicUsize::new(0));
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        lot.park(Box::new(Bomb), Some(t1));
        lot.park(Box::new(Counted(freed.clone())), Some(t1));
        assert_eq!(lot.free_expired_at(t1), 2);
        assert_eq!((lot.len(), freed.load(Ordering::SeqCst)), (0, 1));
        // The lot still works after the panic.
        lot.park(Box::new(Counted(freed.clone())), Some(t1));
        assert_eq!(lot.free_expired_at(t1), 1);
        assert_eq!(freed.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn the_process_lot_frees_real_items_after_their_deadline() {
        let freed = Arc::new(AtomicUsize::new(0));
        park(
            Box::new(Counted(freed.clone())),
            Some(Instant::now() + Duration::from_millis(50)),
        );
        free_expired_teardowns();
        assert_eq!(freed.load(Ordering::SeqCst), 0);
        std::thread::sleep(Duration::from_millis(60));
        free_expired_teardowns();
        assert_eq!(freed.load(Ordering::SeqCst), 1);
    }
}
