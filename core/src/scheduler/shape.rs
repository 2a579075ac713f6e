//! A step plan reduced to the quantities step time depends on: what the simulator's cost
//! models price, the engine's step log records, and `engine profile` measures. A pure
//! function of the plan, so it lives beside it.

use super::{ScheduledSeq, StepPlan};

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
    /// The part of `decode_context_tokens` that decodes share through the prefix cache:
    /// reads of blocks that another decode of the step has already read, which a cache
    /// serves faster than distinct context. Of the decodes that start from the same
    /// block, the one that computed the prefix reads it as its own context, and so does
    /// the first reader when that one is gone ([`shared_prefix_reads`]).
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
    /// The step cut into passes of sequences in consecutive KV slots, as a server with one
    /// KV stream per slot runs it ([`SlotPasses::of`]); empty unless the driver whose cost
    /// model prices that sets it.
    pub slot_passes: SlotPasses,
    /// The forward passes the step runs as: more than one where it holds more tokens than
    /// one pass of the server may ([`whole_sequence_passes`] of its
    /// [`crate::SchedulerConfig::max_pass_tokens`]); 0 where the driver did not count them.
    pub forward_passes: usize,
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
        s.decode_shared_context_tokens = shared_prefix_reads(plan);
        s
    }

    /// New tokens over all sequences.
    pub fn new_tokens(&self) -> usize {
        self.prefill_tokens + self.decode_seqs
    }

    /// Whether every sequence computes one token and samples from it: a step the engine
    /// runs as a decode (its decode attention kernel, its CUDA graphs), the prompts whose
    /// last chunk is one token included.
    pub fn one_token_each(&self) -> bool {
        self.num_seqs > 0 && self.new_tokens() == self.num_seqs && self.sampled == self.num_seqs
    }
}

/// How many forward passes a step of sequences with `new_tokens` each runs as, where a pass
/// holds at most `max_tokens`: the sequences in order, each whole, a pass closed when the
/// next would take it past `max_tokens`; a sequence larger than a pass runs as pieces of
/// `max_tokens`, its last piece sharing a pass with what follows. The rule of the engine's
/// `ForwardBatch::passes`, which the simulator's cost models price.
pub fn whole_sequence_passes(
    new_tokens: impl IntoIterator<Item = usize>,
    max_tokens: usize,
) -> usize {
    let max = max_tokens.max(1);
    // Passes so far, and the tokens of the last one.
    let (mut passes, mut last) = (0, 0);
    for n in new_tokens {
        if n <= max {
            if passes == 0 || last + n > max {
                passes += 1;
                last = 0;
            }
            last += n;
        } else {
            let pieces = n.div_ceil(max);
            passes += pieces;
            last = n - (pieces - 1) * max;
        }
    }
    passes
}

/// Context tokens of a step's decodes that re-read a block another decode of the step
/// reads too, through the prefix cache.
///
/// Decodes that share a prefix start from the same block (`first_block`). In such a group
/// every prefix-cache hit (`cached_tokens`) is a second read, except where nobody reads the
/// blocks as their own: a decode that computed the prefix (no hit) reads its whole context
/// as its own, and when none is left in the step, the longest hit is read first. So a lone
/// decode whose prompt hit the cache shares nothing, and `d` decodes that hit the same
/// prefix share `d − 1` reads of it, as `engine profile` measures them. Hits are prefixes of
/// each other within a group (prompts that share a first block share the chain up to the
/// shorter hit, except where two prompts diverged after cached blocks: counted shared).
///
/// Allocation-free: the groups with a hit go in a small table on the stack (a first pass),
/// then the decodes without one find their group there (a second); hits of groups past its
/// capacity count as their own context (no discount).
fn shared_prefix_reads(plan: &StepPlan) -> usize {
    const GROUPS: usize = 32;
    // (first block, longest hit, longest context of a decode without a hit)
    let mut groups = [(0u32, 0usize, 0usize); GROUPS];
    let mut used = 0;
    let hits = |q: &ScheduledSeq| q.cached_tokens.min(q.context_len());
    let decodes = || plan.seqs.iter().filter(|q| q.is_decode);
    let mut shared = 0;
    for (q, hit) in decodes().map(|q| (q, hits(q))).filter(|&(_, hit)| hit > 0) {
        let g = match groups[..used].iter().position(|g| g.0 == q.first_block) {
            Some(g) => g,
            None if used < GROUPS => {
                groups[used] = (q.first_block, 0, 0);
                used += 1;
                used - 1
            }
            None => continue,
        };
        shared += hit;
        groups[g].1 = groups[g].1.max(hit);
    }
    if used == 0 {
        return 0;
    }
    for q in decodes().filter(|q| hits(q) == 0) {
        if let Some(g) = groups[..used].iter_mut().find(|g| g.0 == q.first_block) {
            g.2 = g.2.max(q.context_len());
        }
    }
    // The part of each group's longest hit that no decode reads as its own: a first read.
    let first_reads: usize = groups[..used]
        .iter()
        .map(|&(_, longest_hit, own)| longest_hit.saturating_sub(own))
        .sum();
    shared - first_reads
}

