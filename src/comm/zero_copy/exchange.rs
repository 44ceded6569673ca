//! The handles of one registration, exchanged among ranks in different processes: each
//! rank exports the allocation that holds its range ([`Backend::export_range`]) and
//! gathers every rank's handle; file descriptors follow over the descriptor channel
//! ([`crate::os::descriptors`]).

use crate::error::lock;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::backend::{Backend, Descriptor};
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};

use super::records::{decode, decode_all, encode, malformed, refused, take};
use crate::os::descriptors::{self, Listener, Peer};

/// How long a rank waits for its peers' descriptors, or to hand one over, at most (less
/// where the bootstrap timeout is short: `Registry::new`). Only a dead or stuck peer
/// makes a rank wait that long.
pub(crate) const DESCRIPTOR_TIMEOUT: Duration = Duration::from_secs(30);

/// A peer's exported range, as received here.
pub(crate) struct Received {
    /// The handle record.
    pub(crate) handle: Vec<u8>,
    /// The range's offset in the exported allocation.
    pub(crate) offset: u64,
    /// The descriptor that came with it, if the peer exported one.
    pub(crate) descriptor: Option<Descriptor>,
}

/// The kind word of an export record (see [`super::records`]).
const EXPORT_RECORD: u64 = u64::from_le_bytes(*b"pcexp\0\0\x01");

/// One rank's gathered export.
#[derive(Default)]
struct Record {
    /// Why it cannot export (empty: it can).
    refusal: String,
    pid: u32,
    nonce: u64,
    /// Whether a descriptor follows the handle.
    descriptor: bool,
    name: Vec<u8>,
    handle: Vec<u8>,
    offset: u64,
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        let (refusal, name) = (self.refusal.len() as u64, self.name.len() as u64);
        let words = [
            self.pid.into(),
            self.nonce,
            self.descriptor.into(),
            self.offset,
            refusal,
            name,
        ];
        let text = [self.refusal.as_bytes(), &self.name, &self.handle].concat();
        encode(EXPORT_RECORD, &words, &text)
    }

    /// Rank `rank`'s record, or its refusal as [`Error::CannotRegister`].
    fn decode(rank: usize, b: &[u8]) -> Result<Record> {
        let ([pid, nonce, descriptor, offset, refusal_len, name_len], rest) =
            decode(rank, b, EXPORT_RECORD)?;
        let (refusal, rest) = take(rest, refusal_len).ok_or_else(|| malformed(rank, b))?;
        let (name, handle) = take(rest, name_len).ok_or_else(|| malformed(rank, b))?;
        if !refusal.is_empty() {
            return Err(refused(rank, String::from_utf8_lossy(refusal).into_owned()));
        }
        Ok(Record {
            refusal: String::new(),
            pid: pid as u32,
            nonce,
            descriptor: descriptor != 0,
            name: name.to_vec(),
            handle: handle.to_vec(),
            offset,
        })
    }
}

/// This rank's listener, bound on first use (see [`descriptors`]).
fn listening(listener: &Mutex<Option<Listener>>) -> Result<(Vec<u8>, u64)> {
    let mut l = lock(listener);
    if l.is_none() {
        *l = Some(Listener::bind()?);
    }
    let l = l.as_ref().expect("bound");
    Ok((l.name().to_vec(), l.nonce()))
}

