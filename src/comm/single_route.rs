//! Routing for the single-controller [`Communicator`]: as the per-rank routing
//! (`route.rs`), for one process that drives every device. Peer memory serves the
//! world unless some pair of devices has no peer access or the check at
//! initialisation fails; then (with the fallback on) whole-world calls go to the
//! external library through its single-controller form (NCCL's `ncclCommInitAll` and
//! group calls), and groups of one still copy on the device.

use crate::backend::Backend;
use crate::dispatch::{self, Algorithm};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::external::{library_of, ExternalAllReduce, Fallback, FallbackConfig, SizeRouting};

use super::{AllReduceOptions, Communicator};

/// The routing state of a single-controller communicator.
pub(super) struct SingleRoute<B: Backend> {
    /// Peer memory serves the whole world.
    pub(super) peer_world: bool,
    /// One external handle per rank, when set up.
    external: Option<Vec<Box<dyn ExternalAllReduce<B>>>>,
    by_size: SizeRouting,
}

impl<B: Backend> SingleRoute<B> {
    /// Peer memory everywhere, nothing external (the state while setting up).
    pub(super) fn peer() -> Self {
        SingleRoute {
            peer_world: true,
            external: None,
            by_size: SizeRouting::Never,
        }
    }
}

impl<B: Backend> Communicator<B> {
    /// Finishes setting up the routing: the peer check (when peer access exists), then
    /// the external handles where they are needed.
    pub(super) fn finish_routing(
        mut self,
        p2p: bool,
        fallback: FallbackConfig,
        corrupt: Option<usize>,
    ) -> Result<Self> {
        let mut peer_world = p2p;
        if peer_world {
            let failed = self.peer_check(corrupt)?;
            if !failed.is_empty() {
                if fallback.fallback == Fallback::Refuse {
                    return Err(Error::PeerCheckFailed {
                        ranks: failed.iter().map(|f| f.0).collect(),
                        detail: failed[0].1.clone(),
                    });
                }
                peer_world = false;
            }
            self.reinitialize()?;
        }
        let need_external = !peer_world || fallback.by_size != SizeRouting::Never;
        let external = if need_external && self.world_size() > 1 {
            let devices: Vec<&B::Device> = self.ranks.iter().map(|r| r.device()).collect();
            Some(library_of::<B>().single_controller(&devices)?)
        } else {
            None
        };
        self.route = SingleRoute {
            peer_world,
            external,
            by_size: fallback.by_size,
        };
        Ok(self)
    }

    /// How whole-world calls run: `Auto` when peer memory serves the world (its
    /// algorithms, as the dispatch table picks), `Nccl` when the external library does.
    pub fn world_path(&self) -> Algorithm {
        if self.route.peer_world {
            Algorithm::Auto
        } else {
            Algorithm::Nccl
        }
    }

    /// Whether a call goes to the external library (`Ok(true)`), to peer memory
    /// (`Ok(false)`), or cannot run (a typed error).
    pub(super) fn routes_external(
        &self,
        dtype: DType,
        elements: usize,
        options: &AllReduceOptions,
    ) -> Result<bool> {
        let world = self.world_size();
        let width = self.settings.group_width(options.group_size)?;
        let route = &self.route;
        let whole = width == world && world > 1;
        if !route.peer_world && width > 1 {
            return match (whole, options.algorithm) {
                (true, Algorithm::Auto | Algorithm::Nccl) => Ok(true),
                (true, a) => Err(Error::Unsupported(format!(
                    "{} cannot serve this communicator: peer memory does not reach every \
                     device; use Auto",
                    a.name()
                ))),
                (false, _) => Err(Error::Unsupported(format!(
                    "groups of {width}: peer memory does not reach every device, and the \
                     external library serves the whole world only"
                ))),
            };
        }
        if route.external.is_none() || !whole {
            return Ok(false);
        }
        Ok(match (options.algorithm, route.by_size) {
            (Algorithm::Nccl, _) => true,
            (Algorithm::Auto, SizeRouting::Above(min)) => elements * dtype.size() >= min,
            (Algorithm::Auto, SizeRouting::Table) => {
                dispatch::external_from(&self.settings.arch, width)
                    .is_some_and(|from| elements * dtype.size() >= from)
            }
            _ => false,
        })
    }

    /// Enqueues the external all-reduce on every rank (one batch); a failure once
    /// something was enqueued poisons the communicator.
    pub(super) fn run_external(
        &self,
        inputs: &[u64],
        outputs: &[u64],
        elements: usize,
        dtype: DType,
    ) -> Result<Algorithm> {
        let handles = self
            .route
            .external
            .as_ref()
            .ok_or_else(|| Error::Unsupported("no external library".into()))?;
        let _launches = self.lock_launches();
        self.check_usable()?;
        if elements == 0 {
            return Ok(Algorithm::Nccl);
        }
        let library = library_of::<B>();
        library.group_start()?;
        let mut result = Ok(());
        for (r, h) in handles.iter().enumerate() {
            // SAFETY: the caller holds every rank's buffers (and their access guards)
            // for the call; handle r was made for rank r's device.
            result = unsafe {
                h.all_reduce_sum(
                    self.ranks[r].device(),
                    inputs[r],
                    outputs[r],
                    elements,
                    dtype,
                )
            };
            if result.is_err() {
                break;
            }
        }
        let ended = library.group_end();
        match result.and(ended) {
            Ok(()) => Ok(Algorithm::Nccl),
            Err(e) => {
                self.poisoned
                    .store(true, std::sync::atomic::Ordering::Release);
                Err(e)
            }
        }
    }

    /// Refuses device-side work over groups of `width` that peer memory does not serve.
    pub(super) fn check_peer_group(&self, width: usize) -> Result<()> {
        if width > 1 && !self.route.peer_world {
            return Err(Error::Unsupported(
                "peer memory does not reach every device of this communicator".into(),
            ));
        }
        Ok(())
    }

    /// Reports (once) an error an external handle found after a call returned.
    pub(super) fn external_async_error(&self) -> Result<()> {
        for h in self.route.external.iter().flatten() {
            h.take_async_error()?;
        }
        Ok(())
    }
}
