//! File descriptors between the ranks' processes, for memory that the driver exports
//! only as one ([`crate::backend::ExportedRange::descriptor`]: CUDA memory pools made
//! with a POSIX-fd handle type and virtual-memory allocations; the host backend's
//! shared memory files). The bootstrap carries bytes; a descriptor travels beside them
//! over a Unix socket (`SCM_RIGHTS`), which needs Linux.
//!
//! Each rank that registers with a peer in another process listens on an abstract
//! Unix socket of a random name ([`Listener`]), bound before the name is gathered, so
//! no other process can hold that name first. A registration's gathered records carry
//! every rank's process id, socket name and a random nonce ([`Peer`]); the bootstrap
//! authenticates them. A rank with a descriptor connects to each peer in another
//! process, checks with `SO_PEERCRED` that the listener is that peer's process and of
//! this user, and sends the registration's number, its rank and the peer's nonce with
//! the descriptor ([`send`]). A receiver ([`Listener::receive`]) takes one descriptor
//! from each expected sender, checking the same of the sender; any other connection
//! (another process or user, another registration, a wrong nonce or rank, a second
//! one from a rank) is closed and ignored, descriptor included. Both sides give up at
//! a deadline: a dead peer makes the registration fail, never hang.

#[cfg(not(target_os = "linux"))]
use std::time::Instant;

use crate::error::Error;
#[cfg(not(target_os = "linux"))]
use crate::error::Result;

/// What a sender says beside its descriptor.
const MAGIC: u64 = u64::from_le_bytes(*b"pcfdesc1");
/// Bytes of one message: magic, registration, sender rank, receiver's nonce.
const MESSAGE_BYTES: usize = 32;

/// A peer to send a descriptor to, or to expect one from, as its gathered record says.
#[derive(Clone, Debug)]
pub(crate) struct Peer {
    /// The peer's rank in the group.
    pub(crate) rank: usize,
    /// Its process id (checked with `SO_PEERCRED`).
    pub(crate) pid: u32,
    /// Its listener's abstract socket name.
    pub(crate) name: Vec<u8>,
    /// Its listener's nonce, echoed by whoever sends it a descriptor.
    pub(crate) nonce: u64,
}

fn channel_error(detail: String) -> Error {
    Error::Backend {
        backend: "peercomm",
        call: "descriptor channel",
        detail,
    }
}

#[cfg(target_os = "linux")]
mod unix {
    use std::io::{IoSlice, IoSliceMut};
    use std::mem::MaybeUninit;
    use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
    use std::time::{Duration, Instant};

    use rustix::io::Errno;
    use rustix::net::{
        self, sockopt, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags,
        SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags,
        SocketType,
    };

    use super::{channel_error, Peer, MAGIC, MESSAGE_BYTES};
    use crate::error::Result;

    /// A rank's listening socket for descriptors (see the module docs).
    pub(crate) struct Listener {
        socket: OwnedFd,
        name: Vec<u8>,
        nonce: u64,
    }

    fn random_u64() -> Result<u64> {
        getrandom::u64().map_err(|e| channel_error(format!("no random bytes: {e}")))
    }

