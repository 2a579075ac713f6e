//! Reasoning models (DeepSeek-R1, Qwen3, QwQ) think before they answer, between `<think>`
//! and `</think>`. A parser named at start (`--reasoning-parser`, as vLLM's) splits a chat's
//! output there: the thinking is the message's `reasoning`, what follows its `content`, which
//! tool-call parsers and grammars see alone (a grammar starts after `</think>`).
//!
//! vLLM's rules, which both parsers follow:
//! - the text before the first `</think>` is reasoning (less a `<think>` that opens the
//!   output: the chat template usually writes it into the prompt), the rest content;
//! - an output without `</think>` is all reasoning (it was cut, or never stopped thinking);
//! - `qwen3` with the template variable `enable_thinking: false` does not think, nor does
//!   `deepseek_v3` without `thinking: true`: all of the output is content.
//!
//! A stream is split as it is generated: a tail that may begin `</think>` is held until the
//! next text says, so the chunks add up to the non-streamed answer. (vLLM drops, when not
//! streaming, any text before a `<think>` that does not open the output, and streams it as
//! reasoning; here it is reasoning both ways.)

use anyhow::{bail, Result};

use crate::runtime::tokenizer::TextTokenizer;

const START: &str = "<think>";
const END: &str = "</think>";

/// The reasoning formats this server splits (vLLM's parser names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParser {
    /// DeepSeek-R1 and its distillations, QwQ: `…</think>answer`.
    DeepSeekR1,
    /// Qwen3: as DeepSeek-R1, but `enable_thinking: false` turns thinking off.
    Qwen3,
    /// DeepSeek-V3.1 and later: as DeepSeek-R1 where the template variable `thinking` is
    /// true; they answer without thinking otherwise.
    DeepSeekV3,
}

/// What a served tokenizer needs for a reasoning parser: the ids of its markers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningTokens {
    /// `<think>`'s id.
    pub start: u32,
    /// `</think>`'s id: the token after which a grammar applies.
    pub end: u32,
    /// Whether the tokenizer marks either marker special: then a request keeps special
    /// tokens in its text, or the markers would be dropped before they are looked for.
    pub special: bool,
    /// The tokenizer's other special tokens, sorted: the turns' boundaries (`<|im_start|>`,
    /// `<|im_end|>`), before which a marker is an earlier turn's.
    boundaries: Vec<u32>,
}

impl ReasoningParser {
    pub fn name(self) -> &'static str {
        match self {
            ReasoningParser::DeepSeekR1 => "deepseek_r1",
            ReasoningParser::Qwen3 => "qwen3",
            ReasoningParser::DeepSeekV3 => "deepseek_v3",
        }
    }

    /// The markers' ids in `tokenizer`; an error where either is not one token (vLLM
    /// refuses to start likewise: the model was not trained to think with this parser).
    pub fn tokens(self, tokenizer: &TextTokenizer) -> Result<ReasoningTokens> {
        let id = |marker: &str| match tokenizer.token_to_id(marker) {
            Some(id) => Ok(id),
            None => bail!(
                "--reasoning-parser {}: the tokenizer has no {marker} token (is this a \
                 reasoning model?)",
                self.name()
            ),
        };
        let (start, end) = (id(START)?, id(END)?);
        let added = tokenizer.inner().get_added_tokens_decoder();
        let special = [start, end]
            .iter()
            .any(|t| added.get(t).is_some_and(|a| a.special));
        let mut boundaries: Vec<u32> = (added.iter())
            .filter(|(&id, a)| a.special && id != start && id != end)
            .map(|(&id, _)| id)
            .collect();
        boundaries.sort_unstable();
        Ok(ReasoningTokens {
            start,
            end,
            special,
            boundaries,
        })
    }

    /// Whether a chat rendered with the template variables `kwargs` thinks: `qwen3`'s
    /// `enable_thinking: false` says not; `deepseek_v3` thinks with `thinking: true` only.
    pub fn thinks(self, kwargs: &serde_json::Map<String, serde_json::Value>) -> bool {
        match self {
            ReasoningParser::DeepSeekR1 => true,
            ReasoningParser::Qwen3 => kwargs.get("enable_thinking") != Some(&false.into()),
            ReasoningParser::DeepSeekV3 => kwargs.get("thinking") == Some(&true.into()),
        }
    }
}

