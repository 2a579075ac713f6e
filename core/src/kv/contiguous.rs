//! Contiguous KV: every admitted sequence reserves one slot of `max_model_len` tokens,
//! however long it turns out to be. With a 32,768-token budget and max_model_len 4,096 that
//! is 8 slots — the benchmark log's Phase 4/5 limit.

use super::{BlockId, KvManager, PrefixMatch, SeqKv};

#[derive(Debug, Clone)]
pub struct ContiguousKv {
    slot_tokens: usize,
    num_slots: usize,
    /// Free slots; popped from the end, so the lowest ids are used first.
    free: Vec<BlockId>,
}

impl ContiguousKv {
    /// Slots of `max_model_len` tokens carved out of a budget of `capacity_tokens`.
    pub fn new(capacity_tokens: usize, max_model_len: usize) -> Self {
        assert!(max_model_len > 0);
        let num_slots = capacity_tokens / max_model_len;
        ContiguousKv {
            slot_tokens: max_model_len,
            num_slots,
            free: (0..num_slots as BlockId).rev().collect(),
        }
    }
}

impl KvManager for ContiguousKv {
    fn block_size(&self) -> usize {
        self.slot_tokens
    }

    fn num_blocks(&self) -> usize {
        self.num_slots
    }

    fn num_free_blocks(&self) -> usize {
        self.free.len()
    }

    fn lookup_prefix(&self, _tokens: &[u32]) -> PrefixMatch {
        PrefixMatch::default()
    }

    fn allocate(&mut self, kv: &mut SeqKv, _prefix: &PrefixMatch, num_tokens: usize) -> bool {
        if num_tokens > self.slot_tokens {
            return false;
        }
        if kv.blocks.is_empty() {
            match self.free.pop() {
                Some(slot) => kv.blocks.push(slot),
                None => return false,
            }
        }
        true
    }

    fn commit(&mut self, _kv: &mut SeqKv, _tokens: &[u32], _num_computed: usize) {}

    fn free(&mut self, kv: &mut SeqKv) {
        self.free.append(&mut kv.blocks);
        kv.hashes.clear();
    }

    fn total_refs(&self) -> usize {
        self.num_slots - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserves_a_whole_slot_per_sequence() {
        let mut kv = ContiguousKv::new(32_768, 4096);
        assert_eq!(kv.num_blocks(), 8);
        let mut seqs: Vec<SeqKv> = (0..9).map(|_| SeqKv::default()).collect();
        for s in seqs.iter_mut().take(8) {
            assert!(kv.allocate(s, &PrefixMatch::default(), 200));
        }
        assert!(!kv.allocate(&mut seqs[8], &PrefixMatch::default(), 1));
        assert_eq!(kv.usage(), 1.0);
        kv.free(&mut seqs[3]);
        assert!(kv.allocate(&mut seqs[8], &PrefixMatch::default(), 4096));
        assert!(!kv.allocate(&mut seqs[8], &PrefixMatch::default(), 4097));
    }
}
