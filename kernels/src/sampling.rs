//! One step's sampling inputs and outputs, packed flat as the sampling kernel reads and writes
//! them. The engine packs a [`SamplingBatch`] from its per-request samplers; the CPU reference
//! ([`crate::reference::sample_rows`]) and the CUDA kernel both take it.
//!
//! Semantics (vLLM's order, as the engine's host sampler applies them): the logit
//! adjustments of a row (repetition penalty, then presence/frequency penalty, then
//! `logit_bias`), then the row's grammar mask (structured output: every token it does not
//! allow set to −∞), then greedy when the temperature is 0, else weights
//! `w = exp((x - max) / T)` filtered by min-p, top-k and top-p, and a draw. The filters keep
//! every token at or above a threshold weight, so tokens tied at a top-k or top-p boundary
//! are all kept (the host sampler breaks such ties by id). The draw is exact integer
//! arithmetic on weights in 40-bit fixed point ([`fixed_weight`]): the same inputs give the
//! same token on every run and on both implementations, up to the last bit of `exp`.

use std::ops::Range;

/// The most `top_logprobs` a row may ask for (the server's limit, as OpenAI's).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A weight of 1 (the most likely token's) in fixed point: `2^40`. Weights below `2^-40` of
/// the most likely one (logits more than 27.7·T below it) count as 0: at most `vocab · 2^-40`
/// of the probability mass (2.4e-7 at a 256k vocabulary).
pub const FIXED_ONE: f32 = (1u64 << 40) as f32;

/// A weight in `[0, 1]` in fixed point, truncated (the kernel computes the very same).
pub fn fixed_weight(w: f32) -> u64 {
    (w * FIXED_ONE) as u64
}

/// How one row is sampled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowParams {
    /// 0 (or below): greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: u32,
    /// Keep the most likely tokens whose mass reaches this fraction; 1 = off.
    pub top_p: f32,
    /// Keep tokens at least this fraction of the most likely one's probability; 0 = off.
    pub min_p: f32,
    /// The draw, uniform in `[0, 1)`, from the request's own generator.
    pub uniform: f32,
    /// Return the sampled token's logprob and this many most likely tokens (raw model
    /// distribution, before any adjustment); `None`: no logprobs.
    pub top_logprobs: Option<usize>,
}

impl RowParams {
    /// The most likely token, no logprobs.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            uniform: 0.0,
            top_logprobs: None,
        }
    }
}

/// A change to one token's logit, applied as `rep(x) - penalty + bias` where `rep` divides a
/// positive logit by `repetition` and multiplies a negative one (the host sampler's order).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adjustment {
    pub token: u32,
    /// 1 = none.
    pub repetition: f32,
    /// Presence plus frequency penalty, subtracted; 0 = none.
    pub penalty: f32,
    /// `logit_bias`, added; 0 = none.
    pub bias: f32,
}

/// Why a row could not be packed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PackError {
    TooManyLogprobs(usize),
    /// Adjustments must name each token once, in increasing order (so the kernel's threads
    /// never write one logit twice).
    UnsortedAdjustments,
    TooLarge,
    /// A grammar mask that allows nothing (the host refuses to sample from it).
    EmptyMask,
}

impl std::fmt::Display for PackError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PackError::TooManyLogprobs(n) => {
                write!(f, "{n} top logprobs asked, at most {MAX_TOP_LOGPROBS}")
            }
            PackError::UnsortedAdjustments => {
                write!(
                    f,
                    "logit adjustments not in strictly increasing token order"
                )
            }
            PackError::TooLarge => write!(f, "more logit adjustments than an i32 counts"),
            PackError::EmptyMask => write!(f, "a grammar mask that allows no token"),
        }
    }
}

impl std::error::Error for PackError {}

