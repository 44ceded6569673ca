//! The Linux descriptor channel: abstract Unix sockets, `SO_PEERCRED`, `SCM_RIGHTS`.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{self, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{
    self, sockopt, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

use super::{channel_error, Peer, CONNECTION_READ_TIMEOUT, MAGIC, MAX_PENDING, MESSAGE_BYTES};
use crate::error::Result;

/// A rank's listening socket for descriptors (see the module docs).
pub(crate) struct Listener {
    socket: OwnedFd,
    name: Vec<u8>,
    nonce: u64,
}

fn unix_socket(flags: SocketFlags) -> std::result::Result<OwnedFd, String> {
    let flags = SocketFlags::CLOEXEC | flags;
    net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None)
        .map_err(|e| format!("a Unix socket: {e}"))
}

/// Time left to `deadline`, at least 1 ms (a zero timeout means none to the kernel).
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// The process and user ids at the other end of `socket` (`SO_PEERCRED`; pid 0 where
/// that process is in a pid namespace this one cannot see).
fn peer_credentials(socket: BorrowedFd<'_>) -> std::result::Result<(u32, u32), String> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` outlive the call and `len` is `cred`'s size; the
    // kernel writes at most `len` bytes of plain integers.
    let r = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::addr_of_mut!(cred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(format!("SO_PEERCRED: {}", std::io::Error::last_os_error()));
    }
    Ok((cred.pid.max(0) as u32, cred.uid))
}

/// Whether the process at the other end of `socket` is `pid`, of this user.
fn peer_is(socket: BorrowedFd<'_>, pid: u32) -> std::result::Result<(), String> {
    let (theirs, uid) = peer_credentials(socket)?;
    let me = rustix::process::getuid().as_raw();
    if uid != me {
        return Err(format!(
            "the process at the other end runs as user {uid} (this one as {me})"
        ));
    }
    if theirs != pid {
        return Err(format!(
            "the process at the other end is {theirs}, not the peer's process {pid}"
        ));
    }
    Ok(())
}

impl Listener {
    /// A listener on a fresh random abstract name.
    pub(crate) fn bind() -> Result<Self> {
        let random = || getrandom::u64().map_err(|e| format!("no random bytes: {e}"));
        let bound = || {
            let socket = unix_socket(SocketFlags::NONBLOCK)?;
            let pid = std::process::id();
            let name = format!("peercomm-descriptors/{pid}/{:016x}", random()?).into_bytes();
            let addr = SocketAddrUnix::new_abstract_name(&name)
                .map_err(|e| format!("an abstract socket name: {e}"))?;
            net::bind(&socket, &addr).map_err(|e| format!("binding a Unix socket: {e}"))?;
            net::listen(&socket, 64).map_err(|e| format!("listening on a Unix socket: {e}"))?;
            let nonce = random()?;
            Ok(Listener {
                socket,
                name,
                nonce,
            })
        };
        bound().map_err(channel_error)
    }

    pub(crate) fn name(&self) -> &[u8] {
        &self.name
    }

    pub(crate) fn nonce(&self) -> u64 {
        self.nonce
    }

    /// One descriptor from each of `from` for registration `registration`, in the
    /// order of `from`, or an error at `deadline` naming the ranks that sent none.
    pub(crate) fn receive(
        &self,
        registration: u64,
        from: &[Peer],
        deadline: Instant,
    ) -> Result<Vec<OwnedFd>> {
        let me = rustix::process::getuid().as_raw();
        let mut got: Vec<Option<OwnedFd>> = from.iter().map(|_| None).collect();
        let mut pending: Vec<Pending> = Vec::new();
        let mut ignored = Ignored::default();
        while got.iter().any(Option::is_none) {
            let now = Instant::now();
            pending.retain(|p| {
                now < p.until || {
                    let why = format!("a connection of process {} sent no whole message", p.pid);
                    ignored.note(format!("{why} within {CONNECTION_READ_TIMEOUT:?}"));
                    false
                }
            });
            if now >= deadline {
                let missing: Vec<usize> = from
                    .iter()
                    .zip(&got)
                    .filter(|(_, g)| g.is_none())
                    .map(|(p, _)| p.rank)
                    .collect();
                return Err(channel_error(format!(
                    "no descriptor came from rank(s) {missing:?} in time (the peer's \
                     process ended or is stuck){}",
                    ignored.text()
                )));
            }
            let wake = pending.iter().map(|p| p.until).fold(deadline, Instant::min);
            let readable = match wait_readable(self.socket.as_fd(), &pending, wake) {
                Ok(r) => r,
                Err(Errno::INTR) => continue,
                Err(e) => return Err(channel_error(format!("poll: {e}"))),
            };
            // Messages first (the connections accepted earlier), newest last.
            for i in (0..pending.len()).rev().filter(|&i| readable[1 + i]) {
                match read_message(&pending[i], registration, from, self.nonce) {
                    Ok(None) => continue,
                    Ok(Some((k, fd))) if got[k].is_none() => got[k] = Some(fd),
                    Ok(Some((k, _))) => {
                        ignored.note(format!("a second descriptor from rank {}", from[k].rank))
                    }
                    Err(why) => ignored.note(why),
                }
                pending.swap_remove(i);
            }
            if readable[0] {
                self.admit(me, from, &mut pending, &mut ignored)?;
            }
        }
        Ok(got.into_iter().flatten().collect())
    }

