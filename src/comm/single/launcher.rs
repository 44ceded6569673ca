//! The single-controller launch pool: one worker thread per rank but rank 0 (the
//! caller's), so that every rank's kernel is enqueued at once. The caller publishes a
//! borrowed job and bumps a generation counter; each worker, spinning for [`SPIN`] then
//! parked, runs its rank's launch and counts down. A panic in a launch is caught and
//! handed back ([`Outcomes::panic`]), so no worker dies with a job.

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;

/// How long a worker (and the caller waiting for the workers) spins before parking:
/// long enough that the calls of a decode step, back to back, find the workers awake.
pub(super) const SPIN: Duration = Duration::from_micros(100);

/// One rank's launch: called with the world rank to launch on.
pub(super) type LaunchFn<'a> = dyn Fn(usize) -> Result<()> + Sync + 'a;

/// A panic caught in a launch, to resume on the caller.
pub(super) type Panic = Box<dyn Any + Send + 'static>;

/// What a parallel launch did on each rank.
#[derive(Default)]
pub(super) struct Outcomes {
    /// `results[r]`: rank r's launch, `None` where it was not asked for (or panicked).
    pub(super) results: [Option<Result<()>>; MAX_GPUS],
    /// The first panic a launch raised (the lowest rank's), if any.
    pub(super) panic: Option<Panic>,
}

/// The job the caller publishes: the launch (its lifetime erased, see
/// [`Launcher::run`]) and the ranks to run it on (bit r: rank r).
#[derive(Clone, Copy)]
struct Job {
    launch: Option<*const LaunchFn<'static>>,
    ranks: u32,
}

/// One worker's slot, on its own cache line: whether it is parked (so the caller
/// unparks only workers that sleep) and the outcome of its last job.
#[repr(align(128))]
struct Slot {
    asleep: AtomicBool,
    outcome: UnsafeCell<Option<thread::Result<Result<()>>>>,
}

/// What the caller and the workers share.
struct Shared {
    /// Bumped once per job (and once to shut down); a worker runs a job when it sees
    /// a generation it has not run.
    generation: AtomicU64,
    shutdown: AtomicBool,
    /// Written by the caller before it bumps `generation`, only while no worker reads
    /// it (every worker has counted the previous job down).
    job: UnsafeCell<Job>,
    /// The thread that published the job, for the last worker to wake.
    caller: UnsafeCell<Option<Thread>>,
    /// Workers that have not finished the current job.
    remaining: AtomicUsize,
    /// Set by the last worker once it no longer touches the job.
    done: AtomicBool,
    /// `slots[w]`: worker w, which drives rank w + 1.
    slots: Vec<Slot>,
}

// SAFETY: the cells are handed over through the atomics: `job` and `caller` are written
// by the caller (through `&mut Launcher`, so by one thread) before the Release of
// `generation` and read by the workers after their Acquire of it, and not written again
// until `done`, which the last worker sets once it no longer reads them; a slot's
// `outcome` is written by its worker before its AcqRel count-down of `remaining` (before
// `done`) and read by the caller after its Acquire of `done`. The raw pointer in `job`
// is only dereferenced during a job, while the caller blocks (see `Launcher::run`); what
// it points to is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; every value in the cells (`Thread`, `Result`, a panic payload, the
// pointer to a `Sync` closure) may be used from another thread.
unsafe impl Send for Shared {}

/// What a communicator's launch lock guards: its launch pool (world > 1, once parallel
/// launch was first on) and whether launches go through it
/// ([`crate::CommConfig::parallel_launch`]).
pub(super) struct Launches {
    pub(super) pool: Option<Launcher>,
    pub(super) parallel: bool,
}

impl Launches {
    /// Turns parallel launch on (starting the pool if it is not running yet) or off
    /// (the pool stays, parked, for a later switch back on); `backend` names a failed
    /// thread start.
    pub(super) fn set_parallel(
        &mut self,
        world: usize,
        on: bool,
        backend: &'static str,
    ) -> Result<()> {
        if on && world > 1 && self.pool.is_none() {
            let pool = Launcher::start(world).map_err(|e| Error::Backend {
                backend,
                call: "std::thread::spawn",
                detail: format!("starting the single controller's launch threads: {e}"),
            })?;
            self.pool = Some(pool);
        }
        self.parallel = on;
        Ok(())
    }

