//! Symmetric buffers ([`Comm::alloc_symmetric`]): memory every peer has mapped, at the
//! same offset of the communicator's pool on every rank. The pool's segments are
//! exportable allocations ([`MemoryKind::SharedData`]) registered with every peer once;
//! a deterministic first fit places a buffer alike on every rank that allocated and
//! dropped alike (the ranks compare placements). A dropped range is reused only after
//! this rank's queued work, whose end barriers waited for the peers' reads.
//! [`Comm::trim_symmetric`] frees, collectively, the segments no rank holds a buffer in
//! (kept mapped otherwise, so that the next allocation costs no export or import).

use crate::error::lock;
use std::sync::{Arc, Mutex};

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut, MemoryKind, TypedBuffer};
use crate::bootstrap::{Bootstrap, ExchangeKind};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

use super::records::{decode, decode_all, encode, malformed, refusal_of, refused, take};
use super::records::{SYMMETRIC_RECORD, TRIM_RECORD};
use super::registry::register_range;
use crate::comm::core::planning::staging::message_bytes;
use crate::comm::per_rank::Comm;
use crate::comm::zero_copy::pool::{reclaim, Segment, ALIGN};

/// Bytes of a symmetric pool segment (a larger buffer gets a segment of its own size,
/// rounded up to 2 MiB). Allocated when the first buffer that needs it is.
pub const SYMMETRIC_SEGMENT_BYTES: usize = 64 << 20;

/// `len` elements of `T` in a per-rank communicator's symmetric pool
/// ([`Comm::alloc_symmetric`]): at the same offset on every rank and mapped by every
/// peer, so collectives whose input it holds read it in place. A device buffer of the
/// crate (on CUDA also cudarc's `DevicePtr` / `DevicePtrMut`) that tracks no events:
/// work on another stream orders itself. An empty segment stays mapped until
/// [`Comm::trim_symmetric`] or the communicator's drop.
pub struct SymmetricBuffer<B: Backend, T: Element> {
    segment: Arc<Segment<B>>,
    offset: u64,
    /// Bytes of the range (whole alignment units).
    span: u64,
    len: usize,
    ordinal: usize,
    _t: std::marker::PhantomData<T>,
}

impl<B: Backend, T: Element> SymmetricBuffer<B, T> {
    /// The device address of the first element.
    pub fn device_address(&self) -> u64 {
        B::memory_ptr(&self.segment.memory) + self.offset
    }
    /// Where it lies in the pool: (segment, byte offset), the same on every rank.
    pub fn placement(&self) -> (u64, u64) {
        (self.segment.registration, self.offset)
    }
    /// The segment's memory (for the backends' own trait implementations).
    #[allow(dead_code)]
    pub(crate) fn memory(&self) -> &B::Memory {
        &self.segment.memory
    }
}

impl<B: Backend, T: Element> Drop for SymmetricBuffer<B, T> {
    fn drop(&mut self) {
        lock(&self.segment.dropped).push((self.offset, self.span));
    }
}

impl<B: Backend, T: Element> std::fmt::Debug for SymmetricBuffer<B, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmetricBuffer")
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .field("segment", &self.segment.registration)
            .field("offset", &self.offset)
            .finish()
    }
}

// SAFETY: the address is inside the live segment (held by the buffer), `len` elements
// of `T` fit in the range taken for it, on the device the segment was allocated on;
// the segment is mapped by every peer, so the peers' kernels reach it.
unsafe impl<B: Backend, T: Element> DeviceBuffer<B> for SymmetricBuffer<B, T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_ordinal(&self) -> usize {
        self.ordinal
    }
    fn read_ptr<'a>(&'a self, _dev: &'a B::Device) -> (u64, B::Access<'a>) {
        (self.device_address(), B::untracked_access())
    }
}

// SAFETY: as above; the range is this buffer's alone.
unsafe impl<B: Backend, T: Element> DeviceBufferMut<B> for SymmetricBuffer<B, T> {
    fn write_ptr<'a>(&'a mut self, _dev: &'a B::Device) -> (u64, B::Access<'a>) {
        (self.device_address(), B::untracked_access())
    }
}