impl ReasoningTokens {
    /// Whether `prompt` has ended the thinking already: the turn it ends with (after its
    /// last special token) holds `</think>` after any `<think>` (a template that turns
    /// thinking off writes `<think></think>` there; a continued answer has it). Its output
    /// is then all answer, as vLLM reads such a prompt. (vLLM looks past the turn, and a
    /// `</think>` of an earlier turn's thinking, which Qwen3's template writes back in a
    /// tool loop, or of a user's text, turns thinking off there.)
    pub fn ends_thinking(&self, prompt: &[u32]) -> bool {
        let last_marker = (prompt.iter().rev())
            .take_while(|t| self.boundaries.binary_search(t).is_err())
            .find(|&&t| t == self.start || t == self.end);
        last_marker == Some(&self.end)
    }
}

/// One piece of output, split.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pieces {
    pub reasoning: String,
    pub content: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing decided yet: the output may open with `<think>`.
    Opening,
    Reasoning,
    Content,
}

/// Splits one output, piece by piece, as it is generated.
#[derive(Debug, Clone)]
pub struct ReasoningSplit {
    phase: Phase,
    /// Text not yet assigned: a tail that may begin a marker.
    held: String,
}

impl Default for ReasoningSplit {
    fn default() -> Self {
        ReasoningSplit {
            phase: Phase::Opening,
            held: String::new(),
        }
    }
}

impl ReasoningSplit {
    /// The next piece of output, split as far as it can be yet.
    pub fn push(&mut self, text: &str) -> Pieces {
        self.held.push_str(text);
        let mut out = Pieces::default();
        loop {
            match self.phase {
                Phase::Opening if self.held.starts_with(START) => {
                    self.held.drain(..START.len());
                    self.phase = Phase::Reasoning;
                }
                Phase::Opening if START.starts_with(self.held.as_str()) => return out,
                Phase::Opening => self.phase = Phase::Reasoning,
                Phase::Reasoning => {
                    if let Some(at) = self.held.find(END) {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + END.len());
                        self.phase = Phase::Content;
                        continue;
                    }
                    let ready = self.held.len() - partial_suffix(&self.held, END);
                    out.reasoning.extend(self.held.drain(..ready));
                    return out;
                }
                Phase::Content => {
                    out.content.push_str(&std::mem::take(&mut self.held));
                    return out;
                }
            }
        }
    }

    /// The output has ended: what was held is reasoning (a marker never completed).
    pub fn finish(&mut self) -> Pieces {
        let held = std::mem::take(&mut self.held);
        match self.phase {
            Phase::Content => Pieces {
                reasoning: String::new(),
                content: held,
            },
            _ => Pieces {
                reasoning: held,
                content: String::new(),
            },
        }
    }

    /// Whether the output has reached its content (`</think>` was written).
    pub fn answering(&self) -> bool {
        self.phase == Phase::Content
    }
}