    /// Runs `launch(r)` for every rank r of `ranks` (each once): at once through the
    /// pool where parallel launch is on, each rank's outcome kept; else in order on
    /// this thread, stopping at the first failure, as a single thread does.
    pub(super) fn run(&mut self, ranks: &[usize], launch: &LaunchFn<'_>) -> Outcomes {
        if let Some(pool) = self
            .pool
            .as_mut()
            .filter(|_| self.parallel && ranks.len() > 1)
        {
            let mask = ranks.iter().fold(0u32, |m, &r| m | 1 << r);
            return pool.run(mask, launch);
        }
        let mut outcomes = Outcomes::default();
        for &r in ranks {
            let result = launch(r);
            let failed = result.is_err();
            outcomes.results[r] = Some(result);
            if failed {
                break;
            }
        }
        outcomes
    }
}

/// The pool: one worker thread per rank but rank 0.
pub(super) struct Launcher {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Launcher {
    /// Starts `world - 1` workers (rank 1 to `world - 1`).
    pub(super) fn start(world: usize) -> std::io::Result<Launcher> {
        assert!(world <= MAX_GPUS);
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            job: UnsafeCell::new(Job {
                launch: None,
                ranks: 0,
            }),
            caller: UnsafeCell::new(None),
            remaining: AtomicUsize::new(0),
            done: AtomicBool::new(true),
            slots: (1..world)
                .map(|_| Slot {
                    asleep: AtomicBool::new(false),
                    outcome: UnsafeCell::new(None),
                })
                .collect(),
        });
        let mut launcher = Launcher {
            shared,
            workers: Vec::with_capacity(world.saturating_sub(1)),
        };
        for w in 0..world.saturating_sub(1) {
            let shared = launcher.shared.clone();
            // On failure `launcher` is dropped: the workers started so far are joined.
            let worker = thread::Builder::new()
                .name(format!("peercomm-launch-{}", w + 1))
                .spawn(move || work(&shared, w))?;
            launcher.workers.push(worker);
        }
        Ok(launcher)
    }

    /// A weak handle on the state every worker holds until its thread ends (see
    /// `SingleController::launch_pool_probe`).
    pub(super) fn probe(&self) -> Weak<dyn Any + Send + Sync> {
        let shared: Arc<dyn Any + Send + Sync> = self.shared.clone();
        Arc::downgrade(&shared)
    }

    /// Runs `launch(r)` for every rank r whose bit is set in `ranks` (within the world):
    /// rank 0 on this thread, the others on their workers, all at once; returns when
    /// every one has returned or panicked.
    pub(super) fn run(&mut self, ranks: u32, launch: &LaunchFn<'_>) -> Outcomes {
        let shared = &*self.shared;
        // SAFETY: only the lifetime changes (the same fat pointer). The workers
        // dereference it only between the bump of `generation` below and `done`, and
        // this function does not return (nor unwind: its own launch runs under
        // `catch_unwind`, and the wait cannot panic) before `done`, so `launch` and
        // everything it borrows outlive every use.
        let erased =
            unsafe { std::mem::transmute::<*const LaunchFn<'_>, *const LaunchFn<'static>>(launch) };
        // SAFETY: no worker reads the cells now: the previous job (if any) ended with
        // `done`, and the next starts with the bump below (see `Shared`).
        unsafe {
            *shared.job.get() = Job {
                launch: Some(erased),
                ranks,
            };
            *shared.caller.get() = Some(thread::current());
        }
        let workers = self.workers.len();
        shared.remaining.store(workers, Ordering::Relaxed);
        shared.done.store(workers == 0, Ordering::Relaxed);
        shared.generation.fetch_add(1, Ordering::SeqCst);
        for (slot, worker) in shared.slots.iter().zip(&self.workers) {
            // SeqCst with the worker's store before it re-checks the generation: either
            // it sees the new generation or this sees it asleep.
            if slot.asleep.load(Ordering::SeqCst) {
                worker.thread().unpark();
            }
        }
        let own = (ranks & 1 != 0).then(|| catch_unwind(AssertUnwindSafe(|| launch(0))));
        wait(|| shared.done.load(Ordering::Acquire), thread::park);
        // SAFETY: the caller handle is not read past `done`.
        unsafe { *shared.caller.get() = None };
        let mut outcomes = Outcomes::default();
        let all = std::iter::once(own).chain(shared.slots.iter().map(|slot| {
            // SAFETY: written by its worker before `done` (Acquire above); no worker
            // writes it again before the next job.
            unsafe { (*slot.outcome.get()).take() }
        }));
        for (r, outcome) in all.enumerate() {
            match outcome {
                Some(Ok(result)) => outcomes.results[r] = Some(result),
                Some(Err(panic)) => {
                    outcomes.panic.get_or_insert(panic);
                }
                None => {}
            }
        }
        outcomes
    }
}

