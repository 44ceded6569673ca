//! The record every rank sends the others at setup, its wire form, and the rules it is
//! checked by (shared process or device, the agreed grid).

use crate::backend::DeviceIdentity;
use crate::error::{Error, Result};

/// Format version of the per-rank exchange record.
pub(crate) const RECORD_VERSION: u8 = 4;

/// What each rank tells the others at setup.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PeerRecord {
    /// Drawn once per process (`process_token`): equal tokens share a process and reach
    /// each other's memory by address (pids repeat across containers).
    pub(crate) process: u64,
    /// Multiprocessors (host: CPU cores); the grid follows the group's fewest.
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
        let mut r = Reader(bytes);
        if r.take(1).is_some_and(|v| v[0] != RECORD_VERSION) {
            return Err(Error::InvalidConfig(format!(
                "rank {rank} runs another peercomm version (setup record format)"
            )));
        }
        let mut read = || -> Option<PeerRecord> {
            let (process, multiprocessors) = (r.u64()?, r.u32()?);
            let (ordinal, signal_addr) = (r.u64()? as usize, r.u64()?);
            let uuid: [u8; 16] = r.take(16)?.try_into().ok()?;
            let (pci, arch) = (r.text()?, r.text()?);
            let identity = DeviceIdentity::new(ordinal, Some(uuid), Some(&pci));
            Some(PeerRecord {
                process,
                multiprocessors,
                identity,
                signal_addr,
                arch,
            })
        };
        read().ok_or_else(|| {
            Error::InvalidConfig(format!("rank {rank} sent a malformed setup record"))
        })
    }
}

/// Reads little-endian fields off the front of a wire record; `None` past its end.
pub(crate) struct Reader<'a>(pub(crate) &'a [u8]);

impl<'a> Reader<'a> {
    /// The next `n` bytes.
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, tail) = self.0.split_at_checked(n)?;
        self.0 = tail;
        Some(head)
    }
    pub(crate) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    pub(crate) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    /// Text written by [`put_text`].
    pub(crate) fn text(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
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

/// Whether two ranks are on one physical device by identity (UUID, else PCI bus id); with
/// neither, ranks of one process compare ordinals, of two processes differ.
pub(crate) fn same_device(a: &PeerRecord, b: &PeerRecord) -> bool {
    same_identity(&a.identity, &b.identity, same_process(a, b))
}

/// [`same_device`] over bare identities (`one_process`: both made by one process).
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
                let (a, b) = (members[i], members[j]);
                return Some(shared_device_error(a, &p.identity, b, &q.identity));
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