/// Passes of one size class summed: [`SlotPasses`]' single-token passes or the rest.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PassSum {
    pub passes: usize,
    /// New tokens over the passes.
    pub tokens: usize,
    /// The part of `tokens` that are prompt tokens (not decodes).
    pub prompt_tokens: usize,
    /// Sequences a token is sampled from in these passes (their last token is here).
    pub sampled: usize,
    /// KV tokens the passes read and write: per sequence the pass's key count plus its
    /// new tokens (as the cost model counts a packed pass's).
    pub kv_tokens: f64,
    /// Query × key pairs attention scores over the passes.
    pub attention_pairs: f64,
    /// The part of `attention_pairs` in passes of one token per sequence (a decode's
    /// kind of attention: one query row against each sequence's keys).
    pub decode_pairs: f64,
    /// The largest pass's new tokens and key count.
    pub max_tokens: usize,
    pub max_keys: usize,
}

/// A step as llama.cpp's server runs it with a KV stream per slot (`kv_unified = false`,
/// its default for several slots): its batch — decodes in slot order, then prompt tokens
/// in slot order — is cut into passes (`llama_batch_allocr::split_equal`, sequential),
/// each of sequences in consecutive slots taking an equal number of tokens, at most
/// `micro_batch_tokens` in all. Decodes in slots 0, 4, 8 and 12 run as four passes, each
/// reading the weights (measured: 196 ms per token where slots 0–3 take 84 ms, docs/
/// results/foreign-servers-cpu.md). A pass's keys span its streams' longest context,
/// padded up to [`SLOT_KEY_PAD`] (`llama_kv_cache::get_n_kv`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SlotPasses {
    /// Passes of one token: a decode alone.
    pub single: PassSum,
    /// Passes of more.
    pub multi: PassSum,
}

/// Decode batch sizes that get a CUDA graph of their own, up to 256 as in vLLM V0 (which
/// captures every multiple of 8 there, and rounds a server's batch up to one). A decode step
/// runs in the graph of the smallest bucket that holds it ([`graph_bucket`]); the engine
/// captures these and the simulator prices a step as replayed by the same rule.
pub const GRAPH_BUCKETS: [usize; 13] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256];

/// The bucket a decode step of `n` sequences replays when the buckets up to `max` (the
/// server's largest batch) are captured: the smallest of at most `max` holding `n`. `None`:
/// the step runs eagerly (past the ladder, or past `max` where `max` falls between buckets).
pub fn graph_bucket(n: usize, max: usize) -> Option<usize> {
    GRAPH_BUCKETS
        .iter()
        .copied()
        .find(|&b| b >= n && b <= max)
        .filter(|_| n > 0)
}

/// llama.cpp pads a pass's key count to a multiple of this (`get_n_kv`).
pub const SLOT_KEY_PAD: usize = 256;

