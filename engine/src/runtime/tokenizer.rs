//! Text side of a model directory: `tokenizer.json` (HF tokenizers), the chat templates
//! (`chat_template.jinja`, `additional_chat_templates/`, `tokenizer_config.json`,
//! `chat_template.json`) and the special tokens of `tokenizer_config.json`.

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    /// The text; a list of text parts joined a line apart (vLLM's "string" format).
    pub content: String,
    /// The text parts, where the request gave `content` as a list: a template that loops
    /// over `message['content']` gets them as a list instead (vLLM's "openai" format).
    #[serde(skip)]
    pub parts: Option<Vec<String>>,
    /// An assistant turn's calls (OpenAI's `tool_calls`, as the template reads them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Value>,
    /// A `tool` turn: the call it answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The participant's name (OpenAI's `name`), for templates that write it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's thinking, which the template reads as `reasoning_content`
    /// (Qwen3's, QwQ's, GLM's, Kimi's) or `reasoning`: vLLM hands it over under both names.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<TurnReasoning>,
}

/// An assistant turn's thinking, written out under both names templates read it by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnReasoning(pub String);

impl Serialize for TurnReasoning {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(2))?;
        map.serialize_entry("reasoning_content", &self.0)?;
        map.serialize_entry("reasoning", &self.0)?;
        map.end()
    }
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
            parts: None,
            tool_calls: None,
            tool_call_id: None,
            name: None,
            reasoning: None,
        }
    }
}

pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// The `default` template.
    chat_template: Option<String>,
    /// The `tool_use` template, which transformers and vLLM render a chat with tools
    /// through where a model ships one (Hermes 2 Pro, Hermes 3).
    tool_use_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    /// `tokenizer_config.json`'s class name (`LlamaTokenizerFast`, …), for clients.
    tokenizer_class: Option<String>,
    /// What encoding with special tokens puts before the text (a BOS token, if any).
    prompt_prefix: Vec<u32>,
}