impl Drop for Launcher {
    /// Tells the workers to stop and joins them.
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        for worker in &self.workers {
            worker.thread().unpark();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// Spins on `ready` for [`SPIN`], then calls `sleep` (a park) until it holds.
fn wait(ready: impl Fn() -> bool, sleep: impl Fn()) {
    let start = Instant::now();
    let mut spins = 0u32;
    while !ready() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) && start.elapsed() >= SPIN {
            while !ready() {
                sleep();
            }
            return;
        }
        std::hint::spin_loop();
    }
}

/// Worker `w`'s loop: waits for a generation it has not run, runs rank `w + 1`'s
/// launch if the job asks for it, stores the outcome and counts down.
fn work(shared: &Shared, w: usize) {
    let rank = w + 1;
    let slot = &shared.slots[w];
    let mut seen = 0u64;
    loop {
        let fresh = || shared.generation.load(Ordering::SeqCst) != seen;
        // Parks only after saying so (SeqCst, see `Launcher::run`), and re-checks.
        wait(fresh, || {
            slot.asleep.store(true, Ordering::SeqCst);
            if !fresh() {
                thread::park();
            }
            slot.asleep.store(false, Ordering::Relaxed);
        });
        seen = shared.generation.load(Ordering::Acquire);
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: published before the generation this worker just acquired, and not
        // written again before this worker counts down (see `Shared`).
        let job = unsafe { *shared.job.get() };
        let outcome = job
            .launch
            .filter(|_| job.ranks & (1 << rank) != 0)
            .map(|launch| {
                // SAFETY: the caller blocks in `Launcher::run` until every worker has
                // counted this job down, so the closure and what it borrows are alive.
                let launch = unsafe { &*launch };
                catch_unwind(AssertUnwindSafe(|| launch(rank)))
            });
        // SAFETY: the caller reads this slot only after `done`, which needs this
        // worker's count-down below.
        unsafe { *slot.outcome.get() = outcome };
        if shared.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last one: wake the caller. Its handle is cloned before `done`, past
            // which the caller may publish the next job.
            // SAFETY: written before the generation was bumped, cleared only after
            // `done`.
            let caller = unsafe { (*shared.caller.get()).clone() };
            shared.done.store(true, Ordering::Release);
            if let Some(caller) = caller {
                caller.unpark();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_asked_rank_runs_once_per_job() {
        let mut pool = Launcher::start(8).unwrap();
        let result = |r: usize| match r {
            5 => Err(Error::Unsupported("rank 5".into())),
            _ => Ok(()),
        };
        for ranks in [0xffu32, 0b1010_0110, 0b1, 0b1000_0000, 0] {
            let hits: Vec<AtomicU32> = (0..8).map(|_| AtomicU32::new(0)).collect();
            let out = pool.run(ranks, &|r| {
                hits[r].fetch_add(1, Ordering::Relaxed);
                result(r)
            });
            assert!(out.panic.is_none());
            for (r, hit) in hits.iter().enumerate() {
                let asked = ranks & (1 << r) != 0;
                assert_eq!(hit.load(Ordering::Relaxed), u32::from(asked), "rank {r}");
                assert_eq!(out.results[r], asked.then(|| result(r)), "rank {r}");
            }
        }
    }

    #[test]
    fn a_panicking_launch_is_handed_back_and_the_pool_keeps_working() {
        let mut pool = Launcher::start(3).unwrap();
        let out = pool.run(0b111, &|r| {
            if r == 2 {
                panic!("launch on rank 2");
            }
            Ok(())
        });
        let panic = out.panic.expect("the panic");
        assert_eq!(panic.downcast_ref::<&str>(), Some(&"launch on rank 2"));
        assert_eq!(out.results[0], Some(Ok(())));
        assert_eq!(out.results[1], Some(Ok(())));
        assert_eq!(out.results[2], None);
        // Parked workers (past the spin) wake for the next job.
        std::thread::sleep(SPIN * 20);
        let out = pool.run(0b111, &|_| Ok(()));
        assert!(out.panic.is_none());
        assert!(out.results[..3].iter().all(|r| *r == Some(Ok(()))));
    }

    #[test]
    fn many_jobs_back_to_back_and_after_sleeps() {
        let mut pool = Launcher::start(4).unwrap();
        let probe = pool.probe();
        let total = AtomicU32::new(0);
        for i in 0..2000 {
            if i % 500 == 0 {
                std::thread::sleep(SPIN * 3);
            }
            let out = pool.run(0b1111, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
                Ok(())
            });
            assert!(out.results[..4].iter().all(|r| *r == Some(Ok(()))));
        }
        assert_eq!(total.load(Ordering::Relaxed), 8000);
        drop(pool);
        assert!(probe.upgrade().is_none(), "the workers were joined");
    }
}
