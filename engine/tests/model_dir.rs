//! Loading model directories: good ones (sharded weights, bf16, chat template, EOS
//! merging) and bad ones, whose errors must name the file at fault.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use common::*;
use infer_engine::runtime::detokenize::IncrementalDetokenizer;
use infer_engine::runtime::tokenizer::{ChatMessage, TemplateOptions, TextTokenizer};
use infer_engine::tools::make_model::ModelSpec;
use infer_engine::{load_model_dir, Arch, ForwardBatch, LoadedModel, SeqChunk};
use std::collections::HashMap;
use std::path::Path;

fn load_err(dir: &Path) -> String {
    match load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

fn prefill_logits(lm: &LoadedModel) -> Result<Vec<f32>> {
    let tokens = prompt(9, 10, lm.config.vocab_size);
    let batch = ForwardBatch {
        seqs: vec![SeqChunk {
            tokens,
            start_pos: 0,
            block_table: vec![0],
            sample: true,
            all_logits: false,
        }],
    };
    let mut cache = lm.model.new_kv_cache(1, 16)?;
    Ok(lm.model.forward(&batch, &mut cache)?.row(0).to_vec())
}

#[test]
fn missing_files_are_named() -> Result<()> {
    for file in ["config.json", "tokenizer.json", "model.safetensors"] {
        let (_tmp, dir) = tiny_model(&spec(Arch::Llama))?;
        std::fs::remove_file(dir.join(file))?;
        let err = load_err(&dir);
        assert!(
            err.contains(file) && err.contains("missing"),
            "{file}: {err}"
        );
    }
    Ok(())
}

#[test]
fn unknown_architecture_names_config_and_architecture() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Llama))?;
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)?
        .replace("LlamaForCausalLM", "FooForCausalLM")
        .replace("\"llama\"", "\"foo\"");
    std::fs::write(&path, text)?;
    let err = load_err(&dir);
    assert!(
        err.contains("config.json") && err.contains("FooForCausalLM"),
        "{err}"
    );
    Ok(())
}

#[test]
fn shape_mismatch_names_tensor_file_and_shapes() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Llama))?;
    let path = dir.join("model.safetensors");
    let mut tensors: HashMap<String, Tensor> = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let name = "model.layers.1.self_attn.k_proj.weight";
    tensors.insert(
        name.to_string(),
        Tensor::zeros((16, 64), DType::F32, &Device::Cpu)?,
    );
    candle_core::safetensors::save(&tensors, &path)?;
    let err = load_err(&dir);
    assert!(
        err.contains(name) && err.contains("model.safetensors"),
        "{err}"
    );
    assert!(
        err.contains("expected [32, 64]") && err.contains("found [16, 64]"),
        "{err}"
    );
    Ok(())
}

/// Weights the config does not account for mean it describes another model: a Qwen2
/// checkpoint (biased q, k, v) labelled Llama would otherwise run without its biases.
#[test]
fn weights_the_config_does_not_use_are_refused() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Qwen2))?;
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)?
        .replace("Qwen2ForCausalLM", "LlamaForCausalLM")
        .replace("\"qwen2\"", "\"llama\"");
    std::fs::write(&path, text)?;
    let err = load_err(&dir);
    assert!(
        err.contains("6 weight(s)") && err.contains("model.layers.0.self_attn.k_proj.bias"),
        "{err}"
    );
    // Llama's own bias key accounts for them once o_proj has its bias too.
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    cfg["attention_bias"] = true.into();
    std::fs::write(&path, cfg.to_string())?;
    assert!(load_err(&dir).contains("tensor `model.layers.0.self_attn.o_proj.bias` not found"));
    // An output head stored beside tied embeddings is transformers' tie, not an extra.
    let (_tmp, dir) = tiny_model(&spec(Arch::Qwen3))?;
    let weights = dir.join("model.safetensors");
    let mut tensors: HashMap<String, Tensor> =
        candle_core::safetensors::load(&weights, &Device::Cpu)?;
    let table = tensors["model.embed_tokens.weight"].clone();
    tensors.insert("lm_head.weight".into(), table);
    candle_core::safetensors::save(&tensors, &weights)?;
    load(&dir)?;
    Ok(())
}

