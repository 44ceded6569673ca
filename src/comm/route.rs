//! Routing: which calls peer memory serves and which go to the external library
//! (see [`crate::external`] for the rules a user sees). Decided once at setup, the
//! same on every rank (from what every rank knows: host identities, world size, and
//! what the peer setup agreed), then per call from the call's group width and size.

use std::sync::Arc;

use crate::backend::Backend;
use crate::bootstrap::{Bootstrap, HostId};
use crate::dispatch::{self, Algorithm};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::external::sub::SubBootstrap;
use crate::external::{library_of, ExternalAllReduce, Fallback, SizeRouting};
use crate::signal::MAX_GPUS;

use super::peer_setup::{self, Outcome, PeerCore};
use super::settings::Settings;
use super::{AllReduceOptions, CommConfig, Rank};

/// How a communicator runs its whole-world calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Peer memory over the whole world.
    Peer,
    /// The external library over the whole world; peer memory serves groups of one.
    External,
    /// Ranks on several hosts of `local` consecutive ranks each: peer memory inside a
    /// host, the external library across hosts.
    Hierarchical { local: usize },
}

/// What runs one call.
pub(super) enum Path {
    /// The peer-memory kernels of the local core, with these (local) options.
    Peer(AllReduceOptions),
    /// The external library over the world.
    External,
    /// Peer memory inside each host, the external library across.
    Hierarchical,
}

/// The routing state of a communicator (the same on every rank).
pub(super) struct Router<B: Backend> {
    pub(super) mode: Mode,
    pub(super) world: usize,
    pub(super) world_rank: usize,
    /// The external handle: over the world (`External`, or `Peer` with routing by
    /// size), or over this rank's slice group across hosts (`Hierarchical`).
    pub(super) external: Option<Box<dyn ExternalAllReduce<B>>>,
    by_size: SizeRouting,
    arch: String,
}

/// A per-rank world of `world` ranks is allowed: more than `MAX_GPUS` only with the
/// fallback on.
pub(super) fn check_world(world: usize, config: &CommConfig) -> Result<()> {
    if world == 0 || (world > MAX_GPUS && config.fallback.fallback == Fallback::Refuse) {
        return Err(Error::InvalidWorldSize {
            got: world,
            max: MAX_GPUS,
        });
    }
    Ok(())
}

/// The ranks grouped by host: `Some(local)` when every host holds `local` consecutive
/// ranks, and how many hosts there are.
fn host_layout(hosts: &[HostId]) -> (usize, Option<usize>) {
    let mut distinct: Vec<&HostId> = Vec::new();
    for h in hosts {
        if !distinct.contains(&h) {
            distinct.push(h);
        }
    }
    let n = distinct.len();
    let world = hosts.len();
    if !world.is_multiple_of(n) {
        return (n, None);
    }
    let local = world / n;
    let regular = hosts.chunks(local).all(|c| c.iter().all(|h| *h == c[0]))
        && hosts
            .chunks(local)
            .enumerate()
            .all(|(i, c)| hosts.chunks(local).take(i).all(|d| d[0] != c[0]));
    (n, regular.then_some(local))
}

