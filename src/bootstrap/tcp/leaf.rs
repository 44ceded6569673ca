//! Rank r's side of the handshake (r > 0): connecting with retries, checking rank 0's
//! challenge before proving the secret, and the welcome.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::bootstrap::error::{io_error, BootstrapError, Result};
use crate::bootstrap::host::HostId;
use crate::bootstrap::id::UniqueId;
use crate::bootstrap::mac::{check_challenge, nonce};
use crate::bootstrap::wire::{
    deadline_after, decode_error, decode_welcome, encode_hello, encode_proof, is_closed,
    is_resource_exhausted, read_frame, recv_error, write_full, RecvError, RAISE_TIMEOUT,
};
use crate::bootstrap::{BOOTSTRAP_ADDR_ENV, KIND_CHALLENGE, KIND_ERROR, KIND_WELCOME, MIN_WAIT};

/// How far a rank r > 0 got before its deadline passed.
#[derive(Clone, Copy)]
enum Reached {
    /// No connection to rank 0's address (refused, or no answer to the connect).
    Nothing,
    /// Connected, but no challenge came.
    Listener,
    /// Proved the secret to rank 0, but no welcome came.
    RankZero,
}

/// Why a rank r > 0 failed to reach rank 0 by its deadline, with what it saw on the way.
/// Every function it names is one the caller has.
fn leaf_timeout_hint(addr: SocketAddr, refused: usize, dropped: usize, reached: Reached) -> String {
    let mut hint = match reached {
        Reached::RankZero => format!(
            "rank 0 has not admitted every rank yet: some rank never came (rank 0's own \
             error names it); {RAISE_TIMEOUT} if ranks start far apart"
        ),
        Reached::Listener => format!(
            "a process accepted the connection at {addr} but never answered as rank 0: the \
             process that made the UniqueId (UniqueId::new) holds its listener until rank 0 \
             joins in that same process, so where rank 0 runs in another process (a \
             launcher made the id), the maker must call UniqueId::release before rank 0 \
             calls Comm::from_rank (or TcpBootstrap::connect); else rank 0 has not reached \
             Comm::from_rank yet: {RAISE_TIMEOUT}"
        ),
        Reached::Nothing if refused > 0 => format!(
            "the connection was refused {refused} time(s), nothing listens there: the \
             UniqueId is stale (its communicator already formed or ended; make a new one \
             per communicator) or rank 0 never called Comm::from_rank (or \
             TcpBootstrap::connect) with it"
        ),
        Reached::Nothing => format!(
            "rank 0 could not be reached: check the address, routes and firewalls, that \
             rank 0 calls Comm::from_rank (or TcpBootstrap::connect) with this UniqueId, or \
             {RAISE_TIMEOUT}"
        ),
    };
    if dropped > 0 {
        hint.push_str(&format!(
            "; rank 0's port closed this rank's connection {dropped} time(s) before \
             welcoming it (rank 0 was flooded with connections, restarted, or failed: its \
             own error says why; or it runs an older peercomm)"
        ));
    }
    if addr.ip().is_loopback() {
        hint.push_str(&format!(
            "; the id names a loopback address, which only serves ranks on rank 0's host: \
             for other hosts set {BOOTSTRAP_ADDR_ENV} on rank 0"
        ));
    }
    hint
}

/// Rank r's whole handshake by one deadline `timeout` from now; reconnects when rank 0's
/// port closes before the welcome, refuses a listener that cannot prove the secret.
pub(super) fn leaf_handshake(
    id: &UniqueId,
    rank: usize,
    world: usize,
    host: &HostId,
    timeout: Duration,
) -> Result<(TcpStream, Vec<HostId>)> {
    let deadline = deadline_after(timeout);
    let mut attempt = Attempt {
        id,
        deadline,
        timeout,
        dropped: 0,
    };
    let mut backoff = Duration::from_millis(5);
    loop {
        let mut s = attempt.connect()?;
        let _ = s.set_nodelay(true);
        if let Some(hosts) = attempt.run(&mut s, rank, world, host)? {
            return Ok((s, hosts));
        }
        attempt.dropped += 1;
        drop(s);
        backoff = back_off(backoff, deadline);
    }
}

/// Sleeps `backoff` (at most until `deadline`); returns the next, doubled up to 100 ms.
fn back_off(backoff: Duration, deadline: Instant) -> Duration {
    std::thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
    (backoff * 2).min(Duration::from_millis(100))
}

/// Rank r's handshake, one connection at a time.
struct Attempt<'a> {
    id: &'a UniqueId,
    deadline: Instant,
    timeout: Duration,
    /// Earlier connections closed before the welcome.
    dropped: usize,
}

