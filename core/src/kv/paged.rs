//! Paged KV: a pool of `num_blocks` blocks of `block_size` tokens, with block tables.
//!
//! Every block nobody references sits in one LRU queue ([`FreeQueue`]), cached or not.
//! Allocation pops the front; if that block was cached, it is evicted then. So a full
//! cache never makes allocation fail while unreferenced blocks exist — the benchmark log's
//! "Cannot allocate 1 blocks: only 0 free" cannot happen.
//!
//! Prefix caching (vLLM's scheme): a full, computed block is registered under the chained
//! hash of its parent's hash and its tokens. A later prompt that starts with the same
//! tokens finds those blocks, takes a reference on them and skips their computation.
//! A match also compares a second, independent 32-bit hash of the parent's hash and the
//! block's tokens, so a wrong match needs a 64-bit and an unrelated 32-bit collision at
//! once (vLLM trusts one hash); the index is one 16-byte table entry per block, which
//! keeps a lookup to one memory access (a cluster simulation holds hundreds of these pools).
//!
//! The same tokens computed twice leave two blocks of one content: two prompts of one
//! prefix admitted in the same step, before either was computed, and routinely the last
//! full block of a prompt sent again (a lookup never covers a prompt's last token, so that
//! block is computed anew). As in vLLM V1, whose `BlockHashToBlockMap` keeps every block of
//! a hash, the second is registered too, as a spare: lookups find the first, and when the
//! first is evicted a spare takes its place, so the content stays cached while any block
//! holds it.

use super::BrokenInvariant;
use rustc_hash::FxHashMap;

use super::events::EventLog;
use super::free_queue::FreeQueue;
use super::hash::block_check;
use super::{
    blocks_for, hash_block, BlockId, DroppedBlocks, KvEvent, KvManager, PrefixMatch, SeqKv,
    ROOT_HASH,
};
use std::sync::Arc;

/// What the prefix-cache index knows of a registered block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CachedBlock {
    block: BlockId,
    /// [`block_check`] of its parent and tokens.
    check: u32,
}

#[derive(Debug, Clone)]
pub struct PagedKv {
    block_size: usize,
    num_blocks: usize,
    refs: Vec<u32>,
    free: FreeQueue,
    prefix_caching: bool,
    /// hash → the block registered under it.
    cached: FxHashMap<u64, CachedBlock>,
    /// hash → the other blocks holding that block's content (registered, not found by
    /// lookups until the block in `cached` is evicted).
    spares: FxHashMap<u64, Vec<BlockId>>,
    /// Per block: its index in its hash's `spares` list, when it is a spare (so an evicted
    /// spare leaves its list at once, however many share its content).
    spare_at: Vec<u32>,
    /// Changes of `cached` so far (see [`KvManager::lookup_version`]).
    cached_changes: u64,
    /// Per block: `cached_changes` as it was registered (an earlier lookup's block still
    /// holds what that lookup matched if it has not been registered again since).
    registered_at: Vec<u64>,
    /// Per block: the hash it is registered under.
    block_hash: Vec<Option<u64>>,
    /// The cache's events, when a driver publishes them.
    events: Option<EventLog>,
    /// Allocations dropped still holding blocks (see [`SeqKv`]).
    dropped: Arc<DroppedBlocks>,
}