/// A multimodal Gemma 3 (gemma-3-4b-it's layout: `Gemma3ForConditionalGeneration`, the
/// text model's keys under `text_config`, its weights under a language-model prefix beside a
/// vision tower) serves its text model: the same logits as the text-only directory, for
/// both prefixes transformers has written.
#[test]
fn multimodal_gemma3_serves_its_text_model() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Gemma3))?;
    let text_only = prefill_logits(&load(&dir)?)?;
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let mut text_config = config.clone();
    for key in [
        "architectures",
        "eos_token_id",
        "bos_token_id",
        "torch_dtype",
    ] {
        text_config.as_object_mut().unwrap().remove(key);
    }
    let multimodal = serde_json::json!({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text_config, "eos_token_id": config["eos_token_id"],
        "torch_dtype": config["torch_dtype"],
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8}
    });
    let weights = dir.join("model.safetensors");
    let original: HashMap<String, Tensor> = candle_core::safetensors::load(&weights, &Device::Cpu)?;
    for prefix in ["language_model.model.", "model.language_model."] {
        let (_tmp2, mm) = tiny_model(&spec(Arch::Gemma3))?;
        std::fs::write(mm.join("config.json"), multimodal.to_string())?;
        let mut tensors: HashMap<String, Tensor> = original
            .iter()
            .map(|(n, t)| (n.replacen("model.", prefix, 1), t.clone()))
            .collect();
        // Beside the vision tower, under the prefix of the same layout.
        let outer = if prefix.starts_with("model.") {
            "model."
        } else {
            ""
        };
        let vision = Tensor::zeros((8, 8), DType::F32, &Device::Cpu)?;
        tensors.insert(
            format!("{outer}vision_tower.vision_model.post_layernorm.weight"),
            vision.clone(),
        );
        tensors.insert(
            format!("{outer}multi_modal_projector.mm_input_projection_weight"),
            vision,
        );
        candle_core::safetensors::save(&tensors, mm.join("model.safetensors"))?;
        let lm = load(&mm)?;
        assert_eq!(lm.config.arch, Arch::Gemma3, "{prefix}");
        assert_eq!(prefill_logits(&lm)?, text_only, "{prefix}");
    }
    Ok(())
}

#[test]
fn corrupt_safetensors_is_named() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Llama))?;
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path)?;
    std::fs::write(&path, &bytes[..bytes.len() / 2])?;
    let err = load_err(&dir);
    assert!(
        err.contains("corrupt") && err.contains("model.safetensors"),
        "{err}"
    );
    // A garbage header is caught too.
    std::fs::write(&path, b"\xff\xff\xff\xff\xff\xff\xff\x7fnot a header")?;
    let err = load_err(&dir);
    assert!(
        err.contains("corrupt") && err.contains("model.safetensors"),
        "{err}"
    );
    Ok(())
}

#[test]
fn sharded_weights_load_like_a_single_file() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Qwen3))?;
    let single = prefill_logits(&load(&dir)?)?;
    // Split the tensors over two shards listed by an index.
    let path = dir.join("model.safetensors");
    let tensors: HashMap<String, Tensor> = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let (mut a, mut b) = (HashMap::new(), HashMap::new());
    let mut weight_map = serde_json::Map::new();
    for (name, t) in tensors {
        let (shard, file) = if name.contains("layers.1") {
            (&mut b, "model-00002-of-00002.safetensors")
        } else {
            (&mut a, "model-00001-of-00002.safetensors")
        };
        weight_map.insert(name.clone(), file.into());
        shard.insert(name, t);
    }
    candle_core::safetensors::save(&a, dir.join("model-00001-of-00002.safetensors"))?;
    candle_core::safetensors::save(&b, dir.join("model-00002-of-00002.safetensors"))?;
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )?;
    std::fs::remove_file(&path)?;
    assert_eq!(prefill_logits(&load(&dir)?)?, single);
    // A missing shard is named.
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors"))?;
    let err = load_err(&dir);
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
    Ok(())
}