/// One step's rows, flat. Row `r`'s adjustments are
/// `adjust_start[r] .. adjust_start[r + 1]` of the adjustment arrays, its grammar mask
/// `mask_start[r] .. mask_start[r + 1]` of `mask_words` (none when that is empty).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingBatch {
    /// `[rows, 4]`: temperature, top_p, min_p, uniform.
    pub floats: Vec<f32>,
    /// `[rows, 2]`: top_k (0 = off), top_logprobs (-1 = none).
    pub ints: Vec<i32>,
    /// `[rows + 1]`.
    pub adjust_start: Vec<i32>,
    /// `[adjustments]`.
    pub adjust_token: Vec<i32>,
    /// `[adjustments, 3]`: repetition, penalty, bias.
    pub adjust_values: Vec<f32>,
    /// `[rows + 1]`, in words of `mask_words`.
    pub mask_start: Vec<i32>,
    /// The masks of the rows that have one, each a bitset over token ids: bit `i % 32` of
    /// word `i / 32` allows token `i`; ids past a mask's end are not allowed (llguidance's
    /// layout, so a grammar's mask is copied as it is computed).
    pub mask_words: Vec<u32>,
}

impl Default for SamplingBatch {
    fn default() -> Self {
        Self {
            floats: Vec::new(),
            ints: Vec::new(),
            adjust_start: vec![0],
            adjust_token: Vec::new(),
            adjust_values: Vec::new(),
            mask_start: vec![0],
            mask_words: Vec::new(),
        }
    }
}

impl SamplingBatch {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn rows(&self) -> usize {
        self.ints.len() / 2
    }

    pub fn adjustments(&self) -> usize {
        self.adjust_token.len()
    }

    /// Appends a row; `adjust` in strictly increasing token order.
    pub fn push(&mut self, p: &RowParams, adjust: &[Adjustment]) -> Result<(), PackError> {
        self.push_masked(p, adjust, None)
    }

    /// Appends a row that samples only what `mask` allows (see [`SamplingBatch::mask_words`]).
    pub fn push_masked(
        &mut self,
        p: &RowParams,
        adjust: &[Adjustment],
        mask: Option<&[u32]>,
    ) -> Result<(), PackError> {
        if mask.is_some_and(|m| m.iter().all(|&w| w == 0)) {
            return Err(PackError::EmptyMask);
        }
        let mask = mask.unwrap_or(&[]);
        let mask_end =
            i32::try_from(self.mask_words.len() + mask.len()).map_err(|_| PackError::TooLarge)?;
        if p.top_logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return Err(PackError::TooManyLogprobs(p.top_logprobs.unwrap()));
        }
        if adjust.windows(2).any(|w| w[0].token >= w[1].token) {
            return Err(PackError::UnsortedAdjustments);
        }
        let end = i32::try_from(self.adjust_token.len() + adjust.len())
            .map_err(|_| PackError::TooLarge)?;
        let top_k = i32::try_from(p.top_k).unwrap_or(i32::MAX);
        let mut tokens = Vec::with_capacity(adjust.len());
        for a in adjust {
            tokens.push(i32::try_from(a.token).map_err(|_| PackError::TooLarge)?);
        }
        self.floats
            .extend([p.temperature, p.top_p, p.min_p, p.uniform]);
        self.ints
            .extend([top_k, p.top_logprobs.map_or(-1, |n| n as i32)]);
        self.adjust_token.extend(tokens);
        for a in adjust {
            self.adjust_values.extend([a.repetition, a.penalty, a.bias]);
        }
        self.adjust_start.push(end);
        self.mask_words.extend_from_slice(mask);
        self.mask_start.push(mask_end);
        Ok(())
    }

    /// Row `r`'s grammar mask, if it has one.
    pub fn mask(&self, r: usize) -> Option<&[u32]> {
        let (a, b) = (self.mask_start[r] as usize, self.mask_start[r + 1] as usize);
        (b > a).then(|| &self.mask_words[a..b])
    }

    /// Whether row `r`'s mask allows `token` (true when the row has no mask).
    pub fn allows(&self, r: usize, token: usize) -> bool {
        self.mask(r).is_none_or(|m| {
            m.get(token / 32)
                .is_some_and(|w| w >> (token % 32) & 1 == 1)
        })
    }

    /// Row `r` as it was pushed.
    pub fn row(&self, r: usize) -> (RowParams, Vec<Adjustment>) {
        let f = &self.floats[4 * r..4 * r + 4];
        let i = &self.ints[2 * r..2 * r + 2];
        let params = RowParams {
            temperature: f[0],
            top_p: f[1],
            min_p: f[2],
            uniform: f[3],
            top_k: i[0] as u32,
            top_logprobs: usize::try_from(i[1]).ok(),
        };
        let (a, b) = (
            self.adjust_start[r] as usize,
            self.adjust_start[r + 1] as usize,
        );
        let adjust = (a..b)
            .map(|j| Adjustment {
                token: self.adjust_token[j] as u32,
                repetition: self.adjust_values[3 * j],
                penalty: self.adjust_values[3 * j + 1],
                bias: self.adjust_values[3 * j + 2],
            })
            .collect();
        (params, adjust)
    }
}

