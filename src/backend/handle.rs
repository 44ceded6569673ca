//! The handle records of [`Backend::export_memory`](super::Backend::export_memory), for
//! every backend: fixed-length, little-endian, a 4-byte magic naming the backend (`pcho`,
//! `pccu`, `pchi`), a `u32` version, then its fields. Reading checks the magic, the
//! version, then the length, so a foreign or other-version handle is named as such;
//! every failure is `Error::Backend { call: "import_memory", .. }`.

use crate::error::{Error, Result};

/// Bytes of the header (magic and version).
const HEADER: usize = 8;

/// The error every malformed or unusable handle gets.
pub(crate) fn import_error(backend: &'static str, detail: String) -> Error {
    Error::Backend {
        backend,
        call: "import_memory",
        detail,
    }
}

/// Builds a record field by field.
pub(crate) struct Writer(Vec<u8>);

impl Writer {
    /// Starts a record with its header.
    pub(crate) fn new(magic: &[u8; 4], version: u32) -> Self {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(magic);
        buf.extend_from_slice(&version.to_le_bytes());
        Writer(buf)
    }
    pub(crate) fn u32(self, v: u32) -> Self {
        self.bytes(&v.to_le_bytes())
    }
    pub(crate) fn u64(self, v: u64) -> Self {
        self.bytes(&v.to_le_bytes())
    }
    pub(crate) fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    pub(crate) fn finish(self) -> Vec<u8> {
        self.0
    }
}

/// Reads the fields of a record whose header and length were checked.
pub(crate) struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    /// Checks the header and the length of `handle`, a record of `len` bytes in all
    /// (header included), and returns a reader positioned after the header.
    pub(crate) fn open(
        backend: &'static str,
        handle: &'a [u8],
        magic: &[u8; 4],
        version: u32,
        len: usize,
    ) -> Result<Self> {
        let what = format!("a peercomm {backend} IPC handle (version {version}, {len} bytes)");
        let fail = |detail: String| Err(import_error(backend, detail));
        if handle.len() < HEADER {
            return fail(format!("{} bytes is too short for {what}", handle.len()));
        }
        let (head, rest) = handle.split_at(HEADER);
        if head[..4] != magic[..] {
            return fail(format!(
                "the handle starts with {:02x?}, not the magic {:?} of {what}: a handle of \
                 another backend, or not a peercomm handle",
                &head[..4],
                String::from_utf8_lossy(magic)
            ));
        }
        let got = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if got != version {
            return fail(format!(
                "handle version {got}, but this build of peercomm reads {what}: exporter and \
                 importer must run the same peercomm"
            ));
        }
        if handle.len() != len {
            return fail(format!("{} bytes where {what} was expected", handle.len()));
        }
        Ok(Reader(rest))
    }
    pub(crate) fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    pub(crate) fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
    /// The next `N` bytes. Panics past the end, which a caller that passed its record's
    /// true length to [`Reader::open`] never reaches.
    pub(crate) fn array<const N: usize>(&mut self) -> [u8; N] {
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .expect("field inside the record length checked by Reader::open");
        self.0 = rest;
        *head
    }
}

/// A random number drawn once per process (a pid is not unique across namespaces): GPU
/// handles carry it, so importing in the exporting process (which CUDA and HIP refuse)
/// is recognised before the driver is asked; the per-rank setup tells processes apart.
pub(crate) fn process_token() -> u64 {
    use std::sync::OnceLock;
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        getrandom::u64().unwrap_or_else(|_| {
            // No entropy source: the pid and the time still tell processes apart on
            // one host, which is all IPC spans.
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            nanos ^ (u64::from(std::process::id()) << 32)
        })
    })
}

/// The legacy IPC handle record of CUDA and HIP (compiled under either feature), 88 bytes
/// LE: magic, version `u32` = 1, the exporter's random token `u64` (spots a same-process
/// import), the allocation's size `u64`, the runtime's 64-byte IPC handle.
#[cfg(any(feature = "cuda", feature = "hip"))]
pub(crate) mod ipc {
    use super::{import_error, process_token, Reader, Writer};
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
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAGIC: &[u8; 4] = b"pcts";

    fn record() -> Vec<u8> {
        Writer::new(MAGIC, 3).u32(7).u64(9).bytes(&[1, 2]).finish()
    }

    #[test]
    fn round_trip() {
        let r = record();
        assert_eq!(r.len(), 8 + 4 + 8 + 2);
        let mut rd = Reader::open("host", &r, MAGIC, 3, r.len()).unwrap();
        assert_eq!(rd.u32(), 7);
        assert_eq!(rd.u64(), 9);
        assert_eq!(rd.array::<2>(), [1, 2]);
    }

    fn detail(e: Option<Error>) -> String {
        match e.expect("refused") {
            Error::Backend {
                backend: "host",
                call: "import_memory",
                detail,
            } => detail,
            other => panic!("unexpected error {other:?}"),
        }
    }

    #[test]
    fn header_magic_version_and_length_are_checked() {
        let r = record();
        let n = r.len();
        let cases: [(&[u8], &[u8; 4], u32, String); 4] = [
            (&r[..5], MAGIC, 3, "too short".into()),
            (&r, b"pccu", 3, "another backend".into()),
            (&r, MAGIC, 4, "handle version 3".into()),
            (&r[..n - 1], MAGIC, 3, format!("{} bytes where", n - 1)),
        ];
        for (bytes, magic, version, want) in cases {
            let got = detail(Reader::open("host", bytes, magic, version, n).err());
            assert!(got.contains(&want), "{got}");
        }
    }
}