impl Attempt<'_> {
    const STEP: &'static str = "the handshake with rank 0";

    /// Connects to rank 0 by the deadline, retrying refusals with backoff (rank 0 may not
    /// listen yet when it runs in a process that did not make the id).
    fn connect(&self) -> Result<TcpStream> {
        use io::ErrorKind::*;
        let addr = self.id.addr;
        let step = format!("connecting to rank 0 at {addr}");
        let mut refused = 0usize;
        let mut backoff = Duration::from_millis(5);
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(BootstrapError::Timeout {
                    step,
                    waiting_for: vec![0],
                    after: self.timeout,
                    hint: leaf_timeout_hint(addr, refused, self.dropped, Reached::Nothing),
                });
            }
            match TcpStream::connect_timeout(&addr, left.max(MIN_WAIT)) {
                Ok(s) => return Ok(s),
                Err(e) if e.kind() == ConnectionRefused => refused += 1,
                Err(e) if matches!(e.kind(), ConnectionReset | ConnectionAborted) => {}
                Err(e) if matches!(e.kind(), TimedOut | WouldBlock | Interrupted) => {}
                Err(e) if is_resource_exhausted(&e) => {}
                Err(e) => return Err(io_error(step, e)),
            }
            backoff = back_off(backoff, self.deadline);
        }
    }

    /// The welcome's hosts, `None` when the connection closed before the welcome (try
    /// again), or the error that ends the handshake.
    fn run(
        &self,
        s: &mut TcpStream,
        rank: usize,
        world: usize,
        host: &HostId,
    ) -> Result<Option<Vec<HostId>>> {
        let leaf_nonce = nonce()?;
        if !self.send(s, &encode_hello(&leaf_nonce), false)? {
            return Ok(None);
        }
        let Some((kind, body)) = self.receive(s, false)? else {
            return Ok(None);
        };
        let keys = match kind {
            KIND_CHALLENGE => {
                check_challenge(&body, &self.id.secret, &leaf_nonce).map_err(Into::into)
            }
            KIND_ERROR => Err(format!(
                "it sent an error frame instead of a challenge: {}",
                decode_error(0, &body)
            )),
            k => Err(format!(
                "it sent a frame of kind {k} where rank 0's challenge belongs"
            )),
        };
        let keys = keys.map_err(|detail| self.unverified(detail))?;
        if !self.send(s, &encode_proof(&keys, rank, world, host), true)? {
            return Ok(None);
        }
        let Some((kind, body)) = self.receive(s, true)? else {
            return Ok(None);
        };
        match kind {
            KIND_WELCOME => Ok(Some(decode_welcome(&body, world, &keys)?)),
            KIND_ERROR => Err(decode_error(0, &body)),
            k => Err(BootstrapError::Protocol {
                detail: format!("rank 0 sent a frame of kind {k} where a welcome belongs"),
            }),
        }
    }

    /// Writes `frame`; `false` when the connection was closed.
    fn send(&self, s: &mut TcpStream, frame: &[u8], proven: bool) -> Result<bool> {
        match write_full(s, frame, self.deadline) {
            Ok(()) => Ok(true),
            Err(e) if is_closed(&e) => Ok(false),
            Err(e) => Err(self.failed(RecvError::Io(e), proven)),
        }
    }

    /// Reads a frame; `None` when the connection was closed first.
    fn receive(&self, s: &mut TcpStream, proven: bool) -> Result<Option<(u8, Vec<u8>)>> {
        match read_frame(s, self.deadline) {
            Ok(f) => Ok(Some(f)),
            Err(RecvError::Io(e)) if is_closed(&e) => Ok(None),
            Err(RecvError::TooLarge(len)) if !proven => Err(self.unverified(format!(
                "it announced a frame of {len} bytes where rank 0's challenge belongs"
            ))),
            Err(e) => Err(self.failed(e, proven)),
        }
    }

    fn failed(&self, e: RecvError, proven: bool) -> BootstrapError {
        let reached = [Reached::Listener, Reached::RankZero][usize::from(proven)];
        let hint = leaf_timeout_hint(self.id.addr, 0, self.dropped, reached);
        recv_error(0, Self::STEP, e, self.timeout, &hint, "")
    }

    fn unverified(&self, detail: String) -> BootstrapError {
        BootstrapError::UnverifiedRankZero {
            addr: self.id.addr,
            detail,
            hint: "an impostor or a stale process holds rank 0's port (a program bound it \
                   after the id was released, or an older communicator's rank 0 still runs \
                   there), or this rank's UniqueId is not the one rank 0 made (stale or \
                   mistyped); this rank sent nothing that reveals the secret: make a new \
                   UniqueId, and check which process listens on that port"
                .into(),
        }
    }
}
