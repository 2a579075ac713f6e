//! The CPU backend's paged KV store.
//!
//! Per layer, K and V are `[num_kv_heads, num_blocks * block_size, head_dim]` tensors: per
//! head, a flat array of token *slots*, slot = `block * block_size + offset`. A contiguous
//! backend is simply `block_size = max_model_len` with one block per sequence. Writes fill
//! the step's new rows into their slots in place (the caller computes each row straight
//! into its slot: K is rotated on its way in); reads gather a sequence's slots through its
//! block table, or read them in place (decodes). Heads come first so that a gather lands
//! directly in the `[kv_heads, sequences, positions, head_dim]` layout attention
//! multiplies with, with no transposing copy of the gathered context.

use anyhow::{bail, ensure, Context, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Storage, Tensor};
use float8::F8E4M3;

use super::decode_attention::{decode_attention, DecodeSet, Dims};

pub struct CpuKv {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    num_blocks: usize,
    block_size: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl CpuKv {
    /// Zero-filled store. Zero (finite) matters: padded attention reads unwritten slots
    /// with weight exactly 0, and 0 * NaN would poison the result.
    pub fn new(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        num_blocks: usize,
        block_size: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        ensure!(
            num_blocks > 0 && block_size > 0,
            "KV cache needs at least one block of one slot"
        );
        let shape = (num_kv_heads, num_blocks * block_size, head_dim);
        let zeros = || Tensor::zeros(shape, dtype, device);
        let k = (0..num_layers)
            .map(|_| zeros())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let v = (0..num_layers)
            .map(|_| zeros())
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            k,
            v,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_layers(&self) -> usize {
        self.k.len()
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub fn dtype(&self) -> DType {
        self.k[0].dtype()
    }

    /// Bytes held by the store (K and V, all layers).
    pub fn size_bytes(&self) -> usize {
        2 * self.k.len() * self.k[0].elem_count() * self.dtype().size_in_bytes()
    }

    /// The slot holding position `pos` of a sequence with this block table.
    pub fn slot(&self, block_table: &[u32], pos: usize) -> Result<u32> {
        let Some(&block) = block_table.get(pos / self.block_size) else {
            bail!(
                "position {pos} needs block #{} but the block table has {} blocks (block_size {})",
                pos / self.block_size,
                block_table.len(),
                self.block_size
            );
        };
        ensure!(
            (block as usize) < self.num_blocks,
            "block id {block} out of range: the KV pool has {} blocks",
            self.num_blocks
        );
        Ok((block as usize * self.block_size + pos % self.block_size) as u32)
    }

    /// Writes the step's new K and V of `layer` in place: for the token at `slots[t]` and
    /// KV head `h`, `k(t, h, dst)` and `v(t, h, dst)` fill that head's `head_dim` values.
    /// The slots come from [`CpuKv::slot`], so they are inside the pool.
    pub(crate) fn write_with(
        &self,
        layer: usize,
        slots: &[u32],
        k: impl Fn(usize, usize, &mut [f32]) + Sync,
        v: impl Fn(usize, usize, &mut [f32]) + Sync,
    ) -> Result<()> {
        let (per_head, head_dim) = (
            self.num_blocks * self.block_size * self.head_dim,
            self.head_dim,
        );
        let k = FillSlots {
            slots,
            per_head,
            head_dim,
            fill: k,
        };
        let v = FillSlots {
            slots,
            per_head,
            head_dim,
            fill: v,
        };
        self.k[layer].inplace_op1(&k).context("writing K")?;
        self.v[layer].inplace_op1(&v).context("writing V")?;
        Ok(())
    }

    /// Gathers the slots `slots` (`[n]` u32): returns K and V shaped
    /// `[kv_heads, n, head_dim]`.
    pub(crate) fn gather(&self, layer: usize, slots: &Tensor) -> Result<(Tensor, Tensor)> {
        let k = self.k[layer].index_select(slots, 1)?;
        let v = self.v[layer].index_select(slots, 1)?;
        Ok((k, v))
    }

    /// Fill every slot with deterministic values of the magnitude real K and V have
    /// (|x| ≤ 0.5), so that reads touch real memory: a fresh store is zero pages, which
    /// the OS maps to one shared page and would make a profile's reads unrealistically fast.
    pub fn fill_pattern(&self) -> Result<()> {
        for t in self.k.iter().chain(self.v.iter()) {
            let n = t.elem_count() as u32;
            let x = Tensor::arange(0u32, n, t.device())?
                .to_dtype(DType::F32)?
                .affine(0.618_034, 0.0)?
                .sin()?
                .affine(0.5, 0.0)?
                .to_dtype(t.dtype())?
                .reshape(t.dims())?;
            t.slice_set(&x, 0, 0)?;
        }
        Ok(())
    }

    /// Whether [`CpuKv::decode_attention`] can read this store in place (CPU storage).
    pub(crate) fn reads_in_place(&self) -> bool {
        self.k[0].device().is_cpu()
    }

    /// Decode attention for `set` over layer `layer`, read in place (see
    /// [`crate::runtime::model::decode_attention`]). `q`: `[decodes, heads, head_dim]` f32.
    pub(crate) fn decode_attention(
        &self,
        layer: usize,
        q: &[f32],
        set: &DecodeSet,
        heads: usize,
        scale: f64,
        softcap: Option<f64>,
    ) -> Result<Vec<f32>> {
        let (ks, kl) = self.k[layer].storage_and_layout();
        let (vs, vl) = self.v[layer].storage_and_layout();
        ensure!(
            kl.is_contiguous() && vl.is_contiguous(),
            "the KV store is not contiguous"
        );
        let dims = Dims {
            heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            slots_per_head: self.num_blocks * self.block_size,
        };
        let (scale, cap) = (scale as f32, softcap.map(|c| c as f32));
        let n = self.k[layer].elem_count();
        let (ko, vo) = (kl.start_offset(), vl.start_offset());
        Ok(match (&*ks, &*vs) {
            (Storage::Cpu(CpuStorage::F32(k)), Storage::Cpu(CpuStorage::F32(v))) => {
                decode_attention(q, &k[ko..ko + n], &v[vo..vo + n], set, dims, scale, cap)
            }
            (Storage::Cpu(CpuStorage::BF16(k)), Storage::Cpu(CpuStorage::BF16(v))) => {
                decode_attention(q, &k[ko..ko + n], &v[vo..vo + n], set, dims, scale, cap)
            }
            (Storage::Cpu(CpuStorage::F16(k)), Storage::Cpu(CpuStorage::F16(v))) => {
                decode_attention(q, &k[ko..ko + n], &v[vo..vo + n], set, dims, scale, cap)
            }
            (Storage::Cpu(CpuStorage::F8E4M3(k)), Storage::Cpu(CpuStorage::F8E4M3(v))) => {
                decode_attention(q, &k[ko..ko + n], &v[vo..vo + n], set, dims, scale, cap)
            }
            _ => bail!(
                "decode attention in place needs a CPU store of f32, bf16, f16 or fp8, not {:?}",
                self.dtype()
            ),
        })
    }

    /// Copies the KV of block `src` into block `dst` in every layer (copy-on-write of a
    /// shared prefix block).
    pub fn copy_block(&self, src: u32, dst: u32) -> Result<()> {
        let (src, dst) = (src as usize, dst as usize);
        ensure!(
            src < self.num_blocks && dst < self.num_blocks && src != dst,
            "copy_block({src}, {dst}) invalid for a pool of {} blocks",
            self.num_blocks
        );
        let bs = self.block_size as u32;
        let device = self.k[0].device();
        let rows = Tensor::arange(src as u32 * bs, (src as u32 + 1) * bs, device)?;
        for t in self.k.iter().chain(self.v.iter()) {
            // index_select always yields fresh contiguous storage, as slice_set needs.
            let block = t.index_select(&rows, 1)?;
            t.slice_set(&block, 1, dst * bs as usize)?;
        }
        Ok(())
    }
}

/// An in-place write of the rows of some slots into one layer's K or V (see
/// [`CpuKv::write_with`]); heads are disjoint ranges, filled in parallel.
struct FillSlots<'a, F> {
    slots: &'a [u32],
    /// Elements per head: `slots_per_head * head_dim`.
    per_head: usize,
    head_dim: usize,
    fill: F,
}

impl<F: Fn(usize, usize, &mut [f32]) + Sync> InplaceOp1 for FillSlots<'_, F> {
    fn name(&self) -> &'static str {
        "fill-kv-slots"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        use rayon::prelude::*;
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("the KV store is not contiguous");
        };
        let d = self.head_dim;
        match storage {
            CpuStorage::F32(data) => data[start..end]
                .par_chunks_mut(self.per_head)
                .enumerate()
                .for_each(|(h, head)| {
                    for (t, &slot) in self.slots.iter().enumerate() {
                        (self.fill)(t, h, &mut head[slot as usize * d..][..d]);
                    }
                }),
            // Each row is computed in f32, then rounded to nearest, saturated at ±448 (as
            // CUDA's __NV_SATFINITE conversion and vLLM's unscaled fp8 cache do).
            CpuStorage::F8E4M3(data) => data[start..end]
                .par_chunks_mut(self.per_head)
                .enumerate()
                .for_each(|(h, head)| {
                    let mut row = vec![0f32; d];
                    for (t, &slot) in self.slots.iter().enumerate() {
                        (self.fill)(t, h, &mut row);
                        for (dst, &x) in head[slot as usize * d..][..d].iter_mut().zip(&row) {
                            *dst = F8E4M3::from_f32(x);
                        }
                    }
                }),
            other => candle_core::bail!(
                "the CPU KV store is f32 or fp8 (e4m3), not {:?}",
                other.dtype()
            ),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[n, heads, d]` -> per position, all values in head order.
    fn per_position(t: &Tensor) -> Result<Vec<Vec<f32>>> {
        Ok(t.transpose(0, 1)?.flatten_from(1)?.to_vec2::<f32>()?)
    }

    #[test]
    fn write_then_gather_round_trips_through_block_table() -> Result<()> {
        let dev = Device::Cpu;
        let cache = CpuKv::new(1, 2, 3, 4, 2, DType::F32, &dev)?;
        // Sequence uses blocks [3, 1]: positions 0,1 -> slots 6,7; 2,3 -> slots 2,3.
        let table = [3u32, 1];
        let slots: Vec<u32> = (0..4).map(|p| cache.slot(&table, p).unwrap()).collect();
        assert_eq!(slots, vec![6, 7, 2, 3]);
        let rows = Tensor::arange(0f32, 24., &dev)?.reshape((4, 2, 3))?;
        let rows2 = (&rows * 2.0)?;
        let (k_in, v_in) = (
            rows.flatten_all()?.to_vec1::<f32>()?,
            rows2.flatten_all()?.to_vec1::<f32>()?,
        );
        let row = |src: &[f32], t: usize, h: usize| src[(t * 2 + h) * 3..][..3].to_vec();
        cache.write_with(
            0,
            &slots,
            |t, h, dst| dst.copy_from_slice(&row(&k_in, t, h)),
            |t, h, dst| dst.copy_from_slice(&row(&v_in, t, h)),
        )?;
        let (k, v) = cache.gather(0, &Tensor::new(slots.as_slice(), &dev)?)?;
        assert_eq!(k.dims(), &[2, 4, 3]);
        let expect = rows.reshape((4, 6))?.to_vec2::<f32>()?;
        assert_eq!(per_position(&k)?, expect);
        assert_eq!(per_position(&v)?, rows2.reshape((4, 6))?.to_vec2::<f32>()?);
        // Untouched slots stay zero.
        let (k0, _) = cache.gather(0, &Tensor::new(&[0u32, 5], &dev)?)?;
        assert!(k0
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|&x| x == 0.0));
        // Copy block 3 to block 0 and read it back.
        cache.copy_block(3, 0)?;
        let (k_copy, _) = cache.gather(0, &Tensor::new(&[0u32, 1], &dev)?)?;
        assert_eq!(per_position(&k_copy)?, expect[..2].to_vec());
        Ok(())
    }

    #[test]
    fn an_fp8_store_rounds_to_nearest_saturates_and_reads_back_what_it_holds() -> Result<()> {
        let dev = Device::Cpu;
        // 2 KV heads of 4 values, 3 blocks of 2 slots.
        let fp8 = CpuKv::new(1, 2, 4, 3, 2, DType::F8E4M3, &dev)?;
        let f32 = CpuKv::new(1, 2, 4, 3, 2, DType::F32, &dev)?;
        assert_eq!(fp8.size_bytes() * 4, f32.size_bytes());
        // Per (token, head): exact, rounded (0.3 -> 0.3125; 17 ties to even 16), saturated.
        let raw = |t: usize, h: usize, dst: &mut [f32]| {
            let s = if h == 0 { 1.0 } else { -1.0 };
            dst.copy_from_slice(&[s * (t as f32 + 1.0), 0.3 * s, 17.0 * s, 1000.0 * s]);
        };
        let rounded = |t: usize, h: usize, dst: &mut [f32]| {
            let s = if h == 0 { 1.0 } else { -1.0 };
            dst.copy_from_slice(&[s * (t as f32 + 1.0), 0.3125 * s, 16.0 * s, 448.0 * s]);
        };
        let slots = [5u32, 0, 3];
        fp8.write_with(0, &slots, raw, raw)?;
        f32.write_with(0, &slots, rounded, rounded)?;
        let idx = Tensor::new(&slots, &dev)?;
        let (k8, v8) = fp8.gather(0, &idx)?;
        assert_eq!(k8.dtype(), DType::F8E4M3);
        let (k32, _) = f32.gather(0, &idx)?;
        assert_eq!(
            per_position(&k8.to_dtype(DType::F32)?)?,
            per_position(&k32)?
        );
        assert_eq!(
            per_position(&v8.to_dtype(DType::F32)?)?,
            per_position(&k32)?
        );
        // Decode attention in place reads the same values as the f32 store holding them.
        let mut set = DecodeSet::new();
        set.push(1, [5u32, 0, 3]);
        set.push(0, [3u32]);
        let q: Vec<f32> = (0..2 * 4 * 4).map(|i| (i as f32 * 0.37).sin()).collect();
        let a = fp8.decode_attention(0, &q, &set, 4, 0.5, None)?;
        let b = f32.decode_attention(0, &q, &set, 4, 0.5, None)?;
        assert_eq!(a, b);
        // A copied block keeps its bytes.
        fp8.copy_block(1, 2)?;
        let (copied, _) = fp8.gather(0, &Tensor::new(&[4u32, 5], &dev)?)?;
        let (source, _) = fp8.gather(0, &Tensor::new(&[2u32, 3], &dev)?)?;
        assert_eq!(
            per_position(&copied.to_dtype(DType::F32)?)?,
            per_position(&source.to_dtype(DType::F32)?)?
        );
        Ok(())
    }

    #[test]
    fn fill_pattern_writes_every_slot() -> Result<()> {
        let cache = CpuKv::new(2, 2, 4, 3, 2, DType::F32, &Device::Cpu)?;
        cache.fill_pattern()?;
        let all = Tensor::arange(0u32, 6, &Device::Cpu)?;
        let (k, v) = cache.gather(1, &all)?;
        let k = k.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(
            k.iter().filter(|x| **x == 0.0).count(),
            1,
            "only sin(0) is zero"
        );
        assert!(k.iter().all(|x| x.abs() <= 0.5));
        assert_eq!(k, v.flatten_all()?.to_vec1::<f32>()?);
        Ok(())
    }

    #[test]
    fn slot_rejects_short_block_table_and_bad_block() -> Result<()> {
        let cache = CpuKv::new(1, 1, 2, 2, 4, DType::F32, &Device::Cpu)?;
        assert!(cache.slot(&[0], 4).is_err());
        assert!(cache.slot(&[7], 0).is_err());
        assert_eq!(cache.slot(&[1], 3)?, 7);
        Ok(())
    }
}