    fn unix_socket(flags: SocketFlags) -> Result<OwnedFd> {
        net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC | flags,
            None,
        )
        .map_err(|e| channel_error(format!("a Unix socket: {e}")))
    }

    /// Time left to `deadline`, at least 1 ms (a zero timeout means none to the kernel).
    fn left(deadline: Instant) -> Duration {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    }

    /// Whether the process at the other end of `socket` is `pid`, of this user.
    fn peer_is(socket: BorrowedFd<'_>, pid: u32) -> std::result::Result<(), String> {
        let cred = sockopt::socket_peercred(socket).map_err(|e| format!("SO_PEERCRED: {e}"))?;
        let me = rustix::process::getuid();
        if cred.uid != me {
            return Err(format!(
                "the process at the other end runs as user {} (this one as {})",
                cred.uid.as_raw(),
                me.as_raw()
            ));
        }
        if cred.pid.as_raw_nonzero().get() as u32 != pid {
            return Err(format!(
                "the process at the other end is {}, not the peer's process {pid}",
                cred.pid.as_raw_nonzero()
            ));
        }
        Ok(())
    }

    impl Listener {
        /// A listener on a fresh random abstract name.
        pub(crate) fn bind() -> Result<Self> {
            let socket = unix_socket(SocketFlags::NONBLOCK)?;
            let name = format!(
                "peercomm-descriptors/{}/{:016x}",
                std::process::id(),
                random_u64()?
            )
            .into_bytes();
            let addr = SocketAddrUnix::new_abstract_name(&name)
                .map_err(|e| channel_error(format!("an abstract socket name: {e}")))?;
            net::bind(&socket, &addr)
                .map_err(|e| channel_error(format!("binding a Unix socket: {e}")))?;
            net::listen(&socket, 64)
                .map_err(|e| channel_error(format!("listening on a Unix socket: {e}")))?;
            Ok(Listener {
                socket,
                name,
                nonce: random_u64()?,
            })
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
            let mut got: Vec<Option<OwnedFd>> = from.iter().map(|_| None).collect();
            let mut ignored = Vec::new();
            while got.iter().any(Option::is_none) {
                let socket = match net::accept_with(&self.socket, SocketFlags::CLOEXEC) {
                    Ok(s) => s,
                    Err(Errno::AGAIN) | Err(Errno::INTR) => {
                        if Instant::now() >= deadline {
                            let missing: Vec<usize> = from
                                .iter()
                                .zip(&got)
                                .filter(|(_, g)| g.is_none())
                                .map(|(p, _)| p.rank)
                                .collect();
                            return Err(channel_error(format!(
                                "no descriptor came from rank(s) {missing:?} in time (the \
                                 peer's process ended or is stuck){}",
                                if ignored.is_empty() {
                                    String::new()
                                } else {
                                    format!("; ignored: {}", ignored.join("; "))
                                }
                            )));
                        }
                        std::thread::sleep(Duration::from_micros(200));
                        continue;
                    }
                    Err(e) => return Err(channel_error(format!("accept: {e}"))),
                };
                match self.take(socket.as_fd(), registration, from, deadline) {
                    Ok((k, fd)) if got[k].is_none() => got[k] = Some(fd),
                    Ok((k, _)) => {
                        ignored.push(format!("a second descriptor from rank {}", from[k].rank))
                    }
                    Err(why) if ignored.len() < 8 => ignored.push(why),
                    Err(_) => {}
                }
            }
            Ok(got
                .into_iter()
                .map(|g| g.expect("every one came"))
                .collect())
        }

        /// The descriptor one accepted connection brings, and which of `from` sent it.
        fn take(
            &self,
            socket: BorrowedFd<'_>,
            registration: u64,
            from: &[Peer],
            deadline: Instant,
        ) -> std::result::Result<(usize, OwnedFd), String> {
            sockopt::set_socket_timeout(socket, sockopt::Timeout::Recv, Some(left(deadline)))
                .map_err(|e| format!("SO_RCVTIMEO: {e}"))?;
            let mut bytes = [0u8; MESSAGE_BYTES];
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let got = net::recvmsg(
                socket,
                &mut [IoSliceMut::new(&mut bytes)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )
            .map_err(|e| format!("recvmsg: {e}"))?;
            // Every descriptor that came is owned here, so that one refused is closed.
            let mut fds: Vec<OwnedFd> = Vec::new();
            for message in control.drain() {
                if let RecvAncillaryMessage::ScmRights(rights) = message {
                    fds.extend(rights);
                }
            }
            if got.bytes != MESSAGE_BYTES || fds.len() != 1 {
                return Err(format!(
                    "a message of {} bytes with {} descriptors",
                    got.bytes,
                    fds.len()
                ));
            }
            let word =
                |i: usize| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().expect("8 bytes"));
            let (magic, number, rank, nonce) = (word(0), word(1), word(2), word(3));
            if magic != MAGIC || nonce != self.nonce {
                return Err("a message without this listener's magic and nonce".into());
            }
            if number != registration {
                return Err(format!(
                    "a descriptor for registration {number}, not {registration}"
                ));
            }
            let k = from
                .iter()
                .position(|p| p.rank as u64 == rank)
                .ok_or_else(|| format!("a descriptor from rank {rank}, which sends none"))?;
            peer_is(socket, from[k].pid).map_err(|e| format!("rank {rank}'s message: {e}"))?;
            Ok((k, fds.pop().expect("one")))
        }
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
        let socket = loop {
            let socket = unix_socket(SocketFlags::empty())?;
            // A full backlog makes a Unix connect wait up to the send timeout.
            sockopt::set_socket_timeout(&socket, sockopt::Timeout::Send, Some(left(deadline)))
                .map_err(|e| fail(format!("SO_SNDTIMEO: {e}")))?;
            match net::connect(&socket, &addr) {
                Ok(()) => break socket,
                Err(e) if Instant::now() >= deadline => {
                    return Err(fail(format!("connect: {e} (until the deadline)")))
                }
                // A full backlog: wait. (No listener at all, `CONNREFUSED`, fails at
                // once: the peer bound its socket before its name was gathered, so it
                // has ended since.)
                Err(Errno::AGAIN) | Err(Errno::INTR) => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(e) => return Err(fail(format!("connect: {e}"))),
            }
        };
        peer_is(socket.as_fd(), to.pid).map_err(fail)?;
        let mut message = [0u8; MESSAGE_BYTES];
        for (i, w) in [MAGIC, registration, me as u64, to.nonce]
            .iter()
            .enumerate()
        {
            message[8 * i..8 * i + 8].copy_from_slice(&w.to_le_bytes());
        }
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds = [fd];
        if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(fail("no room for the descriptor".into()));
        }
        let sent = net::sendmsg(
            &socket,
            &[IoSlice::new(&message)],
            &mut control,
            SendFlags::NOSIGNAL,
        )
        .map_err(|e| fail(format!("sendmsg: {e}")))?;
        if sent != MESSAGE_BYTES {
            return Err(fail(format!(
                "sendmsg sent {sent} of {MESSAGE_BYTES} bytes"
            )));
        }
        Ok(())
    }
}

