//! The profiled cost model: step time fitted to measured steps.
//!
//! `engine profile` writes a JSON file of measured steps; this is its format:
//!
//! ```json
//! {
//!   "model": "llama-3.2-3b",
//!   "device": "rtx-5080",
//!   "points": [
//!     { "prefill_tokens": 512, "decode_seqs": 0, "context_tokens": 512, "step_s": 0.061 },
//!     { "prefill_tokens": 0, "decode_seqs": 16, "context_tokens": 6144, "step_s": 0.019,
//!       "decode_context_tokens": 6144, "attention_pairs": 6144 }
//!   ],
//!   "client": { "request_s": 0.003, "per_prompt_token_s": 1e-6, "stream_s": 0.001 }
//! }
//! ```
//!
//! Field meanings are those of [`StepShape`]: `prefill_tokens` = new prompt tokens in the
//! step, `decode_seqs` = sequences decoding one token, `context_tokens` = Σ context length
//! after the step over scheduled sequences, `decode_context_tokens` = the part of it that
//! belongs to decodes, `decode_shared_context_tokens` = the part of that the decodes share
//! through the prefix cache (default 0), `attention_pairs` = Σ query × key pairs, `step_s`
//! = measured seconds.
//! `chunk_self_pairs` = Σ chunk length² over prompt chunks. The last three are optional;
//! when absent they are taken as for one fresh prompt (`context_tokens − prefill_tokens`,
//! `p × (p + 1) / 2` plus one pair per decode context token, and `p²`). `client` is
//! optional (the client path outside the GPU), and so are `step_spread` (how served steps
//! spread around the fitted time: [`StepSpread`]), `after_prefill` (what the decode steps
//! just after a prefill cost beyond it: [`AfterPrefill`]) and `after_idle` (what the first
//! step after an idle spell costs: [`AfterIdle`]), which `engine profile` measures.
//!
//! The model mirrors what a step does:
//!
//! ```text
//! step_s ≈ dense(new_tokens) + a × own decode context + a' × shared decode context
//!          + b × cross_pairs + c × chunk_self_pairs + r × prefill context
//! ```
//!
//! * `dense` — everything that scales with the rows of the step's activations (weights
//!   streamed, matmuls, norms, sampling, fixed overhead) — is a piecewise-linear function of
//!   the new tokens (prefill tokens + decodes) with knots at powers of two, because it is
//!   not linear at small batches: a GPU is weight-bandwidth bound until the matmuls fill
//!   it, and a CPU's first extra row can cost a thread hand-off. Beyond the last knot it
//!   extrapolates the last segment.
//! * `a` — decode attention reads each context token's K and V once (memory bound);
//!   `a'` — a block that several decodes share through the prefix cache is read again
//!   from cache, cheaper (fitted from profiled steps with a shared prefix; taken as `a`
//!   when the profile has none);
//! * `b`, `c` — prefill attention computes query × key pairs (compute bound): `cross_pairs`
//!   of a chunk's queries with the context before it (n × start), and `chunk_self_pairs`
//!   of the chunk with itself (n²). An attention that skips the masked half (flash
//!   attention) fits `c ≈ b / 2`; one that computes the whole square and masks it (a
//!   batched matmul, like the CPU engine's) fits `c ≈ b`. One pair count cannot be both.
//! * `r` — a prompt chunk also reads its whole earlier context once, whatever its length
//!   (the CPU engine gathers its K and V out of the paged blocks; a tiled kernel streams
//!   it once per tile of queries): per token computed before the chunk. It is what a short
//!   suffix after a long cached prefix pays beyond its pairs. With chunks of one length
//!   only it cannot be told apart from `b` (both grow with the start), so it is fitted
//!   only when the profile has chunks of two lengths after earlier context, and is 0
//!   (its cost inside `b`) otherwise.
//!
//! All weights are fitted at once by non-negative least squares on *relative* error (a
//! 1 ms decode weighs as much as a 1 s prefill; no term may save time).

use super::least_squares::nnls;
use crate::error::SimError;
use crate::settings::{readable, MAX_COST_S};
use serde::{Deserialize, Serialize};

