//! A step's integer inputs as the GPU kernels read them: token ids, positions, KV slots,
//! the rows sampled, per-sequence lengths and offsets, and block tables — all in one `i32`
//! buffer, so a step uploads them with one copy.
//!
//! Plain host code (no CUDA needed), unit-tested here; the CUDA backend uploads the result.
//! For a CUDA-graph decode step the inputs are padded to the graph's batch-size bucket and
//! the block tables to a fixed width on the device, so the captured kernels read every array
//! at the same address with the same shape on each replay. Padding rows are inert: slot `-1`
//! (the KV write skips it), sequence length 0 (decode attention writes zeros), token id 0.
//!
//! The host keeps each table row only as wide as the step's longest sequence needs
//! ([`StepInputs::table_width`]); the upload spreads the rows to the device width. A graph's
//! table width is its longest context (`--max-model-len`, 8,192 blocks at 128k tokens), so
//! padding on the host would copy megabytes a step that no kernel reads: decode attention
//! reads a row only up to its own sequence's blocks, and past them the device rows keep
//! whatever an earlier step left.

use anyhow::{ensure, Result};

use crate::runtime::batch::ForwardBatch;
/// The capture ladder, shared with the simulator's pricing of graph replays.
pub use infer_core::scheduler::{graph_bucket, GRAPH_BUCKETS};

/// Where each array starts in [`StepInputs::data`], and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Offsets {
    /// `[tokens]` each.
    pub ids: usize,
    pub positions: usize,
    pub slots: usize,
    /// `[sampled]`: rows of the step whose next token is sampled.
    pub sample_rows: usize,
    /// `[seqs]`: context length after the step (decode attention's `seq_lens`).
    pub seq_lens: usize,
    /// `[seqs]`: tokens already in the KV store before the step.
    pub start_pos: usize,
    /// `[seqs + 1]`: prefix sums of the step's tokens per sequence.
    pub cu_seqlens: usize,
    /// `[seqs, table_width]` in [`StepInputs::data`]; `[seqs, max_blocks]` on the device.
    pub tables: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepInputs {
    /// Every array, the tables last and `table_width` wide.
    pub data: Vec<i32>,
    pub at: Offsets,
    /// Rows of the step, padding included.
    pub tokens: usize,
    pub seqs: usize,
    pub sampled: usize,
    /// Rows and sequences that are real (the rest is bucket padding).
    pub real_tokens: usize,
    pub real_seqs: usize,
    pub real_sampled: usize,
    /// The device's table row width (the kernels' stride).
    pub max_blocks: usize,
    /// The host's table row width: the blocks of the step's longest sequence (at most
    /// `max_blocks`).
    pub table_width: usize,
    /// Every sequence decodes one token and samples it.
    pub decode_only: bool,
}

/// How a step is padded for a CUDA graph: to `bucket` sequences, tables `max_blocks` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Padding {
    pub bucket: usize,
    pub max_blocks: usize,
}

/// Whether every sequence of `batch` decodes one token and samples it.
pub fn is_decode_only(batch: &ForwardBatch) -> bool {
    batch.seqs.iter().all(|s| s.tokens.len() == 1 && s.sample)
}