    /// Accepts every waiting connection: those of this user and of an expected sender's
    /// process join `pending`; every other one is closed at once, unread.
    fn admit(
        &self,
        me: u32,
        from: &[Peer],
        pending: &mut Vec<Pending>,
        ignored: &mut Ignored,
    ) -> Result<()> {
        let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
        loop {
            let socket = match net::accept_with(&self.socket, flags) {
                Ok(s) => s,
                Err(Errno::AGAIN) => return Ok(()),
                Err(Errno::INTR) | Err(Errno::CONNABORTED) => continue,
                Err(e) => return Err(channel_error(format!("accept: {e}"))),
            };
            let why = match peer_credentials(socket.as_fd()) {
                Err(e) => format!("a connection without credentials ({e})"),
                Ok((_, uid)) if uid != me => {
                    format!("a connection of user {uid} (this rank runs as {me})")
                }
                Ok((pid, _)) if !from.iter().any(|p| p.pid == pid) => {
                    format!("a connection of process {pid}, which is no sender's")
                }
                Ok((pid, _)) => {
                    if pending.len() >= MAX_PENDING {
                        // The oldest goes: a sender writes right after its connect, so
                        // the newest is the likeliest to be one.
                        let oldest = pending.remove(0);
                        ignored.note(format!(
                            "a connection of process {} closed unread to make room (over \
                             {MAX_PENDING} unread ones)",
                            oldest.pid
                        ));
                    }
                    let until = Instant::now() + CONNECTION_READ_TIMEOUT;
                    pending.push(Pending { socket, pid, until });
                    continue;
                }
            };
            ignored.note(why);
        }
    }
}

/// An accepted connection of an expected sender's process, not read yet.
struct Pending {
    socket: OwnedFd,
    /// Its process (`SO_PEERCRED` at the accept).
    pid: u32,
    /// When it is closed unless its message has come.
    until: Instant,
}

/// Why connections were ignored (the first few reasons, and how many in all).
#[derive(Default)]
struct Ignored {
    reasons: Vec<String>,
    count: usize,
}

impl Ignored {
    fn note(&mut self, why: String) {
        self.count += 1;
        if self.reasons.len() < 8 {
            self.reasons.push(why);
        }
    }

    fn text(&self) -> String {
        match self.count {
            0 => String::new(),
            n if n == self.reasons.len() => format!("; ignored: {}", self.reasons.join("; ")),
            n => format!(
                "; ignored {n} connections, among them: {}",
                self.reasons.join("; ")
            ),
        }
    }
}

/// Which of the listener (index 0) and the `pending` connections (1 on) can be
/// read (or have closed) now, waiting for one at most until `until`.
fn wait_readable(
    listener: BorrowedFd<'_>,
    pending: &[Pending],
    until: Instant,
) -> std::result::Result<Vec<bool>, Errno> {
    let mut fds: Vec<PollFd<'_>> = std::iter::once(listener)
        .chain(pending.iter().map(|p| p.socket.as_fd()))
        .map(|fd| PollFd::from_borrowed_fd(fd, PollFlags::IN))
        .collect();
    let timeout = Timespec::try_from(left(until)).unwrap_or(Timespec {
        tv_sec: 1,
        tv_nsec: 0,
    });
    event::poll(&mut fds, Some(&timeout))?;
    Ok(fds.iter().map(|f| !f.revents().is_empty()).collect())
}

