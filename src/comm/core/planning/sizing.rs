//! Sizing a communicator: its memory footprint, a configuration from the largest
//! message, and which algorithm a call would run, answered without launching.

use crate::backend::Backend;
use crate::dispatch::Algorithm;
use crate::dtype::DType;
use crate::error::Result;
use crate::signal::{SignalLayout, LAMPORT_HEADER_BYTES, PACK_BYTES};

use super::staging::padded_bytes;
use crate::comm::core::planning::PeerReads;
use crate::comm::{AllReduceOptions, CommConfig};

/// Device memory one rank of a communicator allocates (its signal allocation, the only
/// memory peercomm allocates per rank), in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryFootprint {
    /// The signal header: barrier counters, Lamport state, error record (8.28 MiB, the
    /// same for every configuration).
    pub header: usize,
    /// The Lamport region: 3 generations x world-size slots x
    /// [`CommConfig::lamport_slot_bytes`].
    pub lamport_region: usize,
    /// The payload: [`CommConfig::payload_bytes`].
    pub payload: usize,
    /// The whole allocation per rank, alignment included.
    pub total: usize,
}

impl MemoryFootprint {
    /// The footprint of a rank with this layout.
    pub fn of(layout: &SignalLayout) -> Result<Self> {
        Ok(MemoryFootprint {
            header: layout.lamport_offset(),
            lamport_region: layout.lamport_region_bytes(),
            payload: layout.payload_bytes,
            total: layout.checked_total_bytes()?,
        })
    }
}

impl std::fmt::Display for MemoryFootprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        let [t, h, l, p] = [self.total, self.header, self.lamport_region, self.payload].map(mib);
        write!(
            f,
            "{t:.2} MiB per rank (header {h:.2}, Lamport {l:.2}, payload {p:.2})"
        )
    }
}

impl CommConfig {
    /// Largest Lamport message [`CommConfig::for_largest_message`] sizes a slot for: past
    /// a few hundred KiB the dispatch table never prefers Lamport, and each slot byte
    /// costs 3 x world-size bytes of device memory per rank.
    pub const LAMPORT_SLOT_CAP: usize = 1 << 20;

    /// A configuration (the defaults otherwise) whose scratch takes messages of up to
    /// `max_elements` x `dtype` per rank whole, in place or not, through either
    /// communicator: the payload holds the message (larger ones run staged in chunks),
    /// the Lamport slot too, up to [`CommConfig::LAMPORT_SLOT_CAP`] (past it `Auto` skips
    /// Lamport and a forced one is [`crate::Error::MessageTooLarge`]). Fails only when the
    /// size overflows.
    ///
    /// ```
    /// use peercomm::backend::host::Host;
    /// use peercomm::{AllReduceOptions, Algorithm, CommConfig, SingleController, DType};
    ///
    /// // A decoder's tensor-parallel all-reduce: up to 64 tokens x 8192 hidden, bf16.
    /// let config = CommConfig::for_largest_message(64 * 8192, DType::BF16)?;
    /// assert_eq!(config.payload_bytes, 1 << 20);
    /// // 8.28 MiB header + 3 x 2 x (1 MiB + 64 B) Lamport region + 1 MiB payload per rank:
    /// assert_eq!(config.memory_footprint(2)?.total, 16_024_320);
    /// let comm = SingleController::<Host>::new(&[0, 1], config)?;
    /// for algorithm in [Algorithm::Auto, Algorithm::OneStage, Algorithm::TwoStage, Algorithm::Lamport] {
    ///     let opts = AllReduceOptions::new().algorithm(algorithm);
    ///     assert!(comm.algorithm_for(DType::BF16, 64 * 8192, &opts, true).is_ok());
    /// }
    /// // One element more does not fit the Lamport slot; the error says by how much.
    /// let lamport = AllReduceOptions::new().algorithm(Algorithm::Lamport);
    /// let err = comm.algorithm_for(DType::BF16, 64 * 8192 + 1, &lamport, false).unwrap_err();
    /// assert_eq!(
    ///     err.to_string(),
    ///     "lamport needs 1048656 bytes of scratch but the communicator has 1048640 \
    ///      (CommConfig::lamport_slot_bytes)"
    /// );
    /// # Ok::<(), peercomm::Error>(())
    /// ```
    pub fn for_largest_message(max_elements: usize, dtype: DType) -> Result<Self> {
        let bytes = padded_bytes(dtype, max_elements).ok_or_else(|| {
            crate::Error::InvalidConfig(format!(
                "a message of {max_elements} x {} does not fit in the address space",
                dtype.name()
            ))
        })?;
        let config = CommConfig {
            lamport_slot_bytes: bytes.clamp(PACK_BYTES, Self::LAMPORT_SLOT_CAP)
                + LAMPORT_HEADER_BYTES,
            payload_bytes: bytes,
            ..CommConfig::default()
        };
        config.memory_footprint(1)?;
        Ok(config)
    }

    /// The device memory each rank of a `world`-rank communicator with this
    /// configuration allocates. With the defaults (1 MiB Lamport slot, 64 MiB payload):
    /// 8.3 MiB of header, 3 x world MiB of Lamport region and the 64 MiB payload.
    pub fn memory_footprint(&self, world: usize) -> Result<MemoryFootprint> {
        let layout = SignalLayout {
            lamport_slot_bytes: self.lamport_slot_bytes,
            lamport_slots: world,
            payload_bytes: self.payload_bytes,
        };
        layout.validate()?;
        MemoryFootprint::of(&layout)
    }
}

