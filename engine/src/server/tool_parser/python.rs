//! Python's call syntax, for the `pythonic` tool-call format: `[f(a=1, b="x"), g()]`, the
//! arguments keywords whose values are literals (strings, numbers, `True`/`False`/`None`,
//! lists and dicts of them), as vLLM reads such an output with Python's `ast`. Read whole
//! ([`calls`]), or as it is written ([`ListReader`], for a stream).

use serde_json::{Map, Number, Value};

use super::{python_json, ReadCall};

/// A call's name and keyword arguments.
pub type Call = (String, Map<String, Value>);

/// The calls of `text` when it is a Python list of calls and nothing else (whitespace
/// aside): each call's name and keyword arguments. `None` for anything else: an empty list,
/// a positional argument, an expression that is not a literal.
pub fn calls(text: &str) -> Option<Vec<Call>> {
    let mut p = Parser {
        s: text.as_bytes(),
        i: 0,
        depth: 0,
    };
    p.ws();
    p.eat(b'[')?;
    let calls = p.items(b']', Parser::call)?;
    p.ws();
    (p.i == p.s.len() && !calls.is_empty()).then_some(calls)
}

/// A Python literal alone (spaces or tabs before it, any whitespace after), of the kinds
/// [`calls`] reads, as Python's `ast.literal_eval` reads it.
pub fn literal(text: &str) -> Option<Value> {
    let text = text.trim_start_matches([' ', '\t']);
    let mut p = Parser {
        s: text.as_bytes(),
        i: 0,
        depth: 0,
    };
    let value = p.value()?;
    p.ws();
    (p.i == p.s.len()).then_some(value)
}

/// Values nest at most this deep (an output is the model's, so bounded, but a recursive
/// parser must not be the thing that overflows).
const MAX_DEPTH: usize = 64;

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    depth: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek() == Some(c)).then(|| self.i += 1)
    }

    /// Items up to `close`, comma-separated, a trailing comma allowed.
    fn items<T>(
        &mut self,
        close: u8,
        mut item: impl FnMut(&mut Self) -> Option<T>,
    ) -> Option<Vec<T>> {
        let mut out = Vec::new();
        loop {
            self.ws();
            if self.eat(close).is_some() {
                return Some(out);
            }
            out.push(item(self)?);
            self.ws();
            if self.eat(b',').is_none() {
                self.ws();
                self.eat(close)?;
                return Some(out);
            }
        }
    }

    fn identifier(&mut self) -> Option<String> {
        let start = self.i;
        if !self
            .peek()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        {
            return None;
        }
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_')
        {
            self.i += 1;
        }
        Some(String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
    }

    /// `name(key=value, …)`.
    fn call(&mut self) -> Option<Call> {
        let name = self.identifier()?;
        self.ws();
        self.eat(b'(')?;
        let arguments = self.items(b')', |p| {
            let key = p.identifier()?;
            p.ws();
            p.eat(b'=')?;
            p.ws();
            Some((key, p.value()?))
        })?;
        let count = arguments.len();
        let arguments: Map<String, Value> = arguments.into_iter().collect();
        // A keyword given twice is Python's syntax error.
        (arguments.len() == count).then_some((name, arguments))
    }

    fn value(&mut self) -> Option<Value> {
        if self.depth >= MAX_DEPTH {
            return None;
        }
        self.depth += 1;
        let v = match self.peek()? {
            b'"' | b'\'' => self.string().map(Value::String),
            b'[' => {
                self.i += 1;
                self.items(b']', Parser::value).map(Value::Array)
            }
            b'{' => {
                self.i += 1;
                let entries = self.items(b'}', |p| {
                    // Keys are constants; json.dumps writes a number's as its text.
                    let key = match p.value()? {
                        Value::String(s) => s,
                        Value::Number(n) => n.to_string(),
                        _ => return None,
                    };
                    p.ws();
                    p.eat(b':')?;
                    p.ws();
                    Some((key, p.value()?))
                })?;
                Some(Value::Object(entries.into_iter().collect()))
            }
            b'-' | b'+' | b'.' | b'0'..=b'9' => self.number(),
            _ => match self.identifier()?.as_str() {
                "True" => Some(Value::Bool(true)),
                "False" => Some(Value::Bool(false)),
                "None" => Some(Value::Null),
                _ => None,
            },
        };
        self.depth -= 1;
        v
    }

    /// A quoted string, single or double, with Python's common escapes (not triple-quoted,
    /// not prefixed).
    fn string(&mut self) -> Option<String> {
        let quote = self.peek()?;
        self.i += 1;
        let mut out = Vec::new();
        loop {
            let c = self.peek()?;
            self.i += 1;
            match c {
                c if c == quote => break,
                b'\n' => return None,
                b'\\' => match escape(&self.s[self.i - 1..]) {
                    Escape::Text(ch, len) => {
                        self.i += len - 1;
                        let mut buf = [0; 4];
                        if let Some(ch) = ch {
                            out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                        }
                    }
                    Escape::Unknown => out.push(b'\\'),
                    Escape::Cut | Escape::Bad => return None,
                },
                c => out.push(c),
            }
        }
        String::from_utf8(out).ok()
    }

    fn number(&mut self) -> Option<Value> {
        let start = self.i;
        self.i = number_end(self.s, start, start);
        number(std::str::from_utf8(&self.s[start..self.i]).ok()?)
    }
}

