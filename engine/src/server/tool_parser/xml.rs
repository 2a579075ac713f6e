//! Qwen3-Coder's calls (vLLM's `qwen3_coder`): XML-like, each parameter's value plain text,
//! which the type the request's tool gives that parameter turns into JSON.
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Oslo
//! </parameter>
//! <parameter=days>
//! 3
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! Read as vLLM's parser reads it (its regular expressions, spelled out): the calls are the
//! `<function=…>` inside each `<tool_call>…</tool_call>` (the last may be cut), or, in an
//! output without `<tool_call>`, anywhere; a parameter's value ends at `</parameter>`, at
//! the next `<parameter=`, or where its function does, less one line break at each end.

use std::collections::HashMap;

use serde_json::{Map, Number, Value};

use super::{python, python_json, spans, ParsedCalls, ReadCall, HERMES_END, HERMES_START};

pub const FUNCTION_START: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER_START: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// A request's tools' parameters, by function name: each one's schema, as vLLM looks it
/// up (the first tool of the name; its `parameters`' `properties`, or the `parameters`
/// object itself where it has none).
#[derive(Debug, Default)]
pub struct ToolParameters(HashMap<String, Map<String, Value>>);

impl ToolParameters {
    /// From a chat request's `tools`, `[{"type": "function", "function": {…}}, …]`.
    pub fn of(tools: Option<&Value>) -> Self {
        let mut by_name = HashMap::new();
        for tool in tools.and_then(Value::as_array).into_iter().flatten() {
            let function = &tool["function"];
            let (Some("function"), Some(name)) = (tool["type"].as_str(), function["name"].as_str())
            else {
                continue;
            };
            let schema = match &function["parameters"] {
                Value::Object(p) => match p.get("properties") {
                    Some(Value::Object(properties)) => properties.clone(),
                    Some(_) => Map::new(),
                    None => p.clone(),
                },
                _ => Map::new(),
            };
            by_name.entry(name.to_string()).or_insert(schema);
        }
        ToolParameters(by_name)
    }

    /// Parameter `name` of function `function`'s text `text` as JSON.
    fn value(&self, function: &str, name: &str, text: &str) -> Value {
        convert(text, self.0.get(function).and_then(|s| s.get(name)))
    }
}

/// A parameter's `text` as the JSON its `schema` (none where the tool does not name it)
/// makes of it, by vLLM's rules: `null` (any case) is null; a string type, or no type, the
/// text; an integer or number type the number Python's `int` or `float` reads (a float
/// with no fraction written as an integer), else the text; a boolean whether the text is
/// `true` (any case); an object or array type the JSON the text is; any other type the
/// Python literal it is (`ast.literal_eval`), else the text.
fn convert(text: &str, schema: Option<&Value>) -> Value {
    if text.to_lowercase() == "null" {
        return Value::Null;
    }
    let string = || Value::String(text.to_string());
    let Some(schema) = schema else {
        return string();
    };
    // Python's `str()` of a type that is not a string (`["string", "null"]`) matches no
    // name below.
    let kind = match schema.get("type") {
        Some(Value::String(t)) => t.trim().to_lowercase(),
        Some(_) => String::new(),
        None => "string".to_string(),
    };
    let kind = kind.as_str();
    let prefixed = |prefixes: &[&str]| prefixes.iter().any(|p| kind.starts_with(p));
    if ["string", "str", "text", "varchar", "char", "enum"].contains(&kind) {
        string()
    } else if prefixed(&["int", "uint", "long", "short", "unsigned"]) {
        python_int(text).unwrap_or_else(string)
    } else if prefixed(&["num", "float"]) {
        python_float(text).unwrap_or_else(string)
    } else if ["boolean", "bool", "binary"].contains(&kind) {
        Value::Bool(text.to_lowercase() == "true")
    } else {
        let json = ["object", "array", "arr"].contains(&kind) || prefixed(&["dict", "list"]);
        (json.then(|| serde_json::from_str(text).ok()).flatten())
            .or_else(|| python::literal(text))
            .unwrap_or_else(string)
    }
}