impl SlotPasses {
    /// The passes of `plan` (a contiguous KV cache's plan: each sequence's first block is
    /// its slot) with at most `micro_batch_tokens` tokens each and slots of `slot_tokens`.
    /// `padded`: each sequence's keys are its pass's padded key count (else its own).
    pub fn of(
        plan: &StepPlan,
        micro_batch_tokens: usize,
        slot_tokens: usize,
        padded: bool,
    ) -> SlotPasses {
        struct Seq {
            slot: u32,
            computed: usize,
            left: usize,
            samples: bool,
            decode: bool,
        }
        let mut seqs: Vec<Seq> = plan
            .seqs
            .iter()
            .map(|q| Seq {
                slot: q.first_block,
                computed: q.num_computed,
                left: q.num_new_tokens,
                samples: q.samples,
                decode: q.is_decode,
            })
            .collect();
        // The server's batch order: every decode in slot order, then prompts in slot order.
        seqs.sort_by_key(|q| (!q.decode, q.slot));
        let u = micro_batch_tokens.max(1);
        let mut out = SlotPasses::default();
        let mut set = Vec::new();
        while let Some(first) = seqs.iter().position(|q| q.left > 0) {
            // The sequences of the pass: the first with tokens left, then, in batch order,
            // each whose slot follows the last one taken.
            set.clear();
            set.push(first);
            for (i, q) in seqs.iter().enumerate().skip(first + 1) {
                if set.len() == u {
                    break;
                }
                if q.left > 0 && q.slot == seqs[*set.last().unwrap()].slot + 1 {
                    set.push(i);
                }
            }
            let least = set.iter().map(|&i| seqs[i].left).min().unwrap();
            let n = least.min(u / set.len()).max(1);
            let keys = set
                .iter()
                .map(|&i| seqs[i].computed + n)
                .max()
                .unwrap()
                .div_ceil(SLOT_KEY_PAD)
                .max(1)
                * SLOT_KEY_PAD;
            let keys = keys.min(slot_tokens.max(1));
            let tokens = n * set.len();
            let sum = if tokens == 1 {
                &mut out.single
            } else {
                &mut out.multi
            };
            sum.passes += 1;
            sum.tokens += tokens;
            sum.max_tokens = sum.max_tokens.max(tokens);
            sum.max_keys = sum.max_keys.max(keys);
            for &i in &set {
                let q = &mut seqs[i];
                if !q.decode {
                    sum.prompt_tokens += n;
                }
                let (own, c) = (q.computed + n, q.computed as f64);
                let (kv, pairs) = if padded {
                    (keys as f64, (n * keys) as f64)
                } else {
                    (own as f64, n as f64 * c + (n * (n + 1)) as f64 / 2.0)
                };
                sum.kv_tokens += kv + n as f64;
                sum.attention_pairs += pairs;
                if n == 1 {
                    sum.decode_pairs += pairs;
                }
                q.computed = own;
                q.left -= n;
                if q.left == 0 && q.samples {
                    sum.sampled += 1;
                }
            }
        }
        out
    }

    /// Whether the step was cut (the driver set it).
    pub fn is_set(&self) -> bool {
        self.single.passes + self.multi.passes > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Request, Scheduler, SchedulerConfig};

    /// A plan of (slot, computed, new tokens, decode) entries, each sampling at its end.
    fn slot_plan(seqs: &[(u32, usize, usize, bool)]) -> StepPlan {
        let mut plan = StepPlan::default();
        for (i, &(slot, computed, new, decode)) in seqs.iter().enumerate() {
            let tokens = vec![1; new];
            plan.push(
                crate::RequestId(i as u64),
                i as u32,
                computed,
                &tokens,
                true,
                decode,
                0,
                slot,
                &[],
            );
        }
        plan
    }

    /// Whole sequences in order, a pass closed when the next would not fit; a sequence
    /// larger than a pass in pieces, its last piece open to what follows.
    #[test]
    fn whole_sequence_passes_pack_in_order() {
        assert_eq!(whole_sequence_passes([30, 30, 50, 1, 64, 5], 64), 4);
        // Three prompts of 60 need three passes of 100, not ⌈180 / 100⌉ = 2.
        assert_eq!(whole_sequence_passes([60, 60, 60], 100), 3);
        // 250 = 100 + 100 + 50, and the 50 shares its pass with the next 40.
        assert_eq!(whole_sequence_passes([250, 40, 20], 100), 4);
        assert_eq!(whole_sequence_passes([1; 8], 8), 1);
        assert_eq!(whole_sequence_passes([], 8), 0);
    }

