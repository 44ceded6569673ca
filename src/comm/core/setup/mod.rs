//! Setting up the peer-memory core over a group (the world, or one host's ranks):
//! signals allocated, records and IPC handles exchanged, signals mapped, peer access
//! agreed and checked. Where it cannot serve, every rank learns so at the same step and
//! gets its device back for the external library. Devices are told apart by
//! [`DeviceIdentity`], never by ordinal (isolated processes all call their GPU 0).

use crate::backend::handle::process_token;
use crate::backend::{Backend, DeviceIdentity, MemoryKind};
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;
use crate::{backend::signal_init::init_signal_buffer_with_counter_base, SignalLayout};

use crate::comm::core::launch::Endpoint;
use crate::comm::core::settings::Settings;
use crate::comm::core::setup::record::*;
use crate::comm::core::setup::unavailable::*;
use crate::comm::CommConfig;

/// Where the ranks being set up run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RankProcesses {
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

/// The identity world rank `world_rank` reports for `device` (or a simulated one).
pub(crate) fn identity_of<B: Backend>(
    device: &B::Device,
    world_rank: usize,
    config: &CommConfig,
) -> Result<DeviceIdentity> {
    Ok(config.identity_of(world_rank, B::identity(device)?))
}

/// A signal of `layout` on `device`, initialised.
fn new_signal<B: Backend>(
    dev: &B::Device,
    layout: SignalLayout,
    kind: MemoryKind,
) -> Result<B::Memory> {
    let signal = B::alloc(dev, layout.checked_total_bytes()?, kind)?;
    init_signal_buffer_with_counter_base::<B>(dev, &signal, layout, 0)?;
    B::synchronize(dev)?;
    Ok(signal)
}

/// A core over this rank alone, for groups of one where the world goes to the external
/// library; its signal is small (a group of one uses no Lamport region or payload).
pub(crate) fn solo<B: Backend>(device: B::Device, config: &CommConfig) -> Result<PeerSetup<B>> {
    let arch = B::architecture(&device)?;
    let sms = B::multiprocessor_count(&device)?;
    let mut settings = Settings::new(config.clone(), arch, sms, 1)?;
    settings.layout = SignalLayout {
        lamport_slot_bytes: 4096,
        lamport_slots: 1,
        payload_bytes: 4096,
    };
    let signal = new_signal::<B>(&device, settings.layout, MemoryKind::Signal)?;
    let mut peer_signals = [0u64; MAX_GPUS];
    peer_signals[0] = B::memory_ptr(&signal);
    Ok(PeerSetup {
        endpoint: Endpoint::new(0, device, signal, peer_signals),
        settings,
        mappings: Vec::new(),
    })
}

