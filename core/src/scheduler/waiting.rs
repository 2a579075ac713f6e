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
//!
//! Under priority scheduling there are no lanes: every waiting sequence, preempted or not,
//! waits in the order of its [`Rank`] (vLLM's priority queue), a fork with its parent's
//! priority and arrival.

use std::collections::{BTreeSet, VecDeque};

use super::SchedulingPolicy;

/// A sequence's place under priority scheduling: the smallest goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Rank {
    /// The request's priority (lower first).
    pub priority: i64,
    /// The request's arrival order; a fork has its parent's.
    pub arrival: u64,
    /// The sequence's own order (a fork's comes after its parent's).
    pub seq: u64,
}

#[derive(Debug)]
pub(super) struct WaitQueue {
    /// Preempted sequences, admitted before either lane.
    preempted: VecDeque<u32>,
    main: VecDeque<u32>,
    forks: VecDeque<u32>,
    /// When both lanes hold sequences, whether the forks' lane goes next.
    forks_turn: bool,
    /// Under priority scheduling, every waiting sequence (the lanes stay empty).
    ranked: Option<BTreeSet<(Rank, u32)>>,
    /// Sequences set aside by [`WaitQueue::pass_over`], with the lane each came from.
    passed: Vec<(u32, Lane)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    Preempted,
    Main,
    Forks,
    Ranked(Rank),
}

impl WaitQueue {
    pub fn new(policy: SchedulingPolicy) -> Self {
        WaitQueue {
            preempted: VecDeque::new(),
            main: VecDeque::new(),
            forks: VecDeque::new(),
            forks_turn: false,
            ranked: (policy == SchedulingPolicy::Priority).then(BTreeSet::new),
            passed: Vec::new(),
        }
    }

    /// An arrival: behind everyone in the main lane (or in its rank's place).
    pub fn push_back(&mut self, slot: u32, rank: Rank) {
        if !self.insert_ranked(slot, rank) {
            self.main.push_back(slot);
        }
    }

    /// A preempted sequence: before every other (or in its rank's place).
    pub fn push_front(&mut self, slot: u32, rank: Rank) {
        if !self.insert_ranked(slot, rank) {
            self.preempted.push_front(slot);
        }
    }

    /// A fork: behind the other forks (or in its rank's place).
    pub fn push_fork(&mut self, slot: u32, rank: Rank) {
        if !self.insert_ranked(slot, rank) {
            self.forks.push_back(slot);
        }
    }

    /// Under priority scheduling, `slot` waits in its rank's place: whether it does.
    fn insert_ranked(&mut self, slot: u32, rank: Rank) -> bool {
        self.ranked
            .as_mut()
            .map(|r| r.insert((rank, slot)))
            .is_some()
    }

    /// The lane whose head goes next.
    fn next_lane(&self) -> Lane {
        if let Some(&(rank, _)) = self.ranked.as_ref().and_then(|r| r.first()) {
            Lane::Ranked(rank)
        } else if !self.preempted.is_empty() {
            Lane::Preempted
        } else if !self.forks.is_empty() && (self.main.is_empty() || self.forks_turn) {
            Lane::Forks
        } else {
            Lane::Main
        }
    }

    /// Take the head of `lane`.
    fn pop_lane(&mut self, lane: Lane) -> Option<u32> {
        match lane {
            Lane::Preempted => self.preempted.pop_front(),
            Lane::Main => self.main.pop_front(),
            Lane::Forks => self.forks.pop_front(),
            Lane::Ranked(_) => self.ranked.as_mut()?.pop_first().map(|(_, slot)| slot),
        }
    }

    /// The sequence to admit next.
    pub fn front(&self) -> Option<u32> {
        match self.next_lane() {
            Lane::Preempted => self.preempted.front().copied(),
            Lane::Main => self.main.front().copied(),
            Lane::Forks => self.forks.front().copied(),
            Lane::Ranked(_) => self.ranked.as_ref()?.first().map(|&(_, slot)| slot),
        }
    }

    /// Take the sequence [`WaitQueue::front`] named; of the two lanes, the other goes next.
    pub fn pop_front(&mut self) -> Option<u32> {
        let lane = self.next_lane();
        if matches!(lane, Lane::Main | Lane::Forks) {
            self.forks_turn = lane == Lane::Main;
        }
        self.pop_lane(lane)
    }

    /// Set the sequence [`WaitQueue::front`] names aside, so that the one behind it comes
    /// to the front (an admission that lets later sequences overtake one that does not
    /// fit); [`WaitQueue::restore_passed`] puts it back.
    pub fn pass_over(&mut self) {
        let lane = self.next_lane();
        if let Some(slot) = self.pop_lane(lane) {
            self.passed.push((slot, lane));
        }
    }

    /// Put the sequences passed over back at the front of their lanes, in their order.
    pub fn restore_passed(&mut self) {
        while let Some((slot, lane)) = self.passed.pop() {
            match lane {
                Lane::Preempted => self.preempted.push_front(slot),
                Lane::Main => self.main.push_front(slot),
                Lane::Forks => self.forks.push_front(slot),
                Lane::Ranked(rank) => _ = self.insert_ranked(slot, rank),
            }
        }
    }