    #[test]
    fn decodes_in_consecutive_slots_share_a_pass_and_others_run_alone() {
        let together = SlotPasses::of(
            &slot_plan(&[
                (2, 99, 1, true),
                (0, 99, 1, true),
                (1, 99, 1, true),
                (3, 99, 1, true),
            ]),
            512,
            4096,
            true,
        );
        assert_eq!(together.single, PassSum::default());
        let m = together.multi;
        assert_eq!((m.passes, m.tokens, m.sampled, m.max_tokens), (1, 4, 4, 4));
        // 100 keys each, padded to 256.
        assert_eq!(
            (m.kv_tokens, m.attention_pairs, m.max_keys),
            (1028.0, 1024.0, 256)
        );

        let apart = SlotPasses::of(
            &slot_plan(&[
                (0, 99, 1, true),
                (4, 99, 1, true),
                (8, 99, 1, true),
                (12, 99, 1, true),
            ]),
            512,
            4096,
            false,
        );
        assert_eq!(apart.multi, PassSum::default());
        let s = apart.single;
        assert_eq!(
            (s.passes, s.tokens, s.prompt_tokens, s.sampled),
            (4, 4, 0, 4)
        );
        // Ragged: each its own 100 keys.
        assert_eq!((s.kv_tokens, s.attention_pairs), (404.0, 400.0));
        assert!(apart.is_set() && !SlotPasses::default().is_set());
    }

    #[test]
    fn a_prompt_in_the_next_slot_joins_the_decodes_for_one_token_then_runs_in_micro_batches() {
        // Decodes in slots 3 and 4, a 1,000-token prompt in slot 5: slot 5's first token
        // joins the decodes (equal tokens per sequence), the rest runs 512 then 487.
        let p = SlotPasses::of(
            &slot_plan(&[(5, 0, 1000, false), (3, 600, 1, true), (4, 700, 1, true)]),
            512,
            4096,
            true,
        );
        let m = p.multi;
        assert_eq!(
            (m.passes, m.tokens, m.prompt_tokens, m.sampled),
            (3, 1002, 1000, 3)
        );
        assert_eq!((m.max_tokens, m.max_keys), (512, 1024));
        // Keys: 768 (slots 3–5, longest 701) × 3; 768 (513) for 512 queries; 1,024 for 487.
        assert_eq!(m.kv_tokens, (3 * 768 + 768 + 1024 + 1002) as f64);
        assert_eq!(m.attention_pairs, (3 * 768 + 512 * 768 + 487 * 1024) as f64);
        // Ragged: the prompt's causal pairs, the decodes' own keys.
        let r = SlotPasses::of(
            &slot_plan(&[(5, 0, 1000, false), (3, 600, 1, true), (4, 700, 1, true)]),
            512,
            4096,
            false,
        );
        let causal = 1.0 + 512.0 * 1.0 + 512.0 * 513.0 / 2.0 + 487.0 * 513.0 + 487.0 * 488.0 / 2.0;
        assert_eq!(r.multi.attention_pairs, 601.0 + 701.0 + causal);
    }

    #[test]
    fn prompts_in_consecutive_slots_split_equally_and_keys_stop_at_the_slot() {
        // 300 and 100 tokens in slots 5 and 6: 100 each, then slot 5's last 200.
        let p = SlotPasses::of(
            &slot_plan(&[(6, 0, 100, false), (5, 0, 300, false)]),
            512,
            4096,
            true,
        );
        assert_eq!(
            (p.multi.passes, p.multi.tokens, p.multi.max_tokens),
            (2, 400, 200)
        );
        assert_eq!(p.multi.kv_tokens, (2 * 256 + 512 + 400) as f64);
        // A slot of 300 tokens holds no more keys than that.
        let small = SlotPasses::of(&slot_plan(&[(0, 280, 1, true)]), 512, 300, true);
        assert_eq!(small.single.kv_tokens, 301.0);
    }

