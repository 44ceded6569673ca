//! The host backend type [`Host`] and its device, [`HostDevice`]: an ordinal and its stream.

use std::sync::Arc;

use super::stream::Stream;
use crate::error::{Error, Result};

/// The host reference backend (see the module docs of `backend::host`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Host;

/// One simulated device: an ordinal and its stream.
pub struct HostDevice {
    pub(super) ordinal: usize,
    pub(super) stream: Arc<Stream>,
}

impl crate::backend::IntoDevice for HostDevice {
    type Backend = Host;
    fn into_device(self) -> Result<HostDevice> {
        Ok(self)
    }
}

impl std::fmt::Debug for HostDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostDevice")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl HostDevice {
    /// The ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    /// Enqueues a host function on the device's stream (as `cuLaunchHostFunc`): it runs
    /// after the work enqueued before it, and later work waits for it.
    pub(crate) fn enqueue_host_fn(&self, f: impl FnOnce() + Send + 'static) {
        self.stream.enqueue(Box::new(f));
    }
}

/// A failed host allocation (heap or shared file).
pub(super) fn alloc_error(detail: String) -> Error {
    Error::Backend {
        backend: "host",
        call: "alloc",
        detail,
    }
}
