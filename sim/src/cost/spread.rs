//! How served steps spread around the cost model's typical step time.
//!
//! A cost model predicts a step's typical time; a served step also meets everything that
//! is not its shape — neighbours on the memory bus, the HTTP and client threads on the same
//! cores, the allocator, a host hiccup before a launch. Medians do not notice (the fitted
//! model is their business), but tails do: on this project's CPU a P99 decode step took
//! about twice its median, so a simulator that ran every step at its typical time predicted
//! ITL P99 40-60% short (docs/results/fidelity-cpu.md).
//!
//! `engine profile` measures the spread on its serving calibration: each busy served step's
//! period over the typical time predicted for its shape. The ratios are kept as quantiles
//! per band of typical step time (a GPU's host hiccup is a fixed delay, a large share of a
//! 2 ms decode and little of an 80 ms prefill; a shared CPU's contention scales with the
//! step), each band over its median (readable: "P99 ×2.3"). The simulator multiplies every
//! step by a factor drawn from the step's band (its own seeded stream; the same scenario
//! and seed give the same run), scaled to a mean of 1: the cost model's time stays the
//! mean step, so throughput and end-to-end latency keep what the fit gives them, and the
//! spread only shapes the distribution around it: a median step a little shorter, a tail
//! as long as served steps had. (Scaled to a median of 1 instead, it would also add its
//! mean excess, 5-10% on the CPU, to a time already fitted to served steps' trimmed mean:
//! that over-predicted E2E and under-predicted throughput by as much.)
//!
//! Draws are independent from step to step. A slow spell that lasts many steps (a
//! neighbour's job) moves a run's median, which no per-step draw can show.

use serde::{Deserialize, Serialize};

/// Quantiles kept per band: at probabilities 0, 0.01, …, 0.99, then finer in the tail
/// ([`TAIL`]), which P99 latencies are drawn from: between the 99th percentile and the
/// largest step, a straight line would put a hundredth of the draws evenly up to the worst
/// hiccup measured, where served steps have most of them near the 99th percentile.
pub const QUANTILES: usize = 100 + TAIL.len();
/// The probabilities of the tail's quantiles.
pub const TAIL: [f64; 6] = [0.992, 0.994, 0.996, 0.998, 0.999, 1.0];