/// A string's escape, as Python reads it.
#[derive(Debug, PartialEq)]
enum Escape {
    /// The character it stands for (none, for a line continuation), and the escape's
    /// length in bytes.
    Text(Option<char>, usize),
    /// No escape Python knows: the backslash stands for itself.
    Unknown,
    /// The text ends where the escape may go on.
    Cut,
    /// `\x`, `\u` or `\U` without its hex digits or with no character's, or `\N{…}` (a
    /// character's name, which is not looked up here).
    Bad,
}

/// The escape at the start of `s` (which starts with `\`).
fn escape(s: &[u8]) -> Escape {
    let Some(&e) = s.get(1) else {
        return Escape::Cut;
    };
    let simple = match e {
        b'n' => '\n',
        b't' => '\t',
        b'r' => '\r',
        b'a' => '\x07',
        b'b' => '\x08',
        b'f' => '\x0c',
        b'v' => '\x0b',
        b'\\' | b'\'' | b'"' => e as char,
        b'\n' => return Escape::Text(None, 2),
        b'N' => return Escape::Bad,
        b'0'..=b'7' => {
            // One to three octal digits.
            let octal = |c: &&u8| (b'0'..=b'7').contains(*c);
            let digits = s[1..].iter().take(3).take_while(octal).count();
            if digits < 3 && s.len() == 1 + digits {
                return Escape::Cut;
            }
            let code = (s[1..1 + digits].iter()).fold(0, |n, d| n * 8 + u32::from(d - b'0'));
            return Escape::Text(char::from_u32(code), 1 + digits);
        }
        _ => {
            let digits = match e {
                b'x' => 2,
                b'u' => 4,
                b'U' => 8,
                _ => return Escape::Unknown,
            };
            let Some(hex) = s.get(2..2 + digits) else {
                // (Cut only where the digits so far may yet be some.)
                return match s[2..].iter().all(u8::is_ascii_hexdigit) {
                    true => Escape::Cut,
                    false => Escape::Bad,
                };
            };
            // (`from_str_radix` would take a sign, Python does not.)
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return Escape::Bad;
            }
            let code = std::str::from_utf8(hex).expect("ASCII digits");
            return match char::from_u32(u32::from_str_radix(code, 16).expect("hex")) {
                Some(ch) => Escape::Text(Some(ch), 2 + digits),
                None => Escape::Bad,
            };
        }
    };
    Escape::Text(Some(simple), 2)
}

/// Where a number that starts at byte `start` of `s` ends, read on from byte `from` (the
/// number's start, or where an earlier read of a shorter `s` stopped): `s.len()` where it
/// may go on.
fn number_end(s: &[u8], start: usize, mut from: usize) -> usize {
    if from == start && matches!(s.get(from), Some(b'-' | b'+')) {
        from += 1;
    }
    while let Some(&c) = s.get(from) {
        let exponent_sign = matches!(c, b'-' | b'+') && matches!(s[from - 1], b'e' | b'E');
        if !(c.is_ascii_digit() || matches!(c, b'.' | b'e' | b'E' | b'_') || exponent_sign) {
            break;
        }
        from += 1;
    }
    from
}

