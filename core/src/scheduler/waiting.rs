//! The waiting queue: sequences not running, in the order they are admitted.
//!
//! Two lanes. Requests as they arrive (and preempted sequences, at the front) wait in the
//! main lane, first come first served. A request's forks (OpenAI's `n`: the sequences made
//! from its prompt once its first token is sampled) wait in a lane of their own, and when
//! both lanes hold sequences the admissions alternate between them. One request's `n`
//! sequences then share the free slots with everyone else instead of taking them all: with
//! the forks at the head of a single queue, a 4-token request sent after an `n = 64` one
//! on a small pool waited for 63 whole forks to run (33 s here), and with four such
//! requests other clients saw no token for minutes. Forks still run as soon as there is
//! room; they give up only every other slot while others wait.

use std::collections::VecDeque;

#[derive(Debug, Default)]
pub(super) struct WaitQueue {
    main: VecDeque<u32>,
    forks: VecDeque<u32>,
    /// When both lanes hold sequences, whether the forks' lane goes next.
    forks_turn: bool,
    /// Sequences set aside by [`WaitQueue::pass_over`], with whether each was a fork.
    passed: Vec<(u32, bool)>,
}

impl WaitQueue {
    /// An arrival: behind everyone in the main lane.
    pub fn push_back(&mut self, slot: u32) {
        self.main.push_back(slot);
    }

    /// A preempted sequence: first in the main lane.
    pub fn push_front(&mut self, slot: u32) {
        self.main.push_front(slot);
    }

    /// A fork: behind the other forks.
    pub fn push_fork(&mut self, slot: u32) {
        self.forks.push_back(slot);
    }

    fn forks_next(&self) -> bool {
        !self.forks.is_empty() && (self.main.is_empty() || self.forks_turn)
    }

    /// The sequence to admit next.
    pub fn front(&self) -> Option<u32> {
        if self.forks_next() {
            self.forks.front().copied()
        } else {
            self.main.front().copied()
        }
    }

    /// Take the sequence [`WaitQueue::front`] named; the other lane goes next.
    pub fn pop_front(&mut self) -> Option<u32> {
        let from_forks = self.forks_next();
        self.forks_turn = !from_forks;
        if from_forks {
            self.forks.pop_front()
        } else {
            self.main.pop_front()
        }
    }

    /// Set the sequence [`WaitQueue::front`] names aside, so that the one behind it comes
    /// to the front (an admission that lets later sequences overtake one that does not
    /// fit); [`WaitQueue::restore_passed`] puts it back.
    pub fn pass_over(&mut self) {
        let from_forks = self.forks_next();
        let lane = if from_forks {
            &mut self.forks
        } else {
            &mut self.main
        };
        if let Some(slot) = lane.pop_front() {
            self.passed.push((slot, from_forks));
        }
    }

    /// Put the sequences passed over back at the front of their lanes, in their order.
    pub fn restore_passed(&mut self) {
        for (slot, fork) in self.passed.drain(..).rev() {
            if fork {
                self.forks.push_front(slot);
            } else {
                self.main.push_front(slot);
            }
        }
    }

    /// Take `slot` out wherever it waits (an ended request).
    pub fn remove(&mut self, slot: u32) {
        for lane in [&mut self.main, &mut self.forks] {
            if let Some(pos) = lane.iter().position(|&s| s == slot) {
                lane.remove(pos);
                return;
            }
        }
    }

    pub fn len(&self) -> usize {
        self.main.len() + self.forks.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.main.iter().chain(&self.forks).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::WaitQueue;

    fn drain(q: &mut WaitQueue) -> Vec<u32> {
        std::iter::from_fn(|| {
            let front = q.front();
            let popped = q.pop_front();
            assert_eq!(front, popped, "front names what pop_front takes");
            popped
        })
        .collect()
    }

    /// Passed over, a sequence lets the next come to the front, and goes back where it was.
    #[test]
    fn passed_over_sequences_return_to_their_places() {
        let mut q = WaitQueue::default();
        for s in [1, 2, 3] {
            q.push_back(s);
        }
        q.push_fork(10);
        q.pass_over();
        assert_eq!(q.front(), Some(2));
        q.pass_over();
        assert_eq!(q.front(), Some(3));
        assert_eq!(q.len(), 2);
        q.restore_passed();
        assert_eq!(drain(&mut q), [1, 10, 2, 3]);
    }

    #[test]
    fn lanes_alternate_while_both_wait_and_each_keeps_its_order() {
        let mut q = WaitQueue::default();
        for f in [10, 11, 12, 13] {
            q.push_fork(f);
        }
        q.push_back(1);
        q.push_back(2);
        q.push_front(0); // preempted: first in its lane
        assert_eq!(q.len(), 7);
        assert_eq!(drain(&mut q), vec![0, 10, 1, 11, 2, 12, 13]);
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn a_lone_lane_runs_in_order_and_removal_finds_either_lane() {
        let mut q = WaitQueue::default();
        q.push_back(1);
        q.push_back(2);
        q.push_fork(10);
        q.push_fork(11);
        q.remove(10);
        q.remove(2);
        q.remove(99); // not waiting: nothing happens
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![1, 11]);
        assert_eq!(drain(&mut q), vec![1, 11]);
        q.push_fork(12);
        q.push_fork(13);
        assert_eq!(drain(&mut q), vec![12, 13], "forks alone go on");
    }
}
