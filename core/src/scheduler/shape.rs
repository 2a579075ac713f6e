//! A step plan reduced to the quantities step time depends on: what the simulator's cost
//! models price, the engine's step log records, and `engine profile` measures. A pure
//! function of the plan, so it lives beside it.

use super::StepPlan;

/// The step plan reduced to the quantities step time depends on.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepShape {
    pub num_seqs: usize,
    /// New tokens of prompt chunks (and recomputes).
    pub prefill_tokens: usize,
    pub prefill_seqs: usize,
    /// The longest prompt chunk in the step.
    pub max_prefill_chunk: usize,
    /// The longest context a prompt chunk attends to (its computed tokens plus the chunk):
    /// the key length of the step's largest attention-score matrix.
    pub max_prefill_context: usize,
    /// Sequences decoding one token.
    pub decode_seqs: usize,
    /// Sequences a token is sampled from (decodes plus prompts that complete).
    pub sampled: usize,
    /// Context tokens the step's attention reads: Σ context length after the step.
    pub context_tokens: usize,
    /// The part of `context_tokens` that belongs to decodes.
    pub decode_context_tokens: usize,
    /// The longest context a decode attends to: the key length of a decode batch padded to
    /// its longest sequence.
    pub max_decode_context: usize,
    /// The part of `decode_context_tokens` that decodes share through the prefix cache
    /// (their prefix-cache hits): blocks read more than once in the step, which a cache
    /// serves faster than distinct context. Counted per reader that found the prefix in
    /// the cache, so the sequence that computed it reads it as its own context.
    pub decode_shared_context_tokens: usize,
    /// Query × key pairs attention computes: Σ over sequences of
    /// new × computed + new × (new + 1) / 2 (causal within the chunk).
    pub attention_pairs: f64,
    /// Σ over prompt chunks of chunk length²: the square block of a chunk attending to
    /// itself, masked half included (what an attention without causal skipping computes).
    pub chunk_self_pairs: f64,
    /// Sampled sequences whose output follows a grammar (structured output): each pays
    /// the grammar's host cost for its token. The plan does not know it; the driver that
    /// knows which requests are constrained sets it.
    pub constrained_seqs: usize,
}

impl StepShape {
    pub fn of(plan: &StepPlan) -> StepShape {
        let mut s = StepShape {
            num_seqs: plan.seqs.len(),
            ..StepShape::default()
        };
        for q in &plan.seqs {
            let n = q.num_new_tokens;
            if q.is_decode {
                s.decode_seqs += 1;
                s.decode_context_tokens += q.context_len();
                s.max_decode_context = s.max_decode_context.max(q.context_len());
                s.decode_shared_context_tokens += q.cached_tokens.min(q.context_len());
            } else {
                s.prefill_tokens += n;
                s.prefill_seqs += 1;
                s.max_prefill_chunk = s.max_prefill_chunk.max(n);
                s.max_prefill_context = s.max_prefill_context.max(q.context_len());
                s.chunk_self_pairs += (n * n) as f64;
            }
            if q.samples {
                s.sampled += 1;
            }
            s.context_tokens += q.context_len();
            let (n, c) = (n as f64, q.num_computed as f64);
            s.attention_pairs += n * c + n * (n + 1.0) / 2.0;
        }
        s
    }

    /// New tokens over all sequences.
    pub fn new_tokens(&self) -> usize {
        self.prefill_tokens + self.decode_seqs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Request, Scheduler, SchedulerConfig};

    #[test]
    fn shapes_count_prefill_decode_and_attention() {
        let mut s = Scheduler::new(SchedulerConfig {
            prefix_caching: false,
            ..Default::default()
        });
        s.add_request(Request::new(1, vec![5; 100], 4), 0.0)
            .unwrap();
        let plan = s.schedule(0.0);
        let shape = StepShape::of(&plan);
        assert_eq!(
            (shape.prefill_tokens, shape.decode_seqs, shape.sampled),
            (100, 0, 1)
        );
        assert_eq!(shape.attention_pairs, 100.0 * 101.0 / 2.0);
        assert_eq!(
            (shape.max_prefill_chunk, shape.max_prefill_context),
            (100, 100)
        );
        let ev = s.complete(plan, &[7], 0.01);
        assert_eq!(ev.len(), 1);
        let plan = s.schedule(0.01);
        let shape = StepShape::of(&plan);
        assert_eq!(
            (
                shape.prefill_tokens,
                shape.decode_seqs,
                shape.context_tokens,
                shape.decode_context_tokens
            ),
            (0, 1, 101, 101)
        );
        assert_eq!(shape.max_decode_context, 101);
        assert_eq!(shape.attention_pairs, 101.0);
    }

    #[test]
    fn decodes_that_hit_the_prefix_cache_count_their_shared_context() {
        let mut s = Scheduler::new(SchedulerConfig {
            block_size: 16,
            ..Default::default()
        });
        s.add_request(Request::new(1, vec![5; 48], 4), 0.0).unwrap();
        let plan = s.schedule(0.0);
        s.complete(plan, &[7], 0.01);
        // The second prompt finds the first's full blocks (not its last token) in the cache.
        s.add_request(Request::new(2, vec![5; 48], 4), 0.01)
            .unwrap();
        let plan = s.schedule(0.01);
        s.complete(plan, &[7, 7], 0.02);
        let shape = StepShape::of(&s.schedule(0.02));
        assert_eq!(shape.decode_seqs, 2);
        assert_eq!(shape.decode_context_tokens, 50 + 49);
        assert_eq!(shape.max_decode_context, 50, "the longer of the two");
        assert_eq!(shape.decode_shared_context_tokens, 32);
    }
}
