//! Python's call syntax, for the `pythonic` tool-call format: `[f(a=1, b="x"), g()]`, the
//! arguments keywords whose values are literals (strings, numbers, `True`/`False`/`None`,
//! lists and dicts of them), as vLLM reads such an output with Python's `ast`.

use serde_json::{Map, Number, Value};

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

/// The whole calls of a Python list of calls being written, read from byte `from` of
/// `text` (just after the list's `[`, or where this left off before): each call with where
/// to read on from (after the `,` that follows it, or at the list's `]`), up to the first
/// call not yet whole, or not a call.
pub fn whole_calls_from(text: &str, from: usize) -> Vec<(Call, usize)> {
    let mut p = Parser {
        s: text.as_bytes(),
        i: from,
        depth: 0,
    };
    let mut calls = Vec::new();
    loop {
        p.ws();
        let Some(call) = p.call() else {
            return calls;
        };
        p.ws();
        let whole = p.eat(b',').is_some() || p.peek() == Some(b']');
        // Without the `,` or `]` after it, `f(a=1)` may yet go on (`f(a=1)(…)`).
        if !whole {
            return calls;
        }
        calls.push((call, p.i));
    }
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
        Some((name, arguments.into_iter().collect()))
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
                b'\\' => {
                    let e = self.peek()?;
                    self.i += 1;
                    let ch = match e {
                        b'n' => '\n',
                        b't' => '\t',
                        b'r' => '\r',
                        b'0' => '\0',
                        b'\\' | b'\'' | b'"' => e as char,
                        b'x' => self.hex(2)?,
                        b'u' => self.hex(4)?,
                        b'U' => self.hex(8)?,
                        _ => {
                            // An unknown escape keeps its backslash, as Python does.
                            out.push(b'\\');
                            self.i -= 1;
                            continue;
                        }
                    };
                    let mut buf = [0; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                }
                c => out.push(c),
            }
        }
        String::from_utf8(out).ok()
    }

    fn hex(&mut self, digits: usize) -> Option<char> {
        let text = std::str::from_utf8(self.s.get(self.i..self.i + digits)?).ok()?;
        // (`from_str_radix` would take a sign, Python does not.)
        if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        self.i += digits;
        char::from_u32(u32::from_str_radix(text, 16).ok()?)
    }

    fn number(&mut self) -> Option<Value> {
        let start = self.i;
        if matches!(self.peek(), Some(b'-' | b'+')) {
            self.i += 1;
        }
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_digit() || matches!(c, b'.' | b'e' | b'E' | b'_'))
            || (self.i > start
                && matches!(self.peek(), Some(b'-' | b'+'))
                && matches!(self.s[self.i - 1], b'e' | b'E'))
        {
            self.i += 1;
        }
        let text: String = std::str::from_utf8(&self.s[start..self.i])
            .ok()?
            .replace('_', "");
        let text = text.strip_prefix('+').unwrap_or(&text);
        let integer = !text.contains(['.', 'e', 'E']);
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
        ] {
            assert_eq!(parsed(text), None, "{text}");
        }
        let deep = format!("[f(x={}1{})]", "[".repeat(100), "]".repeat(100));
        assert_eq!(parsed(&deep), None);
    }

    #[test]
    fn whole_calls_are_read_as_a_list_is_written() {
        let text = "[f(a=1), g(s='x, y)'), h(b=[1,";
        let read = whole_calls_from(text, 1);
        let names: Vec<&str> = read.iter().map(|((n, _), _)| n.as_str()).collect();
        assert_eq!(names, ["f", "g"]);
        // Read on from where it left off: the last call once it is whole.
        let (_, end) = read[1];
        assert_eq!(whole_calls_from(text, end), vec![]);
        let more = format!("{text} 2])]");
        let rest = whole_calls_from(&more, end);
        assert_eq!(rest.len(), 1);
        assert_eq!(Value::Object(rest[0].0 .1.clone()), json!({"b": [1, 2]}));
        // A call with nothing after it may go on.
        assert_eq!(whole_calls_from("[f(a=1)", 1), vec![]);
        assert_eq!(whole_calls_from("[f(a=1) ]", 1).len(), 1);
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