impl StepInputs {
    /// Lays out `batch` for a pool of `num_blocks` blocks of `block_size` slots. Fails on a
    /// block table too short for a position or a block id outside the pool: no id reaches a
    /// kernel unchecked.
    pub fn build(
        batch: &ForwardBatch,
        block_size: usize,
        num_blocks: usize,
        padding: Option<Padding>,
    ) -> Result<Self> {
        let real_seqs = batch.seqs.len();
        let real_tokens = batch.total_tokens();
        let decode_only = is_decode_only(batch);
        let natural_blocks = batch
            .seqs
            .iter()
            .map(|s| s.end_pos().div_ceil(block_size))
            .max()
            .unwrap_or(0)
            .max(1);
        let (seqs, tokens, max_blocks) = match padding {
            Some(p) => {
                ensure!(
                    decode_only && real_seqs <= p.bucket,
                    "only decode steps of at most {} sequences pad to that bucket",
                    p.bucket
                );
                ensure!(
                    natural_blocks <= p.max_blocks,
                    "a sequence needs {natural_blocks} blocks, more than the graph's {}",
                    p.max_blocks
                );
                (p.bucket, p.bucket, p.max_blocks)
            }
            None => (real_seqs, real_tokens, natural_blocks),
        };
        let real_sampled = batch.num_logit_rows();
        let sampled = if padding.is_some() {
            seqs
        } else {
            real_sampled
        };
        let mut at = Offsets::default();
        let mut len = 0;
        for (field, n) in [
            (&mut at.ids, tokens),
            (&mut at.positions, tokens),
            (&mut at.slots, tokens),
            (&mut at.sample_rows, sampled),
            (&mut at.seq_lens, seqs),
            (&mut at.start_pos, seqs),
            (&mut at.cu_seqlens, seqs + 1),
            (&mut at.tables, seqs * natural_blocks),
        ] {
            *field = len;
            len += n;
        }
        let mut data = vec![0i32; len];
        data[at.slots..at.slots + tokens].fill(-1);
        let (mut row, mut sample) = (0, 0);
        for (i, s) in batch.seqs.iter().enumerate() {
            data[at.cu_seqlens + i] = row as i32;
            data[at.seq_lens + i] = s.end_pos() as i32;
            data[at.start_pos + i] = s.start_pos as i32;
            let need = s.end_pos().div_ceil(block_size);
            ensure!(
                s.block_table.len() >= need,
                "sequence {i} reaches position {} but its block table has {} blocks",
                s.end_pos() - 1,
                s.block_table.len()
            );
            for (j, &b) in s.block_table[..need].iter().enumerate() {
                ensure!(
                    (b as usize) < num_blocks,
                    "block id {b} out of range: the KV pool has {num_blocks} blocks"
                );
                data[at.tables + i * natural_blocks + j] = b as i32;
            }
            for (j, &t) in s.tokens.iter().enumerate() {
                let pos = s.start_pos + j;
                let block = s.block_table[pos / block_size] as usize;
                data[at.ids + row] = t as i32;
                data[at.positions + row] = pos as i32;
                data[at.slots + row] = (block * block_size + pos % block_size) as i32;
                row += 1;
            }
            let first = row - s.tokens.len();
            for j in s.logit_rows() {
                data[at.sample_rows + sample] = (first + j) as i32;
                sample += 1;
            }
        }
        // Padding sequences: one inert token each, sampled so every graph row has logits.
        for i in real_seqs..seqs {
            data[at.cu_seqlens + i] = row as i32;
            data[at.sample_rows + sample] = row as i32;
            row += 1;
            sample += 1;
        }
        data[at.cu_seqlens + seqs] = row as i32;
        debug_assert_eq!(row, tokens);
        debug_assert_eq!(sample, sampled);
        Ok(StepInputs {
            data,
            at,
            tokens,
            seqs,
            sampled,
            real_tokens,
            real_seqs,
            real_sampled,
            max_blocks,
            table_width: natural_blocks,
            decode_only,
        })
    }

    /// `i32`s of the device buffer: `data` with the tables `max_blocks` wide.
    pub fn device_len(&self) -> usize {
        self.at.tables + self.seqs * self.max_blocks
    }

    pub fn ids(&self) -> &[i32] {
        &self.data[self.at.ids..self.at.ids + self.tokens]
    }

    pub fn slots(&self) -> &[i32] {
        &self.data[self.at.slots..self.at.slots + self.tokens]
    }

    pub fn sample_rows(&self) -> &[i32] {
        &self.data[self.at.sample_rows..self.at.sample_rows + self.sampled]
    }

    pub fn cu_seqlens(&self) -> &[i32] {
        &self.data[self.at.cu_seqlens..self.at.cu_seqlens + self.seqs + 1]
    }

