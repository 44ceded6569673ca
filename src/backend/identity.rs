//! Which physical device a rank runs on, whatever ordinal its process gives it: with
//! `CUDA_VISIBLE_DEVICES` every process may see its GPU as device 0, so devices are told
//! apart by UUID, else PCI bus id, as NCCL does ([`DeviceIdentity::same_device`]).

/// One device as a process sees it: its ordinal there and what names it physically (UUID,
/// PCI location). Made by [`crate::Backend::identity`].
///
/// ```
/// use peercomm::backend::{host::Host, Backend, DeviceIdentity};
///
/// let id = Host::identity(&Host::open(3)?)?;
/// assert_eq!(id.ordinal(), 3);
/// assert_eq!(id, DeviceIdentity::simulated(3, 3)); // deterministic per ordinal
/// assert_eq!(id.pci_bus_id(), Some("0000:03:00.0"));
/// assert!(id.uuid_string().unwrap().starts_with("GPU-"));
/// // Isolated processes (CUDA_VISIBLE_DEVICES): both see device 0, but not one GPU.
/// let (a, b) = (DeviceIdentity::simulated(0, 0), DeviceIdentity::simulated(0, 1));
/// assert_eq!(a.same_device(&b), Some(false));
/// # Ok::<(), peercomm::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DeviceIdentity {
    ordinal: usize,
    uuid: Option<[u8; 16]>,
    pci_bus_id: Option<String>,
}

impl DeviceIdentity {
    /// An identity from what the runtime reported: the ordinal, the UUID (`None` or all
    /// zeros when unknown) and the PCI bus id (`0000:19:00.0`; an 8-digit or missing
    /// domain is normalised to 4 digits, unparsable text kept in lower case).
    pub fn new(ordinal: usize, uuid: Option<[u8; 16]>, pci_bus_id: Option<&str>) -> Self {
        DeviceIdentity {
            ordinal,
            uuid: uuid.filter(|u| u.iter().any(|&b| b != 0)),
            pci_bus_id: pci_bus_id
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .map(|t| normalize_pci_bus_id(t).unwrap_or_else(|| t.to_ascii_lowercase())),
        }
    }

    /// The host backend's deterministic identity for device `ordinal` standing for
    /// physical device `physical`: UUID `peercomm` + `physical` (BE), PCI bus id with
    /// `physical`'s low byte as bus and next 16 bits as domain. Device `o` is
    /// `simulated(o, o)` unless `Simulation::physical_devices` (`fault-injection`) says.
    pub fn simulated(ordinal: usize, physical: usize) -> Self {
        let mut uuid = [0u8; 16];
        uuid[..8].copy_from_slice(b"peercomm");
        uuid[8..].copy_from_slice(&(physical as u64).to_be_bytes());
        let (domain, bus) = ((physical >> 8) as u32 & 0xffff, (physical & 0xff) as u32);
        let pci = pci_bus_id(domain, bus, 0, 0);
        DeviceIdentity::new(ordinal, Some(uuid), Some(&pci))
    }

    /// The ordinal in the process that made this identity (meaningless elsewhere).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's UUID, when the runtime reports one.
    pub fn uuid(&self) -> Option<[u8; 16]> {
        self.uuid
    }

    /// The UUID as `nvidia-smi -L` writes it (`GPU-` then 8-4-4-4-12 hex digits).
    pub fn uuid_string(&self) -> Option<String> {
        self.uuid.map(|u| {
            let hex = |r: std::ops::Range<usize>| -> String {
                u[r].iter().map(|b| format!("{b:02x}")).collect()
            };
            let groups = [0..4, 4..6, 6..8, 8..10, 10..16].map(hex);
            format!("GPU-{}", groups.join("-"))
        })
    }

    /// The PCI bus id, `dddd:bb:dd.f` in lower-case hexadecimal, when known.
    pub fn pci_bus_id(&self) -> Option<&str> {
        self.pci_bus_id.as_deref()
    }

    /// Whether two identities of one host name the same physical device: by UUID when
    /// both have one (MIG instances have their own), else by PCI bus id; `None` when
    /// neither tells. Ordinals are never compared.
    pub fn same_device(&self, other: &DeviceIdentity) -> Option<bool> {
        match (self.uuid, other.uuid) {
            (Some(a), Some(b)) => Some(a == b),
            _ => Some(self.pci_bus_id.as_ref()? == other.pci_bus_id.as_ref()?),
        }
    }

    /// The physical part, for messages: `GPU-..., PCI 0000:19:00.0` (or "unknown").
    pub fn physical(&self) -> String {
        let uuid = self.uuid_string();
        let pci = self.pci_bus_id.as_deref().unwrap_or("unknown");
        format!("{}, PCI {pci}", uuid.as_deref().unwrap_or("UUID unknown"))
    }
}