/// Where each array of a [`SamplingBatch`] lies in [`SamplingBatch::to_words`]: one buffer of
/// 4-byte words, so a step uploads its sampling inputs with one copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchWords {
    pub floats: Range<usize>,
    pub ints: Range<usize>,
    pub adjust_start: Range<usize>,
    pub adjust_token: Range<usize>,
    pub adjust_values: Range<usize>,
    pub mask_start: Range<usize>,
    pub mask_words: Range<usize>,
    pub len: usize,
}

/// Where each array of a [`SampledRows`] of `rows` rows lies in one buffer of 4-byte words,
/// so a step downloads what it sampled with one copy ([`SampledRows::from_words`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowsWords {
    pub tokens: Range<usize>,
    pub logprobs: Range<usize>,
    pub top_ids: Range<usize>,
    pub top_logprobs: Range<usize>,
    pub len: usize,
}

impl RowsWords {
    pub fn new(rows: usize) -> Self {
        let mut at = Cursor(0);
        Self {
            tokens: at.take(rows),
            logprobs: at.take(rows),
            top_ids: at.take(rows * MAX_TOP_LOGPROBS),
            top_logprobs: at.take(rows * MAX_TOP_LOGPROBS),
            len: at.0,
        }
    }
}

/// Lays arrays out one after another.
struct Cursor(usize);

impl Cursor {
    fn take(&mut self, len: usize) -> Range<usize> {
        self.0 += len;
        self.0 - len..self.0
    }
}

impl SamplingBatch {
    /// Every array in one buffer of 4-byte words (f32 as their bits), and where each lies.
    pub fn to_words(&self) -> (Vec<u32>, BatchWords) {
        let mut at = Cursor(0);
        let layout = BatchWords {
            floats: at.take(self.floats.len()),
            ints: at.take(self.ints.len()),
            adjust_start: at.take(self.adjust_start.len()),
            adjust_token: at.take(self.adjust_token.len()),
            adjust_values: at.take(self.adjust_values.len()),
            mask_start: at.take(self.mask_start.len()),
            mask_words: at.take(self.mask_words.len()),
            len: at.0,
        };
        let mut words = Vec::with_capacity(layout.len);
        words.extend(self.floats.iter().map(|x| x.to_bits()));
        words.extend(self.ints.iter().map(|&x| x as u32));
        words.extend(self.adjust_start.iter().map(|&x| x as u32));
        words.extend(self.adjust_token.iter().map(|&x| x as u32));
        words.extend(self.adjust_values.iter().map(|x| x.to_bits()));
        words.extend(self.mask_start.iter().map(|&x| x as u32));
        words.extend_from_slice(&self.mask_words);
        debug_assert_eq!(words.len(), layout.len);
        (words, layout)
    }
}

/// What sampling returns, flat as the kernel writes it.
#[derive(Clone, Debug, PartialEq)]
pub struct SampledRows {
    /// `[rows]`.
    pub tokens: Vec<i32>,
    /// `[rows]`: the token's raw logprob; NaN where the row asked for none.
    pub logprobs: Vec<f32>,
    /// `[rows, MAX_TOP_LOGPROBS]`: most likely first, -1 past the row's count.
    pub top_ids: Vec<i32>,
    /// `[rows, MAX_TOP_LOGPROBS]`.
    pub top_logprobs: Vec<f32>,
}

