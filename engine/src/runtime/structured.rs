//! Structured output: a grammar (a JSON schema, a regex, a list of choices, a Lark grammar)
//! constrains which tokens a sequence may sample next. llguidance, the grammar engine vLLM
//! and SGLang also use, compiles the grammar against the vocabulary's bytes and computes
//! each step's allowed-token mask; the sampler sets every other logit to −∞ before it
//! applies temperature, top-k or top-p (so greedy picks the most likely allowed token).
//!
//! One [`GrammarCompiler`] per served model (its token trie is built once, lazily: it costs
//! milliseconds at a 128k vocabulary); one [`Constraint`] per sequence, compiled off the
//! engine thread when the request arrives, advanced by one token per step on it.

use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use crate::runtime::tokenizer::TextTokenizer;

/// The grammar of a workload's structured requests (`workload.structured_output`) and of
/// `engine profile`'s measurement: a JSON object holding a list of at least 4,096 records
/// (an integer id, a short string), so it cannot end before any `max_tokens` a benchmark
/// asks for and a request's length is the workload's. Its tokens are JSON's usual mix of
/// punctuation, keys, numbers and string content.
pub fn workload_schema() -> Value {
    json!({
        "type": "object",
        "properties": {"items": {
            "type": "array", "minItems": 4096,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999_999},
                    "name": {"type": "string", "maxLength": 12}
                },
                "required": ["id", "name"], "additionalProperties": false
            }
        }},
        "required": ["items"], "additionalProperties": false
    })
}

/// The name `engine profile` records for [`workload_schema`].
pub const WORKLOAD_GRAMMAR: &str = "records: a list of {id, name} objects, compact";

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Text that parses as JSON and validates against the schema. `any_whitespace`: JSON's
    /// optional whitespace may appear anywhere (vLLM's default); off, the output is compact.
    JsonSchema { schema: Value, any_whitespace: bool },
    /// Text that the regular expression matches whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar in llguidance's dialect (vLLM's `grammar` with its guidance backend).
    Lark(String),
}

impl Grammar {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    pub fn json_object(any_whitespace: bool) -> Self {
        Grammar::JsonSchema {
            schema: json!({"type": "object"}),
            any_whitespace,
        }
    }

    /// JSON without optional whitespace (other grammars say their own whitespace).
    pub fn disable_any_whitespace(&mut self) {
        if let Grammar::JsonSchema { any_whitespace, .. } = self {
            *any_whitespace = false;
        }
    }

    /// The size of what the request sent, in bytes ([`MAX_GRAMMAR_BYTES`]).
    pub fn source_bytes(&self) -> usize {
        match self {
            Grammar::JsonSchema { schema, .. } => schema.to_string().len(),
            Grammar::Regex(text) | Grammar::Lark(text) => text.len(),
            // Each with its quotes and a separator, as a JSON list sends them.
            Grammar::Choice(choices) => choices.iter().map(|c| c.len() + 3).sum(),
        }
    }

    /// [`Grammar::source_bytes`], or why it is too large to compile.
    pub fn checked_bytes(&self) -> Result<usize> {
        let bytes = self.source_bytes();
        if bytes > MAX_GRAMMAR_BYTES {
            bail!(
                "the grammar is {bytes} bytes, more than the {MAX_GRAMMAR_BYTES} a request may send"
            );
        }
        Ok(bytes)
    }

    fn top_level(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Grammar::JsonSchema {
                schema,
                any_whitespace,
            } => {
                let mut schema = schema.clone();
                if let Value::Object(m) = &mut schema {
                    // llguidance's own options ride in the schema; a client's are not taken.
                    m.insert(
                        "x-guidance".into(),
                        json!({"whitespace_flexible": any_whitespace}),
                    );
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Choice(choices) => {
                if choices.is_empty() {
                    bail!("choice needs at least one string");
                }
                // Lark string literals take JSON's escapes. One token of alternatives (the
                // lexer's), not a rule of them: a parser row holds at most 2,000 items.
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::to_string(c).expect("a string serialises"))
                    .collect();
                TopLevelGrammar::from_lark(format!(
                    "start: CHOICE\nCHOICE: {}",
                    alternatives.join(" | ")
                ))
            }
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        })
    }
}

