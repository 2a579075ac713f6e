//! What vLLM's `bad_words` cost the host sampler per token: greedy sampling over a
//! 151,936-token row (Qwen's vocabulary) with no bad words, then with 16 and 128 words of
//! three tokens (the most a request may give: 128), drawn so that none matches, and with
//! 128 words whose first two tokens are the ones the output repeats, so that every word's
//! last token is banned at every step (the most work a ban does). Prints `name: value unit`
//! lines: the time per sampled token, best of 5 runs of 2,000 tokens, and the difference
//! from no bad words.
//!
//! `cargo run --release -p infer-engine --example bad_words_cost`

use std::time::Instant;

use infer_engine::runtime::sampling::{Sampler, SamplingParams};

const VOCAB: usize = 151_936;
const TOKENS: usize = 2_000;

/// Seconds per token sampling `TOKENS` tokens with `bad_words`, best of 5.
fn per_token(bad_words: &[Vec<u32>], logits: &[Vec<f32>]) -> f64 {
    (0..5)
        .map(|_| {
            let params = SamplingParams {
                bad_words: bad_words.to_vec(),
                ..SamplingParams::greedy()
            };
            let mut sampler = Sampler::new(params, &[], 0);
            let start = Instant::now();
            for i in 0..TOKENS {
                let t = sampler.sample(&logits[i % logits.len()]).unwrap();
                std::hint::black_box(t.token);
            }
            start.elapsed().as_secs_f64() / TOKENS as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    // Two rows that favour tokens 11 and 12 in turn: the output is 11, 12, 11, 12, ...
    let logits: Vec<Vec<f32>> = [11usize, 12]
        .iter()
        .map(|&t| {
            let mut row: Vec<f32> = (0..VOCAB).map(|i| (i % 97) as f32 * 0.01).collect();
            row[t] = 5.0;
            row
        })
        .collect();
    let none = per_token(&[], &logits);
    println!("bad_words_0_per_token: {:.2} us", none * 1e6);
    for n in [16u32, 128] {
        // Never matching: the output holds no token past 100.
        let words: Vec<Vec<u32>> = (0..n).map(|i| vec![1000 + i, 2000 + i, 3000 + i]).collect();
        let t = per_token(&words, &logits);
        println!(
            "bad_words_{n}_unmatched_per_token: {:.2} us ({:+.2} us)",
            t * 1e6,
            (t - none) * 1e6
        );
    }
    // Every word matches after each token: (12, 11, x) after ... 12, 11 and (11, 12, x) after
    // ... 11, 12: half the words ban their last token at each step.
    let words: Vec<Vec<u32>> = (0..128u32)
        .map(|i| match i % 2 {
            0 => vec![12, 11, 5000 + i],
            _ => vec![11, 12, 5000 + i],
        })
        .collect();
    let t = per_token(&words, &logits);
    println!(
        "bad_words_128_matched_per_token: {:.2} us ({:+.2} us)",
        t * 1e6,
        (t - none) * 1e6
    );
}