impl<B: Backend> crate::comm::core::Rank<B> {
    /// The device memory this rank allocated.
    pub(crate) fn memory_footprint(&self) -> MemoryFootprint {
        MemoryFootprint::of(&self.settings.layout).expect("a validated layout")
    }

    /// The algorithm a peer-memory all-reduce of `elements` of `dtype` would run, or
    /// the typed error it would get; nothing is launched.
    pub(crate) fn algorithm_for(
        &self,
        dtype: DType,
        elements: usize,
        options: &AllReduceOptions,
        in_place: bool,
        reads: PeerReads,
    ) -> Result<Algorithm> {
        self.settings
            .plan(dtype, elements, options, in_place, reads)
            .map(|p| p.algorithm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table in `CommConfig`'s docs; the Lamport region grows with the world.
    #[test]
    fn footprints_in_the_docs() {
        let mib = |b: usize| (b as f64 / (1 << 20) as f64 * 10.0).round() / 10.0;
        let big_slot = CommConfig::default().with_lamport_slot_bytes(48 << 20);
        let for_message = CommConfig::for_largest_message(1 << 20, DType::BF16).unwrap();
        assert_eq!(for_message.payload_bytes, 2 << 20);
        assert_eq!(for_message.lamport_slot_bytes, (1 << 20) + 64);
        for (config, expected) in [
            (CommConfig::default(), [78.3, 84.3, 96.3]),
            (for_message, [16.3, 22.3, 34.3]),
            (big_slot, [360.3, 648.3, 1224.3]),
        ] {
            for (world, want) in [2, 4, 8].into_iter().zip(expected) {
                let f = config.memory_footprint(world).unwrap();
                assert_eq!(mib(f.total), want, "world {world}: {f}");
                assert_eq!(f.lamport_region, 3 * world * config.lamport_slot_bytes);
                assert_eq!(f.header, 8_683_776);
                assert!(f.total >= f.header + f.lamport_region + f.payload);
            }
        }
    }

    /// `for_largest_message` sizes whole packs, caps the Lamport slot and refuses an
    /// overflowing size.
    #[test]
    fn for_largest_message_sizes() {
        let cap = CommConfig::LAMPORT_SLOT_CAP + 64;
        for (n, dtype, payload, slot) in [
            (1, DType::F32, 16, 80),
            (0, DType::F16, 0, 80),
            (9, DType::BF16, 32, 96),
            (1 << 28, DType::F32, 1 << 30, cap),
        ] {
            let c = CommConfig::for_largest_message(n, dtype).unwrap();
            assert_eq!((c.payload_bytes, c.lamport_slot_bytes), (payload, slot));
        }
        assert!(CommConfig::for_largest_message(usize::MAX, DType::F32).is_err());
    }

    /// Counts whose bytes overflow, or that no device allocation could hold, are
    /// `InvalidConfig` for every dtype (nothing wraps into a small payload), and the
    /// planners refuse such messages with `SizeOverflow` whatever the algorithm.
    #[test]
    fn huge_counts_are_refused() {
        use crate::comm::core::planning::collective::{Collective, CollectiveOptions};
        use crate::comm::core::settings::Settings;
        use crate::Error;
        for dtype in DType::ALL {
            let size = dtype.size();
            for n in [
                usize::MAX,
                usize::MAX / 2,
                usize::MAX / size,
                usize::MAX / size - 1,
                (usize::MAX / 16) * dtype.lanes(),
                isize::MAX as usize / size + 1,
            ] {
                match CommConfig::for_largest_message(n, dtype) {
                    Err(Error::InvalidConfig(_)) => {}
                    other => panic!("{n} x {dtype:?}: {:?}", other.map(|c| c.payload_bytes)),
                }
            }
        }
        let settings = Settings::new(CommConfig::default(), "sm_90".into(), 132, 4).unwrap();
        let overflows = |got: Result<Algorithm>| matches!(got, Err(Error::SizeOverflow { .. }));
        for n in [usize::MAX, usize::MAX / 4, (1 << 62) + 1] {
            use Algorithm::{Auto, Lamport, OneStage, TwoStage};
            for algorithm in [Auto, OneStage, TwoStage, Lamport] {
                for reads in [PeerReads::UserBuffers, PeerReads::Payloads] {
                    let opts = AllReduceOptions::new().algorithm(algorithm);
                    let got = settings.plan(DType::F32, n, &opts, false, reads);
                    assert!(overflows(got.map(|p| p.algorithm)), "{n} {algorithm:?}");
                }
            }
            use Collective::{AllGather, Broadcast, ReduceScatter, Scatter};
            let fused = Collective::AllReduceRmsNorm {
                hidden: 8,
                epsilon: 1e-5,
            };
            let (bcast, scatter) = (Broadcast { root: 0 }, Scatter { root: 0 });
            for which in [AllGather, ReduceScatter, bcast, scatter, fused] {
                let (opts, reads) = (CollectiveOptions::new(), PeerReads::Payloads);
                let got = settings.collective_plan(which, DType::F32, n, &opts, reads);
                assert!(overflows(got.map(|p| p.algorithm)), "{which:?} {n}");
            }
        }
    }
}
