//! Proving the id's secret without sending it: nonces, labelled HMAC-SHA-256 tags checked
//! in constant time, and rank 0's challenge.

use std::io;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::error::{BootstrapError, Result};
use super::frame::frame;
use super::{CHALLENGE_BYTES, KIND_CHALLENGE, MAC_BYTES, NONCE_BYTES, SECRET_BYTES};

/// A fresh random nonce from the OS.
pub(super) fn nonce() -> Result<[u8; NONCE_BYTES]> {
    let mut n = [0u8; NONCE_BYTES];
    getrandom::fill(&mut n).map_err(|e| BootstrapError::Io {
        step: "drawing a handshake nonce from the OS".into(),
        kind: io::ErrorKind::Other,
        detail: e.to_string(),
    })?;
    Ok(n)
}

/// Both sides' nonces of one handshake: every MAC covers both.
#[derive(Clone, Copy)]
pub(super) struct Nonces {
    /// Drawn by rank r > 0, sent in its hello.
    pub(super) leaf: [u8; NONCE_BYTES],
    /// Drawn by rank 0, sent in its challenge.
    pub(super) root: [u8; NONCE_BYTES],
}

/// What each MAC proves; distinct labels, so that no MAC serves as another.
#[derive(Clone, Copy)]
pub(super) enum Label {
    /// Rank 0's answer to a hello (in the challenge).
    Root,
    /// Rank r's answer to the challenge (in the proof), over its announcement.
    Rank,
    /// Rank 0's welcome, over its list of hosts.
    Welcome,
}

impl Label {
    fn bytes(self) -> &'static [u8] {
        match self {
            Label::Root => b"peercomm bootstrap v2: rank 0 knows the secret",
            Label::Rank => b"peercomm bootstrap v2: a rank knows the secret",
            Label::Welcome => b"peercomm bootstrap v2: rank 0 welcomes",
        }
    }
}

/// HMAC-SHA-256 keyed by the id's secret over the label, both nonces, then `tail`.
fn mac(secret: &[u8; SECRET_BYTES], label: Label, n: &Nonces, tail: &[u8]) -> Hmac<Sha256> {
    let mut m =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes a key of any length");
    m.update(label.bytes());
    m.update(&n.leaf);
    m.update(&n.root);
    m.update(tail);
    m
}

pub(super) fn sign(
    secret: &[u8; SECRET_BYTES],
    label: Label,
    n: &Nonces,
    tail: &[u8],
) -> [u8; MAC_BYTES] {
    mac(secret, label, n, tail).finalize().into_bytes().into()
}

/// Checks `tag` in constant time.
pub(super) fn verify(
    secret: &[u8; SECRET_BYTES],
    label: Label,
    n: &Nonces,
    tail: &[u8],
    tag: &[u8],
) -> bool {
    mac(secret, label, n, tail).verify_slice(tag).is_ok()
}

pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Rank 0's challenge: its nonce and its proof of the secret over both nonces.
pub(super) fn encode_challenge(secret: &[u8; SECRET_BYTES], n: &Nonces) -> Vec<u8> {
    let mut b = Vec::with_capacity(CHALLENGE_BYTES);
    b.extend_from_slice(&n.root);
    b.extend_from_slice(&sign(secret, Label::Root, n, &[]));
    frame(KIND_CHALLENGE, &b)
}

/// On rank r: rank 0's nonce from a challenge body, if rank 0's proof in it holds.
pub(super) fn check_challenge(
    body: &[u8],
    secret: &[u8; SECRET_BYTES],
    leaf_nonce: &[u8; NONCE_BYTES],
) -> std::result::Result<Nonces, &'static str> {
    if body.len() != CHALLENGE_BYTES {
        return Err("its challenge has the wrong length");
    }
    let (root, tag) = body.split_at(NONCE_BYTES);
    let n = Nonces {
        leaf: *leaf_nonce,
        root: root.try_into().expect("nonce length"),
    };
    if verify(secret, Label::Root, &n, &[], tag) {
        Ok(n)
    } else {
        Err("its answer to this rank's nonce is not made with this id's secret")
    }
}
