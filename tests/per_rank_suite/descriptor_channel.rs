//! The descriptor channel (the abstract Unix socket carrying a registration's fds)
//! beside connections that are no peer's ([`Strangers`]): two ranks in two processes
//! register fd-only memory, then again with strangers queued on rank 1's channel;
//! every rank must register within [`BOUND`], Ok, and the communicator work after.

use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use peercomm::backend::Backend;
use peercomm::bootstrap::UniqueId;
use peercomm::{Comm, CommConfig, Error, ReduceOp};
use rustix::net::{AddressFamily, SendFlags, SocketAddrUnix, SocketFlags, SocketType};

use super::common;
use super::{processes, Placement};

/// One collective registration of fd-only memory (host: symmetric; CUDA: a POSIX-fd
/// pool buffer), dropped again: Ok, or the error.
pub type Registers<B> = fn(&Comm<B>) -> Result<(), Error>;

/// How long a registration beside the strangers may take on any rank (it takes
/// milliseconds; generous for a loaded CI machine).
const BOUND: Duration = Duration::from_secs(5);

/// The uid (and gid) of user nobody.
const NOBODY: u32 = 65534;

/// Who connects to rank 1's descriptor channel before the measured registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strangers {
    /// A process of user nobody that connects and idles.
    AnotherUser,
    /// Processes of this user flooding backlogs, idling or sending garbage, and rank 0's
    /// own process with idle, partial, garbage and wrong-nonce messages.
    Bogus,
}

impl Strangers {
    fn name(self) -> &'static str {
        ["another-user", "bogus"][self as usize]
    }
}

/// Both ranks: a bootstrap timeout under 30 s, so that a rank stalled on the channel
/// shows as a peer's gather timeout.
fn config(devices: &Placement) -> CommConfig {
    processes::config_for(devices, 2)
        .with_barrier_timeout(Some(Duration::from_secs(10)))
        .with_bootstrap_timeout(Duration::from_secs(20))
}

/// An all-reduce of 16 ones, synchronised: "ok" when it sums right, else why not.
fn all_reduce_check<B: Backend>(comm: &Comm<B>) -> String {
    let dev = comm.device();
    let outcome = B::alloc_from(dev, &[1.0f32; 16]).and_then(|mut buf| {
        comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum)?;
        comm.synchronize()?;
        B::download(dev, &buf)
    });
    match outcome {
        Ok(v) if v == vec![2.0f32; 16] => "ok".into(),
        Ok(v) => format!("wrong sum {:?}", &v[..2]),
        Err(e) => format!("error {e}"),
    }
}

/// One rank's part: warm-up registration, `intrude` (kept open), an all-reduce as a
/// barrier, the measured registration and an all-reduce. Returns `OUTCOME ok <ms>` or
/// `OUTCOME err <ms> <error>`, and `AFTER <check>`.
fn rank_side<B: Backend>(
    comm: &Comm<B>,
    registers: Registers<B>,
    intrude: impl FnOnce() -> Vec<OwnedFd>,
) -> Vec<String> {
    let rank = comm.rank();
    registers(comm).unwrap_or_else(|e| panic!("rank {rank}: the warm-up registration: {e}"));
    let _open = intrude();
    assert_eq!(all_reduce_check(comm), "ok", "rank {rank}: the barrier");
    let start = Instant::now();
    let outcome = registers(comm);
    let ms = start.elapsed().as_millis();
    vec![
        match outcome {
            Ok(()) => format!("OUTCOME ok {ms}"),
            Err(e) => format!("OUTCOME err {ms} {e}"),
        },
        format!("AFTER {}", all_reduce_check(comm)),
    ]
}

