//! The handles of one registration, exchanged among ranks in different processes: each
//! rank exports the allocation that holds its range ([`Backend::export_range`]) and
//! gathers every rank's handle; where the driver exports memory only as a file
//! descriptor, the descriptors follow over the descriptor channel
//! ([`super::descriptors`]). A refusal to export is gathered, so every rank refuses
//! alike; a descriptor that does not arrive is this rank's own problem, which the
//! registration then gathers with the import failures.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::descriptors::{self, Listener, Peer};
use crate::backend::{Backend, Descriptor, ExportedRange};
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};

/// How long a rank waits for a peer's descriptor, or to hand one over.
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

/// One rank's gathered export.
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
        let mut b = (self.refusal.len() as u32).to_le_bytes().to_vec();
        b.extend_from_slice(self.refusal.as_bytes());
        b.extend_from_slice(&self.pid.to_le_bytes());
        b.extend_from_slice(&self.nonce.to_le_bytes());
        b.push(self.descriptor as u8);
        b.extend_from_slice(&(self.name.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.name);
        b.extend_from_slice(&self.offset.to_le_bytes());
        b.extend_from_slice(&self.handle);
        b
    }

    fn decode(b: &[u8]) -> std::result::Result<Record, String> {
        let mut at = 0usize;
        let mut take = |n: usize| -> std::result::Result<&[u8], String> {
            let s = b
                .get(at..at + n)
                .ok_or_else(|| format!("a malformed export record ({} bytes)", b.len()))?;
            at += n;
            Ok(s)
        };
        let len = u32::from_le_bytes(take(4)?.try_into().expect("4")) as usize;
        let refusal = String::from_utf8_lossy(take(len)?).into_owned();
        if !refusal.is_empty() {
            return Ok(Record {
                refusal,
                pid: 0,
                nonce: 0,
                descriptor: false,
                name: Vec::new(),
                handle: Vec::new(),
                offset: 0,
            });
        }
        let pid = u32::from_le_bytes(take(4)?.try_into().expect("4"));
        let nonce = u64::from_le_bytes(take(8)?.try_into().expect("8"));
        let descriptor = take(1)?[0] != 0;
        let name_len = u16::from_le_bytes(take(2)?.try_into().expect("2")) as usize;
        let name = take(name_len)?.to_vec();
        let offset = u64::from_le_bytes(take(8)?.try_into().expect("8"));
        let handle = b[at..].to_vec();
        Ok(Record {
            refusal,
            pid,
            nonce,
            descriptor,
            name,
            handle,
            offset,
        })
    }
}

/// This rank's listener, bound on first use (see [`descriptors`]).
fn listening(listener: &Mutex<Option<Listener>>) -> Result<(Vec<u8>, u64)> {
    let mut l = listener.lock().unwrap_or_else(|e| e.into_inner());
    if l.is_none() {
        *l = Some(Listener::bind()?);
    }
    let l = l.as_ref().expect("bound");
    Ok((l.name().to_vec(), l.nonce()))
}

/// Exports `[ptr, ptr + bytes)` and exchanges every rank's export for registration
/// `registration`: `Ok((received, problem))` with `received[r]` for each rank `r`
/// that `remote[r]` marks (in another process), and this rank's own problem with the
/// descriptors (to be gathered by the caller); `Err` alike on every rank where a rank
/// refused to export or the gather failed.
pub(crate) fn exchange<B: Backend>(
    dev: &B::Device,
    group: &dyn Bootstrap,
    listener: &Mutex<Option<Listener>>,
    registration: u64,
    (ptr, bytes): (u64, usize),
    remote: &[bool],
) -> Result<(Vec<Option<Received>>, Option<String>)> {
    let me = group.rank();
    let mut mine = Record {
        refusal: String::new(),
        pid: std::process::id(),
        nonce: 0,
        descriptor: false,
        name: Vec::new(),
        handle: Vec::new(),
        offset: 0,
    };
    let mut my_descriptor = None;
    match B::export_range(dev, ptr, bytes) {
        Ok(ExportedRange {
            handle,
            offset,
            descriptor,
        }) => {
            mine.handle = handle;
            mine.offset = offset;
            mine.descriptor = descriptor.is_some();
            my_descriptor = descriptor;
        }
        Err(Error::CannotRegister { reason, .. }) => mine.refusal = reason,
        Err(e) => mine.refusal = e.to_string(),
    }
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
    let gathered = group.all_gather(&mine.encode())?;
    let mut records = Vec::with_capacity(gathered.len());
    for (r, g) in gathered.iter().enumerate() {
        let record =
            Record::decode(g).map_err(|reason| Error::CannotRegister { rank: r, reason })?;
        if !record.refusal.is_empty() {
            return Err(Error::CannotRegister {
                rank: r,
                reason: record.refusal,
            });
        }
        records.push(record);
    }
    let peer = |r: usize| Peer {
        rank: r,
        pid: records[r].pid,
        name: records[r].name.clone(),
        nonce: records[r].nonce,
    };
    let deadline = Instant::now() + DESCRIPTOR_TIMEOUT;
    let mut problem = None;
    // Sends first: a connect to a listening socket and a small message complete
    // without the receiver, so no order of ranks deadlocks.
    if let Some(fd) = &my_descriptor {
        for r in (0..records.len()).filter(|&r| r != me && remote[r]) {
            if let Err(e) = descriptors::send(as_fd(fd), registration, me, &peer(r), deadline) {
                problem.get_or_insert(e.to_string());
            }
        }
    }
    drop(my_descriptor);
    let senders: Vec<usize> = (0..records.len())
        .filter(|&r| r != me && remote[r] && records[r].descriptor)
        .collect();
    let mut descriptors: Vec<Option<Descriptor>> = (0..records.len()).map(|_| None).collect();
    if !senders.is_empty() {
        let from: Vec<Peer> = senders.iter().map(|&r| peer(r)).collect();
        let received = listener
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .ok_or_else(|| "this rank has no descriptor channel".to_string())
            .and_then(|l| {
                l.receive(registration, &from, deadline)
                    .map_err(|e| e.to_string())
            });
        match received {
            Ok(fds) => {
                for (&r, fd) in senders.iter().zip(fds) {
                    descriptors[r] = Some(fd);
                }
            }
            Err(e) => {
                problem.get_or_insert(e);
            }
        }
    }
    let received = records
        .into_iter()
        .zip(descriptors)
        .enumerate()
        .map(|(r, (record, descriptor))| {
            (r != me && remote[r]).then_some(Received {
                handle: record.handle,
                offset: record.offset,
                descriptor,
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
        let back = Record::decode(&r.encode()).unwrap();
        assert_eq!(
            (back.pid, back.nonce, back.descriptor, back.offset),
            (42, 7, true, 64)
        );
        assert_eq!((back.name, back.handle), (r.name.clone(), vec![1, 2, 3]));
        let refused = Record {
            refusal: "a pool without IPC".into(),
            ..r
        };
        assert_eq!(
            Record::decode(&refused.encode()).unwrap().refusal,
            "a pool without IPC"
        );
        assert!(Record::decode(&[1, 0]).is_err());
        assert!(Record::decode(&[0, 0, 0, 0, 1]).is_err());
    }
}
