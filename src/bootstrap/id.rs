//! [`UniqueId`]: rank 0's address and secret, its text and byte forms, and the
//! process-wide registry of the listeners of ids made here.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs};
use std::str::FromStr;
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::error::{io_error, BootstrapError, Result};
use super::mac::random;
use super::{BOOTSTRAP_ADDR_ENV, ID_FORMAT_VERSION, SECRET_BYTES};

/// Rank 0's address and a 128-bit random secret that every connection must prove it
/// knows (by challenge-response; the secret never crosses the wire).
///
/// Text form (`Display`, [`str::parse`]): [`UniqueId::BYTES`] bytes in hex. Byte form:
/// format version (1), address family (4 or 6), IP address (16 bytes, IPv4 in the first
/// 4), port (`u16` BE), secret (16 bytes), FNV-1a checksum (`u32` LE) of the first 36
/// bytes, so a garbled id is [`BootstrapError::InvalidId`], not a wrong secret. IPv6
/// scope ids are not carried. `Debug` hides the secret; both forms carry it, so pass them
/// through the environment, a 0600 file or a store, never on the command line.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId {
    pub(super) addr: SocketAddr,
    pub(super) secret: [u8; SECRET_BYTES],
}

/// What the registry holds for an id made in this process.
enum Slot {
    /// Made, rank 0 has not joined yet.
    Listening(TcpListener),
    /// Rank 0 joined (or the id was released): the listener is gone.
    Used,
}

fn registry() -> MutexGuard<'static, HashMap<[u8; SECRET_BYTES], Slot>> {
    static REGISTRY: OnceLock<Mutex<HashMap<[u8; SECRET_BYTES], Slot>>> = OnceLock::new();
    REGISTRY
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

impl UniqueId {
    /// Length of [`UniqueId::to_bytes`].
    pub const BYTES: usize = 40;

    /// Makes an id for a new communicator (on rank 0): binds a listener on
    /// [`BOOTSTRAP_ADDR_ENV`] if set, else on `127.0.0.1` (same host only), at a free
    /// port unless the variable names one, and draws the secret from the OS.
    pub fn new() -> Result<Self> {
        let addr = match std::env::var(BOOTSTRAP_ADDR_ENV) {
            Ok(v) if !v.trim().is_empty() => parse_bootstrap_addr(&v)?,
            Ok(_) | Err(std::env::VarError::NotPresent) => {
                SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
            }
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(BootstrapError::InvalidAddress {
                    value: v.to_string_lossy().into_owned(),
                    reason: format!("{BOOTSTRAP_ADDR_ENV} is not valid UTF-8"),
                })
            }
        };
        Self::bind(addr)
    }

    /// As [`UniqueId::new`], listening on `addr` (port 0 picks a free port). `addr` must
    /// be one the other ranks can connect to, not `0.0.0.0` or `::`.
    pub fn bind(addr: SocketAddr) -> Result<Self> {
        specified(addr, &addr.to_string())?;
        let listener = TcpListener::bind(addr)
            .map_err(|e| io_error(format!("binding the bootstrap listener on {addr}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| io_error("reading the bootstrap listener's address", e))?;
        let secret = random("the bootstrap secret")?;
        registry().insert(secret, Slot::Listening(listener));
        Ok(Self { addr, secret })
    }

    /// Rank 0's address, which the other ranks connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The id as bytes, for a transport that carries bytes (MPI, a key-value store).
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let head = match self.addr.ip() {
            IpAddr::V4(ip) => [&[ID_FORMAT_VERSION, 4], &ip.octets()[..], &[0; 12]].concat(),
            IpAddr::V6(ip) => [&[ID_FORMAT_VERSION, 6], &ip.octets()[..]].concat(),
        };
        let mut b = [&head[..], &self.addr.port().to_be_bytes(), &self.secret].concat();
        b.extend_from_slice(&fnv1a32(&b).to_le_bytes());
        b.try_into().expect("40 bytes")
    }

    /// Reads an id written by [`UniqueId::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let invalid = |reason: String| Err(BootstrapError::InvalidId { reason });
        let (len, want) = (bytes.len(), Self::BYTES);
        if len != want {
            return invalid(format!("{len} bytes where a UniqueId has {want}"));
        }
        if bytes[0] != ID_FORMAT_VERSION {
            return invalid(format!(
                "format version {} where this peercomm reads version {ID_FORMAT_VERSION} \
                 (every process must run the same peercomm)",
                bytes[0]
            ));
        }
        let sum = u32::from_le_bytes(bytes[36..40].try_into().expect("4 bytes"));
        if sum != fnv1a32(&bytes[..36]) {
            return invalid("its checksum does not match: it was garbled in transit".into());
        }
        let ip: [u8; 16] = bytes[2..18].try_into().expect("16 bytes");
        let ip = match bytes[1] {
            4 if ip[4..].iter().all(|&x| x == 0) => IpAddr::from([ip[0], ip[1], ip[2], ip[3]]),
            6 => IpAddr::from(ip),
            f => {
                return invalid(format!(
                    "address family {f} (with its padding) is not 4 or 6"
                ))
            }
        };
        let addr = SocketAddr::new(ip, u16::from_be_bytes([bytes[18], bytes[19]]));
        if addr.port() == 0 || ip.is_unspecified() {
            return invalid(format!("address {addr} cannot be connected to"));
        }
        let secret = bytes[20..36].try_into().expect("16 bytes");
        Ok(Self { addr, secret })
    }

    /// Closes this id's listener if this process made it and rank 0 has not joined;
    /// returns whether it did. Rank 0 can then no longer use the id in this process
    /// ([`BootstrapError::StaleId`]); a rank 0 elsewhere binds the address itself.
    pub fn release(&self) -> bool {
        matches!(
            registry().insert(self.secret, Slot::Used),
            Some(Slot::Listening(_))
        )
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("UniqueId");
        d.field("addr", &self.addr);
        d.field("secret", &format_args!("<hidden>")).finish()
    }
}

impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.to_bytes()
            .iter()
            .try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl FromStr for UniqueId {
    type Err = BootstrapError;

    /// Reads the text form (surrounding whitespace is ignored; either case of hex).
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        let invalid = |reason| Err(BootstrapError::InvalidId { reason });
        let len = 2 * Self::BYTES;
        if s.len() != len {
            let n = s.chars().count();
            return invalid(format!(
                "{n} characters where a UniqueId has {len} hexadecimal ones"
            ));
        }
        let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        let mut bytes = [0u8; Self::BYTES];
        for (i, pair) in s.as_bytes().chunks(2).enumerate() {
            let (Some(hi), Some(lo)) = (hex(pair[0]), hex(pair[1])) else {
                let at = 2 * i;
                return invalid(format!(
                    "a character that is not hexadecimal near position {at}"
                ));
            };
            bytes[i] = hi << 4 | lo;
        }
        Self::from_bytes(&bytes)
    }
}

pub(super) fn fnv1a32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// `addr`, unless it is unspecified (`0.0.0.0`, `::`): no rank can connect to that.
fn specified(addr: SocketAddr, value: &str) -> Result<SocketAddr> {
    if !addr.ip().is_unspecified() {
        return Ok(addr);
    }
    Err(BootstrapError::InvalidAddress {
        value: value.to_string(),
        reason: format!(
            "an unspecified address cannot be connected to: name an address of rank 0's \
             host that the other ranks can reach (e.g. 10.0.0.5 or 10.0.0.5:29500) in \
             {BOOTSTRAP_ADDR_ENV}"
        ),
    })
}

/// Reads a bootstrap address: `ip:port`, `ip`, `host:port` or `host` (a missing port is
/// port 0, a free one).
pub(super) fn parse_bootstrap_addr(value: &str) -> Result<SocketAddr> {
    let v = value.trim();
    let value = value.to_string();
    let invalid = |reason| BootstrapError::InvalidAddress {
        value: value.clone(),
        reason,
    };
    let bare = v.trim_start_matches('[').trim_end_matches(']');
    let addr = if let Ok(a) = v.parse::<SocketAddr>() {
        a
    } else if let Ok(ip) = bare.parse::<IpAddr>() {
        SocketAddr::new(ip, 0)
    } else {
        let resolved = if v.contains(':') {
            v.to_socket_addrs()
        } else {
            (v, 0).to_socket_addrs()
        };
        resolved
            .map_err(|e| {
                invalid(format!(
                    "not an address and not a host name that resolves ({e}): give an IP \
                     address or host name with an optional port, e.g. 10.0.0.5:29500"
                ))
            })?
            .next()
            .ok_or_else(|| invalid("the host name resolves to no address".into()))?
    };
    specified(addr, &value)
}

/// Takes the listener of an id rank 0 is about to use: `Some` if this process made the
/// id, `None` if another did (rank 0 binds itself), [`BootstrapError::StaleId`] if rank
/// 0 already used it here.
pub(super) fn claim_listener(id: &UniqueId) -> Result<Option<TcpListener>> {
    match registry().insert(id.secret, Slot::Used) {
        Some(Slot::Listening(l)) => Ok(Some(l)),
        Some(Slot::Used) => Err(BootstrapError::StaleId),
        None => Ok(None),
    }
}
