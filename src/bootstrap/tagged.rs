//! Tagged exchanges: every all-gather of a communicator carries its kind of call and a
//! sequence number, checked on every rank, so a registration meeting a peer's teardown is
//! [`BootstrapError::ExchangeMismatch`] everywhere instead of freed memory still written.
//!
//! Header: [`MAGIC`], the kind byte, the sequence number (`u64` LE). The lock is held for
//! the whole all-gather, so a rank's threads number theirs in order. The number moves on by
//! one after a match or a store error (a late record of a failed all-gather mismatches next
//! time), and past the highest gathered after a mismatch (every rank saw the same records).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::error::{BootstrapError, Result};
use super::Bootstrap;

/// First byte of every tagged record.
pub(crate) const MAGIC: u8 = 0xC7;
/// Magic, kind, sequence number.
pub(crate) const HEADER_BYTES: usize = 1 + 1 + 8;

/// Declares [`ExchangeKind`]: variant, byte and how an error message names the call.
macro_rules! exchange_kinds {
    ($($(#[$doc:meta])* $kind:ident = $byte:literal, $what:literal;)*) => {
        /// Which collective call an all-gather belongs to.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(u8)]
        pub(crate) enum ExchangeKind {
            $($(#[$doc])* $kind = $byte,)*
        }

        impl ExchangeKind {
            fn from_byte(b: u8) -> Option<Self> {
                match b {
                    $($byte => Some(ExchangeKind::$kind),)*
                    _ => None,
                }
            }

            /// The call, as the error message names it.
            fn describe(self) -> &'static str {
                match self {
                    $(ExchangeKind::$kind => $what,)*
                }
            }
        }
    };
}

exchange_kinds! {
    /// Building the communicator (configuration, peer records, handles, checks).
    Setup = 1, "the communicator's setup";
    /// `Comm::register`.
    Register = 2, "a registration (register)";
    /// `Comm::alloc_symmetric` (its placement, and the registration of a new segment).
    Symmetric = 3, "a symmetric allocation (alloc_symmetric)";
    /// `Comm::trim_symmetric`.
    Trim = 4, "a trim of the symmetric pool (trim_symmetric)";
    /// `Comm::register_inputs_of` (and `Comm::capture_registered`).
    Capture = 5, "a registered capture (register_inputs_of)";
    /// `Comm::reinitialize`.
    Reinitialize = 6, "a re-initialisation (reinitialize)";
    /// Dropping (or closing) the communicator.
    Teardown = 7, "a teardown (its Comm dropped or closed)";
    /// The external library's exchanges (its id at setup; the host stand-in's
    /// all-reduces).
    External = 8, "an exchange of the external library";
    /// `Comm::device_comm`.
    DeviceComm = 9, "a device communicator (device_comm)";
}

/// One communicator's all-gathers (see the module docs): the bootstrap, reachable only
/// through [`Exchanges::of`], so that every all-gather is tagged.
pub(crate) struct Exchanges {
    shared: Arc<Shared>,
}

struct Shared {
    inner: Arc<dyn Bootstrap>,
    /// The next all-gather's sequence number; held for the whole all-gather.
    next: Mutex<u64>,
}

impl Exchanges {
    /// Tags the all-gathers made over `inner` from now on; the first is number 0.
    pub(crate) fn new(inner: Arc<dyn Bootstrap>) -> Self {
        let next = Mutex::new(0);
        Exchanges {
            shared: Arc::new(Shared { inner, next }),
        }
    }

    /// The bootstrap for the all-gathers of one kind of call.
    pub(crate) fn of(&self, kind: ExchangeKind) -> Tagged {
        let shared = self.shared.clone();
        Tagged { shared, kind }
    }
}

/// A [`Bootstrap`] whose every all-gather is tagged with one kind (see the module
/// docs); the caller's bytes come back without the headers.
#[derive(Clone)]
pub(crate) struct Tagged {
    shared: Arc<Shared>,
    kind: ExchangeKind,
}

impl Tagged {
    fn gather(&self, mine: &[u8], timeout: Option<Duration>) -> Result<Vec<Vec<u8>>> {
        let inner = &*self.shared.inner;
        let mut next = self.shared.next.lock().unwrap_or_else(|e| e.into_inner());
        let sequence = *next;
        *next = sequence.wrapping_add(1);
        let record = tag(self.kind, sequence, mine);
        let gathered = match timeout {
            Some(t) => inner.all_gather_within(&record, t)?,
            None => inner.all_gather(&record)?,
        };
        if gathered.len() != inner.world_size() {
            let (got, world) = (gathered.len(), inner.world_size());
            return Err(BootstrapError::Protocol {
                detail: format!(
                    "an all-gather returned {got} records for a world of {world} ranks"
                ),
            });
        }
        let headers: Vec<Option<(u8, u64)>> = gathered.iter().map(|g| header_of(g)).collect();
        let mine = Some((self.kind as u8, sequence));
        if let Some(r) = headers.iter().position(|h| *h != mine) {
            let highest = headers.iter().flatten().map(|&(_, s)| s).max();
            *next = highest.unwrap_or(sequence).max(sequence).wrapping_add(1);
            return Err(BootstrapError::ExchangeMismatch {
                rank: r,
                expected: format!("{} (all-gather #{sequence})", self.kind.describe()),
                got: describe_record(&gathered[r]),
            });
        }
        let strip = |g: Vec<u8>| g[HEADER_BYTES..].to_vec();
        Ok(gathered.into_iter().map(strip).collect())
    }
}

/// `payload` behind the header of the all-gather numbered `sequence` of `kind`.
pub(super) fn tag(kind: ExchangeKind, sequence: u64, payload: &[u8]) -> Vec<u8> {
    let mut record = Vec::with_capacity(HEADER_BYTES + payload.len());
    record.extend_from_slice(&[MAGIC, kind as u8]);
    record.extend_from_slice(&sequence.to_le_bytes());
    record.extend_from_slice(payload);
    record
}

/// The kind byte and sequence number of a record, if it has a tagged header.
fn header_of(record: &[u8]) -> Option<(u8, u64)> {
    match record {
        [MAGIC, kind, rest @ ..] => {
            Some((*kind, u64::from_le_bytes(rest.get(..8)?.try_into().ok()?)))
        }
        _ => None,
    }
}

/// What a record is, for [`BootstrapError::ExchangeMismatch`].
fn describe_record(record: &[u8]) -> String {
    match header_of(record) {
        Some((kind, sequence)) => match ExchangeKind::from_byte(kind) {
            Some(k) => format!("{} (all-gather #{sequence})", k.describe()),
            None => format!("an exchange of unknown kind {kind} (all-gather #{sequence})"),
        },
        None => format!(
            "a record without an exchange header ({} bytes: another peercomm version, or \
             another user of the bootstrap)",
            record.len()
        ),
    }
}

bootstrap_via_gather!(
    Tagged,
    |self| self.shared.inner.rank(),
    self.shared.inner.world_size()
);
