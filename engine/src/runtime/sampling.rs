//! Token sampling from one sequence's logits, with vLLM's parameter semantics:
//! penalties, then temperature (0 = greedy), then min-p, top-k, top-p, then a draw from a
//! per-request seeded generator. Logprobs are those of the raw model distribution.
//! A structured-output request's grammar masks the logits first (see `structured`).

use infer_kernels::reference;
use infer_kernels::sampling::{Adjustment, RowParams};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use crate::runtime::structured::Constraint;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches p; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 = off.
    pub min_p: f32,
    /// Seed of this request's generator; `None` takes the driver's default seed.
    pub seed: Option<u64>,
    /// > 1 discourages tokens already in the prompt or output; 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of every token already generated.
    pub frequency_penalty: f32,
    /// Return this many most likely tokens with their logprobs.
    pub logprobs: Option<usize>,
    /// Added to these tokens' logits before sampling (OpenAI's `logit_bias`, in [-100, 100]);
    /// logprobs stay those of the model's distribution, as vLLM reports them.
    pub logit_bias: Vec<(u32, f32)>,
    /// Tokens to generate before the end-of-sequence and stop tokens may be sampled (vLLM's
    /// `min_tokens`; see [`Sampler::hold_stops`]).
    pub min_tokens: usize,
    /// The only tokens that may be sampled (vLLM's `allowed_token_ids`), sorted; logprobs
    /// stay those of the model's distribution, as vLLM reports them.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Token sequences the output must not contain (vLLM's `bad_words`, tokenised): the
    /// last token of each is not sampled where the output ends with the ones before it.
    pub bad_words: Vec<Vec<u32>>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: None,
            logit_bias: Vec::new(),
            min_tokens: 0,
            allowed_token_ids: None,
            bad_words: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub token: u32,
    /// Logprob of `token` under the raw model distribution; computed only when the request
    /// asked for logprobs (a log-sum-exp over the vocabulary costs more than the argmax).
    pub logprob: Option<f32>,
    /// The `logprobs` most likely tokens, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
    /// Seconds this token's grammar took (copying the logits, the mask, advancing the
    /// grammar): structured output's host cost, 0 without one.
    pub constraint_s: f64,
}

impl SampledToken {
    /// Stands for a token that could not be sampled (its request ends with an error).
    pub fn placeholder() -> Self {
        Self {
            token: 0,
            logprob: None,
            top_logprobs: Vec::new(),
            constraint_s: 0.0,
        }
    }
}

/// The mask that allows `ids` (and no other token), as a grammar's is written.
fn mask_of(ids: &[u32]) -> Vec<u32> {
    let words = ids.iter().max().map_or(0, |&m| m as usize / 32 + 1);
    let mut mask = vec![0u32; words];
    for &t in ids {
        mask[t as usize / 32] |= 1 << (t % 32);
    }
    mask
}