/// The probability of quantile `i` of a band.
pub fn probability(i: usize) -> f64 {
    if i < 100 {
        i as f64 / 100.0
    } else {
        TAIL[i - 100]
    }
}
/// The fewest steps a band is measured over (fewer give no usable tail).
pub const MIN_BAND_STEPS: usize = 50;
/// The largest quantile a spread may hold: a step a thousand times its median is a
/// damaged file, not a measurement, and would stall the simulated clock.
pub const MAX_FACTOR: f64 = 1e3;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepSpread {
    /// Bands of typical step time, shortest first.
    pub bands: Vec<SpreadBand>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpreadBand {
    /// The longest typical step time (s) measured in this band; a step up to it takes this
    /// band's factors (the last band takes every longer step too).
    pub up_to_s: f64,
    /// Served steps the band was measured over.
    pub steps: usize,
    /// Served over typical time at the probabilities [`probability`]`(i)`, over the band's
    /// median: non-decreasing, positive, the one at 0.5 equal to 1.
    pub quantiles: Vec<f64>,
}

impl StepSpread {
    /// The spread of served steps, each `(typical_s, served_s)`: bands of typical time a
    /// factor of two apart, merged with their neighbours until each holds
    /// [`MIN_BAND_STEPS`] steps. `None` with fewer steps than one band needs.
    pub fn measure(steps: &[(f64, f64)]) -> Option<StepSpread> {
        let mut steps: Vec<(f64, f64)> = steps
            .iter()
            .copied()
            .filter(|&(t, s)| t > 0.0 && t.is_finite() && s / t > 0.0 && (s / t).is_finite())
            .collect();
        if steps.len() < MIN_BAND_STEPS {
            return None;
        }
        steps.sort_by(|a, b| a.0.total_cmp(&b.0));
        let shortest = steps[0].0;
        let octave = |t: f64| (t / shortest).log2().floor() as i64;
        // Runs of whole octaves, each closed once it holds enough steps.
        let mut groups: Vec<Vec<(f64, f64)>> = Vec::new();
        let mut current: Vec<(f64, f64)> = Vec::new();
        for (i, &step) in steps.iter().enumerate() {
            current.push(step);
            let octave_ends = steps
                .get(i + 1)
                .is_none_or(|n| octave(n.0) != octave(step.0));
            if octave_ends && current.len() >= MIN_BAND_STEPS {
                groups.push(std::mem::take(&mut current));
            }
        }
        // A short remainder joins the band below it.
        if !current.is_empty() {
            match groups.last_mut() {
                Some(last) => last.extend(current),
                None => groups.push(current),
            }
        }
        let bands = groups
            .into_iter()
            .map(|g| {
                let mut ratios: Vec<f64> = g.iter().map(|&(t, s)| s / t).collect();
                ratios.sort_by(f64::total_cmp);
                let median = quantile(&ratios, 0.5);
                SpreadBand {
                    up_to_s: g.last().expect("a band has steps").0,
                    steps: g.len(),
                    quantiles: (0..QUANTILES)
                        .map(|i| quantile(&ratios, probability(i)) / median)
                        .collect(),
                }
            })
            .collect();
        Some(StepSpread { bands })
    }

    /// Why this spread cannot be used, if it cannot (a hand-edited or damaged profile).
    pub fn check(&self) -> Result<(), String> {
        if self.bands.is_empty() {
            return Err("step_spread has no bands".into());
        }
        let mut below = 0.0;
        for (i, b) in self.bands.iter().enumerate() {
            let at = format!("step_spread.bands[{i}]");
            if !(b.up_to_s > below && b.up_to_s.is_finite()) {
                return Err(format!(
                    "{at}.up_to_s must be finite and above the band before it, got {}",
                    b.up_to_s
                ));
            }
            below = b.up_to_s;
            if b.quantiles.len() != QUANTILES {
                return Err(format!(
                    "{at}.quantiles must hold {QUANTILES} values, has {}",
                    b.quantiles.len()
                ));
            }
            if b.quantiles.iter().any(|q| !(*q > 0.0 && *q <= MAX_FACTOR)) {
                return Err(format!(
                    "{at}.quantiles must be positive and at most {MAX_FACTOR}"
                ));
            }
            if b.quantiles.windows(2).any(|w| w[1] < w[0]) {
                return Err(format!("{at}.quantiles must not decrease"));
            }
        }
        Ok(())
    }

    /// The band a step of typical time `typical_s` takes its factor from.
    pub fn band(&self, typical_s: f64) -> &SpreadBand {
        self.bands
            .iter()
            .find(|b| typical_s <= b.up_to_s)
            .unwrap_or_else(|| self.bands.last().expect("checked: bands exist"))
    }

    /// The factor of a step of typical time `typical_s` at probability `u` in [0, 1): its
    /// band's quantile function at `u`, as stored (over the band's median; the simulator
    /// draws from [`Self::scaled_to_mean_one`]).
    pub fn factor(&self, typical_s: f64, u: f64) -> f64 {
        self.band(typical_s).at(u)
    }

    /// This spread with each band's quantiles over the band's mean, so that its factors
    /// average 1 (the simulator's, computed once rather than every step).
    pub fn scaled_to_mean_one(&self) -> StepSpread {
        let bands = self
            .bands
            .iter()
            .map(|b| {
                let mean = b.mean();
                SpreadBand {
                    quantiles: b.quantiles.iter().map(|q| q / mean).collect(),
                    ..b.clone()
                }
            })
            .collect();
        StepSpread { bands }
    }

    /// One line: each band's factor at P90 and P99 (over its median) and its steps.
    pub fn describe(&self) -> String {
        let bands: Vec<String> = self
            .bands
            .iter()
            .map(|b| {
                format!(
                    "up to {:.3} ms: P90 x{:.2}, P99 x{:.2} ({} steps)",
                    b.up_to_s * 1e3,
                    b.at(0.9),
                    b.at(0.99),
                    b.steps
                )
            })
            .collect();
        format!(
            "served steps spread over their typical time (median x1): {}",
            bands.join("; ")
        )
    }
}

impl SpreadBand {
    /// The factor at probability `p`: the band's quantile function, linear between its
    /// quantiles.
    pub fn at(&self, p: f64) -> f64 {
        let p = p.clamp(0.0, 1.0);
        let q = &self.quantiles;
        let i = (1..q.len())
            .find(|&i| probability(i) >= p)
            .unwrap_or(q.len() - 1);
        let (p0, p1) = (probability(i - 1), probability(i));
        q[i - 1] + (q[i] - q[i - 1]) * ((p - p0) / (p1 - p0))
    }

    /// The mean factor: the mean of the piecewise-linear quantile function.
    pub fn mean(&self) -> f64 {
        let q = &self.quantiles;
        (1..q.len())
            .map(|i| (q[i - 1] + q[i]) / 2.0 * (probability(i) - probability(i - 1)))
            .sum()
    }
}

/// What the first step after an idle spell costs. An engine that waited for work comes back
/// cold: on this project's CPU a prefill after ~170 ms idle ran at 63 us a token against
/// 41-50 just after a decode (caches refilled, cores ramped up; a GPU drops its clocks when
/// idle too). `engine profile` measures it on its serving calibration: each step that
/// started at least [`AfterIdle::IDLE_S`] after the one before ended, over its typical time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AfterIdle {
    /// An engine idle at least this long (s) starts its next step cold.
    pub idle_s: f64,
    /// That step's time over its typical time: the median over the steps measured.
    pub factor: f64,
    /// Steps it was measured over.
    pub steps: usize,
}

