//! The host backend's stand-in for NCCL, so the routing runs (and is tested) anywhere:
//! a job on the rank's host stream all-gathers the elements over a [`Bootstrap`] and
//! sums them in group rank order in f32, as the kernels do. A failed exchange is
//! reported by the next `synchronize`.

use std::sync::{Arc, Mutex};

use super::local::LocalBootstrap;
use super::{Call, ExternalAllReduce, ExternalLibrary, HasExternalLibrary};
use crate::backend::host::{Host, HostDevice};
use crate::bootstrap::Bootstrap;
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};

/// The host stand-in library (see the module docs).
pub struct HostLibrary;

/// The host backend's external library is the stand-in.
impl HasExternalLibrary for Host {
    fn external_library() -> &'static dyn ExternalLibrary<Host> {
        &HostLibrary
    }
}

/// How long the single controller's in-process exchange waits for a rank.
const LOCAL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

impl ExternalLibrary<Host> for HostLibrary {
    fn name(&self) -> &'static str {
        "host"
    }
    fn check_available(&self) -> Result<()> {
        Ok(())
    }
    fn per_rank(
        &self,
        _dev: &HostDevice,
        bootstrap: Arc<dyn Bootstrap>,
        members: &[usize],
    ) -> Result<Box<dyn ExternalAllReduce<Host>>> {
        // The same all-gather as a real library's id exchange, so that every rank
        // makes the same bootstrap calls whatever the backend.
        bootstrap.barrier()?;
        Ok(Box::new(HostAllReduce {
            bootstrap,
            members: members.to_vec(),
            error: Arc::new(Mutex::new(None)),
        }))
    }
    fn single_controller(
        &self,
        devices: &[&HostDevice],
    ) -> Result<Vec<Box<dyn ExternalAllReduce<Host>>>> {
        let members: Vec<usize> = (0..devices.len()).collect();
        Ok(LocalBootstrap::world(devices.len(), LOCAL_TIMEOUT)
            .into_iter()
            .map(|b| {
                Box::new(HostAllReduce {
                    bootstrap: Arc::new(b),
                    members: members.clone(),
                    error: Arc::new(Mutex::new(None)),
                }) as Box<dyn ExternalAllReduce<Host>>
            })
            .collect())
    }
}

/// One rank's handle of the host stand-in.
struct HostAllReduce {
    bootstrap: Arc<dyn Bootstrap>,
    /// World ranks of the group, in group order.
    members: Vec<usize>,
    /// The first failure of a job, until `take_async_error`.
    error: Arc<Mutex<Option<Error>>>,
}

impl ExternalAllReduce<Host> for HostAllReduce {
    fn library(&self) -> &'static str {
        "host"
    }

    unsafe fn all_reduce(&self, dev: &HostDevice, call: Call) -> Result<()> {
        let (send, recv, elements, dtype, op) = call;
        let (bootstrap, members) = (self.bootstrap.clone(), self.members.clone());
        let error = self.error.clone();
        let bytes = elements * dtype.size();
        dev.enqueue_host_fn(move || {
            // SAFETY: the caller guarantees `bytes` bytes at `send` stay valid until this
            // job (ordered on the rank's stream) has run.
            let mine = unsafe { std::slice::from_raw_parts(send as *const u8, bytes) }.to_vec();
            let result = bootstrap
                .all_gather(&mine)
                .map_err(Error::from)
                .and_then(|all| {
                    let parts: Vec<&[u8]> = members.iter().map(|&m| all[m].as_slice()).collect();
                    if parts.iter().any(|p| p.len() != bytes) {
                        return Err(Error::External {
                            library: "host",
                            call: "all_reduce",
                            detail: "the ranks of the group passed different lengths".into(),
                        });
                    }
                    Ok(reduce_in_order(dtype, op, &parts))
                });
            match result {
                // SAFETY: as for `send`; `recv` holds `bytes` bytes.
                Ok(sum) => unsafe {
                    std::ptr::copy_nonoverlapping(sum.as_ptr(), recv as *mut u8, bytes)
                },
                Err(e) => {
                    let mut slot = error.lock().unwrap_or_else(|p| p.into_inner());
                    slot.get_or_insert(e);
                }
            }
        });
        Ok(())
    }

    fn take_async_error(&self) -> Result<()> {
        let error = self.error.lock().unwrap_or_else(|p| p.into_inner()).take();
        error.map_or(Ok(()), Err)
    }
}