/// Sets up the core over the world ranks `members` that `group` connects; every rank
/// learns over `world` whether every group succeeded. An `Err` is a failure not about
/// peer access (configuration, allocation, bootstrap).
pub(crate) fn establish<B: Backend>(
    device: B::Device,
    group: &dyn Bootstrap,
    world: &dyn Bootstrap,
    members: &[usize],
    config: &CommConfig,
    placement: RankProcesses,
) -> Result<Outcome<B>> {
    let (me, n) = (group.rank(), group.world_size());
    let arch = B::architecture(&device)?;
    let sms = config.multiprocessors_of(members[me], B::multiprocessor_count(&device)?);
    let mut settings = Settings::new(config.clone(), arch.clone(), sms, n)?;
    let kind = if n > 1 && placement == RankProcesses::Anywhere {
        MemoryKind::SharedSignal
    } else {
        MemoryKind::Signal
    };
    let signal = new_signal::<B>(&device, settings.layout, kind)?;
    let mine = PeerRecord {
        process: process_token(),
        multiprocessors: u32::try_from(sms).unwrap_or(u32::MAX),
        identity: identity_of::<B>(&device, members[me], config)?,
        signal_addr: B::memory_ptr(&signal),
        arch,
    };
    let records = group
        .all_gather(&mine.encode())?
        .iter()
        .enumerate()
        .map(|(r, bytes)| PeerRecord::decode(r, bytes))
        .collect::<Result<Vec<_>>>()?;
    // IPC handles only where some rank is in another process; every rank exchanges
    // (empty if unneeded): the groups' all-gathers are one world all-gather.
    let need_handles = records.iter().any(|p| !same_process(p, &records[0]));
    let mine_handle = if need_handles {
        B::export_memory(&device, &signal)?
    } else {
        Vec::new()
    };
    let handles = group.all_gather(&mine_handle)?;
    // Every rank checks every record, so the group answers alike at the same step.
    if let Some(r) = records.iter().position(|p| p.arch != mine.arch) {
        return Err(Error::InvalidDevices(format!(
            "rank {} runs on {} and rank {} on {}: one architecture per communicator",
            members[r], records[r].arch, members[me], mine.arch
        )));
    }
    if !config.allow_shared_devices {
        if let Some(refusal) = first_shared_device(&records, members) {
            return Err(refusal);
        }
    }
    // One grid on every rank: from the fewest multiprocessors, capped by sharing.
    let fewest = fewest_multiprocessors(&records);
    settings.agree_on_grid(fewest);
    settings.limit_for_shared_devices(fewest, ranks_per_device(&records));
    if records
        .iter()
        .enumerate()
        .any(|(r, p)| r != me && same_process(p, &mine) && same_device(p, &mine))
    {
        B::prepare_shared_device(&device)?;
    }
    let mut peer_signals = [0u64; MAX_GPUS];
    let mut mappings = Vec::new();
    let mut problem: Option<Error> = None;
    for (r, peer) in records.iter().enumerate() {
        if r == me {
            peer_signals[r] = mine.signal_addr;
            continue;
        }
        let (a, b) = (members[me], members[r]);
        let blocked = config.simulation_blocks_pair(a, b);
        let mut refuse = |cause: String, hint: String| {
            let (ia, ib) = (&mine.identity, &peer.identity);
            problem.get_or_insert_with(|| p2p_unavailable(a, ia, b, ib, cause, hint));
        };
        if blocked {
            refuse(
                "peer access between them is removed by Simulation::no_peer_access (a test \
                 switch)"
                    .into(),
                format!("Unset it, or {FALLBACK_HINT}"),
            );
        }
        peer_signals[r] = if same_process(peer, &mine) {
            // One process: the address is valid once peer access (by ordinal) is on.
            let theirs = peer.identity.ordinal();
            if theirs != mine.identity.ordinal()
                && !blocked
                && !enable_peer_access_to::<B>(&device, theirs)?
            {
                let cause = format!("{} reports no peer access between these devices", B::NAME);
                refuse(cause, no_path_hint(B::NAME));
            }
            peer.signal_addr
        } else {
            // Another process: mapped through IPC; the peer's ordinal names nothing here.
            match B::import_memory(&device, &handles[r]) {
                Ok(mapping) => {
                    let addr = B::mapping_ptr(&mapping);
                    mappings.push(mapping);
                    addr
                }
                Err(e) => {
                    let cause = format!(
                        "mapping rank {b}'s signal memory into rank {a}'s process failed ({e})"
                    );
                    refuse(cause, import_hint(B::NAME));
                    0
                }
            }
        };
    }
    let core = PeerSetup {
        endpoint: Endpoint::new(me, device, signal, peer_signals),
        settings,
        mappings,
    };
    // Every world rank learns whether any lacks peer access (and every mapping is
    // ordered before any launch); then whether the check passed everywhere.
    let reason = match agree(world, problem)? {
        Some(reason) => reason,
        None => {
            let corrupt = config.simulation_fails_peer_check(members[me]);
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
            Error::PeerCheckFailed {
                ranks: failed.iter().map(|(r, _)| *r).collect(),
                detail: failed[0].1.clone(),
            }
        }
    };
    // No kernel uses the signals now (every rank waited for the check's): they may go.
    drop(core.mappings);
    drop(core.endpoint.signal);
    let device = core.endpoint.device;
    Ok(Outcome::Refused { device, reason })
}

/// Lets `dev` reach device `peer_ordinal` of this process; `false` without peer access.
fn enable_peer_access_to<B: Backend>(dev: &B::Device, peer_ordinal: usize) -> Result<bool> {
    let peer = B::open(peer_ordinal)?;
    if !B::can_access_peer(dev, &peer)? {
        return Ok(false);
    }
    B::enable_peer_access(dev, &peer)?;
    Ok(true)
}

pub(crate) mod connect;
mod peer_check;
pub(crate) mod record;
pub(crate) mod unavailable;

#[cfg(test)]
mod tests {
    use super::*;

    /// A record of process `process` on ordinal `ordinal` of simulated device `physical`.
    fn on(process: u64, ordinal: usize, physical: usize) -> PeerRecord {
        PeerRecord {
            process,
            multiprocessors: 4,
            identity: DeviceIdentity::simulated(ordinal, physical),
            signal_addr: 0x1000,
            arch: "host".into(),
        }
    }

    fn with_sms(process: u64, multiprocessors: u32) -> PeerRecord {
        PeerRecord {
            multiprocessors,
            ..on(process, 0, 0)
        }
    }

