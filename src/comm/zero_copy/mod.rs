//! Zero copy: buffers that every peer has mapped, so that a call whose input lies in
//! one reads the peers' inputs in place (no staging copy, two-stage offered).

#[cfg(feature = "cuda")]
pub(crate) mod capture;
pub(crate) mod capture_inputs;
pub(crate) mod device_comm;
pub(crate) mod exchange;
pub(crate) mod pool;
pub(crate) mod records;
pub(crate) mod registered;
pub(crate) mod registry;
pub(crate) mod script;
pub(crate) mod symmetric;
