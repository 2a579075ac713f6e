//! A streamed output's tool calls as they are generated, as vLLM streams them: a call goes
//! out once it has a name and its arguments have begun (with its id), then its arguments
//! piece by piece. A `pythonic` call's arguments go out as JSON, as they are written
//! ([`python::ListReader`]); a `qwen3_coder` call's a parameter at a time ([`xml::Reader`]).
//!
//! The arguments are written as the whole output's parse writes them
//! ([`super::python_json`]): a string's text as it comes (less an escape not yet whole),
//! any other JSON lexeme once finished (a number once a character follows it). So what
//! has been sent is always a prefix of the non-streamed answer's arguments, and a
//! well-formed output's chunks add up to it. An
//! output whose calls turn out not to be well formed (cut at `max_tokens`, or broken
//! JSON) keeps in the stream the calls as far as they went; its non-streamed answer is
//! content, as vLLM answers it. An object that gives a key twice is written with both, or
//! read by its first name or arguments (the parse keeps the last): the stream cannot wait
//! for the object's end.

use serde_json::{json, Value};

use std::sync::Arc;

use super::{
    partial_suffix, python, python_json, xml, ParsedCalls, ToolCallParser, ToolParameters,
};
use super::{HERMES_START, MISTRAL_START, PYTHON_START, PYTHON_TAG};

/// Where each character or escape of a JSON string's text `part` ends, as far as they are
/// whole: each end at a character's boundary (an escape of anything is `\` and a whole
/// character, and a `\u` escape's digits are ASCII or it is none; a `\uD83D` goes with the
/// `\uDE00` after it).
fn string_units(part: &str) -> impl Iterator<Item = usize> + '_ {
    let bytes = part.as_bytes();
    let mut end = 0;
    std::iter::from_fn(move || {
        let len = match *bytes.get(end)? {
            b'\\' => match bytes.get(end + 1) {
                Some(b'u') => {
                    let ascii = |n: usize| bytes[end..bytes.len().min(end + n)].is_ascii();
                    let high = (part.get(end + 2..end + 6))
                        .and_then(|h| u16::from_str_radix(h, 16).ok())
                        .is_some_and(|u| (0xD800..0xDC00).contains(&u));
                    match (ascii(6), high && ascii(12)) {
                        (false, _) => 2,
                        (true, true) => 12,
                        (true, false) => 6,
                    }
                }
                Some(&next) => 1 + utf8_len(next),
                None => 2,
            },
            b => utf8_len(b),
        };
        (end + len <= bytes.len()).then(|| {
            end += len;
            end
        })
    })
}

/// The bytes of the UTF-8 character that begins with `b`.
fn utf8_len(b: u8) -> usize {
    match b {
        0xF0.. => 4,
        0xE0.. => 3,
        0xC0.. => 2,
        _ => 1,
    }
}

/// The characters JSON allows between its tokens.
const JSON_SPACES: [char; 4] = [' ', '\t', '\n', '\r'];

/// Where a call's JSON text stops being readable as a call: the stream stops there, and
/// the whole output's parse decides the rest.
#[derive(Debug)]
struct Malformed;

/// What the reader expects next.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Want {
    Value,
    /// An array's first value, or its end.
    ValueOrClose,
    /// An object's first key, or its end.
    KeyOrClose,
    Key,
    Colon,
    CommaOrClose,
}

/// A string, number or literal being read, from byte `start` of the text.
#[derive(Debug, Clone, Copy)]
enum Lexeme {
    /// A string (`key`: an object's key); `scan` bytes read so far, `escaped` after a `\`.
    /// A value's text is written as it comes: up to byte `written` of the text (a key's is
    /// written whole).
    String {
        start: usize,
        key: bool,
        scan: usize,
        escaped: bool,
        written: usize,
    },
    /// A number; `scan` bytes read so far.
    Number {
        start: usize,
        scan: usize,
    },
    Literal {
        start: usize,
        word: &'static str,
    },
}

/// One call object `{"name": …, "arguments": …}`, read as its text grows. Each lexeme is
/// written to `out` as [`python_json`] writes it, once finished (a string value's text as
/// it comes); the name and where the arguments' value sits in `out` are taken from the
/// object's own keys.
#[derive(Debug)]
struct CallReader {
    /// Bytes of the output read (the object starts at the byte it was made at).
    pos: usize,
    out: String,
    /// Open containers, `true` for an object.
    stack: Vec<bool>,
    want: Want,
    lexeme: Option<Lexeme>,
    /// The top object's key whose value is being read.
    key: Option<String>,
    /// The keys that may hold the arguments (the first met is taken).
    arguments_keys: &'static [&'static str],
    name: Option<String>,
    /// Where the arguments' value starts in `out`, and ends once whole.
    arguments: Option<(usize, Option<usize>)>,
    /// The object is whole.
    done: bool,
    /// Its text broke off where no JSON goes on: nothing more is read.
    broken: bool,
}

