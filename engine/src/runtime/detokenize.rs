//! Streaming text out of generated tokens: incremental detokenisation that never splits a
//! UTF-8 character, and stop strings that cut the text exactly where they begin.

use crate::runtime::tokenizer::TextTokenizer;
use aho_corasick::automaton::{Automaton, StateID};
use aho_corasick::dfa::DFA;
use aho_corasick::{Anchored, MatchKind, StartKind};
use anyhow::Result;
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// Turns a growing token list into text deltas. Decoding a token alone is wrong (BPE and
/// byte-level tokens only make sense in context, a character may span tokens), so each
/// step decodes a short window of recent tokens and emits what it adds beyond the text the
/// window's first part already produced; while the new text ends in an incomplete
/// character (decoded as U+FFFD), nothing is emitted.
///
/// The window starts with the prompt's last tokens (vLLM's rule), so that the first
/// token's text is what it adds after the prompt: SentencePiece decoders (Llama 2, Mistral)
/// strip the leading space of a text's first token, and `▁Paris` alone is `Paris`.
pub struct IncrementalDetokenizer {
    /// The prompt's last tokens, then the generated ones.
    tokens: Vec<u32>,
    /// Start of the decode window.
    prefix_offset: usize,
    /// Tokens before this have been emitted as text.
    read_offset: usize,
    /// Special tokens are written out, not dropped (`skip_special_tokens: false`).
    keep_special: bool,
}

/// Prompt tokens decoded before the first generated one (vLLM's
/// `INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET`).
const PROMPT_CONTEXT: usize = 5;

/// U+FFFD an unfinished character decodes to at most: one for each of its first 3 bytes
/// (a decoder that falls back to bytes replaces each). More at the end, or one before other
/// text, are bytes that will never make a character: they are released as they decode, or
/// the window would grow with them and make every later decode longer.
const MAX_UNFINISHED_BYTES: usize = 3;

impl IncrementalDetokenizer {
    /// The detokenizer of an output that follows `prompt`.
    pub fn after(prompt: &[u32]) -> Self {
        let context = prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..].to_vec();
        Self {
            prefix_offset: 0,
            read_offset: context.len(),
            tokens: context,
            keep_special: false,
        }
    }

    /// Special tokens are written out in the text, as vLLM's `skip_special_tokens: false`.
    pub fn keeping_special_tokens(self) -> Self {
        Self {
            keep_special: true,
            ..self
        }
    }

    fn decode(&self, tok: &TextTokenizer, from: usize, to: usize) -> Result<String> {
        tok.decode_with(&self.tokens[from..to], !self.keep_special)
    }

    /// Adds one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &TextTokenizer, token: u32) -> Result<String> {
        self.tokens.push(token);
        let mut prefix = self.decode(tok, self.prefix_offset, self.read_offset)?;
        if prefix.ends_with('\u{FFFD}') {
            // The prompt's tail ends inside a character: no context then.
            self.prefix_offset = self.read_offset;
            prefix.clear();
        }
        let full = self.decode(tok, self.prefix_offset, self.tokens.len())?;
        if full == prefix {
            // The token adds no text (a special token, skipped in decoding): out of the
            // window, or a model that keeps sampling its end token under `ignore_eos`
            // would make each decode longer than the last.
            self.tokens.pop();
            return Ok(String::new());
        }
        if full.ends_with('\u{FFFD}') {
            let new = full.strip_prefix(prefix.as_str()).unwrap_or(&full);
            let held = new.trim_end_matches('\u{FFFD}');
            let unfinished = new[held.len()..].chars().count();
            if unfinished <= MAX_UNFINISHED_BYTES && !held.contains('\u{FFFD}') {
                return Ok(String::new());
            }
            return self.flush(tok);
        }
        if let Some(delta) = full.strip_prefix(prefix.as_str()) {
            let delta = delta.to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.tokens.len();
            return Ok(delta);
        }
        Ok(String::new())
    }

    /// Tokens each decode reads (the window).
    pub fn window_len(&self) -> usize {
        self.tokens.len() - self.prefix_offset
    }

    /// The text still held back at the end of generation (an incomplete character is
    /// emitted as U+FFFD, as any decoder would).
    pub fn flush(&mut self, tok: &TextTokenizer) -> Result<String> {
        let prefix = self.decode(tok, self.prefix_offset, self.read_offset)?;
        let full = self.decode(tok, self.prefix_offset, self.tokens.len())?;
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
///
/// The stop strings are compiled once into an Aho-Corasick automaton ([`StopMatcher`]) and
/// each new piece of text is fed through it once, so the work per token is the token's own
/// bytes, whatever the number or length of the stop strings: one request's stop strings
/// cannot slow the engine thread every stream shares.
pub struct StopStrings {
    matcher: StopSet,
    /// The automaton's state after all text so far.
    state: StateID,
    /// Text not yet emitted: the longest suffix that could begin a stop string.
    pending: String,
    /// The stop string that ended the output, once one has.
    matched: Option<String>,
}

/// A request's stop strings, compiled once (by the request's handler, not on the engine
/// thread) and shared by each of its sequences.
#[derive(Clone, Default)]
pub struct StopSet {
    matcher: Option<Arc<StopMatcher>>,
    /// The output ends with the stop string it matched rather than before it (vLLM's
    /// `include_stop_str_in_output`).
    keeps_match: bool,
}

impl StopSet {
    pub fn new(stops: &[String]) -> Self {
        StopSet {
            matcher: StopMatcher::new(stops).map(Arc::new),
            keeps_match: false,
        }
    }

    /// The output keeps the stop string that ends it.
    pub fn keeping_the_match(self) -> Self {
        StopSet {
            keeps_match: true,
            ..self
        }
    }

    /// The (non-empty) stop strings.
    pub fn strings(&self) -> &[String] {
        self.matcher.as_ref().map_or(&[], |m| &m.stops)
    }
}

impl std::fmt::Debug for StopSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StopSet").field(&self.strings()).finish()
    }
}

