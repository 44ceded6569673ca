//! Rank 0 out of file descriptors: a child process runs rank 0 under a low
//! `RLIMIT_NOFILE` while the parent piles up idle connections, then joins as rank 1.

use super::*;
use std::io::Read;

/// The helper process of `fd_exhaustion_does_not_end_rank_zero`: rank 0 under a low
/// `RLIMIT_NOFILE`. Does nothing (and passes) unless the parent named it.
#[test]
fn fd_exhaustion_child() {
    use rustix::process::{setrlimit, Resource, Rlimit};
    if std::env::var_os(FD_CHILD_ENV).is_none() {
        return;
    }
    let id = loopback_id();
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let low = open + 12;
    let (current, maximum) = (Some(low), Some(low));
    setrlimit(Resource::Nofile, Rlimit { current, maximum }).unwrap();
    println!("FD_CHILD_ID {id}");
    std::io::stdout().flush().unwrap();
    match connect(&id, 0, 2, Duration::from_secs(8)).and_then(|b| b.all_gather(b"child")) {
        Ok(all) => println!("FD_CHILD_GATHERED {all:?}"),
        Err(e) => panic!("FD_CHILD_FAILED {e}"),
    }
}

const FD_CHILD_ENV: &str = "PEERCOMM_TEST_FD_CHILD";

/// Rank 0 runs out of file descriptors (a child process with a limit a few above what
/// it has open) while idle connections pile up: accept's EMFILE is waited out, and the
/// real rank 1 still joins.
#[test]
fn fd_exhaustion_does_not_end_rank_zero() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "bootstrap::tests::attacks::fds::fd_exhaustion_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FD_CHILD_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the child");
    let stdout = child.stdout.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    let reader = thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let id: UniqueId = loop {
        let line = lines
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|e| {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the child printed no id ({e:?}): {seen:?}");
            });
        match line.split("FD_CHILD_ID ").nth(1) {
            Some(rest) => break rest.trim().parse().unwrap(),
            None => seen.push(line),
        }
    };
    // More idle connections than the child has descriptors left.
    let idle = [(); 48].map(|()| TcpStream::connect(id.addr).unwrap());
    let leaf = connect(&id, 1, 2, Duration::from_secs(8)).and_then(|b| b.all_gather(b"parent"));
    drop(idle);
    // The child has stopped by itself by now (its own 8 s deadline); bound the wait.
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        thread::sleep(Duration::from_millis(20));
    };
    reader.join().unwrap();
    seen.extend(lines.try_iter());
    let mut stderr = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut stderr);
    assert!(
        status.success() && leaf.is_ok(),
        "rank 1: {leaf:?}; child {status}: {}\n{stderr}",
        seen.join("\n")
    );
    assert_eq!(leaf.unwrap(), vec![b"child".to_vec(), b"parent".to_vec()]);
}
