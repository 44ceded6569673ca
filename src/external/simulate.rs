//! Test-only switches (feature `fault-injection`) that make one machine look like the
//! cases the fallback exists for. Every rank must pass the same [`Simulation`].

use crate::backend::DeviceIdentity;
use crate::bootstrap::HostId;

/// Test-only switches (part of [`crate::CommConfig`]; the default simulates nothing).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Simulation {
    /// Pretend that device-level peer access from world rank `.0` to world rank `.1`
    /// is unavailable (as on PCIe without P2P).
    pub no_peer_access: Option<(usize, usize)>,
    /// Corrupt the value the peer check reads back on this world rank before it is
    /// compared (as on a link that reports P2P and returns garbage).
    pub fail_peer_check: Option<usize>,
    /// The host identity of every world rank, in rank order, instead of what the
    /// bootstrap found (for example `["a", "a", "b", "b"]`: two hosts of two ranks).
    pub hosts: Option<Vec<HostId>>,
    /// The multiprocessor count every world rank reports, in rank order (as under MPS
    /// with different thread percentages): the grid must still match on every rank.
    pub multiprocessors: Option<Vec<usize>>,
    /// The physical device of every world rank, in rank order (identity
    /// [`DeviceIdentity::simulated`]`(ordinal, physical_devices[r])`): `[0, 1, 2, 3]` on
    /// device 0 is processes isolated by `CUDA_VISIBLE_DEVICES`; `[0, 0]` on ordinals 0
    /// and 1 is two ranks on one GPU. Ranks really sharing a device but told apart here
    /// lose the grid cap: set `max_blocks`.
    pub physical_devices: Option<Vec<usize>>,
}

impl Simulation {
    setters! {
        /// With [`Simulation::no_peer_access`] between world ranks `pair.0` and `pair.1`.
        fn with_no_peer_access(pair: (usize, usize)) => no_peer_access = Some(pair);
        /// With [`Simulation::fail_peer_check`] on world rank `rank`.
        fn with_fail_peer_check(rank: usize) => fail_peer_check = Some(rank);
        /// With [`Simulation::hosts`]: one host identity per world rank.
        fn with_hosts(hosts: Vec<HostId>) => hosts = Some(hosts);
        /// With [`Simulation::multiprocessors`]: one count per world rank.
        fn with_multiprocessors(counts: Vec<usize>) => multiprocessors = Some(counts);
        /// With [`Simulation::physical_devices`]: one physical device per world rank.
        fn with_physical_devices(devices: Vec<usize>) => physical_devices = Some(devices);
    }

    /// Whether anything is simulated.
    pub fn is_active(&self) -> bool {
        *self != Simulation::default()
    }

    /// Ranks spread over `hosts` simulated hosts of `world / hosts` consecutive ranks
    /// each (`sim-host-0`, `sim-host-1`, ...).
    pub fn split_hosts(world: usize, hosts: usize) -> Self {
        let per = world.div_ceil(hosts.max(1)).max(1);
        Simulation {
            hosts: Some(
                (0..world)
                    .map(|r| HostId::new(format!("sim-host-{}", r / per)))
                    .collect(),
            ),
            ..Simulation::default()
        }
    }

    /// The multiprocessor count world rank `rank` reports: the simulated one, or
    /// `real`.
    pub(crate) fn multiprocessors_of(&self, rank: usize, real: usize) -> usize {
        self.multiprocessors
            .as_ref()
            .and_then(|m| m.get(rank).copied())
            .unwrap_or(real)
    }

    /// The identity world rank `rank` reports: the simulated physical device's, with
    /// the ordinal of `real`, or `real`.
    pub(crate) fn identity_of(&self, rank: usize, real: DeviceIdentity) -> DeviceIdentity {
        match self.physical_devices.as_ref().and_then(|p| p.get(rank)) {
            Some(&physical) => DeviceIdentity::simulated(real.ordinal(), physical),
            None => real,
        }
    }

    /// Whether the simulation removes peer access between world ranks `a` and `b`.
    pub(crate) fn blocks_pair(&self, a: usize, b: usize) -> bool {
        matches!(self.no_peer_access, Some((x, y)) if (x, y) == (a, b) || (x, y) == (b, a))
    }
}