impl PagedKv {
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        assert!(block_size > 0 && num_blocks > 0);
        PagedKv {
            block_size,
            num_blocks,
            refs: vec![0; num_blocks],
            free: FreeQueue::full(num_blocks),
            prefix_caching,
            cached: FxHashMap::default(),
            spares: FxHashMap::default(),
            spare_at: vec![0; if prefix_caching { num_blocks } else { 0 }],
            cached_changes: 0,
            registered_at: vec![0; if prefix_caching { num_blocks } else { 0 }],
            block_hash: vec![None; if prefix_caching { num_blocks } else { 0 }],
            events: None,
            dropped: Arc::default(),
        }
    }

    /// Contents currently in the prefix cache (held or evictable), each counted once
    /// however many blocks hold it.
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// The cached block holding `tokens` after `parent`, if any.
    fn find(&self, parent: u64, hash: u64, tokens: &[u32]) -> Option<BlockId> {
        let e = self.cached.get(&hash)?;
        (e.check == block_check(parent, tokens)).then_some(e.block)
    }

    /// Go on matching `tokens` block by block past the blocks `m` holds (see
    /// [`KvManager::lookup_prefix`]).
    fn extend_prefix(&self, tokens: &[u32], m: &mut PrefixMatch) {
        let max_blocks = if self.prefix_caching {
            tokens.len().saturating_sub(1) / self.block_size
        } else {
            0
        };
        let mut parent = m.hashes.last().copied().unwrap_or(ROOT_HASH);
        for chunk in tokens
            .chunks_exact(self.block_size)
            .take(max_blocks)
            .skip(m.blocks.len())
        {
            let h = hash_block(parent, chunk);
            match self.find(parent, h, chunk) {
                Some(b) => {
                    m.blocks.push(b);
                    m.hashes.push(h);
                    parent = h;
                }
                None => break,
            }
        }
        m.tokens = m.blocks.len() * self.block_size;
    }

    fn take_free_block(&mut self) -> BlockId {
        let b = self.free.pop_front().expect("checked free count");
        if self.prefix_caching {
            if let Some(h) = self.block_hash[b as usize].take() {
                self.unregister(b, h);
            }
        }
        self.refs[b as usize] = 1;
        b
    }

    /// Block `b`, registered under `h`, is evicted: a spare of its content takes its place
    /// in the index (the content stays cached: no event), else the content leaves it.
    fn unregister(&mut self, b: BlockId, h: u64) {
        let Some(entry) = self.cached.get_mut(&h) else {
            return;
        };
        if entry.block != b {
            // A spare: lookups never found it.
            if let Some(spares) = self.spares.get_mut(&h) {
                let i = self.spare_at[b as usize] as usize;
                debug_assert_eq!(spares[i], b);
                spares.swap_remove(i);
                if let Some(&moved) = spares.get(i) {
                    self.spare_at[moved as usize] = i as u32;
                }
                if spares.is_empty() {
                    self.spares.remove(&h);
                }
            }
            return;
        }
        // Every change of a hash's block is a new version: a lookup that holds `b` must
        // not pass as current.
        self.cached_changes += 1;
        if let Some(spares) = self.spares.get_mut(&h) {
            let spare = spares.pop().expect("no empty spare lists are kept");
            if spares.is_empty() {
                self.spares.remove(&h);
            }
            entry.block = spare;
            self.registered_at[spare as usize] = self.cached_changes;
            return;
        }
        self.cached.remove(&h);
        if let Some(log) = &mut self.events {
            log.removed(h);
        }
    }
}

impl KvManager for PagedKv {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn num_free_blocks(&self) -> usize {
        self.free.len()
    }

    fn lookup_prefix(&self, tokens: &[u32]) -> PrefixMatch {
        let mut m = PrefixMatch::default();
        self.extend_prefix(tokens, &mut m);
        m
    }

    fn lookup_version(&self) -> Option<u64> {
        Some(self.cached_changes)
    }

    fn update_prefix(&self, tokens: &[u32], found: &mut PrefixMatch, since: Option<u64>) {
        let Some(since) = since else {
            *found = self.lookup_prefix(tokens);
            return;
        };
        if since == self.cached_changes {
            // Nothing registered or removed since: only tokens added can match more.
            self.extend_prefix(tokens, found);
            return;
        }
        // The blocks found then that still hold the registration they matched (registered
        // no later than `since`: a block is only registered again after its removal, and a
        // spare is dated when promoted) match again, as far as the first that does not; the
        // lookup goes on from there. (Under the same hash alone a block registered
        // again could hold other tokens, where the 32-bit check would have refused it.)
        let still = found
            .blocks
            .iter()
            .zip(&found.hashes)
            .take_while(|&(&b, &h)| {
                self.block_hash[b as usize] == Some(h) && self.registered_at[b as usize] <= since
            })
            .count();
        found.blocks.truncate(still);
        found.hashes.truncate(still);
        self.extend_prefix(tokens, found);
    }

