//! Greedy output must not depend on how a sequence is executed: alone or batched with
//! others, paged with any block size or contiguous (one big block), prefilled whole or in
//! chunks mixed with other sequences' decodes, or resumed from KV blocks that already hold
//! its prefix, or after being preempted or kept waiting for KV blocks. Also checks the exact
//! extent of the sliding window.

mod common;

use anyhow::Result;
use common::*;
use infer_core::{KvPreemption, SchedulerConfig};
use infer_engine::runtime::engine_core::EngineCore;
use infer_engine::runtime::sampling::{argmax, SamplingParams};
use infer_engine::tools::generate::{generate, GenerateOptions, GenerateRequest};
use infer_engine::{Arch, ForwardBatch, KvCache, LoadedModel, SeqChunk};

const NEW_TOKENS: usize = 8;

fn requests(lm: &LoadedModel) -> Vec<GenerateRequest> {
    let vocab = lm.config.vocab_size;
    [5usize, 17, 33, 2, 12]
        .iter()
        .enumerate()
        .map(|(i, &len)| GenerateRequest {
            prompt: prompt(i as u64 + 100, len, vocab),
            params: SamplingParams::greedy(),
            max_tokens: NEW_TOKENS,
            stop_strings: Default::default(),
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            keep_special_tokens: false,
            forks: Vec::new(),
            prompt_logprobs: None,
            constraint: None,
            priority: 0,
        })
        .collect()
}

fn run(
    lm: &LoadedModel,
    reqs: &[GenerateRequest],
    block_size: usize,
    step_tokens: Option<usize>,
) -> Result<Vec<Vec<u32>>> {
    let opts = GenerateOptions {
        block_size,
        step_tokens,
        ..GenerateOptions::default()
    };
    Ok(generate(lm, reqs, opts, |_, _| {})?
        .into_iter()
        .map(|o| o.tokens)
        .collect())
}

fn check_invariance(
    arch: Arch,
    patch: impl Fn(&mut infer_engine::tools::make_model::ModelSpec),
) -> Result<()> {
    let mut s = spec(arch);
    patch(&mut s);
    let (_tmp, dir) = tiny_model(&s)?;
    let lm = load(&dir)?;
    let reqs = requests(&lm);
    // Reference: each request alone, whole prefill, block size 16.
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| Ok(run(&lm, std::slice::from_ref(r), 16, None)?.remove(0)))
        .collect::<Result<_>>()?;
    assert!(alone.iter().all(|t| t.len() == NEW_TOKENS));
    let distinct: std::collections::HashSet<u32> = alone.iter().flatten().copied().collect();
    assert!(distinct.len() > 5, "degenerate model output {alone:?}");

    let max_pos = lm.config.max_position_embeddings;
    // Step budgets below the 5 requests are raised to 5: decodes plus one-token chunks.
    for (block_size, chunk) in [
        (16, None),
        (1, None),
        (3, None),
        (max_pos, None),
        (16, Some(1)),
        (4, Some(5)),
        (3, Some(7)),
        (max_pos, Some(8)),
    ] {
        let batched = run(&lm, &reqs, block_size, chunk)?;
        assert_eq!(
            batched,
            alone,
            "{} block_size {block_size} step budget {chunk:?}",
            arch.name()
        );
    }
    Ok(())
}

/// A pool of 19 blocks of 4 tokens holds the five requests' prompts (5–33 tokens, 8 new
/// each: 30 blocks at their longest) but not their decodes: with `Recompute` a sequence is
/// preempted and prefilled again, with `Wait` sequences sit out steps holding their blocks
/// and none is preempted. Either way each generates what it generates alone.
#[test]
fn preempted_or_waiting_sequences_generate_what_they_generate_alone() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Llama))?;
    let lm = load(&dir)?;
    let reqs = requests(&lm);
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| Ok(run(&lm, std::slice::from_ref(r), 4, None)?.remove(0)))
        .collect::<Result<_>>()?;
    for policy in [KvPreemption::Recompute, KvPreemption::Wait] {
        let cfg = SchedulerConfig {
            num_gpu_blocks: 19,
            block_size: 4,
            max_model_len: 48,
            prefix_caching: false,
            kv_preemption: policy,
            ..SchedulerConfig::default()
        };
        let mut core = EngineCore::new(&lm, cfg, 0)?;
        let arrival = std::time::Instant::now();
        for (i, r) in reqs.iter().enumerate() {
            core.add(i as u64, r.clone(), arrival)?;
        }
        let mut out = vec![Vec::new(); reqs.len()];
        let mut steps = 0;
        while core.has_unfinished() {
            steps += 1;
            assert!(steps < 500, "{policy:?}: no progress");
            let step = core.step();
            assert!(step.failed.is_empty(), "{policy:?}: {:?}", step.failed);
            for t in step.tokens {
                out[t.id as usize].push(t.token);
            }
        }
        assert_eq!(out, alone, "{policy:?}");
        let st = core.stats();
        match policy {
            KvPreemption::Recompute => assert!(st.num_preemptions > 0, "{st:?}"),
            KvPreemption::Wait => {
                assert!(st.num_kv_waits > 0 && st.num_preemptions == 0, "{st:?}")
            }
        }
        assert_eq!(
            st.num_free_blocks, st.num_blocks,
            "{policy:?}: no block held"
        );
    }
    Ok(())
}