/// The abstract socket names of `pid`'s descriptor channels, as every local user reads
/// them in `/proc/net/unix`.
fn channels_of(pid: u32) -> Vec<Vec<u8>> {
    let prefix = format!("@peercomm-descriptors/{pid}/");
    std::fs::read_to_string("/proc/net/unix")
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .filter(|path| path.starts_with(&prefix))
        .map(|path| path.as_bytes()[1..].to_vec())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

fn address(name: &[u8]) -> SocketAddrUnix {
    SocketAddrUnix::new_abstract_name(name).unwrap()
}

/// A `sleep` process (as `uid` where given) connecting to each of `names` and sending
/// `payload`, held until killed; `flood` fills each backlog.
fn stranger_process(names: &[Vec<u8>], uid: Option<u32>, payload: &[u8], flood: bool) -> Child {
    let addrs: Vec<SocketAddrUnix> = names.iter().map(|n| address(n)).collect();
    let payload = payload.to_vec();
    let mut command = Command::new("sleep");
    command
        .arg("60")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(uid) = uid {
        command.uid(uid).gid(uid);
    }
    // SAFETY: the closure runs in the forked child before `exec` (after the uid
    // change) and makes only system calls, on memory allocated before the fork; the
    // sockets are made without close-on-exec so that `sleep` keeps them open.
    unsafe {
        command.pre_exec(move || {
            for addr in &addrs {
                for _ in 0..if flood { 1000 } else { 1 } {
                    let flags = [SocketFlags::empty(), SocketFlags::NONBLOCK][flood as usize];
                    let (unix, stream) = (AddressFamily::UNIX, SocketType::STREAM);
                    let socket = rustix::net::socket_with(unix, stream, flags, None)?;
                    match rustix::net::connect(&socket, addr) {
                        Ok(()) => {}
                        Err(rustix::io::Errno::AGAIN) if flood => break,
                        Err(e) => return Err(e.into()),
                    }
                    if !payload.is_empty() {
                        rustix::net::send(&socket, &payload, SendFlags::empty())?;
                    }
                    std::mem::forget(socket);
                }
            }
            Ok(())
        });
    }
    command.spawn().expect("a stranger process")
}

/// A channel message as a sender writes it: magic, registration, rank, nonce.
fn message(registration: u64, rank: u64, nonce: u64) -> [u8; 32] {
    let mut m = [0u8; 32];
    for (i, w) in [u64::from_le_bytes(*b"pcfdesc1"), registration, rank, nonce]
        .iter()
        .enumerate()
    {
        m[8 * i..8 * i + 8].copy_from_slice(&w.to_le_bytes());
    }
    m
}

/// Connections from rank 0's process (it passes the credential check) to `names`:
/// idle, half a message, garbage, and wrong-nonce messages with a descriptor.
fn same_process_strangers(names: &[Vec<u8>]) -> Vec<OwnedFd> {
    use std::io::IoSlice;
    use std::mem::MaybeUninit;

    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage};

    let connect = |name: &[u8]| {
        let socket = rustix::net::socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
        rustix::net::connect(&socket, &address(name)).unwrap();
        socket
    };
    let file =
        rustix::fs::memfd_create("peercomm-stranger", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let mut open = Vec::new();
    for name in names {
        open.push(connect(name));
        let half = connect(name);
        rustix::net::send(&half, &message(0, 0, 0)[..16], SendFlags::empty()).unwrap();
        open.push(half);
        let garbage = connect(name);
        rustix::net::send(&garbage, &[0xab; 32], SendFlags::empty()).unwrap();
        open.push(garbage);
        for registration in 0..8 {
            let wrong = connect(name);
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            let fds = [std::os::fd::AsFd::as_fd(&file)];
            assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
            let bytes = message(registration, 0, 0x5eed_5eed_5eed_5eed);
            let bytes = [IoSlice::new(&bytes)];
            rustix::net::sendmsg(&wrong, &bytes, &mut control, SendFlags::empty()).unwrap();
            open.push(wrong);
        }
    }
    open
}

/// The child side (rank 1): true when `role` is one of this module's.
pub fn child<B: Backend>(
    role: &str,
    devices: &Placement,
    (rank, world, id): (usize, usize, &UniqueId),
    registers: Registers<B>,
) -> bool {
    if role.strip_prefix("channel-").is_none() {
        return false;
    }
    let dev = B::open(devices.ordinal(rank)).unwrap();
    let comm = Comm::<B>::from_rank(dev, rank, world, id, config(devices)).unwrap();
    for line in rank_side(&comm, registers, Vec::new) {
        println!("CHANNEL {line}");
    }
    true
}

/// Two processes register beside `strangers`: within [`BOUND`], Ok everywhere, and an
/// all-reduce after sums right. `AnotherUser` needs root, else skips.
pub fn beside_strangers<B: Backend>(
    devices: &Placement,
    registers: Registers<B>,
    strangers: Strangers,
) {
    let test = format!("descriptor_channel::beside_strangers({})", strangers.name());
    if strangers == Strangers::AnotherUser && !rustix::process::getuid().is_root() {
        common::announce_skip(&test, "needs root to start a process as user nobody");
        return;
    }
    let id = UniqueId::new().unwrap();
    // This process's channels before rank 0's (other tests may run beside this one).
    let others = channels_of(std::process::id());
    let role = format!("channel-{}", strangers.name());
    let mut child = processes::spawn_with(&role, 1, 2, &id.to_string(), 0, &[]);
    let comm = Comm::<B>::from_rank(B::open(0).unwrap(), 0, 2, &id, config(devices)).unwrap();
    let peer = child.id();
    let mut processes = Vec::new();
    let mine = rank_side(&comm, registers, || {
        let names = channels_of(peer);
        let note = format!("rank 1's channel in /proc/net/unix: {names:?}");
        assert_eq!(names.len(), 1, "{note}");
        match strangers {
            Strangers::AnotherUser => {
                processes.push(stranger_process(&names, Some(NOBODY), &[], false));
                Vec::new()
            }
            Strangers::Bogus => {
                processes.push(stranger_process(&names, None, &[], false));
                processes.push(stranger_process(&names, None, &[0xcd; 32], false));
                processes.push(stranger_process(&names, None, &message(1, 0, 0), false));
                let open = same_process_strangers(&names);
                // Then both ranks' backlogs full: a rank whose send waited for room
                // before its own receive would wait for its peer doing the same.
                let mut both: Vec<Vec<u8>> = channels_of(std::process::id())
                    .into_iter()
                    .filter(|n| !others.contains(n))
                    .collect();
                assert!(!both.is_empty(), "rank 0's channel in /proc/net/unix");
                both.extend(names.iter().cloned());
                processes.push(stranger_process(&both, None, &[], true));
                open
            }
        }
    });
    let theirs = processes::lines_of(&mut child);
    let theirs: Vec<String> = theirs
        .iter()
        .filter_map(|l| l.strip_prefix("CHANNEL "))
        .map(str::to_string)
        .collect();
    let status = child.wait().unwrap();
    for mut p in processes {
        let _ = p.kill();
        let _ = p.wait();
    }
    drop(comm);
    eprintln!("{test}: rank 0 {mine:?}, rank 1 {theirs:?}");
    assert!(status.success(), "rank 1's process failed: {status}");
    let outcome = |lines: &[String], rank: usize| -> (String, Duration) {
        let l = lines.iter().find_map(|l| l.strip_prefix("OUTCOME "));
        let f: Vec<&str> = l
            .unwrap_or_else(|| panic!("rank {rank}: {lines:?}"))
            .splitn(3, ' ')
            .collect();
        let ms = f[1].parse().unwrap();
        (f[0].to_string(), Duration::from_millis(ms))
    };
    let (o0, t0) = outcome(&mine, 0);
    let (o1, t1) = outcome(&theirs, 1);
    let note = format!("ranks 0 and 1 disagree: {mine:?} against {theirs:?}");
    assert_eq!(o0, o1, "{note}");
    assert_eq!(o0, "ok", "{mine:?} {theirs:?}");
    for (rank, t) in [(0, t0), (1, t1)] {
        assert!(
            t < BOUND,
            "rank {rank}'s registration took {t:?} beside {} strangers (bound {BOUND:?})",
            strangers.name()
        );
    }
    for (rank, lines) in [(0, &mine), (1, &theirs)] {
        assert!(
            lines.iter().any(|l| l == "AFTER ok"),
            "rank {rank}: the communicator after the registration: {lines:?}"
        );
    }
}
