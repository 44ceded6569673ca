//! The all-gather over the star, once the handshake is done: rank 0 reads every rank's
//! frame in rank order (naming every rank that is late, not only the first) and relays
//! them; rank r sends its frame and reads the others'.

use std::net::TcpStream;
use std::time::Duration;

use crate::bootstrap::error::{BootstrapError, Result};
use crate::bootstrap::frame::{
    check_frame_len, deadline_after, is_timeout, read_frame, recv_error, write_frame, RecvError,
    RAISE_TIMEOUT,
};
use crate::bootstrap::wire::{expect_data, explain_closed};
use crate::bootstrap::{KIND_DATA, LATE_GRACE, MIN_WAIT};

/// Why a rank's connection closed, or its writes timed out, mid all-gather.
const GONE: &str = "that rank's process ended or dropped its bootstrap";
const STOPPED: &str = "that rank stopped reading";

pub(super) fn root_all_gather(
    streams: &mut [TcpStream],
    mine: &[u8],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    check_frame_len(mine.len())?;
    let deadline = deadline_after(timeout);
    let step = "rank 0 was gathering every rank's bytes";
    let mut out = Vec::with_capacity(streams.len() + 1);
    out.push(mine.to_vec());
    // After the first rank that is late or fails, the later ranks get only a short grace,
    // so that the error names every rank that had not reached this all_gather.
    let mut missing = Vec::new();
    let mut failure = None;
    let mut grace_end = None;
    for (i, s) in streams.iter_mut().enumerate() {
        let r = i + 1;
        let by = if missing.is_empty() && failure.is_none() {
            deadline
        } else {
            let end = *grace_end.get_or_insert_with(|| deadline_after(LATE_GRACE));
            end.max(deadline_after(MIN_WAIT))
        };
        let got = match read_frame(s, by) {
            Ok(f) => expect_data(r, f),
            Err(RecvError::Io(e)) if is_timeout(&e) => {
                missing.push(r);
                Ok(Vec::new())
            }
            Err(e) => Err(recv_error(r, step, e, timeout, "", GONE)),
        };
        out.push(got.unwrap_or_else(|e| {
            failure.get_or_insert(e);
            Vec::new()
        }));
    }
    if let Some(mut e) = failure {
        if let BootstrapError::PeerFailed { message: m, .. }
        | BootstrapError::ConnectionClosed { hint: m, .. } = &mut e
        {
            if !missing.is_empty() {
                let late = "; rank 0 had not heard from rank(s)";
                m.push_str(&format!("{late} {missing:?} in this all_gather by then"));
            }
        }
        return Err(e);
    }
    if !missing.is_empty() {
        return Err(BootstrapError::Timeout {
            step: step.into(),
            waiting_for: missing,
            after: timeout,
            hint: format!(
                "those ranks did not reach this all_gather: every rank must make the same \
                 sequence of bootstrap calls; {RAISE_TIMEOUT} if a rank is legitimately slow"
            ),
        });
    }
    for (i, s) in streams.iter_mut().enumerate() {
        let r = i + 1;
        for (src, bytes) in out.iter().enumerate() {
            if src != r {
                write_frame(s, KIND_DATA, bytes, deadline).map_err(|e| {
                    let (step, stopped) = ("rank 0 sending the gathered bytes", STOPPED);
                    recv_error(r, step, RecvError::Io(e), timeout, stopped, GONE)
                })?;
            }
        }
    }
    Ok(out)
}

pub(super) fn leaf_all_gather(
    s: &mut TcpStream,
    rank: usize,
    world: usize,
    mine: &[u8],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    check_frame_len(mine.len())?;
    let deadline = deadline_after(timeout);
    let step = "this rank was in an all_gather through rank 0";
    let timeout_hint = "rank 0 has not relayed every rank's bytes: rank 0 or another rank \
                        did not reach this all_gather (rank 0's own error names it); every \
                        rank must make the same sequence of bootstrap calls";
    let closed_hint = "rank 0's process ended or dropped its bootstrap";
    let failed = |e| recv_error(0, step, e, timeout, timeout_hint, closed_hint);
    if let Err(e) = write_frame(s, KIND_DATA, mine, deadline) {
        return Err(explain_closed(s, failed(RecvError::Io(e))));
    }
    let mut out = Vec::with_capacity(world);
    for src in 0..world {
        out.push(match src == rank {
            true => mine.to_vec(),
            false => expect_data(0, read_frame(s, deadline).map_err(failed)?)?,
        });
    }
    Ok(out)
}