impl CallReader {
    fn new(pos: usize, arguments_keys: &'static [&'static str]) -> Self {
        CallReader {
            pos,
            out: String::new(),
            stack: Vec::new(),
            want: Want::Value,
            lexeme: None,
            key: None,
            arguments_keys,
            name: None,
            arguments: None,
            done: false,
            broken: false,
        }
    }

    /// The arguments' text so far.
    fn arguments_text(&self) -> &str {
        match self.arguments {
            Some((from, to)) => &self.out[from..to.unwrap_or(self.out.len())],
            None => "",
        }
    }

    /// Reads `text` (the whole output so far) up to its end or the object's.
    fn read(&mut self, text: &str) -> Result<(), Malformed> {
        let bytes = text.as_bytes();
        while !self.done {
            if let Some(lexeme) = self.lexeme {
                if !self.read_lexeme(text, lexeme)? {
                    return Ok(());
                }
                continue;
            }
            while self.pos < bytes.len() && JSON_SPACES.contains(&(bytes[self.pos] as char)) {
                self.pos += 1;
            }
            let Some(&b) = bytes.get(self.pos) else {
                return Ok(());
            };
            let start = self.pos;
            self.pos += 1;
            match (self.want, b) {
                (Want::ValueOrClose, b']') | (Want::KeyOrClose, b'}') => self.close()?,
                (Want::CommaOrClose, b'}' | b']') => self.close_with(b)?,
                (Want::CommaOrClose, b',') => {
                    self.out.push_str(", ");
                    self.want = match self.stack.last() {
                        Some(true) => Want::Key,
                        _ => Want::Value,
                    };
                }
                (Want::Colon, b':') => {
                    self.out.push_str(": ");
                    self.want = Want::Value;
                }
                (Want::Key | Want::KeyOrClose, b'"') => {
                    self.lexeme = Some(Lexeme::String {
                        start,
                        key: true,
                        scan: self.pos,
                        escaped: false,
                        written: self.pos,
                    });
                }
                (Want::Value | Want::ValueOrClose, _) => {
                    if !matches!(
                        b,
                        b'{' | b'[' | b'"' | b'-' | b'0'..=b'9' | b't' | b'f' | b'n'
                    ) {
                        // Python's `None` or `'x'`: no JSON value, and no arguments begun.
                        return Err(Malformed);
                    }
                    self.begin_value();
                    match b {
                        b'{' | b'[' => {
                            self.out.push(b as char);
                            self.stack.push(b == b'{');
                            self.want = if b == b'{' {
                                Want::KeyOrClose
                            } else {
                                Want::ValueOrClose
                            };
                        }
                        b'"' => {
                            self.out.push('"');
                            self.lexeme = Some(Lexeme::String {
                                start,
                                key: false,
                                scan: self.pos,
                                escaped: false,
                                written: self.pos,
                            })
                        }
                        b'-' | b'0'..=b'9' => {
                            self.lexeme = Some(Lexeme::Number { start, scan: start })
                        }
                        b't' => {
                            self.lexeme = Some(Lexeme::Literal {
                                start,
                                word: "true",
                            })
                        }
                        b'f' => {
                            self.lexeme = Some(Lexeme::Literal {
                                start,
                                word: "false",
                            })
                        }
                        b'n' => {
                            self.lexeme = Some(Lexeme::Literal {
                                start,
                                word: "null",
                            })
                        }
                        _ => return Err(Malformed),
                    }
                }
                _ => return Err(Malformed),
            }
        }
        Ok(())
    }

    /// Reads on in `lexeme`; `false` where the text ends first.
    fn read_lexeme(&mut self, text: &str, lexeme: Lexeme) -> Result<bool, Malformed> {
        let bytes = text.as_bytes();
        let (value, end) = match lexeme {
            Lexeme::String {
                start,
                key,
                mut scan,
                mut escaped,
                mut written,
            } => {
                let close = loop {
                    let Some(&b) = bytes.get(scan) else {
                        if !key {
                            written = self.write_string_part(&text[written..scan], written)?;
                        }
                        self.lexeme = Some(Lexeme::String {
                            start,
                            key,
                            scan,
                            escaped,
                            written,
                        });
                        return Ok(false);
                    };
                    scan += 1;
                    match (escaped, b) {
                        (true, _) => escaped = false,
                        (false, b'\\') => escaped = true,
                        (false, b'"') => break scan,
                        _ => {}
                    }
                };
                if !key {
                    // The rest of the value's text (what reads of it, where it breaks).
                    self.write_string_part(&text[written..close - 1], written)?;
                }
                let s: String = serde_json::from_str(&text[start..close]).map_err(|_| Malformed)?;
                if key {
                    self.lexeme = None;
                    self.pos = close;
                    self.out.push_str(&python_json(&Value::String(s.clone())));
                    if self.stack.len() == 1 {
                        self.key = Some(s);
                    }
                    self.want = Want::Colon;
                    return Ok(true);
                }
                self.out.push('"');
                self.lexeme = None;
                self.pos = close;
                self.end_value(Some(Value::String(s)));
                return Ok(true);
            }
            Lexeme::Number { start, scan } => {
                let number = |b: &u8| matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E');
                let Some(len) = bytes[scan..].iter().position(|b| !number(b)) else {
                    // Read on from here next time, not from the number's start.
                    self.lexeme = Some(Lexeme::Number {
                        start,
                        scan: bytes.len(),
                    });
                    return Ok(false);
                };
                let end = scan + len;
                let n: serde_json::Number =
                    serde_json::from_str(&text[start..end]).map_err(|_| Malformed)?;
                (Value::Number(n), end)
            }
            Lexeme::Literal { start, word } => {
                let have = &bytes[start..bytes.len().min(start + word.len())];
                if !word.as_bytes().starts_with(have) {
                    return Err(Malformed);
                }
                if have.len() < word.len() {
                    return Ok(false);
                }
                let v: Value = serde_json::from_str(word).expect("a JSON literal");
                (v, start + word.len())
            }
        };
        self.lexeme = None;
        self.pos = end;
        self.out.push_str(&python_json(&value));
        self.end_value(Some(value));
        Ok(true)
    }

    /// Writes a string value's `part` (its text from byte `at` of the output) as far as
    /// it can be read: up to an escape not yet whole (a `\uD83D` waits for the `\uDE00`
    /// after it). Each character is escaped on its own, so the parts written add up to the
    /// whole string as [`python_json`] writes it. Answers the byte written up to; where
    /// the part does not read as JSON (a raw line break, `\q`), writes what does before it
    /// and fails, so however the text came in pieces, the same goes out.
    fn write_string_part(&mut self, part: &str, at: usize) -> Result<usize, Malformed> {
        let end = string_units(part).last().unwrap_or(0);
        let decode = |text: Option<&str>| {
            text.and_then(|t| serde_json::from_str::<String>(&format!("\"{t}\"")).ok())
        };
        let (written, result) = match decode(part.get(..end)) {
            Some(s) => ((end, s), Ok(at + end)),
            None => {
                // The longest run of whole characters that reads.
                let mut good = (0, String::new());
                let mut from = 0;
                for e in string_units(part) {
                    let Some(c) = decode(part.get(from..e)) else {
                        break;
                    };
                    good.1.push_str(&c);
                    (good.0, from) = (e, e);
                }
                (good, Err(Malformed))
            }
        };
        if written.0 > 0 {
            let escaped = python_json(&Value::String(written.1));
            self.out.push_str(&escaped[1..escaped.len() - 1]);
        }
        result
    }

    /// A value begins: where the arguments start, if it is theirs.
    fn begin_value(&mut self) {
        let is_arguments = self
            .key
            .as_deref()
            .is_some_and(|k| self.arguments_keys.contains(&k));
        if self.stack.len() == 1 && is_arguments && self.arguments.is_none() {
            self.arguments = Some((self.out.len(), None));
        }
    }

    /// A value has ended (`scalar`: it, where it is not a container).
    fn end_value(&mut self, scalar: Option<Value>) {
        match self.stack.len() {
            0 => self.done = true,
            1 => {
                if let Some((from, None)) = self.arguments {
                    if self
                        .key
                        .as_deref()
                        .is_some_and(|k| self.arguments_keys.contains(&k))
                    {
                        self.arguments = Some((from, Some(self.out.len())));
                    }
                }
                if let (Some("name"), Some(Value::String(name))) = (self.key.as_deref(), scalar) {
                    self.name.get_or_insert(name);
                }
                self.key = None;
            }
            _ => {}
        }
        self.want = Want::CommaOrClose;
    }

    fn close_with(&mut self, b: u8) -> Result<(), Malformed> {
        match (self.stack.last(), b) {
            (Some(true), b'}') | (Some(false), b']') => self.close(),
            _ => Err(Malformed),
        }
    }

    fn close(&mut self) -> Result<(), Malformed> {
        let object = self.stack.pop().ok_or(Malformed)?;
        self.out.push(if object { '}' } else { ']' });
        self.end_value(None);
        Ok(())
    }
}

