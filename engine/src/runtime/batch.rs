//! The plain-data input of one model step: a flattened mix of prefill chunks and decodes.
//!
//! This mirrors what the core scheduler's step plan holds per scheduled sequence, so a
//! driver turns a plan into a [`ForwardBatch`] without the model knowing about requests.

/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqChunk {
    /// New token ids processed this step (a prefill chunk, or one decode token).
    pub tokens: Vec<u32>,
    /// Tokens of this sequence already in the KV store: the position of `tokens[0]`.
    pub start_pos: usize,
    /// Block ids into the KV pool; position `p` lives in block `block_table[p / block_size]`.
    pub block_table: Vec<u32>,
    /// Whether logits are needed for the last token of this chunk (a token is sampled).
    pub sample: bool,
    /// Logits for every token of the chunk, not only the last (prompt logprobs).
    pub all_logits: bool,
}

impl SeqChunk {
    /// Context length after this step: positions `[0, end_pos())` are attended.
    pub fn end_pos(&self) -> usize {
        self.start_pos + self.tokens.len()
    }

    /// The chunk's tokens (indices into `tokens`) whose logits come back, in order.
    pub fn logit_rows(&self) -> std::ops::Range<usize> {
        let n = self.tokens.len();
        if self.all_logits {
            0..n
        } else if self.sample {
            n - 1..n
        } else {
            n..n
        }
    }
}

/// All sequences of one step. Logits come back in batch order, each sequence's
/// [`SeqChunk::logit_rows`] in position order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ForwardBatch {
    pub seqs: Vec<SeqChunk>,
}

impl ForwardBatch {
    pub fn total_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// Rows of logits the step returns.
    pub fn num_logit_rows(&self) -> usize {
        self.seqs.iter().map(|s| s.logit_rows().len()).sum()
    }

    /// The step as consecutive forward passes of at most `max_tokens` tokens and
    /// `max_logit_rows` rows of logits each: whole sequences where they fit a pass, and a
    /// sequence larger than a pass (a long prompt whose every row is asked for, for its
    /// prompt logprobs) as consecutive pieces, each a pass of its own. Sequences are
    /// independent within a step (each attends to its own blocks), and a piece attends to
    /// the earlier pieces' K/V as a prefill chunk does, so the passes compute what one would;
    /// their logits, concatenated, are the step's.
    pub fn passes(&self, max_tokens: usize, max_logit_rows: usize) -> Vec<Pass> {
        let (max_tokens, max_rows) = (max_tokens.max(1), max_logit_rows.max(1));
        let mut out: Vec<Pass> = Vec::new();
        // Tokens and logit rows of the last pass.
        let (mut tokens, mut rows) = (0, 0);
        for (i, s) in self.seqs.iter().enumerate() {
            let (n, r) = (s.tokens.len(), s.logit_rows().len());
            if n <= max_tokens && r <= max_rows {
                if out.is_empty() || tokens + n > max_tokens || rows + r > max_rows {
                    out.push(Pass::default());
                    (tokens, rows) = (0, 0);
                }
                let pass = out.last_mut().expect("a pass");
                pass.batch.seqs.push(s.clone());
                pass.origin.push(i);
                (tokens, rows) = (tokens + n, rows + r);
                continue;
            }
            let piece = if s.all_logits {
                max_tokens.min(max_rows)
            } else {
                max_tokens
            };
            for lo in (0..n).step_by(piece) {
                let hi = (lo + piece).min(n);
                let part = SeqChunk {
                    tokens: s.tokens[lo..hi].to_vec(),
                    start_pos: s.start_pos + lo,
                    block_table: s.block_table.clone(),
                    sample: s.sample && hi == n,
                    all_logits: s.all_logits,
                };
                (tokens, rows) = (part.tokens.len(), part.logit_rows().len());
                out.push(Pass {
                    batch: ForwardBatch { seqs: vec![part] },
                    origin: vec![i],
                });
            }
        }
        out
    }
}

