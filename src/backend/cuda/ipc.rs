//! The legacy IPC handle record of CUDA and HIP (compiled under either feature), 88 bytes
//! LE: magic, version `u32` = 1, the exporter's random token `u64` (spots a same-process
//! import), the allocation's size `u64`, the runtime's 64-byte IPC handle.

use super::super::handle::{import_error, process_token, Reader, Writer};
use crate::error::{Error, Result};

/// The record of `raw`, the runtime's handle of an allocation of `bytes`.
pub(crate) fn write(magic: &[u8; 4], bytes: usize, raw: [u8; 64]) -> Vec<u8> {
    let w = Writer::new(magic, 1).u64(process_token());
    w.u64(bytes as u64).bytes(&raw).finish()
}

/// The size and runtime handle a record holds; one this process wrote is refused.
pub(crate) fn read(
    backend: &'static str,
    magic: &[u8; 4],
    record: &[u8],
) -> Result<(usize, [u8; 64])> {
    let mut r = Reader::open(backend, record, magic, 1, 88)?;
    let (token, bytes, raw) = (r.u64(), r.u64(), r.array::<64>());
    if token == process_token() {
        return Err(same_process(backend, "this process exported the handle"));
    }
    let bytes = usize::try_from(bytes)
        .map_err(|_| import_error(backend, format!("size {bytes} does not fit here")))?;
    Ok((bytes, raw))
}

/// The refusal of a handle opened in the process that exported it.
pub(crate) fn same_process(backend: &str, detail: &str) -> Error {
    Error::Unsupported(format!(
        "{backend}: import_memory: {detail}: {} IPC cannot open a handle in the process that \
         exported it; within one process use the allocation's own address (map_peer)",
        backend.to_uppercase()
    ))
}