impl AfterIdle {
    /// The idle spell that counts, as measured.
    pub const IDLE_S: f64 = 0.02;
    /// The fewest steps it is measured over.
    pub const MIN_STEPS: usize = 10;

    /// From steps that began at least [`Self::IDLE_S`] after the one before ended, each
    /// `(typical_s, served_s)`; `None` with fewer than [`Self::MIN_STEPS`].
    pub fn measure(steps: &[(f64, f64)]) -> Option<AfterIdle> {
        let mut ratios: Vec<f64> = steps
            .iter()
            .map(|&(t, s)| s / t)
            .filter(|r| *r > 0.0 && r.is_finite())
            .collect();
        if ratios.len() < Self::MIN_STEPS {
            return None;
        }
        ratios.sort_by(f64::total_cmp);
        Some(AfterIdle {
            idle_s: Self::IDLE_S,
            factor: quantile(&ratios, 0.5),
            steps: ratios.len(),
        })
    }

    /// Why it cannot be used, if it cannot (a hand-edited or damaged profile).
    pub fn check(&self) -> Result<(), String> {
        if !(self.idle_s > 0.0 && self.idle_s.is_finite()) {
            return Err(format!(
                "after_idle.idle_s must be positive, got {}",
                self.idle_s
            ));
        }
        if !(self.factor > 0.0 && self.factor <= MAX_FACTOR) {
            return Err(format!(
                "after_idle.factor must be positive and at most {MAX_FACTOR}, got {}",
                self.factor
            ));
        }
        Ok(())
    }

    pub fn describe(&self) -> String {
        format!(
            "the first step after {:.0} ms idle takes x{:.2} its typical time ({} steps)",
            self.idle_s * 1e3,
            self.factor,
            self.steps
        )
    }
}

