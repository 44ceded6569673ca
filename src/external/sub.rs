//! A group's view of a world [`Bootstrap`]: an all-gather among some ranks, made of one
//! all-gather of the whole world (every world rank calls it at the same time, each
//! through its own group's view). Setup code written for a world runs unchanged over
//! the ranks of one host this way.

use std::sync::Arc;
use std::time::Duration;

use crate::bootstrap::{Bootstrap, BootstrapError};

/// The ranks `members` of a world bootstrap, renumbered `0..members.len()`.
pub(crate) struct SubBootstrap {
    parent: Arc<dyn Bootstrap>,
    members: Vec<usize>,
    index: usize,
}

impl SubBootstrap {
    /// The view of `members` (world ranks in group order; contains the parent's rank).
    pub(crate) fn new(parent: Arc<dyn Bootstrap>, members: Vec<usize>) -> Self {
        let me = parent.rank();
        let index = members
            .iter()
            .position(|&m| m == me)
            .expect("a rank's group contains it");
        SubBootstrap {
            parent,
            members,
            index,
        }
    }

    /// The members' records of a world all-gather, in group order.
    fn pick(&self, mut all: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
        self.members
            .iter()
            .map(|&m| std::mem::take(&mut all[m]))
            .collect()
    }
}

impl Bootstrap for SubBootstrap {
    fn rank(&self) -> usize {
        self.index
    }
    fn world_size(&self) -> usize {
        self.members.len()
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let all = self.parent.all_gather(mine)?;
        Ok(self.pick(all))
    }
    fn all_gather_within(
        &self,
        mine: &[u8],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let all = self.parent.all_gather_within(mine, timeout)?;
        Ok(self.pick(all))
    }
}
