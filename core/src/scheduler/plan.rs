//! The step plan — what `schedule` hands the driver — and the events `complete` returns.

use crate::kv::BlockId;
use crate::request::{FinishReason, RequestId, RequestStats};

/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub request: RequestId,
    /// Tokens already in KV: the position of the first new token.
    pub num_computed: usize,
    /// Tokens processed this step: a prefill chunk, or 1 for a decode.
    pub num_new_tokens: usize,
    /// Whether this chunk reaches the last known token, so a token is sampled from it.
    pub samples: bool,
    /// A decode step of a sequence whose prompt is already computed.
    pub is_decode: bool,
    /// Prompt tokens this sequence found in the prefix cache when admitted: context whose
    /// KV it shares with the sequence that computed it.
    pub cached_tokens: usize,
    /// The first block of its KV: a contiguous cache's slot (set with or without block
    /// tables in the plan).
    pub first_block: BlockId,
    pub(crate) slot: u32,
    tokens: (u32, u32),
    blocks: (u32, u32),
}

impl ScheduledSeq {
    /// Context length after this step.
    pub fn context_len(&self) -> usize {
        self.num_computed + self.num_new_tokens
    }
}

/// What runs in one step. Token ids and block tables live in flat buffers that are
/// reused from step to step, so planning allocates nothing in the steady state.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    pub step: u64,
    pub now: f64,
    pub seqs: Vec<ScheduledSeq>,
    /// Sent back to waiting this step to free KV (they will recompute).
    pub preempted: Vec<RequestId>,
    /// Ended outside `complete` (aborted, or finished by the driver) since the last plan;
    /// the driver drops any per-request state it keeps.
    pub finished: Vec<RequestId>,
    /// Tokens per block of the block tables (max_model_len for contiguous slots).
    pub block_size: usize,
    token_ids: Vec<u32>,
    block_ids: Vec<BlockId>,
}

impl StepPlan {
    pub(crate) fn reset(&mut self, step: u64, now: f64, block_size: usize) {
        self.step = step;
        self.now = now;
        self.block_size = block_size;
        self.seqs.clear();
        self.preempted.clear();
        self.finished.clear();
        self.token_ids.clear();
        self.block_ids.clear();
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn push(
        &mut self,
        request: RequestId,
        slot: u32,
        num_computed: usize,
        new_tokens: &[u32],
        samples: bool,
        is_decode: bool,
        cached_tokens: usize,
        first_block: BlockId,
        block_table: &[BlockId],
    ) {
        let t0 = self.token_ids.len() as u32;
        self.token_ids.extend_from_slice(new_tokens);
        let b0 = self.block_ids.len() as u32;
        self.block_ids.extend_from_slice(block_table);
        self.seqs.push(ScheduledSeq {
            request,
            num_computed,
            num_new_tokens: new_tokens.len(),
            samples,
            is_decode,
            cached_tokens,
            first_block,
            slot,
            tokens: (t0, self.token_ids.len() as u32),
            blocks: (b0, self.block_ids.len() as u32),
        });
    }

    /// Take the sequence in `slot` back out of the step (preempted after it was scheduled):
    /// its tokens and block table leave the flat buffers. Its share, if it was scheduled.
    pub(crate) fn remove(&mut self, slot: u32) -> Option<ScheduledSeq> {
        let i = self.seqs.iter().position(|s| s.slot == slot)?;
        let gone = self.seqs.remove(i);
        let (t0, t1) = gone.tokens;
        let (b0, b1) = gone.blocks;
        self.token_ids.drain(t0 as usize..t1 as usize);
        self.block_ids.drain(b0 as usize..b1 as usize);
        // Later sequences' ranges follow the removed one's.
        for s in &mut self.seqs[i..] {
            s.tokens = (s.tokens.0 - (t1 - t0), s.tokens.1 - (t1 - t0));
            s.blocks = (s.blocks.0 - (b1 - b0), s.blocks.1 - (b1 - b0));
        }
        Some(gone)
    }

    /// The token ids the `i`-th scheduled sequence processes this step.
    pub fn tokens(&self, i: usize) -> &[u32] {
        let (a, b) = self.seqs[i].tokens;
        &self.token_ids[a as usize..b as usize]
    }

    /// The `i`-th scheduled sequence's block table (covers its context after this step;
    /// empty from a scheduler built [`without_block_tables`](super::Scheduler::without_block_tables)).
    pub fn block_table(&self, i: usize) -> &[BlockId] {
        let (a, b) = self.seqs[i].blocks;
        &self.block_ids[a as usize..b as usize]
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Tokens processed this step, over all sequences.
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Sequences from which a token is sampled (the length `complete` expects).
    pub fn num_sampling(&self) -> usize {
        self.seqs.iter().filter(|s| s.samples).count()
    }

    pub fn num_decodes(&self) -> usize {
        self.seqs.iter().filter(|s| s.is_decode).count()
    }

    /// Prompt (and recompute) tokens processed this step.
    pub fn num_prefill_tokens(&self) -> usize {
        self.seqs
            .iter()
            .filter(|s| !s.is_decode)
            .map(|s| s.num_new_tokens)
            .sum()
    }
}

/// What happened to a request in a step.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A sampled token; `prev_token_time` is when the request's previous output token was
    /// computed — `None` for its first (TTFT) — so a driver gets the inter-token gap without
    /// keeping a timeline per request.
    Token {
        request: RequestId,
        token: u32,
        prev_token_time: Option<f64>,
    },
    /// The request ended; its KV is already released.
    Finished {
        request: RequestId,
        reason: FinishReason,
        stats: RequestStats,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sequence taken back out of a step leaves nothing of its own behind, and the others
    /// keep their tokens and block tables.
    #[test]
    fn a_removed_sequence_leaves_the_others_whole() {
        let mut plan = StepPlan::default();
        plan.reset(1, 0.0, 16);
        for (slot, tokens, blocks) in [
            (0u32, &[1u32, 2][..], &[10u32][..]),
            (1, &[3, 4, 5], &[11, 12]),
            (2, &[6], &[13, 14, 15]),
        ] {
            plan.push(
                RequestId(slot as u64),
                slot,
                0,
                tokens,
                true,
                false,
                0,
                blocks[0],
                blocks,
            );
        }
        assert!(plan.remove(7).is_none(), "not in the step");
        let gone = plan.remove(1).unwrap();
        assert_eq!((gone.request, gone.num_new_tokens), (RequestId(1), 3));
        assert_eq!(plan.num_tokens(), 3);
        let ids: Vec<u64> = plan.seqs.iter().map(|s| s.request.0).collect();
        assert_eq!(ids, [0, 2]);
        assert_eq!(
            (plan.tokens(0), plan.block_table(0)),
            (&[1, 2][..], &[10][..])
        );
        assert_eq!(
            (plan.tokens(1), plan.block_table(1)),
            (&[6][..], &[13, 14, 15][..])
        );
        assert!(plan.remove(2).is_some() && plan.remove(0).is_some());
        assert!(plan.is_empty() && plan.num_tokens() == 0);
    }
}