#[test]
fn bf16_model_runs_close_to_f32() -> Result<()> {
    let s = ModelSpec {
        dtype: DType::BF16,
        ..spec(Arch::Gemma3)
    };
    let (_tmp, dir) = tiny_model(&s)?;
    let stored = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    assert!(stored.values().all(|t| t.dtype() == DType::BF16));
    // Asked for f32, the CPU holds the bf16 weights widened; activations and KV are f32.
    let lm = load_model_dir(&dir, Some(DType::F32), infer_engine::Device::Cpu)?;
    assert_eq!(lm.model.weight_dtype(), DType::F32);
    assert_eq!(lm.model.kv_dtype(), DType::F32);
    // Same seed in f32: the weights differ only by bf16 rounding.
    let (_tmp32, dir32) = tiny_model(&spec(Arch::Gemma3))?;
    let (a, b) = (prefill_logits(&lm)?, prefill_logits(&load(&dir32)?)?);
    assert!(a.iter().all(|x| x.is_finite()));
    let d = rel_diff(&a, &b);
    assert!(d > 0.0 && d < 0.05, "bf16 vs f32 relative difference {d}");
    // By default (as `--dtype bf16`) a bf16 checkpoint stays bf16: the same weights,
    // multiplied with activations rounded to bf16 as PyTorch does for a bf16 checkpoint —
    // close to the f32 run, not identical.
    let held16 = load_model_dir(&dir, None, infer_engine::Device::Cpu)?;
    assert_eq!(held16.model.weight_dtype(), DType::BF16);
    assert_eq!(held16.model.kv_dtype(), DType::F32);
    let c = prefill_logits(&held16)?;
    let d16 = rel_diff(&a, &c);
    assert!(
        d16 > 0.0 && d16 < 0.02,
        "bf16 products vs f32 relative difference {d16}"
    );
    Ok(())
}

#[test]
fn chat_template_special_tokens_and_eos_ids() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Llama))?;
    let lm = load(&dir)?;
    let tok = &lm.tokenizer;
    let text = tok.apply_chat_template(
        &[
            ChatMessage::new("system", "Be brief. "),
            ChatMessage::new("user", "Hi"),
        ],
        &TemplateOptions::default(),
    )?;
    assert_eq!(
        text,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    let ids = tok.encode(&text, false)?;
    assert_eq!(ids[0], tok.token_to_id("<|begin_of_text|>").unwrap());
    assert_eq!(
        ids.iter()
            .filter(|&&t| Some(t) == tok.token_to_id("<|eot_id|>"))
            .count(),
        2
    );
    // generation_config's list [<|end_of_text|>, <|eot_id|>] merged with config and tokenizer.
    assert_eq!(lm.eos_token_ids, vec![1, 4]);

    let (_tmp2, gdir) = tiny_model(&spec(Arch::Gemma3))?;
    let g = load(&gdir)?;
    let text = g.tokenizer.apply_chat_template(
        &[
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Yo"),
        ],
        &TemplateOptions {
            add_generation_prompt: false,
            ..Default::default()
        },
    )?;
    assert_eq!(
        text,
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nYo<end_of_turn>\n"
    );
    Ok(())
}