impl TextTokenizer {
    /// Loads `tokenizer.json` and, when present, `tokenizer_config.json` from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            anyhow::bail!("missing tokenizer file {}", path.display());
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path)
                .with_context(|| format!("cannot read {}", cfg_path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", cfg_path.display()))?
        } else {
            Value::Null
        };
        let prompt_prefix = {
            let ids = |special| {
                inner
                    .encode("a", special)
                    .map(|e| e.get_ids().to_vec())
                    .unwrap_or_default()
            };
            let (with, without) = (ids(true), ids(false));
            match with.len().checked_sub(without.len()) {
                Some(k) if with[k..] == without[..] => with[..k].to_vec(),
                _ => Vec::new(),
            }
        };
        let mut templates = chat_templates(dir, &cfg)?;
        Ok(Self {
            inner,
            chat_template: templates.remove("default"),
            tool_use_template: templates.remove("tool_use"),
            bos_token: special_token(cfg.get("bos_token")),
            eos_token: special_token(cfg.get("eos_token")),
            pad_token: special_token(cfg.get("pad_token")),
            tokenizer_class: cfg
                .get("tokenizer_class")
                .and_then(Value::as_str)
                .map(str::to_string),
            prompt_prefix,
        })
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Renders every chat through `template` in place of the model's own (with or without
    /// tools, as vLLM's `--chat-template` does). Refused here if it does not parse.
    pub fn with_chat_template(mut self, template: String) -> Result<Self> {
        check_chat_template(&template)?;
        self.chat_template = Some(template);
        self.tool_use_template = None;
        Ok(self)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The most bytes of text one token stands for: the longest vocabulary entry, in UTF-8
    /// (byte-level entries spell one byte per character, SentencePiece's `▁` three bytes
    /// for one space, byte-fallback `<0xNN>` six for one: each at least what it decodes to).
    pub fn max_token_bytes(&self) -> usize {
        self.inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// The tokens that alone are not whole UTF-8 text (a byte-level token of part of a
    /// character, a byte-fallback `<0xNN>` above 0x7F): decoded alone they end or begin
    /// mid-character. A streaming server holds text that ends mid-character back until the
    /// character completes (llama.cpp's, transformers' `DecodeStream`), so a run of such
    /// tokens reaches the client late and in one chunk.
    pub fn partial_character_ids(&self) -> Vec<u32> {
        (0..self.vocab_size() as u32)
            .filter(|&id| {
                self.inner
                    .decode(&[id], false)
                    .is_ok_and(|text| text.contains('\u{FFFD}'))
            })
            .collect()
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// What a client needs to tokenise as the server does, in the keys of vLLM's
    /// `/tokenizer_info` (lm-eval's remote tokenizer reads them; `/tokenize` and
    /// `/detokenize` do the rest).
    pub fn info(&self, model_max_length: usize) -> Value {
        serde_json::json!({
            "tokenizer_class": self.tokenizer_class, "bos_token": self.bos_token,
            "eos_token": self.eos_token, "pad_token": self.pad_token,
            "chat_template": self.chat_template, "model_max_length": model_max_length,
        })
    }

    /// `add_special_tokens`: apply the tokenizer's post-processor (e.g. prepend BOS). Off for
    /// text rendered by the chat template, which already contains its special tokens.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| anyhow!("tokenizer encode: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// One token's own text, special tokens included (`<|eot_id|>`), as vLLM names tokens in
    /// logprobs; `None` for an id with no text at all (an embedding row past the tokenizer's
    /// vocabulary).
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner
            .decode(&[id], false)
            .ok()
            .filter(|t| !t.is_empty())
    }

    /// A token's string in the vocabulary (`Ġhello`, byte-level marks and all), as
    /// transformers' `convert_ids_to_tokens` gives it; `None` past the vocabulary.
    pub fn token_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Decodes `ids`, dropping special tokens (BOS, end-of-turn, …).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, true)
    }

    /// Decodes `ids`, dropping special tokens or writing them out.
    pub fn decode_with(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| anyhow!("tokenizer decode: {e}"))
    }

    /// Renders the chat template (minijinja, with Python string methods as HF templates use)
    /// as transformers' `apply_chat_template` does with `options`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        options: &TemplateOptions,
    ) -> Result<String> {
        let tools = options.tools.as_ref();
        let template = match (tools, &self.tool_use_template) {
            (Some(_), Some(t)) => t,
            _ => self.chat_template.as_ref().context(
                "this model has no (default) chat template: none in chat_template.jinja, \
                 tokenizer_config.json or chat_template.json",
            )?,
        };
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_function("strftime_now", |_fmt: String| -> String {
            // Templates use it for "today's date" in system prompts; a fixed date keeps
            // prompts (and so runs) reproducible.
            "01 Jan 2025".to_string()
        });
        env.add_template("chat", template)
            .context("invalid chat_template")?;
        let as_json: Vec<Value> = if loops_over_content(template) {
            messages.iter().map(with_content_parts).collect()
        } else {
            messages.iter().map(|m| serde_json::json!(m)).collect()
        };
        let ctx = minijinja::context! {
            messages => as_json,
            tools => tools,
            add_generation_prompt => options.add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
            ..minijinja::Value::from_serialize(&options.kwargs)
        };
        let rendered = env
            .get_template("chat")?
            .render(ctx)
            .context("rendering chat_template")?;
        if !options.continue_final_message {
            return Ok(rendered);
        }
        // The rendering ends where the last message's text does, so that the model goes on
        // writing it. transformers' rule: find the trimmed text's last occurrence; keep its
        // trailing whitespace only where the template kept the text whole.
        let last = messages.last().context("no messages")?;
        let text = last
            .parts
            .as_ref()
            .and_then(|p| p.last())
            .unwrap_or(&last.content);
        let at = rendered.rfind(text.trim()).context(
            "continue_final_message is set but the final message does not appear in the \
             chat after applying the chat template",
        )?;
        let whole = text.trim_start();
        let kept_whole = rendered[at..].starts_with(whole) && whole.len() == text.len();
        let end = at
            + if kept_whole {
                whole.len()
            } else {
                text.trim().len()
            };
        Ok(rendered[..end].to_string())
    }
}

