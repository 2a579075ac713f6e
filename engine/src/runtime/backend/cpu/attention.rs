//! Attention over the paged KV store for a flattened step.
//!
//! Each sequence attends only to its own context, read through its block table. On the CPU,
//! decodes (one query each) take [`super::decode_attention`], which reads the KV store in
//! place. Prompt chunks — and decodes on other devices — go through batched matmuls: to
//! keep the number of tensor ops independent of the batch size, sequences whose chunks
//! have the same length and a similar context form one *group* computed as one padded
//! batched attention; padded key slots are masked out of the softmax, so they get weight
//! exactly 0 and a sequence's result does not depend on what it is batched with. Contexts
//! are bucketed by powers of two, so padding at most doubles a group's work. The plan (slots, masks,
//! row order) depends only on the batch, so it is built once per step and reused by every
//! layer of the same kind (global or sliding window).

use super::decode_attention::DecodeSet;
use super::kv::CpuKv;
use crate::runtime::batch::ForwardBatch;
use anyhow::Result;
use candle_core::{DType, Device, Tensor};

pub(crate) struct AttnPlan {
    groups: Vec<Group>,
    /// Decodes read in place (CPU), after the groups in concatenation order.
    decodes: Option<(DecodeSet, Tensor)>,
    /// Gathers the concatenated group outputs back into the batch's token order;
    /// `None` when they are already in order.
    restore: Option<Tensor>,
}

struct Group {
    /// Query rows of the flattened step, member after member.
    rows: Rows,
    batch: usize,
    len: usize,
    ctx: usize,
    /// `[batch * ctx]` KV slots, member after member, padded to `ctx`.
    slots: Tensor,
    /// Which keys each query sees, `[batch, len, ctx]`; `None` when it sees them all.
    visible: Option<Vec<bool>>,
}

enum Rows {
    Range { start: usize, len: usize },
    Index(Tensor),
}

impl AttnPlan {
    /// `window`: keys of a query at position p are those k with `p - k < window`.
    pub(crate) fn new(
        batch: &ForwardBatch,
        cache: &CpuKv,
        window: Option<usize>,
        dev: &Device,
    ) -> Result<Self> {
        let mut row_start = Vec::with_capacity(batch.seqs.len());
        let mut total = 0;
        for s in &batch.seqs {
            row_start.push(total);
            total += s.tokens.len();
        }
        // First key position each sequence attends to.
        let lo: Vec<usize> = batch
            .seqs
            .iter()
            .map(|s| match window {
                Some(w) => (s.start_pos + 1).saturating_sub(w),
                None => 0,
            })
            .collect();
        // Group by (chunk length, context bucket), in order of first appearance
        // (deterministic).
        let mut by_key: Vec<((usize, usize), Vec<usize>)> = Vec::new();
        let mut decodes = DecodeSet::new();
        let direct = cache.reads_in_place();
        for (i, s) in batch.seqs.iter().enumerate() {
            if direct && s.tokens.len() == 1 {
                let slots = (lo[i]..s.end_pos())
                    .map(|pos| cache.slot(&s.block_table, pos))
                    .collect::<Result<Vec<u32>>>()?;
                decodes.push(row_start[i] as u32, slots);
                continue;
            }
            let key = (s.tokens.len(), (s.end_pos() - lo[i]).next_power_of_two());
            match by_key.iter_mut().find(|(k, _)| *k == key) {
                Some((_, members)) => members.push(i),
                None => by_key.push((key, vec![i])),
            }
        }

        let mut groups = Vec::with_capacity(by_key.len());
        let mut order: Vec<u32> = Vec::with_capacity(total);
        for ((len, _), members) in by_key {
            let ctx = members
                .iter()
                .map(|&i| batch.seqs[i].end_pos() - lo[i])
                .max()
                .unwrap_or(0);

            let mut slots = Vec::with_capacity(members.len() * ctx);
            let mut visible = Vec::with_capacity(members.len() * len * ctx);
            let mut any_masked = false;
            for &i in &members {
                let lo = lo[i];
                let s = &batch.seqs[i];
                let own_ctx = s.end_pos() - lo;
                for c in 0..ctx {
                    // Padding reads the sequence's first slot: written, hence finite.
                    let pos = if c < own_ctx { lo + c } else { lo };
                    slots.push(cache.slot(&s.block_table, pos)?);
                }
                for l in 0..len {
                    let q = s.start_pos + l;
                    for c in 0..ctx {
                        let k = lo + c;
                        let ok = c < own_ctx && k <= q && window.is_none_or(|w| q - k < w);
                        any_masked |= !ok;
                        visible.push(ok);
                    }
                }
                order.extend((row_start[i]..row_start[i] + len).map(|r| r as u32));
            }
            let batch_n = members.len();
            let rows = if batch_n == 1 {
                Rows::Range {
                    start: row_start[members[0]],
                    len,
                }
            } else {
                let idx: Vec<u32> = members
                    .iter()
                    .flat_map(|&i| (row_start[i]..row_start[i] + len).map(|r| r as u32))
                    .collect();
                Rows::Index(Tensor::new(idx.as_slice(), dev)?)
            };
            groups.push(Group {
                rows,
                batch: batch_n,
                len,
                ctx,
                slots: Tensor::new(slots.as_slice(), dev)?,
                visible: any_masked.then_some(visible),
            });
        }

        let decodes = if !decodes.is_empty() {
            order.extend_from_slice(&decodes.rows);
            let rows = Tensor::new(decodes.rows.as_slice(), dev)?;
            Some((decodes, rows))
        } else {
            None
        };
        let in_order = order.iter().enumerate().all(|(i, &r)| i as u32 == r);
        let restore = if in_order {
            None
        } else {
            let mut inverse = vec![0u32; total];
            for (concat_pos, &row) in order.iter().enumerate() {
                inverse[row as usize] = concat_pos as u32;
            }
            Some(Tensor::new(inverse.as_slice(), dev)?)
        };
        Ok(Self {
            groups,
            decodes,
            restore,
        })
    }

