//! Shared memory of the host backend (Linux), as "IPC" in its module docs says.

use std::ffi::c_void;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use super::device::alloc_error;
use crate::backend::handle::{import_error, Reader, Writer};
use crate::error::{Error, Result};

/// Magic of a host handle.
const MAGIC: &[u8; 4] = b"pcho";
/// Version of the host handle layout.
const VERSION: u32 = 1;
/// Bytes of a host handle: header 8, pid 4, fd 4, size 8, st_dev 8, st_ino 8.
const HANDLE_BYTES: usize = 40;

/// A read/write `MAP_SHARED` mapping of a whole file; unmapped when dropped.
pub(crate) struct Mapping {
    ptr: NonNull<c_void>,
    len: usize,
}

// SAFETY: the mapping is owned by this value and only reached through raw addresses by
// kernels (threads here or in other processes) whose synchronisation is the protocol
// under test; unmapping needs nothing thread-specific.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` exposes only the address and the length.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `fd` (the whole file) shared, read/write.
    fn new(fd: BorrowedFd<'_>, len: usize) -> rustix::io::Result<Self> {
        // SAFETY: a new mapping at an address the kernel chooses (no hint, no
        // MAP_FIXED), so it replaces and aliases nothing Rust owns; `len` is non-zero.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        let ptr = NonNull::new(ptr).ok_or(rustix::io::Errno::NOMEM)?;
        Ok(Mapping { ptr, len })
    }
    /// Address of the first byte (page aligned).
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `new`, unmapped once
        // (drop); the owners drop it only after the work that used it (stream order).
        // A failure could only mean a bad range, which `new` rules out; nothing to do.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr(), self.len) };
    }
}

/// Signal memory other processes can map: a memfd, sized, sealed against shrinking
/// and growing, mapped here; the file stays open so that importers can reach it at
/// `/proc/<pid>/fd/<fd>`. Dropping it unmaps it and closes the file (the file itself
/// lives on while an importer still maps it).
pub(crate) struct SharedFile {
    // Field order: unmap first, then close.
    mapping: Mapping,
    file: File,
    dev: u64,
    ino: u64,
}

impl SharedFile {
    /// A zero-filled shared file of `bytes` (at least 1) bytes, mapped here.
    pub(crate) fn create(bytes: usize) -> Result<Self> {
        let len = bytes.max(1);
        let fd = rustix::fs::memfd_create(
            "peercomm-signal",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| alloc_error(format!("memfd_create: {e}")))?;
        let file = File::from(fd);
        file.set_len(len as u64)
            .map_err(|e| alloc_error(format!("sizing the shared file to {len} bytes: {e}")))?;
        // A fixed size: an importer's mapping can never lose its pages to a truncation
        // (which would make its accesses fault with SIGBUS).
        rustix::fs::fcntl_add_seals(&file, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| alloc_error(format!("sealing the shared file: {e}")))?;
        let meta = file
            .metadata()
            .map_err(|e| alloc_error(format!("fstat of the shared file: {e}")))?;
        let mapping = Mapping::new(file.as_fd(), len)
            .map_err(|e| alloc_error(format!("mmap of {len} shared bytes: {e}")))?;
        let shared = SharedFile {
            mapping,
            file,
            dev: meta.dev(),
            ino: meta.ino(),
        };
        live().push((shared.addr(), len, shared.export()));
        Ok(shared)
    }

    /// Address of the mapping in this process.
    pub(crate) fn addr(&self) -> u64 {
        self.mapping.addr()
    }

    /// The handle record (layout in the host backend's module docs).
    pub(crate) fn export(&self) -> Vec<u8> {
        Writer::new(MAGIC, VERSION)
            .u32(std::process::id())
            .u32(self.file.as_raw_fd() as u32)
            .u64(self.mapping.len() as u64)
            .u64(self.dev)
            .u64(self.ino)
            .finish()
    }
}

/// The live shared files of this process (address, bytes, handle), so that a range
/// inside one can be exported ([`export_containing`]).
fn live() -> MutexGuard<'static, Vec<(u64, usize, Vec<u8>)>> {
    static LIVE: Mutex<Vec<(u64, usize, Vec<u8>)>> = Mutex::new(Vec::new());
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drop for SharedFile {
    fn drop(&mut self) {
        let addr = self.addr();
        live().retain(|(a, _, _)| *a != addr);
    }
}