/// A number's `text`, as [`number_end`] delimits it, as a JSON number; `None` where
/// Python would not read it as a number (`1_`, `007`).
fn number(text: &str) -> Option<Value> {
    let b = text.as_bytes();
    let digit = |i: Option<usize>| i.and_then(|i| b.get(i)).is_some_and(u8::is_ascii_digit);
    // Python's `_` goes between digits.
    let misplaced =
        |(i, &c): (usize, &u8)| c == b'_' && !(digit(i.checked_sub(1)) && digit(Some(i + 1)));
    if b.iter().enumerate().any(misplaced) {
        return None;
    }
    let text = text.replace('_', "");
    let text = text.strip_prefix('+').unwrap_or(&text);
    let integer = !text.contains(['.', 'e', 'E']);
    // An integer's leading zero is Python's syntax error, zero itself written long is not.
    let digits = text.strip_prefix('-').unwrap_or(text);
    if integer && digits.starts_with('0') && digits.bytes().any(|c| c != b'0') {
        return None;
    }
    let number = if integer {
        text.parse::<i64>()
            .map(Number::from)
            .ok()
            .or_else(|| text.parse::<u64>().ok().map(Number::from))?
    } else {
        Number::from_f64(text.parse::<f64>().ok()?)?
    };
    Some(Value::Number(number))
}

/// Python's list of calls read as it is written, for a stream: each call from its `(`,
/// its arguments written as JSON as they come. Each lexeme is written as [`python_json`]
/// writes the whole parse's value (a string's text as it comes, less an escape not yet
/// whole; a number, keyword or literal once something follows it), so a well-formed list's
/// arguments, read in any pieces, are the whole parse's; and the same text, however it
/// came in pieces, writes the same. Where the text stops being a list of calls, the reader
/// stops (the whole output's parse decides).
#[derive(Debug)]
pub struct ListReader {
    /// Bytes of the text read.
    pos: usize,
    /// The calls begun.
    pub calls: Vec<ReadCall>,
    /// What is open inside the list: a call, then lists and dicts in its arguments.
    open: Vec<Bracket>,
    want: Want,
    token: Option<Token>,
    /// A `,` read and not yet written: it goes before the next item, and not before a
    /// close (Python allows a last one).
    comma: bool,
    /// The list has ended, or its text broke off where no list of calls goes on.
    pub ended: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Bracket {
    Call,
    List,
    Dict,
}

/// What the reader expects next.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Want {
    /// A call's name, or the list's `]`.
    CallOrEnd,
    /// The `(` after a call's name.
    Open,
    /// An argument's keyword, or the call's `)`.
    KeywordOrClose,
    /// The `=` after a keyword.
    Equals,
    /// A keyword's or a dict key's value.
    Value,
    /// A list's item, or its `]`.
    ValueOrClose,
    /// A dict's key, or its `}`.
    KeyOrClose,
    /// The `:` after a dict's key.
    Colon,
    /// After an item: a `,`, or the end of what holds it.
    CommaOrClose,
}

/// A lexeme being read, from byte `start`; `role`: what the reader wanted where it began.
#[derive(Debug)]
enum Token {
    /// A call's name, a keyword, or `True`/`False`/`None`; `scan`: bytes read so far.
    Identifier {
        start: usize,
        scan: usize,
        role: Want,
    },
    Number {
        start: usize,
        scan: usize,
        role: Want,
    },
    /// A string's text read so far (a dict key's is written whole, a value's as it comes).
    String { quote: u8, role: Want, text: String },
}

/// The text is no list of calls from here on.
struct Malformed;

impl ListReader {
    /// Reads from byte `pos`, just after the list's `[`.
    pub fn new(pos: usize) -> Self {
        ListReader {
            pos,
            calls: Vec::new(),
            open: Vec::new(),
            want: Want::CallOrEnd,
            token: None,
            comma: false,
            ended: false,
        }
    }

    /// Reads on through `text`, the output so far.
    pub fn read(&mut self, text: &str) {
        if !self.ended && self.read_on(text).is_err() {
            self.ended = true;
        }
    }