/// Exports `[ptr, ptr + bytes)` and exchanges every rank's export for registration
/// `registration`, waiting at most `timeout` for the descriptors: `received[r]` for each
/// rank `r` that `remote[r]` marks (in another process), and this rank's own problem
/// with the descriptors (for the caller to gather); `Err` alike on every rank where a
/// rank refused to export or the gather failed.
pub(crate) fn exchange<B: Backend>(
    dev: &B::Device,
    group: &dyn Bootstrap,
    listener: &Mutex<Option<Listener>>,
    (registration, timeout): (u64, Duration),
    (ptr, bytes): (u64, usize),
    remote: &[bool],
) -> Result<(Vec<Option<Received>>, Option<String>)> {
    let me = group.rank();
    let mut mine = Record {
        pid: std::process::id(),
        ..Record::default()
    };
    let my_descriptor = match B::export_range(dev, ptr, bytes) {
        Ok(e) => {
            (mine.handle, mine.offset, mine.descriptor) =
                (e.handle, e.offset, e.descriptor.is_some());
            e.descriptor
        }
        Err(e) => {
            mine.refusal = match e {
                Error::CannotRegister { reason, .. } => reason,
                e => e.to_string(),
            };
            None
        }
    };
    // Every rank listens, whether or not a peer turns out to send it a descriptor: the
    // name must be in the record before anyone knows.
    if mine.refusal.is_empty() {
        match listening(listener) {
            Ok((name, nonce)) => (mine.name, mine.nonce) = (name, nonce),
            Err(e) if my_descriptor.is_some() => {
                mine.refusal = format!("its memory is exported as a file descriptor: {e}")
            }
            // Sending nothing, it needs to receive only where a peer sends: the peer's
            // send then fails (no name) and the registration fails alike.
            Err(_) => {}
        }
    }
    let records = decode_all(group.all_gather(&mine.encode()), Ok(()), Record::decode)?;
    let peer = |r: usize| Peer {
        rank: r,
        pid: records[r].pid,
        name: records[r].name.clone(),
        nonce: records[r].nonce,
    };
    let deadline = Instant::now() + timeout;
    let senders: Vec<usize> = (0..records.len())
        .filter(|&r| r != me && remote[r] && records[r].descriptor)
        .collect();
    let from: Vec<Peer> = senders.iter().map(|&r| peer(r)).collect();
    let to: Vec<Peer> = (0..records.len())
        .filter(|&r| r != me && remote[r] && my_descriptor.is_some())
        .map(peer)
        .collect();
    // Sends and the receive side by side: a send may wait for room in the peer's
    // backlog (which anyone may fill between registrations), and only the peer's
    // receive makes room, so no rank's send may wait for its own receive.
    let (sent, received) = std::thread::scope(|s| {
        let sending = my_descriptor.as_ref().map(|fd| {
            s.spawn(move || {
                to.iter()
                    .find_map(|p| descriptors::send(as_fd(fd), registration, me, p, deadline).err())
                    .map(|e| e.to_string())
            })
        });
        let received = match lock(listener).as_ref() {
            _ if from.is_empty() => Ok(Vec::new()),
            Some(l) => l
                .receive(registration, &from, deadline)
                .map_err(|e| e.to_string()),
            None => Err("this rank has no descriptor channel".to_string()),
        };
        let sent = sending.and_then(|h| {
            h.join()
                .unwrap_or_else(|_| Some("the sending thread panicked".into()))
        });
        (sent, received)
    });
    drop(my_descriptor);
    // The descriptors came in the order of `senders`.
    let (mut fds, problem) = match received {
        Ok(fds) => (fds.into_iter(), sent),
        Err(e) => (Vec::new().into_iter(), Some(sent.unwrap_or(e))),
    };
    let received = records
        .into_iter()
        .enumerate()
        .map(|(r, record)| {
            (r != me && remote[r]).then(|| Received {
                handle: record.handle,
                offset: record.offset,
                descriptor: senders.contains(&r).then(|| fds.next()).flatten(),
            })
        })
        .collect();
    Ok((received, problem))
}

#[cfg(unix)]
fn as_fd(fd: &Descriptor) -> std::os::fd::BorrowedFd<'_> {
    use std::os::fd::AsFd;
    fd.as_fd()
}

