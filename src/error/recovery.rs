//! [`Recovery`]: what a caller does after an [`Error`] or a [`BootstrapError`]. No
//! wildcard: a new variant does not compile until its recovery is decided.

use super::Error;
use crate::bootstrap::BootstrapError;

/// What the caller does after an error ([`Error::recovery`],
/// [`BootstrapError::recovery`]). No error is cured by repeating the call unchanged,
/// so there is no "retry".
///
/// An engine's per-step handling:
///
/// ```
/// use peercomm::{Error, Recovery};
///
/// fn after(e: &Error) -> &'static str {
///     match e.recovery() {
///         Recovery::FixCall => "drop this call: the communicator is as it was",
///         Recovery::Reinitialize => "every rank calls reinitialize(), then goes on",
///         Recovery::Rebuild => "every rank drops the communicator; build a new one",
///         Recovery::FixSetup => "change what the message names, then build",
///         _ => "a recovery this engine does not know: rebuild",
///     }
/// }
/// # let e = Error::InvalidRoot { root: 2, width: 2 };
/// # assert_eq!(after(&e), "drop this call: the communicator is as it was");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Recovery {
    /// The call was refused before anything ran (on this rank; a collective
    /// registration on every rank): nothing written, the communicator as it was.
    /// Change what the message names. Where only this rank refused a call its peers
    /// made, they time out: then [`Recovery::Reinitialize`] on every rank.
    FixCall,
    /// The communicator is poisoned (a timeout, an abort, a call mismatch, a partial
    /// launch): every rank calls `reinitialize` (collective), after which it works as
    /// new. If that fails (a rank is gone), [`Recovery::Rebuild`].
    Reinitialize,
    /// The communicator, its bootstrap or its device cannot be brought back (a rank is
    /// gone, the bootstrap or a driver or external-library call failed): every rank
    /// drops it and the job builds a new one with a new `UniqueId`.
    Rebuild,
    /// The communicator cannot be built as asked (configuration, launch arguments or
    /// machine): change what the message names, then build.
    FixSetup,
}

impl Error {
    /// What the caller does after this error (see [`Recovery`]).
    pub fn recovery(&self) -> Recovery {
        match self {
            Error::InvalidGroupSize { .. }
            | Error::WrongTensorCount { .. }
            | Error::DTypeMismatch { .. }
            | Error::ShapeMismatch { .. }
            | Error::LengthMismatch { .. }
            | Error::WrongDevice { .. }
            | Error::InvalidRoot { .. }
            | Error::InvalidPeer { .. }
            | Error::MessageTooLarge { .. }
            | Error::Unsupported(_)
            | Error::CannotRegister { .. }
            | Error::BufferNotPeerAccessible { .. }
            | Error::SizeOverflow { .. }
            | Error::BuffersOverlap { .. } => Recovery::FixCall,
            Error::BarrierTimeout { .. }
            | Error::PeerAborted { .. }
            | Error::CallMismatch { .. } => Recovery::Reinitialize,
            // Poisoned by an error that `reinitialize` cannot cure: that error's.
            Error::Poisoned { first } => match first.recovery() {
                Recovery::Rebuild => Recovery::Rebuild,
                _ => Recovery::Reinitialize,
            },
            // The external library's communicator or the device may be left broken
            // (a sticky CUDA error, a failed NCCL call).
            Error::External { .. } | Error::Backend { .. } => Recovery::Rebuild,
            Error::InvalidWorldSize { .. }
            | Error::InvalidDevices(_)
            | Error::InvalidConfig(_)
            | Error::P2pUnavailable { .. }
            | Error::ExternalUnavailable { .. }
            | Error::PeerCheckFailed { .. }
            | Error::NoDevice { .. } => Recovery::FixSetup,
            Error::Bootstrap(e) => e.recovery(),
        }
    }
}

impl BootstrapError {
    /// What the caller does after this error (see [`Recovery`]). A bootstrap that
    /// failed is poisoned for good ([`BootstrapError::Poisoned`]), so every failure
    /// after the launch's own arguments were accepted is [`Recovery::Rebuild`].
    pub fn recovery(&self) -> Recovery {
        match self {
            BootstrapError::RankOutOfRange { .. }
            | BootstrapError::InvalidWorldSize { .. }
            | BootstrapError::DuplicateRank { .. }
            | BootstrapError::WorldSizeMismatch { .. }
            | BootstrapError::InvalidId { .. }
            | BootstrapError::InvalidAddress { .. }
            | BootstrapError::HostIdTooLong { .. } => Recovery::FixSetup,
            BootstrapError::Io { .. }
            | BootstrapError::Timeout { .. }
            | BootstrapError::StaleId
            | BootstrapError::FrameTooLarge { .. }
            | BootstrapError::PeerFailed { .. }
            | BootstrapError::ConnectionClosed { .. }
            | BootstrapError::UnverifiedRankZero { .. }
            | BootstrapError::Protocol { .. }
            | BootstrapError::Poisoned { .. }
            | BootstrapError::Store { .. } => Recovery::Rebuild,
            // The ranks' host-side calls diverged (one may have dropped its
            // communicator, or made a call the others did not): `reinitialize` is such
            // a call itself and may meet the same divergence, so only a new
            // communicator is certain to line the ranks up again.
            BootstrapError::ExchangeMismatch { .. } => Recovery::Rebuild,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CallField;
    use crate::DType;
    use std::time::Duration;
    use BootstrapError as B;
    use Recovery::*;

    /// One error of every kind, with the recovery the docs give it.
    #[test]
    #[rustfmt::skip]
    fn every_error_names_its_recovery() {
        let s = || "x".to_string();
        let timeout = Error::BarrierTimeout { rank: 0, block: 0, domain: 0, waiting_for: Some(1) };
        let external = Error::External { library: "nccl", call: "ncclAllReduce", detail: s() };
        let (field, mine, theirs) = (CallField::Length, s(), s());
        let mismatch = Error::CallMismatch { rank: 0, peer: 1, field, mine, theirs };
        let after = Duration::from_secs(1);
        let bootstrap_timeout = B::Timeout { step: s(), waiting_for: vec![0], after, hint: s() };
        let cases = [
            (Error::InvalidRoot { root: 3, width: 2 }, FixCall),
            (Error::InvalidPeer { peer: 4, world: 2 }, FixCall),
            (Error::DTypeMismatch { rank: 1, expected: DType::F32, got: DType::BF16 }, FixCall),
            (Error::CannotRegister { rank: 0, reason: s() }, FixCall),
            (timeout.clone(), Reinitialize),
            (mismatch, Reinitialize),
            (Error::Poisoned { first: Box::new(timeout) }, Reinitialize),
            (Error::Poisoned { first: Box::new(external) }, Rebuild),
            (Error::Backend { backend: "host", call: "launch", detail: s() }, Rebuild),
            (Error::InvalidConfig(s()), FixSetup),
            (Error::Bootstrap(bootstrap_timeout), Rebuild),
            (Error::Bootstrap(B::DuplicateRank { rank: 1 }), FixSetup),
            (Error::Bootstrap(B::ExchangeMismatch { rank: 1, expected: s(), got: s() }), Rebuild),
        ];
        for (e, want) in cases {
            assert_eq!(e.recovery(), want, "{e}");
        }
    }
}
