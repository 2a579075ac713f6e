//! The fixed English corpus prompts are cut from, and the tokenizer abstraction.
//!
//! Prompts are windows of the tokenised corpus: a prompt of N tokens is N consecutive
//! corpus tokens, and its text is exactly the corpus text those tokens cover. So the text a
//! load generator sends and the ids a simulator schedules describe the same prompt.

/// The corpus files (original texts, CC0; see `core/corpus/LICENSE.md`), in name order:
/// prompts are cut from them here, and the engine trains its generated tokenizers on them.
pub const CORPUS_FILES: [&str; 10] = [
    include_str!("../../corpus/01-harbor-town.txt"),
    include_str!("../../corpus/02-kitchen-notes.txt"),
    include_str!("../../corpus/03-travel-diary.txt"),
    include_str!("../../corpus/04-networks-explained.txt"),
    include_str!("../../corpus/05-garden-seasons.txt"),
    include_str!("../../corpus/06-night-sky.txt"),
    include_str!("../../corpus/07-the-lighthouse-keeper.txt"),
    include_str!("../../corpus/08-trade-notes.txt"),
    include_str!("../../corpus/09-practice-room.txt"),
    include_str!("../../corpus/10-letter-to-a-friend.txt"),
];

/// The whole corpus as one text (files joined by blank lines).
pub fn corpus_text() -> String {
    CORPUS_FILES
        .iter()
        .map(|f| f.trim_end())
        .collect::<Vec<_>>()
        .join("\n\n")
        + "\n\n"
}

/// One token: its id and the byte range of the text it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Token {
    pub id: u32,
    pub start: usize,
    pub end: usize,
}

/// Text → token ids. Implemented here by [`ApproxTokenizer`] and, in the engine, by a
/// real `tokenizer.json` through the `tokenizers` crate.
pub trait Tokenizer: Send + Sync {
    /// Tokens in order, their byte ranges covering `text` without gaps or overlaps.
    fn encode_with_offsets(&self, text: &str) -> Vec<Token>;

    fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_with_offsets(text)
            .into_iter()
            .map(|t| t.id)
            .collect()
    }

    /// A short name for logs and run metadata.
    fn name(&self) -> String;

    /// The tokens a server puts before every prompt it tokenises (a BOS token). A prompt
    /// of N tokens holds these and N minus their number of text tokens, so that the server
    /// counts N.
    fn prompt_prefix(&self) -> Vec<u32> {
        Vec::new()
    }
}

/// About four characters per token, for catalog models whose tokenizer is not at hand:
/// each word (with its leading whitespace) is cut into pieces of at most four characters,
/// and a piece's id is a hash of its text, so identical text gives identical ids.
#[derive(Debug, Clone)]
pub struct ApproxTokenizer {
    pub vocab_size: u32,
}

impl Default for ApproxTokenizer {
    fn default() -> Self {
        ApproxTokenizer { vocab_size: 32_000 }
    }
}

impl ApproxTokenizer {
    const CHARS_PER_TOKEN: usize = 4;

    fn id_of(&self, piece: &str) -> u32 {
        // FNV-1a: fixed and portable.
        let mut h: u32 = 0x811c_9dc5;
        for b in piece.bytes() {
            h = (h ^ b as u32).wrapping_mul(0x0100_0193);
        }
        h % self.vocab_size
    }
}

impl Tokenizer for ApproxTokenizer {
    fn encode_with_offsets(&self, text: &str) -> Vec<Token> {
        let mut out = Vec::with_capacity(text.len() / Self::CHARS_PER_TOKEN + 1);
        let mut start = 0;
        let mut chars = 0;
        let mut prev_ws = true;
        for (i, c) in text.char_indices() {
            let ws = c.is_whitespace();
            // A word boundary (whitespace after non-whitespace) or a full piece ends a token.
            let boundary = ws && !prev_ws;
            if i > start && (boundary || chars == Self::CHARS_PER_TOKEN) {
                out.push(Token {
                    id: self.id_of(&text[start..i]),
                    start,
                    end: i,
                });
                start = i;
                chars = 0;
            }
            chars += 1;
            prev_ws = ws;
        }
        if start < text.len() {
            out.push(Token {
                id: self.id_of(&text[start..]),
                start,
                end: text.len(),
            });
        }
        out
    }

    fn name(&self) -> String {
        format!("approx-4cpt-v{}", self.vocab_size)
    }
}

/// The corpus, tokenised once, cut into windows.
pub struct TokenizedCorpus {
    text: String,
    tokens: Vec<Token>,
}

impl TokenizedCorpus {
    pub fn new(tokenizer: &dyn Tokenizer) -> Self {
        let text = corpus_text();
        let tokens = tokenizer.encode_with_offsets(&text);
        assert!(
            !tokens.is_empty(),
            "the tokenizer produced no tokens for the corpus"
        );
        TokenizedCorpus { text, tokens }
    }

    /// Tokens in the corpus.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Append `n` consecutive tokens starting at token `offset` (wrapping around the end of
    /// the corpus) to `text` and `ids`.
    pub fn window(&self, offset: usize, n: usize, text: &mut String, ids: &mut Vec<u32>) {
        let mut pos = offset % self.tokens.len();
        let mut left = n;
        while left > 0 {
            let take = left.min(self.tokens.len() - pos);
            let run = &self.tokens[pos..pos + take];
            text.push_str(&self.text[run[0].start..run[take - 1].end]);
            ids.extend(run.iter().map(|t| t.id));
            left -= take;
            pos = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn approx_tokens_cover_text_and_are_stable() {
        let t = ApproxTokenizer::default();
        let text = "Herring shaped everything. Zürich — café!";
        let toks = t.encode_with_offsets(text);
        assert_eq!(toks[0].start, 0);
        assert_eq!(toks.last().unwrap().end, text.len());
        for w in toks.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        // About four characters per token.
        let chars = text.chars().count();
        assert!(
            toks.len() >= chars / 4 && toks.len() <= chars / 2,
            "{}",
            toks.len()
        );
        assert_eq!(t.encode(text), t.encode(text));
        assert_ne!(t.encode("alpha beta"), t.encode("beta alpha"));
    }

    #[test]
    fn corpus_is_large_and_windows_wrap() {
        let t = ApproxTokenizer::default();
        let c = TokenizedCorpus::new(&t);
        assert!(c.len() > 10_000, "corpus has {} tokens", c.len());
        let (mut text, mut ids) = (String::new(), Vec::new());
        c.window(c.len() - 3, 10, &mut text, &mut ids);
        assert_eq!(ids.len(), 10);
        assert!(text.len() >= 10);
    }
}