impl PartialEq for StopSet {
    fn eq(&self, other: &Self) -> bool {
        self.strings() == other.strings() && self.keeps_match == other.keeps_match
    }
}

/// Stop strings compiled: the automaton, and for each of its states the length of the text
/// it stands for (the longest suffix of the text read that begins some stop string).
struct StopMatcher {
    /// The stop strings, in the automaton's pattern order.
    stops: Vec<String>,
    dfa: DFA,
    depth: FxHashMap<StateID, usize>,
}

impl StopMatcher {
    /// `None` without any non-empty stop string.
    fn new(stops: &[String]) -> Option<Self> {
        let stops: Vec<&str> = stops
            .iter()
            .map(String::as_str)
            .filter(|s| !s.is_empty())
            .collect();
        if stops.is_empty() {
            return None;
        }
        let dfa = DFA::builder()
            .match_kind(MatchKind::Standard)
            .start_kind(StartKind::Unanchored)
            .build(&stops)
            .expect("stop strings are bounded by the API, far below the DFA's limits");
        // A state's depth is the length of the shortest text leading to it (its prefix
        // itself), so a breadth-first walk from the start finds every depth. Bytes that
        // appear in no stop string lead back to the start and need no walk.
        let start = dfa
            .start_state(Anchored::No)
            .expect("an unanchored automaton");
        let mut bytes: Vec<u8> = stops.iter().flat_map(|s| s.bytes()).collect();
        bytes.sort_unstable();
        bytes.dedup();
        let mut depth = FxHashMap::default();
        depth.insert(start, 0);
        let mut queue = std::collections::VecDeque::from([start]);
        while let Some(sid) = queue.pop_front() {
            let d = depth[&sid];
            for &b in &bytes {
                let next = dfa.next_state(Anchored::No, sid, b);
                if let std::collections::hash_map::Entry::Vacant(e) = depth.entry(next) {
                    e.insert(d + 1);
                    queue.push_back(next);
                }
            }
        }
        let stops = stops.into_iter().map(str::to_string).collect();
        Some(StopMatcher { stops, dfa, depth })
    }
}

impl StopStrings {
    pub fn new(matcher: StopSet) -> Self {
        let state = matcher.matcher.as_ref().map_or(StateID::ZERO, |m| {
            m.dfa.start_state(Anchored::No).expect("unanchored")
        });
        Self {
            matcher,
            state,
            pending: String::new(),
            matched: None,
        }
    }

