//! Contiguous KV: every admitted sequence reserves one slot of `max_model_len` tokens,
//! however long it turns out to be. With a 32,768-token budget and max_model_len 4,096 that
//! is 8 slots — the benchmark log's Phase 4/5 limit.
//!
//! With prefix caching (`reuse`), each slot keeps the tokens it last held after its
//! sequence ends, as llama.cpp's server slots keep their last prompt and output: a new
//! prompt takes the free slot whose tokens share the largest fraction of it (more than
//! [`MIN_SIMILARITY`]) and reuses that common prefix; otherwise the free slot used least
//! recently, of whose tokens it still reuses what it shares from the start, and overwrites
//! the rest (`get_available_slot`, then the prompt's common prefix with the slot's tokens, in
//! llama.cpp's `tools/server/server-context.cpp`, its default `--slot-prompt-similarity`).
//! That common start is small but real: every prompt begins with the BOS token, and llama.cpp
//! computes 1,019 of a probe's 1,024-token prompts. A prompt finds only the slots' last
//! contents: there is no cache beyond the slots.

use super::BrokenInvariant;
use super::{BlockId, DroppedBlocks, KvManager, PrefixMatch, SeqKv};
use std::sync::Arc;

/// The fraction of a prompt a slot's tokens must share with it, from its start, to be
/// chosen for that prefix (llama.cpp's `--slot-prompt-similarity` default).
pub const MIN_SIMILARITY: f64 = 0.1;

#[derive(Debug, Clone)]
pub struct ContiguousKv {
    slot_tokens: usize,
    num_slots: usize,
    /// Free slots, in no order when `reuse` (a slot is then chosen by its tokens or its
    /// last use); otherwise popped from the end, so the lowest ids are used first.
    free: Vec<BlockId>,
    /// Per slot: whether a sequence holds it (kept apart from `free`, so that each can
    /// check the other).
    held: Vec<bool>,
    /// Slots keep their tokens for the next prompt (prefix caching).
    reuse: bool,
    /// Per slot (`reuse` only): the tokens whose KV it holds — its sequence's computed
    /// tokens, kept after the sequence ends.
    tokens: Vec<Vec<u32>>,
    /// Per slot (`reuse` only): when it was last freed, in frees counted (0: never used).
    last_freed: Vec<u64>,
    frees: u64,
    /// Allocations dropped still holding their slot (see [`SeqKv`]).
    dropped: Arc<DroppedBlocks>,
}

impl ContiguousKv {
    /// Slots of `max_model_len` tokens carved out of a budget of `capacity_tokens`; with
    /// `reuse`, each keeps its last tokens for a later prompt's prefix.
    pub fn new(capacity_tokens: usize, max_model_len: usize, reuse: bool) -> Self {
        assert!(max_model_len > 0);
        let num_slots = capacity_tokens / max_model_len;
        ContiguousKv {
            slot_tokens: max_model_len,
            num_slots,
            free: (0..num_slots as BlockId).rev().collect(),
            held: vec![false; num_slots],
            reuse,
            tokens: vec![Vec::new(); if reuse { num_slots } else { 0 }],
            last_freed: vec![0; if reuse { num_slots } else { 0 }],
            frees: 0,
            dropped: Arc::default(),
        }
    }

    /// The free slot a new sequence takes without a prefix: the one freed longest ago
    /// (never-used slots first, the highest id first among them: llama.cpp's server keeps
    /// the last slot of a tie, `get_available_slot`) when slots keep their tokens, else the
    /// lowest id.
    fn pick_free(&self) -> Option<usize> {
        if self.reuse {
            (0..self.free.len()).min_by_key(|&i| {
                (
                    self.last_freed[self.free[i] as usize],
                    std::cmp::Reverse(self.free[i]),
                )
            })
        } else {
            self.free.len().checked_sub(1)
        }
    }
}

