//! The per-rank communicator with one process per rank on the host backend (the suite
//! is in tests/per_rank_suite/processes.rs): children of this test binary, signal
//! memory shared through the host backend's IPC.

mod common;
mod per_rank_suite;

use peercomm::backend::host::Host;
use per_rank_suite::descriptor_channel::{self, Strangers};
use per_rank_suite::processes::{self, Devices};

const HOST: Devices = Devices {
    count: peercomm::MAX_GPUS,
    max_blocks: 2,
};

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

/// The descriptor channel beside an idle connection of another user (nobody): every
/// rank registers within the bound, alike (skipped where the test is not root).
#[test]
fn per_rank_descriptor_channel_beside_another_user() {
    descriptor_channel::beside_strangers::<Host>(&HOST, registers, Strangers::AnotherUser);
}

/// The descriptor channel beside idle, garbage and wrong-nonce connections of this
/// user (other processes, and the peer's own process): ignored, every rank registers
/// within the bound, alike.
#[test]
fn per_rank_descriptor_channel_beside_bogus_senders() {
    descriptor_channel::beside_strangers::<Host>(&HOST, registers, Strangers::Bogus);
}

#[test]
fn per_rank_processes_world_2() {
    processes::checked_world::<Host>(&HOST, 2);
}

#[test]
fn per_rank_processes_world_3() {
    processes::checked_world::<Host>(&HOST, 3);
}

#[test]
fn per_rank_processes_world_4() {
    processes::checked_world::<Host>(&HOST, 4);
}

#[test]
fn per_rank_processes_world_8() {
    processes::checked_world::<Host>(&HOST, 8);
}

/// CUDA_VISIBLE_DEVICES isolation across processes, simulated: every rank's process
/// opens device 0, each rank on its own physical device, signals mapped through IPC.
#[test]
fn per_rank_isolated_processes_world_2() {
    processes::isolated_world::<Host>(&HOST, 2, None);
}

#[test]
fn per_rank_isolated_processes_world_4() {
    processes::isolated_world::<Host>(&HOST, 4, None);
}

#[test]
fn per_rank_isolated_processes_without_peer_access() {
    processes::isolated_without_peer_access::<Host>(&HOST);
}

#[test]
fn per_rank_killed_process_gives_a_typed_error() {
    processes::killed_process_gives_a_typed_error::<Host>(&HOST);
}

#[test]
fn per_rank_registration_beside_a_killed_peer() {
    processes::registration_beside_a_killed_peer::<Host>(&HOST);
}

#[test]
fn per_rank_create_drop_cycles_leak_nothing() {
    processes::create_drop_cycles_leak_nothing::<Host>(&HOST, 1000);
}

/// Zero copy across processes (tests/per_rank_suite/zero_copy.rs): symmetric inputs
/// read in place through the host backend's IPC, one-stage and two-stage; a heap
/// buffer cannot be registered across processes.
#[test]
fn per_rank_zero_copy_processes_world_2() {
    per_rank_suite::zero_copy::symmetric_processes::<Host>(&HOST, 2, true);
}

#[test]
fn per_rank_zero_copy_processes_world_4() {
    per_rank_suite::zero_copy::symmetric_processes::<Host>(&HOST, 4, true);
}

/// Register/alloc cycles and communicators with symmetric buffers, in two processes:
/// no registration, import, file descriptor or mapping leaks.
#[test]
fn per_rank_zero_copy_cycles_leak_nothing() {
    per_rank_suite::zero_copy::cycles_leak_nothing::<Host>(1000, true);
}