/// Per-request sampling state: the generator and the token counts penalties need.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Occurrences in the output so far (presence / frequency penalties).
    output_counts: HashMap<u32, u32>,
    /// The penalties and bias as one change per token, in token order: what the device
    /// sampler applies, and the host one through the same function. Made from the bias and
    /// the prompt once and changed token by token, not rebuilt each step (a step rebuilt
    /// it from every distinct prompt token under a repetition penalty, for every sequence,
    /// on the engine thread).
    adjustments: Vec<Adjustment>,
    /// The grammar the output must follow, if any.
    constraint: Option<Constraint>,
    /// A grammar that applies once its start token is sampled (see [`Sampler::constrain`]).
    waiting_constraint: Option<Constraint>,
    /// `allowed_token_ids` as a mask, as a grammar's is written (bit `i % 32` of word
    /// `i / 32` allows token `i`; ids past its end are not allowed).
    allowed: Option<Vec<u32>>,
    /// Tokens sampled so far.
    generated: usize,
    /// While fewer than `min_tokens` are: the tokens held back (their bias −∞ in
    /// `adjustments`) with the bias each had, restored then.
    held_stops: Vec<(u32, f32)>,
    /// The tokens `bad_words` bans from the next token (their bias −∞ in `adjustments`),
    /// with the bias each had, restored after it.
    banned: Vec<(u32, f32)>,
    /// The output's last tokens, at most `recent_len`: as many as the longest bad word has
    /// before its last.
    recent: Vec<u32>,
    recent_len: usize,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32], default_seed: u64) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(params.seed.unwrap_or(default_seed));
        let allowed = params.allowed_token_ids.as_deref().map(mask_of);
        let mut by_token: BTreeMap<u32, Adjustment> = BTreeMap::new();
        for &(t, bias) in &params.logit_bias {
            by_token.entry(t).or_insert_with(|| no_change(t)).bias += bias;
        }
        if params.repetition_penalty != 1.0 {
            for &t in prompt {
                by_token.entry(t).or_insert_with(|| no_change(t)).repetition =
                    params.repetition_penalty;
            }
        }
        let recent_len = (params.bad_words.iter())
            .map(|w| w.len().saturating_sub(1))
            .max()
            .unwrap_or(0);
        let mut sampler = Self {
            params,
            rng,
            output_counts: HashMap::new(),
            adjustments: by_token.into_values().collect(),
            constraint: None,
            waiting_constraint: None,
            allowed,
            generated: 0,
            held_stops: Vec::new(),
            banned: Vec::new(),
            recent: Vec::new(),
            recent_len,
        };
        sampler.ban_bad_words();
        sampler
    }

    /// Bans the last token of each bad word whose other tokens end the output, as vLLM's
    /// `apply_bad_words` (a word of one token always), through `adjustments`: the host and
    /// the device sampler alike. Pairs with [`Sampler::lift_bans`].
    fn ban_bad_words(&mut self) {
        for word in &self.params.bad_words {
            let Some((&last, before)) = word.split_last() else {
                continue;
            };
            if self.recent.ends_with(before) {
                let a = adjustment_of(&mut self.adjustments, last);
                let bias = std::mem::replace(&mut a.bias, f32::NEG_INFINITY);
                self.banned.push((last, bias));
            }
        }
    }

    /// Gives the tokens [`Sampler::ban_bad_words`] banned their bias back, latest first (a
    /// token banned twice gets the bias it had before the first).
    fn lift_bans(&mut self) {
        while let Some((t, bias)) = self.banned.pop() {
            adjustment_of(&mut self.adjustments, t).bias = bias;
        }
    }

    /// Holds `stops` (the request's end-of-sequence and stop tokens) back until
    /// `min_tokens` tokens are out, as vLLM's min-tokens processor does: their logits are
    /// −∞ until then, on the host and the device alike (they go with the adjustments).
    pub fn hold_stops(&mut self, stops: &[u32]) {
        if self.params.min_tokens <= self.generated {
            return;
        }
        // Beneath the bans: a stop that is also a bad word is held with its own bias, which
        // the ban gives back before the hold is released.
        self.lift_bans();
        for &t in stops {
            let adjustment = adjustment_of(&mut self.adjustments, t);
            let bias = std::mem::replace(&mut adjustment.bias, f32::NEG_INFINITY);
            if bias != f32::NEG_INFINITY {
                self.held_stops.push((t, bias));
            }
        }
        self.ban_bad_words();
    }

    /// Sample only what `constraint` allows from now on, or, where it starts after a
    /// token, from the token after that one is sampled.
    pub fn constrain(&mut self, constraint: Constraint) {
        match constraint.starts_after() {
            Some(_) => self.waiting_constraint = Some(constraint),
            None => self.constraint = Some(constraint),
        }
    }

    /// The grammar the next token follows, if one does now.
    pub fn constraint(&self) -> Option<&Constraint> {
        self.constraint.as_ref()
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token from `logits` (one row, vocab long) and records it. Errs only
    /// when the request's grammar fails (it then cannot go on).
    pub fn sample(&mut self, logits: &[f32]) -> anyhow::Result<SampledToken> {
        let p = &self.params;
        let t_constraint = self.constraint.is_some().then(Instant::now);
        let mut adjusted = (p.repetition_penalty != 1.0
            || p.presence_penalty != 0.0
            || p.frequency_penalty != 0.0
            || !p.logit_bias.is_empty()
            || !self.held_stops.is_empty()
            || self.constraint.is_some()
            || self.allowed.is_some()
            || !self.banned.is_empty())
        .then(|| {
            let mut l = logits.to_vec();
            self.apply_penalties(&mut l);
            l
        });
        if let (Some(c), Some(l)) = (&mut self.constraint, &mut adjusted) {
            c.mask(l)?;
        }
        if let (Some(allowed), Some(l)) = (&self.allowed, &mut adjusted) {
            crate::runtime::structured::apply_mask(allowed, l);
        }
        let mut constraint_s = t_constraint.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let l = adjusted.as_deref().unwrap_or(logits);
        let token = if self.params.temperature <= 0.0 {
            argmax(l)
        } else {
            self.draw(l)
        };
        if let Some(c) = &mut self.constraint {
            let t = Instant::now();
            c.accept(token)?;
            constraint_s += t.elapsed().as_secs_f64();
        }
        let (logprob, top_logprobs) = match self.params.logprobs {
            Some(top_n) => {
                let (lp, top) = raw_logprobs(logits, token, top_n);
                (Some(lp), top)
            }
            None => (None, Vec::new()),
        };
        self.record(token);
        Ok(SampledToken {
            token,
            logprob,
            top_logprobs,
            constraint_s,
        })
    }

    fn apply_penalties(&self, l: &mut [f32]) {
        reference::adjust_logits(l, &self.adjustments);
    }

    /// This step's row for the device sampler, its uniform drawn from the request's
    /// generator as a host draw would be (so a seeded request gives the same stream either
    /// way), with the grammar's mask for this step when one constrains the output. Follow
    /// it with [`Sampler::accept_device`] of the token the device chose. Errs only when the
    /// grammar fails (as [`Sampler::sample`] would).
    pub fn device_row(&mut self) -> anyhow::Result<DeviceRow<'_>> {
        let t = Instant::now();
        let grammar = self.constraint.as_mut().map(|c| c.allowed()).transpose()?;
        let constraint_s = grammar.as_ref().map_or(0.0, |_| t.elapsed().as_secs_f64());
        // Both the grammar and `allowed_token_ids`: what both allow (past the shorter
        // mask's end, nothing).
        let mask = match (grammar, &self.allowed) {
            (Some(g), Some(a)) => Some(g.iter().zip(a).map(|(g, a)| g & a).collect()),
            (g, a) => g.or_else(|| a.clone()),
        };
        let p = &self.params;
        let greedy = p.temperature <= 0.0;
        let row = RowParams {
            temperature: p.temperature,
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            top_p: p.top_p,
            min_p: p.min_p,
            uniform: if greedy { 0.0 } else { self.rng.gen::<f32>() },
            top_logprobs: p.logprobs,
        };
        Ok(DeviceRow {
            params: row,
            adjust: &self.adjustments,
            mask,
            constraint_s,
        })
    }

    /// Records a token sampled on the device (see [`Sampler::device_row`]) and advances the
    /// grammar past it: the seconds that took. Errs when the grammar fails.
    pub fn accept_device(&mut self, token: u32) -> anyhow::Result<f64> {
        let mut constraint_s = 0.0;
        if let Some(c) = &mut self.constraint {
            let t = Instant::now();
            c.accept(token)?;
            constraint_s = t.elapsed().as_secs_f64();
        }
        self.record(token);
        Ok(constraint_s)
    }

    fn record(&mut self, token: u32) {
        // Before any other bias changes: a ban gives back the bias it took.
        self.lift_bans();
        self.generated += 1;
        if (self.waiting_constraint.as_ref()).is_some_and(|c| c.starts_after() == Some(token)) {
            self.constraint = self.waiting_constraint.take();
        }
        if self.generated >= self.params.min_tokens {
            for (t, bias) in std::mem::take(&mut self.held_stops) {
                if let Ok(i) = self.adjustments.binary_search_by_key(&t, |a| a.token) {
                    self.adjustments[i].bias = bias;
                }
            }
        }
        if !self.params.bad_words.is_empty() {
            let keep = self.recent_len;
            if keep > 0 {
                if self.recent.len() == keep {
                    self.recent.remove(0);
                }
                self.recent.push(token);
            }
            self.ban_bad_words();
        }
        let n = self.output_counts.entry(token).or_insert(0);
        *n += 1;
        let p = &self.params;
        let (repetition, penalty) = (
            p.repetition_penalty != 1.0,
            p.presence_penalty != 0.0 || p.frequency_penalty != 0.0,
        );
        if !(repetition || penalty) {
            return;
        }
        let a = adjustment_of(&mut self.adjustments, token);
        if repetition {
            a.repetition = p.repetition_penalty;
        }
        if penalty {
            a.penalty = p.presence_penalty + p.frequency_penalty * *n as f32;
        }
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        // Candidates with unnormalised probabilities exp((l - max) / T).
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &x)| (i as u32, ((x - max) / p.temperature).exp()))
            .filter(|&(_, w)| w > 0.0)
            .collect();
        if p.min_p > 0.0 {
            // The most likely token has weight 1 after subtracting the max.
            cand.retain(|&(_, w)| w >= p.min_p);
        }
        let by_prob = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_prob);
            cand.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            cand.sort_unstable_by(by_prob);
            let total: f32 = cand.iter().map(|c| c.1).sum();
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1 / total;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        } else {
            // A fixed order makes the draw independent of how candidates were filtered.
            cand.sort_unstable_by_key(|c| c.0);
        }
        let total: f32 = cand.iter().map(|c| c.1).sum();
        let mut u = self.rng.gen::<f32>() * total;
        for &(t, w) in &cand {
            if u < w {
                return t;
            }
            u -= w;
        }
        cand.last().map(|c| c.0).unwrap_or(0)
    }
}