/// The vocabulary as llguidance sees it: each token's bytes in a trie, and the model's own
/// tokenizer for the text a grammar spells out.
struct VocabEnv {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => match self.tokenizer.encode(text, false) {
                Ok(e) => e.get_ids().to_vec(),
                Err(_) => self.trie.greedy_tokenize(s),
            },
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles grammars for one model's vocabulary.
pub struct GrammarCompiler {
    factory: ParserFactory,
}

/// Bounds on what one grammar may cost, tighter than llguidance's defaults where those
/// would let one request take hundreds of megabytes (its lexer states cost 1–2 kB each).
fn limits() -> ParserLimits {
    ParserLimits {
        max_lexer_states: 50_000,
        max_grammar_size: 200_000,
        // An error names what is wrong, not the parser's whole state (kilobytes, with the
        // tokens so far) in the client's response and the server's log.
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// How a sequence's failure in its grammar is shown in the log (`RequestFailure`'s cause
/// says whose it is; this is for people).
pub const STRUCTURED_FAILURE: &str = "structured output: ";

/// llguidance's error without the marker it leaves where its state would have been.
fn grammar_error(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!(
        "{}",
        e.to_string().trim_end_matches("<non-verbose/>").trim_end()
    )
}

/// The largest grammar a request may send, in bytes of its source (the schema as JSON, the
/// regex, the choices, the Lark text). OpenAI's structured outputs cap a schema's names and
/// values at 120,000 characters in all; this leaves twice that.
pub const MAX_GRAMMAR_BYTES: usize = 256 << 10;

/// The stack a grammar compiles on. llguidance compiles a rule, a token or a JSON schema's
/// `$ref` when it first meets it, nesting one call per link of a chain: about 3.3 kB a
/// link of Lark rules and 5–8 kB a link of `$ref`s (a debug build's frames; a release
/// build's are smaller). The longest chains [`MAX_GRAMMAR_BYTES`] can spell (8-byte Lark
/// rules `abc:abd\n`, 33-byte `$ref`s) need about 110 and 65 MB; a 2 MiB thread, what a
/// server's pool threads have, overflowed at 800 rules and took the whole process down.
/// Only the pages a compile touches are ever committed.
const COMPILE_STACK_BYTES: usize = 512 << 20;

impl GrammarCompiler {
    /// `n_vocab` is the width of the model's logits (at least the tokenizer's vocabulary:
    /// ids past it are never allowed); `eos` the ids that end a sequence, the first the
    /// one a finished grammar asks for.
    pub fn new(tokenizer: &TextTokenizer, n_vocab: usize, eos: &[u32]) -> Result<Self> {
        let json: Value = serde_json::from_str(
            &tokenizer
                .inner()
                .to_string(false)
                .map_err(|e| anyhow!("cannot serialise the tokenizer: {e}"))?,
        )?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .context("structured output needs the bytes of every token")?;
        if words.len() > n_vocab {
            bail!(
                "the tokenizer has {} tokens, more than the model's {n_vocab} logits",
                words.len()
            );
        }
        words.resize(n_vocab, Vec::new());
        let eos: Vec<u32> = eos
            .iter()
            .copied()
            .filter(|&t| (t as usize) < n_vocab)
            .collect();
        let Some(&first_eos) = eos.first() else {
            bail!("structured output needs an end-of-sequence token");
        };
        let info = TokRxInfo::new(n_vocab as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: llguidance::toktrie::TokEnv = Arc::new(VocabEnv {
            trie,
            tokenizer: tokenizer.inner().clone(),
        });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(Self { factory })
    }

    /// A fresh constraint for one sequence, its first mask computed; an invalid grammar,
    /// or one that cannot start, is an error naming why. It compiles on a thread of its own
    /// whose stack holds the deepest grammar of at most [`MAX_GRAMMAR_BYTES`].
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint> {
        grammar.checked_bytes()?;
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("grammar-compile".into())
                .stack_size(COMPILE_STACK_BYTES)
                .spawn_scoped(scope, || self.compile_here(grammar))
                .context("cannot start a thread to compile the grammar")?
                .join()
                .map_err(|_| anyhow!("the grammar compiler failed"))?
        })
    }

    fn compile_here(&self, grammar: &Grammar) -> Result<Constraint> {
        let parser = self.factory.create_parser(grammar.top_level()?)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(grammar_error(e));
        }
        let mut constraint = Constraint {
            grammar: grammar.clone(),
            matcher,
            next: None,
            starts_after: None,
        };
        // The first mask is the costliest (the lexer's caches are cold) and the first to
        // find a grammar that cannot produce anything: here, off the engine thread, its
        // request is refused before it runs.
        constraint.next = Some(constraint.allowed_set()?);
        Ok(constraint)
    }
}

/// One sequence's grammar state.
#[derive(Clone)]
pub struct Constraint {
    /// What it was compiled from (to describe and compare it).
    grammar: Grammar,
    matcher: Matcher,
    /// The mask for the next token, when already computed (the first, by the compiler).
    next: Option<SimpleVob>,
    /// The output follows the grammar only after this token (a reasoning model's
    /// `</think>`: it thinks freely first); `None`: from its first token.
    starts_after: Option<u32>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("grammar", &self.grammar)
            .finish_non_exhaustive()
    }
}