#[test]
fn llama_greedy_is_batch_invariant() -> Result<()> {
    check_invariance(Arch::Llama, |_| {})
}

#[test]
fn qwen3_greedy_is_batch_invariant() -> Result<()> {
    check_invariance(Arch::Qwen3, |_| {})
}

#[test]
fn qwen2_greedy_is_batch_invariant() -> Result<()> {
    check_invariance(Arch::Qwen2, |_| {})
}

#[test]
fn mistral_with_small_sliding_window_is_batch_invariant() -> Result<()> {
    // Every layer slides, over windows cut through chunks and blocks.
    check_invariance(Arch::Mistral, |s| s.sliding_window = 6)
}

#[test]
fn phi3_with_small_sliding_window_is_batch_invariant() -> Result<()> {
    check_invariance(Arch::Phi3, |s| s.sliding_window = 6)
}

#[test]
fn gemma3_with_small_sliding_window_is_batch_invariant() -> Result<()> {
    // Window 6 is shorter than most prompts and chunks: windows cut through chunks,
    // blocks and the padded decode group.
    check_invariance(Arch::Gemma3, |s| {
        s.sliding_window = 6;
        s.sliding_window_pattern = 2;
    })
}

/// Greedy continuation of a sequence whose first `start` tokens are already in the cache.
fn greedy_from(
    lm: &LoadedModel,
    cache: &mut KvCache,
    table: &[u32],
    tokens: &[u32],
    start: usize,
    n: usize,
) -> Result<Vec<u32>> {
    let mut tokens = tokens.to_vec();
    let mut start = start;
    let mut out = Vec::new();
    for _ in 0..n {
        let batch = ForwardBatch {
            seqs: vec![SeqChunk {
                tokens: tokens[start..].to_vec(),
                start_pos: start,
                block_table: table.to_vec(),
                sample: true,
                all_logits: false,
            }],
        };
        let logits: Vec<f32> = lm.model.forward(&batch, cache)?.row(0).to_vec();
        start = tokens.len();
        let t = argmax(&logits);
        tokens.push(t);
        out.push(t);
    }
    Ok(out)
}

#[test]
fn prefix_reuse_from_shared_or_copied_blocks_matches_full_prefill() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Llama))?;
    let lm = load(&dir)?;
    let vocab = lm.config.vocab_size;
    let shared = prompt(1, 8, vocab); // two full blocks of 4
    let a: Vec<u32> = shared.iter().copied().chain(prompt(2, 5, vocab)).collect();
    let b: Vec<u32> = shared.iter().copied().chain(prompt(3, 7, vocab)).collect();

    let mut fresh = lm.model.new_kv_cache(8, 4)?;
    let b_alone = greedy_from(&lm, &mut fresh, &[0, 1, 2, 3, 4, 5], &b, 0, NEW_TOKENS)?;

    let mut cache = lm.model.new_kv_cache(20, 4)?;
    let a_table = [0u32, 1, 2, 3, 4, 5];
    let a_out = greedy_from(&lm, &mut cache, &a_table, &a, 0, NEW_TOKENS)?;
    // B shares A's two prefix blocks and computes only its own suffix.
    let b_shared = greedy_from(&lm, &mut cache, &[0, 1, 6, 7, 8, 9], &b, 8, NEW_TOKENS)?;
    assert_eq!(b_shared, b_alone);
    // B from copies of the prefix blocks (copy-on-write style).
    lm.model.copy_block(&mut cache, 0, 10)?;
    lm.model.copy_block(&mut cache, 1, 11)?;
    let b_copied = greedy_from(
        &lm,
        &mut cache,
        &[10, 11, 12, 13, 14, 15],
        &b,
        8,
        NEW_TOKENS,
    )?;
    assert_eq!(b_copied, b_alone);
    // A, resumed after B ran, is unaffected by B's writes.
    let mut a_more = a.clone();
    a_more.extend(&a_out[..NEW_TOKENS - 1]);
    let a_resumed = greedy_from(&lm, &mut cache, &a_table, &a_more, a_more.len() - 1, 1)?;
    assert_eq!(a_resumed[0], a_out[NEW_TOKENS - 1]);
    Ok(())
}