/// Sets up a per-rank communicator's core and routing: peer memory where it serves,
/// the external library where it does not (or a typed error with
/// [`Fallback::Refuse`]). Every world rank calls this at the same time.
pub(super) fn connect<B: Backend>(
    device: B::Device,
    bootstrap: Arc<dyn Bootstrap>,
    hosts: &[HostId],
    config: &CommConfig,
) -> Result<(PeerCore<B>, Router<B>)> {
    let (me, world) = (bootstrap.rank(), bootstrap.world_size());
    let refuse = config.fallback.fallback == Fallback::Refuse;
    let (n_hosts, local) = host_layout(hosts);
    let names = || hosts.iter().map(HostId::as_str).collect::<Vec<_>>();
    let candidate = if n_hosts == 1 && world <= MAX_GPUS {
        Mode::Peer
    } else if refuse {
        return Err(if n_hosts > 1 {
            Error::Unsupported(format!(
                "the ranks run on several hosts ({:?}); peer memory serves one host only \
                 (FallbackConfig::fallback = External hands such worlds to NCCL/RCCL)",
                names()
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
        match peer_setup::establish::<B>(device, &*group, &*bootstrap, &members, config)? {
            Outcome::Ready(core) => (*core, candidate),
            Outcome::Refused { reason, .. } if refuse => return Err(reason),
            Outcome::Refused { device, .. } => (peer_setup::solo(device, config)?, Mode::External),
        }
    } else {
        (peer_setup::solo(device, config)?, Mode::External)
    };
    let library = library_of::<B>();
    let external_group: Option<Vec<usize>> = match mode {
        Mode::External => Some((0..world).collect()),
        Mode::Hierarchical { local } => {
            let k = me % local;
            Some((0..world / local).map(|h| h * local + k).collect())
        }
        Mode::Peer if config.fallback.by_size != SizeRouting::Never => Some((0..world).collect()),
        Mode::Peer => None,
    };
    let external = match external_group {
        Some(group) => Some(library.per_rank(&core.rank.device, bootstrap.clone(), &group)?),
        None => None,
    };
    let arch = core.settings.arch.clone();
    Ok((
        core,
        Router {
            mode,
            world,
            world_rank: me,
            external,
            by_size: config.fallback.by_size,
            arch,
        },
    ))
}

impl<B: Backend> Router<B> {
    /// The path of a call over groups of `options.group_size` of `elements` elements
    /// of `dtype`, or a typed error (nothing launched).
    pub(super) fn path(
        &self,
        dtype: DType,
        elements: usize,
        options: &AllReduceOptions,
    ) -> Result<Path> {
        let width = if options.group_size == 0 {
            self.world
        } else {
            options.group_size
        };
        if width > self.world || !self.world.is_multiple_of(width) {
            return Err(Error::InvalidGroupSize {
                group_size: options.group_size,
                world: self.world,
            });
        }
        let forced_external = options.algorithm == Algorithm::Nccl;
        let local = match self.mode {
            Mode::Peer => self.world,
            Mode::External => 1,
            Mode::Hierarchical { local } => local,
        };
        if width == self.world && self.world > local {
            // Peer memory cannot serve the whole world.
            return match (self.mode, options.algorithm) {
                (_, Algorithm::Auto) | (Mode::External, Algorithm::Nccl) => Ok(match self.mode {
                    Mode::Hierarchical { .. } => Path::Hierarchical,
                    _ => Path::External,
                }),
                (Mode::Hierarchical { .. }, Algorithm::Hierarchical) => Ok(Path::Hierarchical),
                (_, a) => Err(Error::Unsupported(format!(
                    "{} cannot serve this communicator's whole world ({}); use Auto",
                    a.name(),
                    match self.mode {
                        Mode::Hierarchical { .. } => "its ranks span hosts",
                        _ => "peer memory does not reach every rank",
                    }
                ))),
            };
        }
        if local % width != 0 {
            return Err(Error::Unsupported(format!(
                "groups of {width} would span ranks that peer memory does not connect \
                 (peer memory serves groups inside {local} consecutive ranks here); use \
                 group sizes that divide {local}, or the whole world"
            )));
        }
        if forced_external || options.algorithm == Algorithm::Hierarchical {
            return match (&self.external, width == self.world, self.mode) {
                (Some(_), true, Mode::Peer) if forced_external => Ok(Path::External),
                _ => Err(Error::Unsupported(format!(
                    "{} was asked for, but this call is served by peer memory and the \
                     external library is not set up for it",
                    options.algorithm.name()
                ))),
            };
        }
        if width == self.world
            && self.mode == Mode::Peer
            && self.external.is_some()
            && options.algorithm == Algorithm::Auto
            && self.route_by_size(width, elements * dtype.size())
        {
            return Ok(Path::External);
        }
        let local_group = if width == local { 0 } else { width };
        Ok(Path::Peer(AllReduceOptions {
            group_size: local_group,
            ..*options
        }))
    }

    /// A collective other than the all-reduce (all-gather, reduce-scatter, broadcast,
    /// scatter, fused): served by peer memory only, so its groups must stay inside
    /// what peer memory connects; returns the options in the local core's numbering.
    pub(super) fn local_collective(
        &self,
        options: &crate::CollectiveOptions,
    ) -> Result<crate::CollectiveOptions> {
        let width = if options.group_size == 0 {
            self.world
        } else {
            options.group_size
        };
        if width > self.world || !self.world.is_multiple_of(width) {
            return Err(Error::InvalidGroupSize {
                group_size: options.group_size,
                world: self.world,
            });
        }
        let local = self.local();
        if !local.is_multiple_of(width) {
            return Err(Error::Unsupported(format!(
                "this communicator's peer memory serves groups inside {local} consecutive                  ranks ({}), and only the all-reduce falls back to the external library:                  use a group size that divides {local}",
                match self.mode {
                    Mode::Hierarchical { .. } => "its ranks span hosts",
                    _ => "peer memory does not reach every rank",
                }
            )));
        }
        Ok(crate::CollectiveOptions {
            group_size: if width == local { 0 } else { width },
            ..*options
        })
    }

    /// Ranks a peer-memory group may span here.
    fn local(&self) -> usize {
        match self.mode {
            Mode::Peer => self.world,
            Mode::External => 1,
            Mode::Hierarchical { local } => local,
        }
    }

    /// How whole-world calls run (see `Comm::world_path`).
    pub(super) fn world_path(&self) -> Algorithm {
        match self.mode {
            Mode::Peer => Algorithm::Auto,
            Mode::External => Algorithm::Nccl,
            Mode::Hierarchical { .. } => Algorithm::Hierarchical,
        }
    }

    fn route_by_size(&self, width: usize, bytes: usize) -> bool {
        match self.by_size {
            SizeRouting::Never => false,
            SizeRouting::Above(min) => bytes >= min,
            SizeRouting::Table => {
                dispatch::external_from(&self.arch, width).is_some_and(|from| bytes >= from)
            }
        }
    }

    /// Reports (once) an error the external library found after a call returned.
    pub(super) fn take_async_error(&self) -> Result<()> {
        match &self.external {
            Some(e) => e.take_async_error(),
            None => Ok(()),
        }
    }
}

/// Where a routed call failed: before anything was enqueued (nothing written), or
/// part-way (the ranks may now disagree: the communicator must be poisoned).
pub(super) enum RouteError {
    Validation(Error),
    Launched(Error),
}

/// Runs a routed call of `elements` elements of `dtype` from `input` into `output` (may
/// be equal) on this rank.
#[allow(clippy::too_many_arguments)]
pub(super) fn run<B: Backend>(
    router: &Router<B>,
    path: Path,
    rank: &Rank<B>,
    settings: &Settings,
    input: u64,
    output: u64,
    elements: usize,
    dtype: DType,
    blocks: Option<u32>,
) -> std::result::Result<Algorithm, RouteError> {
    let external = router
        .external
        .as_deref()
        .ok_or_else(|| RouteError::Validation(Error::Unsupported("no external library".into())))?;
    let dev = &rank.device;
    match path {
        Path::Peer(_) => unreachable!("peer calls are not routed"),
        Path::External => {
            if elements > 0 {
                // SAFETY: the caller holds both buffers (and their access guards) for
                // the call, on this rank's device.
                unsafe { external.all_reduce_sum(dev, input, output, elements, dtype) }
                    .map_err(RouteError::Launched)?;
            }
            Ok(Algorithm::Nccl)
        }
        Path::Hierarchical => {
            if elements == 0 {
                return Ok(Algorithm::Hierarchical);
            }
            let mut opts = AllReduceOptions::new();
            opts.blocks = blocks;
            let first = settings
                .plan(dtype, elements, &opts, input == output)
                .map_err(RouteError::Validation)?;
            let gather = settings
                .plan(dtype, elements, &opts, true)
                .map_err(RouteError::Validation)?;
            let (lo, hi) = slice(elements, settings.world, rank.index);
            let size = dtype.size() as u64;
            let mut inputs = [0u64; MAX_GPUS];
            // (a) the host's sum, over peer memory.
            inputs[rank.index] = input;
            rank.launch(settings, &first, &inputs, output)
                .map_err(RouteError::Launched)?;
            // (b) this rank's slice across hosts, in the external library.
            let mut step = || -> Result<()> {
                // Every rank makes the call, an empty slice too (a message shorter
                // than the grain), so that the library sees the same calls everywhere.
                let at = output + lo as u64 * size;
                // SAFETY: [lo, hi) lies inside the output the caller holds.
                unsafe { external.all_reduce_sum(dev, at, at, hi - lo, dtype) }?;
                // (c) the gather inside the host: every other slice is the additive
                // identity -0.0, so the peer sum copies each slice from its owner
                // bit for bit (x + -0.0 == x for every x).
                fill_negative_zero::<B>(dev, output, 0, lo, dtype)?;
                fill_negative_zero::<B>(dev, output, hi, elements, dtype)?;
                inputs[rank.index] = output;
                rank.launch(settings, &gather, &inputs, output)
            };
            step().map_err(RouteError::Launched)?;
            Ok(Algorithm::Hierarchical)
        }
    }
}

/// The slice `[lo, hi)` of `elements` that local rank `k` of `local` reduces across
/// hosts: whole 16-byte packs of 16-bit elements (8 elements), so every boundary is
/// aligned.
fn slice(elements: usize, local: usize, k: usize) -> (usize, usize) {
    const GRAIN: usize = 8;
    let chunk = elements.div_ceil(GRAIN).div_ceil(local) * GRAIN;
    let lo = (k * chunk).min(elements);
    (lo, (lo + chunk).min(elements))
}

/// Writes -0.0 into elements `[from, to)` of the buffer at `base`, on the stream.
fn fill_negative_zero<B: Backend>(
    dev: &B::Device,
    base: u64,
    from: usize,
    to: usize,
    dtype: DType,
) -> Result<()> {
    if to <= from {
        return Ok(());
    }
    let at = base + (from * dtype.size()) as u64;
    match dtype {
        DType::F32 => B::memset_d32(dev, at, 0x8000_0000, to - from),
        DType::F16 | DType::BF16 => B::memset_d16(dev, at, 0x8000, to - from),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_every_element_once() {
        for elements in [0, 1, 7, 8, 9, 63, 1000, 1027] {
            for local in 1..=8 {
                let mut next = 0;
                for k in 0..local {
                    let (lo, hi) = slice(elements, local, k);
                    assert!(lo <= hi);
                    if hi > lo {
                        assert_eq!(lo, next);
                        assert_eq!(lo % 8, 0);
                        next = hi;
                    }
                }
                assert_eq!(next, elements);
            }
        }
    }

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