/// The bytes of a slice of elements.
fn as_bytes<T: Element>(v: &[T]) -> &[u8] {
    // SAFETY: elements are plain numbers (f32, f16, bf16) with no padding; the byte
    // view covers exactly the slice's memory, borrowed as long as it.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

impl<B: Backend, T: Element> TypedBuffer<B> for SymmetricBuffer<B, T> {
    type Elem = T;
    fn copy_from_host(&mut self, dev: &B::Device, src: &[T]) -> Result<()> {
        if src.len() != self.len {
            let (n, len) = (src.len(), self.len);
            let what = format!("upload of {n} elements into a symmetric buffer of {len}");
            return Err(Error::LengthMismatch {
                rank: self.ordinal,
                what,
            });
        }
        B::write(dev, self.device_address(), as_bytes(src))
    }
    fn to_host(&self, dev: &B::Device) -> Result<Vec<T>> {
        let mut out = vec![T::from_f32(0.0); self.len];
        // SAFETY: as in `as_bytes`, for the freshly made vector, borrowed mutably.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                out.as_mut_ptr() as *mut u8,
                std::mem::size_of_val(&out[..]),
            )
        };
        B::read(dev, self.device_address(), bytes)?;
        Ok(out)
    }
}

/// One rank's placement of an allocation, as gathered, and why it cannot allocate
/// (empty: it can; see [`super::records`]).
#[derive(Clone, Debug)]
struct SlotRecord {
    segment: u64,
    offset: u64,
    span: u64,
    new_segment_bytes: u64,
    refusal: String,
}

impl SlotRecord {
    fn encode(&self) -> Vec<u8> {
        encode(SYMMETRIC_RECORD, &self.place(), self.refusal.as_bytes())
    }
    fn decode(rank: usize, b: &[u8]) -> Result<Self> {
        let ([segment, offset, span, new_segment_bytes], rest) = decode(rank, b, SYMMETRIC_RECORD)?;
        let refusal = String::from_utf8_lossy(rest).into_owned();
        Ok(SlotRecord {
            segment,
            offset,
            span,
            new_segment_bytes,
            refusal,
        })
    }
    /// Where it lies, without the refusal.
    fn place(&self) -> [u64; 4] {
        [self.segment, self.offset, self.span, self.new_segment_bytes]
    }
    /// Where it lies, in words.
    fn describe(&self) -> String {
        let new = match self.new_segment_bytes {
            0 => String::new(),
            n => format!(" (a new segment of {n} bytes)"),
        };
        format!(
            "{} bytes at offset {} of segment {}{new}",
            self.span, self.offset, self.segment
        )
    }
}

