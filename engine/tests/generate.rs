//! The generation loop end to end: streamed text, stop strings, stop tokens, seeded
//! sampling independent of batching.

mod common;

use anyhow::Result;
use common::*;
use infer_core::FinishReason;
use infer_engine::runtime::detokenize::StopSet;
use infer_engine::runtime::sampling::SamplingParams;
use infer_engine::tools::generate::{generate, GenerateOptions, GenerateRequest};
use infer_engine::Arch;

/// Stop conditions of a request: a length, stop strings, stop token ids, EOS.
#[derive(Clone, Default)]
struct Stop {
    max_tokens: usize,
    stop: Vec<String>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
}

fn request(prompt: Vec<u32>, params: SamplingParams, stop: Stop) -> GenerateRequest {
    GenerateRequest {
        prompt,
        params,
        max_tokens: stop.max_tokens,
        stop_strings: StopSet::new(&stop.stop),
        stop_token_ids: stop.stop_token_ids,
        ignore_eos: stop.ignore_eos,
        keep_special_tokens: false,
        forks: Vec::new(),
        prompt_logprobs: None,
        constraint: None,
        priority: 0,
    }
}

#[test]
fn stop_strings_and_stop_tokens_end_generation_exactly() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Llama))?;
    let lm = load(&dir)?;
    let p = prompt(4, 6, lm.config.vocab_size);
    let free = Stop {
        max_tokens: 24,
        ignore_eos: true,
        ..Default::default()
    };
    let mut streamed = String::new();
    let full = generate(
        &lm,
        &[request(p.clone(), SamplingParams::greedy(), free.clone())],
        GenerateOptions::default(),
        |_, d| streamed.push_str(d),
    )?
    .remove(0);
    assert_eq!(full.finish, FinishReason::Length);
    assert_eq!(full.tokens.len(), 24);
    assert_eq!(streamed, full.text);
    assert_eq!(full.text, lm.tokenizer.decode(&full.tokens)?);

    // A stop string taken from the middle of the text: output ends right before it.
    let chars: Vec<char> = full.text.chars().collect();
    let at = chars.len() / 2;
    let stop: String = chars[at..at + 3].iter().collect();
    let cut = full.text.find(&stop).unwrap();
    let with_stop = Stop {
        stop: vec![stop.clone()],
        ..free.clone()
    };
    let out = generate(
        &lm,
        &[request(p.clone(), SamplingParams::greedy(), with_stop)],
        GenerateOptions::default(),
        |_, _| {},
    )?
    .remove(0);
    assert_eq!(out.finish, FinishReason::Stop);
    assert_eq!(out.text, full.text[..cut], "stop {stop:?}");

    // A stop token: generation ends on it, and its text is not emitted.
    let stop_id = full.tokens[2];
    let first = full.tokens.iter().position(|&t| t == stop_id).unwrap();
    let with_id = Stop {
        stop_token_ids: vec![stop_id],
        ..free
    };
    let out = generate(
        &lm,
        &[request(p, SamplingParams::greedy(), with_id)],
        GenerateOptions::default(),
        |_, _| {},
    )?
    .remove(0);
    assert_eq!(out.finish, FinishReason::Stop);
    assert_eq!(out.tokens, full.tokens[..=first]);
    assert_eq!(out.text, lm.tokenizer.decode(&full.tokens[..first])?);
    Ok(())
}

#[test]
fn seeded_sampling_reproduces_alone_or_batched() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Qwen3))?;
    let lm = load(&dir)?;
    let vocab = lm.config.vocab_size;
    let stop = Stop {
        max_tokens: 16,
        ignore_eos: true,
        ..Default::default()
    };
    let params = |seed| SamplingParams {
        temperature: 1.0,
        top_p: 0.95,
        top_k: 50,
        seed: Some(seed),
        ..Default::default()
    };
    let reqs: Vec<GenerateRequest> = (0..3)
        .map(|i| {
            request(
                prompt(i, 5 + 3 * i as usize, vocab),
                params(i + 1),
                stop.clone(),
            )
        })
        .collect();
    let opts = GenerateOptions::default();
    let batched: Vec<Vec<u32>> = generate(&lm, &reqs, opts, |_, _| {})?
        .into_iter()
        .map(|o| o.tokens)
        .collect();
    for (r, expect) in reqs.iter().zip(&batched) {
        let alone = generate(
            &lm,
            std::slice::from_ref(r),
            GenerateOptions {
                block_size: 5,
                ..opts
            },
            |_, _| {},
        )?
        .remove(0)
        .tokens;
        assert_eq!(&alone, expect);
    }
    // A different seed gives a different sample.
    let other = request(reqs[0].prompt.clone(), params(99), stop);
    assert_ne!(
        generate(&lm, &[other], opts, |_, _| {})?.remove(0).tokens,
        batched[0]
    );
    Ok(())
}
