//! Operating-system plumbing that is no part of a communicator's logic.

pub(crate) mod descriptors;
