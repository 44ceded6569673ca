//! Routing: which calls peer memory serves and which go to the external library,
//! decided once at setup (the same on every rank), then per call from its width and size.

use crate::backend::Backend;
use crate::dispatch::{self, Algorithm};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::external::{ExternalAllReduce, Fallback, SizeRouting};
use crate::signal::MAX_GPUS;

use super::settings::group_width;
use crate::comm::{AllReduceOptions, CommConfig};

pub(crate) mod external;

/// How a communicator runs its whole-world calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Peer memory over the whole world.
    Peer,
    /// The external library over the whole world; peer memory serves groups of one.
    External,
    /// Ranks on several hosts of `local` consecutive ranks each: peer memory inside a
    /// host, the external library across hosts.
    Hierarchical { local: usize },
}

/// What runs one call.
pub(crate) enum Path {
    /// The peer-memory kernels of the local core, with these (local) options.
    Peer(AllReduceOptions),
    /// The external library over the world.
    External,
    /// Peer memory inside each host, the external library across.
    Hierarchical,
}

/// The routing state of a communicator (the same on every rank).
pub(crate) struct Router<B: Backend> {
    pub(crate) mode: Mode,
    pub(crate) world: usize,
    pub(crate) world_rank: usize,
    /// The external handle: over the world (`External`, or `Peer` with routing by
    /// size), or over this rank's slice group across hosts (`Hierarchical`).
    pub(crate) external: Option<Box<dyn ExternalAllReduce<B>>>,
    pub(crate) by_size: SizeRouting,
    pub(crate) arch: String,
}

/// A per-rank world of `world` ranks is allowed: more than `MAX_GPUS` only with the
/// fallback on.
pub(crate) fn check_world(world: usize, config: &CommConfig) -> Result<()> {
    if world == 0 || (world > MAX_GPUS && config.fallback.fallback == Fallback::Refuse) {
        return Err(Error::InvalidWorldSize {
            got: world,
            max: MAX_GPUS,
        });
    }
    Ok(())
}

impl<B: Backend> Router<B> {
    /// The path of a call over groups of `options.group_size` of `elements` elements
    /// of `dtype`, or a typed error (nothing launched).
    pub(crate) fn path(
        &self,
        dtype: DType,
        elements: usize,
        options: &AllReduceOptions,
    ) -> Result<Path> {
        let width = group_width(self.world, options.group_size)?;
        let forced_external = options.algorithm == Algorithm::Nccl;
        let local = self.local();
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
                    self.why_not_world()
                ))),
            };
        }
        if !local.is_multiple_of(width) {
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

    /// A collective other than the all-reduce: peer memory only, so its groups stay
    /// inside what peer memory connects; returns the options in local numbering.
    pub(crate) fn local_collective(
        &self,
        options: &crate::CollectiveOptions,
    ) -> Result<crate::CollectiveOptions> {
        let width = group_width(self.world, options.group_size)?;
        let local = self.local();
        if !local.is_multiple_of(width) {
            return Err(Error::Unsupported(format!(
                "this communicator's peer memory serves groups inside {local} consecutive \
                 ranks ({}), and only the all-reduce falls back to the external library: \
                 use a group size that divides {local}",
                self.why_not_world()
            )));
        }
        Ok(crate::CollectiveOptions {
            group_size: if width == local { 0 } else { width },
            ..*options
        })
    }

    /// Why peer memory does not serve the whole world.
    fn why_not_world(&self) -> &'static str {
        match self.mode {
            Mode::Hierarchical { .. } => "its ranks span hosts",
            _ => "peer memory does not reach every rank",
        }
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
    pub(crate) fn world_path(&self) -> Algorithm {
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
}

/// Where a routed call failed: before anything was enqueued (nothing written), or
/// part-way (the ranks may now disagree: the communicator must be poisoned).
pub(crate) enum RouteError {
    Validation(Error),
    Launched(Error),
}
