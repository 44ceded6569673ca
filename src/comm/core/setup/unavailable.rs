//! When peer access is unavailable: the typed error with its hint, agreed by every rank
//! of the world.

use crate::backend::DeviceIdentity;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};

use crate::comm::core::setup::record::{put_text, Reader};

/// All-gathers each rank's problem over the world; the first one is every rank's answer.
pub(crate) fn agree(world: &dyn Bootstrap, problem: Option<Error>) -> Result<Option<Error>> {
    let code = problem.as_ref().map_or(Vec::new(), encode_unavailable);
    let all = world.all_gather(&code)?;
    let Some(r) = all.iter().position(|b| !b.is_empty()) else {
        return Ok(None);
    };
    let unknown = || Error::InvalidDevices(format!("rank {r} cannot reach a peer's memory"));
    Ok(Some(decode_unavailable(&all[r]).unwrap_or_else(unknown)))
}

/// A [`Error::P2pUnavailable`] as bytes for [`agree`]: tag 1, the four numbers
/// (`u64`), the detail and the hint (length-prefixed text); tag 2 for other errors.
pub(crate) fn encode_unavailable(e: &Error) -> Vec<u8> {
    let Error::P2pUnavailable {
        from,
        to,
        from_rank,
        to_rank,
        detail,
        hint,
    } = e
    else {
        return vec![2u8];
    };
    let mut v = vec![1u8];
    for n in [from, to, from_rank, to_rank] {
        v.extend_from_slice(&(*n as u64).to_le_bytes());
    }
    put_text(&mut v, detail);
    put_text(&mut v, hint);
    v
}

/// The error [`encode_unavailable`] wrote, or `None` for anything else.
pub(crate) fn decode_unavailable(bytes: &[u8]) -> Option<Error> {
    let mut r = Reader(bytes);
    if r.take(1)? != [1] {
        return None;
    }
    let mut number = || r.u64().map(|n| n as usize);
    let (from, to, from_rank, to_rank) = (number()?, number()?, number()?, number()?);
    let (detail, hint) = (r.text()?, r.text()?);
    Some(Error::P2pUnavailable {
        from,
        to,
        from_rank,
        to_rank,
        detail,
        hint,
    })
}

/// What serves where peer memory cannot, for the hints.
pub(crate) const FALLBACK_HINT: &str =
    "keep FallbackConfig::fallback = External (the default), under \
                             which the external library (NCCL/RCCL) serves the group";

/// Where to look at the links between GPUs, per backend.
pub(crate) fn topology_tool(backend: &str) -> &'static str {
    match backend {
        "cuda" => "`nvidia-smi topo -p2p r`",
        "hip" => "`rocm-smi --showtopo`",
        _ => "the platform's topology tool",
    }
}

/// The hint where the driver reports no peer access between two devices.
pub(crate) fn no_path_hint(backend: &str) -> String {
    format!(
        "The two GPUs have no peer-to-peer path (see {}; PCIe P2P may be off in the BIOS \
         or under an IOMMU, or unsupported across CPU sockets): place the group on GPUs with \
         P2P between every pair, or {FALLBACK_HINT}",
        topology_tool(backend)
    )
}

/// The hint where mapping another process's memory failed.
pub(crate) fn import_hint(backend: &str) -> String {
    format!(
        "Processes isolated by CUDA_VISIBLE_DEVICES are supported (devices are told apart \
         by UUID); the mapping fails when the two GPUs have no peer-to-peer path (see {}), \
         or when the processes may not share memory (run the ranks as one user, on one \
         host, containers in one IPC namespace such as --ipc=host): fix that, or \
         {FALLBACK_HINT}",
        topology_tool(backend)
    )
}

/// The typed error for missing peer access from world rank `a` (on `ia`) to `b` (`ib`).
pub(crate) fn p2p_unavailable(
    a: usize,
    ia: &DeviceIdentity,
    b: usize,
    ib: &DeviceIdentity,
    cause: String,
    hint: String,
) -> Error {
    Error::P2pUnavailable {
        from: ia.ordinal(),
        to: ib.ordinal(),
        from_rank: a,
        to_rank: b,
        detail: format!(
            "rank {a} is on {ia} and rank {b} on {ib} (ordinals as each rank's process sees \
             them); {cause}"
        ),
        hint,
    }
}