use super::{AfterIdle, AfterPrefill, ClientPath, CostModel, StepShape, StepSpread};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfilePoint {
    pub prefill_tokens: usize,
    pub decode_seqs: usize,
    pub context_tokens: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_context_tokens: Option<usize>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub decode_shared_context_tokens: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_pairs: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_self_pairs: Option<f64>,
    pub step_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileClient {
    pub request_s: f64,
    #[serde(default)]
    pub per_prompt_token_s: f64,
    pub stream_s: f64,
    /// See [`ClientPath::overlap_step_loss`]; 0 in profiles from before it was measured.
    #[serde(default)]
    pub overlap_step_loss: f64,
}

impl ProfileClient {
    /// Why it cannot be used, if it cannot (a hand-edited or damaged profile).
    pub fn check(&self) -> Result<(), String> {
        // A negative cost would make a request seen before it was sent (negative TTFTs).
        for (key, x) in [
            ("request_s", self.request_s),
            ("per_prompt_token_s", self.per_prompt_token_s),
            ("stream_s", self.stream_s),
        ] {
            if !(0.0..=MAX_COST_S).contains(&x) {
                return Err(format!(
                    "client.{key} must be between 0 and {MAX_COST_S} seconds, got {}",
                    readable(x)
                ));
            }
        }
        if !(0.0..1.0).contains(&self.overlap_step_loss) {
            return Err(format!(
                "client.overlap_step_loss must be at least 0 and below 1, got {}",
                self.overlap_step_loss
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub model: String,
    pub device: String,
    pub points: Vec<ProfilePoint>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<ProfileClient>,
    /// The host cost of structured output, when profiled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structured_output: Option<ProfileStructuredOutput>,
    /// How served steps spread around their typical time, when profiled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_spread: Option<StepSpread>,
    /// What the decode steps just after a prefill cost beyond their typical time, when
    /// profiled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_prefill: Option<AfterPrefill>,
    /// What the first step after an idle spell costs, when profiled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_idle: Option<AfterIdle>,
}

/// What one constrained token costs the engine thread beyond an unconstrained one: the
/// grammar's mask (llguidance), applying it to the logits, and advancing the grammar.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileStructuredOutput {
    /// Mean seconds per constrained token.
    pub token_s: f64,
    /// Tokens it was measured over.
    pub tokens: u64,
    /// The grammar measured (a name; the engine documents it).
    pub grammar: String,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl ProfilePoint {
    fn new_tokens(&self) -> usize {
        self.prefill_tokens + self.decode_seqs
    }

    fn decode_context(&self) -> usize {
        match self.decode_context_tokens {
            Some(c) => c,
            None if self.decode_seqs == 0 => 0,
            None => self.context_tokens.saturating_sub(self.prefill_tokens),
        }
    }

    fn prefill_pairs(&self) -> f64 {
        let pairs = self.attention_pairs.unwrap_or_else(|| {
            let p = self.prefill_tokens as f64;
            p * (p + 1.0) / 2.0 + self.decode_context() as f64
        });
        (pairs - self.decode_context() as f64).max(0.0)
    }

    /// (own, shared) decode context tokens.
    fn decode_context_split(&self) -> (f64, f64) {
        let total = self.decode_context();
        let shared = self.decode_shared_context_tokens.min(total);
        ((total - shared) as f64, shared as f64)
    }

    fn self_pairs(&self) -> f64 {
        self.chunk_self_pairs
            .unwrap_or((self.prefill_tokens * self.prefill_tokens) as f64)
    }

    /// Context tokens computed before the step's prompt chunks (Σ chunk starts).
    fn prefill_context(&self) -> f64 {
        prefill_context(
            self.context_tokens,
            self.decode_context(),
            self.prefill_tokens,
        )
    }
}

/// A step of one sampled token per sequence as the engine runs it: a decode step, its
/// prompts' last one-token chunks decoding over their context.
fn as_decode(s: &StepShape) -> StepShape {
    StepShape {
        decode_seqs: s.num_seqs,
        decode_context_tokens: s.context_tokens,
        max_decode_context: s.max_decode_context.max(s.max_prefill_context),
        prefill_tokens: 0,
        prefill_seqs: 0,
        max_prefill_chunk: 0,
        max_prefill_context: 0,
        chunk_self_pairs: 0.0,
        ..*s
    }
}

/// Σ over a step's prompt chunks of the tokens computed before each: its context less the
/// decodes' and less the chunks themselves.
fn prefill_context(context_tokens: usize, decode_context: usize, prefill_tokens: usize) -> f64 {
    context_tokens.saturating_sub(decode_context + prefill_tokens) as f64
}

/// Whether the points tell the prefill-context term apart from the cross pairs: chunks of
/// two lengths after earlier context (cross pairs over context tokens is the mean chunk
/// length; with one length the two columns are proportional).
fn prefill_context_determined(points: &[ProfilePoint]) -> bool {
    let lengths: Vec<f64> = points
        .iter()
        .filter(|p| p.prefill_context() > 0.0)
        .map(|p| p.attention().0 / p.prefill_context())
        .collect();
    lengths
        .iter()
        .any(|&l| (l - lengths[0]).abs() > 1e-6 * lengths[0].max(1.0))
}

/// Prefill attention pairs split into (cross, self): `prefill_pairs` counts causal pairs,
/// Σ n × start + n × (n + 1) / 2, so cross = prefill_pairs − (Σ n² + Σ n) / 2.
fn split_pairs(prefill_pairs: f64, self_pairs: f64, prefill_tokens: usize) -> (f64, f64) {
    let cross = (prefill_pairs - (self_pairs + prefill_tokens as f64) / 2.0).max(0.0);
    (cross, self_pairs)
}

impl ProfilePoint {
    fn attention(&self) -> (f64, f64) {
        split_pairs(self.prefill_pairs(), self.self_pairs(), self.prefill_tokens)
    }
}

/// The hat basis of the dense term: value of each knot's function at `n` new tokens.
/// Below the first knot the first function is 1; beyond the last the last segment
/// continues (its two functions take values 1 − t and t with t > 1).
fn hats(knots: &[f64], n: f64, out: &mut [f64]) {
    out.fill(0.0);
    let k = knots.len();
    if k == 1 || n <= knots[0] {
        out[0] = 1.0;
        return;
    }
    let seg = knots.windows(2).position(|w| n <= w[1]).unwrap_or(k - 2);
    let t = (n - knots[seg]) / (knots[seg + 1] - knots[seg]);
    out[seg] = 1.0 - t;
    out[seg + 1] = t;
}

/// Powers of two from 1 up to the first at or above the largest step, keeping only those
/// whose hat function some measured step touches (an untouched one would be unfitted).
fn choose_knots(new_tokens: &[usize]) -> Vec<f64> {
    let max = new_tokens.iter().copied().max().unwrap_or(1).max(1);
    let candidates: Vec<usize> = (0..)
        .map(|i| 1usize << i)
        .take_while(|&c| c < max * 2)
        .collect();
    let mut knots = Vec::new();
    for (i, &c) in candidates.iter().enumerate() {
        let lo = if i == 0 { 0 } else { candidates[i - 1] };
        let hi = candidates.get(i + 1).copied().unwrap_or(usize::MAX);
        if new_tokens.iter().any(|&n| n > lo && n < hi) {
            knots.push(c as f64);
        }
    }
    knots
}

#[derive(Debug, Clone)]
pub struct Profiled {
    name: String,
    /// New-token counts of the dense term's knots.
    knots: Vec<f64>,
    /// Dense step time at each knot (s).
    dense: Vec<f64>,
    /// Seconds per decode context token of a sequence's own.
    per_decode_context: f64,
    /// Seconds per decode context token shared through the prefix cache.
    per_shared_context: f64,
    /// Seconds per prefill pair with the context before the chunk.
    per_cross_pair: f64,
    /// Seconds per pair of a chunk with itself.
    per_self_pair: f64,
    /// Seconds per token of context before a prompt chunk (read once per chunk); 0 when
    /// the profile cannot tell it apart from `per_cross_pair`.
    per_prefill_context: f64,
    client: ClientPath,
    /// Seconds each constrained sampled sequence adds to a step (structured output).
    constrained_token_s: Option<f64>,
    /// Mean random pause per step (`[sim] step_jitter_s`; a profile's steps are its
    /// measurements' typical times, so none by default).
    pub step_jitter_s: f64,
    /// How served steps spread around the fitted typical time (the profile's).
    pub step_spread: Option<StepSpread>,
    /// What the decode steps just after a prefill cost (the profile's).
    pub after_prefill: Option<AfterPrefill>,
    /// What the first step after an idle spell costs (the profile's).
    pub after_idle: Option<AfterIdle>,
    /// Root-mean-square relative error of the fit over the profile's points.
    pub rms_rel_error: f64,
    /// The largest steps the profile measured.
    pub coverage: ProfileCoverage,
}

/// The largest step the profile measured in each dimension a scenario can outgrow: a step
/// beyond them is priced by extrapolation. A calibration file keeps the same of the runs it
/// was fitted to or checked on (`[reach]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileCoverage {
    /// New tokens of one step (prompt tokens + decodes).
    pub new_tokens: usize,
    /// Decodes in one step.
    pub decode_seqs: usize,
    /// The context of one sequence: a decode's (a step's context over its decodes), or a
    /// prompt chunk's with what came before it.
    pub sequence_context: usize,
}

impl ProfileCoverage {
    /// The larger of the two in each dimension.
    pub fn max(self, o: ProfileCoverage) -> ProfileCoverage {
        ProfileCoverage {
            new_tokens: self.new_tokens.max(o.new_tokens),
            decode_seqs: self.decode_seqs.max(o.decode_seqs),
            sequence_context: self.sequence_context.max(o.sequence_context),
        }
    }

    fn of(points: &[ProfilePoint]) -> ProfileCoverage {
        let mut c = ProfileCoverage::default();
        for p in points {
            c.new_tokens = c.new_tokens.max(p.new_tokens());
            c.decode_seqs = c.decode_seqs.max(p.decode_seqs);
            let per_sequence = match p.decode_seqs {
                0 => p.context_tokens,
                d => p.decode_context() / d,
            };
            c.sequence_context = c.sequence_context.max(per_sequence);
        }
        c
    }
}

impl Profiled {
    /// Fit `profile`; `client` is used when the profile has none.
    pub fn fit(profile: &Profile, client: ClientPath) -> Result<Profiled, SimError> {
        let pts = &profile.points;
        if pts.is_empty() {
            return Err(SimError::Invalid(
                "the profile has no points (`points` is empty): nothing to fit".into(),
            ));
        }
        if let Some((i, p)) = pts
            .iter()
            .enumerate()
            .find(|(_, p)| !(p.step_s > 0.0 && p.step_s.is_finite()))
        {
            return Err(SimError::Invalid(format!(
                "points[{i}].step_s must be positive, found {}",
                p.step_s
            )));
        }
        // Pair counts are counts: a negative or non-finite one would price attention at a
        // negative or undefined time.
        for (i, p) in pts.iter().enumerate() {
            for (key, x) in [
                ("attention_pairs", p.attention_pairs),
                ("chunk_self_pairs", p.chunk_self_pairs),
            ] {
                if let Some(x) = x.filter(|x| !(*x >= 0.0 && x.is_finite())) {
                    return Err(SimError::Invalid(format!(
                        "points[{i}].{key} must be finite and not negative, found {}",
                        readable(x)
                    )));
                }
            }
            // A finite count can still be impossible (1e308), and the fit would then price
            // every real pair at nothing. A query attends to at most its sequence's
            // context, so a step's pairs are at most its new tokens × its context; the
            // new tokens are added once more to the context in case a profiler counted it
            // before the step. A chunk's square is at most the step's prompt tokens².
            let (new, prefill) = (p.new_tokens() as f64, p.prefill_tokens as f64);
            for (key, x, most, what) in [
                (
                    "attention_pairs",
                    p.attention_pairs,
                    new * (p.context_tokens as f64 + new),
                    "new tokens (prefill_tokens + decode_seqs) × (context_tokens + new tokens)",
                ),
                (
                    "chunk_self_pairs",
                    p.chunk_self_pairs,
                    prefill * prefill,
                    "prefill_tokens²",
                ),
            ] {
                if let Some(x) = x.filter(|&x| x > most && new > 0.0) {
                    return Err(SimError::Invalid(format!(
                        "points[{i}].{key} is {}, more than the step's tokens allow: at most \
                         {what} = {}",
                        readable(x),
                        readable(most)
                    )));
                }
            }
        }
        if let Some(spread) = &profile.step_spread {
            spread.check().map_err(SimError::Invalid)?;
        }
        if let Some(client) = &profile.client {
            client.check().map_err(SimError::Invalid)?;
        }
        if let Some(after_prefill) = &profile.after_prefill {
            after_prefill.check().map_err(SimError::Invalid)?;
        }
        if let Some(after_idle) = &profile.after_idle {
            after_idle.check().map_err(SimError::Invalid)?;
        }
        if let Some(p) = pts.iter().find(|p| p.new_tokens() == 0) {
            return Err(SimError::Invalid(format!(
                "a point with no new tokens (prefill_tokens 0, decode_seqs 0, step_s {})",
                p.step_s
            )));
        }
        let knots = choose_knots(&pts.iter().map(ProfilePoint::new_tokens).collect::<Vec<_>>());
        let k = knots.len();
        let features = k + 5;
        let fit_prefill_context = prefill_context_determined(pts);
        let row = |p: &ProfilePoint| {
            let mut x = vec![0.0; features];
            hats(&knots, p.new_tokens() as f64, &mut x[..k]);
            (x[k], x[k + 1]) = p.decode_context_split();
            (x[k + 2], x[k + 3]) = p.attention();
            if fit_prefill_context {
                x[k + 4] = p.prefill_context();
            }
            x
        };
        let rows: Vec<Vec<f64>> = pts.iter().map(row).collect();
        // A term no point exercises is no unknown: it is fitted at 0 (and the shared
        // context priced as own context, below).
        let unknowns = (0..features)
            .filter(|&j| rows.iter().any(|r| r[j] != 0.0))
            .count();
        if pts.len() < unknowns {
            return Err(SimError::Invalid(format!(
                "a profile needs at least {unknowns} points to fit the {unknowns} terms its \
                 shapes exercise ({k} dense knots, decode context, prefill attention), it has {}",
                pts.len()
            )));
        }
        // Relative error: each row divided by its step time, target 1. Columns scaled to
        // max |value| = 1 so that the normal equations are well conditioned.
        let mut scale = vec![0.0f64; features];
        for (r, p) in rows.iter().zip(pts) {
            for j in 0..features {
                scale[j] = scale[j].max((r[j] / p.step_s).abs());
            }
        }
        for s in scale.iter_mut().filter(|s| **s == 0.0) {
            *s = 1.0; // an unexercised feature: its weight ends up 0
        }
        let a: Vec<Vec<f64>> = rows
            .iter()
            .zip(pts)
            .map(|(r, p)| (0..features).map(|j| r[j] / p.step_s / scale[j]).collect())
            .collect();
        let w = nnls(&a, &vec![1.0; pts.len()]).ok_or_else(|| {
            SimError::Invalid("the profile's points do not determine a fit (singular)".into())
        })?;
        let coef: Vec<f64> = (0..features).map(|j| w[j] / scale[j]).collect();
        let client = profile.client.map_or(client, |c| ClientPath {
            request_s: c.request_s,
            per_prompt_token_s: c.per_prompt_token_s,
            stream_s: c.stream_s,
            overlap_step_loss: c.overlap_step_loss,
        });
        let mut fit = Profiled {
            name: format!("{} on {}", profile.model, profile.device),
            knots,
            dense: coef[..k].to_vec(),
            per_decode_context: coef[k],
            // No shared-prefix steps profiled: shared context costs what own context does.
            per_shared_context: if pts.iter().any(|p| p.decode_shared_context_tokens > 0) {
                coef[k + 1]
            } else {
                coef[k]
            },
            per_cross_pair: coef[k + 2],
            per_self_pair: coef[k + 3],
            per_prefill_context: coef[k + 4],
            client,
            constrained_token_s: profile.structured_output.as_ref().map(|s| s.token_s),
            step_jitter_s: 0.0,
            step_spread: profile.step_spread.clone(),
            after_prefill: profile.after_prefill.clone(),
            after_idle: profile.after_idle,
            rms_rel_error: 0.0,
            coverage: ProfileCoverage::of(pts),
        };
        let sq: f64 = pts
            .iter()
            .map(|p| ((fit.predict_point(p) - p.step_s) / p.step_s).powi(2))
            .sum();
        fit.rms_rel_error = (sq / pts.len() as f64).sqrt();
        Ok(fit)
    }

    pub fn from_json(text: &str, client: ClientPath) -> Result<Profiled, SimError> {
        let profile: Profile = serde_json::from_str(text)
            .map_err(|e| SimError::Invalid(format!("invalid profile JSON: {e}")))?;
        Profiled::fit(&profile, client)
    }

    /// Price the request path with `client` instead of the profile's (`[sim]`'s client
    /// costs override the measured ones, as they override a calibration's).
    pub fn set_client(&mut self, client: ClientPath) {
        self.client = client;
    }

    /// The dense term at `n` new tokens.
    pub fn dense_time(&self, n: usize) -> f64 {
        self.dense_at(n as f64)
    }

    /// The dense term of a step of `n` new tokens run as `passes` forward passes (0 or 1:
    /// one), each paying it for its share.
    fn step_dense_time(&self, n: usize, passes: usize) -> f64 {
        let passes = passes.max(1) as f64;
        passes * self.dense_at(n as f64 / passes)
    }

    fn dense_at(&self, n: f64) -> f64 {
        let k = self.knots.len();
        if k > 1 && n > self.knots[k - 1] {
            // Extrapolate the last segment, never downwards.
            let slope =
                (self.dense[k - 1] - self.dense[k - 2]) / (self.knots[k - 1] - self.knots[k - 2]);
            return self.dense[k - 1] + slope.max(0.0) * (n - self.knots[k - 1]);
        }
        let mut h = vec![0.0; k];
        hats(&self.knots, n, &mut h);
        h.iter().zip(&self.dense).map(|(a, b)| a * b).sum()
    }

    /// The fitted step time of a profiled shape.
    pub fn predict_point(&self, p: &ProfilePoint) -> f64 {
        self.predict(
            p.new_tokens(),
            p.decode_context_split(),
            p.attention(),
            p.prefill_context(),
        )
    }

    fn predict(
        &self,
        new_tokens: usize,
        (own_ctx, shared_ctx): (f64, f64),
        (cross, within): (f64, f64),
        prefill_ctx: f64,
    ) -> f64 {
        self.dense_time(new_tokens)
            + self.attention_time((own_ctx, shared_ctx), (cross, within), prefill_ctx)
    }

    /// The terms of a step beyond its dense one: attention's reads and pairs.
    fn attention_time(
        &self,
        (own_ctx, shared_ctx): (f64, f64),
        (cross, within): (f64, f64),
        prefill_ctx: f64,
    ) -> f64 {
        self.per_decode_context * own_ctx
            + self.per_shared_context * shared_ctx
            + self.per_cross_pair * cross
            + self.per_self_pair * within
            + self.per_prefill_context * prefill_ctx
    }
}

impl CostModel for Profiled {
    fn step_time(&self, s: &StepShape) -> f64 {
        let decode;
        let s = if s.one_token_each() && s.prefill_seqs > 0 {
            decode = as_decode(s);
            &decode
        } else {
            s
        };
        let prefill_pairs = (s.attention_pairs - s.decode_context_tokens as f64).max(0.0);
        let pairs = split_pairs(prefill_pairs, s.chunk_self_pairs, s.prefill_tokens);
        let shared = s.decode_shared_context_tokens.min(s.decode_context_tokens);
        let ctx = ((s.decode_context_tokens - shared) as f64, shared as f64);
        let prefill_ctx =
            prefill_context(s.context_tokens, s.decode_context_tokens, s.prefill_tokens);
        self.step_dense_time(s.new_tokens(), s.forward_passes)
            + self.attention_time(ctx, pairs, prefill_ctx)
            + s.constrained_seqs as f64 * self.constrained_token_s.unwrap_or(0.0)
    }

    fn constrained_token_s(&self) -> Option<f64> {
        self.constrained_token_s
    }

    fn step_jitter(&self) -> f64 {
        self.step_jitter_s
    }

    fn step_spread(&self) -> Option<&StepSpread> {
        self.step_spread.as_ref()
    }

    fn after_prefill(&self) -> Option<&AfterPrefill> {
        self.after_prefill.as_ref()
    }

    fn after_idle(&self) -> Option<AfterIdle> {
        self.after_idle
    }

    fn client_path(&self) -> ClientPath {
        self.client
    }

    fn describe(&self) -> String {
        let dense: Vec<String> = self
            .knots
            .iter()
            .zip(&self.dense)
            .map(|(n, t)| format!("{n}:{:.3}", t * 1e3))
            .collect();
        format!(
            "profiled ({}): step = dense(new tokens) [ms at {}] + {:.3e} ms/decode ctx tok \
             ({:.3e} shared) + {:.3e} ms/prefill pair with earlier context + {:.3e} ms/pair \
             within a chunk + {:.3e} ms/context tok before a chunk (fit rms error {:.1}%){}",
            self.name,
            dense.join(" "),
            self.per_decode_context * 1e3,
            self.per_shared_context * 1e3,
            self.per_cross_pair * 1e3,
            self.per_self_pair * 1e3,
            self.per_prefill_context * 1e3,
            self.rms_rel_error * 100.0,
            self.step_spread
                .as_ref()
                .map_or(String::new(), |s| format!("; {}", s.describe()))
                + &self
                    .after_prefill
                    .as_ref()
                    .map_or(String::new(), |a| format!("; {}", a.describe()))
                + &self
                    .after_idle
                    .map_or(String::new(), |a| format!("; {}", a.describe()))
        )
    }

    fn summary(&self) -> String {
        let n = self.knots.len() - 1;
        format!(
            "profiled: dense(new tokens) {:.3} ms at {} to {:.3} ms at {} ({} knots) + {:.3e} ms \
             per decode context token{} (fit rms error {:.1}%)\nprofile: {}",
            self.dense[0] * 1e3,
            self.knots[0],
            self.dense[n] * 1e3,
            self.knots[n],
            n + 1,
            self.per_decode_context * 1e3,
            if self.per_prefill_context > 0.0 {
                format!(
                    " + {:.3e} ms per token of context before a prompt chunk",
                    self.per_prefill_context * 1e3
                )
            } else {
                String::new()
            },
            self.rms_rel_error * 100.0,
            self.name
        ) + &self
            .step_spread
            .as_ref()
            .map_or(String::new(), |s| format!("\n{}", s.describe()))
            + &self
                .after_prefill
                .as_ref()
                .map_or(String::new(), |a| format!("\n{}", a.describe()))
            + &self
                .after_idle
                .map_or(String::new(), |a| format!("\n{}", a.describe()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A synthetic device: a fixed cost, a jump from one row to two (a thread hand-off),
    /// linear beyond, plus decode context reads and prefill attention that computes a
    /// chunk's square block at 3/4 the cost per pair of its earlier context.
    fn truth(new: usize, decode_ctx: usize, cross: f64, own: f64) -> f64 {
        let dense = 0.8e-3 + if new >= 2 { 1.2e-3 } else { 0.0 } + 0.1e-3 * new as f64;
        dense + 0.5e-6 * decode_ctx as f64 + 2e-9 * cross + 1.5e-9 * own
    }

    /// Context shared through the prefix cache reads at a fifth of the cost.
    const SHARED_DISCOUNT: f64 = 0.4e-6;

    /// A prefill chunk of `n` tokens after `start` computed ones plus `d` decodes at `ctx`.
    fn point(start: usize, n: usize, d: usize, ctx: usize) -> ProfilePoint {
        let (cross, own) = ((n * start) as f64, (n * n) as f64);
        ProfilePoint {
            prefill_tokens: n,
            decode_seqs: d,
            context_tokens: start + n + d * ctx,
            decode_context_tokens: Some(d * ctx),
            decode_shared_context_tokens: 0,
            attention_pairs: Some(cross + (n * (n + 1) / 2) as f64 + (d * ctx) as f64),
            chunk_self_pairs: Some(own),
            step_s: truth(n + d, d * ctx, cross, own),
        }
    }

    fn profile() -> Profile {
        let mut points = Vec::new();
        for &p in &[0usize, 16, 128, 512, 2048] {
            for &d in &[0usize, 1, 2, 4, 8, 24] {
                for ctx in [300, 1100] {
                    if p + d > 0 {
                        points.push(point(0, p, d, ctx));
                    }
                }
            }
        }
        for start in [512, 1536] {
            points.push(point(start, 512, 0, 0));
        }
        for d in [8, 24] {
            points.push(shared_point(d, 1100, 800));
        }
        Profile {
            model: "m".into(),
            device: "d".into(),
            points,
            client: None,
            structured_output: None,
            step_spread: None,
            after_prefill: None,
            after_idle: None,
        }
    }

    /// `d` decodes of `ctx` tokens each, the first `shared` of which all share.
    fn shared_point(d: usize, ctx: usize, shared: usize) -> ProfilePoint {
        let mut p = point(0, 0, d, ctx);
        p.decode_shared_context_tokens = (d - 1) * shared;
        p.step_s -= SHARED_DISCOUNT * ((d - 1) * shared) as f64;
        p
    }

    fn shape(start: usize, n: usize, decodes: usize, decode_ctx: usize) -> StepShape {
        let p = point(start, n, decodes, decode_ctx);
        StepShape {
            prefill_tokens: n,
            decode_seqs: decodes,
            context_tokens: p.context_tokens,
            decode_context_tokens: decodes * decode_ctx,
            attention_pairs: p.attention_pairs.unwrap(),
            chunk_self_pairs: p.chunk_self_pairs.unwrap(),
            ..StepShape::default()
        }
    }

    /// A step past what one pass of the server holds runs as equal passes, each paying the
    /// dense term; its attention is what it is in one pass. A step within is unchanged.
    #[test]
    fn a_step_past_what_one_pass_holds_pays_the_dense_term_per_pass() {
        let fit = Profiled::fit(&profile(), ClientPath::default()).unwrap();
        let one = shape(0, 1500, 0, 0);
        let counted = StepShape {
            forward_passes: 1,
            ..one
        };
        assert_eq!(fit.step_time(&counted), fit.step_time(&one));
        let two = StepShape {
            forward_passes: 2,
            ..one
        };
        let extra = 2.0 * fit.dense_time(750) - fit.dense_time(1500);
        let got = fit.step_time(&two) - fit.step_time(&one);
        assert!((got - extra).abs() < 1e-12, "{got} vs {extra}");
        assert!(extra > 0.0, "a second pass costs its fixed part again");
    }

    /// The engine runs a step of one sampled token per sequence as a decode, a prompt's last
    /// one-token chunk too: priced as the decode step of the same contexts.
    #[test]
    fn a_prompts_last_one_token_chunk_among_decodes_is_priced_as_a_decode() {
        let fit = Profiled::fit(&profile(), ClientPath::default()).unwrap();
        let mut last_chunk = shape(0, 0, 7, 500);
        last_chunk.num_seqs = 8;
        last_chunk.sampled = 8;
        last_chunk.prefill_tokens = 1;
        last_chunk.prefill_seqs = 1;
        last_chunk.max_prefill_chunk = 1;
        last_chunk.max_prefill_context = 500;
        last_chunk.context_tokens += 500;
        last_chunk.attention_pairs += 500.0;
        last_chunk.chunk_self_pairs = 1.0;
        let mut decodes = shape(0, 0, 8, 500);
        decodes.num_seqs = 8;
        decodes.sampled = 8;
        let (got, want) = (fit.step_time(&last_chunk), fit.step_time(&decodes));
        assert!((got - want).abs() < 1e-12, "{got} vs {want}");
        // Two tokens of a prompt: a prefill, its pairs priced as such.
        let mut two = last_chunk;
        two.prefill_tokens = 2;
        two.max_prefill_chunk = 2;
        two.attention_pairs += 499.0 + 2.0;
        two.chunk_self_pairs = 4.0;
        assert!(!two.one_token_each());
        assert_ne!(fit.step_time(&two), fit.step_time(&decodes));
    }

    #[test]
    fn the_fit_recovers_a_piecewise_linear_truth() {
        let fit = Profiled::fit(&profile(), ClientPath::default()).unwrap();
        assert!(fit.rms_rel_error < 1e-6, "{}", fit.rms_rel_error);
        // Shapes the grid does not hold: new-token counts between knots, other contexts,
        // a prefill chunk after earlier chunks beside decodes.
        for (start, n, d, ctx) in [(0, 0, 1, 4000), (0, 0, 12, 750), (1000, 300, 5, 760)] {
            let want = point(start, n, d, ctx).step_s;
            let got = fit.step_time(&shape(start, n, d, ctx));
            assert!(
                (got - want).abs() / want < 1e-6,
                "{n} {d} {ctx}: {got} vs {want}"
            );
        }
        // Shared context at its own price.
        let p = shared_point(12, 900, 500);
        let mut s = shape(0, 0, 12, 900);
        s.decode_shared_context_tokens = p.decode_shared_context_tokens;
        let got = fit.step_time(&s);
        assert!(
            (got - p.step_s).abs() / p.step_s < 1e-6,
            "{got} vs {}",
            p.step_s
        );
        // The jump from one row to two is kept, not averaged away.
        assert!(fit.dense_time(2) > 2.0 * fit.dense_time(1));
        // Beyond the largest profiled step: the last segment continues.
        let want = truth(4096, 0, 0.0, 0.0);
        assert!((fit.dense_time(4096) - want).abs() / want < 1e-6);
        // The JSON form fits the same.
        let json = serde_json::to_string(&profile()).unwrap();
        let again = Profiled::from_json(&json, ClientPath::default()).unwrap();
        let s = shape(64, 64, 3, 700);
        let (a, b) = (again.step_time(&s), fit.step_time(&s));
        assert!((a - b).abs() / b < 1e-9, "{a} vs {b}");
    }

    #[test]
    fn chunks_of_two_lengths_after_a_prefix_price_reading_it_apart_from_pairs() {
        // The truth plus a read of each chunk's earlier context, once per chunk.
        const PER_CONTEXT: f64 = 0.3e-6;
        let with_read = |start: usize, n: usize| {
            let mut p = point(start, n, 0, 0);
            p.step_s += PER_CONTEXT * start as f64;
            p
        };
        let mut p = profile();
        p.points.retain(|pt| pt.prefill_context() == 0.0);
        p.points
            .extend([(512, 512), (1536, 512)].map(|(a, n)| with_read(a, n)));
        // 512-token chunks alone: the read is folded into the pairs, and a short suffix
        // after a long prefix comes out too cheap.
        let one_length = Profiled::fit(&p, ClientPath::default()).unwrap();
        assert_eq!(one_length.per_prefill_context, 0.0);
        let want = with_read(1536, 48).step_s;
        assert!(one_length.step_time(&shape(1536, 48, 0, 0)) < 0.95 * want);
        // With short chunks too, the fit recovers both terms.
        p.points
            .extend([(1024, 64), (1024, 128)].map(|(a, n)| with_read(a, n)));
        let fit = Profiled::fit(&p, ClientPath::default()).unwrap();
        assert!(fit.rms_rel_error < 1e-6, "{}", fit.rms_rel_error);
        assert!((fit.per_prefill_context - PER_CONTEXT).abs() < 1e-3 * PER_CONTEXT);
        let got = fit.step_time(&shape(1536, 48, 0, 0));
        assert!((got - want).abs() / want < 1e-6, "{got} vs {want}");
    }

    #[test]
    fn a_profile_without_the_optional_counts_reads_as_fresh_prompts() {
        let mut p = profile();
        for pt in p
            .points
            .iter_mut()
            .filter(|pt| pt.context_tokens == pt.prefill_tokens)
        {
            (
                pt.decode_context_tokens,
                pt.attention_pairs,
                pt.chunk_self_pairs,
            ) = (None, None, None);
        }
        let fit = Profiled::fit(&p, ClientPath::default()).unwrap();
        assert!(fit.rms_rel_error < 1e-6, "{}", fit.rms_rel_error);
        // Without shared-prefix points, shared context is priced as own context.
        p.points.retain(|pt| pt.decode_shared_context_tokens == 0);
        let fit = Profiled::fit(&p, ClientPath::default()).unwrap();
        assert_eq!(fit.per_shared_context, fit.per_decode_context);
    }

    #[test]
    fn no_weight_comes_out_negative() {
        // Noisy points that an unconstrained fit would answer with negative weights.
        let mut p = profile();
        for (i, pt) in p.points.iter_mut().enumerate() {
            pt.step_s *= if i % 2 == 0 { 1.3 } else { 0.75 };
        }
        let fit = Profiled::fit(&p, ClientPath::default()).unwrap();
        assert!(fit.dense.iter().all(|&w| w >= 0.0));
        assert!(fit.per_decode_context >= 0.0 && fit.per_cross_pair >= 0.0);
        assert!(fit.per_self_pair >= 0.0 && fit.per_shared_context >= 0.0);
        assert!(fit.rms_rel_error > 0.05 && fit.rms_rel_error < 0.5);
    }

    #[test]
    fn knots_are_powers_of_two_that_points_touch() {
        assert_eq!(
            choose_knots(&[1, 2, 8, 24]),
            vec![1.0, 2.0, 8.0, 16.0, 32.0]
        );
        assert_eq!(choose_knots(&[512]), vec![512.0]);
        let mut h = [0.0; 3];
        hats(&[1.0, 2.0, 4.0], 3.0, &mut h);
        assert_eq!(h, [0.0, 0.5, 0.5]);
    }

    #[test]
    fn too_few_or_bad_points_are_refused() {
        // A decode and a prompt exercise four terms (two knots, decode context, the
        // prompt's square): two points cannot fit them.
        let mut p = profile();
        p.points = vec![point(0, 0, 1, 300), point(0, 512, 0, 0)];
        let e = Profiled::fit(&p, ClientPath::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 4 points"), "{e}");
        // Terms no point exercises are not unknowns: three decodes fit.
        p.points = vec![
            point(0, 0, 1, 300),
            point(0, 0, 1, 900),
            point(0, 0, 2, 300),
        ];
        assert!(Profiled::fit(&p, ClientPath::default()).is_ok());
        let e = Profiled::from_json("{\"model\": 1}", ClientPath::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("invalid profile JSON"), "{e}");
        let mut p = profile();
        p.points[0].step_s = -1.0;
        let e = Profiled::fit(&p, ClientPath::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("step_s must be positive"), "{e}");
    }

    #[test]
    fn a_profile_without_points_is_refused() {
        let mut p = profile();
        p.points.clear();
        let e = Profiled::fit(&p, ClientPath::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("the profile has no points"), "{e}");
        let e = Profiled::from_json(
            r#"{"model": "m", "device": "d", "points": []}"#,
            ClientPath::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("the profile has no points"), "{e}");
    }

    #[test]
    fn negative_or_non_finite_client_costs_and_pair_counts_are_refused() {
        let client = ProfileClient {
            request_s: 0.003,
            per_prompt_token_s: 1e-6,
            stream_s: 0.001,
            overlap_step_loss: 0.0,
        };
        assert!(client.check().is_ok());
        for (key, bad) in [
            (
                "request_s",
                ProfileClient {
                    request_s: -5.0,
                    ..client
                },
            ),
            (
                "per_prompt_token_s",
                ProfileClient {
                    per_prompt_token_s: -1e-6,
                    ..client
                },
            ),
            (
                "stream_s",
                ProfileClient {
                    stream_s: f64::NAN,
                    ..client
                },
            ),
            (
                "stream_s",
                ProfileClient {
                    stream_s: f64::INFINITY,
                    ..client
                },
            ),
            (
                "request_s",
                ProfileClient {
                    request_s: 1e300,
                    ..client
                },
            ),
        ] {
            let e = bad.check().unwrap_err();
            assert!(
                e.contains(&format!("client.{key} must be between 0")),
                "{e}"
            );
        }
        // Through the fit, as a profile file reaches it.
        let mut p = profile();
        p.client = Some(ProfileClient {
            request_s: -5.0,
            ..client
        });
        let e = Profiled::fit(&p, ClientPath::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("client.request_s"), "{e}");
        let mut p = profile();
        p.points[3].attention_pairs = Some(-6144.0);
        let e = Profiled::fit(&p, ClientPath::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("points[3].attention_pairs must be finite and not negative"),
            "{e}"
        );
        let mut p = profile();
        p.points[1].chunk_self_pairs = Some(f64::NAN);
        let e = Profiled::fit(&p, ClientPath::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("points[1].chunk_self_pairs"), "{e}");
    }

    #[test]
    fn pair_counts_beyond_what_the_steps_tokens_allow_are_refused() {
        // Every point of the synthetic profile is within the bound, decodes exactly at it.
        assert!(Profiled::fit(&profile(), ClientPath::default()).is_ok());
        let mut p = profile();
        p.points[3].attention_pairs = Some(1e308);
        let e = Profiled::fit(&p, ClientPath::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("points[3].attention_pairs is 1e308, more than the step's tokens allow"),
            "{e}"
        );
        // The bound is new × (context + new): one pair past it is refused, the bound itself
        // is not.
        let mut p = profile();
        let q = &p.points[3];
        let new = (q.prefill_tokens + q.decode_seqs) as f64;
        let most = new * (q.context_tokens as f64 + new);
        p.points[3].attention_pairs = Some(most);
        assert!(Profiled::fit(&p, ClientPath::default()).is_ok());
        p.points[3].attention_pairs = Some(most + 1.0);
        assert!(Profiled::fit(&p, ClientPath::default()).is_err());
        // A chunk's square cannot exceed the step's prompt tokens squared.
        let mut p = profile();
        let i = p
            .points
            .iter()
            .position(|q| q.prefill_tokens == 512)
            .unwrap();
        p.points[i].chunk_self_pairs = Some(512.0 * 512.0 + 1.0);
        let e = Profiled::fit(&p, ClientPath::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("points[{i}].chunk_self_pairs is 262145"))
                && e.contains("prefill_tokens²"),
            "{e}"
        );
    }

    #[test]
    fn each_constrained_sequence_adds_the_profiled_grammar_cost() {
        let mut profile = profile();
        let plain = Profiled::fit(&profile, Default::default()).unwrap();
        assert_eq!(plain.constrained_token_s(), None);
        profile.structured_output = Some(ProfileStructuredOutput {
            token_s: 20e-6,
            tokens: 2048,
            grammar: "g".into(),
        });
        let fit = Profiled::fit(&profile, Default::default()).unwrap();
        let mut s = shape(0, 0, 16, 512);
        let base = fit.step_time(&s);
        assert_eq!(base, plain.step_time(&s));
        s.constrained_seqs = 10;
        assert!((fit.step_time(&s) - base - 200e-6).abs() < 1e-12);
    }
}