/// The length of the longest tail of `text` that begins `marker` (and is not all of it).
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&marker[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A whole output's reasoning and content, each `None` where empty (as vLLM answers).
    fn whole(text: &str) -> (Option<String>, Option<String>) {
        let mut split = ReasoningSplit::default();
        let mut pieces = split.push(text);
        let last = split.finish();
        pieces.reasoning.push_str(&last.reasoning);
        pieces.content.push_str(&last.content);
        let some = |s: String| (!s.is_empty()).then_some(s);
        (some(pieces.reasoning), some(pieces.content))
    }

    fn some(s: &str) -> Option<String> {
        Some(s.to_string())
    }

    #[test]
    fn the_thinking_ends_at_the_first_end_marker() {
        assert_eq!(
            whole("Let me see.\n</think>\n\nOslo."),
            (some("Let me see.\n"), some("\n\nOslo."))
        );
        // An opening marker the template did not write is dropped.
        assert_eq!(whole("<think>hm</think>yes"), (some("hm"), some("yes")));
        // A second end marker is the answer's.
        assert_eq!(
            whole("a</think>b</think>c"),
            (some("a"), some("b</think>c"))
        );
        // Nothing after the thinking: no content; nothing before it: no reasoning.
        assert_eq!(whole("all thought</think>"), (some("all thought"), None));
        assert_eq!(whole("</think>{\"a\": 1}"), (None, some("{\"a\": 1}")));
    }

    #[test]
    fn an_output_that_never_stops_thinking_is_all_reasoning() {
        assert_eq!(
            whole("still thinking </thi"),
            (some("still thinking </thi"), None)
        );
        assert_eq!(whole("<thi"), (some("<thi"), None));
        assert_eq!(whole(""), (None, None));
        // `<think>` is only dropped where it opens the output.
        assert_eq!(whole("x<think>y</think>z"), (some("x<think>y"), some("z")));
    }

    #[test]
    fn a_marker_split_across_pieces_is_held_until_it_is_whole() {
        let mut s = ReasoningSplit::default();
        assert_eq!(s.push("<th"), Pieces::default());
        assert_eq!(
            s.push("ink>why"),
            Pieces {
                reasoning: "why".into(),
                content: "".into()
            }
        );
        assert_eq!(
            s.push(" so</th"),
            Pieces {
                reasoning: " so".into(),
                content: "".into()
            }
        );
        assert!(!s.answering());
        assert_eq!(
            s.push("ink>Be"),
            Pieces {
                reasoning: "".into(),
                content: "Be".into()
            }
        );
        assert!(s.answering());
        assert_eq!(
            s.push("cause."),
            Pieces {
                reasoning: "".into(),
                content: "cause.".into()
            }
        );
        assert_eq!(s.finish(), Pieces::default());
    }

    #[test]
    fn the_template_variables_say_whether_a_chat_thinks() {
        let kwargs = |v: serde_json::Value| v.as_object().unwrap().clone();
        let cases = [
            (ReasoningParser::DeepSeekR1, serde_json::json!({}), true),
            (
                ReasoningParser::DeepSeekR1,
                serde_json::json!({"thinking": false}),
                true,
            ),
            (ReasoningParser::Qwen3, serde_json::json!({}), true),
            (
                ReasoningParser::Qwen3,
                serde_json::json!({"enable_thinking": false}),
                false,
            ),
            (
                ReasoningParser::Qwen3,
                serde_json::json!({"enable_thinking": true}),
                true,
            ),
            (ReasoningParser::DeepSeekV3, serde_json::json!({}), false),
            (
                ReasoningParser::DeepSeekV3,
                serde_json::json!({"thinking": true}),
                true,
            ),
        ];
        for (parser, vars, thinks) in cases {
            assert_eq!(
                parser.thinks(&kwargs(vars.clone())),
                thinks,
                "{parser:?} {vars}"
            );
        }
    }

    #[test]
    fn a_parser_needs_the_markers_as_tokens_of_their_own() {
        use crate::runtime::model::Arch;
        use crate::tools::make_model::{make_model, ModelSpec};
        let tmp = tempfile::tempdir().unwrap();
        for (arch, has_markers) in [(Arch::Qwen3, true), (Arch::Llama, false)] {
            let dir = tmp.path().join(format!("{arch:?}"));
            make_model(&ModelSpec::new(arch), &dir).unwrap();
            let tok = TextTokenizer::from_dir(&dir).unwrap();
            let found = ReasoningParser::Qwen3.tokens(&tok);
            if !has_markers {
                let e = found.unwrap_err().to_string();
                assert!(
                    e.contains("--reasoning-parser qwen3") && e.contains("<think>"),
                    "{e}"
                );
                continue;
            }
            // As Qwen3's own tokenizer: text tokens, kept when special ones are skipped.
            let found = found.unwrap();
            assert!(!found.special);
            let ids = tok.encode("<think>a</think>", false).unwrap();
            assert_eq!(ids.last(), Some(&found.end));
            assert_eq!(tok.decode(&ids).unwrap(), "<think>a</think>");
            // A prompt whose last marker closes the thinking has ended it.
            let ends = |text: &str| found.ends_thinking(&tok.encode(text, false).unwrap());
            assert!(ends("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
            assert!(!ends("<|im_start|>assistant\n<think>\n"));
            assert!(!ends("<|im_start|>assistant\n"));
            assert!(!ends("earlier </think> answer; now <think> again"));
            // An earlier turn's thinking (a tool loop's), or a user's `</think>`, is not this
            // turn's.
            assert!(!ends(
                "<|im_start|>assistant\n<think>R</think>call<|im_end|>\n\
                 <|im_start|>user\nsay </think><|im_end|>\n<|im_start|>assistant\n"
            ));
        }
    }

    proptest! {
        /// However the output comes in pieces, the pieces add up to the whole's split.
        #[test]
        fn pieces_add_up_to_the_whole(
            text in "(<think>|</think>|<th|</th|ink>|é|a| )*",
            cuts in proptest::collection::vec(0usize..64, 0..8),
        ) {
            let mut bounds: Vec<usize> = cuts.into_iter()
                .map(|c| c % (text.len() + 1))
                .filter(|&c| text.is_char_boundary(c))
                .collect();
            bounds.push(0);
            bounds.push(text.len());
            bounds.sort_unstable();
            let mut s = ReasoningSplit::default();
            let mut all = Pieces::default();
            for w in bounds.windows(2) {
                let p = s.push(&text[w[0]..w[1]]);
                all.reasoning.push_str(&p.reasoning);
                all.content.push_str(&p.content);
            }
            let last = s.finish();
            all.reasoning.push_str(&last.reasoning);
            all.content.push_str(&last.content);
            let (r, c) = whole(&text);
            prop_assert_eq!(all.reasoning, r.unwrap_or_default());
            prop_assert_eq!(all.content, c.unwrap_or_default());
        }
    }
}
