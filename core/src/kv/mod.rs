//! Where each sequence's KV lives. Two managers behind one trait:
//!
//! * [`ContiguousKv`]: each sequence reserves a whole `max_model_len` slot; a slot is
//!   represented as a single block whose size is `max_model_len`, so the engine reads both
//!   backends through the same block-table code. With prefix caching a free slot keeps the
//!   tokens it last held, and a prompt reuses the longest common prefix of one slot's (as
//!   llama.cpp's server does).
//! * [`PagedKv`]: a pool of fixed-size blocks with block tables, optionally with prefix
//!   caching (content-addressed full blocks, LRU eviction of unreferenced cached blocks).

mod contiguous;
mod events;
mod free_queue;
mod hash;
mod paged;

use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};

pub use contiguous::ContiguousKv;
pub use events::KvEvent;
pub use hash::{hash_block, ROOT_HASH};
pub use paged::PagedKv;

/// Index of a block in the pool (or of a slot, for the contiguous backend).
pub type BlockId = u32;

/// One sequence's KV placement: owned by the sequence, made by [`KvManager::new_seq`] and
/// edited only by that manager. It owns its blocks: dropped while still holding them (a
/// `free` forgotten on some path), it hands them back to its manager, which takes them at
/// the next step ([`KvManager::reclaim_dropped`]) — TGI's `BlockAllocation` does the same —
/// so a missing free cannot leak the pool.
#[derive(Debug)]
pub struct SeqKv {
    /// The block table: block `i` holds token positions `i * block_size ..`.
    pub blocks: Vec<BlockId>,
    /// Chained hashes of this sequence's full, computed blocks, in order (prefix caching only).
    pub hashes: Vec<u64>,
    dropped: Arc<DroppedBlocks>,
}

impl SeqKv {
    fn new(dropped: &Arc<DroppedBlocks>) -> SeqKv {
        SeqKv {
            blocks: Vec::new(),
            hashes: Vec::new(),
            dropped: dropped.clone(),
        }
    }
}

impl Drop for SeqKv {
    fn drop(&mut self) {
        if !self.blocks.is_empty() {
            self.dropped.push(std::mem::take(&mut self.blocks));
        }
    }
}

/// Block tables of allocations dropped without a free, waiting for their manager. Shared
/// by a manager and every allocation it made; the engine's allocations may be dropped on
/// another thread than the one stepping the manager, hence the lock (taken only on such
/// a drop, never on a correct path).
#[derive(Debug, Default)]
pub struct DroppedBlocks {
    pending: AtomicBool,
    tables: Mutex<Vec<Vec<BlockId>>>,
}

impl DroppedBlocks {
    fn push(&self, table: Vec<BlockId>) {
        let mut tables = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        tables.push(table);
        self.pending.store(true, AtomicOrdering::Release);
    }

