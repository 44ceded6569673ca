//! Tagged exchanges: each all-gather a communicator makes carries the kind of call it
//! belongs to and a sequence number, and every rank checks every gathered record.
//!
//! Without the tag, a rank registering a buffer while its peer drops its communicator
//! would pair its record with the peer's teardown record, and the teardown would free
//! memory the other rank's kernels still write. With it, every rank gets
//! [`BootstrapError::ExchangeMismatch`] naming the first rank that differs.
//!
//! Header: [`MAGIC`], the kind byte, the sequence number (`u64` LE), numbering the
//! all-gathers (not the calls) 0, 1, 2, ...; the lock is held for the whole all-gather so
//! two threads of one rank number theirs in order. After a match the sequence moves on
//! by one; after a mismatch to the highest gathered plus one (every rank saw the same
//! records, so ranks stay in step); after a store error by one, so a late record of that
//! all-gather is a mismatch next time rather than taken for it.

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
        Exchanges {
            shared: Arc::new(Shared {
                inner,
                next: Mutex::new(0),
            }),
        }
    }

    /// The bootstrap for the all-gathers of one kind of call.
    pub(crate) fn of(&self, kind: ExchangeKind) -> Tagged {
        Tagged {
            shared: self.shared.clone(),
            kind,
        }
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
        let mut record = Vec::with_capacity(HEADER_BYTES + mine.len());
        record.push(MAGIC);
        record.push(self.kind as u8);
        record.extend_from_slice(&sequence.to_le_bytes());
        record.extend_from_slice(mine);
        let gathered = match timeout {
            Some(t) => inner.all_gather_within(&record, t)?,
            None => inner.all_gather(&record)?,
        };
        if gathered.len() != inner.world_size() {
            return Err(BootstrapError::Protocol {
                detail: format!(
                    "an all-gather returned {} records for a world of {} ranks",
                    gathered.len(),
                    inner.world_size()
                ),
            });
        }
        let headers: Vec<Option<(u8, u64)>> = gathered.iter().map(|g| header_of(g)).collect();
        if let Some(r) = headers
            .iter()
            .position(|h| *h != Some((self.kind as u8, sequence)))
        {
            // Every rank has the same records, so every rank continues from the same
            // number.
            let highest = headers.iter().flatten().map(|&(_, s)| s).max();
            *next = highest.unwrap_or(sequence).max(sequence).wrapping_add(1);
            return Err(BootstrapError::ExchangeMismatch {
                rank: r,
                expected: format!("{} (all-gather #{sequence})", self.kind.describe()),
                got: describe_record(&gathered[r]),
            });
        }
        Ok(gathered
            .into_iter()
            .map(|mut g| {
                g.drain(..HEADER_BYTES);
                g
            })
            .collect())
    }
}