/// What the decode steps just after a step with prompt tokens cost beyond their typical
/// time. On this project's CPU the first decode after a prefill took 0.27-0.34 ms more than
/// the 0.34-0.37 ms of a steady one-sequence decode, the second 0.12-0.18 ms more, the
/// third 0.07-0.11, the fourth 0.05-0.08 (`runs/fid8-ctx6`, every scenario alike; why, is
/// not known: caches, the allocator and clocks are all candidates). Priced as seconds, not
/// as a factor, because they were alike for decode steps of 0.34 and of 0.62 ms; they grow
/// with the prefill's tokens (the first: 0.27-0.34 ms after at most 128, 0.43-0.48 after
/// 257-512, `runs/fid9-prefill`), so each is scaled linearly by the tokens of the prefill
/// it follows. `engine profile` measures it on its serving calibration: for the
/// `j`-th decode step after a prefill, the median of its period less its typical time, over
/// that median for steps further on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AfterPrefill {
    /// Extra seconds of the first, second, … decode step after a step with prompt tokens.
    pub extra_s: Vec<f64>,
    /// Steps the first was measured over.
    pub steps: usize,
    /// The median prompt tokens of the prefills they were measured after (0: not scaled).
    #[serde(default)]
    pub prefill_tokens: f64,
    /// How much larger each extra is per prompt token of its prefill beyond
    /// `prefill_tokens`, as a share of it (the first extra's least-squares slope over it).
    #[serde(default)]
    pub per_prefill_token: f64,
}

/// Where a step stands after the last step with prompt tokens, counted step by step
/// ([`SincePrefill::next`]): what [`AfterPrefill::extra`] is priced by. One counter for the
/// simulator, `engine profile` and `engine verify`, so all three count alike.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SincePrefill {
    /// Steps since that one (0: this step has prompt tokens; `usize::MAX`: none yet).
    pub steps: usize,
    /// That step's prompt tokens.
    pub prompt_tokens: usize,
}

impl Default for SincePrefill {
    fn default() -> Self {
        SincePrefill {
            steps: usize::MAX,
            prompt_tokens: 0,
        }
    }
}

impl SincePrefill {
    /// Moves on to the next step, which has `prefill_tokens` prompt tokens; returns where
    /// it stands.
    pub fn next(&mut self, prefill_tokens: usize) -> SincePrefill {
        if prefill_tokens > 0 {
            *self = SincePrefill {
                steps: 0,
                prompt_tokens: prefill_tokens,
            };
        } else {
            self.steps = self.steps.saturating_add(1);
        }
        *self
    }
}

impl AfterPrefill {
    /// Decode steps after a prefill that are measured apart (a steady step is further on).
    pub const MAX_STEPS: usize = 6;
    /// The fewest steps each extra is measured over.
    pub const MIN_STEPS: usize = 10;

