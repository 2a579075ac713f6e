//! A minimal driver over the batch API: every request runs from the first step, prefills
//! in chunks of `prefill_chunk` tokens, then decodes one token per step, all sequences
//! batched together. It is the manual check behind `engine generate` and the reference
//! the tests compare batched and chunked execution against; serving uses the core
//! scheduler instead.

use crate::batch::{ForwardBatch, SeqChunk};
use crate::detokenize::{FinishReason, OutputStream, StopConditions};
use crate::model::LoadedModel;
use crate::sampling::{Sampler, SamplingParams};
use anyhow::{ensure, Result};

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub stop: StopConditions,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOutput {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
}

#[derive(Debug, Clone, Copy)]
pub struct GenerateOptions {
    pub block_size: usize,
    /// Largest prefill chunk per sequence per step.
    pub prefill_chunk: usize,
    /// Seed for requests without their own.
    pub default_seed: u64,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            block_size: 16,
            prefill_chunk: 512,
            default_seed: 0,
        }
    }
}

struct Running {
    tokens: Vec<u32>,
    /// Tokens whose KV is in the cache.
    computed: usize,
    prompt_len: usize,
    blocks: Vec<u32>,
    sampler: Sampler,
    output: OutputStream,
    text: String,
    done: Option<FinishReason>,
}

/// Generates for all `requests` together. `on_text(i, delta)` receives streamed text.
pub fn generate(
    lm: &LoadedModel,
    requests: &[GenerateRequest],
    opts: GenerateOptions,
    mut on_text: impl FnMut(usize, &str),
) -> Result<Vec<GenerateOutput>> {
    ensure!(opts.prefill_chunk > 0, "prefill_chunk must be positive");
    let bs = opts.block_size;
    // Reserve every sequence's blocks up front: this driver never preempts.
    let mut next_block = 0u32;
    let mut seqs: Vec<Running> = requests
        .iter()
        .map(|r| {
            let max_len = r.prompt.len() + r.stop.max_tokens;
            let n = max_len.div_ceil(bs) as u32;
            let blocks = (next_block..next_block + n).collect();
            next_block += n;
            Running {
                tokens: r.prompt.clone(),
                computed: 0,
                prompt_len: r.prompt.len(),
                blocks,
                sampler: Sampler::new(r.params.clone(), &r.prompt, opts.default_seed),
                output: OutputStream::new(r.stop.clone()),
                text: String::new(),
                done: (r.stop.max_tokens == 0).then_some(FinishReason::Length),
            }
        })
        .collect();
    for (r, s) in requests.iter().zip(&seqs) {
        ensure!(!r.prompt.is_empty(), "empty prompt");
        ensure!(
            s.prompt_len + r.stop.max_tokens <= lm.config.max_position_embeddings,
            "prompt + max_tokens exceeds the model's {} positions",
            lm.config.max_position_embeddings
        );
    }
    let mut cache = lm.model.new_kv_cache(next_block.max(1) as usize, bs)?;

    loop {
        let active: Vec<usize> = (0..seqs.len())
            .filter(|&i| seqs[i].done.is_none())
            .collect();
        if active.is_empty() {
            break;
        }
        let batch = ForwardBatch {
            seqs: active
                .iter()
                .map(|&i| {
                    let s = &seqs[i];
                    let end = (s.computed + opts.prefill_chunk).min(s.tokens.len());
                    SeqChunk {
                        tokens: s.tokens[s.computed..end].to_vec(),
                        start_pos: s.computed,
                        block_table: s.blocks.clone(),
                        sample: end == s.tokens.len(),
                    }
                })
                .collect(),
        };
        let logits = lm.model.forward(&batch, &mut cache)?;
        let mut row = 0;
        for (&i, chunk) in active.iter().zip(&batch.seqs) {
            let s = &mut seqs[i];
            s.computed += chunk.tokens.len();
            if !chunk.sample {
                continue;
            }
            let t = s.sampler.sample(logits.row(row)).token;
            row += 1;
            s.tokens.push(t);
            let delta = s.output.push(&lm.tokenizer, t)?;
            if !delta.is_empty() {
                on_text(i, &delta);
                s.text.push_str(&delta);
            }
            s.done = s.output.finished();
        }
    }
    Ok(seqs
        .into_iter()
        .map(|s| GenerateOutput {
            tokens: s.tokens[s.prompt_len..].to_vec(),
            text: s.text,
            finish: s.done.unwrap_or(FinishReason::Length),
        })
        .collect())
}