/// Reads the message `p` brings, without blocking: `(k, descriptor of from[k])` for
/// `registration`, with this listener's `nonce`, from that sender's process; `None`
/// while nothing came, `Err(why)` for a connection to close and ignore.
fn read_message(
    p: &Pending,
    registration: u64,
    from: &[Peer],
    nonce: u64,
) -> std::result::Result<Option<(usize, OwnedFd)>, String> {
    let mut bytes = [0u8; MESSAGE_BYTES];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = match net::recvmsg(
        &p.socket,
        &mut [IoSliceMut::new(&mut bytes)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
    ) {
        Ok(got) => got,
        Err(Errno::AGAIN) | Err(Errno::INTR) => return Ok(None),
        Err(e) => return Err(format!("recvmsg: {e}")),
    };
    // Every descriptor that came is owned here, so that one refused is closed.
    let mut fds: Vec<OwnedFd> = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    if got.bytes != MESSAGE_BYTES || fds.len() != 1 {
        return Err(format!(
            "a message of {} bytes with {} descriptors from process {}",
            got.bytes,
            fds.len(),
            p.pid
        ));
    }
    let word = |i: usize| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().expect("8 bytes"));
    let (magic, number, rank) = (word(0), word(1), word(2));
    if magic != MAGIC || word(3) != nonce {
        return Err("a message without this listener's magic and nonce".into());
    }
    if number != registration {
        return Err(format!(
            "a descriptor for registration {number}, not {registration}"
        ));
    }
    let Some(k) = from.iter().position(|s| s.rank as u64 == rank) else {
        return Err(format!("a descriptor from rank {rank}, which sends none"));
    };
    if from[k].pid != p.pid {
        return Err(format!(
            "rank {rank}'s message came from process {}, not the peer's process {}",
            p.pid, from[k].pid
        ));
    }
    Ok(Some((k, fds.pop().expect("one"))))
}

/// Sends `fd` to `to` for registration `registration`, as rank `me`.
pub(crate) fn send(
    fd: BorrowedFd<'_>,
    registration: u64,
    me: usize,
    to: &Peer,
    deadline: Instant,
) -> Result<()> {
    let fail =
        |what: String| channel_error(format!("sending rank {} a descriptor: {what}", to.rank));
    let addr = SocketAddrUnix::new_abstract_name(&to.name)
        .map_err(|e| fail(format!("its socket name: {e}")))?;
    let message = message(registration, me, to.nonce);
    loop {
        let socket = connect(&addr, deadline).map_err(&fail)?;
        peer_is(socket.as_fd(), to.pid).map_err(&fail)?;
        match send_with_fd(&socket, &message, fd) {
            Ok(MESSAGE_BYTES) => return Ok(()),
            Ok(sent) => {
                return Err(fail(format!(
                    "sendmsg sent {sent} of {MESSAGE_BYTES} bytes"
                )))
            }
            // The receiver closed the connection before reading it (it took this
            // sender for a stalled one, see `CONNECTION_READ_TIMEOUT`): again, on a
            // new one, until the deadline.
            Err(Errno::PIPE) | Err(Errno::CONNRESET) | Err(Errno::INTR)
                if Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(1))
            }
            Err(e) => return Err(fail(format!("sendmsg: {e}"))),
        }
    }
}

/// What a sender writes beside its descriptor: magic, registration, its rank, the
/// receiver's nonce.
pub(super) fn message(registration: u64, rank: usize, nonce: u64) -> [u8; MESSAGE_BYTES] {
    let mut m = [0u8; MESSAGE_BYTES];
    let words = [MAGIC, registration, rank as u64, nonce];
    for (chunk, w) in m.chunks_exact_mut(8).zip(words) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    m
}

/// Writes `message` on `socket` with `fd` beside it (`SCM_RIGHTS`).
pub(super) fn send_with_fd(
    socket: &OwnedFd,
    message: &[u8],
    fd: BorrowedFd<'_>,
) -> std::result::Result<usize, Errno> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(Errno::NOBUFS);
    }
    net::sendmsg(
        socket,
        &[IoSlice::new(message)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
}

/// A connection to the listener at `addr`, waiting out a full backlog until
/// `deadline`.
pub(super) fn connect(
    addr: &SocketAddrUnix,
    deadline: Instant,
) -> std::result::Result<OwnedFd, String> {
    loop {
        let socket = unix_socket(SocketFlags::empty())?;
        // A full backlog makes a Unix connect wait up to the send timeout.
        sockopt::set_socket_timeout(&socket, sockopt::Timeout::Send, Some(left(deadline)))
            .map_err(|e| format!("SO_SNDTIMEO: {e}"))?;
        match net::connect(&socket, addr) {
            Ok(()) => return Ok(socket),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!("connect: {e} (until the deadline)"))
            }
            // A full backlog: wait. (No listener at all, `CONNREFUSED`, fails at
            // once: the peer bound its socket before its name was gathered, so it
            // has ended since.)
            Err(Errno::AGAIN) | Err(Errno::INTR) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => return Err(format!("connect: {e}")),
        }
    }
}
