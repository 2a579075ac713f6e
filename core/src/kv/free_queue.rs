//! An intrusive doubly linked queue over block ids: O(1) push to the back, pop from the
//! front, and removal of any member. It holds every block with no owner, cached or not,
//! in least-recently-freed order, so the front is both "the next free block" and "the
//! least recently used cached block" — allocation evicts before it fails, for free.

use super::BlockId;

const NONE: u32 = u32::MAX;

/// A block's place in the queue: its neighbours side by side, so that an operation touches
/// one cache line per block (pools run to tens of thousands of blocks, hundreds of pools in
/// a simulated cluster).
#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
    member: bool,
}

#[derive(Debug, Clone)]
pub struct FreeQueue {
    links: Vec<Link>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// A queue holding all of `0..num_blocks`, in order.
    pub fn full(num_blocks: usize) -> Self {
        assert!(num_blocks < NONE as usize, "too many blocks");
        let unlinked = Link {
            prev: NONE,
            next: NONE,
            member: false,
        };
        let mut q = FreeQueue {
            links: vec![unlinked; num_blocks],
            head: NONE,
            tail: NONE,
            len: 0,
        };
        for b in 0..num_blocks as u32 {
            q.push_back(b);
        }
        q
    }

    pub fn len(&self) -> usize {
        self.len
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn contains(&self, block: BlockId) -> bool {
        self.links[block as usize].member
    }

    pub fn push_back(&mut self, block: BlockId) {
        // A double free would corrupt the list: an error in every build.
        assert!(!self.contains(block), "block {block} queued twice");
        self.links[block as usize] = Link {
            prev: self.tail,
            next: NONE,
            member: true,
        };
        if self.tail == NONE {
            self.head = block;
        } else {
            self.links[self.tail as usize].next = block;
        }
        self.tail = block;
        self.len += 1;
    }

    /// Members from front to back, by walking the links (invariant checks).
    pub fn walk(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.len);
        let mut b = self.head;
        while b != NONE && out.len() <= self.links.len() {
            out.push(b);
            b = self.links[b as usize].next;
        }
        out
    }

    pub fn pop_front(&mut self) -> Option<BlockId> {
        if self.head == NONE {
            return None;
        }
        let b = self.head;
        self.remove(b);
        Some(b)
    }

    pub fn remove(&mut self, block: BlockId) {
        let Link { prev, next, member } = self.links[block as usize];
        assert!(member, "block {block} not queued");
        if prev == NONE {
            self.head = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == NONE {
            self.tail = prev;
        } else {
            self.links[next as usize].prev = prev;
        }
        self.links[block as usize] = Link {
            prev: NONE,
            next: NONE,
            member: false,
        };
        self.len -= 1;
    }

    /// Members front to back.
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NONE {
                None
            } else {
                let b = cur;
                cur = self.links[b as usize].next;
                Some(b)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_order_and_removal() {
        let mut q = FreeQueue::full(4);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        q.remove(2);
        assert_eq!(q.pop_front(), Some(0));
        q.push_back(0);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![1, 3, 0]);
        assert_eq!(q.len(), 3);
        assert!(!q.contains(2));
        q.remove(0);
        q.remove(1);
        q.remove(3);
        assert!(q.is_empty());
        assert_eq!(q.pop_front(), None);
    }
}
