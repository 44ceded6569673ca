//! Connecting a rank: which mode serves its world (peer memory, the external library,
//! or both across hosts), then the peer setup and the external handles.

use std::sync::Arc;

use crate::backend::Backend;
use crate::bootstrap::{Bootstrap, HostId};
use crate::error::{Error, Result};
use crate::external::sub::SubBootstrap;
use crate::external::{Fallback, SizeRouting};
use crate::signal::MAX_GPUS;

use crate::comm::core::routing::{Mode, Router};
use crate::comm::core::setup::{self, Outcome, RankProcesses};
use crate::comm::core::Rank;
use crate::comm::CommConfig;

/// The ranks grouped by host: `Some(local)` when every host holds `local` consecutive
/// ranks, and how many hosts there are.
fn host_layout(hosts: &[HostId]) -> (usize, Option<usize>) {
    let world = hosts.len();
    let n = (0..world)
        .filter(|&i| !hosts[..i].contains(&hosts[i]))
        .count();
    if !world.is_multiple_of(n) {
        return (n, None);
    }
    // n uniform chunks over n distinct hosts: each host is one chunk.
    let local = world / n;
    let regular = hosts.chunks(local).all(|c| c.iter().all(|h| *h == c[0]));
    (n, regular.then_some(local))
}

/// Sets up one rank's core and routing, every world rank at once: peer memory where it
/// serves, the external library where not (or a typed error with [`Fallback::Refuse`]).
/// `bootstrap` carries the setup's exchanges, `external` the library's; with
/// [`RankProcesses::OneProcess`] the front door makes the external handles.
pub(crate) fn connect<B: Backend>(
    device: B::Device,
    bootstrap: Arc<dyn Bootstrap>,
    external: Arc<dyn Bootstrap>,
    hosts: &[HostId],
    config: &CommConfig,
    placement: RankProcesses,
) -> Result<Rank<B>> {
    let (me, world) = (bootstrap.rank(), bootstrap.world_size());
    let refuse = config.fallback.fallback == Fallback::Refuse;
    let (n_hosts, local) = host_layout(hosts);
    let candidate = if n_hosts == 1 && world <= MAX_GPUS {
        Mode::Peer
    } else if refuse {
        return Err(if n_hosts > 1 {
            Error::Unsupported(format!(
                "the ranks run on several hosts ({:?}); peer memory serves one host only \
                 (FallbackConfig::fallback = External hands such worlds to NCCL/RCCL)",
                hosts.iter().map(HostId::as_str).collect::<Vec<_>>()
            ))
        } else {
            Error::InvalidWorldSize {
                got: world,
                max: MAX_GPUS,
            }
        });
    } else {
        match local {
            Some(l) if n_hosts > 1 && (2..=MAX_GPUS).contains(&l) => {
                Mode::Hierarchical { local: l }
            }
            _ => Mode::External,
        }
    };
    let members: Vec<usize> = match candidate {
        Mode::Peer => (0..world).collect(),
        Mode::Hierarchical { local } => (me / local * local..(me / local + 1) * local).collect(),
        Mode::External => vec![me],
    };
    let (core, mode) = if members.len() > 1 || candidate == Mode::Peer {
        let group: Box<dyn Bootstrap> = if members.len() == world {
            Box::new(bootstrap.clone())
        } else {
            Box::new(SubBootstrap::new(bootstrap.clone(), members.clone()))
        };
        match setup::establish::<B>(device, &*group, &*bootstrap, &members, config, placement)? {
            Outcome::Ready(core) => (*core, candidate),
            Outcome::Refused { reason, .. } if refuse => return Err(reason),
            Outcome::Refused { device, .. } => (setup::solo(device, config)?, Mode::External),
        }
    } else {
        (setup::solo(device, config)?, Mode::External)
    };
    let library = crate::external::library_of::<B>();
    let external_group: Option<Vec<usize>> = match mode {
        Mode::External => Some((0..world).collect()),
        Mode::Hierarchical { local } => {
            let k = me % local;
            Some((0..world / local).map(|h| h * local + k).collect())
        }
        Mode::Peer if config.fallback.by_size != SizeRouting::Never => Some((0..world).collect()),
        Mode::Peer => None,
    };
    let external = match (external_group, placement) {
        (Some(group), RankProcesses::Anywhere) => {
            Some(library.per_rank(&core.endpoint.device, external, &group)?)
        }
        _ => None,
    };
    let route = Router {
        mode,
        world,
        world_rank: me,
        external,
        by_size: config.fallback.by_size,
        arch: core.settings.arch.clone(),
    };
    Ok(Rank::new(core, route))
}

/// Whether a single controller's cores over `world` devices need external handles:
/// when peer memory does not serve the world, or calls are routed by size.
pub(crate) fn needs_external<B: Backend>(core: &Rank<B>, world: usize) -> bool {
    world > 1 && (core.route.mode != Mode::Peer || core.route.by_size != SizeRouting::Never)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_layouts() {
        let h = |v: &[&str]| v.iter().map(|s| HostId::new(*s)).collect::<Vec<_>>();
        assert_eq!(host_layout(&h(&["a", "a"])), (1, Some(2)));
        assert_eq!(host_layout(&h(&["a", "a", "b", "b"])), (2, Some(2)));
        assert_eq!(host_layout(&h(&["a", "b", "a", "b"])), (2, None));
        assert_eq!(host_layout(&h(&["a", "a", "b"])), (2, None));
        assert_eq!(host_layout(&h(&["a", "b", "c"])), (3, Some(1)));
    }
}