/// How a chat is rendered, as transformers' `apply_chat_template` and vLLM take it.
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateOptions {
    /// OpenAI's `tools` list, the template's `tools`.
    pub tools: Option<Value>,
    /// End with the assistant's turn opened (the default).
    pub add_generation_prompt: bool,
    /// End inside the last message instead, for the model to go on writing it.
    pub continue_final_message: bool,
    /// More variables for the template (vLLM's `chat_template_kwargs`, e.g. Qwen3's
    /// `enable_thinking`).
    pub kwargs: serde_json::Map<String, Value>,
}

impl Default for TemplateOptions {
    fn default() -> Self {
        Self {
            tools: None,
            add_generation_prompt: true,
            continue_final_message: false,
            kwargs: Default::default(),
        }
    }
}

/// The template `--chat-template ARG` names, as vLLM reads it: the file at `arg`, or where
/// none can be read and `arg` holds a `{`, `}` or newline, `arg` itself, its backslash
/// escapes (`\n`) decoded. A path that cannot be read, or a template that does not parse,
/// is an error saying so (before the model loads).
pub fn chat_template_arg(arg: &str) -> Result<String> {
    let template = match std::fs::read_to_string(arg) {
        Ok(text) => text,
        Err(e) if !arg.contains(['{', '}', '\n']) => {
            bail!("--chat-template {arg}: looks like a file path, but cannot be read: {e}")
        }
        Err(_) => unescape(arg),
    };
    check_chat_template(&template)?;
    Ok(template)
}

fn check_chat_template(template: &str) -> Result<()> {
    minijinja::Environment::new()
        .template_from_str(template)
        .context("invalid --chat-template")?;
    Ok(())
}

/// Python's `unicode_escape` for the escapes a template written on one line uses: `\n`,
/// `\t`, `\r`, `\\`, `\'` and `\"`; another backslash stays as written (Python would
/// also read `\xNN`, `\uNNNN` and the like, which templates do not need).
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        let escaped = match (c, chars.peek()) {
            ('\\', Some('n')) => '\n',
            ('\\', Some('t')) => '\t',
            ('\\', Some('r')) => '\r',
            ('\\', Some(&e @ ('\\' | '\'' | '"'))) => e,
            _ => {
                out.push(c);
                continue;
            }
        };
        chars.next();
        out.push(escaped);
    }
    out
}

/// Whether a template loops over a message's content (`{% for x in message['content'] %}`,
/// Gemma 3's and Llama 3.2's): vLLM then hands it the content as OpenAI's list of parts
/// (its "openai" content format), where other templates get one string.
fn loops_over_content(template: &str) -> bool {
    template.split("{%").skip(1).any(|block| {
        let statement = block.split("%}").next().unwrap_or("");
        let words: Vec<&str> = statement
            .trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace())
            .split_whitespace()
            .collect();
        match words.as_slice() {
            ["for", _, "in", iterable, ..] => {
                let iterable = iterable.split('|').next().unwrap_or("");
                iterable.ends_with("['content']")
                    || iterable.ends_with("[\"content\"]")
                    || iterable.ends_with(".content")
            }
            _ => false,
        }
    })
}

/// `m` for a template that loops over content: its parts as `{"type": "text", "text"}`
/// items (a string content as one part).
fn with_content_parts(m: &ChatMessage) -> Value {
    let mut v = serde_json::json!(m);
    let parts = m.parts.clone().unwrap_or_else(|| vec![m.content.clone()]);
    v["content"] = parts
        .into_iter()
        .map(|text| serde_json::json!({"type": "text", "text": text}))
        .collect();
    v
}

/// The named chat templates as transformers' tokenizer loads them: template files
/// (`chat_template.jinja`, what transformers 5 saves, as `default`, and
/// `additional_chat_templates/NAME.jinja`) replace `tokenizer_config.json`'s `chat_template`
/// (one template, the `default`, or a list of named ones). Where neither has one, a
/// processor's `chat_template.json` (multimodal repositories) gives the `default`; vLLM
/// prefers the processor's for a chat without tools where both exist, and Gemma 3's
/// repositories ship the same template in both.
fn chat_templates(dir: &Path, cfg: &Value) -> Result<HashMap<String, String>> {
    let read = |path: &Path| {
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
    };
    let mut files = HashMap::new();
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        files.insert("default".to_string(), read(&jinja)?);
    }
    let extra = dir.join("additional_chat_templates");
    if extra.is_dir() {
        let entries = std::fs::read_dir(&extra)
            .with_context(|| format!("cannot list {}", extra.display()))?;
        for entry in entries {
            let path = entry?.path();
            if let (Some(name), Some("jinja")) = (
                path.file_stem().and_then(|n| n.to_str()),
                path.extension().and_then(|e| e.to_str()),
            ) {
                files.insert(name.to_string(), read(&path)?);
            }
        }
    }
    if !files.is_empty() {
        return Ok(files);
    }
    let named = templates_in(cfg);
    if !named.is_empty() {
        return Ok(named);
    }
    let processor = dir.join("chat_template.json");
    if !processor.exists() {
        return Ok(HashMap::new());
    }
    let json: Value = serde_json::from_str(&read(&processor)?)
        .with_context(|| format!("{} is not valid JSON", processor.display()))?;
    Ok(templates_in(&json))
}

