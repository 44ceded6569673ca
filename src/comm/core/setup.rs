//! Setting up the peer-memory core of a per-rank communicator over a group of ranks
//! (the whole world, or the ranks of one host): every rank allocates its signal, the
//! ranks exchange records and IPC handles, map each other's signals, agree that peer
//! access exists everywhere, and check that it works (see `peer_check`). When it
//! cannot serve, every rank learns so at the same step and gets its device back, so
//! that the communicator can fall back to the external library.

use crate::backend::handle::process_token;
use crate::backend::{Backend, MemoryKind};
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;
use crate::{backend::signal_init::init_signal_buffer_with_counter_base, SignalLayout};

use super::settings::Settings;
use super::{peer_check, Endpoint};
use crate::comm::config::config_checksum;
use crate::comm::CommConfig;

/// Format version of the per-rank exchange record.
const RECORD_VERSION: u8 = 2;

/// Where the ranks being set up run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// All in this process (the single controller's cores): signals need no export.
    OneProcess,
    /// Each in its own thread or process (the per-rank `Comm`).
    Anywhere,
}

/// A working peer-memory rank: its signal and where it reaches its group's.
pub(crate) struct PeerSetup<B: Backend> {
    pub(crate) endpoint: Endpoint<B>,
    pub(crate) settings: Settings,
    /// Peer signals imported from other processes; unmapped on drop.
    pub(crate) mappings: Vec<B::PeerMapping>,
}

/// What setting up the core over a group gave.
pub(crate) enum Outcome<B: Backend> {
    /// Peer memory serves the group.
    Ready(Box<PeerSetup<B>>),
    /// It cannot (the reason, the same on every rank); the device comes back.
    Refused { device: B::Device, reason: Error },
}

/// What each rank tells the others at setup.
#[derive(Clone, Debug, PartialEq)]
struct PeerRecord {
    /// A random number drawn once per process (`process_token`): ranks with the same
    /// token share a process and reach each other's memory by address. A process id
    /// would not do: processes in different pid namespaces (containers) share ids.
    process: u64,
    /// The device's multiprocessors (CPU cores on the host backend): the grid is
    /// sized from the fewest of the group.
    multiprocessors: u32,
    ordinal: usize,
    signal_addr: u64,
    arch: String,
    checksum: u64,
}

impl PeerRecord {
    fn encode(&self) -> Vec<u8> {
        let mut out = vec![RECORD_VERSION];
        out.extend_from_slice(&self.process.to_le_bytes());
        out.extend_from_slice(&self.multiprocessors.to_le_bytes());
        out.extend_from_slice(&(self.ordinal as u64).to_le_bytes());
        out.extend_from_slice(&self.signal_addr.to_le_bytes());
        out.extend_from_slice(&self.checksum.to_le_bytes());
        out.extend_from_slice(&(self.arch.len() as u32).to_le_bytes());
        out.extend_from_slice(self.arch.as_bytes());
        out
    }

    fn decode(rank: usize, bytes: &[u8]) -> Result<Self> {
        let bad = || Error::InvalidConfig(format!("rank {rank} sent a malformed setup record"));
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8]> {
            let field = bytes.get(at..at + n).ok_or_else(bad)?;
            at += n;
            Ok(field)
        };
        if take(1)?[0] != RECORD_VERSION {
            return Err(Error::InvalidConfig(format!(
                "rank {rank} runs another peercomm version (setup record format)"
            )));
        }
        let process = u64::from_le_bytes(take(8)?.try_into().unwrap());
        let multiprocessors = u32::from_le_bytes(take(4)?.try_into().unwrap());
        let ordinal = u64::from_le_bytes(take(8)?.try_into().unwrap()) as usize;
        let signal_addr = u64::from_le_bytes(take(8)?.try_into().unwrap());
        let checksum = u64::from_le_bytes(take(8)?.try_into().unwrap());
        let n = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
        let arch = String::from_utf8(take(n)?.to_vec()).map_err(|_| bad())?;
        Ok(PeerRecord {
            process,
            multiprocessors,
            ordinal,
            signal_addr,
            arch,
            checksum,
        })
    }
}

/// A core over this rank alone (no peers, no exchange): what a communicator whose
/// whole-world calls go to the external library keeps for groups of one. Its signal
/// is small (its Lamport region and payload are never used by a group of one).
pub(crate) fn solo<B: Backend>(device: B::Device, config: &CommConfig) -> Result<PeerSetup<B>> {
    let arch = B::architecture(&device)?;
    let sms = B::multiprocessor_count(&device)?;
    let mut settings = Settings::new(config.clone(), arch, sms, 1)?;
    settings.layout = SignalLayout {
        lamport_slot_bytes: 4096,
        lamport_slots: 1,
        payload_bytes: 4096,
    };
    let signal = B::alloc(
        &device,
        settings.layout.checked_total_bytes()?,
        MemoryKind::Signal,
    )?;
    init_signal_buffer_with_counter_base::<B>(&device, &signal, settings.layout, 0)?;
    B::synchronize(&device)?;
    let mut peer_signals = [0u64; MAX_GPUS];
    peer_signals[0] = B::memory_ptr(&signal);
    Ok(PeerSetup {
        endpoint: Endpoint::new(0, device, signal, peer_signals),
        settings,
        mappings: Vec::new(),
    })
}