/// Where the template lives decides which one serves, as transformers decides:
/// `chat_template.jinja` (what transformers 5 saves, with none in tokenizer_config.json)
/// first, then tokenizer_config.json's, then a processor's chat_template.json.
#[test]
fn chat_template_files_in_transformers_order() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Qwen3))?;
    let render = |dir: &Path| -> Result<String> {
        TextTokenizer::from_dir(dir)?.apply_chat_template(
            &[ChatMessage::new("user", "Hi")],
            &TemplateOptions::default(),
        )
    };
    let shipped = render(&dir)?;
    assert!(shipped.starts_with("<|im_start|>user\nHi"), "{shipped}");
    // A processor's file alone does not override tokenizer_config.json's template ...
    std::fs::write(
        dir.join("chat_template.json"),
        serde_json::json!({"chat_template": "legacy {{ messages[0].content }}"}).to_string(),
    )?;
    assert_eq!(render(&dir)?, shipped);
    // ... but serves where tokenizer_config.json has none (as transformers 5 saves it) ...
    let path = dir.join("tokenizer_config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    cfg.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&path, cfg.to_string())?;
    assert_eq!(render(&dir)?, "legacy Hi");
    // ... and chat_template.jinja wins over both.
    std::fs::write(
        dir.join("chat_template.jinja"),
        "jinja {{ messages[0].content }}",
    )?;
    assert_eq!(render(&dir)?, "jinja Hi");
    // A chat with tools goes through a `tool_use` template where there is one (transformers'
    // and vLLM's choice), from additional_chat_templates/ or a named list.
    let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
    let with_tools = |dir: &Path| -> Result<String> {
        TextTokenizer::from_dir(dir)?.apply_chat_template(
            &[ChatMessage::new("user", "Hi")],
            &TemplateOptions {
                tools: Some(tools.clone()),
                ..Default::default()
            },
        )
    };
    assert_eq!(with_tools(&dir)?, "jinja Hi");
    std::fs::create_dir(dir.join("additional_chat_templates"))?;
    std::fs::write(
        dir.join("additional_chat_templates/tool_use.jinja"),
        "tools {{ tools[0].function.name }} {{ messages[0].content }}",
    )?;
    assert_eq!(with_tools(&dir)?, "tools f Hi");
    assert_eq!(render(&dir)?, "jinja Hi");
    let (_tmp2, named) = tiny_model(&spec(Arch::Llama))?;
    let path = named.join("tokenizer_config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    cfg["chat_template"] = serde_json::json!([
        {"name": "tool_use", "template": "T {{ messages[0].content }}"},
        {"name": "default", "template": "D {{ messages[0].content }}"}
    ]);
    std::fs::write(&path, cfg.to_string())?;
    assert_eq!(
        (render(&named)?, with_tools(&named)?),
        ("D Hi".into(), "T Hi".into())
    );
    Ok(())
}

#[test]
fn incremental_detokenization_never_splits_utf8() -> Result<()> {
    let (_tmp, dir) = tiny_model(&spec(Arch::Llama))?;
    let lm = load(&dir)?;
    let tok = &lm.tokenizer;
    let text = "Hello naïve café — 日本語 ✓ 🎉 done";
    let ids = tok.encode(text, false)?;
    // The English-trained tokenizer splits the CJK and emoji into byte tokens.
    assert!(ids.len() > text.chars().count() / 2);
    let mut d = IncrementalDetokenizer::after(&[]);
    let mut out = String::new();
    let mut held_back = 0;
    for &id in &ids {
        let delta = d.push(tok, id)?;
        assert!(!delta.contains('\u{FFFD}'), "split character in {delta:?}");
        held_back += delta.is_empty() as usize;
        out.push_str(&delta);
    }
    out.push_str(&d.flush(tok)?);
    assert_eq!(out, text);
    assert!(
        held_back > 0,
        "multi-byte characters should have been held back at least once"
    );
    Ok(())
}

