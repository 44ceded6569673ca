//! Peer access between the devices of one process, enabled once per ordered pair and
//! remembered process-wide (re-exported at the crate root: [`crate::enable_p2p`],
//! [`crate::is_p2p_enabled`]).

use std::collections::HashSet;
use std::sync::Mutex;

use super::Backend;
use crate::error::Result;

/// (backend name, from ordinal, to ordinal) whose peer access this process enabled.
type PeerPair = (&'static str, usize, usize);
static ENABLED_PEERS: Mutex<Option<HashSet<PeerPair>>> = Mutex::new(None);

/// The ordered pairs of distinct devices (by ordinal) of `devices`.
fn pairs<B: Backend>(devices: &[B::Device]) -> impl Iterator<Item = (&B::Device, &B::Device)> {
    let all = move |a| devices.iter().map(move |b| (a, b));
    devices
        .iter()
        .flat_map(all)
        .filter(|(a, b)| B::ordinal(a) != B::ordinal(b))
}

/// Enables peer access between every ordered pair of `devices`. Returns `Ok(false)`
/// (and enables nothing more) when some pair cannot reach each other; never panics.
pub fn enable_p2p<B: Backend>(devices: &[B::Device]) -> Result<bool> {
    for (a, b) in pairs::<B>(devices) {
        if !B::can_access_peer(a, b)? {
            return Ok(false);
        }
    }
    let mut enabled = ENABLED_PEERS.lock().unwrap_or_else(|e| e.into_inner());
    let set = enabled.get_or_insert_with(HashSet::new);
    for (a, b) in pairs::<B>(devices) {
        B::enable_peer_access(a, b)?;
        set.insert((B::NAME, B::ordinal(a), B::ordinal(b)));
    }
    Ok(true)
}

/// Whether [`enable_p2p`] has enabled peer access between every ordered pair of these
/// devices in this process.
pub fn is_p2p_enabled<B: Backend>(devices: &[B::Device]) -> bool {
    let enabled = ENABLED_PEERS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(set) = enabled.as_ref() else {
        return devices.len() <= 1;
    };
    pairs::<B>(devices).all(|(a, b)| set.contains(&(B::NAME, B::ordinal(a), B::ordinal(b))))
}
