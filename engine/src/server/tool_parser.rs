//! `tool_choice: "auto"`: the model decides whether to call a tool, and writes a call in its
//! own format, which a parser named at start (`--tool-call-parser`, as vLLM's) finds in
//! the output and answers as OpenAI's `tool_calls`. Output without a well-formed call is
//! the message's content, unchanged.
//!
//! Streamed, the text before a call goes out as content as it is generated (less any tail
//! that may begin a call); a call goes out once it has a name and its arguments have
//! begun, then its arguments piece by piece, as vLLM streams them ([`CallStream`]), and at
//! the end the whole output is parsed as a non-streamed one is, so a well-formed output's
//! chunks add up to the same message.

use serde_json::{json, Value};

mod python;
mod stream;
mod xml;

pub use stream::CallStream;
pub use xml::ToolParameters;

/// The call formats this server parses (vLLM's parser names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallParser {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, once per call, after any
    /// content: Hermes 2 Pro and 3, Qwen2.5 and Qwen3.
    Hermes,
    /// The whole output one JSON object `{"name": …, "parameters": {…}}` (or
    /// `"arguments"`), several separated by `;`, optionally after `<|python_tag|>`:
    /// Llama 3.1–3.3 with their JSON tool template.
    Llama3Json,
    /// The whole output a Python list of calls, `[get_weather(city="Oslo"), now()]`, with
    /// literal keyword arguments (optionally between `<|python_start|>` and
    /// `<|python_end|>`): Llama 3.2 and 4 with their pythonic tool template.
    Pythonic,
    /// `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` after any content: Mistral 7B
    /// Instruct v0.3 and the Mistral models of its tokenizer (a Hugging Face
    /// `tokenizer.json`, not mistral_common's).
    Mistral,
    /// `<tool_call><function=f><parameter=p>text</parameter></function></tool_call>` after
    /// any content, each value's text turned into JSON by the type the request's tool gives
    /// it: Qwen3-Coder.
    Qwen3Coder,
}

/// A call being read from a stream: its name, and its arguments as far as read, as JSON.
#[derive(Debug, PartialEq)]
pub struct ReadCall {
    pub name: String,
    pub arguments: String,
    /// Its end has been read.
    pub whole: bool,
}

const HERMES_START: &str = "<tool_call>";
const MISTRAL_START: &str = "[TOOL_CALLS]";
const PYTHON_START: &str = "<|python_start|>";
const PYTHON_END: &str = "<|python_end|>";
const HERMES_END: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

/// What a finished output holds when it calls tools.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCalls {
    /// The text before the first call; `None` where there is none.
    pub content: Option<String>,
    /// `(name, arguments as JSON text)` per call, in order.
    pub calls: Vec<(String, String)>,
}

impl ParsedCalls {
    /// `calls` after `content`, which is none where it is empty.
    fn after(content: &str, calls: Vec<(String, String)>) -> Self {
        let content = (!content.is_empty()).then(|| content.to_string());
        ParsedCalls { content, calls }
    }
}