/// The handle of the live shared file of this process that holds `[ptr, ptr + bytes)`,
/// `ptr`'s offset in it and a descriptor of the file (to send beside the handle, see
/// [`import_descriptor`]); `None` when no shared file holds the range.
pub(crate) fn export_containing(
    ptr: u64,
    bytes: usize,
) -> Option<Result<(Vec<u8>, u64, std::os::fd::OwnedFd)>> {
    let live = live();
    let (addr, _, handle) = live
        .iter()
        .find(|(a, n, _)| ptr >= *a && ptr + bytes as u64 <= *a + *n as u64)?;
    let (_pid, fd, ..) = fields(handle).ok()?;
    // SAFETY: the file of a listed shared file is open while it is listed: its drop
    // unlists it (under this lock, held here) before its fields close the file.
    let file = unsafe { BorrowedFd::borrow_raw(fd as std::os::fd::RawFd) };
    Some(
        rustix::io::fcntl_dupfd_cloexec(file, 0)
            .map(|dup| (handle.clone(), ptr - addr, dup))
            .map_err(|e| alloc_error(format!("duplicating a shared file's descriptor: {e}"))),
    )
}

/// The fields of a host handle: pid, fd number, size, `st_dev`, `st_ino`.
fn fields(handle: &[u8]) -> Result<(u32, u32, u64, u64, u64)> {
    let mut r = Reader::open("host", handle, MAGIC, VERSION, HANDLE_BYTES)?;
    Ok((r.u32(), r.u32(), r.u64(), r.u64(), r.u64()))
}

/// Maps the whole file `fd` once it is the file a handle names (`st_dev`, `st_ino`,
/// size); `why` ends the message of an identity mismatch.
fn map_named(
    fd: BorrowedFd<'_>,
    (size, dev, ino): (u64, u64, u64),
    err: impl Fn(String) -> Error,
    why: &str,
) -> Result<Mapping> {
    let meta = rustix::fs::fstat(fd).map_err(|e| err(format!("fstat: {e}")))?;
    if (meta.st_dev, meta.st_ino) != (dev, ino) {
        return Err(err(format!(
            "file identity mismatch: it is device {}, inode {}, but the handle names device \
             {dev}, inode {ino}{why}",
            meta.st_dev, meta.st_ino
        )));
    }
    if meta.st_size as u64 != size {
        return Err(err(format!(
            "size mismatch: the file has {} bytes, the handle says {size}",
            meta.st_size
        )));
    }
    let len = usize::try_from(size)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| err(format!("size {size} cannot be mapped")))?;
    Mapping::new(fd, len).map_err(|e| err(format!("mmap: {e}")))
}

/// Maps the shared file that `descriptor` is, once it is the one the handle from
/// [`SharedFile::export`] names; the descriptor is closed when this returns.
pub(crate) fn import_descriptor(
    handle: &[u8],
    descriptor: std::os::fd::OwnedFd,
) -> Result<Mapping> {
    let (pid, _fd, size, dev, ino) = fields(handle)?;
    let err = |what: String| import_error("host", format!("process {pid}'s shared file: {what}"));
    map_named(descriptor.as_fd(), (size, dev, ino), err, "")
}

/// Maps the memory a handle from [`SharedFile::export`] names (any process, this one
/// included). The file is closed on return; the mapping keeps the memory alive.
pub(crate) fn import(handle: &[u8]) -> Result<Mapping> {
    let (pid, fd, size, dev, ino) = fields(handle)?;
    let path = format!("/proc/{pid}/fd/{fd}");
    let err = |what: String| import_error("host", format!("{path}: {what}"));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| {
            err(format!(
                "cannot open it ({e}): the exporting process {pid} has exited or freed the \
                 allocation, or this process may not inspect it"
            ))
        })?;
    let why = " (the exporter freed the allocation and reused its fd number)";
    map_named(file.as_fd(), (size, dev, ino), err, why)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A descriptor is mapped only where it is the file its handle names, of the size
    /// the handle says: another shared file (of another size or the same), a file that
    /// is no shared file, and a handle whose size was changed are refused, nothing
    /// mapped.
    #[test]
    fn a_descriptor_that_is_not_the_handles_file_is_refused() {
        let dup = |f: &SharedFile| rustix::io::fcntl_dupfd_cloexec(&f.file, 0).unwrap();
        let (a, b, c) = (
            SharedFile::create(4096).unwrap(),
            SharedFile::create(8192).unwrap(),
            SharedFile::create(4096).unwrap(),
        );
        let handle = a.export();
        let plain = rustix::fs::memfd_create("plain", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&plain, 4096).unwrap();
        for (what, descriptor) in [("larger", dup(&b)), ("alike", dup(&c)), ("plain", plain)] {
            let Err(e) = import_descriptor(&handle, descriptor) else {
                panic!("{what}: mapped");
            };
            let e = e.to_string();
            assert!(e.contains("but the handle names device"), "{what}: {e}");
            assert!(!e.contains("  "), "{what}: {e}");
        }
        // The size field (bytes 16..24) says 8192 where the file has 4096.
        let mut resized = handle.clone();
        resized[16..24].copy_from_slice(&8192u64.to_le_bytes());
        let Err(e) = import_descriptor(&resized, dup(&a)) else {
            panic!("resized: mapped");
        };
        assert!(e.to_string().contains("size mismatch"), "{e}");
        assert_eq!(import_descriptor(&handle, dup(&a)).unwrap().len(), 4096);
    }
}