/// One sequence's row of a step sampled on the device ([`Sampler::device_row`]).
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceRow<'a> {
    pub params: RowParams,
    /// Penalties and bias, in token order (the sampler's own, packed without a copy).
    pub adjust: &'a [Adjustment],
    /// The grammar's allowed tokens (bit `i % 32` of word `i / 32`), when one constrains
    /// the output.
    pub mask: Option<Vec<u32>>,
    /// Seconds the grammar took to compute the mask.
    pub constraint_s: f64,
}

/// Index of the largest logit; ties go to the lowest id.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

pub(crate) fn raw_logprobs(logits: &[f32], token: u32, top_n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let log_z = max + logits.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
    let lp = |t: u32| logits[t as usize] - log_z;
    let mut top = Vec::new();
    if top_n > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let n = top_n.min(idx.len());
        let cmp = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        idx.select_nth_unstable_by(n - 1, cmp);
        idx.truncate(n);
        idx.sort_unstable_by(cmp);
        top = idx.into_iter().map(|t| (t, lp(t))).collect();
    }
    (lp(token), top)
}

/// The tokens whose logit is at least `token`'s, itself included: its rank, as vLLM
/// counts it (a tie ranks behind the tokens it ties with, which bf16 logits make common).
pub(crate) fn rank_of(logits: &[f32], token: u32) -> usize {
    let own = logits[token as usize];
    logits.iter().filter(|&&x| x >= own).count()
}