/// Where the stream stands in the output's calls.
#[derive(Debug)]
enum Place {
    /// Before a call's marker (Hermes's each call's, Mistral's the list's).
    Marker,
    /// Llama 3's start: spaces and `<|python_tag|>` may come before the first call;
    /// Python's: spaces and `<|python_start|>` before its list.
    Tag,
    /// Before a call object's `{`.
    Object,
    /// Before Mistral's list's `[`.
    List,
    /// In a call object.
    Call(CallReader),
    /// In Python's list of calls.
    PythonCalls(python::ListReader),
    /// In Qwen3-Coder's output, read whole by its own reader.
    XmlCalls(xml::Reader),
    /// After a call: a format's separator, or its end.
    After,
    /// No more calls are streamed: the output's end, `parallel_tool_calls: false`'s first
    /// call, or text no call can be read from (the whole output's parse decides).
    Stopped,
}

/// A streamed call: what has been sent of it.
#[derive(Debug)]
struct SentCall {
    name: String,
    arguments: String,
}

/// The calls of one streamed output (one choice) under `tool_choice: "auto"`.
#[derive(Debug)]
pub struct CallStream {
    parser: ToolCallParser,
    parallel: bool,
    /// Bytes of the output read, outside a call object.
    pos: usize,
    place: Place,
    /// Call objects begun.
    calls_read: usize,
    sent: Vec<SentCall>,
    /// The request's tools' parameters (`qwen3_coder` types its values by them).
    tools: Arc<ToolParameters>,
}

impl CallStream {
    /// `parallel`: the request's `parallel_tool_calls` (false streams the first call only);
    /// `tools`: its tools' parameters.
    pub fn new(parser: ToolCallParser, parallel: bool, tools: Arc<ToolParameters>) -> Self {
        let place = match parser {
            ToolCallParser::Hermes | ToolCallParser::Mistral => Place::Marker,
            ToolCallParser::Llama3Json | ToolCallParser::Pythonic => Place::Tag,
            ToolCallParser::Qwen3Coder => Place::XmlCalls(xml::Reader::new()),
        };
        CallStream {
            parser,
            parallel,
            pos: 0,
            place,
            calls_read: 0,
            sent: Vec::new(),
            tools,
        }
    }

    /// Whether a call has gone out.
    pub fn started(&self) -> bool {
        !self.sent.is_empty()
    }

    /// The `tool_calls` delta entries (with their `index`) that `text`, the whole output so
    /// far, adds to what was sent: a call whose name is now known, with its id from
    /// `next_id`, and the arguments read since.
    pub fn advance(&mut self, text: &str, next_id: fn() -> String) -> Vec<Value> {
        let mut entries = Vec::new();
        loop {
            let mut moved = self.step(text);
            let read = match &self.place {
                Place::PythonCalls(reader) => Some((&reader.calls, reader.ended)),
                Place::XmlCalls(reader) => Some((&reader.calls, false)),
                _ => None,
            };
            if let Some((calls, ended)) = read {
                // A call goes out once its arguments have begun (Python's `(`, Qwen3-Coder's
                // name's `>`); of those sent, only the last can have grown.
                // `parallel_tool_calls: false` streams the first call only.
                let kept = if self.parallel { usize::MAX } else { 1 };
                let first_whole = calls.first().is_some_and(|c| c.whole);
                let calls = calls.iter().take(kept).enumerate();
                for (index, call) in calls.skip(self.sent.len().saturating_sub(1)) {
                    if call.arguments.is_empty() {
                        break;
                    }
                    let (name, arguments) = (&call.name, &call.arguments);
                    entries.extend(progress(&mut self.sent, index, name, arguments, next_id));
                }
                if ended || (first_whole && !self.parallel) {
                    self.place = Place::Stopped;
                }
            }
            if let Place::Call(reader) = &self.place {
                // A call goes out once it has a name and its arguments have begun: JSON
                // with a "name" alone (a Llama 3 answer that is an object) is no call.
                if let (Some(name), Some(_)) = (&reader.name, reader.arguments) {
                    let index = self.calls_read - 1;
                    let arguments = reader.arguments_text();
                    entries.extend(progress(&mut self.sent, index, name, arguments, next_id));
                }
                if reader.done || reader.broken {
                    // A call without a name or arguments is no call: the whole output's
                    // parse answers it as content.
                    let call = reader.name.is_some() && reader.arguments.is_some();
                    self.place = match call && self.parallel && !reader.broken {
                        true => {
                            self.pos = reader.pos;
                            Place::After
                        }
                        false => Place::Stopped,
                    };
                    moved = true;
                }
            }
            if !moved {
                return entries;
            }
        }
    }