    fn read_on(&mut self, text: &str) -> Result<(), Malformed> {
        let s = text.as_bytes();
        while !self.ended {
            if self.token.is_some() {
                if !self.read_token(text)? {
                    return Ok(());
                }
                continue;
            }
            while s.get(self.pos).is_some_and(u8::is_ascii_whitespace) {
                self.pos += 1;
            }
            let Some(&b) = s.get(self.pos) else {
                return Ok(());
            };
            let start = self.pos;
            let identifier = b.is_ascii_alphabetic() || b == b'_';
            match (self.want, b) {
                (Want::CallOrEnd, b']') => self.ended = true,
                (Want::CallOrEnd | Want::KeywordOrClose, _) if identifier => {
                    self.write_comma();
                    self.token = Some(Token::Identifier {
                        start,
                        scan: start,
                        role: self.want,
                    });
                    continue;
                }
                (Want::Open, b'(') => {
                    self.open.push(Bracket::Call);
                    self.calls.last_mut().expect("a name").arguments.push('{');
                    self.want = Want::KeywordOrClose;
                }
                (Want::Equals, b'=') => self.want = Want::Value,
                (Want::Colon, b':') => {
                    self.write(": ");
                    self.want = Want::Value;
                }
                (Want::KeywordOrClose, b')')
                | (Want::ValueOrClose, b']')
                | (Want::KeyOrClose, b'}') => self.close()?,
                (Want::CommaOrClose, b',') => {
                    self.comma = true;
                    self.want = match self.open.last() {
                        None => Want::CallOrEnd,
                        Some(Bracket::Call) => Want::KeywordOrClose,
                        Some(Bracket::List) => Want::ValueOrClose,
                        Some(Bracket::Dict) => Want::KeyOrClose,
                    };
                }
                (Want::CommaOrClose, b')' | b']' | b'}') => {
                    let closes = match self.open.last() {
                        None => b']',
                        Some(Bracket::Call) => b')',
                        Some(Bracket::List) => b']',
                        Some(Bracket::Dict) => b'}',
                    };
                    if b != closes {
                        return Err(Malformed);
                    }
                    match self.open.is_empty() {
                        true => self.ended = true,
                        false => self.close()?,
                    }
                }
                (Want::Value | Want::ValueOrClose | Want::KeyOrClose, _) => {
                    self.begin_value(b, start)?;
                    continue;
                }
                _ => return Err(Malformed),
            }
            self.pos += 1;
        }
        Ok(())
    }

    /// Appends to the arguments of the call being read.
    fn write(&mut self, text: &str) {
        self.calls
            .last_mut()
            .expect("a call")
            .arguments
            .push_str(text);
    }

    /// Writes a `,` read before the item that begins (none between calls).
    fn write_comma(&mut self) {
        if std::mem::take(&mut self.comma) && !self.open.is_empty() {
            self.write(", ");
        }
    }

    /// A value (or a dict's key) begins with byte `b`, at `start`.
    fn begin_value(&mut self, b: u8, start: usize) -> Result<(), Malformed> {
        // As deep as the whole parse reads: the call's arguments' values are at depth 0.
        if self.open.len() > MAX_DEPTH {
            return Err(Malformed);
        }
        let role = self.want;
        let key = role == Want::KeyOrClose;
        self.write_comma();
        match b {
            b'"' | b'\'' => {
                if !key {
                    self.write("\"");
                }
                self.pos += 1;
                self.token = Some(Token::String {
                    quote: b,
                    role,
                    text: String::new(),
                });
            }
            b'-' | b'+' | b'.' | b'0'..=b'9' => {
                self.token = Some(Token::Number {
                    start,
                    scan: start,
                    role,
                })
            }
            // A dict's key is a string or a number.
            _ if key => return Err(Malformed),
            b'[' | b'{' => {
                self.write(if b == b'[' { "[" } else { "{" });
                self.open.push(if b == b'[' {
                    Bracket::List
                } else {
                    Bracket::Dict
                });
                self.want = if b == b'[' {
                    Want::ValueOrClose
                } else {
                    Want::KeyOrClose
                };
                self.pos += 1;
            }
            b if b.is_ascii_alphabetic() || b == b'_' => {
                self.token = Some(Token::Identifier {
                    start,
                    scan: start,
                    role,
                })
            }
            _ => return Err(Malformed),
        }
        Ok(())
    }

