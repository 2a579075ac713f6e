//! Captured decode graphs, one per batch-size bucket, each bound to the KV pool it was
//! captured against.
//!
//! A CUDA graph freezes its launches' arguments, and a decode step's launches carry the KV
//! pool: every layer's K and V addresses and the pool's block count (the kernels bound block
//! ids by it). Replayed on another pool, a graph reads and writes the pool it was captured on
//! — freed memory, once that pool is dropped (a server once captured its graphs during its
//! memory plan's warm-up, over a scratch pool, and replayed them over the live one). So a
//! graph records its pool, and a replay on any other pool is refused.
//!
//! Host-side bookkeeping only, so it is tested without a GPU; the CUDA backend stores its
//! graphs here.

use std::collections::HashMap;

use anyhow::{bail, Result};

/// What a decode graph freezes of a KV pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPoolId {
    /// Device addresses of every layer's K and V pools, in layer order.
    pub addresses: Vec<u64>,
    pub num_blocks: usize,
    pub block_size: usize,
}

struct Captured<G> {
    graph: G,
    pool: KvPoolId,
}

/// Graphs by bucket.
pub struct GraphSet<G> {
    captured: HashMap<usize, Captured<G>>,
}

impl<G> Default for GraphSet<G> {
    fn default() -> Self {
        Self {
            captured: HashMap::new(),
        }
    }
}

impl<G> GraphSet<G> {
    /// The graph of `bucket` to replay on `pool`; `None` when none is captured yet (capture
    /// one). An error when the bucket's graph was captured against another pool.
    pub fn replay(&self, bucket: usize, pool: &KvPoolId) -> Result<Option<&G>> {
        let Some(c) = self.captured.get(&bucket) else {
            return Ok(None);
        };
        if &c.pool != pool {
            bail!(
                "the CUDA graph of decode bucket {bucket} was captured against another KV pool \
                 ({} blocks of {} at {:#x}) than this step's ({} blocks of {} at {:#x}); \
                 replaying it would read and write the other pool's memory",
                c.pool.num_blocks,
                c.pool.block_size,
                c.pool.addresses.first().copied().unwrap_or(0),
                pool.num_blocks,
                pool.block_size,
                pool.addresses.first().copied().unwrap_or(0),
            );
        }
        Ok(Some(&c.graph))
    }

    /// Records `graph`, captured for `bucket` against `pool`.
    pub fn insert(&mut self, bucket: usize, pool: KvPoolId, graph: G) {
        self.captured.insert(bucket, Captured { graph, pool });
    }

    pub fn len(&self) -> usize {
        self.captured.len()
    }

    pub fn is_empty(&self) -> bool {
        self.captured.is_empty()
    }

    pub fn clear(&mut self) {
        self.captured.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(base: u64, num_blocks: usize) -> KvPoolId {
        KvPoolId {
            addresses: vec![base, base + 0x1000, base + 0x2000, base + 0x3000],
            num_blocks,
            block_size: 16,
        }
    }

    #[test]
    fn a_graph_replays_only_on_the_pool_it_was_captured_against() {
        let mut graphs = GraphSet::default();
        let live = pool(0x7f00_0000, 100);
        assert!(
            graphs.replay(4, &live).unwrap().is_none(),
            "nothing captured"
        );
        graphs.insert(4, live.clone(), "bucket 4");
        assert_eq!(graphs.replay(4, &live).unwrap(), Some(&"bucket 4"));
        // Another bucket is simply not captured yet.
        assert!(graphs.replay(8, &live).unwrap().is_none());

        // The memory plan's scratch pool, dropped, then the live pool allocated elsewhere.
        let elsewhere = pool(0x7e00_0000, 100);
        let e = graphs.replay(4, &elsewhere).unwrap_err().to_string();
        assert!(e.contains("another KV pool"), "{e}");
        // Same addresses, another block count: the kernels' bounds are frozen too.
        assert!(graphs.replay(4, &pool(0x7f00_0000, 200)).is_err());
        // One layer moved.
        let mut moved = live.clone();
        moved.addresses[3] += 0x10;
        assert!(graphs.replay(4, &moved).is_err());

        graphs.clear();
        assert!(graphs.is_empty());
        assert!(graphs.replay(4, &elsewhere).unwrap().is_none());
    }
}
