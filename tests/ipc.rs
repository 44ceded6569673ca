//! IPC of shared signal memory (`export_memory` / `import_memory`): the host backend
//! and, with `cuda`, CUDA between two processes (skipped visibly without a GPU).
//!
//! Two-process tests rerun this binary (`--exact <child test>`) with the child's name
//! (`PEERCOMM_IPC_CHILD`) and the hex handle (`PEERCOMM_IPC_HANDLE`); child tests pass
//! doing nothing otherwise. Every test takes one lock: the leak test counts this
//! process's fds and mappings, and fd reuse relies on the lowest free fd.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use peercomm::backend::host::Host;
use peercomm::backend::Backend;
use peercomm::unstable::AllReduceArgs;
use peercomm::unstable::{Kernel, KernelKind, LaunchDims, MemoryKind};
use peercomm::{DType, Error};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Words of the pattern area: 64 KiB, in 16 chunks of 1024 words with one value each.
const WORDS: usize = 16 * 1024;
const CHUNK: usize = 1024;
/// The allocation: the pattern area, a counter word, and a tail that makes the size
/// no multiple of the page size.
const BYTES: usize = WORDS * 4 + 100;
/// Word index of the counter the killed child keeps writing.
const COUNTER: usize = WORDS;

const ENV_CHILD: &str = "PEERCOMM_IPC_CHILD";
const ENV_HANDLE: &str = "PEERCOMM_IPC_HANDLE";
const ENV_ORDINAL: &str = "PEERCOMM_IPC_ORDINAL";
const READY: &str = "PEERCOMM_IPC_CHILD_READY";
const DONE: &str = "PEERCOMM_IPC_CHILD_DONE";

/// The value of chunk `chunk` in the pattern seeded by `seed` (never 0).
fn value(seed: u32, chunk: usize) -> u32 {
    (seed.wrapping_mul(0x9E37_79B9) ^ (chunk as u32).wrapping_mul(0x85EB_CA6B)) | 1
}

/// Writes the pattern `seed` into chunks `chunks` at `ptr`, on `dev`'s stream.
fn write_pattern<B: Backend>(dev: &B::Device, ptr: u64, seed: u32, chunks: std::ops::Range<usize>) {
    for c in chunks {
        B::memset_d32(dev, ptr + (c * CHUNK * 4) as u64, value(seed, c), CHUNK).unwrap();
    }
}

/// `n` words at `ptr`, read on `dev`'s stream.
fn read_words<B: Backend>(dev: &B::Device, ptr: u64, n: usize) -> Vec<u32> {
    let mut bytes = vec![0u8; n * 4];
    B::read(dev, ptr, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect()
}

/// Asserts the pattern `seed` in chunks `chunks` at `ptr`.
fn check_pattern<B: Backend>(
    dev: &B::Device,
    ptr: u64,
    seed: u32,
    chunks: std::ops::Range<usize>,
    what: &str,
) {
    let words = read_words::<B>(dev, ptr, WORDS);
    for c in chunks {
        let want = value(seed, c);
        let chunk = &words[c * CHUNK..(c + 1) * CHUNK];
        if let Some(i) = chunk.iter().position(|&w| w != want) {
            panic!(
                "{what}: word {} is {:#x}, expected {want:#x}",
                c * CHUNK + i,
                chunk[i]
            );
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex handle"))
        .collect()
}

/// This process's device and the handle when it is the child `test`, else `None` (not
/// the child process: nothing to do).
fn child_args<B: Backend>(test: &str) -> Option<(B::Device, Vec<u8>)> {
    if std::env::var(ENV_CHILD).ok()? != test {
        return None;
    }
    let handle = unhex(&std::env::var(ENV_HANDLE).expect("PEERCOMM_IPC_HANDLE"));
    let ordinal = std::env::var(ENV_ORDINAL)
        .ok()
        .map(|o| o.parse().expect("PEERCOMM_IPC_ORDINAL"))
        .unwrap_or(0);
    Some((B::open(ordinal).unwrap(), handle))
}

/// A child process of this test binary.
struct ChildProcess {
    child: Child,
    /// Its stdout, line by line.
    lines: mpsc::Receiver<String>,
    /// The thread reading its stdout: joined once the child has exited, so that the
    /// pipe is closed before the next test counts or reuses fds.
    reader: std::thread::JoinHandle<()>,
}

/// A child process running the test `test` (a full name) of this binary.
fn spawn_child(test: &str, handle: &[u8], ordinal: usize) -> ChildProcess {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ENV_CHILD, test)
        .env(ENV_HANDLE, hex(handle))
        .env(ENV_ORDINAL, ordinal.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the child test process");
    let stdout = child.stdout.take().unwrap();
    let (tx, lines) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            let _ = tx.send(line);
        }
    });
    ChildProcess {
        child,
        lines,
        reader,
    }
}