impl<B: Backend> Comm<B> {
    /// Allocates `len` elements of `T` in the symmetric pool (collective: the same length
    /// and type on every rank, in the same order as the other allocations, drops and
    /// [`Comm::register`] calls). Placements that differ, or a peer that registers
    /// meanwhile, are [`Error::CannotRegister`] on every rank; a refusal of this rank's
    /// own (poisoned, [`Error::SizeOverflow`], a failed allocation) is that error here.
    /// Nothing is allocated anywhere on an error. Needs peer memory across the world.
    pub fn alloc_symmetric<T: Element>(&self, len: usize) -> Result<SymmetricBuffer<B, T>> {
        let core = &*self.core;
        let mut segments = lock(&self.pool);
        // A local refusal is still gathered (see `SlotRecord`).
        let local = core
            .check_usable()
            .and_then(|_| self.check_zero_copy())
            .and_then(|_| {
                // Checked, so that no size below wraps: isize::MAX bytes, rounded up to
                // the alignment and a segment, stay within u64.
                message_bytes(T::DTYPE, len, &|| "a symmetric buffer".into())?;
                Ok(((len * T::DTYPE.size()).max(1) as u64).next_multiple_of(ALIGN))
            })
            // Dropped ranges are reused only after the work queued before their drop.
            .and_then(|span| reclaim(&segments, core.device()).map(|_| span));
        let span = *local.as_ref().unwrap_or(&0);
        let (segment, offset, new_segment_bytes) = segments
            .iter()
            .enumerate()
            .find_map(|(i, s)| s.first_fit(span).map(|o| (i as u64, o, 0)))
            .unwrap_or_else(|| {
                let bytes = span.max(SYMMETRIC_SEGMENT_BYTES as u64);
                (segments.len() as u64, 0, bytes.next_multiple_of(2 << 20))
            });
        let mine = SlotRecord {
            segment,
            offset,
            span,
            new_segment_bytes,
            refusal: refusal_of(&local),
        };
        let bootstrap = self.exchanges.of(ExchangeKind::Symmetric);
        let gathered = bootstrap.all_gather(&mine.encode());
        for (r, theirs) in decode_all(gathered, local.map(drop), SlotRecord::decode)?
            .into_iter()
            .enumerate()
        {
            if !theirs.refusal.is_empty() {
                return Err(refused(r, theirs.refusal));
            }
            if theirs.place() != mine.place() {
                let (t, me, m) = (theirs.describe(), self.rank(), mine.describe());
                let why = format!(
                    "its symmetric allocation would be {t} where rank {me} places it at {m}: \
                     every rank allocates and drops symmetric buffers of the same sizes in the \
                     same order"
                );
                return Err(refused(r, why));
            }
        }
        if mine.new_segment_bytes > 0 {
            // A failed allocation is still gathered by the registration (every rank
            // refuses together).
            let memory = usize::try_from(mine.new_segment_bytes)
                .map_err(|_| Error::Unsupported("a segment too large for this host".into()))
                .and_then(|bytes| B::alloc(core.device(), bytes, MemoryKind::SharedData));
            let ptr = memory.as_ref().map_or(0, B::memory_ptr);
            let local = memory.as_ref().map(drop).map_err(Error::clone);
            let registration = register_range(
                &self.registry,
                core.device(),
                &bootstrap,
                ptr,
                mine.new_segment_bytes as usize,
                local,
                true,
            )?;
            let memory = memory.expect("registered only where allocated");
            segments.push(Arc::new(Segment {
                memory,
                bytes: mine.new_segment_bytes,
                registration,
                registry: self.registry.clone(),
                free: Mutex::new(vec![(0, mine.new_segment_bytes)]),
                dropped: Mutex::new(Vec::new()),
            }));
        }
        let segment = segments[mine.segment as usize].clone();
        debug_assert!(mine.offset + span <= segment.bytes);
        segment.take(mine.offset, span);
        Ok(SymmetricBuffer {
            segment,
            offset: mine.offset,
            span,
            len,
            ordinal: core.ordinal(),
            _t: std::marker::PhantomData,
        })
    }
}

#[cfg(feature = "cuda")]
mod cuda_traits {
    //! cudarc's slice traits for symmetric buffers, taken as a `CudaSlice` is.
    use std::sync::Arc;

    use cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

    use super::SymmetricBuffer;
    use crate::backend::cuda::Cuda;
    use crate::dtype::Element;

    impl<T: Element> DeviceSlice<T> for SymmetricBuffer<Cuda, T> {
        fn len(&self) -> usize {
            self.len
        }
        fn stream(&self) -> &Arc<CudaStream> {
            self.memory().stream()
        }
    }

    impl<T: Element> DevicePtr<T> for SymmetricBuffer<Cuda, T> {
        /// No event: the buffer tracks none (see the type's docs).
        fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
            (self.device_address(), SyncOnDrop::Sync(None))
        }
    }

    impl<T: Element> DevicePtrMut<T> for SymmetricBuffer<Cuda, T> {
        /// No event: the buffer tracks none (see the type's docs).
        fn device_ptr_mut<'a>(
            &'a mut self,
            _stream: &'a CudaStream,
        ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
            (self.device_address(), SyncOnDrop::Sync(None))
        }
    }
}

