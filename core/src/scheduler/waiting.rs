//! The waiting queue: sequences not running, in the order they are admitted.
//!
//! Preempted sequences come first, before anything else (vLLM puts them back at the head
//! of its queue). Then two lanes. Requests as they arrive wait in the main lane, first
//! come first served. A request's forks (OpenAI's `n`: the sequences made
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
    /// Preempted sequences, admitted before either lane.
    preempted: VecDeque<u32>,
    main: VecDeque<u32>,
    forks: VecDeque<u32>,
    /// When both lanes hold sequences, whether the forks' lane goes next.
    forks_turn: bool,
    /// Sequences set aside by [`WaitQueue::pass_over`], with the lane each came from.
    passed: Vec<(u32, Lane)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    Preempted,
    Main,
    Forks,
}

impl WaitQueue {
    /// An arrival: behind everyone in the main lane.
    pub fn push_back(&mut self, slot: u32) {
        self.main.push_back(slot);
    }

    /// A preempted sequence: before every other.
    pub fn push_front(&mut self, slot: u32) {
        self.preempted.push_front(slot);
    }

    /// A fork: behind the other forks.
    pub fn push_fork(&mut self, slot: u32) {
        self.forks.push_back(slot);
    }

    /// The lane whose head goes next.
    fn next_lane(&self) -> Lane {
        if !self.preempted.is_empty() {
            Lane::Preempted
        } else if !self.forks.is_empty() && (self.main.is_empty() || self.forks_turn) {
            Lane::Forks
        } else {
            Lane::Main
        }
    }

    fn lane(&mut self, lane: Lane) -> &mut VecDeque<u32> {
        match lane {
            Lane::Preempted => &mut self.preempted,
            Lane::Main => &mut self.main,
            Lane::Forks => &mut self.forks,
        }
    }

    /// The sequence to admit next.
    pub fn front(&self) -> Option<u32> {
        match self.next_lane() {
            Lane::Preempted => self.preempted.front(),
            Lane::Main => self.main.front(),
            Lane::Forks => self.forks.front(),
        }
        .copied()
    }

    /// Take the sequence [`WaitQueue::front`] named; of the two lanes, the other goes next.
    pub fn pop_front(&mut self) -> Option<u32> {
        let lane = self.next_lane();
        if lane != Lane::Preempted {
            self.forks_turn = lane == Lane::Main;
        }
        self.lane(lane).pop_front()
    }

    /// Set the sequence [`WaitQueue::front`] names aside, so that the one behind it comes
    /// to the front (an admission that lets later sequences overtake one that does not
    /// fit); [`WaitQueue::restore_passed`] puts it back.
    pub fn pass_over(&mut self) {
        let lane = self.next_lane();
        if let Some(slot) = self.lane(lane).pop_front() {
            self.passed.push((slot, lane));
        }
    }

    /// Put the sequences passed over back at the front of their lanes, in their order.
    pub fn restore_passed(&mut self) {
        while let Some((slot, lane)) = self.passed.pop() {
            self.lane(lane).push_front(slot);
        }
    }

    /// Take `slot` out wherever it waits (an ended request).
    pub fn remove(&mut self, slot: u32) {
        for lane in [&mut self.preempted, &mut self.main, &mut self.forks] {
            if let Some(pos) = lane.iter().position(|&s| s == slot) {
                lane.remove(pos);
                return;
            }
        }
    }

    pub fn len(&self) -> usize {
        self.preempted.len() + self.main.len() + self.forks.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.preempted
            .iter()
            .chain(&self.main)
            .chain(&self.forks)
            .copied()
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

    /// A preempted sequence goes before both lanes, whichever lane's turn it is, and the
    /// lanes then alternate as before; several preempted keep the order they were put back
    /// in.
    #[test]
    fn preempted_sequences_go_first_whatever_the_lanes_turn() {
        let mut q = WaitQueue::default();
        for s in [1, 2] {
            q.push_back(s);
        }
        q.push_fork(10);
        q.push_fork(11);
        assert_eq!(q.pop_front(), Some(1));
        // The forks' turn now; two sequences are preempted.
        q.push_front(21);
        q.push_front(20);
        assert_eq!(q.front(), Some(20));
        q.pass_over();
        assert_eq!(q.front(), Some(21), "the next preempted, not a fork");
        q.restore_passed();
        assert_eq!(q.iter().collect::<Vec<_>>(), [20, 21, 2, 10, 11]);
        assert_eq!(drain(&mut q), [20, 21, 10, 2, 11]);
        q.push_front(30);
        q.remove(30);
        assert_eq!(q.len(), 0);
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
        q.push_front(0); // preempted: before both lanes, taking neither's turn
        assert_eq!(q.len(), 7);
        assert_eq!(drain(&mut q), vec![0, 1, 10, 2, 11, 12, 13]);
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
