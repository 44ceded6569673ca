//! Proving the id's secret without sending it: nonces, labelled HMAC-SHA-256 tags checked
//! in constant time, and rank 0's challenge.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::error::{BootstrapError, Result};
use super::wire::frame;
use super::{CHALLENGE_BYTES, KIND_CHALLENGE, MAC_BYTES, NONCE_BYTES, SECRET_BYTES};

/// `N` fresh random bytes from the OS (`what` names them in the error).
pub(super) fn random<const N: usize>(what: &str) -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| BootstrapError::Io {
        step: format!("drawing {what} from the OS"),
        kind: std::io::ErrorKind::Other,
        detail: e.to_string(),
    })?;
    Ok(b)
}

/// A fresh handshake nonce.
pub(super) fn nonce() -> Result<[u8; NONCE_BYTES]> {
    random("a handshake nonce")
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

/// One handshake's keys: the id's secret and both sides' nonces, which every MAC covers.
#[derive(Clone, Copy)]
pub(super) struct Keys {
    pub(super) secret: [u8; SECRET_BYTES],
    /// Drawn by rank r > 0, sent in its hello.
    pub(super) leaf: [u8; NONCE_BYTES],
    /// Drawn by rank 0, sent in its challenge.
    pub(super) root: [u8; NONCE_BYTES],
}

impl Keys {
    /// HMAC-SHA-256 keyed by the secret over the label, both nonces, then `tail`.
    fn mac(&self, label: Label, tail: &[u8]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.secret).expect("any key length");
        m.update(match label {
            Label::Root => b"peercomm bootstrap v2: rank 0 knows the secret",
            Label::Rank => b"peercomm bootstrap v2: a rank knows the secret",
            Label::Welcome => b"peercomm bootstrap v2: rank 0 welcomes",
        });
        m.update(&self.leaf);
        m.update(&self.root);
        m.update(tail);
        m
    }

    /// A frame of `kind` whose body is the MAC over `body`, then `body`.
    pub(super) fn signed(&self, label: Label, kind: u8, body: &[u8]) -> Vec<u8> {
        let tag: [u8; MAC_BYTES] = self.mac(label, body).finalize().into_bytes().into();
        frame(kind, &[&tag[..], body].concat())
    }

    /// The rest of a signed `body` if its MAC holds (checked in constant time).
    pub(super) fn open<'a>(&self, label: Label, body: &'a [u8]) -> Option<&'a [u8]> {
        let (tag, rest) = body.split_at_checked(MAC_BYTES)?;
        self.mac(label, rest)
            .verify_slice(tag)
            .is_ok()
            .then_some(rest)
    }

    /// Rank 0's challenge: its nonce and its proof of the secret over both nonces.
    pub(super) fn challenge(&self) -> Vec<u8> {
        let tag: [u8; MAC_BYTES] = self.mac(Label::Root, &[]).finalize().into_bytes().into();
        frame(KIND_CHALLENGE, &[&self.root[..], &tag].concat())
    }
}

pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// On rank r: the handshake's keys from a challenge body, if rank 0's proof in it holds.
pub(super) fn check_challenge(
    body: &[u8],
    secret: &[u8; SECRET_BYTES],
    leaf: &[u8; NONCE_BYTES],
) -> std::result::Result<Keys, &'static str> {
    if body.len() != CHALLENGE_BYTES {
        return Err("its challenge has the wrong length");
    }
    let (root, tag) = body.split_at(NONCE_BYTES);
    let (secret, leaf, root) = (*secret, *leaf, root.try_into().expect("nonce length"));
    let keys = Keys { secret, leaf, root };
    match keys.mac(Label::Root, &[]).verify_slice(tag) {
        Ok(()) => Ok(keys),
        Err(_) => Err("its answer to this rank's nonce is not made with this id's secret"),
    }
}