/// The kind byte and sequence number of a record, if it has a tagged header.
fn header_of(record: &[u8]) -> Option<(u8, u64)> {
    match record {
        [MAGIC, kind, rest @ ..] if rest.len() >= 8 => Some((
            *kind,
            u64::from_le_bytes(rest[..8].try_into().expect("8 bytes")),
        )),
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
    use super::*;
    use std::collections::VecDeque;

    /// Rank `rank` of a scripted world: each all-gather returns the next scripted round
    /// with this rank's own record put in its place, and remembers what was sent and
    /// the timeout it was given.
    struct Scripted {
        rank: usize,
        world: usize,
        rounds: Mutex<VecDeque<Result<Vec<Vec<u8>>>>>,
        sent: Mutex<Vec<(Vec<u8>, Option<Duration>)>>,
    }

    impl Scripted {
        fn new(rank: usize, world: usize, rounds: Vec<Result<Vec<Vec<u8>>>>) -> Arc<Self> {
            Arc::new(Scripted {
                rank,
                world,
                rounds: Mutex::new(rounds.into()),
                sent: Mutex::new(Vec::new()),
            })
        }
        fn gather(&self, mine: &[u8], timeout: Option<Duration>) -> Result<Vec<Vec<u8>>> {
            self.sent.lock().unwrap().push((mine.to_vec(), timeout));
            let mut round = self.rounds.lock().unwrap().pop_front().expect("scripted")?;
            if self.rank < round.len() {
                round[self.rank] = mine.to_vec();
            }
            Ok(round)
        }
        fn sent(&self) -> Vec<(Vec<u8>, Option<Duration>)> {
            self.sent.lock().unwrap().clone()
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

    fn record(kind: ExchangeKind, sequence: u64, payload: &[u8]) -> Vec<u8> {
        let mut r = vec![MAGIC, kind as u8];
        r.extend_from_slice(&sequence.to_le_bytes());
        r.extend_from_slice(payload);
        r
    }

    fn exchanges(store: &Arc<Scripted>) -> Exchanges {
        Exchanges::new(store.clone())
    }

    use ExchangeKind::*;

    #[test]
    fn matching_records_come_back_without_headers_and_number_the_gathers() {
        let store = Scripted::new(
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
        let ex = exchanges(&store);
        assert_eq!(
            ex.of(Register).all_gather(b"one").unwrap(),
            vec![b"zero".to_vec(), b"one".to_vec(), vec![]]
        );
        ex.of(Teardown)
            .barrier_within(Duration::from_millis(250))
            .unwrap();
        let sent = store.sent();
        assert_eq!(sent[0], (record(Register, 0, b"one"), None));
        // The teardown's bounded barrier is a bounded all-gather of a header.
        assert_eq!(
            sent[1],
            (record(Teardown, 1, b""), Some(Duration::from_millis(250)))
        );
    }

    /// Rank 0 tears down where rank 1 (this rank) registers: the mismatch names rank 0
    /// and both kinds.
    #[test]
    fn another_kind_is_a_mismatch_naming_the_rank_and_both_kinds() {
        let store = Scripted::new(1, 2, vec![Ok(vec![record(Teardown, 0, b""), vec![]])]);
        match exchanges(&store).of(Register).all_gather(b"offer") {
            Err(BootstrapError::ExchangeMismatch {
                rank: 0,
                expected,
                got,
            }) => {
                assert!(
                    expected.contains("register") && expected.contains("#0"),
                    "{expected}"
                );
                assert!(got.contains("teardown") && got.contains("#0"), "{got}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// A record of the same kind out of step is a mismatch too; afterwards every rank
    /// continues from the highest number gathered, plus one.
    #[test]
    fn another_sequence_is_a_mismatch_and_the_ranks_continue_from_the_highest() {
        let store = Scripted::new(
            0,
            3,
            vec![
                Ok(vec![vec![], record(Trim, 0, b""), record(Trim, 4, b"")]),
                Ok(vec![vec![], record(Trim, 5, b"a"), record(Trim, 5, b"b")]),
            ],
        );
        let ex = exchanges(&store);
        match ex.of(Trim).all_gather(b"") {
            Err(BootstrapError::ExchangeMismatch { rank: 2, got, .. }) => {
                assert!(got.contains("#4"), "{got}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            ex.of(Trim).all_gather(b"c").unwrap(),
            vec![b"c".to_vec(), b"a".to_vec(), b"b".to_vec()]
        );
        assert_eq!(store.sent()[1].0, record(Trim, 5, b"c"));
    }

    /// Records without a header (empty, short, another magic byte) and headers of an
    /// unknown kind are mismatches, named as such; the first rank that differs is named.
    #[test]
    fn garbage_and_short_records_are_mismatches() {
        let mut wrong_magic = record(Symmetric, 0, b"");
        wrong_magic[0] ^= 0xff;
        let mut unknown = record(Symmetric, 0, b"");
        unknown[1] = 200;
        for (theirs, says) in [
            (Vec::new(), "without an exchange header (0 bytes"),
            (
                vec![MAGIC, Symmetric as u8, 0, 0, 0],
                "without an exchange header (5 bytes",
            ),
            (wrong_magic, "without an exchange header (10 bytes"),
            (unknown, "unknown kind 200"),
        ] {
            let store = Scripted::new(
                0,
                3,
                vec![Ok(vec![vec![], theirs.clone(), b"junk".to_vec()])],
            );
            match exchanges(&store).of(Symmetric).all_gather(b"") {
                Err(BootstrapError::ExchangeMismatch { rank: 1, got, .. }) => {
                    assert!(got.contains(says), "{theirs:?}: {got}")
                }
                other => panic!("{theirs:?}: {other:?}"),
            }
        }
    }

    /// The store's error comes back as it is, and uses up a number; a store that
    /// returns records for another world size is a protocol error.
    #[test]
    fn store_errors_use_up_a_number_and_wrong_counts_are_refused() {
        let failed = BootstrapError::Store {
            message: "down".into(),
        };
        let store = Scripted::new(
            0,
            2,
            vec![
                Err(failed.clone()),
                Ok(vec![vec![], record(Reinitialize, 1, b"")]),
                Ok(vec![vec![]]),
            ],
        );
        let ex = exchanges(&store);
        assert_eq!(ex.of(Reinitialize).barrier(), Err(failed));
        ex.of(Reinitialize).barrier().unwrap();
        assert!(matches!(
            ex.of(Reinitialize).barrier(),
            Err(BootstrapError::Protocol { .. })
        ));
    }

    /// Over the built-in bootstrap: rank 0 tears down while rank 1 registers; both get
    /// the mismatch naming the other, and then make matching exchanges again.
    #[test]
    fn over_tcp_both_ranks_see_the_mismatch_and_stay_in_step() {
        let id = super::super::UniqueId::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let got: Vec<_> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..2)
                .map(|r| {
                    let id = &id;
                    s.spawn(move || {
                        let tcp =
                            super::super::TcpBootstrap::connect(id, r, 2, Duration::from_secs(10))
                                .unwrap();
                        let ex = Exchanges::new(Arc::new(tcp));
                        let kind = if r == 0 { Teardown } else { Register };
                        let first = ex.of(kind).all_gather_within(b"", Duration::from_secs(5));
                        let then = ex.of(Setup).all_gather(&[r as u8]);
                        (first, then)
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