/// One rank's record: which of its segments are empty, or why it refuses.
fn trim_record(empty: &[bool], refusal: &str) -> Vec<u8> {
    let text: Vec<u8> = empty
        .iter()
        .map(|&e| e as u8)
        .chain(refusal.bytes())
        .collect();
    encode(TRIM_RECORD, &[empty.len() as u64], &text)
}

/// Rank `rank`'s empty segments, from its record.
fn trim_flags(rank: usize, b: &[u8], segments: usize) -> Result<Vec<bool>> {
    let ([count], rest) = decode(rank, b, TRIM_RECORD)?;
    let (flags, refusal) = take(rest, count).ok_or_else(|| malformed(rank, b))?;
    if !refusal.is_empty() {
        return Err(refused(rank, String::from_utf8_lossy(refusal).into_owned()));
    }
    if count != segments as u64 {
        return Err(refused(
            rank,
            format!(
                "its symmetric pool has {count} segments where this rank's has {segments}: \
                 every rank allocates and drops symmetric buffers in the same order"
            ),
        ));
    }
    Ok(flags.iter().map(|&f| f == 1).collect())
}

impl<B: Backend> Comm<B> {
    /// Frees the symmetric pool's segments that hold no buffer on any rank (collective:
    /// in the same order as the symmetric allocations and registrations) and returns
    /// the bytes this rank freed. Every rank closes its mappings of the freed segments
    /// before any rank frees the memory. [`crate::Error::CannotRegister`] on every rank where a
    /// peer allocates or registers meanwhile, or its pool differs; a poisoned
    /// communicator is [`crate::Error::Poisoned`] here and `CannotRegister` on the peers.
    pub fn trim_symmetric(&self) -> Result<u64> {
        let core = &*self.core;
        let mut segments = lock(&self.pool);
        // Dropped ranges count as free once this rank's work before the drop is done.
        let local = core
            .check_usable()
            .and_then(|_| reclaim(&segments, core.device()));
        // Empty: no buffer holds it (the pool's handle is the only one) and all of it
        // is free.
        let empty: Vec<bool> = segments
            .iter()
            .map(|s| local.is_ok() && Arc::strong_count(s) == 1 && s.is_whole())
            .collect();
        let bootstrap = self.exchanges.of(ExchangeKind::Trim);
        let gathered = bootstrap.all_gather(&trim_record(&empty, &refusal_of(&local)));
        let lists = decode_all(gathered, local, |r, b| trim_flags(r, b, segments.len()))?;
        let free_everywhere = |i: usize| lists.iter().all(|l| l[i]);
        if !(0..segments.len()).any(free_everywhere) {
            return Ok(0);
        }
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut *segments)
            .into_iter()
            .enumerate()
            .partition(|(i, _)| free_everywhere(*i));
        *segments = kept.into_iter().map(|(_, s)| s).collect();
        // First every rank closes its mappings of the peers' segments, then the memory
        // goes: no rank frees what a peer still has mapped.
        for (_, s) in &gone {
            self.registry.remove(s.registration);
        }
        let closed = bootstrap.barrier();
        let bytes = gone.iter().map(|(_, s)| s.bytes).sum();
        drop(gone);
        closed?;
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::zero_copy::records::refused_by;

    #[test]
    fn records_round_trip_and_refuse_other_kinds() {
        let flags = trim_flags(1, &trim_record(&[true, false], ""), 2).unwrap();
        assert_eq!(flags, vec![true, false]);
        for (record, what) in [
            (trim_record(&[true], "poisoned"), "poisoned"),
            (trim_record(&[true, true], ""), "2 segments"),
            (encode(SYMMETRIC_RECORD, &[0, 0], b""), "symmetric"),
        ] {
            let reason = refused_by(trim_flags(3, &record, 1), 3);
            assert!(reason.contains(what), "{reason}");
        }
    }
}