impl ToolCallParser {
    pub fn name(self) -> &'static str {
        match self {
            ToolCallParser::Hermes => "hermes",
            ToolCallParser::Llama3Json => "llama3_json",
            ToolCallParser::Mistral => "mistral",
            ToolCallParser::Pythonic => "pythonic",
            ToolCallParser::Qwen3Coder => "qwen3_coder",
        }
    }

    /// Whether this parser types what it reads by the request's tools' parameter schemas
    /// ([`ToolParameters`]), which only it then needs.
    pub fn reads_tool_schemas(self) -> bool {
        self == ToolCallParser::Qwen3Coder
    }

    /// Whether a request this parser reads keeps special tokens in its text, as vLLM's
    /// parser asks: the marker it looks for is a special token in some tokenizers
    /// (Mistral's `[TOOL_CALLS]` always, `<tool_call>` in some Hermes ones).
    pub fn keeps_special_tokens(self) -> bool {
        matches!(self, ToolCallParser::Hermes | ToolCallParser::Mistral)
    }

    /// The calls in a finished output; `None` where it calls nothing, or where a call is
    /// not well formed (then all of it is content, as vLLM answers it). `parallel: false`
    /// (a request's `parallel_tool_calls`) keeps the first call only, as vLLM does.
    /// `tools`: the request's tools' parameters, which `qwen3_coder` types its values by.
    pub fn parse(self, text: &str, parallel: bool, tools: &ToolParameters) -> Option<ParsedCalls> {
        let mut parsed = self.parse_all(text, tools)?;
        if !parallel {
            parsed.calls.truncate(1);
        }
        Some(parsed)
    }

    fn parse_all(self, text: &str, tools: &ToolParameters) -> Option<ParsedCalls> {
        match self {
            ToolCallParser::Qwen3Coder => xml::calls(text, tools),
            ToolCallParser::Hermes => {
                let start = text.find(HERMES_START)?;
                // Each call is `<tool_call>…</tool_call>`, the last one's end tag optional
                // (an output cut short of it); text between calls is not content.
                let calls = (spans(text, HERMES_START, HERMES_END, |s| s).into_iter())
                    .map(|call| call_of(serde_json::from_str(call).ok()?, &["arguments"]))
                    .collect::<Option<Vec<_>>>()?;
                Some(ParsedCalls::after(&text[..start], calls))
            }
            ToolCallParser::Mistral => {
                let start = text.find(MISTRAL_START)?;
                // The calls: a JSON list after the marker, or else the widest `[{…}]` in
                // the text (vLLM's fallback).
                let calls = text.replace(MISTRAL_START, "");
                let calls = calls.trim();
                let list: Vec<Value> = serde_json::from_str(calls).ok().or_else(|| {
                    let from = calls.find("[{")?;
                    let to = calls.rfind("}]")? + 2;
                    serde_json::from_str(calls.get(from..to)?).ok()
                })?;
                let calls = list
                    .into_iter()
                    .map(|c| call_of(c, &["arguments"]))
                    .collect::<Option<Vec<_>>>()?;
                Some(ParsedCalls::after(&text[..start], calls))
            }
            ToolCallParser::Llama3Json => {
                let body = text.trim_start();
                let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body).trim_start();
                if !body.starts_with('{') {
                    return None;
                }
                Some(ParsedCalls {
                    content: None,
                    calls: json_calls(body)?,
                })
            }
            ToolCallParser::Pythonic => {
                let spaces = |c: char| c.is_ascii_whitespace();
                let body = match text.trim_start_matches(spaces).strip_prefix(PYTHON_START) {
                    Some(rest) => rest.replace(PYTHON_END, ""),
                    None => text.to_string(),
                };
                let calls = python::calls(&body)?;
                Some(ParsedCalls {
                    content: None,
                    calls: (calls.into_iter())
                        .map(|(name, arguments)| (name, python_json(&Value::Object(arguments))))
                        .collect(),
                })
            }
        }
    }

    /// How many leading bytes of `text`, an output still being generated, are content
    /// whatever follows: none of a call's text, and no tail that may begin one. `sent`
    /// bytes were found to be content before (only the text after them is searched, so a
    /// long output costs no more per token than a short one).
    pub fn streamable_len(self, text: &str, sent: usize) -> usize {
        match self {
            ToolCallParser::Hermes | ToolCallParser::Mistral | ToolCallParser::Qwen3Coder => {
                let markers: &[&str] = match self {
                    ToolCallParser::Hermes => &[HERMES_START],
                    ToolCallParser::Mistral => &[MISTRAL_START],
                    _ => &[HERMES_START, xml::FUNCTION_START],
                };
                let mut from = sent.min(text.len());
                while !text.is_char_boundary(from) {
                    from -= 1;
                }
                // The first place any marker begins: the text is read once, not once per
                // marker (a marker not in it would be looked for to its end at each token).
                let rest = &text[from..];
                let firsts: Vec<char> = markers.iter().filter_map(|m| m.chars().next()).collect();
                let start = (rest.match_indices(&firsts[..]))
                    .map(|(at, _)| at)
                    .find(|&at| markers.iter().any(|m| rest[at..].starts_with(m)));
                match start {
                    Some(start) => from + start,
                    None => {
                        let held = markers.iter().map(|m| partial_suffix(text, m)).max();
                        text.len() - held.unwrap_or(0)
                    }
                }
            }
            ToolCallParser::Llama3Json | ToolCallParser::Pythonic => {
                // The whole output is calls or none: held until its first characters say.
                let (tag, open) = match self {
                    ToolCallParser::Llama3Json => (PYTHON_TAG, '{'),
                    _ => (PYTHON_START, '['),
                };
                let body = text.trim_start();
                let undecided = body.is_empty() || tag.starts_with(body);
                if undecided || body.starts_with(open) || body.starts_with(tag) {
                    0
                } else {
                    text.len()
                }
            }
        }
    }
}

