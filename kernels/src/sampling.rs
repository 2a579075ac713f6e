//! One step's sampling inputs and outputs, packed flat as the sampling kernel reads and writes
//! them. The engine packs a [`SamplingBatch`] from its per-request samplers; the CPU reference
//! ([`crate::reference::sample_rows`]) and the CUDA kernel both take it.
//!
//! Semantics (vLLM's order, as the engine's host sampler applies them): the logit
//! adjustments of a row (repetition penalty, then presence/frequency penalty, then
//! `logit_bias`), then greedy when the temperature is 0, else weights
//! `w = exp((x - max) / T)` filtered by min-p, top-k and top-p, and a draw. The filters keep
//! every token at or above a threshold weight, so tokens tied at a top-k or top-p boundary
//! are all kept (the host sampler breaks such ties by id). The draw is exact integer
//! arithmetic on weights in 40-bit fixed point ([`fixed_weight`]): the same inputs give the
//! same token on every run and on both implementations, up to the last bit of `exp`.

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
        }
    }
}

impl std::error::Error for PackError {}

/// One step's rows, flat. Row `r`'s adjustments are
/// `adjust_start[r] .. adjust_start[r + 1]` of the adjustment arrays.
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
}

impl Default for SamplingBatch {
    fn default() -> Self {
        Self {
            floats: Vec::new(),
            ints: Vec::new(),
            adjust_start: vec![0],
            adjust_token: Vec::new(),
            adjust_values: Vec::new(),
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
        Ok(())
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