#[test]
fn sliding_window_sees_exactly_the_last_window_positions() -> Result<()> {
    const W: usize = 4;
    let mut s = spec(Arch::Gemma3);
    s.sliding_window = W;
    s.sliding_window_pattern = 100; // every layer slides
    let (_tmp, dir) = tiny_model(&s)?;
    let lm = load(&dir)?;
    let tokens = prompt(5, 12, lm.config.vocab_size);
    // Block size 1: block i holds position i; block 19 is never written (all zeros).
    let table: Vec<u32> = (0..12).collect();
    let decode = |cache: &mut KvCache| -> Result<Vec<f32>> {
        let batch = ForwardBatch {
            seqs: vec![SeqChunk {
                tokens: vec![tokens[11]],
                start_pos: 11,
                block_table: table.clone(),
                sample: true,
                all_logits: false,
            }],
        };
        Ok(lm.model.forward(&batch, cache)?.row(0).to_vec())
    };
    let prefill = |cache: &mut KvCache| -> Result<()> {
        let batch = ForwardBatch {
            seqs: vec![SeqChunk {
                tokens: tokens[..11].to_vec(),
                start_pos: 0,
                block_table: table.clone(),
                sample: false,
                all_logits: false,
            }],
        };
        lm.model.forward(&batch, cache)?;
        Ok(())
    };
    let mut cache = lm.model.new_kv_cache(20, 1)?;
    prefill(&mut cache)?;
    let clean = decode(&mut cache)?;
    // Position 11 sees 8..=11. Wiping positions 0..8 must change nothing at all.
    prefill(&mut cache)?;
    for p in 0..(12 - W) as u32 {
        lm.model.copy_block(&mut cache, 19, p)?;
    }
    assert_eq!(decode(&mut cache)?, clean);
    // Wiping position 8, the oldest one inside the window, must change the logits.
    prefill(&mut cache)?;
    lm.model.copy_block(&mut cache, 19, (12 - W) as u32)?;
    assert!(rel_diff(&decode(&mut cache)?, &clean) > 1e-3);
    Ok(())
}

#[test]
fn interleaved_groups_in_one_step_match_each_sequence_alone() -> Result<()> {
    // A step of [decode A, 3-token chunk of B, decode C]: A and C share an attention group
    // that is not contiguous in the batch, so outputs are reordered back.
    let (_tmp, dir) = tiny_model(&spec(Arch::Qwen3))?;
    let lm = load(&dir)?;
    let vocab = lm.config.vocab_size;
    let (a, b, c) = (
        prompt(20, 6, vocab),
        prompt(21, 9, vocab),
        prompt(22, 7, vocab),
    );
    let tables = [vec![0u32, 1], vec![2, 3], vec![4, 5]];
    let history = [(&a, 5usize), (&b, 6), (&c, 6)];
    let step_chunks: Vec<SeqChunk> = history
        .iter()
        .zip(&tables)
        .map(|((toks, done), table)| SeqChunk {
            tokens: toks[*done..].to_vec(),
            start_pos: *done,
            block_table: table.clone(),
            sample: true,
            all_logits: false,
        })
        .collect();
    let prefill = |cache: &mut KvCache, i: usize| -> Result<()> {
        let (toks, done) = history[i];
        let chunk = SeqChunk {
            tokens: toks[..done].to_vec(),
            start_pos: 0,
            block_table: tables[i].clone(),
            sample: false,
            all_logits: false,
        };
        lm.model
            .forward(&ForwardBatch { seqs: vec![chunk] }, cache)?;
        Ok(())
    };
    let mut cache = lm.model.new_kv_cache(6, 8)?;
    for i in 0..3 {
        prefill(&mut cache, i)?;
    }
    let together = lm.model.forward(
        &ForwardBatch {
            seqs: step_chunks.clone(),
        },
        &mut cache,
    )?;
    assert_eq!((together.rows(), together.vocab()), (3, vocab));
    for (i, chunk) in step_chunks.into_iter().enumerate() {
        let mut solo_cache = lm.model.new_kv_cache(6, 8)?;
        prefill(&mut solo_cache, i)?;
        let solo: Vec<f32> = lm
            .model
            .forward(&ForwardBatch { seqs: vec![chunk] }, &mut solo_cache)?
            .row(0)
            .to_vec();
        let row: Vec<f32> = together.row(i).to_vec();
        assert!(rel_diff(&row, &solo) < 1e-5, "sequence {i}");
        assert_eq!(argmax(&row), argmax(&solo));
    }
    Ok(())
}
