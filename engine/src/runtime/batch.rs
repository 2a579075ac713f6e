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

    /// The step as consecutive runs of whole sequences of at most `max_tokens` tokens each
    /// (a sequence longer than that alone): passes whose logits, concatenated, are the
    /// step's. Sequences are independent within a step (each attends to its own blocks), so
    /// running them in several passes computes the same.
    pub fn passes(&self, max_tokens: usize) -> Vec<ForwardBatch> {
        let mut out: Vec<ForwardBatch> = Vec::new();
        let mut tokens = 0;
        for s in &self.seqs {
            let n = s.tokens.len();
            match out.last_mut() {
                Some(pass) if tokens + n <= max_tokens => {
                    pass.seqs.push(s.clone());
                    tokens += n;
                }
                _ => {
                    out.push(ForwardBatch {
                        seqs: vec![s.clone()],
                    });
                    tokens = n;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_keep_sequences_whole_in_order_within_the_tokens() {
        let seq = |n: usize, id: u32| SeqChunk {
            tokens: vec![id; n],
            start_pos: 0,
            block_table: vec![id],
            sample: true,
            all_logits: false,
        };
        let batch = ForwardBatch {
            seqs: vec![
                seq(30, 0),
                seq(30, 1),
                seq(50, 2),
                seq(1, 3),
                seq(70, 4),
                seq(5, 5),
            ],
        };
        let passes = batch.passes(64);
        let ids: Vec<Vec<u32>> = passes
            .iter()
            .map(|p| p.seqs.iter().map(|s| s.tokens[0]).collect())
            .collect();
        assert_eq!(ids, vec![vec![0, 1], vec![2, 3], vec![4], vec![5]]);
        assert!(passes
            .iter()
            .all(|p| p.total_tokens() <= 64 || p.seqs.len() == 1));
        let flat: Vec<SeqChunk> = passes.into_iter().flat_map(|p| p.seqs).collect();
        assert_eq!(flat, batch.seqs);
        assert_eq!(batch.passes(1000), vec![batch.clone()]);
    }
}
