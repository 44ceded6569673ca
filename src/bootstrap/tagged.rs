//! Tagged exchanges: every all-gather of a communicator carries the kind of call it
//! belongs to and a sequence number, and every rank checks every gathered record, so a
//! registration meeting a peer's teardown is [`BootstrapError::ExchangeMismatch`] on
//! every rank instead of one rank freeing memory the other's kernels still write.
//!
//! Header: [`MAGIC`], the kind byte, the sequence number (`u64` LE) of the all-gather. The
//! lock is held for the whole all-gather, so two threads of one rank number theirs in
//! order. The number moves on by one after a match or a store error (a late record of a
//! failed all-gather is a mismatch next time), and to the highest gathered plus one after
//! a mismatch (every rank saw the same records, so ranks stay in step).

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
fn tag(kind: ExchangeKind, sequence: u64, payload: &[u8]) -> Vec<u8> {
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

impl Bootstrap for Tagged {
    fn rank(&self) -> usize {
        self.shared.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.shared.inner.world_size()
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.gather(mine, None)
    }
    fn all_gather_within(&self, mine: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.gather(mine, Some(timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::tag as record;
    use super::*;
    use std::collections::VecDeque;
    use ExchangeKind::*;

    type Sent = Vec<(Vec<u8>, Option<Duration>)>;

    /// Rank `rank` of a scripted world: each all-gather returns the next scripted round
    /// with this rank's own record in its place, and records what was sent and the
    /// timeout given.
    struct Scripted {
        rank: usize,
        world: usize,
        rounds: Mutex<VecDeque<Result<Vec<Vec<u8>>>>>,
        sent: Mutex<Sent>,
    }

    impl Scripted {
        fn gather(&self, mine: &[u8], timeout: Option<Duration>) -> Result<Vec<Vec<u8>>> {
            self.sent.lock().unwrap().push((mine.to_vec(), timeout));
            let mut round = self.rounds.lock().unwrap().pop_front().expect("scripted")?;
            if self.rank < round.len() {
                round[self.rank] = mine.to_vec();
            }
            Ok(round)
        }
    }

    impl Bootstrap for Scripted {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            self.world
        }
        fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
            self.gather(mine, None)
        }
        fn all_gather_within(&self, mine: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
            self.gather(mine, Some(timeout))
        }
    }

    /// Exchanges over rank `rank` of a scripted world of `world`, and what it sent.
    fn scripted(
        rank: usize,
        world: usize,
        rounds: Vec<Result<Vec<Vec<u8>>>>,
    ) -> (Exchanges, impl Fn() -> Sent) {
        let store = Arc::new(Scripted {
            rank,
            world,
            rounds: Mutex::new(rounds.into()),
            sent: Mutex::default(),
        });
        (Exchanges::new(store.clone()), move || {
            store.sent.lock().unwrap().clone()
        })
    }

    #[test]
    fn matching_records_come_back_without_headers_and_number_the_gathers() {
        let (ex, sent) = scripted(
            1,
            3,
            vec![
                Ok(vec![
                    record(Register, 0, b"zero"),
                    vec![],
                    record(Register, 0, b""),
                ]),
                Ok(vec![
                    record(Teardown, 1, b""),
                    vec![],
                    record(Teardown, 1, b"x"),
                ]),
            ],
        );
        let got = ex.of(Register).all_gather(b"one").unwrap();
        assert_eq!(got, vec![b"zero".to_vec(), b"one".to_vec(), vec![]]);
        let quarter = Duration::from_millis(250);
        ex.of(Teardown).barrier_within(quarter).unwrap();
        // The teardown's bounded barrier is a bounded all-gather of a header.
        let bounded = (record(Teardown, 1, b""), Some(quarter));
        assert_eq!(sent(), vec![(record(Register, 0, b"one"), None), bounded]);
    }

    /// A record of another kind, without a header (empty, short, another magic byte) or
    /// of an unknown kind is a mismatch naming the first rank that differs, this rank's
    /// call and what that rank sent.
    #[test]
    fn other_kinds_garbage_and_short_records_are_mismatches() {
        let mut wrong_magic = record(Symmetric, 0, b"");
        wrong_magic[0] ^= 0xff;
        let mut unknown = record(Symmetric, 0, b"");
        unknown[1] = 200;
        let short = vec![MAGIC, Symmetric as u8, 0, 0, 0];
        for (theirs, says) in [
            (
                record(Teardown, 0, b""),
                "a teardown (its Comm dropped or closed) (all-gather #0)",
            ),
            (Vec::new(), "without an exchange header (0 bytes"),
            (short, "without an exchange header (5 bytes"),
            (wrong_magic, "without an exchange header (10 bytes"),
            (unknown, "unknown kind 200"),
        ] {
            let round = vec![vec![], theirs.clone(), b"junk".to_vec()];
            let (ex, _) = scripted(0, 3, vec![Ok(round)]);
            match ex.of(Symmetric).all_gather(b"") {
                Err(BootstrapError::ExchangeMismatch {
                    rank: 1,
                    expected,
                    got,
                }) => {
                    assert!(expected.contains("alloc_symmetric") && expected.contains("#0"));
                    assert!(got.contains(says), "{theirs:?}: {got}")
                }
                other => panic!("{theirs:?}: {other:?}"),
            }
        }
    }

    /// A record of the same kind out of step is a mismatch too; afterwards every rank
    /// continues from the highest number gathered, plus one.
    #[test]
    fn another_sequence_is_a_mismatch_and_the_ranks_continue_from_the_highest() {
        let (ex, sent) = scripted(
            0,
            3,
            vec![
                Ok(vec![vec![], record(Trim, 0, b""), record(Trim, 4, b"")]),
                Ok(vec![vec![], record(Trim, 5, b"a"), record(Trim, 5, b"b")]),
            ],
        );
        match ex.of(Trim).all_gather(b"") {
            Err(BootstrapError::ExchangeMismatch { rank: 2, got, .. }) => {
                assert!(got.contains("#4"), "{got}")
            }
            other => panic!("{other:?}"),
        }
        let got = ex.of(Trim).all_gather(b"c").unwrap();
        assert_eq!(got, vec![b"c".to_vec(), b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(sent()[1].0, record(Trim, 5, b"c"));
    }

    /// The store's error comes back as it is, and uses up a number; a store that
    /// returns records for another world size is a protocol error.
    #[test]
    fn store_errors_use_up_a_number_and_wrong_counts_are_refused() {
        let failed = BootstrapError::Store {
            message: "down".into(),
        };
        let (ex, _) = scripted(
            0,
            2,
            vec![
                Err(failed.clone()),
                Ok(vec![vec![], record(Reinitialize, 1, b"")]),
                Ok(vec![vec![]]),
            ],
        );
        assert_eq!(ex.of(Reinitialize).barrier(), Err(failed));
        ex.of(Reinitialize).barrier().unwrap();
        let wrong_count = ex.of(Reinitialize).barrier();
        assert!(matches!(wrong_count, Err(BootstrapError::Protocol { .. })));
    }

    /// Over the built-in bootstrap: rank 0 tears down while rank 1 registers; both get
    /// the mismatch naming the other, and then make matching exchanges again.
    #[test]
    fn over_tcp_both_ranks_see_the_mismatch_and_stay_in_step() {
        use super::super::{TcpBootstrap, UniqueId};
        let id = UniqueId::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let got: Vec<_> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..2)
                .map(|r| {
                    let id = &id;
                    s.spawn(move || {
                        let tcp = TcpBootstrap::connect(id, r, 2, Duration::from_secs(10));
                        let ex = Exchanges::new(Arc::new(tcp.unwrap()));
                        let kind = if r == 0 { Teardown } else { Register };
                        let first = ex.of(kind).all_gather_within(b"", Duration::from_secs(5));
                        (first, ex.of(Setup).all_gather(&[r as u8]))
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        for (r, (first, then)) in got.into_iter().enumerate() {
            match first {
                Err(BootstrapError::ExchangeMismatch { rank, .. }) => assert_eq!(rank, 1 - r),
                other => panic!("rank {r}: {other:?}"),
            }
            assert_eq!(then.unwrap(), vec![vec![0], vec![1]]);
        }
    }
}
