//! [`HostId`] and `host_identity`: which machine a rank runs on.

use std::fmt;

use super::{HOST_ID_OVERRIDE_ENV, MAX_HOST_ID_BYTES};

// Named by doc links only.
#[cfg(doc)]
use super::TcpBootstrap;

/// Which machine (operating-system instance) a rank runs on, as text; equal ids mean
/// one host. Read with `host_identity`; exchanged by [`TcpBootstrap`] during the
/// handshake ([`TcpBootstrap::host_ids`]).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct HostId(pub(super) String);

impl HostId {
    /// A host id from any text (tests, or an engine's own notion of host).
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// This process's host: [`HOST_ID_OVERRIDE_ENV`] if set and not empty, else
/// `hostname/boot-id` (`/proc/sys/kernel/random/boot_id`, else `/etc/machine-id`; unique
/// even where host names repeat), else the host name. Containers sharing a kernel usually
/// differ by host name, so they count as different hosts.
pub fn host_identity() -> HostId {
    host_identity_from(std::env::var(HOST_ID_OVERRIDE_ENV).ok())
}

pub(super) fn host_identity_from(override_value: Option<String>) -> HostId {
    if let Some(v) = override_value.filter(|v| !v.trim().is_empty()) {
        return HostId(v.trim().to_string());
    }
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    let hostname = read("/proc/sys/kernel/hostname")
        .or_else(|| read("/etc/hostname"))
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .or_else(|| std::env::var("COMPUTERNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "unknown-host".into());
    let instance = read("/proc/sys/kernel/random/boot_id")
        .or_else(|| read("/etc/machine-id"))
        .or_else(|| read("/var/lib/dbus/machine-id"));
    let mut id = match instance {
        Some(i) => format!("{hostname}/{i}"),
        None => hostname,
    };
    truncate_utf8(&mut id, MAX_HOST_ID_BYTES);
    HostId(id)
}

pub(super) fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}