    fn allocate(&mut self, kv: &mut SeqKv, prefix: &PrefixMatch, num_tokens: usize) -> bool {
        let reuse = if kv.blocks.is_empty() {
            prefix
        } else {
            &PrefixMatch::default()
        };
        let held = kv.blocks.len() + reuse.blocks.len();
        let needed = blocks_for(num_tokens, self.block_size).saturating_sub(held);
        // Reused blocks nobody holds leave the free queue when we take them.
        let reused_free = reuse
            .blocks
            .iter()
            .filter(|&&b| self.refs[b as usize] == 0)
            .count();
        if needed > self.free.len() - reused_free {
            return false;
        }
        for &b in &reuse.blocks {
            if self.refs[b as usize] == 0 {
                self.free.remove(b);
            }
            self.refs[b as usize] += 1;
        }
        kv.blocks.extend_from_slice(&reuse.blocks);
        kv.hashes.extend_from_slice(&reuse.hashes);
        for _ in 0..needed {
            let b = self.take_free_block();
            kv.blocks.push(b);
        }
        true
    }

    fn commit(&mut self, kv: &mut SeqKv, tokens: &[u32], num_computed: usize) {
        if !self.prefix_caching {
            return;
        }
        let full = num_computed / self.block_size;
        while kv.hashes.len() < full {
            let i = kv.hashes.len();
            let parent = kv.hashes.last().copied().unwrap_or(ROOT_HASH);
            let chunk = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let h = hash_block(parent, chunk);
            kv.hashes.push(h);
            let b = kv.blocks[i];
            if self.block_hash[b as usize].is_some() {
                continue; // found by a lookup: registered already
            }
            // Registered only under a registered parent: the parent's own content check
            // vouches for the chain. A parent left out (other content under its hash, or
            // cleared by a reset) leaves its descendants out, or a lookup of the other
            // content's prefix would match them on the shared 64-bit parent hash alone.
            if i > 0 && self.block_hash[kv.blocks[i - 1] as usize] != Some(parent) {
                continue;
            }
            let check = block_check(parent, chunk);
            match self.cached.entry(h) {
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(CachedBlock { block: b, check });
                    self.cached_changes += 1;
                    self.block_hash[b as usize] = Some(h);
                    self.registered_at[b as usize] = self.cached_changes;
                    if let Some(log) = &mut self.events {
                        log.stored(h, (i > 0).then_some(parent), chunk);
                    }
                }
                // The same content computed again: a spare, announced with the first.
                std::collections::hash_map::Entry::Occupied(e) if e.get().check == check => {
                    let spares = self.spares.entry(h).or_default();
                    self.spare_at[b as usize] = spares.len() as u32;
                    spares.push(b);
                    self.block_hash[b as usize] = Some(h);
                    // Not what a lookup finds (until promoted, which dates it): no lookup
                    // made before may take it as current.
                    self.registered_at[b as usize] = u64::MAX;
                }
                // Other content under the same 64-bit hash: left out of the cache.
                std::collections::hash_map::Entry::Occupied(_) => {}
            }
        }
    }

    fn free(&mut self, kv: &mut SeqKv) {
        // Tail blocks first: they are the least likely to be shared, so evict them first.
        for &b in kv.blocks.iter().rev() {
            let r = &mut self.refs[b as usize];
            // An underflow would hand a live block to another sequence: an error in every
            // build.
            assert!(*r > 0, "block {b} freed with no reference");
            *r -= 1;
            if *r == 0 {
                self.free.push_back(b);
            }
        }
        kv.blocks.clear();
        kv.hashes.clear();
    }

    fn dropped_blocks(&self) -> &Arc<DroppedBlocks> {
        &self.dropped
    }

    fn total_refs(&self) -> usize {
        self.refs.iter().map(|&r| r as usize).sum()
    }

    /// Refused while any block is in use, as vLLM refuses it: a running sequence's blocks
    /// (spares of freed content among them) would otherwise be registered again under
    /// parents the reset announced cleared.
    fn reset_prefix_cache(&mut self) -> bool {
        if self.refs.iter().any(|&r| r > 0) {
            return false;
        }
        self.cached.clear();
        self.spares.clear();
        self.cached_changes += 1;
        self.block_hash.iter_mut().for_each(|h| *h = None);
        if let Some(log) = &mut self.events {
            log.cleared();
        }
        true
    }

    fn record_events(&mut self) {
        if self.prefix_caching {
            self.events.get_or_insert_with(EventLog::default);
        }
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map_or_else(Vec::new, EventLog::take)
    }

    fn refs(&self, block: BlockId) -> usize {
        self.refs[block as usize] as usize
    }

    fn check(&self) -> Result<(), BrokenInvariant> {
        let walked = self.free.walk();
        if walked.len() != self.free.len() {
            return Err(BrokenInvariant::new(
                3,
                format!(
                    "the free queue links {} blocks but counts {}",
                    walked.len(),
                    self.free.len()
                ),
            ));
        }
        let mut queued = vec![false; self.num_blocks];
        for &b in &walked {
            if std::mem::replace(&mut queued[b as usize], true) {
                return Err(BrokenInvariant::new(
                    3,
                    format!("block {b} is in the free queue twice"),
                ));
            }
        }
        for (b, &q) in queued.iter().enumerate() {
            let r = self.refs[b];
            if (r == 0) != q || self.free.contains(b as BlockId) != q {
                return Err(BrokenInvariant::new(
                    3,
                    format!(
                        "block {b}: {r} references but {}in the free queue",
                        if q { "" } else { "not " }
                    ),
                ));
            }
        }
        if self.prefix_caching {
            for (&h, e) in &self.cached {
                let b = e.block;
                if self.block_hash[b as usize] != Some(h) {
                    return Err(BrokenInvariant::new(
                        8,
                        format!(
                            "cache entry {h:x} points at block {b}, which is not registered under it"
                        ),
                    ));
                }
            }
            let mut spares = 0;
            for (&h, blocks) in &self.spares {
                let Some(e) = self.cached.get(&h) else {
                    return Err(BrokenInvariant::new(
                        8,
                        format!("spares of {h:x}, which has no cache entry"),
                    ));
                };
                if blocks.is_empty() {
                    return Err(BrokenInvariant::new(
                        8,
                        format!("an empty list of spares of {h:x}"),
                    ));
                }
                for (i, &b) in blocks.iter().enumerate() {
                    if b == e.block
                        || self.block_hash[b as usize] != Some(h)
                        || self.spare_at[b as usize] as usize != i
                    {
                        return Err(BrokenInvariant::new(
                            8,
                            format!("block {b}, a spare of {h:x}, is not registered as one"),
                        ));
                    }
                }
                spares += blocks.len();
            }
            let registered = self.block_hash.iter().flatten().count();
            if registered != self.cached.len() + spares {
                return Err(BrokenInvariant::new(
                    8,
                    format!(
                        "{registered} blocks registered but {} cache entries and {spares} \
                         spares",
                        self.cached.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    fn cached_prefix_blocks(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq_tokens(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn allocates_block_tables_and_frees_everything() {
        let mut kv = PagedKv::new(8, 4, false);
        let mut a = kv.new_seq();
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 9));
        assert_eq!(a.blocks.len(), 3);
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 12));
        assert_eq!(a.blocks.len(), 3);
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 13));
        assert_eq!(a.blocks.len(), 4);
        let mut b = kv.new_seq();
        assert!(
            !kv.allocate(&mut b, &PrefixMatch::default(), 17),
            "needs 5, 4 free"
        );
        assert!(b.blocks.is_empty());
        kv.free(&mut a);
        assert_eq!(kv.num_free_blocks(), 8);
        assert_eq!(kv.total_refs(), 0);
    }

    #[test]
    fn prefix_hit_reuses_blocks_but_never_the_last_token() {
        let mut kv = PagedKv::new(16, 4, true);
        let prompt = seq_tokens(12, 1);
        let mut a = kv.new_seq();
        assert_eq!(kv.lookup_prefix(&prompt).blocks.len(), 0);
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 12));
        kv.commit(&mut a, &prompt, 12);
        assert_eq!(kv.num_cached_blocks(), 3);

        // Same 12-token prompt: the third block holds the last token, so only 2 blocks hit.
        let m = kv.lookup_prefix(&prompt);
        assert_eq!(m.blocks, a.blocks[..2].to_vec());
        // A longer prompt with the same start hits all three.
        let mut longer = prompt.clone();
        longer.extend([99, 98]);
        let m = kv.lookup_prefix(&longer);
        assert_eq!(m.tokens, 12);
        let mut b = kv.new_seq();
        assert!(kv.allocate(&mut b, &m, 14));
        assert_eq!(&b.blocks[..3], &a.blocks[..]);
        assert_eq!(kv.num_free_blocks(), 16 - 4);
        kv.free(&mut a);
        kv.free(&mut b);
        assert_eq!(kv.total_refs(), 0);
        assert_eq!(kv.num_free_blocks(), 16);
        // Freed blocks keep their content: still a hit.
        assert_eq!(kv.lookup_prefix(&longer).blocks.len(), 3);
    }

    /// A prompt's blocks are announced as one chain when computed (in two commits: the
    /// second chain names the first's last block as parent), a duplicate of cached content
    /// is not announced, and an evicted block is announced removed when its slot is reused.
    #[test]
    fn records_stored_chains_and_evictions_as_vllm_announces_them() {
        let mut kv = PagedKv::new(4, 4, true);
        let mut a = kv.new_seq();
        let prompt = seq_tokens(12, 1);
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 12));
        kv.commit(&mut a, &prompt, 4);
        assert!(kv.take_events().is_empty(), "not recording yet");
        kv.record_events();
        kv.commit(&mut a, &prompt, 12);
        let h = a.hashes.clone();
        assert_eq!(
            kv.take_events(),
            vec![KvEvent::Stored {
                hashes: vec![h[1], h[2]],
                parent: Some(h[0]),
                token_ids: prompt[4..12].to_vec(),
                block_size: 4,
            }]
        );
        // The same tokens computed again in other blocks: a spare, no event.
        let mut b = kv.new_seq();
        assert!(kv.allocate(&mut b, &PrefixMatch::default(), 4));
        kv.commit(&mut b, &prompt, 4);
        assert!(kv.take_events().is_empty());
        // Freed, a's blocks stay cached until reused; taking all four evicts its three.
        kv.free(&mut a);
        kv.free(&mut b);
        let mut c = kv.new_seq();
        assert!(kv.allocate(&mut c, &PrefixMatch::default(), 16));
        let KvEvent::Removed { hashes } = &kv.take_events()[0] else {
            panic!("expected a removal");
        };
        let mut removed = hashes.clone();
        removed.sort_unstable();
        let mut all = h.clone();
        all.sort_unstable();
        assert_eq!(removed, all);
        assert_eq!(kv.num_cached_blocks(), 0);
    }

    /// Two prompts of one prefix admitted in the same step, before either was computed,
    /// hold the same content in two blocks. When the registered block is evicted, the other
    /// is found in its place (vLLM V1 keeps every block of a hash), and the content leaves
    /// the cache, announced, only with the last block that holds it.
    #[test]
    fn content_computed_twice_stays_cached_while_a_block_holds_it() {
        let mut kv = PagedKv::new(6, 4, true);
        kv.record_events();
        let prompt = seq_tokens(9, 1); // two full blocks and one token
        let (mut a, mut b) = (kv.new_seq(), kv.new_seq());
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 9));
        assert!(kv.allocate(&mut b, &PrefixMatch::default(), 9));
        kv.commit(&mut a, &prompt, 9);
        kv.commit(&mut b, &prompt, 9);
        kv.check().unwrap();
        assert_eq!(kv.num_cached_blocks(), 2);
        let stored = kv.take_events();
        assert_eq!(stored.len(), 1, "announced once: {stored:?}");
        assert_eq!(kv.lookup_prefix(&prompt).blocks, a.blocks[..2]);
        let (a_blocks, b_blocks, hashes) = (a.blocks.clone(), b.blocks.clone(), a.hashes.clone());
        // a's blocks are freed first, so evicted first: b's take their place, unannounced.
        kv.free(&mut a);
        kv.free(&mut b);
        let mut c = kv.new_seq();
        assert!(kv.allocate(&mut c, &PrefixMatch::default(), 12));
        assert_eq!(c.blocks, vec![a_blocks[2], a_blocks[1], a_blocks[0]]);
        kv.check().unwrap();
        assert!(kv.take_events().is_empty());
        assert_eq!(kv.lookup_prefix(&prompt).blocks, b_blocks[..2]);
        // The last blocks holding it evicted, the content is gone, and announced so.
        let mut d = kv.new_seq();
        assert!(kv.allocate(&mut d, &PrefixMatch::default(), 12));
        kv.check().unwrap();
        assert_eq!(kv.num_cached_blocks(), 0);
        assert!(kv.lookup_prefix(&prompt).blocks.is_empty());
        assert_eq!(
            kv.take_events(),
            vec![KvEvent::Removed {
                hashes: vec![hashes[1], hashes[0]]
            }]
        );
    }

    /// Many blocks of one content: a spare evicted from the middle of its list leaves it,
    /// and the others stay registered and take the first's place in turn.
    #[test]
    fn spares_leave_their_list_from_anywhere() {
        let mut kv = PagedKv::new(8, 4, true);
        let prompt = seq_tokens(8, 5);
        let mut seqs: Vec<SeqKv> = (0..3).map(|_| kv.new_seq()).collect();
        for s in &mut seqs {
            assert!(kv.allocate(s, &PrefixMatch::default(), 8));
        }
        for s in &mut seqs {
            kv.commit(s, &prompt, 8);
        }
        kv.check().unwrap();
        let blocks: Vec<Vec<BlockId>> = seqs.iter().map(|s| s.blocks.clone()).collect();
        let mut probe = prompt.clone();
        probe.push(1);
        // The middle sequence's blocks (spares) are evicted first.
        kv.free(&mut seqs[1]);
        let mut d = kv.new_seq();
        assert!(kv.allocate(&mut d, &PrefixMatch::default(), 16));
        assert!(d.blocks.contains(&blocks[1][0]) && d.blocks.contains(&blocks[1][1]));
        kv.check().unwrap();
        assert_eq!(kv.lookup_prefix(&probe).blocks, blocks[0]);
        // Then the first's: the last sequence's blocks are found in their place.
        kv.free(&mut seqs[0]);
        let mut e = kv.new_seq();
        assert!(kv.allocate(&mut e, &PrefixMatch::default(), 8));
        kv.check().unwrap();
        assert_eq!(kv.lookup_prefix(&probe).blocks, blocks[2]);
        assert_eq!(kv.num_cached_blocks(), 2);
    }

    /// A block whose hash other content holds (a 64-bit collision) is left out of the cache,
    /// and so are its descendants: registered under its hash as parent, a lookup of the other
    /// content's prefix would match them on that hash alone.
    #[test]
    fn a_block_left_out_for_a_hash_collision_leaves_its_descendants_out() {
        let mut kv = PagedKv::new(8, 4, true);
        kv.record_events();
        let prompt = seq_tokens(12, 1);
        let h0 = hash_block(ROOT_HASH, &prompt[..4]);
        let other = block_check(ROOT_HASH, &prompt[..4]) ^ 1;
        kv.cached.insert(
            h0,
            CachedBlock {
                block: 7,
                check: other,
            },
        );
        let mut a = kv.new_seq();
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 12));
        kv.commit(&mut a, &prompt, 12);
        assert_eq!(kv.take_events(), vec![], "nothing stored");
        assert_eq!(kv.cached.len(), 1, "only the other content's entry");
        assert!(a
            .blocks
            .iter()
            .all(|&b| kv.block_hash[b as usize].is_none()));
    }

    /// `reset_prefix_cache` is refused while a sequence holds a cached block; once none
    /// does, nothing is found any more and the reset is announced.
    #[test]
    fn a_prefix_cache_reset_waits_for_its_blocks_to_be_free() {
        let mut kv = PagedKv::new(8, 4, true);
        kv.record_events();
        let prompt = seq_tokens(12, 1);
        let mut a = kv.new_seq();
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 12));
        kv.commit(&mut a, &prompt, 12);
        kv.take_events();
        assert!(!kv.reset_prefix_cache(), "a's blocks are in use");
        assert_eq!(kv.num_cached_blocks(), 3);
        kv.free(&mut a);
        assert!(kv.reset_prefix_cache());
        assert_eq!(kv.num_cached_blocks(), 0);
        assert!(kv.lookup_prefix(&prompt).blocks.is_empty());
        assert_eq!(kv.take_events(), vec![KvEvent::AllCleared]);
        kv.check().unwrap();
    }

    #[test]
    fn check_catches_a_referenced_free_block_and_a_broken_cache_index() {
        let mut kv = PagedKv::new(8, 4, true);
        let mut a = kv.new_seq();
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 8));
        kv.commit(&mut a, &seq_tokens(8, 1), 8);
        kv.check().unwrap();
        let mut bad = kv.clone();
        bad.refs[a.blocks[0] as usize] = 0; // held, yet not in the free queue
        let e = bad.check().unwrap_err();
        assert!(
            e.0.starts_with("INV-3: ") && e.0.contains("references"),
            "{e}"
        );
        let mut bad = kv.clone();
        bad.free.push_back(a.blocks[1]); // in the free queue, yet referenced
        assert!(bad.check().is_err());
        let mut bad = kv.clone();
        bad.block_hash[a.blocks[0] as usize] = None; // cached entry without its block
        let e = bad.check().unwrap_err();
        assert!(e.0.starts_with("INV-8: "), "{e}");
    }

    #[test]
    #[should_panic(expected = "freed with no reference")]
    fn a_double_free_is_an_error_in_every_build() {
        let mut kv = PagedKv::new(8, 4, false);
        let mut a = kv.new_seq();
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 8));
        let mut again = kv.new_seq();
        again.blocks = a.blocks.clone();
        kv.free(&mut a);
        kv.free(&mut again);
    }

    #[test]
    fn an_allocation_dropped_without_a_free_gives_its_blocks_back() {
        let mut kv = PagedKv::new(8, 4, true);
        let tokens = seq_tokens(12, 3);
        let mut a = kv.new_seq();
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 12));
        kv.commit(&mut a, &tokens, 12);
        let mut b = kv.new_seq();
        let hit = kv.lookup_prefix(&tokens);
        assert_eq!(hit.blocks.len(), 2, "the last token is always computed");
        assert!(kv.allocate(&mut b, &hit, 12)); // a's first two blocks, one of its own
        assert_eq!(kv.num_free_blocks(), 4);
        drop(a); // the bug: no free
        assert_eq!(
            kv.num_free_blocks(),
            4,
            "taken back at the next step, not before"
        );
        kv.reclaim_dropped();
        assert_eq!(
            kv.num_free_blocks(),
            5,
            "a's own block is back; b holds the shared ones"
        );
        kv.check().unwrap();
        drop(b);
        kv.reclaim_dropped();
        assert_eq!(kv.num_free_blocks(), 8);
        assert_eq!(kv.total_refs(), 0);
        kv.check().unwrap();
        // The cached prefix survives as evictable blocks, as after a normal free.
        assert_eq!(kv.lookup_prefix(&tokens).blocks.len(), 2);
    }

    proptest::proptest! {
        /// A lookup brought up to date (`update_prefix`) answers as a fresh one, whatever
        /// was registered, evicted or reset since, and as the tokens looked up grow.
        #[test]
        fn an_updated_lookup_answers_as_a_fresh_one(
            ops in proptest::collection::vec(
                (0u8..4, 0usize..6, 1usize..14, proptest::bool::ANY),
                1..60,
            ),
        ) {
            // Prompts over a two-letter alphabet and a 2-token block share prefixes often;
            // a 6-block pool evicts often.
            let prompt = |seed: usize, len: usize| -> Vec<u32> {
                (0..len).map(|i| ((seed >> (i % 3)) & 1) as u32).collect()
            };
            let mut kv = PagedKv::new(6, 2, true);
            let mut running: Vec<SeqKv> = Vec::new();
            let mut probes: Vec<(Vec<u32>, PrefixMatch, Option<u64>)> = (0..6)
                .map(|seed| (prompt(seed, 3), kv.lookup_prefix(&prompt(seed, 3)), kv.lookup_version()))
                .collect();
            for (op, seed, len, look) in ops {
                match op {
                    0 => {
                        // A prompt runs: it takes its cached prefix and registers the rest.
                        let tokens = prompt(seed, len);
                        let hit = kv.lookup_prefix(&tokens);
                        let mut seq = kv.new_seq();
                        if kv.allocate(&mut seq, &hit, len) {
                            kv.commit(&mut seq, &tokens, len);
                            running.push(seq);
                        }
                    }
                    1 if !running.is_empty() => {
                        let mut seq = running.remove(seed % running.len());
                        kv.free(&mut seq);
                    }
                    2 => {
                        let _ = kv.reset_prefix_cache();
                    }
                    _ => {
                        // A waiting prompt grows (a preempted sequence's output).
                        let probe = &mut probes[seed];
                        let more = prompt(seed, probe.0.len() + len);
                        probe.0 = more;
                    }
                }
                kv.check().unwrap();
                if !look {
                    continue; // several changes, and growth, before the next update
                }
                for (tokens, found, since) in &mut probes {
                    kv.update_prefix(tokens, found, *since);
                    *since = kv.lookup_version();
                    proptest::prop_assert_eq!(&*found, &kv.lookup_prefix(tokens));
                }
            }
        }
    }

    #[test]
    fn different_prefix_does_not_hit() {
        let mut kv = PagedKv::new(16, 4, true);
        let p = seq_tokens(8, 1);
        let mut a = kv.new_seq();
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 8));
        kv.commit(&mut a, &p, 8);
        let mut q = p.clone();
        q[0] += 1;
        q.push(5);
        assert!(kv.lookup_prefix(&q).blocks.is_empty());
    }

    #[test]
    fn full_cache_evicts_lru_instead_of_failing() {
        let mut kv = PagedKv::new(4, 4, true);
        // Fill the whole pool with cached content, then release it.
        let old = seq_tokens(16, 3);
        let mut a = kv.new_seq();
        assert!(kv.allocate(&mut a, &PrefixMatch::default(), 16));
        kv.commit(&mut a, &old, 16);
        kv.free(&mut a);
        assert_eq!(kv.num_cached_blocks(), 4);
        // A new sequence still gets every block: cached ones are evicted, tail first.
        let mut b = kv.new_seq();
        assert!(kv.allocate(&mut b, &PrefixMatch::default(), 4));
        assert_eq!(kv.num_cached_blocks(), 3);
        let mut probe = old.clone();
        probe.push(0);
        assert_eq!(
            kv.lookup_prefix(&probe).blocks.len(),
            3,
            "head blocks survive"
        );
        assert!(kv.allocate(&mut b, &PrefixMatch::default(), 16));
        assert_eq!(kv.num_cached_blocks(), 0);
        assert_eq!(kv.num_free_blocks(), 0);
    }
}