#[cfg(target_os = "linux")]
pub(crate) use unix::{send, Listener};

/// Elsewhere than Linux no descriptor travels: memory exported as one is refused.
#[cfg(not(target_os = "linux"))]
pub(crate) struct Listener(std::convert::Infallible);

#[cfg(not(target_os = "linux"))]
impl Listener {
    pub(crate) fn bind() -> Result<Self> {
        Err(Error::Unsupported(
            "passing file descriptors between processes needs Linux".into(),
        ))
    }
    pub(crate) fn name(&self) -> &[u8] {
        match self.0 {}
    }
    pub(crate) fn nonce(&self) -> u64 {
        match self.0 {}
    }
    pub(crate) fn receive(
        &self,
        _registration: u64,
        _from: &[Peer],
        _deadline: Instant,
    ) -> Result<Vec<crate::backend::Descriptor>> {
        match self.0 {}
    }
}

/// Elsewhere than Linux no descriptor travels.
#[cfg(not(target_os = "linux"))]
pub(crate) fn send<F>(
    _fd: F,
    _registration: u64,
    _me: usize,
    _to: &Peer,
    _deadline: Instant,
) -> Result<()> {
    Err(Error::Unsupported(
        "passing file descriptors between processes needs Linux".into(),
    ))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};

    use super::*;

    fn me(rank: usize, listener: &Listener) -> Peer {
        Peer {
            rank,
            pid: std::process::id(),
            name: listener.name().to_vec(),
            nonce: listener.nonce(),
        }
    }

    /// A descriptor sent arrives as a descriptor of the same file.
    #[test]
    fn a_descriptor_travels() {
        let listener = Listener::bind().unwrap();
        let file = tempfile_fd();
        let deadline = Instant::now() + Duration::from_secs(5);
        send(file.as_fd(), 3, 1, &me(0, &listener), deadline).unwrap();
        let got = listener.receive(3, &[me(1, &listener)], deadline).unwrap();
        let (a, b) = (
            rustix::fs::fstat(&file).unwrap(),
            rustix::fs::fstat(&got[0]).unwrap(),
        );
        assert_eq!((a.st_dev, a.st_ino), (b.st_dev, b.st_ino));
    }

    /// A message for another registration, with a wrong nonce, or from an unexpected
    /// rank is ignored (its descriptor closed), and the receiver gives up at its
    /// deadline naming the rank that sent nothing.
    #[test]
    fn wrong_messages_are_ignored_and_a_missing_one_times_out() {
        let listener = Listener::bind().unwrap();
        let file = tempfile_fd();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut stale = me(0, &listener);
        send(file.as_fd(), 2, 1, &stale, deadline).unwrap();
        stale.nonce ^= 1;
        send(file.as_fd(), 3, 1, &stale, deadline).unwrap();
        send(file.as_fd(), 3, 5, &me(0, &listener), deadline).unwrap();
        let start = Instant::now();
        let e = listener
            .receive(3, &[me(1, &listener)], start + Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        assert!(e.contains("rank(s) [1]"), "{e}");
        assert!(e.contains("registration 2, not 3"), "{e}");
        assert!(e.contains("nonce"), "{e}");
        assert!(e.contains("rank 5"), "{e}");
    }

    /// A sender whose process id is not the one gathered for it is refused.
    #[test]
    fn a_sender_of_another_process_is_refused() {
        let listener = Listener::bind().unwrap();
        let file = tempfile_fd();
        let deadline = Instant::now() + Duration::from_secs(5);
        send(file.as_fd(), 0, 1, &me(0, &listener), deadline).unwrap();
        let mut other = me(1, &listener);
        other.pid = other.pid.wrapping_add(1);
        let e = listener
            .receive(0, &[other], Instant::now() + Duration::from_millis(200))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not the peer's process"), "{e}");
        // And a listener that is not the peer's process gets nothing.
        let mut wrong = me(0, &listener);
        wrong.pid = wrong.pid.wrapping_add(1);
        let e = send(file.as_fd(), 0, 1, &wrong, deadline)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not the peer's process"), "{e}");
    }

    /// Nobody listening (the peer has ended): the sender fails at once.
    #[test]
    fn a_missing_listener_times_out() {
        let name = Listener::bind().unwrap().name().to_vec();
        let file = tempfile_fd();
        let to = Peer {
            rank: 0,
            pid: std::process::id(),
            name,
            nonce: 0,
        };
        let start = Instant::now();
        let e = send(file.as_fd(), 0, 1, &to, start + Duration::from_millis(200));
        assert!(e.is_err());
        assert!(start.elapsed() < Duration::from_secs(3));
    }

    fn tempfile_fd() -> std::os::fd::OwnedFd {
        rustix::fs::memfd_create("peercomm-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap()
    }
}