    /// Sequence `seq`'s table row as the host holds it (`table_width` long).
    pub fn table(&self, seq: usize) -> &[i32] {
        let start = self.at.tables + seq * self.table_width;
        &self.data[start..start + self.table_width]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::batch::SeqChunk;

    fn seq(tokens: &[u32], start_pos: usize, table: &[u32], sample: bool) -> SeqChunk {
        SeqChunk {
            tokens: tokens.to_vec(),
            start_pos,
            block_table: table.to_vec(),
            sample,
            all_logits: false,
        }
    }

    #[test]
    fn buckets_pick_the_smallest_that_fits() {
        assert_eq!(graph_bucket(1, 256), Some(1));
        assert_eq!(graph_bucket(3, 256), Some(4));
        assert_eq!(graph_bucket(17, 256), Some(24));
        assert_eq!(graph_bucket(33, 32), None);
        assert_eq!(graph_bucket(257, 1024), None);
        assert_eq!(graph_bucket(0, 8), None);
    }

    #[test]
    fn mixed_step_maps_slots_through_block_tables() {
        // A 3-token prefill chunk after 4 cached tokens (blocks of 4: [7, 2]), and a decode.
        let batch = ForwardBatch {
            seqs: vec![
                seq(&[10, 11, 12], 4, &[7, 2], false),
                seq(&[5], 1, &[3], true),
            ],
        };
        let s = StepInputs::build(&batch, 4, 8, None).unwrap();
        assert!(!s.decode_only);
        assert_eq!((s.tokens, s.seqs, s.sampled, s.max_blocks), (4, 2, 1, 2));
        // Unpadded: the host's rows are the device's.
        assert_eq!((s.table_width, s.device_len()), (2, s.data.len()));
        assert_eq!(s.ids(), &[10, 11, 12, 5]);
        assert_eq!(s.slots(), &[2 * 4, 2 * 4 + 1, 2 * 4 + 2, 3 * 4 + 1]);
        assert_eq!(s.sample_rows(), &[3]);
        assert_eq!(s.cu_seqlens(), &[0, 3, 4]);
        assert_eq!(s.table(0), &[7, 2]);
        assert_eq!(s.table(1), &[3, 0]);
        let at = s.at;
        assert_eq!(&s.data[at.seq_lens..at.seq_lens + 2], &[7, 2]);
        assert_eq!(&s.data[at.start_pos..at.start_pos + 2], &[4, 1]);
    }

    #[test]
    fn graph_padding_is_inert_and_fixed_shape() {
        let batch = ForwardBatch {
            seqs: vec![seq(&[9], 5, &[1, 4], true), seq(&[8], 0, &[6], true)],
        };
        let pad = Padding {
            bucket: 4,
            max_blocks: 3,
        };
        let s = StepInputs::build(&batch, 4, 8, Some(pad)).unwrap();
        assert!(s.decode_only);
        assert_eq!((s.tokens, s.seqs, s.sampled, s.real_sampled), (4, 4, 4, 2));
        assert_eq!(s.ids(), &[9, 8, 0, 0]);
        assert_eq!(s.slots(), &[4 * 4 + 1, 6 * 4, -1, -1]);
        assert_eq!(s.sample_rows(), &[0, 1, 2, 3]);
        assert_eq!(s.cu_seqlens(), &[0, 1, 2, 3, 4]);
        assert_eq!(&s.data[s.at.seq_lens..s.at.seq_lens + 4], &[6, 1, 0, 0]);
        // Rows as wide as the longest sequence needs on the host; 3 wide on the device.
        assert_eq!((s.table_width, s.max_blocks), (2, 3));
        assert_eq!(s.table(0), &[1, 4]);
        assert_eq!(s.table(1), &[6, 0]);
        assert_eq!(s.table(3), &[0, 0]);
        assert_eq!(s.device_len(), s.at.tables + 4 * 3);
        assert_eq!(s.data.len(), s.at.tables + 4 * 2);
        // Same bucket, other contexts: the same device layout (a graph reads the same
        // addresses), a narrower host one.
        let other = ForwardBatch {
            seqs: vec![seq(&[1], 0, &[0], true)],
        };
        let o = StepInputs::build(&other, 4, 8, Some(pad)).unwrap();
        assert_eq!((o.at, o.device_len()), (s.at, s.device_len()));
        assert_eq!(o.table_width, 1);
    }

    #[test]
    fn bad_ids_and_shapes_are_refused() {
        let past_pool = ForwardBatch {
            seqs: vec![seq(&[1], 0, &[8], true)],
        };
        assert!(StepInputs::build(&past_pool, 4, 8, None).is_err());
        let short_table = ForwardBatch {
            seqs: vec![seq(&[1, 2], 3, &[0], true)],
        };
        assert!(StepInputs::build(&short_table, 4, 8, None).is_err());
        let prefill = ForwardBatch {
            seqs: vec![seq(&[1, 2], 0, &[0], true)],
        };
        let pad = Padding {
            bucket: 4,
            max_blocks: 2,
        };
        assert!(StepInputs::build(&prefill, 4, 8, Some(pad)).is_err());
        let too_long = ForwardBatch {
            seqs: vec![seq(&[1], 11, &[0, 1, 2], true)],
        };
        assert!(StepInputs::build(&too_long, 4, 8, Some(pad)).is_err());
    }
}
