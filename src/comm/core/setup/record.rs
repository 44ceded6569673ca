//! The record every rank sends the others at setup (its process, device identity,
//! multiprocessors, signal address, architecture), its wire
//! form, and the rules the records are checked by: which ranks share a process or a
//! physical device, the grid the group agrees on, and the shared-device refusal.

use crate::backend::DeviceIdentity;
use crate::error::{Error, Result};

/// Format version of the per-rank exchange record.
pub(crate) const RECORD_VERSION: u8 = 4;

/// What each rank tells the others at setup.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PeerRecord {
    /// A random number drawn once per process (`process_token`): ranks with the same
    /// token share a process and reach each other's memory by address. A process id
    /// would not do: processes in different pid namespaces (containers) share ids.
    pub(crate) process: u64,
    /// The device's multiprocessors (CPU cores on the host backend): the grid is
    /// sized from the fewest of the group.
    pub(crate) multiprocessors: u32,
    /// The device: its ordinal in the rank's process, its UUID and PCI bus id.
    pub(crate) identity: DeviceIdentity,
    pub(crate) signal_addr: u64,
    pub(crate) arch: String,
}

impl PeerRecord {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = vec![RECORD_VERSION];
        out.extend_from_slice(&self.process.to_le_bytes());
        out.extend_from_slice(&self.multiprocessors.to_le_bytes());
        out.extend_from_slice(&(self.identity.ordinal() as u64).to_le_bytes());
        out.extend_from_slice(&self.signal_addr.to_le_bytes());
        // An unknown UUID travels as 16 zero bytes, an unknown PCI bus id as no text.
        out.extend_from_slice(&self.identity.uuid().unwrap_or([0; 16]));
        put_text(&mut out, self.identity.pci_bus_id().unwrap_or(""));
        put_text(&mut out, &self.arch);
        out
    }

    pub(crate) fn decode(rank: usize, bytes: &[u8]) -> Result<Self> {
        let bad = || Error::InvalidConfig(format!("rank {rank} sent a malformed setup record"));
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8]> {
            let field = bytes.get(at..at + n).ok_or_else(bad)?;
            at += n;
            Ok(field)
        };
        if take(1)?[0] != RECORD_VERSION {
            return Err(Error::InvalidConfig(format!(
                "rank {rank} runs another peercomm version (setup record format)"
            )));
        }
        let process = u64::from_le_bytes(take(8)?.try_into().unwrap());
        let multiprocessors = u32::from_le_bytes(take(4)?.try_into().unwrap());
        let ordinal = u64::from_le_bytes(take(8)?.try_into().unwrap()) as usize;
        let signal_addr = u64::from_le_bytes(take(8)?.try_into().unwrap());
        let uuid: [u8; 16] = take(16)?.try_into().unwrap();
        let mut text = || -> Result<String> {
            let n = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
            String::from_utf8(take(n)?.to_vec()).map_err(|_| bad())
        };
        let pci = text()?;
        let arch = text()?;
        let identity = DeviceIdentity::new(ordinal, Some(uuid), Some(&pci));
        Ok(PeerRecord {
            process,
            multiprocessors,
            identity,
            signal_addr,
            arch,
        })
    }
}

/// Appends `text` with its length (`u32`, little-endian) first.
pub(crate) fn put_text(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
}

/// Whether two ranks run in one process (and reach each other's memory by address).
pub(crate) fn same_process(a: &PeerRecord, b: &PeerRecord) -> bool {
    a.process == b.process
}

/// The fewest multiprocessors of any rank: the grid every rank of the group uses.
pub(crate) fn fewest_multiprocessors(records: &[PeerRecord]) -> usize {
    records
        .iter()
        .map(|p| p.multiprocessors as usize)
        .min()
        .unwrap_or(1)
        .max(1)
}

/// Whether two ranks are on one physical device: their identities say so (UUID, else
/// PCI bus id). Where neither tells, ranks of one process are on one device when their
/// ordinals agree (an ordinal names a device within its process), and ranks of
/// different processes are taken to be on different devices.
pub(crate) fn same_device(a: &PeerRecord, b: &PeerRecord) -> bool {
    same_identity(&a.identity, &b.identity, same_process(a, b))
}

/// [`same_device`] over bare identities, `one_process` saying whether both were made
/// by one process.
pub(crate) fn same_identity(a: &DeviceIdentity, b: &DeviceIdentity, one_process: bool) -> bool {
    a.same_device(b)
        .unwrap_or(one_process && a.ordinal() == b.ordinal())
}

/// The most ranks of the group on one physical device (at least 1).
pub(crate) fn ranks_per_device(records: &[PeerRecord]) -> usize {
    records
        .iter()
        .map(|p| records.iter().filter(|q| same_device(p, q)).count())
        .max()
        .unwrap_or(1)
}

/// The refusal of the first two ranks (`members`: their world ranks) on one physical
/// device, if any.
pub(crate) fn first_shared_device(records: &[PeerRecord], members: &[usize]) -> Option<Error> {
    for (i, p) in records.iter().enumerate() {
        for (j, q) in records.iter().enumerate().skip(i + 1) {
            if same_device(p, q) {
                return Some(shared_device_error(
                    members[i],
                    &p.identity,
                    members[j],
                    &q.identity,
                ));
            }
        }
    }
    None
}

/// Why ranks `a` (on `ia`) and `b` (on `ib`) may not share their device.
pub(crate) fn shared_device_error(
    a: usize,
    ia: &DeviceIdentity,
    b: usize,
    ib: &DeviceIdentity,
) -> Error {
    Error::InvalidDevices(format!(
        "ranks {a} and {b} are on the same physical device: rank {a} on {ia}, rank {b} on \
         {ib} (ordinals as each rank's process sees them); give each rank its own GPU, or \
         set CommConfig::allow_shared_devices to share one on purpose (tests, MPS)"
    ))
}

/// Checks what rank `r` reported against this rank's own record.
pub(crate) fn check_peer_record(
    me: usize,
    r: usize,
    mine: &PeerRecord,
    peer: &PeerRecord,
) -> Result<()> {
    if peer.arch != mine.arch {
        return Err(Error::InvalidDevices(format!(
            "rank {r} runs on {} and rank {me} on {}: one architecture per communicator",
            peer.arch, mine.arch
        )));
    }
    Ok(())
}