    /// From busy decode steps, each `(j, prompt_tokens, typical_s, served_s)`: the step is the
    /// `j`-th after one with `prompt_tokens` prompt tokens (`j` > [`Self::MAX_STEPS`]: a
    /// steady step). Each extra is the median of `served − typical` at its `j`, less that of
    /// the steady steps; they end before the first that is not positive or has fewer than
    /// [`Self::MIN_STEPS`] steps. `None` when the first does. The growth with the prefill's
    /// tokens is the least-squares slope of the first steps' excess over them (none if it
    /// falls), at most twice the extra per median prefill.
    pub fn measure(steps: &[(usize, usize, f64, f64)]) -> Option<AfterPrefill> {
        let steps: Vec<(usize, usize, f64, f64)> = steps
            .iter()
            .copied()
            .filter(|&(_, _, t, s)| t > 0.0 && s.is_finite())
            .collect();
        let excess_at = |keep: &dyn Fn(usize) -> bool| {
            let mut xs: Vec<f64> = steps
                .iter()
                .filter(|&&(j, ..)| keep(j))
                .map(|&(_, _, t, s)| s - t)
                .collect();
            xs.sort_by(f64::total_cmp);
            (!xs.is_empty()).then(|| (quantile(&xs, 0.5), xs.len()))
        };
        let (steady, _) = excess_at(&|j| j > Self::MAX_STEPS)?;
        let mut extra_s = Vec::new();
        let mut first = 0;
        for j in 1..=Self::MAX_STEPS {
            match excess_at(&|k| k == j) {
                Some((x, n)) if n >= Self::MIN_STEPS && x > steady => {
                    if j == 1 {
                        first = n;
                    }
                    extra_s.push(x - steady);
                }
                _ => break,
            }
        }
        if extra_s.is_empty() {
            return None;
        }
        let firsts: Vec<(f64, f64)> = steps
            .iter()
            .filter(|&&(j, ..)| j == 1)
            .map(|&(_, p, t, s)| (p as f64, s - t))
            .collect();
        let mut tokens: Vec<f64> = firsts.iter().map(|f| f.0).collect();
        tokens.sort_by(f64::total_cmp);
        let prefill_tokens = quantile(&tokens, 0.5);
        let slope = super::Line::fit(&firsts).map_or(0.0, |l| l.slope);
        let per_prefill_token = if prefill_tokens > 0.0 {
            (slope / extra_s[0]).clamp(0.0, 2.0 / prefill_tokens)
        } else {
            0.0
        };
        Some(AfterPrefill {
            extra_s,
            steps: first,
            prefill_tokens,
            per_prefill_token,
        })
    }

    /// Extra seconds of a decode step that stands `at` after the last prefill (none at 0
    /// steps: the step with prompt tokens itself).
    pub fn extra(&self, at: SincePrefill) -> f64 {
        let (j, prompt_tokens) = (at.steps, at.prompt_tokens);
        let scale = if self.prefill_tokens > 0.0 {
            (1.0 + self.per_prefill_token * (prompt_tokens as f64 - self.prefill_tokens)).max(0.0)
        } else {
            1.0
        };
        j.checked_sub(1)
            .and_then(|i| self.extra_s.get(i))
            .map_or(0.0, |x| x * scale)
    }

    /// Why it cannot be used, if it cannot (a hand-edited or damaged profile).
    pub fn check(&self) -> Result<(), String> {
        if self.extra_s.len() > Self::MAX_STEPS {
            return Err(format!(
                "after_prefill.extra_s has {} steps, more than {}",
                self.extra_s.len(),
                Self::MAX_STEPS
            ));
        }
        for (key, x) in [
            ("prefill_tokens", self.prefill_tokens),
            ("per_prefill_token", self.per_prefill_token),
        ] {
            if !(x >= 0.0 && x.is_finite()) {
                return Err(format!(
                    "after_prefill.{key} must be finite and not negative, got {x}"
                ));
            }
        }
        match self.extra_s.iter().find(|x| !(**x >= 0.0 && **x < 1.0)) {
            Some(x) => Err(format!(
                "after_prefill.extra_s must hold seconds from 0 to 1, got {x}"
            )),
            None => Ok(()),
        }
    }

    pub fn describe(&self) -> String {
        let ms: Vec<String> = self
            .extra_s
            .iter()
            .map(|x| format!("{:.3}", x * 1e3))
            .collect();
        format!(
            "the decode steps after a prefill of {:.0} tokens take {} ms more, {:+.0}% per \
             100 more tokens ({} steps)",
            self.prefill_tokens,
            ms.join(", "),
            self.per_prefill_token * 1e4,
            self.steps
        )
    }
}