/// Waits (at most `limit`) for the child to print `marker`; kills it and fails the test
/// if it does not. Returns the lines printed so far.
fn wait_for_line(child: &mut ChildProcess, marker: &str, limit: Duration) -> Vec<String> {
    let deadline = Instant::now() + limit;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match child.lines.recv_timeout(left) {
            Ok(line) => {
                // The harness prints `test <name> ... ` before the test's own output.
                let found = line.contains(marker);
                seen.push(line);
                if found {
                    return seen;
                }
            }
            Err(e) => {
                let _ = child.child.kill();
                let status = child.child.wait();
                panic!(
                    "the child never printed {marker} ({e:?}; status {status:?}); its output:\n{}",
                    seen.join("\n")
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Two processes, generic over the backend.

/// Runs the child test `test` on `handle` to its end; asserts it passed.
fn child_passes(test: &str, handle: &[u8], ordinal: usize) {
    let mut child = spawn_child(test, handle, ordinal);
    let mut out = wait_for_line(&mut child, DONE, Duration::from_secs(60));
    let status = child.child.wait().unwrap();
    child.reader.join().unwrap();
    out.extend(child.lines.try_iter());
    assert!(status.success(), "child: {status}\n{}", out.join("\n"));
    assert!(
        out.iter()
            .any(|l| l.starts_with("test result: ok. 1 passed")),
        "the child test did not pass:\n{out:#?}"
    );
}

/// The parent writes the first half and exports; the child imports on
/// `child_ordinal`, checks it and writes the second half, which the parent then sees.
fn parent_and_child_share_memory<B: Backend>(
    dev: &B::Device,
    child_test: &str,
    child_ordinal: usize,
) {
    let mem = B::alloc(dev, BYTES, MemoryKind::SharedSignal).unwrap();
    let ptr = B::memory_ptr(&mem);
    write_pattern::<B>(dev, ptr, 1, 0..8);
    B::synchronize(dev).unwrap();
    child_passes(
        child_test,
        &B::export_memory(dev, &mem).unwrap(),
        child_ordinal,
    );
    check_pattern::<B>(dev, ptr, 2, 8..16, "the child's half, seen by the parent");
    check_pattern::<B>(dev, ptr, 1, 0..8, "the parent's half after the child ran");
    drop(mem);
    B::synchronize(dev).unwrap();
}

/// The child of [`parent_and_child_share_memory`].
fn child_checks_and_writes<B: Backend>(dev: &B::Device, handle: &[u8]) {
    let mapping = B::import_memory(dev, handle).unwrap();
    let ptr = B::mapping_ptr(&mapping);
    check_pattern::<B>(dev, ptr, 1, 0..8, "the parent's half, seen by the child");
    write_pattern::<B>(dev, ptr, 2, 8..16);
    B::synchronize(dev).unwrap();
    drop(mapping);
    B::synchronize(dev).unwrap();
    println!("\n{DONE}");
}

/// A child maps the parent's memory and writes until SIGKILLed; the parent's memory
/// stays mapped, holds the child's writes, stays writable and frees normally.
fn parent_survives_killed_child<B: Backend>(
    dev: &B::Device,
    child_test: &str,
    child_ordinal: usize,
) {
    use std::os::unix::process::ExitStatusExt;

    let mem = B::alloc(dev, BYTES, MemoryKind::SharedSignal).unwrap();
    let ptr = B::memory_ptr(&mem);
    write_pattern::<B>(dev, ptr, 3, 0..8);
    B::synchronize(dev).unwrap();
    let handle = B::export_memory(dev, &mem).unwrap();

    let mut child = spawn_child(child_test, &handle, child_ordinal);
    wait_for_line(&mut child, READY, Duration::from_secs(60));
    // Let it write the counter for a moment, then kill it mid-loop.
    std::thread::sleep(Duration::from_millis(20));
    child.child.kill().unwrap();
    let status = child.child.wait().unwrap();
    child.reader.join().unwrap();
    assert_eq!(
        status.signal(),
        Some(9),
        "the child should die of SIGKILL: {status}"
    );

    let counter = |dev: &B::Device| read_words::<B>(dev, ptr + (COUNTER * 4) as u64, 1)[0];
    let first = counter(dev);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(counter(dev), first, "nobody writes after the kill");
    eprintln!("killed child had written its counter up to {first}");
    check_pattern::<B>(dev, ptr, 3, 0..8, "the parent's half after the kill");
    check_pattern::<B>(dev, ptr, 4, 8..16, "the killed child's half");
    write_pattern::<B>(dev, ptr, 5, 0..16);
    check_pattern::<B>(dev, ptr, 5, 0..16, "rewritten after the kill");
    drop(mem);
    B::synchronize(dev).unwrap();
}

/// The child of [`parent_survives_killed_child`].
fn child_writes_until_killed<B: Backend>(dev: &B::Device, handle: &[u8]) {
    let mapping = B::import_memory(dev, handle).unwrap();
    let ptr = B::mapping_ptr(&mapping);
    check_pattern::<B>(dev, ptr, 3, 0..8, "the parent's half, seen by the child");
    write_pattern::<B>(dev, ptr, 4, 8..16);
    B::synchronize(dev).unwrap();
    println!("\n{READY}");
    let start = Instant::now();
    let mut n = 1u32;
    while start.elapsed() < Duration::from_secs(30) {
        B::memset_d32(dev, ptr + (COUNTER * 4) as u64, n, 1).unwrap();
        B::synchronize(dev).unwrap();
        n = n.wrapping_add(1);
    }
    panic!("the parent did not kill this child within 30 s");
}

/// The parent exports an allocation and frees it; a child importing the stale handle
/// gets a typed error (`Error::Backend` from `import_memory`), not a crash.
fn stale_handle_fails_in_another_process<B: Backend>(
    dev: &B::Device,
    child_test: &str,
    child_ordinal: usize,
) {
    let mem = B::alloc(dev, BYTES, MemoryKind::SharedSignal).unwrap();
    let handle = B::export_memory(dev, &mem).unwrap();
    drop(mem);
    B::synchronize(dev).unwrap();
    child_passes(child_test, &handle, child_ordinal);
}

/// The child of [`stale_handle_fails_in_another_process`].
fn child_import_fails<B: Backend>(dev: &B::Device, handle: &[u8]) {
    eprintln!("stale handle: {}", import_error_detail::<B>(dev, handle));
    println!("\n{DONE}");
}

/// In module `$module` over backend `B` (with its `parent_device`): each two-process
/// test `$parent` running `$run`, with its child test `$child` (a no-op in an ordinary run).
macro_rules! two_process_suite {
    ($module:ident) => {
        /// The full name of this module's test `name`.
        fn full(name: &str) -> String {
            format!("{}::{name}", stringify!($module))
        }
        two_process_suite!(@ two_processes_share_signal_memory(parent_and_child_share_memory) => child_checks_and_writes);
        two_process_suite!(@ killed_child_leaves_the_parents_memory_intact(parent_survives_killed_child) => child_writes_until_killed);
        two_process_suite!(@ stale_handle_fails_in_another_process(stale_handle_fails_in_another_process) => child_import_fails);
    };
    (@ $parent:ident($run:ident) => $child:ident) => {
        #[test]
        fn $parent() {
            let _serial = serial();
            if let Some((dev, child)) = parent_device(&full(stringify!($parent))) {
                super::$run::<B>(&dev, &full(stringify!($child)), child);
            }
        }

        #[test]
        fn $child() {
            if let Some((dev, handle)) = child_args::<B>(&full(stringify!($child))) {
                super::$child::<B>(&dev, &handle);
            }
        }
    };
}

// ---------------------------------------------------------------------------------------
// Host backend.

fn host(ordinal: usize) -> <Host as Backend>::Device {
    Host::open(ordinal).unwrap()
}

/// Two simulated devices in one process: each side sees the other's writes through the
/// import.
#[test]
fn host_same_process_round_trip() {
    let _serial = serial();
    let (d0, d1) = (host(0), host(1));
    let mem = Host::alloc(&d0, BYTES, MemoryKind::SharedSignal).unwrap();
    let ptr = Host::memory_ptr(&mem);
    assert_eq!(ptr % 256, 0, "signal memory is 256-byte aligned");
    assert!(
        read_words::<Host>(&d0, ptr, BYTES / 4)
            .iter()
            .all(|&w| w == 0),
        "zero-filled"
    );
    write_pattern::<Host>(&d0, ptr, 11, 0..16);
    // The pattern is written in d0's stream order; d1 reads in its own.
    Host::synchronize(&d0).unwrap();
    let handle = Host::export_memory(&d0, &mem).unwrap();
    assert_eq!(handle.len(), 40);
    assert_eq!(&handle[..4], b"pcho");

    let mapping = Host::import_memory(&d1, &handle).unwrap();
    let mptr = Host::mapping_ptr(&mapping);
    assert_ne!(mptr, ptr, "a mapping of its own");
    assert_eq!(mapping.bytes(), BYTES);
    check_pattern::<Host>(&d1, mptr, 11, 0..16, "read through the mapping");
    write_pattern::<Host>(&d1, mptr, 12, 4..12);
    Host::synchronize(&d1).unwrap();
    check_pattern::<Host>(&d0, ptr, 12, 4..12, "written through the mapping");
    check_pattern::<Host>(&d0, ptr, 11, 0..4, "untouched");
    check_pattern::<Host>(&d0, ptr, 11, 12..16, "untouched");
    // The last bytes (past the last whole page) are reachable through both.
    let tail = (BYTES - 4) as u64;
    Host::memset_d32(&d1, mptr + tail, 0xABCD_0123, 1).unwrap();
    Host::synchronize(&d1).unwrap();
    assert_eq!(read_words::<Host>(&d0, ptr + tail, 1), [0xABCD_0123]);
    drop(mapping);
    drop(mem);
    Host::synchronize(&d0).unwrap();
    Host::synchronize(&d1).unwrap();
}

/// The mapping keeps the memory alive after the exporter freed its allocation.
#[test]
fn host_mapping_outlives_the_exporters_allocation() {
    let _serial = serial();
    let (d0, d1) = (host(0), host(1));
    let mem = Host::alloc(&d0, BYTES, MemoryKind::SharedSignal).unwrap();
    write_pattern::<Host>(&d0, Host::memory_ptr(&mem), 21, 0..16);
    let handle = Host::export_memory(&d0, &mem).unwrap();
    let mapping = Host::import_memory(&d1, &handle).unwrap();
    drop(mem);
    Host::synchronize(&d0).unwrap(); // unmapped and closed on the exporter's side
    let mptr = Host::mapping_ptr(&mapping);
    check_pattern::<Host>(&d1, mptr, 21, 0..16, "after the exporter freed it");
    write_pattern::<Host>(&d1, mptr, 22, 0..16);
    check_pattern::<Host>(&d1, mptr, 22, 0..16, "written after the exporter freed it");
}

/// Dropping a mapping unmaps it in stream order: a memset queued behind a 100 ms kernel
/// still lands (an immediate unmap would fault).
#[test]
fn host_mapping_is_unmapped_in_stream_order() {
    let _serial = serial();
    let (d0, d1) = (host(0), host(1));
    let mem = Host::alloc(&d0, BYTES, MemoryKind::SharedSignal).unwrap();
    let mapping = Host::import_memory(&d1, &Host::export_memory(&d0, &mem).unwrap()).unwrap();
    let args = AllReduceArgs {
        timeout_ns: 100_000_000,
        ..Default::default()
    };
    let delay = Kernel {
        kind: KernelKind::Delay,
        dtype: DType::F32,
    };
    let dims = LaunchDims {
        blocks: 1,
        threads: 1,
    };
    Host::launch(&d1, delay, dims, &args).unwrap();
    Host::memset_d32(&d1, Host::mapping_ptr(&mapping), 0x5EED, WORDS).unwrap();
    drop(mapping);
    Host::synchronize(&d1).unwrap();
    let words = read_words::<Host>(&d0, Host::memory_ptr(&mem), WORDS);
    assert!(words.iter().all(|&w| w == 0x5EED));
}

/// The host's two-process tests: device 0 exports, the child opens device 1.
mod host {
    use super::*;

    type B = Host;

    fn parent_device(_test: &str) -> Option<(<B as Backend>::Device, usize)> {
        Some((B::open(0).unwrap(), 1))
    }

    two_process_suite!(host);
}

/// Name of the shared memory files (`/memfd:peercomm-signal (deleted)` in /proc).
const MEMFD_NAME: &str = "memfd:peercomm-signal";

/// Entries of `/proc/self/fd` and lines of `/proc/self/maps`: all of them, and those
/// of shared signal memory.
fn count_fds_and_maps() -> [(usize, usize); 2] {
    let fds = std::fs::read_dir("/proc/self/fd").unwrap();
    let fds = fds.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok());
    let fds: Vec<String> = fds.map(|p| p.to_string_lossy().into_owned()).collect();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let maps: Vec<String> = maps.lines().map(String::from).collect();
    [fds, maps].map(|l| (l.len(), l.iter().filter(|l| l.contains(MEMFD_NAME)).count()))
}

/// 1000 allocate/export/import/drop cycles leave no shm fd or mapping behind, and the
/// process totals grow by a small constant at most (harness threads and malloc arenas
/// move them; a leak would be about 1000).
#[test]
fn host_export_import_cycles_leak_nothing() {
    const SLACK_FDS: usize = 4;
    const SLACK_MAPS: usize = 32;
    let _serial = serial();
    let (d0, d1) = (host(0), host(1));
    let cycle = |i: u32| {
        let bytes = 4096 + (i as usize % 3) * 4000;
        let mem = Host::alloc(&d0, bytes, MemoryKind::SharedSignal).unwrap();
        let handle = Host::export_memory(&d0, &mem).unwrap();
        let mapping = Host::import_memory(&d1, &handle).unwrap();
        Host::memset_d32(&d1, Host::mapping_ptr(&mapping), i, 16).unwrap();
        drop(mapping);
        drop(mem);
    };
    // Warm up: the stream threads' first allocations and the like.
    (0..10).for_each(cycle);
    Host::synchronize(&d0).unwrap();
    Host::synchronize(&d1).unwrap();
    let [fds, maps] = count_fds_and_maps();
    (0..1000).for_each(cycle);
    Host::synchronize(&d0).unwrap();
    Host::synchronize(&d1).unwrap();
    let [fds_after, maps_after] = count_fds_and_maps();
    eprintln!(
        "host_export_import_cycles_leak_nothing: /proc/self/fd {} -> {} ({} -> {} shared \
         signal files), /proc/self/maps {} -> {} lines ({} -> {} shared signal mappings)",
        fds.0, fds_after.0, fds.1, fds_after.1, maps.0, maps_after.0, maps.1, maps_after.1
    );
    assert_eq!(fds_after.1, fds.1, "shared signal fds leaked");
    assert_eq!(maps_after.1, maps.1, "shared signal mappings leaked");
    assert!(fds_after.0 <= fds.0 + SLACK_FDS, "{fds:?} -> {fds_after:?}");
    assert!(
        maps_after.0 <= maps.0 + SLACK_MAPS,
        "{maps:?} -> {maps_after:?}"
    );
}

/// The detail of the error every unusable handle gets.
fn import_error_detail<B: Backend>(dev: &B::Device, handle: &[u8]) -> String {
    match B::import_memory(dev, handle) {
        Err(Error::Backend {
            backend,
            call,
            detail,
        }) if (backend, call) == (B::NAME, "import_memory") => detail,
        Err(other) => panic!("expected Error::Backend from import_memory, got {other:?}"),
        Ok(_) => panic!("imported a bad handle"),
    }
}

fn patched(handle: &[u8], at: usize, bytes: &[u8]) -> Vec<u8> {
    let mut h = handle.to_vec();
    h[at..at + bytes.len()].copy_from_slice(bytes);
    h
}

/// Each `(name, handle, expected in the detail)` is refused with `Error::Backend`.
fn bad_handles_refused<B: Backend>(dev: &B::Device, cases: Vec<(&str, Vec<u8>, &str)>) {
    for (name, handle, expect) in cases {
        let detail = import_error_detail::<B>(dev, &handle);
        eprintln!("{name}: {detail}");
        assert!(detail.contains(expect), "{name}: {detail}");
    }
}

/// Malformed, foreign and stale handles are typed errors naming what is wrong; heap
/// memory cannot be exported.
#[test]
fn host_bad_handles_are_typed_errors() {
    let _serial = serial();
    let (d0, d1) = (host(0), host(1));

    let heap = Host::alloc(&d0, 4096, MemoryKind::Signal).unwrap();
    match Host::export_memory(&d0, &heap) {
        Err(Error::Unsupported(why)) => assert!(why.contains("SharedSignal"), "{why}"),
        other => panic!("exported heap memory: {other:?}"),
    }

    let mem = Host::alloc(&d0, 4096, MemoryKind::SharedSignal).unwrap();
    let good = Host::export_memory(&d0, &mem).unwrap();
    let at = |at: usize, bytes: &[u8]| patched(&good, at, bytes);
    let inode = u64::from_le_bytes(good[32..40].try_into().unwrap());
    let (huge, next_inode) = (0x7fff_fff0u32.to_le_bytes(), (inode + 1).to_le_bytes());
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", vec![], "too short"),
        ("header only", good[..8].to_vec(), "8 bytes where"),
        ("short", good[..39].to_vec(), "39 bytes where"),
        ("long", [&good[..], &[0]].concat(), "41 bytes where"),
        ("CUDA magic", at(0, b"pccu"), "another backend"),
        ("v2", at(4, &2u32.to_le_bytes()), "handle version 2"),
        ("size", at(16, &8192u64.to_le_bytes()), "size mismatch"),
        ("inode", at(32, &next_inode), "identity mismatch"),
        ("no such process", at(8, &huge), "cannot open"),
        ("no such fd", at(12, &huge), "cannot open"),
    ];
    bad_handles_refused::<Host>(&d1, cases);
    // The good handle still works after all that.
    drop(Host::import_memory(&d1, &good).unwrap());

    // Stale: the exporter freed the memory, and the next shared allocation takes the
    // lowest free fd number, its old one.
    drop(mem);
    Host::synchronize(&d0).unwrap();
    let gone = import_error_detail::<Host>(&d1, &good);
    eprintln!("exporter dropped: {gone}");
    assert!(gone.contains("cannot open"), "{gone}");
    let reuse = Host::alloc(&d0, 4096, MemoryKind::SharedSignal).unwrap();
    let reuse_handle = Host::export_memory(&d0, &reuse).unwrap();
    assert_eq!(
        reuse_handle[12..16],
        good[12..16],
        "the new file should have taken the freed fd number"
    );
    let reused = import_error_detail::<Host>(&d1, &good);
    eprintln!("fd reused: {reused}");
    assert!(reused.contains("identity mismatch"), "{reused}");
    drop(Host::import_memory(&d1, &reuse_handle).unwrap());
    drop(reuse);
    Host::synchronize(&d0).unwrap();
    Host::synchronize(&d1).unwrap();
}

// ---------------------------------------------------------------------------------------
// GPU backends: two processes (their IPC cannot open a handle in the exporter).

/// The IPC tests of a GPU backend, in module `$module` (behind feature `$feature`).
macro_rules! gpu_ipc_suite {
    ($module:ident, $feature:literal, $backend:ty, $magic:literal) => {
        #[cfg(feature = $feature)]
        mod $module {
            use super::*;

            type B = $backend;

            /// Device 0 and the ordinal the child uses (device 1 where there is one),
            /// or `None` after printing why `test` is skipped.
            fn parent_device(test: &str) -> Option<(<B as Backend>::Device, usize)> {
                let why = match B::device_count() {
                    Ok(0) => format!("no {} device", B::NAME),
                    Ok(n) => return Some((B::open(0).unwrap(), usize::from(n > 1))),
                    Err(e) => e.to_string(),
                };
                // Straight to stderr, past the harness's output capture.
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
                None
            }

            two_process_suite!($module);

            /// Importing in the exporting process is `Error::Unsupported` saying so;
            /// malformed handles are `Error::Backend` from `import_memory`.
            #[test]
            fn same_process_and_bad_handles_are_typed_errors() {
                let _serial = serial();
                let Some((dev, _)) =
                    parent_device(&full("same_process_and_bad_handles_are_typed_errors"))
                else {
                    return;
                };
                let mem = B::alloc(&dev, BYTES, MemoryKind::SharedSignal).unwrap();
                let good = B::export_memory(&dev, &mem).unwrap();
                assert_eq!(good.len(), 88);
                assert_eq!(&good[..4], $magic);
                match B::import_memory(&dev, &good) {
                    Err(Error::Unsupported(why)) => {
                        eprintln!("same process: {why}");
                        assert!(why.contains("process that exported it"), "{why}");
                    }
                    other => panic!("expected Error::Unsupported, got {other:?}"),
                }
                let cases: Vec<(&str, Vec<u8>, &str)> = vec![
                    ("empty", vec![], "too short"),
                    ("one byte short", good[..87].to_vec(), "87 bytes where"),
                    ("host magic", patched(&good, 0, b"pcho"), "another backend"),
                    ("v2", patched(&good, 4, &[2, 0, 0, 0]), "handle version 2"),
                ];
                bad_handles_refused::<B>(&dev, cases);
            }
        }
    };
}

gpu_ipc_suite!(cuda, "cuda", peercomm::backend::cuda::Cuda, b"pccu");
gpu_ipc_suite!(hip, "hip", peercomm::backend::hip::Hip, b"pchi");