    /// The entries that finish the stream as `parsed`, the whole output's calls, answers
    /// it: the rest of each call sent (none, where its last lexeme was whole), then the
    /// calls not sent, whole.
    pub fn finish(&mut self, parsed: &ParsedCalls, next_id: fn() -> String) -> Vec<Value> {
        let mut entries = Vec::new();
        for (index, (name, arguments)) in parsed.calls.iter().enumerate() {
            match self.sent.get_mut(index) {
                // Where the parse read the call otherwise (a key given twice, of which it
                // keeps the last), nothing: a stream cannot take back what it sent.
                Some(sent) => {
                    let rest = arguments.strip_prefix(sent.arguments.as_str());
                    if let Some(rest) = rest.filter(|r| !r.is_empty() && sent.name == *name) {
                        entries.push(arguments_entry(index, rest));
                        sent.arguments.push_str(rest);
                    }
                }
                None => entries.push(announce(&mut self.sent, name, arguments, next_id)),
            }
        }
        self.place = Place::Stopped;
        entries
    }

    /// Moves on through `text` by one place; `false` where it cannot yet.
    fn step(&mut self, text: &str) -> bool {
        // (`pos` is always a character's start: past ASCII or whole characters.)
        let Some(rest) = text.get(self.pos..) else {
            return false;
        };
        // Spaces before a token are passed once, not read again at each token. Inside
        // JSON text only JSON's spaces; around it, any (as the parse trims).
        let rest = match (self.parser, &self.place) {
            (ToolCallParser::Hermes, Place::Object)
            | (ToolCallParser::Mistral, Place::Object | Place::After) => {
                rest.trim_start_matches(JSON_SPACES)
            }
            // Python's spaces are ASCII's.
            (ToolCallParser::Pythonic, Place::Tag | Place::List) => {
                rest.trim_start_matches(|c: char| c.is_ascii_whitespace())
            }
            (_, Place::Tag | Place::Object | Place::List | Place::After) => rest.trim_start(),
            _ => rest,
        };
        self.pos = text.len() - rest.len();
        let next = match &mut self.place {
            Place::Stopped => return false,
            Place::Marker => {
                let marker = match self.parser {
                    ToolCallParser::Mistral => MISTRAL_START,
                    _ => HERMES_START,
                };
                match rest.find(marker) {
                    Some(at) => {
                        self.pos += at + marker.len();
                        match self.parser {
                            ToolCallParser::Mistral => Place::List,
                            _ => Place::Object,
                        }
                    }
                    None => {
                        // Keep a tail that may begin the marker.
                        self.pos = text.len() - partial_suffix(text, marker);
                        return false;
                    }
                }
            }
            Place::Tag => {
                let (tag, list) = match self.parser {
                    ToolCallParser::Pythonic => (PYTHON_START, Place::List),
                    _ => (PYTHON_TAG, Place::Object),
                };
                if rest.is_empty() || (tag.starts_with(rest) && rest != tag) {
                    return false;
                }
                if rest.starts_with(tag) {
                    self.pos += tag.len();
                }
                list
            }
            Place::PythonCalls(reader) => {
                reader.read(text);
                // The caller sends what was read, and stops where the list did.
                return false;
            }
            Place::XmlCalls(reader) => {
                reader.read(text, &self.tools);
                return false;
            }
            Place::Object | Place::List => {
                let open = match self.place {
                    Place::List => b'[',
                    _ => b'{',
                };
                match rest.as_bytes().first() {
                    None => return false,
                    Some(&b) if b == open => {}
                    Some(_) => {
                        self.place = Place::Stopped;
                        return false;
                    }
                }
                if open == b'[' {
                    self.pos += 1;
                    match self.parser {
                        ToolCallParser::Pythonic => {
                            Place::PythonCalls(python::ListReader::new(self.pos))
                        }
                        _ => Place::Object,
                    }
                } else {
                    let arguments_keys: &'static [&'static str] = match self.parser {
                        ToolCallParser::Llama3Json => &["arguments", "parameters"],
                        _ => &["arguments"],
                    };
                    self.calls_read += 1;
                    Place::Call(CallReader::new(self.pos, arguments_keys))
                }
            }
            Place::Call(reader) => {
                reader.broken = reader.read(text).is_err();
                // The caller sends what was read, and moves on from a whole call or a
                // broken one.
                return false;
            }
            Place::After => match (self.parser, rest.as_bytes().first()) {
                (_, None) => return false,
                (ToolCallParser::Hermes, _) => Place::Marker,
                (ToolCallParser::Llama3Json, Some(b';'))
                | (ToolCallParser::Mistral, Some(b',')) => {
                    self.pos += 1;
                    Place::Object
                }
                _ => Place::Stopped,
            },
        };
        self.place = next;
        true
    }
}

/// The entry that sends call `index` as far as its `arguments` go: the call, where it is
/// new; else what its arguments gained since, if anything.
fn progress(
    sent: &mut Vec<SentCall>,
    index: usize,
    name: &str,
    arguments: &str,
    next_id: fn() -> String,
) -> Option<Value> {
    let Some(sent) = sent.get_mut(index) else {
        return Some(announce(sent, name, arguments, next_id));
    };
    // The arguments' text only grows: what is new is its tail. (Checked cheaply: a full
    // compare per token is quadratic.)
    debug_assert!(arguments.is_char_boundary(sent.arguments.len()));
    let rest = arguments.get(sent.arguments.len()..).unwrap_or_default();
    (!rest.is_empty()).then(|| {
        sent.arguments.push_str(rest);
        arguments_entry(index, rest)
    })
}

/// The entry of a new call (the next of `sent`), with its id from `next_id`.
fn announce(
    sent: &mut Vec<SentCall>,
    name: &str,
    arguments: &str,
    next_id: fn() -> String,
) -> Value {
    let index = sent.len();
    sent.push(SentCall {
        name: name.to_string(),
        arguments: arguments.to_string(),
    });
    json!({"index": index, "id": next_id(), "type": "function",
           "function": {"name": name, "arguments": arguments}})
}

