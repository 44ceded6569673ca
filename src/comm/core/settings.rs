//! What every rank of a communicator shares: sizes, limits and the dispatch key.

use crate::backend::KernelKind;
use crate::error::{Error, Result};
use crate::signal::{SignalLayout, MAX_NUM_BLOCKS_UPPER_BOUND};

use crate::comm::CommConfig;

/// The settings the planner and the launcher read; equal on every rank.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) layout: SignalLayout,
    pub(crate) config: CommConfig,
    /// Architecture of the devices (keys the dispatch table).
    pub(crate) arch: String,
    pub(crate) max_blocks: u32,
    pub(crate) world: usize,
}

impl Settings {
    /// Checks `config` and derives the settings for `world` ranks on devices of `arch`
    /// with `multiprocessors` each.
    pub(crate) fn new(
        config: CommConfig,
        arch: String,
        multiprocessors: usize,
        world: usize,
    ) -> Result<Self> {
        let layout = SignalLayout {
            lamport_slot_bytes: config.lamport_slot_bytes,
            lamport_slots: world,
            payload_bytes: config.payload_bytes,
        };
        layout.validate()?;
        let threads = config.threads_per_block;
        if !(64..=512).contains(&threads) || !threads.is_multiple_of(64) {
            return Err(Error::Unsupported(format!(
                "threads_per_block must be a multiple of 64 in 64..=512 (the kernels' launch \
                 bound), not {threads}"
            )));
        }
        let mut settings = Settings {
            layout,
            config,
            arch,
            max_blocks: 0,
            world,
        };
        settings.agree_on_grid(multiprocessors);
        Ok(settings)
    }

    /// Sets the grid from the group's fewest multiprocessors unless the configuration
    /// fixes it (each block waits for the same-index block of every peer).
    pub(crate) fn agree_on_grid(&mut self, fewest_multiprocessors: usize) {
        self.max_blocks = self
            .config
            .max_blocks
            .unwrap_or(u32::try_from(fewest_multiprocessors).unwrap_or(u32::MAX))
            .clamp(1, MAX_NUM_BLOCKS_UPPER_BOUND as u32);
    }

    /// Caps the grid where `ranks_per_device` ranks share a device: every block must be
    /// resident at once (blocks wait for their peers'), so each gets at most its share of
    /// the multiprocessors (at least one). Every rank passes the same numbers.
    pub(crate) fn limit_for_shared_devices(
        &mut self,
        multiprocessors: usize,
        ranks_per_device: usize,
    ) {
        if ranks_per_device > 1 {
            let share = u32::try_from(multiprocessors / ranks_per_device).unwrap_or(u32::MAX);
            self.max_blocks = self.max_blocks.min(share.max(1));
        }
    }

    /// [`Error::MessageTooLarge`]: `kind` needs `needed` bytes of the payload.
    pub(crate) fn payload_too_large(&self, kind: KernelKind, needed: usize) -> Error {
        Error::MessageTooLarge {
            algorithm: kind.name(),
            needed,
            available: self.layout.payload_bytes,
            setting: "payload_bytes",
        }
    }

    /// The width of the groups of a call: `group_size`, or the world for 0.
    pub(crate) fn group_width(&self, group_size: usize) -> Result<usize> {
        group_width(self.world, group_size)
    }

    /// The wait limit the kernels get, in nanoseconds (0 = never; saturates).
    pub(crate) fn timeout_ns(&self) -> u64 {
        self.config.barrier_timeout.map_or(0, |t| {
            u64::try_from(t.as_nanos()).unwrap_or(u64::MAX).max(1)
        })
    }
}

/// The width of groups of `group_size` in a world of `world` ranks (0: the world), which
/// must divide the world.
pub(crate) fn group_width(world: usize, group_size: usize) -> Result<usize> {
    let width = if group_size == 0 { world } else { group_size };
    if width > world || !world.is_multiple_of(width) {
        return Err(Error::InvalidGroupSize { group_size, world });
    }
    Ok(width)
}