impl SampledRows {
    pub fn new(rows: usize) -> Self {
        Self {
            tokens: vec![-1; rows],
            logprobs: vec![f32::NAN; rows],
            top_ids: vec![-1; rows * MAX_TOP_LOGPROBS],
            top_logprobs: vec![f32::NAN; rows * MAX_TOP_LOGPROBS],
        }
    }

    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// The rows as [`RowsWords::new`] lays them out in `words`.
    pub fn from_words(rows: usize, words: &[u32]) -> Self {
        let at = RowsWords::new(rows);
        assert_eq!(
            words.len(),
            at.len,
            "{rows} sampled rows are {} words",
            at.len
        );
        let ints = |r: &Range<usize>| words[r.clone()].iter().map(|&w| w as i32).collect();
        let floats = |r: &Range<usize>| {
            words[r.clone()]
                .iter()
                .map(|&w| f32::from_bits(w))
                .collect()
        };
        Self {
            tokens: ints(&at.tokens),
            logprobs: floats(&at.logprobs),
            top_ids: ints(&at.top_ids),
            top_logprobs: floats(&at.top_logprobs),
        }
    }

    /// Row `r`'s top tokens with their logprobs, most likely first.
    pub fn top(&self, r: usize) -> Vec<(u32, f32)> {
        let ids = &self.top_ids[r * MAX_TOP_LOGPROBS..][..MAX_TOP_LOGPROBS];
        let lps = &self.top_logprobs[r * MAX_TOP_LOGPROBS..][..MAX_TOP_LOGPROBS];
        ids.iter()
            .zip(lps)
            .take_while(|(&t, _)| t >= 0)
            .map(|(&t, &l)| (t as u32, l))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(top_logprobs: Option<usize>) -> RowParams {
        RowParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            uniform: 0.25,
            top_logprobs,
        }
    }

    fn adj(token: u32) -> Adjustment {
        Adjustment {
            token,
            repetition: 1.1,
            penalty: 0.5,
            bias: -2.0,
        }
    }

    #[test]
    fn rows_round_trip() {
        let mut b = SamplingBatch::new();
        b.push(&params(None), &[adj(3), adj(9)]).unwrap();
        b.push(&params(Some(5)), &[]).unwrap();
        b.push(&params(Some(0)), &[adj(0)]).unwrap();
        assert_eq!(b.rows(), 3);
        assert_eq!(b.adjustments(), 3);
        assert_eq!(b.adjust_start, vec![0, 2, 2, 3]);
        assert_eq!(b.row(0), (params(None), vec![adj(3), adj(9)]));
        assert_eq!(b.row(1), (params(Some(5)), vec![]));
        assert_eq!(b.row(2), (params(Some(0)), vec![adj(0)]));
        assert_eq!(b.ints, vec![40, -1, 40, 5, 40, 0]);
        assert_eq!(b.mask_start, vec![0, 0, 0, 0]);
        assert!((0..3).all(|r| b.mask(r).is_none() && b.allows(r, 12_345)));
    }

    #[test]
    fn masks_pack_per_row_and_allow_only_their_bits() {
        let mut b = SamplingBatch::new();
        b.push_masked(&params(None), &[], Some(&[0b101, 1 << 31]))
            .unwrap();
        b.push(&params(None), &[adj(2)]).unwrap();
        b.push_masked(&params(Some(1)), &[adj(0)], Some(&[0, 0, 1 << 4]))
            .unwrap();
        assert_eq!(b.mask_start, vec![0, 2, 2, 5]);
        assert_eq!(b.mask(0), Some(&[0b101, 1 << 31][..]));
        assert_eq!(b.mask(1), None);
        let allowed = |r| (0..100).filter(|&t| b.allows(r, t)).collect::<Vec<_>>();
        // Ids past a mask's end are not allowed.
        assert_eq!(allowed(0), vec![0, 2, 63]);
        assert_eq!(allowed(1), (0..100).collect::<Vec<_>>());
        assert_eq!(allowed(2), vec![68]);
        assert_eq!(b.row(2), (params(Some(1)), vec![adj(0)]));
    }

    #[test]
    fn bad_rows_are_refused_and_leave_the_batch_unchanged() {
        let mut b = SamplingBatch::new();
        b.push(&params(None), &[adj(1)]).unwrap();
        let before = b.clone();
        assert_eq!(
            b.push(&params(Some(21)), &[]),
            Err(PackError::TooManyLogprobs(21))
        );
        assert_eq!(
            b.push(&params(None), &[adj(4), adj(4)]),
            Err(PackError::UnsortedAdjustments)
        );
        assert_eq!(
            b.push(&params(None), &[adj(5), adj(2)]),
            Err(PackError::UnsortedAdjustments)
        );
        assert_eq!(
            b.push_masked(&params(None), &[], Some(&[0, 0])),
            Err(PackError::EmptyMask)
        );
        assert_eq!(
            b.push_masked(&params(Some(21)), &[], Some(&[1])),
            Err(PackError::TooManyLogprobs(21))
        );
        assert_eq!(b, before);
    }

