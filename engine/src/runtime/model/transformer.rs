//! The one decoder-only transformer used for every supported architecture and backend.
//!
//! All tokens of a step (prefill chunks and decodes together) are flattened into one
//! `[tokens, hidden]` activation, so every matmul sees the whole step; only attention is
//! per sequence. Architecture differences are flags of [`ModelConfig`], not separate code
//! paths; device differences are the [`Backend`]'s.

use super::config::ModelConfig;
use super::rope::inv_frequencies;
use super::weights::WeightStore;
use crate::runtime::backend::{AttnKind, Backend, Heads, KvLayout, Logits, Role};
use crate::runtime::batch::ForwardBatch;
use anyhow::{anyhow, bail, ensure, Context, Result};
use infer_kernels::sampling::{SampledRows, SamplingBatch};

/// A projection and its optional bias.
struct Linear<B: Backend> {
    w: B::Weight,
    bias: Option<B::Weight>,
}

impl<B: Backend> Linear<B> {
    fn forward(&self, b: &B, x: &B::Act) -> Result<B::Act> {
        b.linear(x, &self.w, self.bias.as_ref())
    }
}

struct Layer<B: Backend> {
    /// q, k and v projections fused into one matmul.
    qkv: Linear<B>,
    o: Linear<B>,
    /// Per-head norms of q and k (Qwen3, Gemma 3).
    qk_norm: Option<(B::Weight, B::Weight)>,
    attn_in_norm: B::Weight,
    attn_out_norm: Option<B::Weight>,
    mlp_in_norm: B::Weight,
    mlp_out_norm: Option<B::Weight>,
    /// gate and up projections fused into one matmul.
    gate_up: Linear<B>,
    down: Linear<B>,
    /// Index into [`Transformer::kinds`]: global or sliding-window attention.
    kind: usize,
}

/// One kind of attention layer, as the model holds it.
struct Kind<B: Backend> {
    window: Option<usize>,
    rope: B::Rope,
}

pub struct Transformer<B: Backend> {
    backend: B,
    cfg: ModelConfig,
    heads: Heads,
    embed: B::Weight,
    layers: Vec<Layer<B>>,
    norm: B::Weight,
    /// The output head; `None`: tied, the embedding table itself (see
    /// [`Backend::EMBEDDING_IS_LINEAR`]).
    lm_head: Option<B::Weight>,
    /// The attention kinds layers use, each once: `[global]`, `[sliding]` or `[global, sliding]`.
    kinds: Vec<Kind<B>>,
}

fn linear<B: Backend>(
    b: &B,
    w: &WeightStore,
    parts: &[(&str, usize)],
    inp: usize,
    bias: bool,
) -> Result<Linear<B>> {
    let load = |suffix: &str, shape: &[usize]| -> Result<Vec<_>> {
        parts
            .iter()
            .map(|(prefix, out)| {
                let mut shape = shape.to_vec();
                shape[0] = *out;
                w.get(&format!("{prefix}.{suffix}"), &shape)
            })
            .collect()
    };
    let weights = load("weight", &[0, inp])?;
    let weight = candle_core::Tensor::cat(&weights, 0)?;
    let bias = if bias {
        let biases = load("bias", &[0])?;
        Some(b.weight(candle_core::Tensor::cat(&biases, 0)?, Role::Bias)?)
    } else {
        None
    };
    Ok(Linear {
        w: b.weight(weight, Role::Linear)?,
        bias,
    })
}

/// A weight the model did not read means the config describes another model than the
/// weights do (a bias its architecture does not have, a layer past `num_hidden_layers`): the
/// outputs would be wrong without a sign, so loading stops and names them. Left alone:
/// rotary tables some checkpoints store (recomputed from the config), an output head stored
/// beside tied embeddings (transformers ties it to the table too), and a multimodal
/// checkpoint's vision tower and projector (the text model is served; said once).
fn refuse_unused_weights(w: &WeightStore, cfg: &ModelConfig) -> Result<()> {
    const VISION: [&str; 4] = [
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    ];
    let (vision, unused): (Vec<&str>, Vec<&str>) = w
        .unread()
        .into_iter()
        .filter(|n| !n.ends_with(".rotary_emb.inv_freq"))
        .filter(|n| !(cfg.tie_word_embeddings && n.ends_with("lm_head.weight")))
        .partition(|n| VISION.iter().any(|p| n.starts_with(p)));
    if let Some(first) = unused.first() {
        bail!(
            "{} weight(s) the {} architecture as configured does not use, first `{first}`: \
             config.json does not describe these weights",
            unused.len(),
            cfg.arch.name()
        );
    }
    if !vision.is_empty() {
        eprintln!(
            "serving the text model only: {} vision weights left unloaded",
            vision.len()
        );
    }
    Ok(())
}