impl PartialEq for Constraint {
    /// Two constraints compiled from the same grammar (whatever their state).
    fn eq(&self, other: &Self) -> bool {
        self.grammar == other.grammar
    }
}

impl Constraint {
    /// This grammar, followed only from the token after `token` (see [`Sampler::constrain`]).
    ///
    /// [`Sampler::constrain`]: crate::runtime::sampling::Sampler::constrain
    pub fn starting_after(self, token: u32) -> Self {
        Constraint {
            starts_after: Some(token),
            ..self
        }
    }

    /// The token after which the output follows the grammar, if not from its start.
    pub fn starts_after(&self) -> Option<u32> {
        self.starts_after
    }

    /// Sets every logit the grammar does not allow next to −∞. A finished grammar allows
    /// only the end-of-sequence tokens. Errs if the grammar is in an error state.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        apply_mask(self.allowed_set()?.as_slice(), logits);
        Ok(())
    }

    /// The tokens the grammar allows next, as a bitset (bit `i % 32` of word `i / 32`: token
    /// `i`; ids past its end are not allowed): what [`Constraint::mask`] applies, for a
    /// sampler that applies it elsewhere (the GPU's). Errs as `mask` does.
    pub fn allowed(&mut self) -> Result<Vec<u32>> {
        Ok(self.allowed_set()?.as_slice().to_vec())
    }

    fn allowed_set(&mut self) -> Result<SimpleVob> {
        if let Some(allowed) = self.next.take() {
            return Ok(allowed);
        }
        let allowed = self.matcher.compute_mask_or_eos().map_err(grammar_error)?;
        if allowed.is_zero() {
            bail!("the grammar allows no token here");
        }
        Ok(allowed)
    }

    /// Advances past the sampled `token`.
    pub fn accept(&mut self, token: u32) -> Result<()> {
        self.next = None;
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(grammar_error)
    }
}

