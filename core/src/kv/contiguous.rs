//! Contiguous KV: every admitted sequence reserves one slot of `max_model_len` tokens,
//! however long it turns out to be. With a 32,768-token budget and max_model_len 4,096 that
//! is 8 slots — the benchmark log's Phase 4/5 limit.

use super::BrokenInvariant;
use super::{BlockId, DroppedBlocks, KvManager, PrefixMatch, SeqKv};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct ContiguousKv {
    slot_tokens: usize,
    num_slots: usize,
    /// Free slots; popped from the end, so the lowest ids are used first.
    free: Vec<BlockId>,
    /// Per slot: whether a sequence holds it (kept apart from `free`, so that each can
    /// check the other).
    held: Vec<bool>,
    /// Allocations dropped still holding their slot (see [`SeqKv`]).
    dropped: Arc<DroppedBlocks>,
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
            held: vec![false; num_slots],
            dropped: Arc::default(),
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
                Some(slot) => {
                    assert!(!self.held[slot as usize], "slot {slot} handed out twice");
                    self.held[slot as usize] = true;
                    kv.blocks.push(slot);
                }
                None => return false,
            }
        }
        true
    }

    fn commit(&mut self, _kv: &mut SeqKv, _tokens: &[u32], _num_computed: usize) {}

    fn free(&mut self, kv: &mut SeqKv) {
        for &slot in &kv.blocks {
            assert!(self.held[slot as usize], "slot {slot} freed twice");
            self.held[slot as usize] = false;
        }
        self.free.append(&mut kv.blocks);
        kv.hashes.clear();
    }

    fn dropped_blocks(&self) -> &Arc<DroppedBlocks> {
        &self.dropped
    }

    fn total_refs(&self) -> usize {
        self.held.iter().filter(|&&h| h).count()
    }

    fn refs(&self, block: BlockId) -> usize {
        usize::from(self.held[block as usize])
    }

    fn check(&self) -> Result<(), BrokenInvariant> {
        let mut listed = vec![false; self.num_slots];
        for &s in &self.free {
            if std::mem::replace(&mut listed[s as usize], true) {
                return Err(BrokenInvariant::new(3, format!("slot {s} is free twice")));
            }
            if self.held[s as usize] {
                return Err(BrokenInvariant::new(
                    3,
                    format!("slot {s} is both free and held"),
                ));
            }
        }
        if let Some(s) = (0..self.num_slots).find(|&s| !listed[s] && !self.held[s]) {
            return Err(BrokenInvariant::new(
                3,
                format!("slot {s} is neither free nor held"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserves_a_whole_slot_per_sequence() {
        let mut kv = ContiguousKv::new(32_768, 4096);
        assert_eq!(kv.num_blocks(), 8);
        let mut seqs: Vec<SeqKv> = (0..9).map(|_| kv.new_seq()).collect();
        for s in seqs.iter_mut().take(8) {
            assert!(kv.allocate(s, &PrefixMatch::default(), 200));
        }
        assert!(!kv.allocate(&mut seqs[8], &PrefixMatch::default(), 1));
        assert_eq!(kv.usage(), 1.0);
        kv.free(&mut seqs[3]);
        assert!(kv.allocate(&mut seqs[8], &PrefixMatch::default(), 4096));
        assert!(!kv.allocate(&mut seqs[8], &PrefixMatch::default(), 4097));
        kv.check().unwrap();
        assert_eq!(kv.total_refs(), 8);
        let mut bad = kv.clone();
        bad.free.push(seqs[0].blocks[0]);
        let e = bad.check().unwrap_err();
        assert!(
            e.0.starts_with("INV-3: ") && e.0.contains("both free and held"),
            "{e}"
        );
        let mut bad = kv.clone();
        bad.held[seqs[1].blocks[0] as usize] = false;
        assert!(bad.check().unwrap_err().0.contains("neither"));
        // Allocations dropped without a free give their slots back at the next step.
        drop(seqs);
        assert_eq!(kv.num_free_blocks(), 0);
        kv.reclaim_dropped();
        assert_eq!(kv.num_free_blocks(), 8);
        kv.check().unwrap();
    }
}