/// The entry of more of call `index`'s arguments.
fn arguments_entry(index: usize, arguments: &str) -> Value {
    json!({"index": index, "function": {"arguments": arguments}})
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn id() -> String {
        "call".to_string()
    }

    /// What a client reads from the entries: each call's name and its arguments joined.
    #[derive(Debug, Default, PartialEq)]
    struct Read {
        calls: Vec<(String, String)>,
        /// Entries read.
        entries: usize,
    }

    impl Read {
        fn take(&mut self, entries: Vec<Value>) {
            for e in entries {
                let index = e["index"].as_u64().unwrap() as usize;
                if let Some(name) = e["function"]["name"].as_str() {
                    assert_eq!(index, self.calls.len(), "calls are numbered in order: {e}");
                    assert_eq!(e["id"], "call");
                    self.calls.push((name.to_string(), String::new()));
                }
                let piece = e["function"]["arguments"].as_str().unwrap();
                self.entries += 1;
                self.calls[index].1.push_str(piece);
            }
        }
    }

    /// `text` streamed in the pieces between `bounds`: what the calls read before the
    /// end, and after it (with the whole output's parse).
    /// The tools the tests' calls are of (which `qwen3_coder` types values by): `f0`…`f3`
    /// take `k`, an object (any JSON), and `n`, an integer.
    fn tools() -> Arc<ToolParameters> {
        let tools: Vec<Value> = (0..4)
            .map(|i| {
                json!({"type": "function", "function": {"name": format!("f{i}"), "parameters": {
                "properties": {"k": {"type": "object"}, "n": {"type": "integer"}}}}})
            })
            .collect();
        Arc::new(ToolParameters::of(Some(&Value::Array(tools))))
    }

    fn stream(p: ToolCallParser, text: &str, bounds: &[usize], parallel: bool) -> (Read, Read) {
        let mut s = CallStream::new(p, parallel, tools());
        let mut read = Read::default();
        for w in bounds.windows(2) {
            read.take(s.advance(&text[..w[1]], id));
        }
        let before = Read {
            calls: read.calls.clone(),
            entries: read.entries,
        };
        if let Some(parsed) = p.parse(text, parallel, &tools()) {
            read.take(s.finish(&parsed, id));
        }
        (before, read)
    }

    /// Where `text` is cut: at `cuts` (those at a character's start), and its ends.
    fn bounds(text: &str, cuts: &[proptest::sample::Index]) -> Vec<usize> {
        let mut bounds: Vec<usize> = (cuts.iter())
            .map(|c| c.index(text.len() + 1))
            .filter(|&c| text.is_char_boundary(c))
            .chain([0, text.len()])
            .collect();
        bounds.sort_unstable();
        bounds
    }

    /// Every byte (at a character's start) a piece of its own.
    fn each_char(text: &str) -> Vec<usize> {
        (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect()
    }

    fn parsed(p: ToolCallParser, text: &str, parallel: bool) -> Vec<(String, String)> {
        p.parse(text, parallel, &tools()).expect("calls").calls
    }

    #[test]
    fn calls_go_out_as_they_are_written_and_add_up_to_the_parse() {
        let hermes = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par\\u00eds \\\"é\\\"\", \"days\": [1,2, -0, 1E+2, 1.50, 0.1e-3, 12345678901234567890], \"x\":{\"a\":[true,false,null,{}],\"b\":[]}}}\n</tool_call>\n<tool_call>{\"arguments\":{}, \"name\":\"now\"}</tool_call>";
        let llama = "<|python_tag|> {\"name\": \"f\", \"parameters\": {\"q\": \"a;b\"}} ;\n{\"name\": \"g\", \"arguments\": {\"n\": 3}}";
        let mistral = "Sure. [TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", \"arguments\": {\"s\": \"]}\"}}]";
        for (p, text) in [
            (ToolCallParser::Hermes, hermes),
            (ToolCallParser::Llama3Json, llama),
            (ToolCallParser::Mistral, mistral),
        ] {
            let whole = parsed(p, text, true);
            assert_eq!(whole.len(), 2, "{text}");
            let (before, after) = stream(p, text, &each_char(text), true);
            // All was sent before the end, piece by piece, and nothing is left for it.
            assert_eq!(before.calls, whole, "{text}");
            assert_eq!(after.calls, whole, "{text}");
            assert!(before.entries > 4, "{text}: {} entries", before.entries);
            // In one piece, each call in one entry.
            let (before, _) = stream(p, text, &[0, text.len()], true);
            assert_eq!((before.calls, before.entries), (whole.clone(), 2), "{text}");
        }
        // Written as the parse writes them (serde_json's numbers: `-0` is a float here,
        // Python's `json` writes `0`).
        let (read, _) = stream(ToolCallParser::Hermes, hermes, &each_char(hermes), true);
        assert_eq!(
            read.calls[0].1,
            r#"{"city": "París \"é\"", "days": [1, 2, -0.0, 100.0, 1.5, 0.0001, 12345678901234567890], "x": {"a": [true, false, null, {}], "b": []}}"#
        );
    }

    #[test]
    fn a_call_goes_out_with_its_name_and_its_arguments_as_they_are_written() {
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"city\": \"Oslo\", \"n\": 12}}";
        let mut s = CallStream::new(ToolCallParser::Hermes, true, Default::default());
        let mut at = |upto: &str| s.advance(&text[..text.find(upto).unwrap() + upto.len()], id);
        assert_eq!(at("\"nam"), Vec::<Value>::new());
        // A name alone is not yet a call: its arguments must begin.
        assert_eq!(at("\"f\""), Vec::<Value>::new());
        assert_eq!(at("\"arguments\": "), Vec::<Value>::new());
        assert_eq!(
            at("{\"ci"),
            vec![
                json!({"index": 0, "id": "call", "type": "function", "function": {"name": "f", "arguments": "{"}})
            ]
        );
        // A string's text as it comes.
        assert_eq!(
            at("\"Os"),
            vec![json!({"index": 0, "function": {"arguments": "\"city\": \"Os"}})]
        );
        assert_eq!(
            at("\"Oslo\""),
            vec![json!({"index": 0, "function": {"arguments": "lo\""}})]
        );
        // A number is whole once something follows it.
        assert_eq!(
            at("12"),
            vec![json!({"index": 0, "function": {"arguments": ", \"n\": "}})]
        );
        assert_eq!(
            at("12}"),
            vec![json!({"index": 0, "function": {"arguments": "12}"}})]
        );
    }

    #[test]
    fn a_strings_escapes_go_out_once_whole() {
        let text = r#"<tool_call>{"name": "f", "arguments": {"s": "a\u00e9\ud83d\ude00\n\"\\\/é😀b\uD83D\uDE00"}}"#;
        let p = ToolCallParser::Hermes;
        let whole = parsed(p, text, true);
        assert_eq!(whole[0].1, r#"{"s": "aé😀\n\"\\/é😀b😀"}"#);
        let (before, _) = stream(p, text, &each_char(text), true);
        assert_eq!(before.calls, whole);
        assert!(before.entries > 8, "{}", before.entries);
        // Half an escape waits for the rest.
        let mut s = CallStream::new(p, true, Default::default());
        let upto = text.find("\\ude00").unwrap();
        let mut sent = String::new();
        for e in s.advance(&text[..upto + 3], id) {
            sent.push_str(e["function"]["arguments"].as_str().unwrap());
        }
        assert_eq!(sent, r#"{"s": "aé"#);
    }

    #[test]
    fn a_broken_or_cut_call_keeps_what_was_sent_and_nothing_more() {
        let p = ToolCallParser::Hermes;
        // Cut in the arguments: the call is sent as far as it went (a string's text too,
        // a number not yet); the output's parse finds no call (its non-streamed answer is
        // content).
        let cut = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"lo";
        assert_eq!(p.parse(cut, true, &tools()), None);
        let (before, _) = stream(p, cut, &each_char(cut), true);
        assert_eq!(
            before.calls,
            vec![("f".to_string(), "{\"a\": \"lo".to_string())]
        );
        // Broken JSON stops the stream where it breaks, however the text was cut: what
        // was read before the break goes out, and no later call.
        let broken = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\" 1}}</tool_call><tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";
        for bounds in [each_char(broken), vec![0, broken.len()]] {
            let (before, _) = stream(p, broken, &bounds, true);
            assert_eq!(before.calls, vec![("f".to_string(), "{\"a\"".to_string())]);
        }
        // A string that breaks (an unknown escape, a raw line break) goes out up to the
        // break, however the text was cut.
        for (text, sent) in [
            (
                r#"<tool_call>{"name": "f", "arguments": {"a": "xy\q"}}"#,
                r#"{"a": "xy"#,
            ),
            (
                r#"<tool_call>{"name": "f", "arguments": {"a": "x\é\u00é"}}"#,
                r#"{"a": "x"#,
            ),
            (
                "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"x\\u00e9\ny\"}}",
                r#"{"a": "xé"#,
            ),
        ] {
            for bounds in [each_char(text), vec![0, text.len()]] {
                let (before, _) = stream(p, text, &bounds, true);
                assert_eq!(
                    before.calls,
                    vec![("f".to_string(), sent.to_string())],
                    "{text}"
                );
            }
        }
        // Arguments that are no JSON value (Python's `None`) never began: no call.
        let python = "<tool_call>{\"name\": \"f\", \"arguments\": None}</tool_call>";
        let (before, _) = stream(p, python, &each_char(python), true);
        assert_eq!(before.calls, vec![]);
        // Without a name nothing goes out, and nothing after it.
        let nameless = "<tool_call>{\"arguments\": {}}</tool_call><tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";
        let (before, _) = stream(p, nameless, &each_char(nameless), true);
        assert_eq!(before.calls, vec![]);
        // Text no call begins with, or an object with a name and no arguments: Llama 3's
        // output is content.
        let l = ToolCallParser::Llama3Json;
        for text in [
            " It is {\"name\": \"f\"}",
            "{\"name\": \"Alice\", \"age\": 30}",
        ] {
            let (before, _) = stream(l, text, &each_char(text), true);
            assert_eq!(before.calls, vec![], "{text}");
            assert_eq!(l.parse(text, true, &tools()), None);
        }
    }

    #[test]
    fn parallel_tool_calls_false_streams_the_first_call() {
        let text = "{\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"parameters\": {}}";
        let l = ToolCallParser::Llama3Json;
        let (before, after) = stream(l, text, &each_char(text), false);
        assert_eq!(before.calls, parsed(l, text, false));
        assert_eq!(after.calls.len(), 1);
    }

    #[test]
    fn python_calls_go_out_as_json_as_they_are_written() {
        let p = ToolCallParser::Pythonic;
        let text = " <|python_start|>[get_weather(city='Oslo, \\'N\\'', days=[1, 2,],), now( ), f(x={'a': None, 1.5: [True, False], \"b\\x41\\q\": -2e3},\n  y=+1_000)]<|python_end|>";
        let whole = parsed(p, text, true);
        assert_eq!(
            whole,
            [
                ("get_weather", r#"{"city": "Oslo, 'N'", "days": [1, 2]}"#),
                ("now", "{}"),
                (
                    "f",
                    r#"{"x": {"a": null, "1.5": [true, false], "bA\\q": -2000.0}, "y": 1000}"#
                ),
            ]
            .map(|(n, a)| (n.to_string(), a.to_string()))
        );
        let (before, after) = stream(p, text, &each_char(text), true);
        assert_eq!(before.calls, whole);
        assert_eq!(after.calls, whole);
        assert!(before.entries > 20, "{} entries", before.entries);
        // In one piece, each call in one entry.
        let (before, _) = stream(p, text, &[0, text.len()], true);
        assert_eq!((before.calls, before.entries), (whole, 3));
        // A call goes out at its `(`, then its arguments as they come: a string's text as
        // it is written, a number once something follows it.
        let mut s = CallStream::new(p, true, Default::default());
        let mut at = |upto: &str| {
            let sent = s.advance(&text[..text.find(upto).unwrap() + upto.len()], id);
            (sent.iter())
                .map(|e| e["function"]["arguments"].as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(at("get_weather"), Vec::<String>::new());
        assert_eq!(at("get_weather("), ["{"]);
        assert_eq!(at("city='Os"), ["\"city\": \"Os"]);
        assert_eq!(at("Oslo, \\"), ["lo, "]);
        assert_eq!(at("Oslo, \\'"), ["'"]);
        assert_eq!(at("days=[1"), ["N'\", \"days\": ["]);
        assert_eq!(at("days=[1,"), ["1"]);
        // A last `,` is written only if an item follows it.
        assert_eq!(at("2,],"), [", 2]"]);
        assert_eq!(at("2,],)"), ["}"]);
        let (before, _) = stream(p, text, &each_char(text), false);
        assert_eq!(before.calls, parsed(p, text, false));
        // Text no list of calls reads as: what was read before it, and nothing after.
        for (text, sent) in [
            (
                "[f(s='(', t=\"'\"), g(a=[1 2])]",
                vec![("f", r#"{"s": "(", "t": "'"}"#), ("g", r#"{"a": [1"#)],
            ),
            ("[f(a='x\ny')]", vec![("f", r#"{"a": "x"#)]),
            ("[f(a='x\\xZ1')]", vec![("f", r#"{"a": "x"#)]),
            ("[f('Oslo')]", vec![("f", "{")]),
            ("[f(a=other)]", vec![("f", r#"{"a": "#)]),
            ("[f(a={[1]: 2})]", vec![("f", r#"{"a": {"#)]),
            ("[f(a=1)(2)]", vec![("f", r#"{"a": 1}"#)]),
            // Python's spaces are ASCII's.
            ("\u{a0}[f(a=1)]", vec![]),
            ("<|python_start|>\u{2003}[f(a=1)]", vec![]),
        ] {
            assert_eq!(p.parse(text, true, &tools()), None, "{text}");
            let sent: Vec<(String, String)> = (sent.into_iter())
                .map(|(n, a)| (n.to_string(), a.to_string()))
                .collect();
            for bounds in [each_char(text), vec![0, text.len()]] {
                let (before, _) = stream(p, text, &bounds, true);
                assert_eq!(before.calls, sent, "{text}");
            }
        }
        // As deep as the whole parse reads, and no deeper.
        for depth in [63, 64] {
            let text = format!("[f(x={}1{})]", "[".repeat(depth), "]".repeat(depth));
            let (before, _) = stream(p, &text, &each_char(&text), true);
            match p.parse(&text, true, &tools()) {
                Some(whole) => assert_eq!((depth, before.calls), (63, whole.calls)),
                None => assert_eq!(
                    (depth, before.calls),
                    (
                        64,
                        vec![("f".into(), format!("{{\"x\": {}", "[".repeat(64)))]
                    )
                ),
            }
        }
        // Not a list of calls: nothing goes out.
        let (before, _) = stream(p, "It is [f(a=1)]", &[0, 3, 14], true);
        assert_eq!(before.calls, vec![]);
    }

    /// JSON values of every kind, keys and strings with escapes and non-ASCII text.
    fn json_value() -> impl Strategy<Value = Value> {
        let text = "[a-z \"'\\\\/éж😀\n\t]{0,6}";
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<u64>().prop_map(|n| json!(n)),
            (-1e12f64..1e12).prop_map(|f| json!(f)),
            text.prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::vec((text, inner), 0..4)
                    .prop_map(|entries| Value::Object(entries.into_iter().collect())),
            ]
        })
    }

    /// `v` as a Python literal: `spaced` with line breaks and a last `,` in each
    /// container; `escaped` in single quotes, other than ASCII as `\x`, `\u` or `\U`.
    fn python_literal(v: &Value, spaced: bool, escaped: bool) -> String {
        let items = |items: Vec<String>, open: &str, close: &str| match spaced {
            true => format!("{open}\n  {},\n{close}", items.join(" ,\n  ")),
            false => format!("{open}{}{close}", items.join(", ")),
        };
        match v {
            Value::Null => "None".into(),
            Value::Bool(b) => if *b { "True" } else { "False" }.into(),
            Value::Number(n) => n.to_string(),
            Value::String(s) => {
                let quote = if escaped { '\'' } else { '"' };
                let mut out = String::from(quote);
                for c in s.chars() {
                    match c {
                        '\\' => out.push_str("\\\\"),
                        '\n' => out.push_str("\\n"),
                        '\t' => out.push_str("\\t"),
                        c if c == quote => out.extend(['\\', c]),
                        c if escaped && (c as u32) < 0x100 && !c.is_ascii() => {
                            out.push_str(&format!("\\x{:02x}", c as u32))
                        }
                        c if escaped && (c as u32) > 0xffff => {
                            out.push_str(&format!("\\U{:08X}", c as u32))
                        }
                        c if escaped && !c.is_ascii() => {
                            out.push_str(&format!("\\u{:04x}", c as u32))
                        }
                        c => out.push(c),
                    }
                }
                out.push(quote);
                out
            }
            Value::Array(values) if !values.is_empty() => items(
                values
                    .iter()
                    .map(|v| python_literal(v, spaced, escaped))
                    .collect(),
                "[",
                "]",
            ),
            Value::Object(entries) if !entries.is_empty() => items(
                entries
                    .iter()
                    .map(|(k, v)| {
                        let key = python_literal(&json!(k), spaced, escaped);
                        format!("{key}: {}", python_literal(v, spaced, escaped))
                    })
                    .collect(),
                "{",
                "}",
            ),
            Value::Array(_) => "[]".into(),
            Value::Object(_) => "{}".into(),
        }
    }

    proptest! {
        /// However a well-formed output comes in pieces, however its JSON is spaced and
        /// its call objects' keys ordered, with or without text around the calls, the calls
        /// streamed before its end are the whole output's parse.
        #[test]
        fn streamed_calls_are_the_parse_however_cut(
            arguments in proptest::collection::vec(json_value(), 1..4),
            pretty in any::<bool>(),
            ascii in any::<bool>(),
            key_order in 0usize..3,
            parser in 0usize..5,
            text_around in any::<bool>(),
            parallel in any::<bool>(),
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..12),
        ) {
            let write = |v: &Value| {
                let json = match pretty {
                    true => serde_json::to_string_pretty(v).unwrap(),
                    false => serde_json::to_string(v).unwrap(),
                };
                // As Python's `json.dumps` writes by default: other than ASCII as `\u`
                // escapes, a surrogate pair beyond the first plane.
                match ascii {
                    true => json.chars().map(|c| match c.is_ascii() {
                        true => c.to_string(),
                        false => c.encode_utf16(&mut [0; 2]).iter().map(|u| format!("\\u{u:04x}")).collect(),
                    }).collect(),
                    false => json,
                }
            };
            let key = if parser == 1 { "parameters" } else { "arguments" };
            let calls: Vec<String> = arguments.iter().enumerate()
                .map(|(i, a)| {
                    let (name, args) = (format!("\"name\": \"f{i}\""), format!("\"{key}\": {}", write(a)));
                    match key_order {
                        0 => format!("{{{name}, {args}}}"),
                        1 => format!("{{{args},\n {name}}}"),
                        _ => format!("{{\"id\": [{i}], {name}, \"x\": {{}}, {args}}}"),
                    }
                })
                .collect();
            // Python's calls take keywords: each value is a keyword's.
            let python_calls: Vec<String> = arguments.iter().enumerate()
                .map(|(i, a)| format!("f{i}(k={}, n=1)", python_literal(a, pretty, ascii)))
                .collect();
            let around = |t: &'static str| if text_around { t } else { "" };
            let (p, text) = match parser {
                0 => (ToolCallParser::Hermes, around("Let me see. ").to_string() + &calls.iter()
                    .map(|c| format!("<tool_call>\n{c}\n</tool_call>{}", around("\nthen\n")))
                    .collect::<String>()),
                1 => (ToolCallParser::Llama3Json, format!("{}{}", around(" <|python_tag|>"), calls.join("; "))),
                2 => (ToolCallParser::Mistral, format!("{}[TOOL_CALLS] [{}]", around("Sure. "), calls.join(", "))),
                3 => (ToolCallParser::Pythonic, format!("{}[{}]{}", around("<|python_start|>"), python_calls.join(", "), around("<|python_end|>"))),
                // Each value the JSON text of an object-typed parameter.
                _ => (ToolCallParser::Qwen3Coder, around("Let me see.\n").to_string() + &arguments.iter().enumerate()
                    .map(|(i, a)| format!(
                        "<tool_call>\n<function=f{i}>\n<parameter=k>\n{}\n</parameter>\n<parameter=n>\n1\n</parameter>\n</function>\n</tool_call>{}",
                        write(a), around("\n")))
                    .collect::<String>()),
            };
            let bounds = bounds(&text, &cuts);
            let (before, after) = stream(p, &text, &bounds, parallel);
            let whole = p.parse(&text, parallel, &tools()).expect("well-formed calls").calls;
            prop_assert_eq!(&before.calls, &whole);
            prop_assert_eq!(&after.calls, &whole);
            let kept = if parallel { arguments.len() } else { 1 };
            let expected: Vec<String> = arguments.iter().take(kept)
                .map(|a| match p {
                    ToolCallParser::Pythonic | ToolCallParser::Qwen3Coder => python_json(&json!({"k": a, "n": 1})),
                    _ => python_json(a),
                })
                .collect();
            prop_assert_eq!(whole.into_iter().map(|c| c.1).collect::<Vec<_>>(), expected);
        }
    }

    proptest! {
        /// Python's many ways to write a literal (number spellings, escapes, a dict's
        /// number keys, last commas, spaces between any tokens), however they come in
        /// pieces, stream as the whole output's parse reads them.
        #[test]
        fn python_spellings_stream_as_the_parse_reads_them(
            values in proptest::collection::vec(proptest::sample::select(vec![
                "1_000", "+1", "-0", ".5", "5.", "1E5", "-2e-3", "2e+3", "00", "1_0.5e1_0",
                "'\\101\\0\\08\\a\\b\\f\\v\\\nx\\q\\8'",
                "12345678901234567890", "'\\x41\\xe9'", "\"\\u00e9\\U0001F600\"", "'a\\qb\\\\'",
                "'it\\'s \"x\"'", "\"\\0\\t\\r\"", "''", "True", "False", "None", "[]", "{}",
                "[1,]", "{1: 2, 'b': [3,],}", "{1.5: 'x', -2: None}", "[{'a': [True]}, 'é😀']",
            ]), 1..5),
            spaces in proptest::collection::vec(proptest::sample::select(vec![
                "", " ", "\n", "\t", "\x0c", "\r\n  ",
            ]), 8),
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..12),
        ) {
            let sp = |i: usize| spaces[i % spaces.len()];
            let arguments: Vec<String> = values.iter().enumerate()
                .map(|(i, v)| format!("{}k{i}{}={}{v}{}", sp(i), sp(i + 1), sp(i + 2), sp(i + 3)))
                .collect();
            let text = format!(
                "{}[{}f{}({}){}, g(){}]", sp(4), sp(5), sp(6), arguments.join(","), sp(7), sp(0)
            );
            let p = ToolCallParser::Pythonic;
            let whole = p.parse(&text, true, &tools()).expect("well-formed calls").calls;
            for bounds in [bounds(&text, &cuts), each_char(&text)] {
                let (before, after) = stream(p, &text, &bounds, true);
                prop_assert_eq!(&before.calls, &whole);
                prop_assert_eq!(&after.calls, &whole);
            }
        }
    }

    proptest! {
        /// Whatever a model writes, however it comes in pieces: no panic, and what goes out
        /// before the end is what goes out when it comes whole.
        #[test]
        fn any_output_streams_the_same_however_cut(
            fragments in proptest::collection::vec(proptest::sample::select(vec![
                "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|python_start|>",
                "{\"name\": \"f\", \"arguments\": ", "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"",
                "{\"name\": \"f\", \"parameters\": {\"a\": \"", "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": \"",
                "[f(a='", "{", "}", "[", "]", "\"", "'", "\\", "\\u",
                "\\ud83d", "\\ude00", "00e9", "é", "😀", "u", ",", ":", ";", " ", "\n", "1", "-",
                "e", "true", "nul", "f(a=", ")", "a", "\\é", "\\x", "\\U", "True", "None", "=",
                "_", "<function=f0>", "<parameter=k>", "<parameter=n>", "</parameter>", "</function>",
                ">", "null",
            ]), 0..40),
            parser in 0usize..5,
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..12),
        ) {
            let text: String = fragments.concat();
            let p = [ToolCallParser::Hermes, ToolCallParser::Llama3Json, ToolCallParser::Mistral,
                     ToolCallParser::Pythonic, ToolCallParser::Qwen3Coder][parser];
            let bounds = bounds(&text, &cuts);
            let (cut, _) = stream(p, &text, &bounds, true);
            let (whole, _) = stream(p, &text, &[0, text.len()], true);
            prop_assert_eq!(cut.calls, whole.calls);
        }
    }
}
