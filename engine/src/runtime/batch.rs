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
}