impl<B: Backend> Transformer<B> {
    /// Builds the model from loaded weights (HF tensor names).
    pub fn load(cfg: &ModelConfig, w: &WeightStore, backend: B) -> Result<Self> {
        let b = &backend;
        let (h, d, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (nq, nkv) = (cfg.num_heads * d, cfg.num_kv_heads * d);
        let norm_role = Role::Norm {
            plus_one: cfg.norm_weight_plus_one,
        };
        let norm = |name: &str, dim: usize| b.weight(w.get(name, &[dim])?, norm_role);
        let embed_host = w.get("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let sliding_window = cfg
            .sliding_window
            .filter(|_| cfg.layer_sliding.contains(&true));
        let slides = |li: usize| cfg.layer_sliding[li] && sliding_window.is_some();
        // Only kinds some layer uses are built (each holds a rope table of
        // max_position_embeddings rows): where every layer slides (Mistral 7B v0.1), none is
        // global.
        let has_global = !(0..cfg.num_layers).all(slides);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for li in 0..cfg.num_layers {
            let p = format!("model.layers.{li}");
            let (q, k, v) = (
                format!("{p}.self_attn.q_proj"),
                format!("{p}.self_attn.k_proj"),
                format!("{p}.self_attn.v_proj"),
            );
            let qkv = if cfg.fused_projections {
                let fused = format!("{p}.self_attn.qkv_proj");
                linear(b, w, &[(&fused, nq + 2 * nkv)], h, cfg.qkv_bias)?
            } else {
                linear(b, w, &[(&q, nq), (&k, nkv), (&v, nkv)], h, cfg.qkv_bias)?
            };
            let o_proj = format!("{p}.self_attn.o_proj");
            let o = linear(b, w, &[(&o_proj, h)], nq, cfg.o_proj_bias)?;
            let layer_norm = |name: &str, dim: usize| norm(&format!("{p}.{name}.weight"), dim);
            let qk_norm = if cfg.qk_norm {
                Some((
                    layer_norm("self_attn.q_norm", d)?,
                    layer_norm("self_attn.k_norm", d)?,
                ))
            } else {
                None
            };
            // Llama/Qwen call the pre-MLP norm `post_attention_layernorm`; Gemma has a real
            // post-attention norm and a separate `pre_feedforward_layernorm`.
            let (attn_out_norm, mlp_in_norm, mlp_out_norm) = if cfg.sandwich_norms {
                (
                    Some(layer_norm("post_attention_layernorm", h)?),
                    layer_norm("pre_feedforward_layernorm", h)?,
                    Some(layer_norm("post_feedforward_layernorm", h)?),
                )
            } else {
                (None, layer_norm("post_attention_layernorm", h)?, None)
            };
            let (gate, up) = (format!("{p}.mlp.gate_proj"), format!("{p}.mlp.up_proj"));
            let gate_up = if cfg.fused_projections {
                let fused = format!("{p}.mlp.gate_up_proj");
                linear(b, w, &[(&fused, 2 * i)], h, cfg.mlp_bias)?
            } else {
                linear(b, w, &[(&gate, i), (&up, i)], h, cfg.mlp_bias)?
            };
            let down_proj = format!("{p}.mlp.down_proj");
            let down = linear(b, w, &[(&down_proj, h)], i, cfg.mlp_bias)?;
            layers.push(Layer {
                qkv,
                o,
                qk_norm,
                attn_in_norm: layer_norm("input_layernorm", h)?,
                attn_out_norm,
                mlp_in_norm,
                mlp_out_norm,
                gate_up,
                down,
                kind: if slides(li) {
                    usize::from(has_global)
                } else {
                    0
                },
            });
        }
        let lm_head = match (cfg.tie_word_embeddings, B::EMBEDDING_IS_LINEAR) {
            (true, true) => None,
            (true, false) => Some(b.weight(embed_host.clone(), Role::Linear)?),
            (false, _) => {
                Some(b.weight(w.get("lm_head.weight", &[cfg.vocab_size, h])?, Role::Linear)?)
            }
        };
        let max_pos = cfg.max_position_embeddings;
        let mut kinds = Vec::with_capacity(2);
        if has_global {
            kinds.push(Kind {
                window: None,
                rope: b.rope(
                    &inv_frequencies(d, cfg.rope_theta, &cfg.rope_scaling),
                    max_pos,
                    cfg.rope_scaling.attention_scaling(),
                )?,
            });
        }
        if let Some(window) = sliding_window {
            // Sliding layers have their own RoPE base (Gemma 3) or share the global one.
            let theta = cfg.rope_local_theta.unwrap_or(cfg.rope_theta);
            let scaling = match cfg.rope_local_theta {
                Some(_) => &super::config::RopeScaling::None,
                None => &cfg.rope_scaling,
            };
            kinds.push(Kind {
                window: Some(window),
                rope: b.rope(
                    &inv_frequencies(d, theta, scaling),
                    max_pos,
                    scaling.attention_scaling(),
                )?,
            });
        }
        let final_norm = norm("model.norm.weight", h)?;
        refuse_unused_weights(w, cfg)?;
        let heads = Heads {
            q: cfg.num_heads,
            kv: cfg.num_kv_heads,
            dim: d,
            scale: cfg.query_pre_attn_scalar.powf(-0.5) as f32,
            softcap: cfg.attn_logit_softcapping.map(|c| c as f32),
        };
        Ok(Self {
            embed: b.weight(embed_host, Role::Embedding)?,
            norm: final_norm,
            backend,
            cfg: cfg.clone(),
            heads,
            layers,
            lm_head,
            kinds,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// A KV store shaped for this model.
    pub fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> Result<B::Kv> {
        ensure!(
            num_blocks > 0 && block_size > 0,
            "KV cache needs at least one block of one slot"
        );
        let c = &self.cfg;
        self.backend.new_kv(KvLayout {
            num_layers: c.num_layers,
            num_blocks,
            block_size,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        })
    }

    /// Checks what the backends trust: token ids, positions, and block tables covering
    /// every position with ids inside the pool.
    fn validate(&self, batch: &ForwardBatch, kv: &KvLayout) -> Result<()> {
        let c = &self.cfg;
        ensure!(
            kv.num_layers == c.num_layers
                && kv.num_kv_heads == c.num_kv_heads
                && kv.head_dim == c.head_dim,
            "KV cache shape does not match the model"
        );
        ensure!(batch.total_tokens() > 0, "empty batch");
        for s in &batch.seqs {
            ensure!(
                !s.tokens.is_empty(),
                "a sequence in the batch has no tokens"
            );
            ensure!(
                s.end_pos() <= c.max_position_embeddings,
                "sequence reaches position {} beyond max_position_embeddings {}",
                s.end_pos(),
                c.max_position_embeddings
            );
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                bail!("token id {t} out of vocabulary ({})", c.vocab_size);
            }
            let need = s.end_pos().div_ceil(kv.block_size);
            ensure!(
                s.block_table.len() >= need,
                "position {} needs block #{} but the block table has {} blocks (block_size {})",
                s.end_pos() - 1,
                need - 1,
                s.block_table.len(),
                kv.block_size
            );
            if let Some(&b) = s.block_table[..need]
                .iter()
                .find(|&&b| b as usize >= kv.num_blocks)
            {
                bail!(
                    "block id {b} out of range: the KV pool has {} blocks",
                    kv.num_blocks
                );
            }
        }
        Ok(())
    }

    /// Runs one step: writes the batch's new K/V into `kv` and returns the f32 logits of
    /// each sequence's [`crate::runtime::batch::SeqChunk::logit_rows`] (the last token of a sampling
    /// chunk, every token of an `all_logits` one), in batch order.
    pub fn forward(&self, batch: &ForwardBatch, kv: &mut B::Kv) -> Result<Logits> {
        let c = &self.cfg;
        match self.head(batch, kv)? {
            Some(x) => self.backend.logits(&x, self.softcap()),
            None => Ok(Logits::empty(c.vocab_size)),
        }
    }

    /// Runs one step as [`Self::forward`] does, then samples each row `rows` gives (one per
    /// sampling sequence, in batch order; the batch asks for no other logits) on the
    /// backend. `rows` is asked once the step's work is queued, so on a GPU the host packs
    /// them (a grammar's mask takes tens to hundreds of µs a row) while the step computes.
    /// Errs if the backend samples only on the host.
    pub fn forward_sampled(
        &self,
        batch: &ForwardBatch,
        kv: &mut B::Kv,
        rows: &mut dyn FnMut() -> Result<SamplingBatch>,
    ) -> Result<SampledRows> {
        ensure!(
            batch.seqs.iter().all(|s| !s.all_logits),
            "prompt logprobs need the logits on the host"
        );
        match self.head(batch, kv)? {
            Some(x) => self
                .backend
                .sample(&x, self.softcap(), &rows()?)?
                .ok_or_else(|| anyhow!("this backend samples on the host only")),
            None => Ok(SampledRows::new(0)),
        }
    }

    fn softcap(&self) -> Option<f32> {
        self.cfg.final_logit_softcapping.map(|c| c as f32)
    }

    /// The step up to the head: its output for the rows whose next token is sampled.
    fn head(&self, batch: &ForwardBatch, kv: &mut B::Kv) -> Result<Option<B::Act>> {
        let b = &self.backend;
        self.validate(batch, &B::kv_layout(kv))?;
        let kinds: Vec<AttnKind<'_, B::Rope>> = self
            .kinds
            .iter()
            .map(|k| AttnKind {
                window: k.window,
                rope: &k.rope,
            })
            .collect();
        let step = b.prepare(batch, kv, &kinds)?;
        b.execute(&step, &mut || self.run(&step, kv))
    }

    /// Embedding to head: the head's output for the rows whose next token is sampled.
    fn run(&self, step: &B::Step, kv: &mut B::Kv) -> Result<Option<B::Act>> {
        let (b, c, heads) = (&self.backend, &self.cfg, &self.heads);
        let eps = c.rms_norm_eps as f32;
        let scale = c.scale_embeddings.then(|| (c.hidden_size as f32).sqrt());
        let mut x = b.embed(&self.embed, step, scale)?;
        let (nq, nkv) = (heads.q * heads.dim, heads.kv * heads.dim);
        let mut h = b.rms_norm(&x, &self.layers[0].attn_in_norm, eps)?;
        for (li, layer) in self.layers.iter().enumerate() {
            // Everything but the residual `x` and the normed input `h` is this layer's.
            let scratch = b.scratch_mark();
            let qkv = layer.qkv.forward(b, &h)?;
            let q = match &layer.qk_norm {
                // Q and K normed between the split and the rotation (Qwen3, Gemma 3).
                Some((qn, kn)) => {
                    let [q, k, v]: [B::Act; 3] = b
                        .split(&qkv, &[nq, nkv, nkv])?
                        .try_into()
                        .map_err(|_| anyhow::anyhow!("split returned the wrong number of parts"))?;
                    let (mut q, k) = (b.rms_norm(&q, qn, eps)?, b.rms_norm(&k, kn, eps)?);
                    b.rope_and_write_kv(&mut q, k, &v, kv, li, heads, step, layer.kind)
                        .with_context(|| format!("layer {li}"))?;
                    q
                }
                None => b
                    .qkv_rope_and_write_kv(&qkv, kv, li, heads, step, layer.kind)
                    .with_context(|| format!("layer {li}"))?,
            };
            let attn = b.attention(&q, kv, li, heads, step, layer.kind)?;
            let mut o = layer.o.forward(b, &attn)?;
            if let Some(n) = &layer.attn_out_norm {
                o = b.rms_norm(&o, n, eps)?;
            }
            b.add_rms_norm(&mut x, &o, &layer.mlp_in_norm, eps, &mut h)?;
            let gate_up = layer.gate_up.forward(b, &h)?;
            let mut m = layer.down.forward(b, &b.gated(&gate_up, c.activation)?)?;
            if let Some(n) = &layer.mlp_out_norm {
                m = b.rms_norm(&m, n, eps)?;
            }
            // The residual add feeds the next layer's input norm (or, after the last layer,
            // the sampled rows' final norm).
            match self.layers.get(li + 1) {
                Some(next) => b.add_rms_norm(&mut x, &m, &next.attn_in_norm, eps, &mut h)?,
                None => b.add(&mut x, &m)?,
            }
            b.release_scratch(scratch);
        }
        // Only rows whose next token is sampled go through the final norm and the head.
        let Some(x) = b.sampled_rows(&x, step)? else {
            return Ok(None);
        };
        let x = b.rms_norm(&x, &self.norm, eps)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        Ok(Some(b.linear(&x, head, None)?))
    }

    pub fn copy_block(&self, kv: &mut B::Kv, src: usize, dst: usize) -> Result<()> {
        let l = B::kv_layout(kv);
        ensure!(
            src < l.num_blocks && dst < l.num_blocks && src != dst,
            "copy_block({src}, {dst}) invalid for a pool of {} blocks",
            l.num_blocks
        );
        self.backend.copy_block(kv, src, dst)
    }
}