    proptest::proptest! {
        /// Every new token runs in exactly one pass, no pass exceeds the micro-batch (a
        /// pass's sequences each take at least one token), every sampling sequence samples
        /// once, and decodes in slots that do not follow one another never share a pass.
        #[test]
        fn slot_passes_run_every_token_once(
            seqs in proptest::collection::btree_map(
                0u32..40,
                (0usize..3000, 1usize..1500, proptest::bool::ANY),
                1..20,
            ),
            u in 1usize..600,
        ) {
            let entries: Vec<(u32, usize, usize, bool)> = seqs
                .iter()
                .map(|(&slot, &(computed, new, decode))| {
                    (slot, computed, if decode { 1 } else { new }, decode)
                })
                .collect();
            let plan = slot_plan(&entries);
            let p = SlotPasses::of(&plan, u, 4096, true);
            let tokens: usize = entries.iter().map(|e| e.2).sum();
            let prompt: usize = entries.iter().filter(|e| !e.3).map(|e| e.2).sum();
            proptest::prop_assert_eq!(p.single.tokens + p.multi.tokens, tokens);
            proptest::prop_assert_eq!(p.single.tokens, p.single.passes);
            proptest::prop_assert_eq!(p.single.prompt_tokens + p.multi.prompt_tokens, prompt);
            proptest::prop_assert_eq!(p.single.sampled + p.multi.sampled, entries.len());
            proptest::prop_assert!(p.multi.max_tokens <= u);
            let decodes: Vec<u32> = entries.iter().filter(|e| e.3).map(|e| e.0).collect();
            let runs = decodes
                .iter()
                .enumerate()
                .filter(|&(i, &s)| i == 0 || s != decodes[i - 1] + 1)
                .count();
            proptest::prop_assert!(p.single.passes + p.multi.passes >= runs.max(1));
        }
    }

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

    #[test]
    fn a_prefix_is_shared_only_between_decodes_of_the_same_step() {
        let mut s = Scheduler::new(SchedulerConfig {
            block_size: 16,
            ..Default::default()
        });
        let prompt = |tail: u32| [vec![5; 48], vec![tail; 8]].concat();
        // Request 1 computes the 48-token prefix and ends after its first token.
        s.add_request(Request::new(1, prompt(1), 1), 0.0).unwrap();
        let plan = s.schedule(0.0);
        s.complete(plan, &[7], 0.01);
        // Alone, a decode that found the prefix in the cache reads it as its own context.
        s.add_request(Request::new(2, prompt(2), 8), 0.01).unwrap();
        let plan = s.schedule(0.01);
        assert_eq!(plan.seqs[0].cached_tokens, 48);
        s.complete(plan, &[7], 0.02);
        let plan = s.schedule(0.02);
        assert_eq!(StepShape::of(&plan).decode_shared_context_tokens, 0);
        s.complete(plan, &[7], 0.03);
        // Two more hits: three readers of one prefix, two of them re-reads.
        s.add_request(Request::new(3, prompt(3), 8), 0.03).unwrap();
        s.add_request(Request::new(4, prompt(4), 8), 0.03).unwrap();
        let plan = s.schedule(0.03);
        s.complete(plan, &[7, 7, 7], 0.04);
        let plan = s.schedule(0.04);
        let shape = StepShape::of(&plan);
        assert_eq!(shape.decode_seqs, 3);
        assert_eq!(shape.decode_shared_context_tokens, 2 * 48);
        // A prompt of other tokens starts from another block: nothing to share.
        s.complete(plan, &[7, 7, 7], 0.05);
        s.add_request(Request::new(5, vec![9; 56], 8), 0.05)
            .unwrap();
        let plan = s.schedule(0.05);
        s.complete(plan, &[7, 7, 7, 7], 0.06);
        let shape = StepShape::of(&s.schedule(0.06));
        assert_eq!(shape.decode_seqs, 4);
        assert_eq!(shape.decode_shared_context_tokens, 2 * 48);
    }
}
