//! Writing new K/V tokens into the paged pool.

use super::gather::copy_columns;
use super::rope::{rope_neox, RopeTable};
use crate::layout::KvCacheShape;

/// Copy each new token's K and V (`[num_tokens, num_kv_heads, head_dim]`) into pool slot
/// `slot_mapping[t] = block * block_size + offset`. A negative slot marks a padding token
/// (e.g. a CUDA-graph bucket larger than the batch) and is skipped; so is a slot past the pool
/// (`>= shape.num_slots()`), as the kernel never writes outside the pool.
pub fn reshape_and_cache(
    key: &[f32],
    value: &[f32],
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    slot_mapping: &[i32],
    shape: &KvCacheShape,
) {
    let token_len = shape.num_kv_heads * shape.head_dim;
    assert_eq!(key.len(), slot_mapping.len() * token_len);
    assert_eq!(value.len(), key.len());
    assert_eq!(k_cache.len(), shape.len());
    assert_eq!(v_cache.len(), shape.len());
    for (t, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 || slot as usize >= shape.num_slots() {
            continue;
        }
        let dst = shape.offset(slot as usize, 0);
        let src = t * token_len;
        k_cache[dst..dst + token_len].copy_from_slice(&key[src..src + token_len]);
        v_cache[dst..dst + token_len].copy_from_slice(&value[src..src + token_len]);
    }
}

/// A fused QKV product (`[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]`) as
/// attention takes it: Q rotated into `q_out` (`[num_tokens, num_heads * head_dim]`), K rotated
/// and V written into the pool at `slot_mapping` — [`copy_columns`], [`rope_neox`] and
/// [`reshape_and_cache`] composed, which the CUDA kernel `qkv_rope_cache_bf16` does in one
/// launch (the same skipped positions and slots).
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_and_cache(
    q_out: &mut [f32],
    qkv: &[f32],
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    positions: &[i32],
    slot_mapping: &[i32],
    num_heads: usize,
    table: &RopeTable,
    shape: &KvCacheShape,
) {
    let (nq, nkv) = (
        num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
    );
    let (tokens, cols) = (positions.len(), nq + 2 * nkv);
    assert_eq!(qkv.len(), tokens * cols);
    assert_eq!(slot_mapping.len(), tokens);
    let (mut k, mut v) = (vec![0.0; tokens * nkv], vec![0.0; tokens * nkv]);
    copy_columns(q_out, qkv, cols, 0);
    copy_columns(&mut k, qkv, cols, nq);
    copy_columns(&mut v, qkv, cols, nq + nkv);
    rope_neox(q_out, positions, num_heads, table);
    rope_neox(&mut k, positions, shape.num_kv_heads, table);
    reshape_and_cache(&k, &v, k_cache, v_cache, slot_mapping, shape);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_land_in_their_slots() {
        let shape = KvCacheShape {
            num_blocks: 2,
            block_size: 2,
            num_kv_heads: 1,
            head_dim: 2,
        };
        let key = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let value = key.map(|v| -v);
        let mut k = vec![0.0; shape.len()];
        let mut v = vec![0.0; shape.len()];
        // Token 0 -> block 1 offset 1 (slot 3); token 1 is padding; token 2 -> slot 0.
        reshape_and_cache(&key, &value, &mut k, &mut v, &[3, -1, 0], &shape);
        assert_eq!(k, [5.0, 6.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0]);
        assert_eq!(v, [-5.0, -6.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0]);
        // Slots past the pool (4 slots) are skipped, not written.
        reshape_and_cache(&key, &value, &mut k, &mut v, &[4, 99, -7], &shape);
        assert_eq!(k, [5.0, 6.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0]);
        assert_eq!(v, [-5.0, -6.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0]);
    }
}