/// The calls of `text`: JSON objects separated by `;` (one may end it), nothing else.
fn json_calls(mut text: &str) -> Option<Vec<(String, String)>> {
    let mut calls = Vec::new();
    loop {
        let mut objects = serde_json::Deserializer::from_str(text).into_iter::<Value>();
        calls.push(call_of(
            objects.next()?.ok()?,
            &["arguments", "parameters"],
        )?);
        let rest = text[objects.byte_offset()..].trim_start();
        text = match rest.strip_prefix(';') {
            Some(next) => next.trim_start(),
            None if rest.is_empty() => rest,
            None => return None,
        };
        if text.is_empty() {
            return Some(calls);
        }
    }
}

/// `{"name": "f", "<one of arguments_keys>": {…}}` as `(name, arguments)`; the arguments
/// are written as Python's `json.dumps` writes them, as vLLM answers them.
fn call_of(v: Value, arguments_keys: &[&str]) -> Option<(String, String)> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = arguments_keys.iter().find_map(|k| v.get(*k))?;
    Some((name, python_json(arguments)))
}

/// The texts between each `start` and the `end` after it, the last to the text's end if it
/// has none (`to_end` turns that last one as a pattern's end would).
pub(super) fn spans<'a>(
    text: &'a str,
    start: &str,
    end: &str,
    to_end: fn(&str) -> &str,
) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(start) {
        let body = &rest[at + start.len()..];
        match body.find(end) {
            Some(e) => {
                out.push(&body[..e]);
                rest = &body[e + end.len()..];
            }
            None => {
                out.push(to_end(body));
                break;
            }
        }
    }
    out
}

/// The longest tail of `text` that is a proper prefix of `marker`.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&marker[..n]))
        .unwrap_or(0)
}