/// How many tokens `a` and `b` share from their start.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
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

    fn lookup_prefix(&self, tokens: &[u32]) -> PrefixMatch {
        let mut best = PrefixMatch::default();
        if !self.reuse || tokens.is_empty() {
            return best;
        }
        // The last token is always computed (its logits are needed).
        let most = tokens.len() - 1;
        let mut best_share = MIN_SIMILARITY;
        // In slot order, a tie going to the lower id, as llama.cpp's server chooses.
        for slot in (0..self.num_slots).filter(|&s| !self.held[s]) {
            let common = common_prefix(&self.tokens[slot], tokens);
            let share = common as f64 / tokens.len() as f64;
            if share > best_share {
                best_share = share;
                best = PrefixMatch {
                    blocks: vec![slot as BlockId],
                    hashes: Vec::new(),
                    tokens: common.min(most),
                };
            }
        }
        // None shares enough: the slot a new sequence takes still holds what it shares.
        if best.blocks.is_empty() {
            if let Some(at) = self.pick_free() {
                let slot = self.free[at];
                let common = common_prefix(&self.tokens[slot as usize], tokens).min(most);
                if common > 0 {
                    best = PrefixMatch {
                        blocks: vec![slot],
                        hashes: Vec::new(),
                        tokens: common,
                    };
                }
            }
        }
        best
    }

    fn allocate(&mut self, kv: &mut SeqKv, prefix: &PrefixMatch, num_tokens: usize) -> bool {
        if num_tokens > self.slot_tokens {
            return false;
        }
        if kv.blocks.is_empty() {
            // The slot holding the prefix, else the one a new sequence takes.
            let at = prefix
                .blocks
                .first()
                .and_then(|&b| self.free.iter().position(|&f| f == b))
                .or_else(|| self.pick_free());
            let Some(at) = at else {
                return false;
            };
            // Without reuse `at` is the last: the others keep their order.
            let slot = self.free.swap_remove(at);
            assert!(!self.held[slot as usize], "slot {slot} handed out twice");
            self.held[slot as usize] = true;
            if self.reuse {
                // What follows the reused prefix is overwritten.
                let kept = if prefix.blocks.first() == Some(&slot) {
                    prefix.tokens
                } else {
                    0
                };
                self.tokens[slot as usize].truncate(kept);
            }
            kv.blocks.push(slot);
        }
        true
    }

    fn commit(&mut self, kv: &mut SeqKv, tokens: &[u32], num_computed: usize) {
        let (true, Some(&slot)) = (self.reuse, kv.blocks.first()) else {
            return;
        };
        // The slot's record is this sequence's computed tokens: it only grows while held.
        let kept = &mut self.tokens[slot as usize];
        kept.truncate(num_computed);
        let have = kept.len();
        kept.extend_from_slice(&tokens[have..num_computed]);
    }

    fn free(&mut self, kv: &mut SeqKv) {
        for &slot in &kv.blocks {
            assert!(self.held[slot as usize], "slot {slot} freed twice");
            self.held[slot as usize] = false;
            if self.reuse {
                self.frees += 1;
                self.last_freed[slot as usize] = self.frees;
            }
        }
        self.free.append(&mut kv.blocks);
        kv.hashes.clear();
    }

    fn reset_prefix_cache(&mut self) -> bool {
        // A held slot's tokens become reusable when its sequence ends: refused while one runs.
        if self.held.contains(&true) {
            return !self.reuse;
        }
        self.tokens.iter_mut().for_each(Vec::clear);
        true
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
        if let Some(s) = self.tokens.iter().position(|t| t.len() > self.slot_tokens) {
            return Err(BrokenInvariant::new(
                3,
                format!("slot {s} keeps more tokens than it holds"),
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
        let mut kv = ContiguousKv::new(32_768, 4096, false);
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
    /// Run one sequence of `tokens` through a slot: look up, allocate, compute all, free.
    fn run(kv: &mut ContiguousKv, tokens: &[u32]) -> (PrefixMatch, BlockId) {
        let mut seq = kv.new_seq();
        let prefix = kv.lookup_prefix(tokens);
        assert!(kv.allocate(&mut seq, &prefix, tokens.len()));
        let slot = seq.blocks[0];
        // Computed in two steps, as a prompt chunk and a decode would be.
        kv.commit(&mut seq, tokens, tokens.len() - 1);
        kv.commit(&mut seq, tokens, tokens.len());
        kv.free(&mut seq);
        kv.check().unwrap();
        (prefix, slot)
    }

    #[test]
    fn a_slot_keeps_its_last_tokens_for_the_prompt_that_shares_most_of_them() {
        let mut kv = ContiguousKv::new(4 * 64, 64, true);
        let a: Vec<u32> = (0..40).collect();
        let (first, slot_a) = run(&mut kv, &a);
        assert_eq!(first, PrefixMatch::default(), "an empty pool holds nothing");
        // A prompt sharing 30 of its 40 tokens with slot a's record goes there and reuses them.
        let b: Vec<u32> = (0..30).chain(100..110).collect();
        let (hit, slot_b) = run(&mut kv, &b);
        assert_eq!((hit.blocks.clone(), hit.tokens), (vec![slot_a], 30));
        assert_eq!(slot_b, slot_a);
        // The slot now holds b: a's tail was overwritten, and the same prompt again finds all
        // of it but its last token (whose logits are computed).
        let (hit, _) = run(&mut kv, &b);
        assert_eq!(hit.tokens, b.len() - 1);
        assert_eq!(kv.lookup_prefix(&a).tokens, 30);
        // A prompt sharing no more than a tenth takes the slot used least recently instead
        // (here never used: nothing to reuse), leaving the record of b where it was.
        let c: Vec<u32> = (0..3).chain(200..240).collect();
        assert_eq!(kv.lookup_prefix(&c), PrefixMatch::default());
        let (_, slot_c) = run(&mut kv, &c);
        assert_ne!(slot_c, slot_a);
        assert_eq!(kv.lookup_prefix(&b).blocks, vec![slot_a]);
        // Once every slot has held a prompt, one that shares little with all of them still
        // reuses what it shares with the slot used least recently (llama.cpp: its BOS and the
        // first words): here c's slot is never the least recent, so fill the other two.
        for first in [300, 400] {
            run(&mut kv, &(first..first + 40).collect::<Vec<u32>>());
        }
        let d: Vec<u32> = (0..2).chain(500..540).collect();
        let lru = kv.lookup_prefix(&d);
        assert_eq!((lru.blocks.clone(), lru.tokens), (vec![slot_a], 2));
        // A held slot is never offered.
        let mut held = kv.new_seq();
        let p = kv.lookup_prefix(&b);
        assert!(kv.allocate(&mut held, &p, b.len()));
        // (b then finds only what it shares with the free slot used least recently: c's.)
        let without = kv.lookup_prefix(&b);
        assert_eq!((without.blocks, without.tokens), (vec![slot_c], 3));
        // Emptied: nothing is found, and an empty record is refused while a slot is held.
        assert!(!kv.reset_prefix_cache());
        kv.free(&mut held);
        assert!(kv.reset_prefix_cache());
        assert_eq!(kv.lookup_prefix(&b), PrefixMatch::default());
        kv.check().unwrap();
    }

    #[test]
    fn of_two_slots_holding_the_same_prefix_the_lower_id_is_chosen() {
        let mut kv = ContiguousKv::new(4 * 64, 64, true);
        let a: Vec<u32> = (0..40).collect();
        run(&mut kv, &a);
        let mut held = kv.new_seq();
        let p = kv.lookup_prefix(&a);
        assert!(kv.allocate(&mut held, &p, a.len()));
        kv.commit(&mut held, &a, a.len());
        let (_, other) = run(&mut kv, &a);
        assert_ne!(other, held.blocks[0]);
        let first = held.blocks[0].min(other);
        kv.free(&mut held);
        assert_eq!(kv.lookup_prefix(&a).blocks, vec![first]);
    }

    #[test]
    fn with_reuse_never_used_slots_go_highest_id_first_then_least_recently_freed() {
        // llama.cpp's server: 15, 14, 13, … on a fresh start; then the slot freed first.
        let mut kv = ContiguousKv::new(4 * 64, 64, true);
        let mut seqs: Vec<SeqKv> = (0..3).map(|_| kv.new_seq()).collect();
        for s in &mut seqs {
            assert!(kv.allocate(s, &PrefixMatch::default(), 10));
        }
        let slots: Vec<BlockId> = seqs.iter().map(|s| s.blocks[0]).collect();
        assert_eq!(slots, vec![3, 2, 1]);
        for i in [1, 0, 2] {
            kv.free(&mut seqs[i]);
        }
        let order: Vec<BlockId> = (0..4)
            .map(|_| {
                let mut s = kv.new_seq();
                assert!(kv.allocate(&mut s, &PrefixMatch::default(), 10));
                s.blocks[0]
            })
            .collect();
        assert_eq!(
            order,
            vec![0, 2, 3, 1],
            "never used, then freed first to last"
        );
    }

    #[test]
    fn without_reuse_slots_go_lowest_id_first_and_find_nothing() {
        let mut kv = ContiguousKv::new(4 * 64, 64, false);
        let a: Vec<u32> = (0..40).collect();
        let (hit, slot) = run(&mut kv, &a);
        assert_eq!((hit, slot), (PrefixMatch::default(), 0));
        let (hit, slot) = run(&mut kv, &a);
        assert_eq!((hit, slot), (PrefixMatch::default(), 0));
        assert!(kv.tokens.is_empty(), "no tokens are kept");
    }
}