/// Whether every `_` of `text` stands between two digits, as Python's numbers have them.
fn underscores_between_digits(text: &str) -> bool {
    let b = text.as_bytes();
    let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    (b.iter().enumerate()).all(|(i, &c)| c != b'_' || (i > 0 && digit(i - 1) && digit(i + 1)))
}

/// Python's `int(text)`: spaces around, a sign, digits (with `_` between them).
fn python_int(text: &str) -> Option<Value> {
    let t = text.trim();
    let digits = t.strip_prefix(['-', '+']).unwrap_or(t);
    let ok = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit() || b == b'_');
    if !ok || !underscores_between_digits(digits) {
        return None;
    }
    let t = t.replace('_', "");
    let t = t.strip_prefix('+').unwrap_or(&t);
    // (Python's integers have no bound; one beyond 64 bits stays text here.)
    t.parse::<i64>()
        .map(Value::from)
        .ok()
        .or_else(|| t.parse::<u64>().ok().map(Value::from))
}

/// Python's `float(text)`, written as an integer where it has no fraction (vLLM's rule);
/// none where it is infinite or not a number (Python's `int()` of it fails there).
fn python_float(text: &str) -> Option<Value> {
    let t = text.trim();
    if !underscores_between_digits(t) {
        return None;
    }
    let f: f64 = t.replace('_', "").parse().ok()?;
    if !f.is_finite() {
        return None;
    }
    // (An integer beyond 64 bits, which Python writes whole, is written as a float here.)
    const TWO_63: f64 = 9_223_372_036_854_775_808.0;
    match f.fract() == 0.0 {
        true if f.abs() < TWO_63 => Some(Value::from(f as i64)),
        true if (0.0..2.0 * TWO_63).contains(&f) => Some(Value::from(f as u64)),
        _ => Number::from_f64(f).map(Value::Number),
    }
}

/// Where Python's `$` first matches at the end of `s`: before a last line break.
fn before_last_line_break(s: &str) -> &str {
    s.strip_suffix('\n').unwrap_or(s)
}

/// The calls of a finished output; `None` where it has none, or one is not well formed
/// (a name without its `>`): then all of it is content, as vLLM answers it.
pub fn calls(text: &str, tools: &ToolParameters) -> Option<ParsedCalls> {
    if !text.contains(FUNCTION_START) {
        return None;
    }
    let mut regions = spans(text, HERMES_START, HERMES_END, before_last_line_break);
    if regions.is_empty() {
        regions.push(text);
    }
    let mut calls = Vec::new();
    for region in regions {
        for function in spans(region, FUNCTION_START, FUNCTION_END, |s| s) {
            calls.push(function_call(function, tools)?);
        }
    }
    if calls.is_empty() {
        return None;
    }
    let start = (text.find(HERMES_START))
        .or_else(|| text.find(FUNCTION_START))
        .expect("a call's start");
    Some(ParsedCalls::after(&text[..start], calls))
}

/// `name>` and its parameters, as `(name, arguments)`.
fn function_call(function: &str, tools: &ToolParameters) -> Option<(String, String)> {
    let (name, mut rest) = function.split_once('>')?;
    let mut arguments = Map::new();
    while let Some(at) = rest.find(PARAMETER_START) {
        let body = &rest[at + PARAMETER_START.len()..];
        let end = [PARAMETER_END, PARAMETER_START]
            .into_iter()
            .filter_map(|m| body.find(m).map(|at| (at, m)))
            .min();
        let parameter = match end {
            Some((at, marker)) => {
                // `</parameter>` is passed; the next `<parameter=` is read next.
                rest = &body[at
                    + if marker == PARAMETER_END {
                        marker.len()
                    } else {
                        0
                    }..];
                &body[..at]
            }
            None => {
                rest = "";
                before_last_line_break(body)
            }
        };
        let (key, value) = parameter.split_once('>')?;
        arguments.insert(
            key.to_string(),
            tools.value(name, key, trim_line_breaks(value)),
        );
    }
    Some((name.to_string(), python_json(&Value::Object(arguments))))
}

