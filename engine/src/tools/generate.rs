//! Run a fixed set of requests to completion through the engine core — the same scheduler,
//! step and text handling `engine serve` uses — with a scheduler sized so that nothing
//! waits for memory. It backs `engine generate` and the runner tests, which compare
//! batched, chunked and paged execution against one request alone.

use std::time::Instant;

use anyhow::{bail, ensure, Result};
use infer_core::{
    BatchingMode, FinishReason, KvAdmission, KvBackend, KvPreemption, SchedulerConfig,
};

use crate::runtime::engine_core::{EngineCore, EngineRequest};
use crate::runtime::model::LoadedModel;
use crate::runtime::tokenizer::ChatMessage;

pub use crate::runtime::engine_core::EngineRequest as GenerateRequest;

#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOutput {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
}

#[derive(Debug, Clone, Copy)]
pub struct GenerateOptions {
    pub block_size: usize,
    /// Token budget of a step (chunked prefill; raised to the number of requests so that
    /// every running sequence decodes each step). `None` prefills each prompt whole.
    pub step_tokens: Option<usize>,
    pub prefix_caching: bool,
    /// Seed for requests without their own.
    pub default_seed: u64,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            block_size: 16,
            step_tokens: Some(512),
            prefix_caching: true,
            default_seed: 0,
        }
    }
}

impl GenerateOptions {
    /// A continuous, paged scheduler with a KV pool that holds every request at its longest,
    /// so none is ever preempted or kept waiting.
    pub fn scheduler_config(
        &self,
        lm: &LoadedModel,
        requests: &[EngineRequest],
    ) -> SchedulerConfig {
        let n = requests.len().max(1);
        let positions = lm.config.max_position_embeddings;
        let lens = requests
            .iter()
            .map(|r| (r.prompt.len() + r.max_tokens).clamp(1, positions));
        let max_model_len = lens.clone().max().unwrap_or(1);
        let blocks: usize = lens.map(|len| len.div_ceil(self.block_size)).sum();
        SchedulerConfig {
            batching_mode: BatchingMode::Continuous,
            max_batch_size: n,
            kv_cache_backend: KvBackend::Paged,
            num_gpu_blocks: blocks.max(1),
            block_size: self.block_size,
            chunked_prefill: self.step_tokens.is_some(),
            prefill_chunk_size: self.step_tokens.unwrap_or(0).max(n),
            max_num_batched_tokens: None,
            prefix_caching: self.prefix_caching,
            max_model_len,
            max_waiting: None,
            kv_admission: KvAdmission::Prompt,
            kv_preemption: KvPreemption::Recompute,
            kv_watermark: 0.0,
            kv_victim: Default::default(),
            max_step_read_tokens: None,
            scheduling_policy: Default::default(),
        }
    }
}

/// Generates for all `requests` together. `on_text(i, delta)` receives streamed text.
/// `text` as the model's prompt tokens: with the special tokens its tokenizer adds, or,
/// with `chat`, as one user message through the model's chat template.
pub fn prompt_tokens(lm: &LoadedModel, text: &str, chat: bool) -> Result<Vec<u32>> {
    if !chat {
        return lm.tokenizer.encode(text, true);
    }
    if !lm.tokenizer.has_chat_template() {
        bail!("--chat: {} has no chat template", lm.dir.display());
    }
    let text = lm
        .tokenizer
        .apply_chat_template(&[ChatMessage::new("user", text)], &Default::default())?;
    lm.tokenizer.encode(&text, false)
}

pub fn generate(
    lm: &LoadedModel,
    requests: &[GenerateRequest],
    opts: GenerateOptions,
    mut on_text: impl FnMut(usize, &str),
) -> Result<Vec<GenerateOutput>> {
    ensure!(opts.block_size > 0, "block_size must be positive");
    let mut outputs: Vec<Option<GenerateOutput>> = vec![None; requests.len()];
    let mut core = EngineCore::new(lm, opts.scheduler_config(lm, requests), opts.default_seed)?;
    let arrival = Instant::now();
    for (i, r) in requests.iter().enumerate() {
        if r.max_tokens == 0 {
            outputs[i] = Some(GenerateOutput {
                tokens: Vec::new(),
                text: String::new(),
                finish: FinishReason::Length,
            });
            continue;
        }
        if let Err(e) = core.add(i as u64, r.clone(), arrival) {
            bail!("request {i}: {e}");
        }
    }
    let mut running: Vec<(Vec<u32>, String)> = vec![Default::default(); requests.len()];
    while core.has_unfinished() {
        let step = core.step();
        if let Some((id, _, error)) = step.failed.first() {
            bail!("request {id}: {error}");
        }
        ensure!(
            !step.idle,
            "the scheduler ran nothing although every request fits"
        );
        for t in step.tokens {
            let i = t.id as usize;
            let (tokens, text) = &mut running[i];
            tokens.push(t.token);
            if !t.text.is_empty() {
                on_text(i, &t.text);
                text.push_str(&t.text);
            }
            if let Some((finish, _)) = t.finish {
                let (tokens, text) = std::mem::take(&mut running[i]);
                outputs[i] = Some(GenerateOutput {
                    tokens,
                    text,
                    finish,
                });
            }
        }
    }
    outputs
        .into_iter()
        .enumerate()
        .map(|(i, o)| o.ok_or_else(|| anyhow::anyhow!("request {i} did not finish")))
        .collect()
}
