//! The id and the local checks that need no handshake.

use super::*;
use crate::bootstrap::host::host_identity_from;
use crate::bootstrap::id::{fnv1a32, parse_bootstrap_addr};

#[test]
fn id_round_trips_as_bytes_and_text() {
    let id = loopback_id();
    assert!(id.release());
    assert_eq!(UniqueId::from_bytes(&id.to_bytes()).unwrap(), id);
    let text = id.to_string();
    assert_eq!(text.len(), 2 * UniqueId::BYTES);
    let lower_hex = |c: u8| c.is_ascii_hexdigit() && !c.is_ascii_uppercase();
    assert!(text.bytes().all(lower_hex));
    assert_eq!(text.parse::<UniqueId>().unwrap(), id);
    let spaced_upper = format!(" {}\n", text.to_uppercase());
    assert_eq!(spaced_upper.parse::<UniqueId>().unwrap(), id);
    let v6 = UniqueId {
        addr: "[fd00::5]:29500".parse().unwrap(),
        secret: *b"0123456789abcdef",
    };
    assert_eq!(v6.to_string().parse::<UniqueId>().unwrap(), v6);
    // Debug shows the address, never the secret (in hex or raw).
    let debug = format!("{v6:?}");
    assert!(debug.contains("fd00::5"), "{debug}");
    let secret_hex: String = v6.secret.iter().map(|b| format!("{b:02x}")).collect();
    assert!(!debug.contains(&secret_hex) && !debug.contains("0123456789abcdef"));
}

#[test]
fn garbled_ids_are_typed_errors() {
    let id = loopback_id();
    id.release();
    let text = id.to_string();
    let invalid = |s: &str| match s.parse::<UniqueId>() {
        Err(BootstrapError::InvalidId { reason }) => reason,
        other => panic!("{s:?} parsed as {other:?}"),
    };
    assert!(invalid("").contains("0 characters"));
    assert!(invalid(&text[..79]).contains("79 characters"));
    assert!(invalid(&format!("{text}0")).contains("81 characters"));
    assert!(invalid(&format!("{}g{}", &text[..10], &text[11..])).contains("not hexadecimal"));
    // One digit changed anywhere past the version byte: the checksum catches it.
    for pos in [2, 10, 40, 60, 79] {
        let mut t = text.clone().into_bytes();
        t[pos] = if t[pos] == b'0' { b'1' } else { b'0' };
        let t = String::from_utf8(t).unwrap();
        assert!(invalid(&t).contains("checksum"), "position {pos}");
    }
    assert!(invalid(&format!("02{}", &text[2..])).contains("format version 2"));
    // Well-formed checksums over bad contents.
    let reason = |b: &[u8]| match UniqueId::from_bytes(b) {
        Err(BootstrapError::InvalidId { reason }) => reason,
        other => panic!("parsed as {other:?}"),
    };
    // The address family, then the port.
    for (field, value, says) in [(1..2, 5, "family 5"), (18..20, 0, "cannot be connected to")] {
        let mut b = id.to_bytes();
        b[field].fill(value);
        let sum = fnv1a32(&b[..36]);
        b[36..].copy_from_slice(&sum.to_le_bytes());
        assert!(reason(&b).contains(says), "{says}");
    }
    assert!(reason(&id.to_bytes()[..39]).contains("39 bytes"));
}

#[test]
fn addresses_are_parsed_and_unspecified_ones_refused() {
    let p = |s: &str| parse_bootstrap_addr(s).unwrap();
    assert_eq!(p("10.0.0.5:29500"), "10.0.0.5:29500".parse().unwrap());
    assert_eq!(p(" 10.0.0.5 "), "10.0.0.5:0".parse().unwrap());
    assert_eq!(p("[fd00::5]:7"), "[fd00::5]:7".parse().unwrap());
    assert_eq!(p("fd00::5"), "[fd00::5]:0".parse().unwrap());
    assert_eq!(p("[fd00::5]"), "[fd00::5]:0".parse().unwrap());
    assert!(p("localhost:7").ip().is_loopback());
    for bad in [
        "0.0.0.0",
        "0.0.0.0:5",
        "[::]:5",
        "10.0.0.5:99999",
        "no such host!",
    ] {
        assert_is!(parse_bootstrap_addr(bad) => Err(BootstrapError::InvalidAddress { .. }));
    }
    let unspecified = UniqueId::bind("0.0.0.0:0".parse().unwrap());
    assert_is!(unspecified, Err(BootstrapError::InvalidAddress { .. }));
}

#[test]
fn new_id_listens_on_loopback_unless_told() {
    let id = UniqueId::new().unwrap();
    if std::env::var_os(BOOTSTRAP_ADDR_ENV).is_none() {
        assert!(id.addr().ip().is_loopback());
    }
    assert_ne!(id.addr().port(), 0);
    assert!(id.release());
    assert!(!id.release());
}

#[test]
fn local_argument_errors_need_no_network() {
    let id = loopback_id();
    id.release();
    use BootstrapError::{HostIdTooLong, InvalidWorldSize, RankOutOfRange};
    assert_is!(connect(&id, 2, 2, SHORT) => Err(RankOutOfRange { rank: 2, world_size: 2 }));
    assert_is!(connect(&id, 0, 0, SHORT) => Err(InvalidWorldSize { world_size: 0, .. }));
    let long = HostId::new("h".repeat(MAX_HOST_ID_BYTES + 1));
    let e = TcpBootstrap::connect_with_host(&id, 1, 2, SHORT, long);
    assert_is!(e, Err(HostIdTooLong { .. }));
}

#[test]
fn host_identity_is_overridable() {
    let node = host_identity_from(Some(" node-a ".into()));
    assert_eq!(node.as_str(), "node-a");
    let system = host_identity_from(None);
    assert_eq!(host_identity_from(Some("  ".into())), system);
    assert!(!system.as_str().is_empty() && system.as_str().len() <= MAX_HOST_ID_BYTES);
    assert_eq!(system, host_identity_from(None), "stable within a process");
}