/// The `p` quantile of sorted `xs`, linear between order statistics.
fn quantile(xs: &[f64], p: f64) -> f64 {
    let x = p * (xs.len() - 1) as f64;
    let i = x.floor() as usize;
    match xs.get(i + 1) {
        Some(next) => xs[i] + (next - xs[i]) * (x - i as f64),
        None => xs[i],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps of typical time `t`, served at `t` × the ratios 1..=n / (n / 2) (median ~1).
    fn steps(t: f64, n: usize) -> Vec<(f64, f64)> {
        (1..=n)
            .map(|i| (t, t * i as f64 / (n / 2) as f64))
            .collect()
    }

    #[test]
    fn steps_are_counted_from_the_last_one_with_prompt_tokens() {
        let mut at = SincePrefill::default();
        let counted: Vec<(usize, usize)> = [0, 100, 0, 0, 30, 0]
            .into_iter()
            .map(|p| {
                let s = at.next(p);
                (s.steps, s.prompt_tokens)
            })
            .collect();
        let none = usize::MAX;
        assert_eq!(
            counted,
            [(none, 0), (0, 100), (1, 100), (2, 100), (0, 30), (1, 30)]
        );
    }

    #[test]
    fn after_prefill_measures_each_steps_extra_over_the_steady_ones() {
        // Typical 1 ms; steady steps served at 1.1 ms; the first after a prefill of 100
        // tokens at 1.4, of 300 at 1.6; the second at 1.3, the third at 1.1 (no more than
        // steady: the extras end there).
        let mut steps = Vec::new();
        for _ in 0..AfterPrefill::MIN_STEPS {
            steps.push((1, 100, 1e-3, 1.4e-3));
            steps.push((1, 300, 1e-3, 1.6e-3));
            steps.push((2, 200, 1e-3, 1.3e-3));
            steps.push((3, 200, 1e-3, 1.1e-3));
            steps.push((4, 200, 1e-3, 1.4e-3)); // after the end: not counted
            steps.push((7, 200, 1e-3, 1.1e-3));
            steps.push((50, 200, 1e-3, 1.1e-3));
        }
        let a = AfterPrefill::measure(&steps).unwrap();
        let close = |x: f64, want: f64| (x - want).abs() < 1e-12;
        let extra = |steps: usize, prompt_tokens: usize| {
            a.extra(SincePrefill {
                steps,
                prompt_tokens,
            })
        };
        assert_eq!(a.extra_s.len(), 2, "{a:?}");
        assert!(
            close(a.extra_s[0], 0.4e-3) && close(a.extra_s[1], 0.2e-3),
            "{a:?}"
        );
        assert_eq!(a.steps, 2 * AfterPrefill::MIN_STEPS);
        // 0.3 ms after 100 tokens, 0.5 after 300: 0.1 ms per 100 tokens, a quarter of 0.4.
        assert!(close(a.prefill_tokens, 200.0), "{a:?}");
        assert!(close(a.per_prefill_token, 0.0025), "{a:?}");
        assert!(close(extra(1, 100), 0.3e-3) && close(extra(1, 300), 0.5e-3));
        assert!(close(extra(2, 200), 0.2e-3) && close(extra(2, 400), 0.3e-3));
        assert_eq!(
            (extra(0, 200), extra(3, 200), extra(9, 200)),
            (0.0, 0.0, 0.0)
        );
        assert!(a.check().is_ok());
        // Extras that fall with the prefill's tokens are not scaled.
        let falling: Vec<_> = steps
            .iter()
            .map(|&(j, p, t, s)| match (j, p) {
                (1, 100) => (j, p, t, 1.6e-3),
                (1, 300) => (j, p, t, 1.4e-3),
                _ => (j, p, t, s),
            })
            .collect();
        assert_eq!(
            AfterPrefill::measure(&falling).unwrap().per_prefill_token,
            0.0
        );
        // Too few first steps, or no steady ones: nothing.
        let few: Vec<_> = steps
            .iter()
            .copied()
            .filter(|s| s.0 != 1)
            .chain([(1, 100, 1e-3, 2e-3)])
            .collect();
        assert_eq!(AfterPrefill::measure(&few), None);
        let unsteady: Vec<_> = steps.iter().copied().filter(|s| s.0 <= 6).collect();
        assert_eq!(AfterPrefill::measure(&unsteady), None);
        // A damaged one is refused by name.
        let bad = AfterPrefill {
            extra_s: vec![f64::NAN],
            ..a.clone()
        };
        assert!(bad.check().unwrap_err().contains("after_prefill.extra_s"));
        let bad = AfterPrefill {
            per_prefill_token: -1.0,
            ..a
        };
        assert!(bad
            .check()
            .unwrap_err()
            .contains("after_prefill.per_prefill_token"));
    }

    #[test]
    fn too_few_steps_measure_nothing() {
        assert!(StepSpread::measure(&steps(1e-3, MIN_BAND_STEPS - 1)).is_none());
        let one = StepSpread::measure(&steps(1e-3, MIN_BAND_STEPS)).unwrap();
        assert_eq!(one.bands.len(), 1);
        one.check().unwrap();
    }

    #[test]
    fn bands_separate_step_sizes_and_normalise_to_their_medians() {
        // Short steps spread x1..x3 around their median, long ones barely (a fixed hiccup).
        let mut s: Vec<(f64, f64)> = (0..200)
            .map(|i| (1e-3, 1e-3 * (1.0 + 2.0 * i as f64 / 199.0)))
            .collect();
        s.extend((0..100).map(|i| (80e-3, 80e-3 * (1.0 + 0.02 * i as f64 / 99.0))));
        let spread = StepSpread::measure(&s).unwrap();
        spread.check().unwrap();
        assert_eq!(spread.bands.len(), 2);
        assert_eq!((spread.bands[0].steps, spread.bands[1].steps), (200, 100));
        assert_eq!(spread.bands[0].up_to_s, 1e-3);
        for b in &spread.bands {
            assert!((b.at(0.5) - 1.0).abs() < 1e-12);
        }
        // Short: 1..3 over a median of 2.
        assert!((spread.factor(1e-3, 0.0) - 0.5).abs() < 1e-9);
        assert!((spread.factor(1e-3, 1.0) - 1.5).abs() < 1e-9);
        // Long (and longer than anything measured): within 1% of the median.
        assert!(spread.factor(80e-3, 0.999) < 1.011);
        assert!(spread.factor(1.0, 0.0) > 0.989);
        // A step between the bands takes the longer band's factors.
        assert!(spread.factor(5e-3, 0.999) < 1.011);
    }

    #[test]
    fn a_short_remainder_joins_the_band_below() {
        let mut s = steps(1e-3, 100);
        s.extend(steps(10e-3, 20));
        let spread = StepSpread::measure(&s).unwrap();
        assert_eq!(spread.bands.len(), 1);
        assert_eq!(spread.bands[0].steps, 120);
        assert_eq!(spread.bands[0].up_to_s, 10e-3);
    }

    #[test]
    fn draws_follow_the_measured_distribution() {
        // Ratios uniform on [0.5, 1.5]: draws at evenly spaced u reproduce them, and the
        // mean factor is their mean.
        let s: Vec<(f64, f64)> = (0..1001)
            .map(|i| (2e-3, 2e-3 * (0.5 + i as f64 / 1000.0)))
            .collect();
        let spread = StepSpread::measure(&s).unwrap();
        for u in [0.0, 0.1, 0.25, 0.5, 0.9, 0.99, 0.993, 0.9995, 1.0] {
            assert!((spread.factor(2e-3, u) - (0.5 + u)).abs() < 1e-9, "u {u}");
        }
        assert!((spread.band(2e-3).mean() - 1.0).abs() < 1e-9);
        // A skewed tail raises the mean above the median; the factors are scaled to average
        // 1 (the cost model's time stays the mean step), so the median factor falls below 1.
        let mut skewed = s.clone();
        for x in skewed.iter_mut().skip(990) {
            x.1 *= 10.0;
        }
        let skewed = StepSpread::measure(&skewed).unwrap();
        let mean = skewed.band(2e-3).mean();
        assert!(mean > 1.05, "{mean}");
        let skewed = skewed.scaled_to_mean_one();
        assert!((skewed.factor(2e-3, 0.5) - 1.0 / mean).abs() < 1e-9);
        let n = 100_000;
        let average = (0..n)
            .map(|i| skewed.factor(2e-3, (i as f64 + 0.5) / n as f64))
            .sum::<f64>()
            / n as f64;
        assert!((average - 1.0).abs() < 1e-3, "{average}");
    }

    #[test]
    fn the_tail_keeps_its_shape_past_the_99th_percentile() {
        // Nine steps in a thousand at twice the median and one at twenty: draws past the
        // 99th percentile stay near twice, as served steps did, rather than spreading
        // evenly up to twenty.
        let s: Vec<(f64, f64)> = (0..1000)
            .map(|i| {
                let r = match i {
                    0..=989 => 1.0,
                    990..=998 => 2.0,
                    _ => 20.0,
                };
                (1e-3, 1e-3 * r)
            })
            .collect();
        let band = &StepSpread::measure(&s).unwrap().bands[0];
        assert!((band.at(0.995) - 2.0).abs() < 1e-9);
        assert!(band.at(0.9985) < 2.01);
        assert!((band.at(1.0) - 20.0).abs() < 1e-9);
        // The mean of the ratios is 1.028; the quantile function's within two hundredths.
        let mean = band.mean();
        assert!((mean - 1.028).abs() < 0.02, "{mean}");
    }

    #[test]
    fn after_idle_is_the_median_ratio_of_enough_steps() {
        let steps: Vec<(f64, f64)> = (0..AfterIdle::MIN_STEPS)
            .map(|i| (2e-3, 2e-3 * (1.0 + 0.1 * i as f64)))
            .collect();
        assert!(AfterIdle::measure(&steps[1..]).is_none());
        let a = AfterIdle::measure(&steps).unwrap();
        a.check().unwrap();
        // Ratios 1.0 .. 1.9: the median 1.45.
        assert!((a.factor - 1.45).abs() < 1e-9, "{}", a.factor);
        assert_eq!(
            (a.steps, a.idle_s),
            (AfterIdle::MIN_STEPS, AfterIdle::IDLE_S)
        );
        let bad = AfterIdle { factor: 0.0, ..a };
        assert!(bad.check().unwrap_err().contains("after_idle.factor"));
        let bad = AfterIdle {
            idle_s: f64::NAN,
            ..a
        };
        assert!(bad.check().unwrap_err().contains("after_idle.idle_s"));
    }

    #[test]
    fn damaged_spreads_are_refused_by_name() {
        let good = StepSpread::measure(&steps(1e-3, 100)).unwrap();
        let mut bad = good.clone();
        bad.bands[0].quantiles.pop();
        assert!(bad
            .check()
            .unwrap_err()
            .contains("bands[0].quantiles must hold 106"));
        let mut bad = good.clone();
        bad.bands[0].quantiles[3] = 100.0;
        assert!(bad.check().unwrap_err().contains("must not decrease"));
        let mut bad = good.clone();
        bad.bands[0].quantiles[0] = 0.0;
        assert!(bad.check().unwrap_err().contains("positive"));
        let mut bad = good.clone();
        *bad.bands[0].quantiles.last_mut().unwrap() = 1e300;
        assert!(bad.check().unwrap_err().contains("at most 1000"));
        let mut bad = good.clone();
        bad.bands.push(bad.bands[0].clone());
        assert!(bad.check().unwrap_err().contains("bands[1].up_to_s"));
        assert!(StepSpread { bands: vec![] }.check().is_err());
    }
}
