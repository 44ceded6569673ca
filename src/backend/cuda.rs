//! CUDA backend (in progress).