/// `token`'s entry of `adjustments` (kept in token order), a new one that changes nothing
/// yet if it has none.
fn adjustment_of(adjustments: &mut Vec<Adjustment>, token: u32) -> &mut Adjustment {
    let i = match adjustments.binary_search_by_key(&token, |a| a.token) {
        Ok(i) => i,
        Err(i) => {
            adjustments.insert(i, no_change(token));
            i
        }
    };
    &mut adjustments[i]
}

/// A token's adjustment that changes nothing yet.
fn no_change(token: u32) -> Adjustment {
    Adjustment {
        token,
        repetition: 1.0,
        penalty: 0.0,
        bias: 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_tokens_holds_the_stop_tokens_back_then_restores_their_bias() {
        // Token 0 (an end of sequence) is the likeliest, token 2 a stop token the request
        // biased up; token 1 comes next.
        let logits = [3.0, 2.0, 1.0, -1.0];
        let params = SamplingParams {
            min_tokens: 3,
            logit_bias: vec![(2, 1.5)],
            logprobs: Some(0),
            ..SamplingParams::greedy()
        };
        let mut host = Sampler::new(params.clone(), &[], 0);
        host.hold_stops(&[0, 2, 0]);
        let drawn: Vec<u32> = (0..5)
            .map(|_| host.sample(&logits).unwrap().token)
            .collect();
        assert_eq!(drawn, [1, 1, 1, 0, 0]);
        // The device gets the same adjustments: −∞ for both until then, the bias after.
        let mut device = Sampler::new(params, &[], 0);
        device.hold_stops(&[0, 2]);
        for step in 0..4 {
            let adjust = device.device_row().unwrap().adjust.to_vec();
            let bias = |t: u32| adjust.iter().find(|a| a.token == t).map_or(0.0, |a| a.bias);
            if step < 3 {
                assert_eq!((bias(0), bias(2)), (f32::NEG_INFINITY, f32::NEG_INFINITY));
            } else {
                assert_eq!((bias(0), bias(2)), (0.0, 1.5), "step {step}");
            }
            let mut row = logits;
            reference::adjust_logits(&mut row, &adjust);
            device.accept_device(argmax(&row)).unwrap();
        }
        // Without min_tokens, nothing is held.
        let mut free = Sampler::new(SamplingParams::greedy(), &[], 0);
        free.hold_stops(&[0]);
        assert_eq!(free.sample(&logits).unwrap().token, 0);
    }

    #[test]
    fn logit_bias_moves_the_choice_but_not_the_reported_logprobs() {
        let logits = [2.0, 1.0, 0.5, -1.0];
        let mut plain = Sampler::new(
            SamplingParams {
                logprobs: Some(0),
                ..SamplingParams::greedy()
            },
            &[],
            0,
        );
        let want = plain.sample(&logits).unwrap();
        assert_eq!(want.token, 0);
        let mut biased = Sampler::new(
            SamplingParams {
                logprobs: Some(0),
                logit_bias: vec![(0, -100.0), (3, 2.5)],
                ..SamplingParams::greedy()
            },
            &[],
            0,
        );
        let got = biased.sample(&logits).unwrap();
        assert_eq!(
            got.token, 3,
            "-1 + 2.5 beats 1.0 once token 0 is pushed down"
        );
        let lp = got.logprob.unwrap();
        let expected = -1.0 - logits.iter().map(|x: &f32| x.exp()).sum::<f32>().ln();
        assert!(
            (lp - expected).abs() < 1e-5,
            "raw logprob {lp} vs {expected}"
        );
    }

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.5, 0.0, -1.0, 2.9, 0.5, 1.5]
    }

    fn draws(params: SamplingParams, n: usize) -> Vec<u32> {
        let mut s = Sampler::new(params, &[], 7);
        (0..n).map(|_| s.sample(&logits()).unwrap().token).collect()
    }

    #[test]
    fn greedy_is_argmax() {
        assert_eq!(draws(SamplingParams::greedy(), 3), vec![1, 1, 1]);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_seed_dependent() {
        let p = |seed| SamplingParams {
            seed: Some(seed),
            ..Default::default()
        };
        assert_eq!(draws(p(1), 50), draws(p(1), 50));
        assert_ne!(draws(p(1), 50), draws(p(2), 50));
        // Without a per-request seed the default seed decides.
        assert_eq!(
            draws(SamplingParams::default(), 50),
            draws(SamplingParams::default(), 50)
        );
    }

    #[test]
    fn top_k_restricts_support() {
        let d = draws(
            SamplingParams {
                top_k: 2,
                temperature: 5.0,
                ..Default::default()
            },
            300,
        );
        assert!(d.iter().all(|&t| t == 1 || t == 5), "{d:?}");
        assert!(d.contains(&1) && d.contains(&5));
    }

    #[test]
    fn top_p_restricts_support() {
        // Softmax of logits(): token 1 ≈ 0.33, 5 ≈ 0.30, 2 ≈ 0.20; p = 0.6 keeps {1, 5}.
        let d = draws(
            SamplingParams {
                top_p: 0.6,
                ..Default::default()
            },
            300,
        );
        assert!(d.iter().all(|&t| t == 1 || t == 5), "{d:?}");
        assert!(d.contains(&1) && d.contains(&5));
    }

    #[test]
    fn min_p_restricts_support() {
        // exp(2.5 - 3) ≈ 0.61 ≥ 0.5, exp(1.5 - 3) ≈ 0.22 < 0.5.
        let d = draws(
            SamplingParams {
                min_p: 0.5,
                ..Default::default()
            },
            300,
        );
        assert!(d.iter().all(|&t| [1, 2, 5].contains(&t)), "{d:?}");
        assert!(d.contains(&2));
    }

    #[test]
    fn penalties_steer_away_from_repeats() {
        // Token 1 leads by 0.1; a repetition penalty on it (from the prompt) flips greedy to 5.
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 1.2,
                ..SamplingParams::greedy()
            },
            &[1],
            0,
        );
        assert_eq!(s.sample(&logits()).unwrap().token, 5);
        // Presence penalty: after emitting 1, it loses 0.2 and 5 wins; then 5 is penalised too.
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: 0.2,
                ..SamplingParams::greedy()
            },
            &[],
            0,
        );
        assert_eq!(s.sample(&logits()).unwrap().token, 1);
        assert_eq!(s.sample(&logits()).unwrap().token, 5);
        assert_eq!(s.sample(&logits()).unwrap().token, 1);
        // Frequency penalty grows with each occurrence.
        let mut s = Sampler::new(
            SamplingParams {
                frequency_penalty: 0.45,
                ..SamplingParams::greedy()
            },
            &[],
            0,
        );
        let tokens: Vec<u32> = (0..4).map(|_| s.sample(&logits()).unwrap().token).collect();
        assert_eq!(tokens, vec![1, 5, 1, 2]);
    }

    /// The adjustments kept token by token are those built afresh from the prompt and the
    /// output so far (as they were each step before), with every penalty and a bias.
    #[test]
    fn adjustments_kept_token_by_token_are_those_built_afresh() {
        let params = SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.2,
            frequency_penalty: 0.1,
            logit_bias: vec![(3, -2.0), (39, 1.5), (3, 0.5)],
            temperature: 0.8,
            seed: Some(7),
            ..SamplingParams::greedy()
        };
        let prompt = [5, 9, 5, 30];
        let afresh = |output: &[u32]| -> Vec<Adjustment> {
            let mut m: BTreeMap<u32, Adjustment> = BTreeMap::new();
            for &t in prompt.iter().chain(output) {
                m.entry(t).or_insert_with(|| no_change(t)).repetition = 1.3;
            }
            for &t in output {
                let n = output.iter().filter(|&&o| o == t).count() as f32;
                m.entry(t).or_insert_with(|| no_change(t)).penalty = 0.2 + 0.1 * n;
            }
            for &(t, b) in &params.logit_bias {
                m.entry(t).or_insert_with(|| no_change(t)).bias += b;
            }
            m.into_values().collect()
        };
        let mut s = Sampler::new(params.clone(), &prompt, 0);
        let mut output = Vec::new();
        assert_eq!(s.adjustments, afresh(&output));
        for step in 0..30 {
            output.push(s.sample(&step_logits(step)).unwrap().token);
            assert_eq!(s.adjustments, afresh(&output), "step {step}");
        }
    }

    /// Logits that change with the step, so penalties and bias keep changing the choice.
    fn step_logits(step: usize) -> Vec<f32> {
        (0..40)
            .map(|i| ((i * 7 + step * 3) % 11) as f32 * 0.37 - ((i * i) % 5) as f32 * 0.21)
            .collect()
    }

    /// The device path (pack a row, sample it with the kernels' reference, record the token)
    /// makes the host sampler's greedy choices and logprobs, step after step, with every
    /// penalty and bias changing them.
    #[test]
    fn device_rows_choose_as_the_host_sampler_does() {
        let params = SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.2,
            frequency_penalty: 0.15,
            logit_bias: vec![(3, 1.5), (39, -0.5), (1000, 2.0)],
            logprobs: Some(4),
            ..SamplingParams::greedy()
        };
        let prompt = [1, 5, 5, 9];
        let mut host = Sampler::new(params.clone(), &prompt, 3);
        let mut device = Sampler::new(params, &prompt, 3);
        let mut tokens = Vec::new();
        for step in 0..30 {
            let logits = step_logits(step);
            let want = host.sample(&logits).unwrap();
            let row = device.device_row().unwrap();
            assert_eq!(row.mask, None);
            let mut batch = infer_kernels::sampling::SamplingBatch::new();
            batch.push(&row.params, row.adjust).unwrap();
            let got = reference::sample_rows(&mut logits.clone(), logits.len(), &batch);
            assert_eq!(got.tokens[0] as u32, want.token, "step {step}");
            assert_eq!(Some(got.logprobs[0]), want.logprob, "step {step}");
            assert_eq!(got.top(0), want.top_logprobs, "step {step}");
            assert_eq!(device.accept_device(want.token).unwrap(), 0.0);
            tokens.push(want.token);
        }
        // The penalties did their work: the choice moved around.
        tokens.sort_unstable();
        tokens.dedup();
        assert!(tokens.len() >= 4, "{tokens:?}");
    }

    /// vLLM's `bad_words`: a one-token word is never sampled, and a word's last token is
    /// not right after its other tokens, on the host and the device alike; a ban gives back
    /// the bias it took, here a `logit_bias`, beneath a stop token's hold for `min_tokens`.
    #[test]
    fn bad_words_ban_their_last_token_after_the_others() {
        let favour = |t: usize| {
            let mut l = vec![0.0f32; 40];
            l[t] = 10.0;
            l
        };
        let params = SamplingParams {
            bad_words: vec![vec![5], vec![7, 9]],
            logit_bias: vec![(9, 2.0)],
            min_tokens: 3,
            ..SamplingParams::greedy()
        };
        let mut host = Sampler::new(params.clone(), &[], 0);
        let mut device = Sampler::new(params, &[], 0);
        for s in [&mut host, &mut device] {
            s.hold_stops(&[9]); // 9 is a stop token too: held for 3 tokens
        }
        let bias = |s: &Sampler, t: u32| {
            (s.adjustments.iter())
                .find(|a| a.token == t)
                .map_or(0.0, |a| a.bias)
        };
        // (favoured token, sampled, 9's bias after)
        for (step, (favoured, sampled, bias_of_9)) in [
            (5, 0, f32::NEG_INFINITY), // a one-token word: never; 9 still held
            (7, 7, f32::NEG_INFINITY), // 9 banned after 7, and held
            (9, 0, 2.0),               // 9 not sampled; after 3 tokens neither held nor banned
            (7, 7, f32::NEG_INFINITY), // banned again after 7
            (5, 0, 2.0),
            (9, 9, 2.0), // with 0 before it, 9 is sampled
        ]
        .into_iter()
        .enumerate()
        {
            let logits = favour(favoured);
            let want = host.sample(&logits).unwrap();
            assert_eq!(want.token, sampled, "step {step}");
            let row = device.device_row().unwrap();
            let mut batch = infer_kernels::sampling::SamplingBatch::new();
            batch
                .push_masked(&row.params, row.adjust, row.mask.as_deref())
                .unwrap();
            let got = reference::sample_rows(&mut logits.clone(), logits.len(), &batch);
            assert_eq!(got.tokens[0] as u32, sampled, "device, step {step}");
            device.accept_device(sampled).unwrap();
            for s in [&host, &device] {
                assert_eq!(bias(s, 9), bias_of_9, "step {step}");
                assert_eq!(bias(s, 5), f32::NEG_INFINITY, "step {step}");
            }
        }
        // Bad words alone, no other adjustment: the ban still takes the adjusted path.
        let mut alone = Sampler::new(
            SamplingParams {
                bad_words: vec![vec![5]],
                ..SamplingParams::greedy()
            },
            &[],
            0,
        );
        assert_eq!(alone.sample(&favour(5)).unwrap().token, 0);
    }

    /// `allowed_token_ids`: only those tokens are sampled, on the host and the device
    /// alike (the device's mask is the grammar's form), while logprobs stay the model's.
    #[test]
    fn allowed_token_ids_are_the_only_choices_on_the_host_and_the_device() {
        let allowed = vec![3, 17, 33];
        let params = SamplingParams {
            allowed_token_ids: Some(allowed.clone()),
            logprobs: Some(2),
            ..SamplingParams::greedy()
        };
        let mut host = Sampler::new(params.clone(), &[], 3);
        let mut device = Sampler::new(params, &[], 3);
        let mut seen = Vec::new();
        for step in 0..30 {
            let logits = step_logits(step);
            let want = host.sample(&logits).unwrap();
            // The likeliest allowed token, its logprob under the whole distribution.
            let best = *(allowed.iter())
                .max_by(|&&a, &&b| logits[a as usize].total_cmp(&logits[b as usize]))
                .unwrap();
            assert_eq!(want.token, best, "step {step}");
            let norm = logits.iter().map(|x| x.exp()).sum::<f32>().ln();
            assert!((want.logprob.unwrap() - (logits[best as usize] - norm)).abs() < 1e-5);
            let row = device.device_row().unwrap();
            assert_eq!(row.mask.as_deref(), Some(&[1 << 3 | 1 << 17, 1 << 1][..]));
            let mut batch = infer_kernels::sampling::SamplingBatch::new();
            batch
                .push_masked(&row.params, row.adjust, row.mask.as_deref())
                .unwrap();
            let got = reference::sample_rows(&mut logits.clone(), logits.len(), &batch);
            assert_eq!(got.tokens[0] as u32, want.token, "step {step}");
            device.accept_device(want.token).unwrap();
            seen.push(want.token);
        }
        seen.sort_unstable();
        seen.dedup();
        assert!(seen.len() >= 2, "the choice moved: {seen:?}");
        // Drawn at a temperature, too: never another token.
        let mut drawn = Sampler::new(
            SamplingParams {
                allowed_token_ids: Some(allowed.clone()),
                temperature: 1.5,
                seed: Some(5),
                ..Default::default()
            },
            &[],
            0,
        );
        for step in 0..200 {
            let t = drawn.sample(&step_logits(step)).unwrap().token;
            assert!(allowed.contains(&t), "{t}");
        }
    }

    #[test]
    fn device_rows_draw_the_requests_own_uniforms() {
        let seeded = SamplingParams {
            seed: Some(42),
            ..Default::default()
        };
        let mut a = Sampler::new(seeded.clone(), &[], 0);
        let mut b = Sampler::new(seeded, &[], 9);
        let mut rng = ChaCha8Rng::seed_from_u64(42);
        for _ in 0..5 {
            let want = rng.gen::<f32>();
            assert_eq!(a.device_row().unwrap().params.uniform, want);
            assert_eq!(b.device_row().unwrap().params.uniform, want);
        }
        // Greedy rows draw nothing: the generator stays where it was.
        let mut g = Sampler::new(SamplingParams::greedy(), &[], 0);
        assert_eq!(g.device_row().unwrap().params.uniform, 0.0);
        assert_eq!(
            g.rng.gen::<f32>(),
            ChaCha8Rng::seed_from_u64(0).gen::<f32>()
        );
    }

    #[test]
    fn logprobs_only_when_asked() {
        let out = Sampler::new(SamplingParams::greedy(), &[], 0)
            .sample(&logits())
            .unwrap();
        assert_eq!((out.logprob, out.top_logprobs.len()), (None, 0));
    }

    #[test]
    fn logprobs_are_raw_and_sorted() {
        let mut s = Sampler::new(
            SamplingParams {
                logprobs: Some(3),
                ..SamplingParams::greedy()
            },
            &[],
            0,
        );
        let out = s.sample(&logits()).unwrap();
        let l = logits();
        let z: f32 = l.iter().map(|x| x.exp()).sum::<f32>().ln();
        assert!((out.logprob.unwrap() - (3.0 - z)).abs() < 1e-5);
        let ids: Vec<u32> = out.top_logprobs.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1, 5, 2]);
        assert!((out.top_logprobs[2].1 - (2.5 - z)).abs() < 1e-5);
    }
}