#[cfg(not(unix))]
fn as_fd(fd: &Descriptor) -> &Descriptor {
    fd
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::zero_copy::records::refused_by;

    #[test]
    fn records_round_trip_and_carry_refusals() {
        let r = Record {
            refusal: String::new(),
            pid: 42,
            nonce: 7,
            descriptor: true,
            name: b"peercomm-descriptors/42/abc".to_vec(),
            handle: vec![1, 2, 3],
            offset: 64,
        };
        // Every field is in the encoding, so equal encodings mean equal records.
        assert_eq!(Record::decode(0, &r.encode()).unwrap().encode(), r.encode());
        let refused = Record {
            refusal: "a pool without IPC".into(),
            ..r
        };
        let reason = refused_by(Record::decode(1, &refused.encode()), 1);
        assert_eq!(reason, "a pool without IPC");
        let mut short = refused.encode();
        short.truncate(60);
        for b in [&[1, 0][..], &[0, 0, 0, 0, 1], &short] {
            assert!(Record::decode(0, b).is_err());
        }
    }

    /// Registration `registration` exchanged between two ranks of this process on
    /// `channels`, every rank's outcome (and whether it imports its peer's handle).
    #[cfg(target_os = "linux")]
    fn two_ranks(
        channels: &[Mutex<Option<Listener>>],
        registration: u64,
        timeout: Duration,
    ) -> Vec<(Option<String>, bool)> {
        use crate::backend::host::Host;
        use crate::backend::MemoryKind;
        use crate::external::local::LocalBootstrap;

        let world = LocalBootstrap::world(2, Duration::from_secs(30));
        std::thread::scope(|s| {
            let ranks: Vec<_> = world
                .iter()
                .zip(channels)
                .map(|(boot, channel)| {
                    s.spawn(move || {
                        let rank = boot.rank();
                        let dev = Host::open(rank).unwrap();
                        let memory = Host::alloc(&dev, 4096, MemoryKind::SharedData).unwrap();
                        let range = (Host::memory_ptr(&memory), 4096);
                        let (mut received, problem) = exchange::<Host>(
                            &dev,
                            boot,
                            channel,
                            (registration, timeout),
                            range,
                            &[true, true],
                        )
                        .unwrap();
                        let peer = received[1 - rank].take().unwrap();
                        let imported = Host::import_range(&dev, &peer.handle, peer.descriptor);
                        (problem, imported.is_ok())
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[cfg(target_os = "linux")]
    fn channels() -> [Mutex<Option<Listener>>; 2] {
        std::array::from_fn(|_| Mutex::new(Some(Listener::bind().unwrap())))
    }

    /// Every rank's channel with its backlog full of connections nobody reads (anyone
    /// may connect between registrations): no rank's send waits for its own receive, so
    /// the ranks drain each other's backlog and the exchange ends at once.
    #[cfg(target_os = "linux")]
    #[test]
    fn full_backlogs_stall_no_exchange() {
        use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

        let channels = channels();
        // Idle connections until each backlog is full (a connect would wait).
        let mut idle = Vec::new();
        for channel in &channels {
            let name = channel.lock().unwrap().as_ref().unwrap().name().to_vec();
            let addr = SocketAddrUnix::new_abstract_name(&name).unwrap();
            for _ in 0..1000 {
                let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
                let socket =
                    rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None)
                        .unwrap();
                match rustix::net::connect(&socket, &addr) {
                    Ok(()) => idle.push(socket),
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(e) => panic!("{e}"),
                }
            }
        }
        let start = Instant::now();
        let outcomes = two_ranks(&channels, 0, Duration::from_secs(10));
        assert_eq!(outcomes, vec![(None, true), (None, true)]);
        let took = start.elapsed();
        assert!(took < Duration::from_secs(2), "{took:?}");
        drop(idle);
    }

    /// A descriptor tagged with an earlier registration's number (a late send of a
    /// registration that failed), queued ahead of the real one with the right nonce, is
    /// dropped: the exchange takes the real one, whose import matches its handle.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_descriptor_of_an_earlier_registration_is_dropped() {
        use crate::os::descriptors::tests::me;
        use std::os::fd::AsFd;

        let channels = channels();
        let to = |rank: usize| me(rank, channels[rank].lock().unwrap().as_ref().unwrap());
        let stale = rustix::fs::memfd_create("stale", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        for (from, rank) in [(0, 1), (1, 0)] {
            descriptors::send(stale.as_fd(), 4, from, &to(rank), deadline).unwrap();
        }
        let outcomes = two_ranks(&channels, 5, DESCRIPTOR_TIMEOUT);
        assert_eq!(outcomes, vec![(None, true), (None, true)]);
    }
}