/// Sets up the core over the ranks `members` (world ranks, in group order) that
/// `group` connects; `world` is the whole world's bootstrap, over which every rank
/// learns whether every group succeeded. Every world rank calls this at the same time.
/// An `Err` is a failure that is not about peer access (a bad configuration, a failed
/// allocation, a bootstrap failure).
pub(crate) fn establish<B: Backend>(
    device: B::Device,
    group: &dyn Bootstrap,
    world: &dyn Bootstrap,
    members: &[usize],
    config: &CommConfig,
    placement: Placement,
) -> Result<Outcome<B>> {
    let (me, n) = (group.rank(), group.world_size());
    let checksum = config_checksum(config);
    let arch = B::architecture(&device)?;
    let sms = config
        .simulate
        .multiprocessors_of(members[me], B::multiprocessor_count(&device)?);
    let mut settings = Settings::new(config.clone(), arch.clone(), sms, n)?;
    let layout = settings.layout;
    let kind = if n > 1 && placement == Placement::Anywhere {
        MemoryKind::SharedSignal
    } else {
        MemoryKind::Signal
    };
    let signal = B::alloc(&device, layout.checked_total_bytes()?, kind)?;
    init_signal_buffer_with_counter_base::<B>(&device, &signal, layout, 0)?;
    B::synchronize(&device)?;
    let mine = PeerRecord {
        process: process_token(),
        multiprocessors: u32::try_from(sms).unwrap_or(u32::MAX),
        ordinal: B::ordinal(&device),
        signal_addr: B::memory_ptr(&signal),
        arch,
        checksum,
    };
    let records = group
        .all_gather(&mine.encode())?
        .iter()
        .enumerate()
        .map(|(r, bytes)| PeerRecord::decode(r, bytes))
        .collect::<Result<Vec<_>>>()?;
    // IPC handles only when some rank is in another process. Every rank makes the
    // exchange (empty when not needed): groups of different hosts may decide
    // differently, and their all-gathers are one world all-gather.
    let need_handles = records.iter().any(|p| !same_process(p, &records[0]));
    let mine_handle = if need_handles {
        B::export_memory(&device, &signal)?
    } else {
        Vec::new()
    };
    let handles = group.all_gather(&mine_handle)?;
    // The same grid on every rank of the group: from the fewest multiprocessors, then
    // capped by the most ranks sharing one device.
    let fewest = fewest_multiprocessors(&records);
    settings.agree_on_grid(fewest);
    let per_device = records
        .iter()
        .map(|p| records.iter().filter(|q| q.ordinal == p.ordinal).count())
        .max()
        .unwrap_or(1);
    settings.limit_for_shared_devices(fewest, per_device);
    if records
        .iter()
        .enumerate()
        .any(|(r, p)| r != me && same_process(p, &mine) && p.ordinal == mine.ordinal)
    {
        B::prepare_shared_device(&device)?;
    }
    let mut peer_signals = [0u64; MAX_GPUS];
    let mut mappings = Vec::new();
    let mut problem: Option<Error> = None;
    for (r, peer) in records.iter().enumerate() {
        check_peer_record(members[me], members[r], &mine, peer, config)?;
        peer_signals[r] = if r == me {
            mine.signal_addr
        } else if same_process(peer, &mine) {
            // The same process: the address is valid here once peer access is on.
            if peer.ordinal != mine.ordinal {
                let reachable = !config.simulate.blocks_pair(members[me], members[r])
                    && enable_peer_access_to::<B>(&device, peer.ordinal)?;
                if !reachable {
                    problem.get_or_insert(Error::P2pUnavailable {
                        from: mine.ordinal,
                        to: peer.ordinal,
                    });
                }
            } else if config.simulate.blocks_pair(members[me], members[r]) {
                problem.get_or_insert(Error::P2pUnavailable {
                    from: mine.ordinal,
                    to: peer.ordinal,
                });
            }
            peer.signal_addr
        } else {
            if config.simulate.blocks_pair(members[me], members[r]) {
                problem.get_or_insert(Error::P2pUnavailable {
                    from: mine.ordinal,
                    to: peer.ordinal,
                });
            }
            let mapping = B::import_memory(&device, &handles[r])?;
            let addr = B::mapping_ptr(&mapping);
            mappings.push(mapping);
            addr
        };
    }
    // Every world rank learns whether any lacks peer access (this all-gather also
    // orders every mapping before any launch).
    if let Some(reason) = agree(world, problem)? {
        drop(mappings);
        drop(signal);
        return Ok(Outcome::Refused { device, reason });
    }
    let core = PeerSetup {
        endpoint: Endpoint::new(me, device, signal, peer_signals),
        settings,
        mappings,
    };
    let corrupt = config.simulate.fail_peer_check == Some(members[me]);
    let verdict = peer_check::check_rank(&core.endpoint, &core.settings, corrupt)?;
    let failed: Vec<(usize, String)> = world
        .all_gather(verdict.as_deref().unwrap_or("").as_bytes())?
        .into_iter()
        .enumerate()
        .filter(|(_, v)| !v.is_empty())
        .map(|(r, v)| (r, String::from_utf8_lossy(&v).into_owned()))
        .collect();
    if failed.is_empty() {
        return Ok(Outcome::Ready(Box::new(core)));
    }
    let PeerSetup {
        endpoint: Endpoint { device, signal, .. },
        mappings,
        ..
    } = core;
    // Every kernel of the check has finished on every rank (each waited before its
    // verdict), so the signals may go.
    drop(mappings);
    drop(signal);
    Ok(Outcome::Refused {
        device,
        reason: Error::PeerCheckFailed {
            ranks: failed.iter().map(|(r, _)| *r).collect(),
            detail: failed[0].1.clone(),
        },
    })
}

