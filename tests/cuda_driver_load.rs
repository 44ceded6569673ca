//! Loading the CUDA driver leaves the process-wide panic hook alone:
//! its own test binary, so that this is the process's first driver load.
#![cfg(feature = "cuda")]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use peercomm::backend::{cuda::Cuda, Backend};

/// A hook that counts the panics it sees is installed; another thread panics (and
/// catches) in a loop while this thread loads the driver. Every one of those panics
/// must reach the hook (a loader that swaps in a silent hook for the duration of the
/// load loses any panic message raised meanwhile), and the load itself must not
/// panic: with no libcuda it is a typed `NoDevice`, with one a device count.
#[test]
fn driver_load_keeps_the_panic_hook() {
    let seen = Arc::new(AtomicUsize::new(0));
    let previous = std::panic::take_hook();
    {
        let seen = seen.clone();
        std::panic::set_hook(Box::new(move |_| {
            seen.fetch_add(1, Ordering::SeqCst);
        }));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let panicker = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut raised = 0usize;
            while !stop.load(Ordering::SeqCst) || raised < 100 {
                let _ = std::panic::catch_unwind(|| panic!("deliberate"));
                raised += 1;
            }
            raised
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(20));
    let count = Cuda::device_count();
    stop.store(true, Ordering::SeqCst);
    let raised = panicker.join().unwrap();
    let hooked = seen.load(Ordering::SeqCst);
    std::panic::set_hook(previous);
    match &count {
        Ok(n) => eprintln!("driver_load_keeps_the_panic_hook: {n} CUDA device(s)"),
        Err(peercomm::Error::NoDevice { detail, .. }) => {
            eprintln!("driver_load_keeps_the_panic_hook: no driver ({detail})")
        }
        Err(other) => panic!("loading the driver: unexpected {other}"),
    }
    assert_eq!(
        hooked, raised,
        "{raised} panics were raised during the driver load but the hook saw {hooked}"
    );
}
