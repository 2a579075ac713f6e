//! Tensor layouts shared by the CPU references and the CUDA kernels.
//!
//! All tensors are dense, row-major, with the shapes written next to each argument. Index
//! arrays (block tables, sequence lengths, positions, slot mappings) are `i32`: the pool has far
//! fewer than 2^31 slots, and the kernels widen to 64 bits before forming element offsets.

/// Shape of one layer's paged K (or V) pool: `[num_blocks, block_size, num_kv_heads, head_dim]`.
///
/// A token's K vectors for all heads are contiguous, so writing one token (reshape_and_cache)
/// is one contiguous copy, and a decode warp reading one head walks `head_dim` contiguous
/// elements per token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheShape {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvCacheShape {
    /// Elements in one pool (K or V).
    pub fn len(&self) -> usize {
        self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Offset of the first element of `(slot, kv_head)`, where `slot = block * block_size + offset`.
    pub fn offset(&self, slot: usize, kv_head: usize) -> usize {
        (slot * self.num_kv_heads + kv_head) * self.head_dim
    }
}

/// What a KV pool's elements are: bf16, or fp8 E4M3 (`--kv-cache-dtype fp8`: unscaled, each
/// bf16 value rounded to nearest even and saturated at ±448 on its way in; read back exactly).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvDtype {
    #[default]
    Bf16,
    Fp8E4m3,
}

impl KvDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
            KvDtype::Fp8E4m3 => 1,
        }
    }
}

/// Per-sequence block tables, `[num_seqs, max_blocks_per_seq]`, entry = physical block index.
/// Entries past a sequence's last block are never read and may hold anything.
#[derive(Clone, Copy, Debug)]
pub struct BlockTables<'a> {
    pub table: &'a [i32],
    pub max_blocks_per_seq: usize,
}

impl BlockTables<'_> {
    /// The pool slot holding token `pos` of sequence `seq`.
    pub fn slot(&self, seq: usize, pos: usize, block_size: usize) -> usize {
        let block = self.table[seq * self.max_blocks_per_seq + pos / block_size];
        block as usize * block_size + pos % block_size
    }

    /// Like [`Self::slot`], but `None` where the kernels skip the key: the logical block lies
    /// past the sequence's row of the table, or the entry is not a block of the pool
    /// (outside `[0, shape.num_blocks)`).
    pub fn slot_checked(&self, seq: usize, pos: usize, shape: &KvCacheShape) -> Option<usize> {
        let logical = pos / shape.block_size;
        if logical >= self.max_blocks_per_seq {
            return None;
        }
        let block = *self.table.get(seq * self.max_blocks_per_seq + logical)?;
        let block = usize::try_from(block)
            .ok()
            .filter(|&b| b < shape.num_blocks)?;
        Some(block * shape.block_size + pos % shape.block_size)
    }
}

/// Attention head configuration of one layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionConfig {
    pub num_heads: usize,
    /// Grouped-query attention: query head `h` reads KV head `h / (num_heads / num_kv_heads)`.
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q·k before the softmax, usually `1/sqrt(head_dim)`.
    pub scale: f32,
    /// Sliding-window attention: a query at position `p` sees keys at `j` with `p - j < window`
    /// (the Mistral/Gemma convention, the query's own token included). `None`: full causal.
    pub sliding_window: Option<usize>,
    /// Logit soft-capping (Gemma 2's `attn_logit_softcapping`): after the scale,
    /// `score = cap * tanh(score / cap)`. `None`: no capping.
    pub softcap: Option<f32>,
}

impl AttentionConfig {
    pub fn new(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        assert!(
            num_kv_heads > 0 && num_heads.is_multiple_of(num_kv_heads),
            "heads must group evenly"
        );
        Self {
            num_heads,
            num_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            sliding_window: None,
            softcap: None,
        }
    }

    pub fn with_sliding_window(mut self, window: usize) -> Self {
        self.sliding_window = Some(window);
        self
    }

    pub fn with_softcap(mut self, cap: f32) -> Self {
        assert!(cap > 0.0, "soft-cap must be positive, got {cap}");
        self.softcap = Some(cap);
        self
    }

    pub fn kv_head(&self, head: usize) -> usize {
        head / (self.num_heads / self.num_kv_heads)
    }

    /// First key position visible to a query at `pos` (the last one is `pos` itself).
    pub fn first_visible(&self, pos: usize) -> usize {
        match self.sliding_window {
            Some(w) if w > 0 => (pos + 1).saturating_sub(w),
            _ => 0,
        }
    }

    /// The window as the kernels take it: 0 means no window.
    pub fn window_arg(&self) -> i32 {
        self.sliding_window.unwrap_or(0) as i32
    }

    /// The soft-cap as the kernels take it: 0 means none.
    pub fn softcap_arg(&self) -> f32 {
        self.softcap.unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_goes_through_the_block_table() {
        let table = [7, 2, 0, 0, 5, 9];
        let tables = BlockTables {
            table: &table,
            max_blocks_per_seq: 3,
        };
        // Sequence 0, token 5 with block_size 4: logical block 1 -> physical 2, offset 1.
        assert_eq!(tables.slot(0, 5, 4), 2 * 4 + 1);
        // Sequence 1, token 0: logical block 0 -> physical 0.
        assert_eq!(tables.slot(1, 0, 4), 0);
        assert_eq!(tables.slot(1, 7, 4), 5 * 4 + 3);
    }

    #[test]
    fn checked_slot_rejects_bad_blocks() {
        let shape = KvCacheShape {
            num_blocks: 8,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 2,
        };
        let table = [7, -1, 8, 3];
        let tables = BlockTables {
            table: &table,
            max_blocks_per_seq: 2,
        };
        assert_eq!(tables.slot_checked(0, 1, &shape), Some(7 * 4 + 1));
        assert_eq!(tables.slot_checked(0, 4, &shape), None); // block -1
        assert_eq!(tables.slot_checked(1, 0, &shape), None); // block 8 of 8
        assert_eq!(tables.slot_checked(1, 5, &shape), Some(3 * 4 + 1));
        assert_eq!(tables.slot_checked(1, 8, &shape), None); // past the row
    }

    #[test]
    fn gqa_and_window() {
        let cfg = AttentionConfig::new(8, 2, 64).with_sliding_window(4);
        assert_eq!(cfg.kv_head(3), 0);
        assert_eq!(cfg.kv_head(4), 1);
        assert_eq!(cfg.first_visible(2), 0);
        assert_eq!(cfg.first_visible(10), 7);
        assert_eq!(AttentionConfig::new(4, 4, 8).first_visible(10), 0);
        assert_eq!(cfg.softcap_arg(), 0.0);
        assert_eq!(cfg.with_softcap(50.0).softcap_arg(), 50.0);
    }

    #[test]
    fn cache_offsets() {
        let s = KvCacheShape {
            num_blocks: 3,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
        };
        assert_eq!(s.len(), 3 * 4 * 2 * 8);
        assert_eq!(s.offset(5, 1), (5 * 2 + 1) * 8);
    }
}
