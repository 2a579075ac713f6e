//! Streaming text out of generated tokens: incremental detokenisation that never splits a
//! UTF-8 character, and stop strings that cut the text exactly where they begin.

use crate::runtime::tokenizer::TextTokenizer;
use anyhow::Result;

/// Turns a growing token list into text deltas. Decoding a token alone is wrong (BPE and
/// byte-level tokens only make sense in context, a character may span tokens), so each
/// step decodes a short window of recent tokens and emits what it adds beyond the text the
/// window's first part already produced; while the new text ends in an incomplete
/// character (decoded as U+FFFD), nothing is emitted.
pub struct IncrementalDetokenizer {
    tokens: Vec<u32>,
    /// Start of the decode window.
    prefix_offset: usize,
    /// Tokens before this have been emitted as text.
    read_offset: usize,
}

impl Default for IncrementalDetokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl IncrementalDetokenizer {
    pub fn new() -> Self {
        Self {
            tokens: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Adds one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &TextTokenizer, token: u32) -> Result<String> {
        self.tokens.push(token);
        let prefix = tok.decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&self.tokens[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(delta) = full.strip_prefix(prefix.as_str()) {
                let delta = delta.to_string();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.tokens.len();
                return Ok(delta);
            }
        }
        Ok(String::new())
    }

    /// The text still held back at the end of generation (an incomplete character is
    /// emitted as U+FFFD, as any decoder would).
    pub fn flush(&mut self, tok: &TextTokenizer) -> Result<String> {
        let prefix = tok.decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&self.tokens[self.prefix_offset..])?;
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        Ok(full
            .strip_prefix(prefix.as_str())
            .unwrap_or(&full)
            .to_string())
    }
}

/// Holds back text that could still be the beginning of a stop string, and cuts the output
/// right before the first stop string that appears (the stop string is not emitted).
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
}

impl StopStrings {
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Feeds new text. Returns the text safe to emit and whether a stop string matched.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        // Earliest match wins: the output must end before the first stop string.
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        let hold = self.longest_partial_match();
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// Text held back at the end of generation.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of a stop string.
    fn longest_partial_match(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            for (k, _) in stop.char_indices().skip(1) {
                if k > best && self.pending.ends_with(&stop[..k]) {
                    best = k;
                }
            }
        }
        best
    }
}

/// One request's text: generated tokens in, text deltas out, cut right before the first
/// stop string. When the request ends (the scheduler decides on tokens and lengths; a
/// stop string is decided here), `finish` releases the text still held back.
pub struct OutputStream {
    detok: IncrementalDetokenizer,
    stops: StopStrings,
    stopped: bool,
}

impl OutputStream {
    pub fn new(stop_strings: &[String]) -> Self {
        Self {
            detok: IncrementalDetokenizer::new(),
            stops: StopStrings::new(stop_strings),
            stopped: false,
        }
    }

    /// A stop string has appeared: the request must end.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds a generated token; returns the text to stream now. After a stop string,
    /// further tokens add nothing.
    pub fn push(&mut self, tok: &TextTokenizer, token: u32) -> Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        let delta = self.detok.push(tok, token)?;
        let (out, stopped) = self.stops.push(&delta);
        self.stopped = stopped;
        Ok(out)
    }

    /// The request ended: the text held back for UTF-8 or a possible stop string (which
    /// may still complete a stop string, and is then cut before it).
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        let rest = self.detok.flush(tok)?;
        let (mut out, stopped) = self.stops.push(&rest);
        self.stopped = stopped;
        if !stopped {
            out.push_str(&self.stops.flush());
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(stops: &[&str], pieces: &[&str]) -> (String, bool, Vec<String>) {
        let mut s = StopStrings::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let mut out = String::new();
        let mut deltas = Vec::new();
        for p in pieces {
            let (d, stopped) = s.push(p);
            out.push_str(&d);
            deltas.push(d);
            if stopped {
                return (out, true, deltas);
            }
        }
        out.push_str(&s.flush());
        (out, false, deltas)
    }

    #[test]
    fn stop_string_cuts_exactly_across_pieces() {
        let (out, stopped, deltas) = stream(&["STOP"], &["hello S", "TO", "P and more"]);
        assert!(stopped);
        assert_eq!(out, "hello ");
        // "S" and "STO" were held back while they could still start "STOP".
        assert_eq!(deltas, vec!["hello ", "", ""]);
    }

    #[test]
    fn false_start_is_released() {
        let (out, stopped, deltas) = stream(&["STOP"], &["ST", "ART", "!"]);
        assert!(!stopped);
        assert_eq!(out, "START!");
        assert_eq!(deltas[0], "");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (out, stopped, _) = stream(&["world", "lo w"], &["hello world"]);
        assert!(stopped);
        assert_eq!(out, "hel");
    }

    #[test]
    fn multibyte_stop_string_is_held_on_char_boundaries() {
        let (out, stopped, _) = stream(&["é!"], &["caf", "é", "!", "x"]);
        assert!(stopped);
        assert_eq!(out, "caf");
    }
}