    /// Records round-trip with every identity; another version or a cut record is
    /// refused, not a panic.
    #[test]
    fn records_round_trip() {
        let mut uuid = [0u8; 16];
        uuid[15] = 0xab;
        let r = with_sms(0xdead_beef_0123, 132);
        assert_eq!(PeerRecord::decode(1, &r.encode()).unwrap(), r);
        for identity in [
            DeviceIdentity::new(3, Some(uuid), Some("0000:c1:00.0")),
            DeviceIdentity::new(0, Some(uuid), None),
            DeviceIdentity::new(1, None, Some("0001:02:03.4")),
            DeviceIdentity::new(7, None, None),
        ] {
            let arch = "sm_90".into();
            let r = PeerRecord {
                identity,
                arch,
                ..with_sms(5, 132)
            };
            assert_eq!(PeerRecord::decode(1, &r.encode()).unwrap(), r);
        }
        let mut old = r.encode();
        old[0] = 2;
        let err = PeerRecord::decode(1, &old).unwrap_err().to_string();
        assert!(err.contains("another peercomm version"), "{err}");
        assert!(PeerRecord::decode(1, &r.encode()[..40]).is_err());
    }

    /// Processes isolated by CUDA_VISIBLE_DEVICES all report ordinal 0: they are on
    /// different devices when their UUIDs differ, on one when they agree.
    #[test]
    fn the_device_is_told_by_its_identity_not_its_ordinal() {
        let isolated = [on(1, 0, 0), on(2, 0, 1), on(3, 0, 2)];
        assert!(!same_device(&isolated[0], &isolated[1]));
        assert_eq!(ranks_per_device(&isolated), 1);
        assert_eq!(first_shared_device(&isolated, &[0, 1, 2]), None);
        // One GPU behind two different ordinals (other visible sets).
        let shared = [on(1, 0, 4), on(2, 1, 5), on(3, 2, 4)];
        assert!(same_device(&shared[0], &shared[2]));
        assert_eq!(ranks_per_device(&shared), 2);
        let refusal = first_shared_device(&shared, &[4, 5, 6])
            .unwrap()
            .to_string();
        let uuid = DeviceIdentity::simulated(0, 4).uuid_string().unwrap();
        for part in [
            "ranks 4 and 6".to_string(),
            format!("rank 4 on device 0 ({uuid}"),
            format!("rank 6 on device 2 ({uuid}"),
            "allow_shared_devices".into(),
        ] {
            assert!(refusal.contains(&part), "{part:?} missing from {refusal}");
        }
        // Nothing physical known: one process compares ordinals, two processes cannot.
        let blank = |process, ordinal| PeerRecord {
            identity: DeviceIdentity::new(ordinal, None, None),
            ..on(process, 0, 0)
        };
        assert!(same_device(&blank(1, 0), &blank(1, 0)));
        assert!(!same_device(&blank(1, 0), &blank(1, 1)));
        assert!(!same_device(&blank(1, 0), &blank(2, 0)));
    }

    #[test]
    fn unavailable_peer_access_crosses_the_world_whole() {
        let ia = DeviceIdentity::simulated(0, 0);
        let ib = DeviceIdentity::simulated(0, 1);
        let cause = "the mapping failed".into();
        let e = p2p_unavailable(0, &ia, 3, &ib, cause, import_hint("cuda"));
        assert_eq!(decode_unavailable(&encode_unavailable(&e)), Some(e.clone()));
        assert_eq!(decode_unavailable(&[2]), None);
        assert_eq!(decode_unavailable(&encode_unavailable(&e)[..20]), None);
        let text = e.to_string();
        for part in [
            "from rank 0 (device 0) to rank 3 (device 0)",
            &ib.to_string(),
            "the mapping failed",
            "CUDA_VISIBLE_DEVICES",
            "nvidia-smi topo -p2p r",
            "FallbackConfig::fallback = External",
        ] {
            assert!(text.contains(part), "{part:?} missing from {text}");
        }
    }

    /// Two containers of one pod can both be pid 1: the process is told by its token,
    /// so such ranks import each other's memory instead of using raw addresses. The
    /// grid comes from the fewest multiprocessors (at least one).
    #[test]
    fn the_process_is_told_by_its_token_and_the_grid_by_the_fewest_sms() {
        assert!(!same_process(&with_sms(1, 4), &with_sms(2, 4)));
        assert!(same_process(&with_sms(1, 4), &with_sms(1, 8)));
        assert_ne!(process_token(), 0);
        assert_eq!(process_token(), process_token());
        let records = [with_sms(1, 2), with_sms(2, 1), with_sms(3, 132)];
        assert_eq!(fewest_multiprocessors(&records), 1);
        assert_eq!(fewest_multiprocessors(&[with_sms(1, 0)]), 1);
    }
}