/// Llama 2's and Mistral's decoder (SentencePiece's `▁` for a space, byte fallback, and the
/// text's first leading space stripped) over a handful of whole-word tokens.
fn sentencepiece_tokenizer() -> Result<(tempfile::TempDir, TextTokenizer)> {
    let dir = tempfile::tempdir()?;
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": true})
    };
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true,
                  "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "\u{2581}The": 3,
                            "\u{2581}capital": 4, "\u{2581}is": 5, "\u{2581}Paris": 6,
                            "<0xE2>": 7, "<0x9C>": 8, "<0x93>": 9, ".": 10},
                  "merges": []}
    });
    std::fs::write(dir.path().join("tokenizer.json"), json.to_string())?;
    let tok = TextTokenizer::from_dir(dir.path())?;
    Ok((dir, tok))
}

/// The first generated token's text is what it adds after the prompt, as vLLM streams it:
/// `▁Paris` after "The capital is" is " Paris", though alone it decodes to "Paris".
#[test]
fn the_first_token_keeps_its_leading_space_after_the_prompt() -> Result<()> {
    let (_dir, tok) = sentencepiece_tokenizer()?;
    let prompt = [1, 3, 4, 5];
    assert_eq!(tok.decode(&prompt)?, "The capital is");
    assert_eq!(tok.decode(&[6])?, "Paris", "alone, the space is stripped");
    let mut d = IncrementalDetokenizer::after(&prompt);
    assert_eq!(d.push(&tok, 6)?, " Paris");
    assert_eq!(d.push(&tok, 10)?, ".");
    // Without a prompt (or a tail that ends inside a character) there is no context.
    let mut d = IncrementalDetokenizer::after(&[]);
    assert_eq!(d.push(&tok, 6)?, "Paris");
    let mut d = IncrementalDetokenizer::after(&[3, 7, 8]);
    assert_eq!(d.push(&tok, 6)?, "Paris");
    Ok(())
}

/// Tokens that add no text (special tokens, skipped) leave the decode window: a model that
/// samples its end token over and over under `ignore_eos` does not make each decode longer
/// than the last. Characters split over byte tokens still come out whole, and a run of
/// bytes that can never make one (more than a character's first 3) comes out as U+FFFD
/// rather than growing the window.
#[test]
fn tokens_that_add_no_text_leave_the_decode_window() -> Result<()> {
    let (_dir, tok) = sentencepiece_tokenizer()?;
    let mut d = IncrementalDetokenizer::after(&[1, 3]);
    let mut out = String::new();
    for _ in 0..1000 {
        out.push_str(&d.push(&tok, 2)?);
        assert!(d.window_len() <= 2, "{}", d.window_len());
    }
    for id in [6, 2, 7, 8, 2, 9, 5] {
        out.push_str(&d.push(&tok, id)?);
    }
    out.push_str(&d.flush(&tok)?);
    assert_eq!(out, " Paris\u{2713} is");
    let mut d = IncrementalDetokenizer::after(&[]);
    let mut out = String::new();
    for _ in 0..100 {
        out.push_str(&d.push(&tok, 7)?);
        assert!(d.window_len() <= 4, "{}", d.window_len());
    }
    out.push_str(&d.flush(&tok)?);
    assert!(
        !out.is_empty() && out.chars().all(|c| c == '\u{FFFD}'),
        "{out:?}"
    );
    Ok(())
}

/// `skip_special_tokens: false`: a special token (`</s>` here, which the default drops) is
/// written out in the text, at its place among the others.
#[test]
fn kept_special_tokens_are_written_out() -> Result<()> {
    let (_dir, tok) = sentencepiece_tokenizer()?;
    let run = |d: IncrementalDetokenizer| -> Result<String> {
        let mut d = d;
        let mut out = String::new();
        for id in [6, 2, 5] {
            out.push_str(&d.push(&tok, id)?);
        }
        out.push_str(&d.flush(&tok)?);
        Ok(out)
    };
    assert_eq!(run(IncrementalDetokenizer::after(&[1, 3]))?, " Paris is");
    let kept = run(IncrementalDetokenizer::after(&[1, 3]).keeping_special_tokens())?;
    assert!(
        kept.starts_with(" Paris") && kept.contains("</s>") && kept.ends_with("is"),
        "{kept:?}"
    );
    Ok(())
}