    /// Closes what is open innermost (`)`, `]` or `}`, read at `pos`).
    fn close(&mut self) -> Result<(), Malformed> {
        self.comma = false;
        match self.open.pop().ok_or(Malformed)? {
            Bracket::Call => {
                let call = self.calls.last_mut().expect("a call");
                call.arguments.push('}');
                call.whole = true;
            }
            Bracket::List => self.write("]"),
            Bracket::Dict => self.write("}"),
        }
        self.want = Want::CommaOrClose;
        Ok(())
    }

    /// A value read whole (`Some(value)`), or a dict's key (`key`, already written).
    fn end_value(&mut self, value: Option<&Value>) {
        if let Some(v) = value {
            self.write(&python_json(v));
        }
        self.want = Want::CommaOrClose;
    }

    /// A key or value that ends, written as its role has it: a dict's key as a string,
    /// then `:` is wanted; a value whole.
    fn end_scalar(&mut self, role: Want, value: Value) -> Result<(), Malformed> {
        if role == Want::KeyOrClose {
            let key = match value {
                Value::String(s) => s,
                // As the whole parse writes a number's key: its text.
                Value::Number(n) => n.to_string(),
                _ => return Err(Malformed),
            };
            self.write(&python_json(&Value::String(key)));
            self.want = Want::Colon;
        } else {
            self.end_value(Some(&value));
        }
        Ok(())
    }