/// −∞ at every position `words` does not set (positions past its length included).
pub fn apply_mask(words: &[u32], logits: &mut [f32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, x) in chunk.iter_mut().enumerate() {
            if bits & (1 << b) == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::model::Arch;
    use crate::tools::make_model::{make_model, ModelSpec};

    fn tokenizer(arch: Arch, vocab: usize) -> (tempfile::TempDir, TextTokenizer) {
        let dir = tempfile::tempdir().unwrap();
        let spec = ModelSpec {
            vocab,
            ..ModelSpec::new(arch)
        };
        make_model(&spec, dir.path()).unwrap();
        let tok = TextTokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    /// Greedy decoding over `logits_of(step)`, constrained: the text it spells.
    fn greedy(c: &mut Constraint, tok: &TextTokenizer, n_vocab: usize, eos: u32) -> String {
        let mut out = Vec::new();
        for step in 0..200 {
            // A fixed pseudo-random preference over the vocabulary, different every step.
            let mut logits: Vec<f32> = (0..n_vocab)
                .map(|i| ((i * 7919 + step * 104_729) % 1013) as f32 / 1013.0)
                .collect();
            c.mask(&mut logits).unwrap();
            let t = crate::runtime::sampling::argmax(&logits);
            if t == eos {
                break;
            }
            c.accept(t).unwrap();
            out.push(t);
        }
        tok.decode(&out).unwrap()
    }

    #[test]
    fn every_token_spells_its_bytes() {
        // The mask is only right if each token's bytes are: the tokens of a text must spell
        // it back, byte for byte.
        let (_d, tok) = tokenizer(Arch::Qwen3, 2000);
        let json: Value = serde_json::from_str(&tok.inner().to_string(false).unwrap()).unwrap();
        let words = llguidance::token_bytes_from_tokenizer_json(&json).unwrap();
        for text in [
            "Hello, world! {\"a\": [1, 2.5e-3, null]}\n\ttabs",
            "naïve café — 東京 🚀",
        ] {
            let ids = tok.encode(text, false).unwrap();
            let spelled: Vec<u8> = ids
                .iter()
                .flat_map(|&t| words[t as usize].clone())
                .collect();
            assert_eq!(spelled, text.as_bytes(), "{ids:?}");
        }
    }

    #[test]
    fn json_schema_output_validates() {
        let (_d, tok) = tokenizer(Arch::Llama, 1000);
        let eos = tok.token_to_id("<|eot_id|>").unwrap();
        let compiler = GrammarCompiler::new(&tok, 1024, &[eos]).unwrap();
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}
            },
            "required": ["name", "age", "tags"],
            "additionalProperties": false
        });
        let mut c = compiler
            .compile(&Grammar::JsonSchema {
                schema,
                any_whitespace: false,
            })
            .unwrap();
        let text = greedy(&mut c, &tok, 1024, eos);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["name"].as_str().unwrap().chars().count() <= 12, "{text}");
        assert!((0..=150).contains(&v["age"].as_i64().unwrap()), "{text}");
        assert!(v["tags"].as_array().unwrap().len() <= 3, "{text}");
        assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
    }

    /// A grammar and `allowed_token_ids` together: the device row's mask allows what both
    /// do, and nothing else.
    #[test]
    fn a_grammar_and_allowed_token_ids_mask_a_device_row_together() {
        use crate::runtime::sampling::{Sampler, SamplingParams};
        let (_d, tok) = tokenizer(Arch::Llama, 1000);
        let eos = tok.token_to_id("<|eot_id|>").unwrap();
        let compiler = GrammarCompiler::new(&tok, 1000, &[eos]).unwrap();
        let grammar = compiler
            .compile(&Grammar::Regex("[0-9]{2}".into()))
            .unwrap();
        let digits: Vec<u32> = (0..10)
            .filter_map(|d| tok.token_to_id(&d.to_string()))
            .collect();
        assert!(digits.len() >= 2, "{digits:?}");
        // Two digits the grammar allows, and tokens it does not.
        let allowed = vec![digits[0], digits[1], eos, 100, 700];
        let bit = |mask: &[u32], t: u32| {
            mask.get(t as usize / 32)
                .is_some_and(|w| w >> (t % 32) & 1 == 1)
        };
        let by_grammar = grammar.clone().allowed().unwrap();
        let mut want: Vec<u32> = allowed
            .iter()
            .copied()
            .filter(|&t| bit(&by_grammar, t))
            .collect();
        want.sort_unstable();
        assert!(
            want.contains(&digits[0]) && !want.contains(&eos),
            "{want:?}"
        );
        let mut s = Sampler::new(
            SamplingParams {
                allowed_token_ids: Some(allowed),
                ..SamplingParams::greedy()
            },
            &[],
            0,
        );
        s.constrain(grammar);
        let mask = s.device_row().unwrap().mask.unwrap();
        let got: Vec<u32> = (0..1000).filter(|&t| bit(&mask, t)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn choices_regexes_and_errors() {
        let (_d, tok) = tokenizer(Arch::Llama, 1000);
        let eos = tok.token_to_id("<|eot_id|>").unwrap();
        let compiler = GrammarCompiler::new(&tok, 1000, &[eos]).unwrap();
        let choices = vec!["yes \"quoted\"".to_string(), "no\\way".to_string()];
        let mut c = compiler.compile(&Grammar::Choice(choices.clone())).unwrap();
        let text = greedy(&mut c, &tok, 1000, eos);
        assert!(choices.contains(&text), "{text:?}");
        let mut c = compiler
            .compile(&Grammar::Regex("[0-9]{3}-[a-z]{2}".into()))
            .unwrap();
        let text = greedy(&mut c, &tok, 1000, eos);
        assert!(
            text.len() == 6
                && text[..3].bytes().all(|b| b.is_ascii_digit())
                && &text[3..4] == "-"
                && text[4..].bytes().all(|b| b.is_ascii_lowercase()),
            "{text:?}"
        );
        for bad in [
            Grammar::Regex("(".into()),
            Grammar::Lark("start: undefined_rule".into()),
            Grammar::JsonSchema {
                schema: json!({"type": "no-such-type"}),
                any_whitespace: true,
            },
            Grammar::Choice(Vec::new()),
        ] {
            assert!(compiler.compile(&bad).is_err(), "{bad:?}");
        }
    }

    /// A reasoning model's grammar starts after its `</think>`: the tokens before, and that
    /// one, are sampled freely; the token after follows the grammar.
    #[test]
    fn a_grammar_that_starts_after_a_token_leaves_the_tokens_before_free() {
        use crate::runtime::sampling::{Sampler, SamplingParams};
        let (_d, tok) = tokenizer(Arch::Llama, 1000);
        let eos = tok.token_to_id("<|eot_id|>").unwrap();
        let compiler = GrammarCompiler::new(&tok, 1000, &[eos]).unwrap();
        let grammar = Grammar::Choice(vec!["yes".into()]);
        let [free, start] = [
            tok.encode("Z", false).unwrap()[0],
            tok.encode("Q", false).unwrap()[0],
        ];
        let favouring = |t: u32| {
            let mut logits = vec![0.0f32; 1000];
            logits[t as usize] = 10.0;
            logits
        };
        let mut sampler = Sampler::new(SamplingParams::greedy(), &[1, 2], 0);
        sampler.constrain(compiler.compile(&grammar).unwrap().starting_after(start));
        assert!(sampler.constraint().is_none());
        assert_eq!(sampler.sample(&favouring(free)).unwrap().token, free);
        assert_eq!(sampler.sample(&favouring(start)).unwrap().token, start);
        assert!(sampler.constraint().is_some());
        let next = sampler.sample(&favouring(free)).unwrap().token;
        assert!("yes".starts_with(&tok.decode(&[next]).unwrap()), "{next}");
        // Without the start token, the same grammar applies from the first token.
        let mut sampler = Sampler::new(SamplingParams::greedy(), &[1, 2], 0);
        sampler.constrain(compiler.compile(&grammar).unwrap());
        assert_ne!(sampler.sample(&favouring(free)).unwrap().token, free);
    }

    #[test]
    fn many_choices_and_choices_that_prefix_each_other() {
        let (_d, tok) = tokenizer(Arch::Llama, 1000);
        let eos = tok.token_to_id("<|eot_id|>").unwrap();
        let compiler = GrammarCompiler::new(&tok, 1000, &[eos]).unwrap();
        // Past the 2,000 items a parser row holds, as a rule of alternatives would need.
        let many: Vec<String> = (0..5000).map(|i| format!("opt{i}")).collect();
        let mut c = compiler.compile(&Grammar::Choice(many.clone())).unwrap();
        let text = greedy(&mut c, &tok, 1000, eos);
        assert!(many.contains(&text), "{text:?}");
        // A choice that is a prefix of another may end where it ends, or go on.
        let mut c = compiler
            .compile(&Grammar::Choice(vec!["a".into(), "ab".into()]))
            .unwrap();
        let a = tok.encode("a", false).unwrap();
        assert_eq!(a.len(), 1);
        let allowed =
            |c: &mut Constraint, t: u32| c.allowed().unwrap()[t as usize / 32] >> (t % 32) & 1 == 1;
        assert!(allowed(&mut c, a[0]));
        c.accept(a[0]).unwrap();
        assert!(allowed(&mut c, eos), "\"a\" may end");
        let b = tok.encode("b", false).unwrap();
        assert!(allowed(&mut c, b[0]), "\"a\" may go on to \"ab\"");
    }

    /// The deepest grammars a request may send compile on the compiler's own stack, where a
    /// pool thread's overflowed and aborted the server (a test that overflows aborts too).
    #[test]
    fn the_deepest_grammars_within_the_size_limit_compile() {
        let (_d, tok) = tokenizer(Arch::Llama, 1000);
        let eos = tok.token_to_id("<|eot_id|>").unwrap();
        let compiler = GrammarCompiler::new(&tok, 1000, &[eos]).unwrap();
        // Three-character rule names (a letter, then letters, digits or `_`): 8 bytes a
        // link, each rule the next one's only use.
        const TAIL: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789_";
        let n = TAIL.len();
        let name = |i: usize| {
            let c = |k: usize| TAIL[k % n] as char;
            format!(
                "{}{}{}",
                (b'a' + (i / (n * n)) as u8) as char,
                c(i / n),
                c(i)
            )
        };
        let links = (MAX_GRAMMAR_BYTES - 64) / 8;
        assert!(links < 26 * n * n);
        let mut lark = format!("start: {}\n", name(0));
        for i in 0..links - 1 {
            lark += &format!("{}:{}\n", name(i), name(i + 1));
        }
        lark += &format!("{}:\"y\"\n", name(links - 1));
        let chain = Grammar::Lark(lark);
        assert!(chain.source_bytes() <= MAX_GRAMMAR_BYTES);
        let mut c = compiler.compile(&chain).unwrap();
        assert_eq!(greedy(&mut c, &tok, 1000, eos), "y");
        // A chain of `$ref`s, about 33 bytes a link.
        let links = MAX_GRAMMAR_BYTES / 34;
        let defs: serde_json::Map<String, Value> = (0..links)
            .map(|i| {
                (
                    format!("{i}"),
                    json!({"$ref": format!("#/$defs/{}", i + 1)}),
                )
            })
            .chain([(format!("{links}"), json!({"type": "integer"}))])
            .collect();
        let refs = Grammar::JsonSchema {
            schema: json!({"$ref": "#/$defs/0", "$defs": defs}),
            any_whitespace: false,
        };
        assert!(refs.source_bytes() <= MAX_GRAMMAR_BYTES);
        let _ = compiler.compile(&refs);
        // One byte more is refused before it compiles.
        let over = Grammar::Regex("a".repeat(MAX_GRAMMAR_BYTES + 1));
        let e = compiler.compile(&over).unwrap_err().to_string();
        assert!(e.contains("more than the 262144"), "{e}");
    }

    #[test]
    fn a_grammar_that_cannot_start_fails_to_compile() {
        let (_d, tok) = tokenizer(Arch::Llama, 1000);
        let eos = tok.token_to_id("<|eot_id|>").unwrap();
        let compiler = GrammarCompiler::new(&tok, 1000, &[eos]).unwrap();
        // A schema that is only a reference to itself: it parses, and allows nothing.
        let e = compiler
            .compile(&Grammar::JsonSchema {
                schema: json!({"$ref": "#"}),
                any_whitespace: true,
            })
            .unwrap_err()
            .to_string();
        // Without the parser's state dump.
        assert!(
            e.len() < 500 && !e.contains("<state>") && !e.contains("non-verbose"),
            "{e}"
        );
    }

    #[test]
    fn the_workload_grammar_never_lets_a_benchmark_request_end_early() {
        let (_d, tok) = tokenizer(Arch::Llama, 512);
        let eos = tok.token_to_id("<|eot_id|>").unwrap();
        let compiler = GrammarCompiler::new(&tok, 512, &[eos]).unwrap();
        let mut c = compiler
            .compile(&Grammar::JsonSchema {
                schema: workload_schema(),
                any_whitespace: false,
            })
            .unwrap();
        let mut out = Vec::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..1500 {
            let mut logits: Vec<f32> = (0..512)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 40) as f32 / (1u64 << 24) as f32
                })
                .collect();
            c.mask(&mut logits).unwrap();
            assert!(logits[eos as usize] == f32::NEG_INFINITY);
            let t = crate::runtime::sampling::argmax(&logits);
            c.accept(t).unwrap();
            out.push(t);
        }
        let text = tok.decode(&out).unwrap();
        assert!(text.starts_with("{\"items\":[{\"id\":"), "{text}");
        assert!(text.matches("\"name\":").count() > 20, "{text}");
    }

    #[test]
    fn mask_covers_the_whole_row() {
        let mut v = SimpleVob::alloc(70);
        v.allow_token(3);
        v.allow_token(64);
        let mut logits = vec![1.0f32; 80];
        apply_mask(v.as_slice(), &mut logits);
        let kept: Vec<usize> = (0..80).filter(|&i| logits[i].is_finite()).collect();
        assert_eq!(kept, vec![3, 64]);
    }
}