    /// The stop string that ended the output, if one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Feeds new text. Returns the text safe to emit and whether a stop string matched.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.feed(text, true)
    }

    /// [`StopStrings::push`], where a stop string that completes in `text` ends the output
    /// only if `armed` (the text is still read, so one that begins here and completes in
    /// armed text later does).
    pub fn feed(&mut self, text: &str, armed: bool) -> (String, bool) {
        let Some(m) = &self.matcher.matcher else {
            return (text.to_string(), false);
        };
        let base = self.pending.len();
        self.pending.push_str(text);
        // The first stop string to complete ends the output; of several completing at the
        // same byte, the one that starts first.
        for (i, &b) in text.as_bytes().iter().enumerate() {
            self.state = m.dfa.next_state(Anchored::No, self.state, b);
            if armed && m.dfa.is_match(self.state) {
                let end = base + i + 1;
                let (start, pattern) = (0..m.dfa.match_len(self.state))
                    .map(|k| {
                        let p = m.dfa.match_pattern(self.state, k);
                        (end - m.dfa.pattern_len(p), p)
                    })
                    .min()
                    .expect("a match state has a match");
                let cut = if self.matcher.keeps_match { end } else { start };
                let out = self.pending[..cut].to_string();
                self.pending.clear();
                self.matched = Some(m.stops[pattern.as_usize()].clone());
                return (out, true);
            }
        }
        let hold = m.depth[&self.state];
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// Text held back at the end of generation.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// One request's text: generated tokens in, text deltas out, cut right before the first
/// stop string. When the request ends (the scheduler decides on tokens and lengths; a
/// stop string is decided here), `finish` releases the text still held back.
pub struct OutputStream {
    detok: IncrementalDetokenizer,
    stops: StopStrings,
    stopped: bool,
    /// Tokens pushed so far, and how many must be before a stop string counts.
    tokens: usize,
    min_tokens: usize,
}

impl OutputStream {
    /// The output of a sequence of `prompt`, ended by `stops` once it holds `min_tokens`
    /// tokens (vLLM looks for stop strings only from then on, the text before included
    /// in the output whatever it holds).
    pub fn new(stops: StopSet, prompt: &[u32], min_tokens: usize) -> Self {
        Self {
            detok: IncrementalDetokenizer::after(prompt),
            stops: StopStrings::new(stops),
            stopped: false,
            tokens: 0,
            min_tokens,
        }
    }

    /// Special tokens are written out in the text (see [`IncrementalDetokenizer`]).
    pub fn keeping_special_tokens(self) -> Self {
        Self {
            detok: self.detok.keeping_special_tokens(),
            ..self
        }
    }

    /// A stop string has appeared: the request must end.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The stop string that ended the output, if one has.
    pub fn matched_stop(&self) -> Option<&str> {
        self.stops.matched()
    }

    /// Adds a generated token; returns the text to stream now. After a stop string,
    /// further tokens add nothing.
    pub fn push(&mut self, tok: &TextTokenizer, token: u32) -> Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        let delta = self.detok.push(tok, token)?;
        self.tokens += 1;
        let (out, stopped) = self.stops.feed(&delta, self.armed());
        self.stopped = stopped;
        Ok(out)
    }

    /// Whether a stop string ends the output now: once it holds more than `min_tokens`
    /// tokens (vLLM's rule; the one that completes then may begin before).
    fn armed(&self) -> bool {
        self.tokens > self.min_tokens
    }

    /// Whether the output keeps the stop that ends it (`include_stop_str_in_output`): a
    /// stop token's own text too.
    pub fn keeps_stop(&self) -> bool {
        self.stops.matcher.keeps_match
    }

    /// The request ended: the text held back for UTF-8 or a possible stop string (which
    /// may still complete a stop string, and is then cut before it).
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        let rest = self.detok.flush(tok)?;
        let (mut out, stopped) = self.stops.feed(&rest, self.armed());
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
        let mut s = StopStrings::new(StopSet::new(
            &stops.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        ));
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

    /// min_tokens' boundary, as vLLM draws it: a stop string that completes before it does
    /// not end the output, one that completes after it does, though it began before.
    #[test]
    fn unarmed_text_is_read_but_ends_nothing() {
        let stops = || StopSet::new(&["abc".into(), "xy".into()]);
        let mut s = StopStrings::new(stops());
        let (a, stopped) = s.feed("zab", false);
        assert!(!stopped);
        let (b, stopped) = s.feed("c!", true);
        assert!(stopped);
        assert_eq!(a + &b, "z");
        let mut s = StopStrings::new(stops());
        let (a, stopped) = s.feed("xy", false);
        let (b, stopped_later) = s.feed("z", true);
        assert!(!stopped && !stopped_later);
        assert_eq!(a + &b + &s.flush(), "xyz");
    }

    #[test]
    fn a_kept_stop_string_ends_the_output() {
        let stops = StopSet::new(&["lo w".into(), "world".into()]).keeping_the_match();
        let mut s = StopStrings::new(stops);
        let (a, _) = s.push("hel");
        let (b, stopped) = s.push("lo world and more");
        assert!(stopped);
        assert_eq!(a + &b, "hello w");
        assert_eq!(s.matched(), Some("lo w"));
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
        let mut s = StopStrings::new(StopSet::new(&["world".into(), "lo w".into()]));
        s.push("hello world");
        assert_eq!(s.matched(), Some("lo w"), "the one that matched is named");
    }

    /// What the stream must produce: the text up to the start of the stop string that
    /// completes first (of those completing at the same byte, the one starting first).
    fn reference(stops: &[String], text: &str) -> (String, Option<String>) {
        for end in 1..=text.len() {
            let first = stops
                .iter()
                .filter(|s| !s.is_empty() && text.as_bytes()[..end].ends_with(s.as_bytes()))
                .map(|s| (end - s.len(), s))
                .min();
            if let Some((start, stop)) = first {
                return (text[..start].to_string(), Some(stop.clone()));
            }
        }
        (text.to_string(), None)
    }

    /// The longest suffix of `text` that is a proper prefix of a stop string.
    fn could_begin_a_stop(stops: &[String], text: &str) -> usize {
        (1..=text.len())
            .filter(|&k| {
                stops.iter().any(|s| {
                    s.len() > k && s.as_bytes().starts_with(&text.as_bytes()[text.len() - k..])
                })
            })
            .max()
            .unwrap_or(0)
    }

    proptest::proptest! {
        /// Any stop strings, any text cut into any pieces: the output is the reference's,
        /// and the text held back is exactly what could still begin a stop string.
        #[test]
        fn streaming_equals_the_reference_and_holds_back_no_more_than_needed(
            stops in proptest::collection::vec("[abé]{1,4}", 1..5),
            pieces in proptest::collection::vec("[abcé]{0,5}", 0..8),
        ) {
            let mut s = StopStrings::new(StopSet::new(&stops));
            let (mut out, mut seen, mut stopped) = (String::new(), String::new(), false);
            for p in &pieces {
                seen.push_str(p);
                let (d, hit) = s.push(p);
                out.push_str(&d);
                if hit {
                    stopped = true;
                    break;
                }
                proptest::prop_assert_eq!(s.pending.len(), could_begin_a_stop(&stops, &seen));
            }
            if !stopped {
                out.push_str(&s.flush());
            }
            let (want, want_stop) = reference(&stops, &seen);
            proptest::prop_assert_eq!(stopped, want_stop.is_some());
            proptest::prop_assert_eq!(s.matched(), want_stop.as_deref());
            proptest::prop_assert_eq!(out, want);
        }
    }

    #[test]
    fn the_cost_per_token_does_not_grow_with_the_stop_strings() {
        // 128 stop strings of 128 bytes each (the API's bound is 16 KiB in all) against
        // one: the automaton's steps per byte are the same, so a stream of tokens costs
        // the same (compared as work, not time: the number of bytes fed is the text's).
        let many: Vec<String> = (0..128)
            .map(|i| format!("{i:03}{}", "x".repeat(125)))
            .collect();
        let m = StopMatcher::new(&many).unwrap();
        assert!(m.depth.len() <= 16 * 1024 + 1, "{} states", m.depth.len());
        let mut s = StopStrings::new(StopSet::new(&many));
        let mut emitted = 0;
        for _ in 0..1000 {
            let (d, stopped) = s.push("token ");
            assert!(!stopped);
            emitted += d.len();
        }
        assert_eq!(emitted, 6000, "nothing held back that cannot begin a stop");
    }

    #[test]
    fn multibyte_stop_string_is_held_on_char_boundaries() {
        let (out, stopped, _) = stream(&["é!"], &["caf", "é", "!", "x"]);
        assert!(stopped);
        assert_eq!(out, "caf");
    }
}