impl std::fmt::Display for DeviceIdentity {
    /// `device 0 (GPU-..., PCI 0000:19:00.0)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "device {} ({})", self.ordinal, self.physical())
    }
}

/// A PCI bus id from its parts, as the runtimes write it: `dddd:bb:dd.f`.
pub(crate) fn pci_bus_id(domain: u32, bus: u32, device: u32, function: u32) -> String {
    format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}")
}

/// `[domain:]bus:device.function` in the canonical form, or `None`.
fn normalize_pci_bus_id(text: &str) -> Option<String> {
    let hex = |s: &str, digits: usize| {
        (!s.is_empty() && s.len() <= digits)
            .then(|| u32::from_str_radix(s, 16).ok())
            .flatten()
    };
    let (location, function) = text.rsplit_once('.')?;
    let parts: Vec<&str> = location.split(':').collect();
    let (domain, bus, device) = match parts[..] {
        [d, b, dev] => (hex(d, 8)?, hex(b, 2)?, hex(dev, 2)?),
        [b, dev] => (0, hex(b, 2)?, hex(dev, 2)?),
        _ => return None,
    };
    Some(pci_bus_id(domain, bus, device, hex(function, 1)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_bus_ids_are_normalised() {
        let id = |t: &str| DeviceIdentity::new(0, None, Some(t));
        assert_eq!(id("0000:19:00.0").pci_bus_id(), Some("0000:19:00.0"));
        assert_eq!(id("00000000:19:00.0").pci_bus_id(), Some("0000:19:00.0"));
        assert_eq!(id("0000:AB:1F.7").pci_bus_id(), Some("0000:ab:1f.7"));
        assert_eq!(id("19:00.0").pci_bus_id(), Some("0000:19:00.0"));
        assert_eq!(id("Weird").pci_bus_id(), Some("weird"));
        assert_eq!(id(" ").pci_bus_id(), None);
    }

    #[test]
    fn the_uuid_decides_then_the_pci_bus_id() {
        let uuid = |b: u8| Some([b; 16]);
        // Same UUID, different ordinals (two processes, different visible sets).
        let a = DeviceIdentity::new(0, uuid(1), Some("0000:19:00.0"));
        let b = DeviceIdentity::new(3, uuid(1), Some("0000:19:00.0"));
        assert_eq!(a.same_device(&b), Some(true));
        // Two MIG instances of one GPU: UUIDs differ, PCI agrees.
        let c = DeviceIdentity::new(0, uuid(2), Some("0000:19:00.0"));
        assert_eq!(a.same_device(&c), Some(false));
        // No UUID on one side: the PCI bus id decides.
        let d = DeviceIdentity::new(0, None, Some("0000:19:00.0"));
        let e = DeviceIdentity::new(0, uuid(1), Some("0000:1a:00.0"));
        assert_eq!(a.same_device(&d), Some(true));
        assert_eq!(d.same_device(&e), Some(false));
        // Nothing in common: unknown, whatever the ordinals.
        let f = DeviceIdentity::new(0, None, None);
        assert_eq!(f.same_device(&f.clone()), None);
        assert_eq!(a.same_device(&f), None);
        // An all-zero UUID is no UUID.
        assert_eq!(DeviceIdentity::new(0, Some([0; 16]), None).uuid(), None);
    }

    #[test]
    fn texts() {
        let u: [u8; 16] = std::array::from_fn(|i| i as u8 * 0x11);
        let id = DeviceIdentity::new(2, Some(u), Some("0000:19:00.0"));
        assert_eq!(
            id.uuid_string().unwrap(),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
        assert_eq!(
            id.to_string(),
            "device 2 (GPU-00112233-4455-6677-8899-aabbccddeeff, PCI 0000:19:00.0)"
        );
        assert_eq!(
            DeviceIdentity::new(1, None, None).to_string(),
            "device 1 (UUID unknown, PCI unknown)"
        );
    }

    #[test]
    fn simulated_identities_are_deterministic_and_distinct() {
        let sim = DeviceIdentity::simulated;
        assert_eq!(sim(0, 5), sim(0, 5));
        assert_eq!(sim(0, 5).same_device(&sim(7, 5)), Some(true));
        let ids: Vec<_> = (0..600).map(|p| sim(0, p)).collect();
        for (i, a) in ids.iter().enumerate() {
            for b in &ids[i + 1..] {
                assert_ne!(a.uuid(), b.uuid());
                assert_ne!(a.pci_bus_id(), b.pci_bus_id());
            }
        }
        assert_eq!(sim(0, 0x1_23).pci_bus_id(), Some("0001:23:00.0"));
    }
}
