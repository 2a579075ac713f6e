//! What the prefix cache tells the world: the blocks it registers and evicts, in the order
//! it does so — vLLM's KV-cache events (`BlockStored`, `BlockRemoved`), which routers such
//! as vllm-router's `kv_aware` policy and llm-d's precise-prefix scorer subscribe to in
//! order to see each replica's real cache.
//!
//! The pool records them only when asked ([`super::KvManager::record_events`]); the driver
//! drains them after each step and publishes them (the engine: ZeroMQ, as vLLM does).

/// One change to the set of blocks a prefix lookup can find.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks registered under `hashes`, a chain: each block's parent is the one
    /// before it, the first one's is `parent` (`None`: it starts a prompt). `token_ids` are
    /// the blocks' tokens, `block_size` each.
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
    },
    /// Blocks evicted: a lookup no longer finds these hashes here.
    Removed { hashes: Vec<u64> },
    /// The whole prefix cache was emptied.
    AllCleared,
}

/// Events as the pool records them: consecutive stores of one chain join into one event,
/// as vLLM sends a newly computed run of blocks.
#[derive(Debug, Clone, Default)]
pub(super) struct EventLog {
    events: Vec<KvEvent>,
}

impl EventLog {
    pub(super) fn stored(&mut self, hash: u64, parent: Option<u64>, tokens: &[u32]) {
        if let Some(KvEvent::Stored {
            hashes, token_ids, ..
        }) = self.events.last_mut()
        {
            if parent.is_some() && hashes.last() == parent.as_ref() {
                hashes.push(hash);
                token_ids.extend_from_slice(tokens);
                return;
            }
        }
        self.events.push(KvEvent::Stored {
            hashes: vec![hash],
            parent,
            token_ids: tokens.to_vec(),
            block_size: tokens.len(),
        });
    }

    pub(super) fn removed(&mut self, hash: u64) {
        if let Some(KvEvent::Removed { hashes }) = self.events.last_mut() {
            hashes.push(hash);
            return;
        }
        self.events.push(KvEvent::Removed { hashes: vec![hash] });
    }

    pub(super) fn cleared(&mut self) {
        self.events.push(KvEvent::AllCleared);
    }

    pub(super) fn take(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }
}