/// A value less one line break at its start and one at its end.
fn trim_line_breaks(value: &str) -> &str {
    let value = value.strip_prefix('\n').unwrap_or(value);
    value.strip_suffix('\n').unwrap_or(value)
}

/// Where the reader is.
#[derive(Debug)]
enum Place {
    /// Between calls: before `<tool_call>` or `<function=` (in a `<tool_call>`, before
    /// `<function=` or its end).
    Between,
    /// A function's name (`parameter`: a parameter's), from byte `start`, up to `>`.
    Name { start: usize, parameter: bool },
    /// In a function: before a `<parameter=`, or its end.
    Body,
    /// Parameter `name`'s value, from byte `start`.
    Value { name: String, start: usize },
}

/// The calls of an output read as it is written, for a stream, as vLLM streams them: a
/// call from its name's `>` (`{`), then each parameter once its value has ended (its
/// `"name": value`), then `}` once its function has. Each byte is searched once for the
/// markers that may come (plus a marker's length where the text ended).
#[derive(Debug)]
pub struct Reader {
    /// Where to read on from.
    pos: usize,
    place: Place,
    /// In a `<tool_call>`.
    in_region: bool,
    /// A `<tool_call>` has been read: the calls are those inside one (as vLLM's parse
    /// has them, which then passes by a `<function=` outside).
    regions: bool,
    /// Parameters written of the call being read.
    parameters: usize,
    pub calls: Vec<ReadCall>,
}

impl Reader {
    pub fn new() -> Self {
        Reader {
            pos: 0,
            place: Place::Between,
            in_region: false,
            regions: false,
            parameters: 0,
            calls: Vec::new(),
        }
    }

    /// Reads on through `text`, the output so far.
    pub fn read(&mut self, text: &str, tools: &ToolParameters) {
        loop {
            let markers: &[&str] = match (&self.place, self.in_region) {
                (Place::Between, true) => &[FUNCTION_START, HERMES_END],
                (Place::Between, false) if self.regions => &[HERMES_START],
                (Place::Between, false) => &[HERMES_START, FUNCTION_START],
                (Place::Name { .. }, _) => &[">"],
                (Place::Body, true) => &[PARAMETER_START, FUNCTION_END, HERMES_END],
                (Place::Body, false) => &[PARAMETER_START, FUNCTION_END],
                (Place::Value { .. }, true) => {
                    &[PARAMETER_END, PARAMETER_START, FUNCTION_END, HERMES_END]
                }
                (Place::Value { .. }, false) => &[PARAMETER_END, PARAMETER_START, FUNCTION_END],
            };
            let Some((at, marker)) = self.find(text, markers) else {
                return;
            };
            let after = at + marker.len();
            self.pos = after;
            self.place = match std::mem::replace(&mut self.place, Place::Between) {
                Place::Between => match marker {
                    HERMES_START => {
                        (self.in_region, self.regions) = (true, true);
                        Place::Between
                    }
                    HERMES_END => {
                        self.in_region = false;
                        Place::Between
                    }
                    _ => Place::Name {
                        start: after,
                        parameter: false,
                    },
                },
                Place::Name { start, parameter } => {
                    let name = text[start..at].to_string();
                    if parameter {
                        Place::Value { name, start: after }
                    } else {
                        self.calls.push(ReadCall {
                            name,
                            arguments: "{".to_string(),
                            whole: false,
                        });
                        self.parameters = 0;
                        Place::Body
                    }
                }
                Place::Body => self.after_parameter(marker),
                Place::Value { name, start } => {
                    // Where the function's text ends, Python's `$` passes a last line break.
                    let value = match marker {
                        FUNCTION_END | HERMES_END => before_last_line_break(&text[start..at]),
                        _ => &text[start..at],
                    };
                    let call = self.calls.last_mut().expect("a call being read");
                    let value = tools.value(&call.name, &name, trim_line_breaks(value));
                    if self.parameters > 0 {
                        call.arguments.push_str(", ");
                    }
                    call.arguments.push_str(&python_json(&Value::String(name)));
                    call.arguments.push_str(": ");
                    call.arguments.push_str(&python_json(&value));
                    self.parameters += 1;
                    // The next parameter's start is read again as one.
                    if marker == PARAMETER_START {
                        self.pos = at;
                        Place::Body
                    } else {
                        self.after_parameter(marker)
                    }
                }
            };
        }
    }

