//! Waiting in the host kernels: why a wait stopped, and the spinner every wait goes
//! through (yields, polls the rank's abort word, gives up at the deadline).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::protocol::Backoff;
use crate::signal::CALL_WORDS;

/// Why a wait stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// This block waited longer than the timeout for group rank `awaited`.
    TimedOut { awaited: usize },
    /// The rank's abort word is set (a peer gave up, or another block of this rank).
    Aborted,
    /// Group rank `peer` runs another call: the record shows `mine` and `theirs`.
    Mismatch {
        peer: usize,
        mine: [u32; CALL_WORDS],
        theirs: [u32; CALL_WORDS],
    },
}

/// How a kernel's block ended: at its end, or stopped.
pub(crate) type Flow = Result<(), Stop>;

/// Why a spin stopped: what [`Stop`] becomes once the awaited rank is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Spun {
    TimedOut,
    Aborted,
}

impl Spun {
    pub(super) fn waiting_for(self, awaited: usize) -> Stop {
        match self {
            Spun::TimedOut => Stop::TimedOut { awaited },
            Spun::Aborted => Stop::Aborted,
        }
    }
}

/// A spin that yields (CI has 2 cores and many block threads), polls the rank's abort
/// word and gives up after the configured time.
pub(super) struct Spinner<'a> {
    deadline: Option<Instant>,
    spins: u32,
    abort_word: &'a AtomicU32,
}

impl<'a> Spinner<'a> {
    pub(super) fn new(timeout_ns: u64, abort_word: &'a AtomicU32) -> Self {
        Spinner {
            deadline: deadline(timeout_ns),
            spins: 0,
            abort_word,
        }
    }
    pub(super) fn wait(&mut self) -> Result<(), Spun> {
        self.spins = self.spins.wrapping_add(1);
        if self.spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
        if self.spins.is_multiple_of(64) {
            if self.abort_word.load(Ordering::Relaxed) != 0 {
                return Err(Spun::Aborted);
            }
            if matches!(self.deadline, Some(d) if Instant::now() > d) {
                return Err(Spun::TimedOut);
            }
        }
        Ok(())
    }
}

/// `now + timeout_ns`, or `None` (never) for 0 or a time past what `Instant` holds.
pub(super) fn deadline(timeout_ns: u64) -> Option<Instant> {
    if timeout_ns == 0 {
        return None;
    }
    Instant::now().checked_add(Duration::from_nanos(timeout_ns))
}

impl Backoff for Spinner<'_> {
    type Timeout = Spun;
    fn wait(&mut self) -> Result<(), Spun> {
        Spinner::wait(self)
    }
}