/// Whether two ranks run in one process (and reach each other's memory by address).
fn same_process(a: &PeerRecord, b: &PeerRecord) -> bool {
    a.process == b.process
}

/// The fewest multiprocessors of any rank: the grid every rank of the group uses.
fn fewest_multiprocessors(records: &[PeerRecord]) -> usize {
    records
        .iter()
        .map(|p| p.multiprocessors as usize)
        .min()
        .unwrap_or(1)
        .max(1)
}

/// All-gathers each rank's problem over the world; the first rank's problem, if any
/// rank has one, is every rank's answer.
fn agree(world: &dyn Bootstrap, problem: Option<Error>) -> Result<Option<Error>> {
    let code = match &problem {
        Some(Error::P2pUnavailable { from, to }) => {
            let mut v = vec![1u8];
            v.extend_from_slice(&(*from as u64).to_le_bytes());
            v.extend_from_slice(&(*to as u64).to_le_bytes());
            v
        }
        Some(_) => vec![2u8],
        None => Vec::new(),
    };
    for (r, bytes) in world.all_gather(&code)?.into_iter().enumerate() {
        match bytes.first() {
            Some(1) if bytes.len() == 17 => {
                let from = u64::from_le_bytes(bytes[1..9].try_into().unwrap()) as usize;
                let to = u64::from_le_bytes(bytes[9..17].try_into().unwrap()) as usize;
                return Ok(Some(Error::P2pUnavailable { from, to }));
            }
            Some(_) => {
                return Ok(Some(Error::InvalidDevices(format!(
                    "rank {r} cannot reach a peer's memory"
                ))))
            }
            None => {}
        }
    }
    Ok(None)
}

/// Checks what rank `r` reported against this rank's own record.
fn check_peer_record(
    me: usize,
    r: usize,
    mine: &PeerRecord,
    peer: &PeerRecord,
    config: &CommConfig,
) -> Result<()> {
    if peer.checksum != mine.checksum {
        return Err(Error::InvalidConfig(format!(
            "rank {r}'s configuration differs from rank {me}'s: every rank must pass the same \
             CommConfig"
        )));
    }
    if peer.arch != mine.arch {
        return Err(Error::InvalidDevices(format!(
            "rank {r} runs on {} and rank {me} on {}: one architecture per communicator",
            peer.arch, mine.arch
        )));
    }
    if r != me && peer.ordinal == mine.ordinal && !config.allow_shared_devices {
        return Err(Error::InvalidDevices(format!(
            "ranks {me} and {r} are both on device {} (set allow_shared_devices for tests)",
            mine.ordinal
        )));
    }
    Ok(())
}

/// Lets `dev` reach memory of device `peer_ordinal` in this process; `false` when the
/// devices have no peer access.
fn enable_peer_access_to<B: Backend>(dev: &B::Device, peer_ordinal: usize) -> Result<bool> {
    let peer = B::open(peer_ordinal)?;
    if !B::can_access_peer(dev, &peer)? {
        return Ok(false);
    }
    B::enable_peer_access(dev, &peer)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(process: u64, multiprocessors: u32) -> PeerRecord {
        PeerRecord {
            process,
            multiprocessors,
            ordinal: 0,
            signal_addr: 0x1000,
            arch: "host".into(),
            checksum: 7,
        }
    }

    #[test]
    fn records_round_trip() {
        let r = record(0xdead_beef_0123, 132);
        assert_eq!(PeerRecord::decode(1, &r.encode()).unwrap(), r);
    }

    /// Two containers of one pod can both be pid 1: the process is told by its token,
    /// so such ranks import each other's memory instead of using raw addresses.
    #[test]
    fn the_process_is_told_by_its_token_not_its_pid() {
        let a = record(1, 4);
        let b = record(2, 4);
        assert!(!same_process(&a, &b));
        assert!(same_process(&a, &record(1, 8)));
        assert_ne!(process_token(), 0);
        assert_eq!(process_token(), process_token());
    }

    #[test]
    fn the_grid_comes_from_the_fewest_multiprocessors() {
        let records = [record(1, 2), record(2, 1), record(3, 132)];
        assert_eq!(fewest_multiprocessors(&records), 1);
        assert_eq!(fewest_multiprocessors(&[record(1, 0)]), 1);
    }
}