/// The element-wise reduction of `parts` (little-endian elements of `dtype`) in order, in
/// the element's accumulator (as the kernels).
fn reduce_in_order(dtype: DType, op: ReduceOp, parts: &[&[u8]]) -> Vec<u8> {
    fn typed<T: Element>(op: ReduceOp, parts: &[&[u8]]) -> Vec<u8> {
        let width = std::mem::size_of::<T>();
        let at = |p: &[u8], e: usize| {
            let mut bits = [0u8; 8];
            bits[..width].copy_from_slice(&p[e * width..(e + 1) * width]);
            T::from_bits_u64(u64::from_le_bytes(bits)).to_acc()
        };
        (0..parts[0].len() / width)
            .flat_map(|e| {
                let start = op.start(at(parts[0], e), parts.len());
                let acc = (parts[1..].iter()).fold(start, |acc, p| op.combine(acc, at(p, e)));
                let bits = T::from_acc(op.finish(acc, parts.len()))
                    .to_bits_u64()
                    .to_le_bytes();
                bits.into_iter().take(width)
            })
            .collect()
    }
    match dtype {
        DType::F32 => typed::<f32>(op, parts),
        DType::F16 => typed::<half::f16>(op, parts),
        DType::BF16 => typed::<half::bf16>(op, parts),
        DType::F64 => typed::<f64>(op, parts),
        DType::I8 => typed::<i8>(op, parts),
        DType::U8 => typed::<u8>(op, parts),
        DType::I32 => typed::<i32>(op, parts),
        DType::U32 => typed::<u32>(op, parts),
        DType::I64 => typed::<i64>(op, parts),
        DType::U64 => typed::<u64>(op, parts),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_in_rank_order_like_the_kernels() {
        let a = [1e8f32, -0.0, 1.0];
        let b = [1.0f32, -0.0, f32::NAN];
        let c = [-1e8f32, -0.0, 2.0];
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let (a, b, c) = (bytes(&a), bytes(&b), bytes(&c));
        let f32s = |op| -> Vec<u32> {
            let out = reduce_in_order(DType::F32, op, &[&a, &b, &c]);
            let word = |c: &[u8]| u32::from_le_bytes(c.try_into().unwrap());
            out.chunks(4).map(word).collect()
        };
        let got = f32s(ReduceOp::Sum);
        // (1e8 + 1) - 1e8 in f32 is 0 (1 is lost), in this order only.
        assert_eq!(got[0], ((1e8f32 + 1.0) + -1e8f32).to_bits());
        // As the kernels: an exact-zero sum over two or more ranks is +0.0.
        assert_eq!(got[1], 0);
        assert!(f32::from_bits(got[2]).is_nan());
        assert_eq!(
            f32s(ReduceOp::Max),
            [1e8f32.to_bits(), 0x8000_0000, 0x7fc0_0000]
        );
        let h = |v: f32| half::bf16::from_f32(v).to_le_bytes();
        let parts = [&h(1.5)[..], &h(2.25)[..], &h(-0.25)[..]];
        assert_eq!(reduce_in_order(DType::BF16, ReduceOp::Sum, &parts), h(3.5));
        assert_eq!(
            reduce_in_order(DType::BF16, ReduceOp::Avg, &parts),
            h(3.5 / 3.0)
        );
        let i = |v: i8| v.to_le_bytes();
        let parts = [&i(100)[..], &i(50)[..], &i(-3)[..]];
        assert_eq!(reduce_in_order(DType::I8, ReduceOp::Sum, &parts), i(-109));
        assert_eq!(reduce_in_order(DType::I8, ReduceOp::Min, &parts), i(-3));
    }
}