/// A `chat_template` key: one template (the `default`) or a list of `{name, template}`.
fn templates_in(cfg: &Value) -> HashMap<String, String> {
    match cfg.get("chat_template") {
        Some(Value::String(s)) => HashMap::from([("default".to_string(), s.clone())]),
        Some(Value::Array(list)) => list
            .iter()
            .filter_map(|t| {
                let name = t.get("name")?.as_str()?;
                let template = t.get("template")?.as_str()?;
                Some((name.to_string(), template.to_string()))
            })
            .collect(),
        _ => HashMap::new(),
    }
}

/// Special tokens are a string or an `AddedToken` object with `content`.
fn special_token(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// The core's tokenizer abstraction over a real `tokenizer.json`, so the workload generator
/// can cut prompts in this model's own tokens (what `engine verify` needs for the simulator
/// and the server to see the same prompt lengths).
impl infer_core::workload::Tokenizer for TextTokenizer {
    fn encode_with_offsets(&self, text: &str) -> Vec<infer_core::workload::Token> {
        let Ok(enc) = self.inner.encode(text, false) else {
            return Vec::new();
        };
        // Byte-level BPE offsets can fall inside a character or leave gaps (trimmed
        // spaces); snap them to character boundaries and make them contiguous.
        let floor = |mut i: usize| {
            i = i.min(text.len());
            while !text.is_char_boundary(i) {
                i -= 1;
            }
            i
        };
        let ids = enc.get_ids();
        let starts: Vec<usize> = enc.get_offsets().iter().map(|o| floor(o.0)).collect();
        let mut out = Vec::with_capacity(ids.len());
        let mut prev = 0;
        for (i, &id) in ids.iter().enumerate() {
            let start = prev;
            let end = if i + 1 < ids.len() {
                starts[i + 1].max(start)
            } else {
                text.len()
            };
            out.push(infer_core::workload::Token { id, start, end });
            prev = end;
        }
        out
    }

    fn name(&self) -> String {
        format!("tokenizer.json (vocab {})", self.vocab_size())
    }

    fn prompt_prefix(&self) -> Vec<u32> {
        self.prompt_prefix.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tokenizer with a given chat template, on a minimal vocabulary.
    fn with_template(template: &str) -> TextTokenizer {
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
            "model":{"type":"WordLevel","vocab":{"a":0,"<unk>":1},"unk_token":"<unk>"}}"#;
        TextTokenizer {
            inner: tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap(),
            chat_template: Some(template.to_string()),
            tool_use_template: None,
            bos_token: Some("<s>".into()),
            eos_token: Some("</s>".into()),
            pad_token: None,
            tokenizer_class: None,
            prompt_prefix: Vec::new(),
        }
    }

    #[test]
    fn renders_templates_that_use_python_methods_and_namespaces() -> Result<()> {
        // The constructs real templates (Qwen3, Llama 3.1) rely on. As in Jinja, `{%-`
        // trims the newline before it and booleans print as Python's True/False.
        let t = with_template(
            "{%- set ns = namespace(last_user=-1) %}\
             {%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}\
             {{- bos_token }}\
             {%- for m in messages %}\
               {%- if m.content.startswith('!') %}{{ raise_exception('no bangs') }}{%- endif %}\
               {%- set c = m.content.split('</think>')[-1].strip() %}\
               {{- m.role | upper }}({{ loop.index0 == ns.last_user }}):{{ c | tojson }}\n\
             {%- endfor %}\
             {%- if add_generation_prompt %}ASSISTANT:{%- endif %}",
        );
        let msgs = [
            ChatMessage::new("user", "  hi  "),
            ChatMessage::new("assistant", "<think>x</think> yo"),
        ];
        assert_eq!(
            t.apply_chat_template(&msgs, &Default::default())?,
            "<s>USER(True):\"hi\"ASSISTANT(False):\"yo\"ASSISTANT:"
        );
        let err = t
            .apply_chat_template(
                &[ChatMessage::new("user", "!x")],
                &TemplateOptions {
                    add_generation_prompt: false,
                    ..Default::default()
                },
            )
            .unwrap_err();
        assert!(format!("{err:#}").contains("no bangs"), "{err:#}");
        Ok(())
    }

    /// An assistant turn's thinking reaches the template as `reasoning_content` (and
    /// `reasoning`), which Qwen3's template writes back (here for every assistant turn;
    /// Qwen3's, for those after the last user message) and which a turn without it lacks.
    #[test]
    fn a_turns_reasoning_reaches_the_template() -> Result<()> {
        let t = with_template(
            "{%- for m in messages %}{{ m.role }}:\
             {%- if m.reasoning_content is defined and m.reasoning_content %}<think>{{ m.reasoning_content }}|{{ m.reasoning }}</think>{%- endif %}\
             {{ m.content }};{%- endfor %}",
        );
        let mut thought = ChatMessage::new("assistant", "No.");
        thought.reasoning = Some(TurnReasoning("Clouds?".into()));
        let msgs = [
            ChatMessage::new("user", "Rain?"),
            thought,
            ChatMessage::new("assistant", "Sure."),
        ];
        let options = TemplateOptions {
            add_generation_prompt: false,
            ..Default::default()
        };
        assert_eq!(
            t.apply_chat_template(&msgs, &options)?,
            "user:Rain?;assistant:<think>Clouds?|Clouds?</think>No.;assistant:Sure.;"
        );
        Ok(())
    }

    /// Qwen3's kind of template: a variable the request sets (`chat_template_kwargs`), and
    /// a last message continued rather than closed.
    #[test]
    fn template_kwargs_and_a_continued_final_message() -> Result<()> {
        let t = with_template(
            "{%- for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{%- endfor %}\
             {%- if add_generation_prompt %}<assistant>\
             {%- if enable_thinking is defined and not enable_thinking %}<think></think>{%- endif %}\
             {%- endif %}",
        );
        let user = [ChatMessage::new("user", "hi")];
        assert_eq!(
            t.apply_chat_template(&user, &Default::default())?,
            "<user>hi</user><assistant>"
        );
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("enable_thinking".into(), Value::Bool(false));
        let no_thinking = TemplateOptions {
            kwargs,
            ..Default::default()
        };
        assert_eq!(
            t.apply_chat_template(&user, &no_thinking)?,
            "<user>hi</user><assistant><think></think>"
        );
        let continued = TemplateOptions {
            add_generation_prompt: false,
            continue_final_message: true,
            ..Default::default()
        };
        let chat = [
            ChatMessage::new("user", "hi"),
            ChatMessage::new("assistant", "The answer is "),
        ];
        // Cut after the message's text, with its trailing space where the template kept it.
        assert_eq!(
            t.apply_chat_template(&chat, &continued)?,
            "<user>hi</user><assistant>The answer is "
        );
        // A template that trims content (Llama 3's): cut after the trimmed text's last
        // occurrence, not inside an earlier message that holds the untrimmed one.
        let trims = with_template(
            "{%- for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{%- endfor %}",
        );
        let chat = [
            ChatMessage::new("user", "Begin with 'Sure, ' then explain"),
            ChatMessage::new("assistant", "Sure, "),
        ];
        assert_eq!(
            trims.apply_chat_template(&chat, &continued)?,
            "<user>Begin with 'Sure, ' then explain</user><assistant>Sure,"
        );
        let gone = [
            ChatMessage::new("user", "hi"),
            ChatMessage::new("assistant", ""),
        ];
        let t2 = with_template("{%- for m in messages %}[{{ m.role }}]{%- endfor %}");
        let err = t2
            .apply_chat_template(&[ChatMessage::new("user", "x")], &continued)
            .unwrap_err();
        assert!(format!("{err:#}").contains("does not appear"), "{err:#}");
        // An empty last message is found anywhere: the rendering is cut at its end.
        assert_eq!(
            t2.apply_chat_template(&gone, &continued)?,
            "[user][assistant]"
        );
        Ok(())
    }

    #[test]
    fn chat_template_arg_is_a_file_or_a_template_on_one_line() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("t.jinja");
        std::fs::write(&file, "{{ messages[0].content }}\n")?;
        assert_eq!(
            chat_template_arg(file.to_str().unwrap())?,
            "{{ messages[0].content }}\n"
        );
        // Not a file: a template, its escapes decoded as Python's unicode_escape does.
        assert_eq!(
            chat_template_arg(r#"{{ 'a' }}\n\t\\x \"q\" \d"#)?,
            "{{ 'a' }}\n\t\\x \"q\" \\d"
        );
        // A path that cannot be read, with nothing of a template in it, is named.
        let missing = dir.path().join("missing.jinja");
        let err = chat_template_arg(missing.to_str().unwrap()).unwrap_err();
        assert!(err.to_string().contains("looks like a file path"), "{err}");
        // A template that does not parse is refused here, before any model loads.
        let err = chat_template_arg("{% for m in messages %}").unwrap_err();
        assert!(
            format!("{err:#}").contains("invalid --chat-template"),
            "{err:#}"
        );
        Ok(())
    }

    #[test]
    fn partial_characters_are_the_tokens_that_alone_split_one() {
        // Byte-level BPE: `Ã` is the byte 0xC3 (the lead byte of `é`), `©` the byte 0xA9
        // (its continuation); `Ã©` is the whole `é`.
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"post_processor":null,
            "pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},
            "decoder":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},
            "model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,
              "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,
              "vocab":{"a":0,"Ã":1,"©":2,"Ã©":3},"merges":[["Ã","©"]]}}"#;
        let tok = TextTokenizer {
            inner: tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap(),
            ..with_template("")
        };
        assert_eq!(tok.decode(&[3]).unwrap(), "é");
        assert_eq!(tok.partial_character_ids(), vec![1, 2]);
    }

    /// A template that loops over a message's content (Gemma 3's form) gets the request's
    /// text parts as a list, each trimmed by it and none joined by a newline, as vLLM's
    /// "openai" content format renders them; other templates get the parts joined.
    #[test]
    fn templates_looping_over_content_get_the_parts() {
        let gemma = "{%- for message in messages -%}{%- if message['content'] is string -%}\
                     {{ message['content'] | trim }}{%- else -%}\
                     {%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}\
                     {{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}\
                     {%- endfor -%}";
        let plain = "{%- for message in messages %}{{ message['content'] }}{%- endfor %}";
        assert!(loops_over_content(gemma));
        assert!(loops_over_content("{% for p in m.content %}{% endfor %}"));
        assert!(!loops_over_content(plain));
        let mut m = ChatMessage::new("user", "a \nb");
        m.parts = Some(vec!["a ".into(), "b".into()]);
        let render = |t: &str, m: &ChatMessage| {
            with_template(t)
                .apply_chat_template(
                    std::slice::from_ref(m),
                    &TemplateOptions {
                        add_generation_prompt: false,
                        ..Default::default()
                    },
                )
                .unwrap()
        };
        assert_eq!(render(gemma, &m), "ab");
        assert_eq!(render(plain, &m), "a \nb");
        // A string content reaches a looping template as one part.
        assert_eq!(render(gemma, &ChatMessage::new("user", " c ")), "c");
    }

    #[test]
    fn template_and_special_tokens_come_from_either_config_form() {
        let cfg = serde_json::json!({
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
            "bos_token": {"content": "<s>", "special": true},
            "eos_token": "</s>",
        });
        let named = templates_in(&cfg);
        assert_eq!(
            (named["default"].as_str(), named["tool_use"].as_str()),
            ("D", "T")
        );
        assert_eq!(special_token(cfg.get("bos_token")).as_deref(), Some("<s>"));
        assert_eq!(special_token(cfg.get("eos_token")).as_deref(), Some("</s>"));
    }
}