    /// Where the reader goes from a function's body on `marker`.
    fn after_parameter(&mut self, marker: &str) -> Place {
        match marker {
            PARAMETER_START => Place::Name {
                start: self.pos,
                parameter: true,
            },
            PARAMETER_END => Place::Body,
            // The function ends (with its `<tool_call>` at `</tool_call>`).
            _ => {
                let call = self.calls.last_mut().expect("a call being read");
                call.arguments.push('}');
                call.whole = true;
                if marker == HERMES_END {
                    self.in_region = false;
                }
                Place::Between
            }
        }
    }

    /// The first of `markers` in `text` from `pos`, with where it is. Where none is, the
    /// next search starts where one may yet end.
    fn find(&mut self, text: &str, markers: &[&'static str]) -> Option<(usize, &'static str)> {
        let rest = text.get(self.pos..)?;
        let found = (markers.iter())
            .filter_map(|&m| rest.find(m).map(|at| (self.pos + at, m)))
            .min();
        if found.is_none() {
            // (A value keeps its start in its place; only the search moves on.)
            let longest = markers.iter().map(|m| m.len()).max().unwrap_or(1);
            let mut resume = text.len().saturating_sub(longest - 1).max(self.pos);
            while !text.is_char_boundary(resume) {
                resume -= 1;
            }
            self.pos = resume;
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> ToolParameters {
        ToolParameters::of(Some(&json!([
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
                "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
                "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": "array"},
                "any": {"type": "any"}, "either": {"type": ["string", "null"]}, "untyped": {},
            }}}},
            {"type": "function", "function": {"name": "g", "parameters": {"x": {"type": "integer"}}}},
        ])))
    }

    #[test]
    fn each_value_is_what_its_type_makes_of_its_text() {
        let t = tools();
        for (name, text, value) in [
            ("s", "42", json!("42")),
            ("s", "NULL", json!(null)),
            ("i", " -1_000 ", json!(-1000)),
            ("i", "007", json!(7)),
            ("i", "1.5", json!("1.5")),
            ("i", "1__0", json!("1__0")),
            ("n", "2.50", json!(2.5)),
            ("n", "3.0", json!(3)),
            ("n", "1e3", json!(1000)),
            ("n", "inf", json!("inf")),
            ("n", "x", json!("x")),
            ("b", "True", json!(true)),
            ("b", "yes", json!(false)),
            ("o", "{\"k\": [1]}", json!({"k": [1]})),
            ("o", "{'k': None}", json!({"k": null})),
            ("a", "[1, 'x']", json!([1, "x"])),
            ("a", "not a list", json!("not a list")),
            ("any", "[True]", json!([true])),
            ("any", "Oslo", json!("Oslo")),
            ("either", "1", json!(1)),
            ("untyped", "1", json!("1")),
            ("unknown", "1", json!("1")),
        ] {
            assert_eq!(t.value("f", name, text), value, "{name} {text:?}");
        }
        // A tool's `parameters` without `properties` are its parameters (vLLM's reading);
        // a function the request does not have takes each value as text.
        assert_eq!(t.value("g", "x", "5"), json!(5));
        assert_eq!(t.value("h", "x", "5"), json!("5"));
    }

    /// The content, and each call's name and arguments.
    type Read = (Option<String>, Vec<(String, Value)>);

    fn parsed(text: &str) -> Option<Read> {
        let p = calls(text, &tools())?;
        let calls = (p.calls.into_iter())
            .map(|(n, a)| (n, serde_json::from_str(&a).unwrap()))
            .collect();
        Some((p.content, calls))
    }

    #[test]
    fn calls_are_read_as_vllm_reads_them() {
        let text = "Let me see.\n<tool_call>\n<function=f>\n<parameter=s>\nline one\nline two\n\n</parameter>\n<parameter=i>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=g>\n</function>\n</tool_call>";
        assert_eq!(
            parsed(text),
            Some((
                Some("Let me see.\n".into()),
                vec![
                    ("f".into(), json!({"s": "line one\nline two\n", "i": 3})),
                    ("g".into(), json!({})),
                ]
            ))
        );
        // A value ends at the next parameter or its function's end, less a line break; a
        // cut call counts; without `<tool_call>`, a function anywhere.
        assert_eq!(
            parsed("<function=f><parameter=s>a\n<parameter=i>2\n\n</function>"),
            Some((None, vec![("f".into(), json!({"s": "a", "i": 2}))]))
        );
        assert_eq!(
            parsed("<tool_call>\n<function=f>\n<parameter=s>\nOs"),
            Some((None, vec![("f".into(), json!({"s": "Os"}))]))
        );
        // With `<tool_call>`, a function outside one is passed by.
        assert_eq!(
            parsed("<function=g></function><tool_call><function=f></function></tool_call>"),
            Some((
                Some("<function=g></function>".into()),
                vec![("f".into(), json!({}))]
            ))
        );
        // Python's `$` passes a last line break where a cut `<tool_call>` ends the text,
        // and again where the value ends its function's text.
        assert_eq!(
            parsed("<tool_call>\n<function=f>\n<parameter=s>\nOs\n\n\n"),
            Some((None, vec![("f".into(), json!({"s": "Os"}))]))
        );
        // No function, or a name without its `>`: content.
        for text in [
            "<tool_call>\n</tool_call>",
            "plain",
            "<function=f",
            "<function=f><parameter=s",
        ] {
            assert_eq!(parsed(text), None, "{text}");
        }
    }

    #[test]
    fn a_stream_reads_what_the_whole_parse_reads_however_cut() {
        let t = tools();
        for text in [
            // Values ended by the next parameter, their function's end (where Python's `$`
            // passes a last line break), their `<tool_call>`'s end.
            "<tool_call>\n<function=f>\n<parameter=s>\na\n\n<parameter=i>\n2\n\n\n</function>\n</tool_call>",
            "<tool_call><function=f><parameter=s>\nx\n\n</tool_call><tool_call><function=g><parameter=x>7</parameter></function></tool_call>",
            "Hi <function=f><parameter=n>1.5\n</parameter>junk<parameter=b>TRUE</parameter></function> <function=g></function>",
        ] {
            let whole = calls(text, &t).expect("calls").calls;
            let bounds: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
            let mut r = Reader::new();
            for end in bounds {
                r.read(&text[..end], &t);
            }
            let read: Vec<(String, String)> =
                (r.calls.iter()).map(|c| (c.name.clone(), c.arguments.clone())).collect();
            assert_eq!(read, whole, "{text}");
        }
    }

    #[test]
    fn a_stream_reads_each_parameter_once_its_value_ends() {
        let text = "<tool_call>\n<function=f>\n<parameter=s>\nOslo\n</parameter>\n<parameter=i>\n3\n</parameter>\n</function>\n</tool_call>";
        let t = tools();
        let mut r = Reader::new();
        let mut at = |upto: &str| {
            r.read(&text[..text.find(upto).unwrap() + upto.len()], &t);
            r.calls
                .iter()
                .map(|c| (c.arguments.clone(), c.whole))
                .collect::<Vec<_>>()
        };
        assert_eq!(at("<function=f"), []);
        assert_eq!(at("<function=f>"), [("{".into(), false)]);
        assert_eq!(at("Oslo\n</parameter"), [("{".into(), false)]);
        assert_eq!(
            at("Oslo\n</parameter>"),
            [("{\"s\": \"Oslo\"".into(), false)]
        );
        assert_eq!(
            at("3\n</parameter>"),
            [("{\"s\": \"Oslo\", \"i\": 3".into(), false)]
        );
        assert_eq!(
            at("</function>"),
            [("{\"s\": \"Oslo\", \"i\": 3}".into(), true)]
        );
    }
}
