//! Tagged exchanges over a scripted store (each all-gather returns the next scripted
//! round) and over TCP.

use super::*;
use crate::bootstrap::tagged::{tag as rec, ExchangeKind::*, MAGIC};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

type Sent = Vec<(Vec<u8>, Option<Duration>)>;

/// Rank `rank` of a scripted world: each all-gather returns the next scripted round with
/// this rank's own record in its place, and records what was sent and the timeout given.
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

bootstrap_via_gather!(Scripted, |self| self.rank, self.world);

/// Exchanges over rank `rank` of a scripted world of `world`, and what it sent.
fn scripted(
    rank: usize,
    world: usize,
    rounds: Vec<Result<Vec<Vec<u8>>>>,
) -> (Exchanges, impl Fn() -> Sent) {
    let rounds = Mutex::new(rounds.into());
    let store = Arc::new(Scripted {
        rank,
        world,
        rounds,
        sent: Mutex::default(),
    });
    (Exchanges::new(store.clone()), move || {
        store.sent.lock().unwrap().clone()
    })
}

#[test]
fn matching_records_come_back_without_headers_and_number_the_gathers() {
    let register = vec![rec(Register, 0, b"zero"), vec![], rec(Register, 0, b"")];
    let teardown = vec![rec(Teardown, 1, b""), vec![], rec(Teardown, 1, b"x")];
    let (ex, sent) = scripted(1, 3, vec![Ok(register), Ok(teardown)]);
    let got = ex.of(Register).all_gather(b"one").unwrap();
    assert_eq!(got, vec![b"zero".to_vec(), b"one".to_vec(), vec![]]);
    let quarter = Duration::from_millis(250);
    ex.of(Teardown).barrier_within(quarter).unwrap();
    // The teardown's bounded barrier is a bounded all-gather of a header.
    let bounded = (rec(Teardown, 1, b""), Some(quarter));
    assert_eq!(sent(), vec![(rec(Register, 0, b"one"), None), bounded]);
}

/// A record of another kind, without a header (empty, short, another magic byte) or of an
/// unknown kind is a mismatch naming the first rank that differs, this rank's call and
/// what that rank sent.
#[test]
fn other_kinds_garbage_and_short_records_are_mismatches() {
    let mut wrong_magic = rec(Symmetric, 0, b"");
    wrong_magic[0] ^= 0xff;
    let mut unknown = rec(Symmetric, 0, b"");
    unknown[1] = 200;
    let short = vec![MAGIC, Symmetric as u8, 0, 0, 0];
    let teardown = "a teardown (its Comm dropped or closed) (all-gather #0)";
    for (theirs, says) in [
        (rec(Teardown, 0, b""), teardown),
        (Vec::new(), "without an exchange header (0 bytes"),
        (short, "without an exchange header (5 bytes"),
        (wrong_magic, "without an exchange header (10 bytes"),
        (unknown, "unknown kind 200"),
    ] {
        let round = vec![vec![], theirs.clone(), b"junk".to_vec()];
        let (ex, _) = scripted(0, 3, vec![Ok(round)]);
        let ours = |e: &str| e.contains("alloc_symmetric") && e.contains("#0");
        assert_is!((&theirs, ex.of(Symmetric).all_gather(b"")),
            (_, Err(BootstrapError::ExchangeMismatch { rank: 1, expected, got }))
                if ours(expected) && got.contains(says));
    }
}

/// A record of the same kind out of step is a mismatch too; afterwards every rank
/// continues from the highest number gathered, plus one.
#[test]
fn another_sequence_is_a_mismatch_and_the_ranks_continue_from_the_highest() {
    let first = vec![vec![], rec(Trim, 0, b""), rec(Trim, 4, b"")];
    let second = vec![vec![], rec(Trim, 5, b"a"), rec(Trim, 5, b"b")];
    let (ex, sent) = scripted(0, 3, vec![Ok(first), Ok(second)]);
    let e = ex.of(Trim).all_gather(b"");
    assert_is!(e, Err(BootstrapError::ExchangeMismatch { rank: 2, got, .. }) if got.contains("#4"));
    let got = ex.of(Trim).all_gather(b"c").unwrap();
    assert_eq!(got, vec![b"c".to_vec(), b"a".to_vec(), b"b".to_vec()]);
    assert_eq!(sent()[1].0, rec(Trim, 5, b"c"));
}

/// The store's error comes back as it is, and uses up a number; a store that returns
/// records for another world size is a protocol error.
#[test]
fn store_errors_use_up_a_number_and_wrong_counts_are_refused() {
    let message = "down".into();
    let failed = BootstrapError::Store { message };
    let rounds = vec![
        Err(failed.clone()),
        Ok(vec![vec![], rec(Reinitialize, 1, b"")]),
        Ok(vec![vec![]]),
    ];
    let (ex, _) = scripted(0, 2, rounds);
    assert_eq!(ex.of(Reinitialize).barrier(), Err(failed));
    ex.of(Reinitialize).barrier().unwrap();
    assert_is!(ex.of(Reinitialize).barrier() => Err(BootstrapError::Protocol { .. }));
}

/// Over the built-in bootstrap: rank 0 tears down while rank 1 registers; both get the
/// mismatch naming the other, and then make matching exchanges again.
#[test]
fn over_tcp_both_ranks_see_the_mismatch_and_stay_in_step() {
    let id = loopback_id();
    let got = run(&[0, 1], |r| {
        let ex = Exchanges::new(Arc::new(connect(&id, r, 2, LONG).unwrap()));
        let kind = if r == 0 { Teardown } else { Register };
        let first = ex.of(kind).all_gather_within(b"", Duration::from_secs(5));
        (first, ex.of(Setup).all_gather(&[r as u8]))
    });
    for (r, (first, then)) in got.into_iter().enumerate() {
        assert_is!(first, Err(BootstrapError::ExchangeMismatch { rank, .. }) if *rank == 1 - r);
        assert_eq!(then.unwrap(), vec![vec![0], vec![1]]);
    }
}
