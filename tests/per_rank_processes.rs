//! The per-rank communicator with one process per rank on the host backend (suite in
//! tests/per_rank_suite/processes.rs), signal memory shared through the host's IPC.

mod common;
mod per_rank_suite;

use peercomm::backend::host::Host;
use per_rank_suite::descriptor_channel::{self, Strangers};
use per_rank_suite::zero_copy::processes as zero_copy;
use per_rank_suite::HOST;
use per_rank_suite::{process_faults, processes};

/// The child processes' entry point (does nothing when run as a normal test).
#[test]
fn per_rank_child() {
    if let Some((role, rank, world, id, _)) = processes::child_args() {
        if descriptor_channel::child::<Host>(&role, &HOST, (rank, world, &id), registers) {
            return;
        }
    }
    processes::child_main::<Host>(&HOST);
}

/// A registration whose memory the host backend exports as a descriptor (a symmetric
/// buffer, a shared memory file), dropped again.
fn registers(comm: &peercomm::Comm<Host>) -> Result<(), peercomm::Error> {
    let buffer = comm.alloc_symmetric::<f32>(4096)?;
    comm.register(buffer).map(drop).map_err(|e| e.error)
}

tests! {
    /// The descriptor channel beside an idle connection of another user (nobody): every
    /// rank registers within the bound, alike (skipped where the test is not root).
    per_rank_descriptor_channel_beside_another_user =>
        descriptor_channel::beside_strangers::<Host>(&HOST, registers, Strangers::AnotherUser);

    /// The descriptor channel beside idle, garbage and wrong-nonce connections of this
    /// user: ignored, every rank registers within the bound.
    per_rank_descriptor_channel_beside_bogus_senders =>
        descriptor_channel::beside_strangers::<Host>(&HOST, registers, Strangers::Bogus);

    per_rank_processes_world_2 => processes::checked_world::<Host>(&HOST, 2);
    per_rank_processes_world_3 => processes::checked_world::<Host>(&HOST, 3);
    per_rank_processes_world_4 => processes::checked_world::<Host>(&HOST, 4);
    per_rank_processes_world_8 => processes::checked_world::<Host>(&HOST, 8);

    /// CUDA_VISIBLE_DEVICES isolation across processes, simulated: every rank's process
    /// opens device 0, each rank on its own physical device, signals mapped through IPC.
    per_rank_isolated_processes_world_2 => processes::isolated_world::<Host>(&HOST, 2, None);
    per_rank_isolated_processes_world_4 => processes::isolated_world::<Host>(&HOST, 4, None);
    per_rank_isolated_processes_without_peer_access =>
        processes::isolated_without_peer_access::<Host>(&HOST);

    per_rank_killed_process_gives_a_typed_error =>
        process_faults::killed_process_gives_a_typed_error::<Host>(&HOST);
    per_rank_registration_beside_a_killed_peer =>
        process_faults::registration_beside_a_killed_peer::<Host>(&HOST);
    per_rank_create_drop_cycles_leak_nothing =>
        process_faults::create_drop_cycles_leak_nothing::<Host>(&HOST, 1000);

    /// Zero copy across processes: symmetric inputs read in place through IPC; a heap
    /// buffer cannot be registered across processes.
    per_rank_zero_copy_processes_world_2 => zero_copy::symmetric_processes::<Host>(&HOST, 2, true);
    per_rank_zero_copy_processes_world_4 => zero_copy::symmetric_processes::<Host>(&HOST, 4, true);

    /// Register/alloc cycles and communicators with symmetric buffers, in two processes:
    /// no registration, import, file descriptor or mapping leaks.
    per_rank_zero_copy_cycles_leak_nothing => zero_copy::cycles_leak_nothing::<Host>(1000, true);
}