    /// Reads on in the token; `false` where the text ends first.
    fn read_token(&mut self, text: &str) -> Result<bool, Malformed> {
        let s = text.as_bytes();
        match self.token.as_mut().expect("a token") {
            Token::Identifier { start, scan, role } => {
                let (start, role) = (*start, *role);
                let Some(len) = s[*scan..]
                    .iter()
                    .position(|&c| !(c.is_ascii_alphanumeric() || c == b'_'))
                else {
                    *scan = s.len();
                    return Ok(false);
                };
                let end = *scan + len;
                let word = &text[start..end];
                self.token = None;
                self.pos = end;
                match role {
                    Want::CallOrEnd => {
                        self.calls.push(ReadCall {
                            name: word.to_string(),
                            arguments: String::new(),
                            whole: false,
                        });
                        self.want = Want::Open;
                    }
                    Want::KeywordOrClose => {
                        self.write(&python_json(&Value::String(word.to_string())));
                        self.write(": ");
                        self.want = Want::Equals;
                    }
                    _ => {
                        let value = match word {
                            "True" => Value::Bool(true),
                            "False" => Value::Bool(false),
                            "None" => Value::Null,
                            _ => return Err(Malformed),
                        };
                        self.end_scalar(role, value)?;
                    }
                }
            }
            Token::Number { start, scan, role } => {
                let (start, role) = (*start, *role);
                let end = number_end(s, start, *scan);
                if end == s.len() {
                    *scan = end;
                    return Ok(false);
                }
                self.token = None;
                self.pos = end;
                let value = number(&text[start..end]).ok_or(Malformed)?;
                self.end_scalar(role, value)?;
            }
            Token::String {
                quote,
                role,
                text: read,
            } => {
                let (quote, key) = (*quote, *role == Want::KeyOrClose);
                let mut run = String::new();
                let closed = loop {
                    let Some(&c) = s.get(self.pos) else {
                        break Ok(false);
                    };
                    match c {
                        c if c == quote => break Ok(true),
                        b'\n' => break Err(Malformed),
                        b'\\' => match escape(&s[self.pos..]) {
                            Escape::Text(ch, len) => {
                                run.extend(ch);
                                self.pos += len;
                            }
                            Escape::Unknown => {
                                run.push('\\');
                                self.pos += 1;
                            }
                            Escape::Cut => break Ok(false),
                            Escape::Bad => break Err(Malformed),
                        },
                        _ => {
                            let ch = text[self.pos..].chars().next().expect("a character");
                            run.push(ch);
                            self.pos += ch.len_utf8();
                        }
                    }
                };
                // A value's text goes out as it comes, up to where it breaks too: however
                // the text came in pieces, the same is written.
                if key {
                    read.push_str(&run);
                } else if !run.is_empty() {
                    let escaped = python_json(&Value::String(run));
                    self.write(&escaped[1..escaped.len() - 1]);
                }
                if !closed? {
                    return Ok(false);
                }
                self.pos += 1;
                let Some(Token::String { text, role, .. }) = self.token.take() else {
                    unreachable!("a string is being read")
                };
                match key {
                    true => self.end_scalar(role, Value::String(text))?,
                    false => {
                        self.write("\"");
                        self.end_value(None);
                    }
                }
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parsed(text: &str) -> Option<Vec<(String, Value)>> {
        calls(text).map(|c| c.into_iter().map(|(n, a)| (n, Value::Object(a))).collect())
    }

    #[test]
    fn calls_with_literal_keywords_are_read() {
        assert_eq!(
            parsed(
                r#"[get_weather(city="Oslo", days=3), now(), f(x=[1, -2.5, 1e3], y={'a': None, 1: True},)]"#
            ),
            Some(vec![
                ("get_weather".into(), json!({"city": "Oslo", "days": 3})),
                ("now".into(), json!({})),
                (
                    "f".into(),
                    json!({"x": [1, -2.5, 1000.0], "y": {"a": null, "1": true}})
                ),
            ])
        );
        // Python's escapes: octal, the control letters, a line continuation; an unknown
        // one keeps its backslash.
        assert_eq!(
            parsed("[g(s='\\101\\0\\08\\a\\b\\f\\v\\\nx\\q\\8')]"),
            Some(vec![(
                "g".into(),
                json!({"s": "A\0\08\x07\x08\x0c\x0bx\\q\\8"})
            )])
        );
        // Python's number spellings.
        assert_eq!(
            parsed("[g(a=1_000, b=-0, c=00, d=5., e=.5, f=1_0.5e1_0)]"),
            Some(vec![(
                "g".into(),
                json!({"a": 1000, "b": 0, "c": 0, "d": 5.0, "e": 0.5, "f": 10.5e10})
            )])
        );
        assert_eq!(
            parsed(" [g(s='it\\'s \\u00e9\\n')]\n"),
            Some(vec![("g".into(), json!({"s": "it's é\n"}))])
        );
    }

    #[test]
    fn anything_else_is_not_a_call_list() {
        for text in [
            "[]",
            "get_weather(city='Oslo')",
            "[get_weather('Oslo')]",
            "[get_weather(city=other)]",
            "[get_weather(city='Oslo')] and more",
            "[get_weather(city='Oslo'",
            "[1, 2]",
            "Sure, [f()]",
            "[f(x=(1, 2))]",
            "[f(x=1, x=2)]",
            "[f(x=007)]",
            "[f(x=1_)]",
            "[f(x=1__0)]",
            "[f(x=1_.5)]",
            "[f(x='\\N{BULLET}')]",
        ] {
            assert_eq!(parsed(text), None, "{text}");
        }
        let deep = format!("[f(x={}1{})]", "[".repeat(100), "]".repeat(100));
        assert_eq!(parsed(&deep), None);
    }

    #[test]
    fn a_list_is_read_as_it_is_written() {
        let call = |name: &str, arguments: &str, whole| ReadCall {
            name: name.into(),
            arguments: arguments.into(),
            whole,
        };
        let text = "[f(a=1), g(s='x, y)'), h(b=[1,";
        let mut r = ListReader::new(1);
        r.read(text);
        assert_eq!(
            r.calls,
            [
                call("f", r#"{"a": 1}"#, true),
                call("g", r#"{"s": "x, y)"}"#, true),
                call("h", r#"{"b": [1"#, false),
            ]
        );
        assert!(!r.ended);
        // Read on from where it left off: the last call once it is whole, and the list's
        // end.
        r.read(&format!("{text} 2])] and more"));
        assert_eq!(r.calls[2], call("h", r#"{"b": [1, 2]}"#, true));
        assert!(r.ended);
        // A name goes in from its end, its arguments from the `(`.
        let mut r = ListReader::new(1);
        r.read("[ get_weather");
        assert_eq!(r.calls, []);
        r.read("[ get_weather (");
        assert_eq!(r.calls, [call("get_weather", "{", false)]);
    }

    proptest::proptest! {
        /// A model writes anything: no text makes the parser panic, and a call list it reads
        /// reads the same with whitespace around it.
        #[test]
        fn any_text_parses_or_not_without_panicking(
            text in r#"[\[\](){}'",=:_a-zA-Z0-9.+\-eE \\nux]{0,40}"#,
        ) {
            if let Some(c) = parsed(&text) {
                proptest::prop_assert_eq!(parsed(&format!(" {text}\n")), Some(c));
            }
        }
    }
}