/// `v` as Python's `json.dumps(v, ensure_ascii=False)` writes it: `", "` between items and
/// `": "` after keys.
pub fn python_json(v: &Value) -> String {
    use std::io::{Result, Write};
    fn comma<W: ?Sized + Write>(w: &mut W, first: bool) -> Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    struct Python;
    impl serde_json::ser::Formatter for Python {
        fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> Result<()> {
            comma(w, first)
        }
        fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> Result<()> {
            comma(w, first)
        }
        fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Python);
    serde::Serialize::serialize(v, &mut ser).expect("a JSON value serialises");
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

/// An id for a tool call, in vLLM's form.
pub fn openai_call_id() -> String {
    format!("chatcmpl-tool-{:032x}", rand::random::<u128>())
}

/// 9 letters and digits, the only ids Mistral's chat templates take back.
fn mistral_call_id() -> String {
    const ALPHANUMERIC: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    (0..9)
        .map(|_| ALPHANUMERIC[rand::random::<usize>() % ALPHANUMERIC.len()] as char)
        .collect()
}

/// How a server with `parser` names tool calls, forced ones too: a Mistral model's next
/// turn must take back the ids it was given.
pub fn call_ids(parser: Option<ToolCallParser>) -> fn() -> String {
    match parser {
        Some(ToolCallParser::Mistral) => mistral_call_id,
        _ => openai_call_id,
    }
}

/// OpenAI's `tool_calls` entries for `calls`, each with a fresh id; `indexed`: with each
/// call's `index`, as a streamed delta carries it.
pub fn tool_call_values(
    calls: &[(String, String)],
    indexed: bool,
    mut next_id: impl FnMut() -> String,
) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, (name, arguments))| {
            let mut call = json!({"id": next_id(), "type": "function",
                                  "function": {"name": name, "arguments": arguments}});
            if indexed {
                call["index"] = json!(i);
            }
            call
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The content and each call as `name arguments`.
    fn calls(p: ToolCallParser, text: &str) -> Option<(Option<String>, Vec<String>)> {
        let parsed = p.parse(text, true, &ToolParameters::default())?;
        let calls = parsed.calls.iter().map(|(n, a)| format!("{n} {a}"));
        Some((parsed.content, calls.collect()))
    }

    #[test]
    fn hermes_calls_follow_the_content_and_a_malformed_one_leaves_all_content() {
        let h = ToolCallParser::Hermes;
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1,2]}}\n</tool_call>\n<tool_call>{\"name\":\"now\",\"arguments\":{}}</tool_call>";
        assert_eq!(
            calls(h, text),
            Some((
                Some("Let me look.\n".to_string()),
                vec![
                    r#"get_weather {"city": "Paris", "days": [1, 2]}"#.to_string(),
                    "now {}".to_string()
                ]
            ))
        );
        // Only calls: no content. A last call cut short of its end tag still counts.
        assert_eq!(
            calls(h, "<tool_call>{\"name\": \"f\", \"arguments\": {\"é\": 1}}"),
            Some((None, vec![r#"f {"é": 1}"#.to_string()]))
        );
        for content in [
            "no call here",
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": </tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"f\"}</tool_call>",
        ] {
            assert_eq!(
                h.parse(content, true, &ToolParameters::default()),
                None,
                "{content}"
            );
        }
    }

    #[test]
    fn llama3_json_calls_are_the_whole_output() {
        let l = ToolCallParser::Llama3Json;
        assert_eq!(
            calls(
                l,
                " {\"name\": \"f\", \"parameters\": {\"x\": {\"y\": [1]}}} ; {\"name\": \"g\", \"arguments\": {}}"
            ),
            Some((
                None,
                vec![r#"f {"x": {"y": [1]}}"#.to_string(), "g {}".to_string()]
            ))
        );
        assert_eq!(
            calls(l, "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}"),
            Some((None, vec!["f {}".to_string()]))
        );
        // A last `;` is allowed; a second call needs one before it.
        assert_eq!(
            calls(l, "{\"name\": \"f\", \"parameters\": {}};\n"),
            Some((None, vec!["f {}".to_string()]))
        );
        // parallel_tool_calls: false keeps the first call.
        let two = "{\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"parameters\": {}}";
        assert_eq!(
            l.parse(two, false, &ToolParameters::default())
                .unwrap()
                .calls
                .len(),
            1
        );
        assert_eq!(
            l.parse(two, true, &ToolParameters::default())
                .unwrap()
                .calls
                .len(),
            2
        );
        for content in [
            "The answer is {\"name\": \"f\", \"parameters\": {}}",
            "{\"name\": \"f\", \"parameters\": {}} and some words",
            "{\"name\": \"f\", \"parameters\": {}} {\"name\": \"g\", \"parameters\": {}}",
            "{\"name\": \"f\"}",
            "{not json",
        ] {
            assert_eq!(
                l.parse(content, true, &ToolParameters::default()),
                None,
                "{content}"
            );
        }
    }

    #[test]
    fn mistral_calls_follow_the_marker_with_ids_its_templates_take() {
        let m = ToolCallParser::Mistral;
        let text = "Sure. [TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", \"arguments\": {}}]";
        assert_eq!(
            calls(m, text),
            Some((
                Some("Sure. ".to_string()),
                vec![r#"f {"a": 1}"#.to_string(), "g {}".to_string()]
            ))
        );
        // A list with text around it is found (vLLM's fallback); no list, no call.
        assert_eq!(
            calls(
                m,
                "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}}] done"
            ),
            Some((None, vec!["f {}".to_string()]))
        );
        for content in [
            "no call",
            "[TOOL_CALLS] oops",
            "[TOOL_CALLS][{\"name\": \"f\"}]",
        ] {
            assert_eq!(
                m.parse(content, true, &ToolParameters::default()),
                None,
                "{content}"
            );
        }
        assert_eq!(m.streamable_len("Sure. [TOOL_", 0), "Sure. ".len());
        let id = call_ids(Some(m))();
        assert!(
            id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()),
            "{id}"
        );
        assert!(call_ids(Some(ToolCallParser::Hermes))().starts_with("chatcmpl-tool-"));
        assert!(m.keeps_special_tokens() && !ToolCallParser::Llama3Json.keeps_special_tokens());
    }

    #[test]
    fn streamed_content_stops_where_a_call_may_begin() {
        let h = ToolCallParser::Hermes;
        assert_eq!(h.streamable_len("Hello", 0), 5);
        assert_eq!(h.streamable_len("Hello <tool_", 0), 6);
        assert_eq!(h.streamable_len("Hello <", 0), 6);
        assert_eq!(h.streamable_len("Hello <b>", 0), 9);
        assert_eq!(h.streamable_len("Hi <tool_call>{\"na", 0), 3);
        assert_eq!(h.streamable_len("é<", 0), "é".len());
        // Searched from what was sent: the same answers, whatever was.
        let text = "Hi there <tool_call>{";
        for sent in 0..=9 {
            assert_eq!(h.streamable_len(text, sent), 9, "{sent}");
        }
        let p = ToolCallParser::Pythonic;
        assert_eq!(p.streamable_len(" [get_wea", 0), 0);
        assert_eq!(p.streamable_len("<|python_st", 0), 0);
        assert_eq!(p.streamable_len("Sunny", 0), 5);
        assert_eq!(
            calls(p, "<|python_start|>[f(a=1)]<|python_end|>"),
            Some((None, vec![r#"f {"a": 1}"#.to_string()]))
        );
        assert_eq!(
            p.parse("It is [f(a=1)]", true, &ToolParameters::default()),
            None
        );
        // Qwen3-Coder: the first of its two markers, or a tail of either.
        let q = ToolCallParser::Qwen3Coder;
        for (text, content) in [
            ("Sure <tool_call>\n<function=f>", "Sure "),
            ("Sure <function=f>", "Sure "),
            ("Sure <functi", "Sure "),
            ("Sure <tool_c", "Sure "),
            ("a <b> c", "a <b> c"),
        ] {
            assert_eq!(q.streamable_len(text, 0), content.len(), "{text}");
        }
        let l = ToolCallParser::Llama3Json;
        assert_eq!(l.streamable_len("  ", 0), 0);
        assert_eq!(l.streamable_len(" {\"name", 0), 0);
        assert_eq!(l.streamable_len("<|python", 0), 0);
        assert_eq!(l.streamable_len(" Sure", 0), 5);
    }

    #[test]
    fn arguments_are_written_as_python_writes_them() {
        let v: Value = serde_json::from_str(r#"{"z":[1,{"b":"ü \"q\""}],"c":null}"#).unwrap();
        assert_eq!(
            python_json(&v),
            r#"{"z": [1, {"b": "ü \"q\""}], "c": null}"#,
            "keys in the model's order"
        );
    }
}
