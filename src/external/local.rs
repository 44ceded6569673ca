//! An in-process [`Bootstrap`]: the ranks of one process (threads, or the streams of a
//! single controller) exchange bytes through shared memory. The host stand-in of the
//! single-controller communicator meets over it.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::bootstrap::{Bootstrap, BootstrapError};

struct State {
    /// Rounds completed.
    generation: u64,
    /// This round's contributions.
    slots: Vec<Option<Vec<u8>>>,
    /// The last completed round's result.
    last: Arc<Vec<Vec<u8>>>,
    /// A rank gave up (its setup failed): every wait ends at once.
    aborted: bool,
}

struct Shared {
    state: Mutex<State>,
    done: Condvar,
    timeout: Duration,
}

/// One rank of an in-process world (see the module docs).
pub(crate) struct LocalBootstrap {
    shared: Arc<Shared>,
    rank: usize,
    world: usize,
}

impl LocalBootstrap {
    /// A world of `world` ranks; each all-gather waits at most `timeout`.
    pub(crate) fn world(world: usize, timeout: Duration) -> Vec<LocalBootstrap> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                generation: 0,
                slots: vec![None; world],
                last: Arc::new(Vec::new()),
                aborted: false,
            }),
            done: Condvar::new(),
            timeout,
        });
        (0..world)
            .map(|rank| LocalBootstrap {
                shared: shared.clone(),
                rank,
                world,
            })
            .collect()
    }

    /// Ends every rank's wait at once, now and in later rounds: this rank will not
    /// come (its side of a collective setup failed).
    pub(crate) fn abort(&self) {
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.aborted = true;
        self.shared.done.notify_all();
    }
}

impl Bootstrap for LocalBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let deadline = Instant::now() + self.shared.timeout;
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = st.generation;
        st.slots[self.rank] = Some(mine.to_vec());
        if st.slots.iter().all(Option::is_some) {
            let all = st.slots.iter_mut().map(|s| s.take().unwrap()).collect();
            st.last = Arc::new(all);
            st.generation += 1;
            self.shared.done.notify_all();
            return Ok(st.last.as_ref().clone());
        }
        while st.generation == generation {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || st.aborted {
                let waiting_for = (0..self.world).filter(|&r| st.slots[r].is_none()).collect();
                st.slots[self.rank] = None;
                return Err(BootstrapError::Timeout {
                    step: "an in-process all-gather".into(),
                    waiting_for,
                    after: self.shared.timeout,
                    hint: if st.aborted {
                        "another rank of this process gave up".into()
                    } else {
                        "a rank did not make the same call".into()
                    },
                });
            }
            st = self
                .shared
                .done
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(st.last.as_ref().clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_in_order_and_timeout() {
        let world = LocalBootstrap::world(3, Duration::from_secs(10));
        let results: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = world
                .iter()
                .map(|b| {
                    s.spawn(move || {
                        (0..50u8)
                            .map(|i| b.all_gather(&[i, b.rank() as u8]).unwrap())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in &results {
            for (i, round) in r.iter().enumerate() {
                assert_eq!(
                    round,
                    &vec![vec![i as u8, 0], vec![i as u8, 1], vec![i as u8, 2]]
                );
            }
        }
        let lonely = LocalBootstrap::world(2, Duration::from_millis(50));
        match lonely[0].all_gather(b"x") {
            Err(BootstrapError::Timeout { waiting_for, .. }) => assert_eq!(waiting_for, vec![1]),
            other => panic!("{other:?}"),
        }
    }
}