    /// `q`: `[tokens, heads, head_dim]` (rope applied). The step's K/V must already be in
    /// the cache. Returns `[tokens, heads * head_dim]` in `q`'s dtype.
    pub(crate) fn attend(
        &self,
        q: &Tensor,
        cache: &CpuKv,
        layer: usize,
        scale: f64,
        softcap: Option<f64>,
    ) -> Result<Tensor> {
        let (_, heads, d) = q.dims3()?;
        let kv = cache.num_kv_heads();
        let g = heads / kv;
        let mut outs = Vec::with_capacity(self.groups.len());
        for grp in &self.groups {
            let (b, l, c) = (grp.batch, grp.len, grp.ctx);
            let qg = match &grp.rows {
                Rows::Range { start, len } => q.narrow(0, *start, *len)?,
                Rows::Index(idx) => q.index_select(idx, 0)?,
            };
            // Query head h = kv_head * g + j (HF's repeat_kv order): group the g query heads
            // of one KV head together so K/V are never repeated. Batch dims are
            // (kv_head, sequence), the layout the cache gathers into.
            let qg = qg
                .to_dtype(DType::F32)?
                .reshape((b, l, kv, g, d))?
                .permute((2, 0, 3, 1, 4))?
                .contiguous()?
                .reshape((kv, b, g * l, d))?;
            let (k, v) = cache.gather(layer, &grp.slots)?;
            let k = k.to_dtype(DType::F32)?.reshape((kv, b, c, d))?;
            let v = v.to_dtype(DType::F32)?.reshape((kv, b, c, d))?;
            let mut scores = (qg.matmul(&k.t()?)? * scale)?;
            if let Some(cap) = softcap {
                scores = ((scores / cap)?.tanh()? * cap)?;
            }
            let probs = masked_softmax(&scores, grp.visible.as_deref(), b, g, l, c)?.reshape((
                kv,
                b,
                g * l,
                c,
            ))?;
            let out = probs
                .matmul(&v)?
                .reshape((kv, b, g, l, d))?
                .permute((1, 3, 0, 2, 4))?
                .contiguous()?
                .reshape((b * l, heads * d))?;
            outs.push(out.to_dtype(q.dtype())?);
        }
        if let Some((set, rows)) = &self.decodes {
            let qd = q.index_select(rows, 0)?.to_dtype(DType::F32)?;
            let qd = qd.flatten_all()?.to_vec1::<f32>()?;
            let out = cache.decode_attention(layer, &qd, set, heads, scale, softcap)?;
            let out = Tensor::from_vec(out, (set.len(), heads * d), q.device())?;
            outs.push(out.to_dtype(q.dtype())?);
        }
        let out = if outs.len() == 1 {
            outs.pop().unwrap()
        } else {
            Tensor::cat(&outs, 0)?
        };
        Ok(match &self.restore {
            Some(idx) => out.index_select(idx, 0)?,
            None => out,
        })
    }
}

/// Softmax over the last dimension of `scores` (`[kv, b, g * l, c]`, contiguous f32) where
/// only the keys `visible` (`[b, l, c]`, shared by every head) count: hidden keys get
/// probability exactly 0 without being exponentiated. One parallel pass, in place of
/// adding an -inf mask and a separate softmax (two passes and two tensors the size of the
/// scores, for a prompt chunk the largest of the step).
fn masked_softmax(
    scores: &Tensor,
    visible: Option<&[bool]>,
    b: usize,
    g: usize,
    l: usize,
    c: usize,
) -> Result<Tensor> {
    use rayon::prelude::*;
    let Some(visible) = visible else {
        return Ok(candle_nn::ops::softmax_last_dim(scores)?);
    };
    let probs = super::with_f32(scores, |src| {
        let mut probs = vec![0f32; src.len()];
        probs
            .par_chunks_mut(c)
            .zip(src.par_chunks(c))
            .enumerate()
            .for_each(|(row, (p, s))| {
                // Row order is (kv head, sequence, query head, query).
                let (seq, query) = ((row / (g * l)) % b, row % l);
                let seen = &visible[(seq * l + query) * c..][..c];
                let max = s
                    .iter()
                    .zip(seen)
                    .filter(|(_, &v)| v)
                    .fold(f32::NEG_INFINITY, |m, (&x, _)| m.max(x));
                let mut sum = 0f32;
                for ((p, &x), &v) in p.iter_mut().zip(s).zip(seen) {
                    if v {
                        *p = (x - max).exp();
                        sum += *p;
                    }
                }
                if sum > 0.0 {
                    for p in p.iter_mut() {
                        *p /= sum;
                    }
                }
            });
        probs
    })?;
    Ok(Tensor::from_vec(probs, scores.shape(), scores.device())?)
}