    /// Take `slot` out wherever it waits (an ended request).
    pub fn remove(&mut self, slot: u32) {
        if let Some(ranked) = &mut self.ranked {
            if let Some(&entry) = ranked.iter().find(|&&(_, s)| s == slot) {
                ranked.remove(&entry);
            }
            return;
        }
        for lane in [&mut self.preempted, &mut self.main, &mut self.forks] {
            if let Some(pos) = lane.iter().position(|&s| s == slot) {
                lane.remove(pos);
                return;
            }
        }
    }

    pub fn len(&self) -> usize {
        self.preempted.len()
            + self.main.len()
            + self.forks.len()
            + self.ranked.as_ref().map_or(0, BTreeSet::len)
    }

    /// The waiting sequences, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.preempted
            .iter()
            .chain(&self.main)
            .chain(&self.forks)
            .copied()
            .chain(self.ranked.iter().flatten().map(|&(_, slot)| slot))
    }
}

#[cfg(test)]
mod tests {
    use super::{Rank, SchedulingPolicy, WaitQueue};

    /// A rank first come, first served ignores.
    const ANY: Rank = Rank {
        priority: 0,
        arrival: 0,
        seq: 0,
    };

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
        let mut q = WaitQueue::new(SchedulingPolicy::Fcfs);
        for s in [1, 2] {
            q.push_back(s, ANY);
        }
        q.push_fork(10, ANY);
        q.push_fork(11, ANY);
        assert_eq!(q.pop_front(), Some(1));
        // The forks' turn now; two sequences are preempted.
        q.push_front(21, ANY);
        q.push_front(20, ANY);
        assert_eq!(q.front(), Some(20));
        q.pass_over();
        assert_eq!(q.front(), Some(21), "the next preempted, not a fork");
        q.restore_passed();
        assert_eq!(q.iter().collect::<Vec<_>>(), [20, 21, 2, 10, 11]);
        assert_eq!(drain(&mut q), [20, 21, 10, 2, 11]);
        q.push_front(30, ANY);
        q.remove(30);
        assert_eq!(q.len(), 0);
    }

    /// Passed over, a sequence lets the next come to the front, and goes back where it was.
    #[test]
    fn passed_over_sequences_return_to_their_places() {
        let mut q = WaitQueue::new(SchedulingPolicy::Fcfs);
        for s in [1, 2, 3] {
            q.push_back(s, ANY);
        }
        q.push_fork(10, ANY);
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
        let mut q = WaitQueue::new(SchedulingPolicy::Fcfs);
        for f in [10, 11, 12, 13] {
            q.push_fork(f, ANY);
        }
        q.push_back(1, ANY);
        q.push_back(2, ANY);
        q.push_front(0, ANY); // preempted: before both lanes, taking neither's turn
        assert_eq!(q.len(), 7);
        assert_eq!(drain(&mut q), vec![0, 1, 10, 2, 11, 12, 13]);
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn a_lone_lane_runs_in_order_and_removal_finds_either_lane() {
        let mut q = WaitQueue::new(SchedulingPolicy::Fcfs);
        q.push_back(1, ANY);
        q.push_back(2, ANY);
        q.push_fork(10, ANY);
        q.push_fork(11, ANY);
        q.remove(10);
        q.remove(2);
        q.remove(99); // not waiting: nothing happens
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![1, 11]);
        assert_eq!(drain(&mut q), vec![1, 11]);
        q.push_fork(12, ANY);
        q.push_fork(13, ANY);
        assert_eq!(drain(&mut q), vec![12, 13], "forks alone go on");
    }

    /// Under priority scheduling every sequence waits in its rank's place: a preempted one
    /// goes back by its priority and arrival, not to the front, and a fork waits right
    /// behind its parent's arrival, before later arrivals of its priority.
    #[test]
    fn ranked_sequences_wait_by_priority_then_arrival() {
        let rank = |priority, arrival, seq| Rank {
            priority,
            arrival,
            seq,
        };
        let mut q = WaitQueue::new(SchedulingPolicy::Priority);
        q.push_back(1, rank(5, 1, 1));
        q.push_back(2, rank(0, 2, 2));
        q.push_back(3, rank(5, 3, 3));
        q.push_front(4, rank(5, 0, 0)); // preempted, of an earlier arrival
        q.push_front(5, rank(9, 4, 4)); // preempted, of the lowest priority
        q.push_fork(6, rank(5, 1, 7)); // request 1's fork
        assert_eq!(q.len(), 6);
        assert_eq!(q.front(), Some(2));
        q.pass_over();
        q.pass_over();
        assert_eq!(
            q.front(),
            Some(1),
            "passed over, the next in rank comes first"
        );
        q.remove(1);
        q.restore_passed();
        q.remove(99); // not waiting: nothing happens
        let mut order = q.iter().collect::<Vec<_>>();
        order.sort_unstable();
        assert_eq!(order, [2, 3, 4, 5, 6]);
        assert_eq!(drain(&mut q), [2, 4, 6, 3, 5]);
    }
}