    #[test]
    fn fixed_point_keeps_the_top_weight_exact() {
        assert_eq!(fixed_weight(1.0), 1 << 40);
        assert_eq!(fixed_weight(0.5), 1 << 39);
        assert_eq!(fixed_weight(0.0), 0);
        // Below 2^-40 a weight counts as nothing.
        assert_eq!(fixed_weight(2f32.powi(-41)), 0);
        assert_eq!(fixed_weight(2f32.powi(-40)), 1);
    }

    #[test]
    fn a_batch_packs_into_words_where_its_layout_says() {
        let mut b = SamplingBatch::new();
        b.push(&params(Some(3)), &[adj(3), adj(9)]).unwrap();
        b.push_masked(&params(None), &[], Some(&[7, u32::MAX]))
            .unwrap();
        let (words, at) = b.to_words();
        assert_eq!(words.len(), at.len);
        let floats: Vec<f32> = words[at.floats.clone()]
            .iter()
            .map(|&w| f32::from_bits(w))
            .collect();
        assert_eq!(floats, b.floats);
        let ints = |r: Range<usize>| words[r].iter().map(|&w| w as i32).collect::<Vec<_>>();
        assert_eq!(ints(at.ints), b.ints);
        assert_eq!(ints(at.adjust_start), b.adjust_start);
        assert_eq!(ints(at.adjust_token), b.adjust_token);
        let values: Vec<f32> = words[at.adjust_values]
            .iter()
            .map(|&w| f32::from_bits(w))
            .collect();
        assert_eq!(values, b.adjust_values);
        assert_eq!(ints(at.mask_start), b.mask_start);
        assert_eq!(words[at.mask_words.clone()].to_vec(), b.mask_words);
        // The arrays tile the buffer in order, with no gap.
        assert_eq!(at.floats.start, 0);
        assert_eq!(at.mask_words.end, at.len);
    }

    #[test]
    fn sampled_rows_come_back_from_words() {
        let mut want = SampledRows::new(3);
        want.tokens = vec![5, -1, 70_000];
        want.logprobs = vec![-0.25, f32::NAN, -3.5];
        want.top_ids[2 * MAX_TOP_LOGPROBS] = 9;
        want.top_logprobs[2 * MAX_TOP_LOGPROBS] = -0.125;
        let at = RowsWords::new(3);
        let mut words = vec![0u32; at.len];
        for (i, r) in at.tokens.clone().enumerate() {
            words[r] = want.tokens[i] as u32;
        }
        for (i, r) in at.logprobs.clone().enumerate() {
            words[r] = want.logprobs[i].to_bits();
        }
        for (i, r) in at.top_ids.clone().enumerate() {
            words[r] = want.top_ids[i] as u32;
        }
        for (i, r) in at.top_logprobs.clone().enumerate() {
            words[r] = want.top_logprobs[i].to_bits();
        }
        let got = SampledRows::from_words(3, &words);
        assert_eq!(got.tokens, want.tokens);
        assert_eq!(got.top(2), vec![(9, -0.125)]);
        assert!(got.logprobs[1].is_nan() && got.logprobs[2] == -3.5);
        assert_eq!(at.len, 3 * (2 + 2 * MAX_TOP_LOGPROBS));
    }

    #[test]
    fn sampled_rows_read_back_their_top() {
        let mut s = SampledRows::new(2);
        s.top_ids[MAX_TOP_LOGPROBS] = 7;
        s.top_logprobs[MAX_TOP_LOGPROBS] = -0.5;
        s.top_ids[MAX_TOP_LOGPROBS + 1] = 3;
        s.top_logprobs[MAX_TOP_LOGPROBS + 1] = -1.5;
        assert_eq!(s.top(0), vec![]);
        assert_eq!(s.top(1), vec![(7, -0.5), (3, -1.5)]);
    }
}