/// One forward pass of a step run in several ([`ForwardBatch::passes`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pass {
    pub batch: ForwardBatch,
    /// For each of the pass's sequences, the index in the step of the sequence it is (a
    /// piece of).
    pub origin: Vec<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(n: usize, id: u32) -> SeqChunk {
        SeqChunk {
            tokens: vec![id; n],
            start_pos: 0,
            block_table: vec![id],
            sample: true,
            all_logits: false,
        }
    }

    #[test]
    fn passes_keep_sequences_whole_in_order_within_the_tokens() {
        let batch = ForwardBatch {
            seqs: vec![
                seq(30, 0),
                seq(30, 1),
                seq(50, 2),
                seq(1, 3),
                seq(64, 4),
                seq(5, 5),
            ],
        };
        let passes = batch.passes(64, 64);
        let ids: Vec<Vec<u32>> = passes
            .iter()
            .map(|p| p.batch.seqs.iter().map(|s| s.tokens[0]).collect())
            .collect();
        assert_eq!(ids, vec![vec![0, 1], vec![2, 3], vec![4], vec![5]]);
        let origins: Vec<Vec<usize>> = passes.iter().map(|p| p.origin.clone()).collect();
        assert_eq!(origins, vec![vec![0, 1], vec![2, 3], vec![4], vec![5]]);
        assert!(passes.iter().all(|p| p.batch.total_tokens() <= 64));
        let flat: Vec<SeqChunk> = passes.into_iter().flat_map(|p| p.batch.seqs).collect();
        assert_eq!(flat, batch.seqs);
        // Rows bound a pass as tokens do: each sampled sequence is one.
        let by_rows = batch.passes(1000, 2);
        assert_eq!(by_rows.len(), 3);
        assert!(by_rows.iter().all(|p| p.batch.num_logit_rows() <= 2));
        let one = batch.passes(1000, 1000);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].batch, batch);
    }

    /// The simulator counts a step's passes by core's rule ([`whole_sequence_passes`]): the
    /// same number as the engine runs, over mixes of whole and oversized sequences.
    #[test]
    fn passes_are_the_ones_the_simulator_counts() {
        use infer_core::scheduler::whole_sequence_passes;
        let mut state = 7u64;
        for _ in 0..500 {
            let mut next = |m: u64| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 33) % m
            };
            let max = 1 + next(96) as usize;
            let seqs: Vec<SeqChunk> = (0..1 + next(12))
                .map(|i| seq(1 + next(2 * max as u64) as usize, i as u32))
                .collect();
            let sizes: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
            let batch = ForwardBatch { seqs };
            assert_eq!(
                batch.passes(max, usize::MAX).len(),
                whole_sequence_passes(sizes.iter().copied(), max),
                "{sizes:?} in passes of {max}"
            );
        }
    }

    /// A prompt whose every row is asked for is cut into consecutive pieces within the rows
    /// a pass may return; only the last piece samples, and the pieces' rows, in order, are
    /// the whole chunk's.
    #[test]
    fn a_chunk_larger_than_a_pass_runs_as_consecutive_pieces() {
        let mut long = seq(100, 7);
        long.start_pos = 16;
        long.all_logits = true;
        long.tokens = (0..100).collect();
        let batch = ForwardBatch {
            seqs: vec![seq(3, 1), long.clone(), seq(2, 2), seq(90, 3)],
        };
        let passes = batch.passes(64, 32);
        for p in &passes {
            assert!(p.batch.total_tokens() <= 64, "{p:?}");
            assert!(p.batch.num_logit_rows() <= 32, "{p:?}");
        }
        let origins: Vec<Vec<usize>> = passes.iter().map(|p| p.origin.clone()).collect();
        assert_eq!(
            origins,
            vec![
                vec![0],
                vec![1],
                vec![1],
                vec![1],
                vec![1, 2],
                vec![3],
                vec![3]
            ]
        );
        let pieces: Vec<&SeqChunk> = passes
            .iter()
            .flat_map(|p| p.batch.seqs.iter().zip(&p.origin))
            .filter(|(_, &i)| i == 1)
            .map(|(s, _)| s)
            .collect();
        let starts: Vec<usize> = pieces.iter().map(|s| s.start_pos).collect();
        assert_eq!(starts, vec![16, 48, 80, 112]);
        let samples: Vec<bool> = pieces.iter().map(|s| s.sample).collect();
        assert_eq!(samples, vec![false, false, false, true]);
        let tokens: Vec<u32> = pieces.iter().flat_map(|s| s.tokens.clone()).collect();
        assert_eq!(tokens, long.tokens);
        assert!(pieces.iter().all(|s| s.block_table == long.block_table));
        // A sequence past the tokens, its logits not all asked for, is cut by tokens alone
        // and its one row comes from its last piece.
        let last: Vec<&SeqChunk> = passes[5..].iter().map(|p| &p.batch.seqs[0]).collect();
        assert_eq!(
            last.iter()
                .map(|s| (s.start_pos, s.tokens.len(), s.sample))
                .collect::<Vec<_>>(),
            vec![(0, 64, false), (64, 26, true)]
        );
        let rows: usize = passes.iter().map(|p| p.batch.num_logit_rows()).sum();
        assert_eq!(rows, batch.num_logit_rows());
    }
}