    /// The tables dropped since the last call (none, nearly always: one atomic load).
    fn take(&self) -> Vec<Vec<BlockId>> {
        if !self.pending.swap(false, AtomicOrdering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.tables.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Cached KV that holds a prefix of a prompt, found by [`KvManager::lookup_prefix`]: the
/// blocks holding it (a paged pool's full blocks; a contiguous pool's one slot) and how many
/// of the prompt's tokens they hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    pub blocks: Vec<BlockId>,
    pub hashes: Vec<u64>,
    /// The prompt's tokens found: whole blocks in a paged pool, any count in a slot.
    pub tokens: usize,
}

/// A broken invariant of the KV manager or the scheduler: a bug, described. The message
/// starts with the invariant's number in `docs/design.md` (`INV-3: …`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BrokenInvariant(pub String);

impl BrokenInvariant {
    /// Invariant `INV-{number}` of `docs/design.md` does not hold: `what` says where.
    pub fn new(number: u8, what: impl std::fmt::Display) -> Self {
        BrokenInvariant(format!("INV-{number}: {what}"))
    }
}

/// The KV-memory policy the scheduler drives. All methods are deterministic.
pub trait KvManager {
    /// Tokens per block (`max_model_len` for contiguous slots).
    fn block_size(&self) -> usize;
    /// Blocks (or slots) in the pool.
    fn num_blocks(&self) -> usize;
    /// Blocks no sequence holds, cached ones included: free + used = total.
    fn num_free_blocks(&self) -> usize;
    /// Fraction of the pool held by sequences, as `vllm:kv_cache_usage_perc` reports it.
    fn usage(&self) -> f64 {
        1.0 - self.num_free_blocks() as f64 / self.num_blocks() as f64
    }
    /// Tokens the pool can hold in all.
    fn capacity_tokens(&self) -> usize {
        self.num_blocks() * self.block_size()
    }
    /// The longest cached prefix of `tokens` (a paged pool's run of full blocks; the slot
    /// whose last tokens share the most), never covering the last token (its logits must be
    /// computed). Changes nothing.
    fn lookup_prefix(&self, tokens: &[u32]) -> PrefixMatch;
    /// The prefix index's version, where the manager keeps one: it changes whenever what a
    /// lookup finds changes (a block registered or evicted, or another block of the same
    /// content found in its place), so a lookup made at a version holds until it changes.
    /// `None`: every lookup must be made again.
    fn lookup_version(&self) -> Option<u64> {
        None
    }
    /// [`KvManager::lookup_prefix`] of `tokens` again, given `found`, its answer for the
    /// same tokens or fewer (`tokens` begins with them) when the index was at version
    /// `since`: a manager may bring that answer up to date rather than start over (a
    /// waiting prompt is looked up every step). The answer is the same either way.
    fn update_prefix(&self, tokens: &[u32], found: &mut PrefixMatch, since: Option<u64>) {
        let _ = since;
        *found = self.lookup_prefix(tokens);
    }
    /// Make `kv` hold enough blocks for positions `0..num_tokens`. For a sequence that holds
    /// nothing yet, `prefix` (from `lookup_prefix`) is reused first. On failure nothing changes.
    fn allocate(&mut self, kv: &mut SeqKv, prefix: &PrefixMatch, num_tokens: usize) -> bool;
    /// The first `num_computed` tokens of `tokens` are now in `kv`: make its newly full blocks
    /// reusable by later requests (prefix caching; a no-op otherwise).
    fn commit(&mut self, kv: &mut SeqKv, tokens: &[u32], num_computed: usize);
    /// Release everything `kv` holds.
    fn free(&mut self, kv: &mut SeqKv);
    /// Where this manager's allocations put their blocks when dropped holding them.
    fn dropped_blocks(&self) -> &Arc<DroppedBlocks>;
    /// A new allocation of this manager, holding nothing.
    fn new_seq(&self) -> SeqKv {
        SeqKv::new(self.dropped_blocks())
    }
    /// Frees the blocks of allocations dropped while still holding them (see [`SeqKv`]),
    /// through `free` as if their sequences had ended; the scheduler calls it before each
    /// step.
    fn reclaim_dropped(&mut self) {
        let dropped = self.dropped_blocks().clone();
        for blocks in dropped.take() {
            let mut seq = SeqKv {
                blocks,
                hashes: Vec::new(),
                dropped: dropped.clone(),
            };
            self.free(&mut seq);
        }
    }
    /// Sum of reference counts over the pool (invariant checks).
    fn total_refs(&self) -> usize;
    /// References to `block`: the sequences whose tables hold it (invariant checks).
    fn refs(&self, block: BlockId) -> usize;
    /// The manager's own invariants, each checked from its own records rather than derived
    /// from another count: a block is free exactly when nobody references it, the free
    /// records agree with each other, and (prefix caching) the cache index agrees with the
    /// blocks registered in it.
    fn check(&self) -> Result<(), BrokenInvariant>;
    /// How many of these chained block hashes, from the first, are cached here
    /// (precise-prefix routing reads this).
    fn cached_prefix_blocks(&self, _hashes: &[u64]) -> usize {
        0
    }
    /// Forget every cached block (vLLM's `reset_prefix_cache`): later prompts find nothing.
    /// Refused (false, nothing changes) while a sequence holds a block, as vLLM refuses it.
    fn reset_prefix_cache(&mut self) -> bool {
        true
    }
    /// From now on, record the prefix cache's [`KvEvent`]s (a pool without prefix caching
    /// has none).
    fn record_events(&mut self) {}
    /// The events recorded since the last call, oldest first.
    fn take_events(&mut self) -> Vec<KvEvent> {
        Vec::new()
    }
}

/// Blocks needed to hold `num_tokens` positions.
pub fn blocks_for(num_tokens: usize, block_size: usize) -> usize {
    num_tokens.div_ceil(block_size)
}
