//! How far a predicted figure may be off: a 90% interval around each figure of a run.
//!
//! An interval combines two things, in log space (errors of a latency or a throughput are
//! multiplicative):
//!
//! * the workload's randomness: the same scenario run again with other seeds (`--seeds N`:
//!   the given seed and the `N − 1` that follow it, priced with the calibration's coefficient
//!   draws where it has them). Beside recorded errors, a normal of their spread around the
//!   given seed's figure ([`SeedSpread::around_given`]). Alone, they are all the interval
//!   has, and it claims what another draw of the workload would give: predicted from the `N`
//!   log figures as from a normal sample of unknown spread, centred on their mean, Student's
//!   t with `N − 1` degrees of freedom scaled by their standard deviation × √(1 + 1/N)
//!   ([`SeedSpread::predictive`]), widened where it would leave out the given seed's own
//!   figure. (The normal around the given seed held another seed's figure 67% of the time
//!   at five seeds, not 90%: the given seed is itself one draw, and five seeds pin a spread
//!   down loosely.)
//! * the model's error: how far the calibration's predictions were from the measurements
//!   of the runs it was fitted and checked on (`ln(measured / predicted)` per metric, kept
//!   in the calibration file as `[[residuals]]`), taken as they are (their bias too: a
//!   model that always predicts ITL P99 low gets an interval above its figure).
//!
//! The interval is the 5th to 95th percentile of the sum of the two, found exactly (the
//! mixture's distribution function solved by bisection). Without residuals (a profiled cost
//! model, an uncalibrated pair) it is the workload's alone: said beside it.
//!
//! The figure itself stays the given seed's (vLLM's summary keys keep their meaning); the
//! interval goes beside it as `KEY_lo` and `KEY_hi`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use infer_core::metrics::Summary;

use crate::calibration::Mechanisms;
use crate::error::SimError;
use crate::setup::Setup;

/// How many seeds `sim run` and `engine verify` run by default: enough for a spread, few
/// enough that the main command stays fast.
pub const DEFAULT_SEEDS: usize = 5;

/// The most seeds a prediction runs (`--seeds`): each is a whole simulation, and a
/// thousand already pin a 90% interval's percentiles far finer than the model's error.
pub const MAX_SEEDS: usize = 1000;

/// The interval's coverage: the 5th to the 95th percentile.
pub const LEVEL: f64 = 0.90;

/// One calibration run's model error: `ln(measured / predicted)` per fitted metric
/// (`fit::FIT_METRICS`), as `sim calibrate` found it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Residual {
    /// The run's label.
    pub run: String,
    /// Runs of one configuration (workload, server settings; any model): left out together
    /// when the intervals' coverage is tested on one of them.
    pub group: String,
    /// Whether the fit held the run out (its errors are out-of-sample).
    #[serde(default)]
    pub held_out: bool,
    pub errors: BTreeMap<String, f64>,
}

impl Residual {
    /// The residual of run `run` from its `(metric, measured, predicted)` figures: the
    /// finite `ln(measured / predicted)` of each (a figure not predicted is left out).
    pub fn new(
        run: String,
        group: String,
        held_out: bool,
        figures: impl IntoIterator<Item = (String, f64, f64)>,
    ) -> Residual {
        Residual {
            run,
            group,
            held_out,
            errors: figures
                .into_iter()
                .map(|(metric, measured, predicted)| (metric, (measured / predicted).ln()))
                .filter(|(_, e)| e.is_finite())
                .collect(),
        }
    }
}

/// A figure with its interval.
#[derive(Debug, Clone, PartialEq)]
pub struct Interval {
    /// The summary key (`median_ttft_ms`, …).
    pub key: String,
    /// The given seed's figure.
    pub value: f64,
    pub lo: f64,
    pub hi: f64,
}

impl Interval {
    pub fn contains(&self, x: f64) -> bool {
        self.lo <= x && x <= self.hi
    }

    /// Width as a fraction of the figure.
    pub fn relative_width(&self) -> f64 {
        (self.hi - self.lo) / self.value
    }
}

/// What the intervals of a run are made of, in words (the console's and run.json's).
#[derive(Debug, Clone, PartialEq)]
pub struct Basis {
    pub seeds: usize,
    /// Bootstrap draws of the coefficients the seeds took turns with (0: none).
    pub draws: usize,
    /// Runs whose errors were used (0: none, the workload's randomness only).
    pub residual_runs: usize,
}

impl Basis {
    pub fn describe(&self) -> String {
        let mut seeds = format!(
            "{} seed{}",
            self.seeds,
            if self.seeds == 1 { "" } else { "s" }
        );
        if self.draws > 0 && self.seeds > 1 {
            seeds = format!(
                "{seeds} (the others priced with bootstrap refits of the coefficients, {} \
                 recorded)",
                self.draws
            );
        }
        match self.residual_runs {
            0 => format!(
                "{seeds}; the workload's randomness only: no calibration errors to add (the \
                 model's own error is not in it)"
            ),
            n => format!("{seeds} and the calibration's errors on {n} measured runs"),
        }
    }
}

/// The residual metric (one of `fit::FIT_METRICS`) whose errors a summary key's interval
/// takes: a mean or median takes the median's, the upper percentiles the P99's. TPOT takes
/// ITL's; end-to-end latency, which no fit measures, both TTFT's and ITL's (a request's
/// latency is its first token and its decodes). `None`: a key with no interval (counts,
/// spreads, fractions).
pub fn residual_metrics(key: &str) -> Option<&'static [&'static str]> {
    let upper = key.starts_with("p90_") || key.starts_with("p95_") || key.starts_with("p99_");
    let central = key.starts_with("mean_") || key.starts_with("median_");
    Some(match key {
        "request_throughput" | "output_throughput" | "total_token_throughput" => {
            &["output_throughput"]
        }
        k if k.ends_with("_ttft_ms") && central => &["median_ttft_ms"],
        k if k.ends_with("_ttft_ms") && upper => &["p99_ttft_ms"],
        k if (k.ends_with("_itl_ms") || k.ends_with("_tpot_ms")) && central => &["median_itl_ms"],
        k if (k.ends_with("_itl_ms") || k.ends_with("_tpot_ms")) && upper => &["p99_itl_ms"],
        k if k.ends_with("_e2el_ms") && central => &["median_ttft_ms", "median_itl_ms"],
        k if k.ends_with("_e2el_ms") && upper => &["p99_ttft_ms", "p99_itl_ms"],
        _ => return None,
    })
}

/// The errors of `metric` over `residuals`, leaving out the runs of group `leave_out`.
fn errors_of(residuals: &[Residual], metrics: &[&str], leave_out: Option<&str>) -> Vec<f64> {
    residuals
        .iter()
        .filter(|r| Some(r.group.as_str()) != leave_out)
        .flat_map(|r| metrics.iter().filter_map(|m| r.errors.get(*m).copied()))
        .filter(|e| e.is_finite())
        .collect()
}

/// Every figure of `central` that has an interval, with it: `others` are the same scenario
/// under the other seeds, `residuals` the calibration's errors (the runs of group
/// `leave_out` left out: a coverage test's). Figures that are zero or missing, or with
/// neither a seed spread nor errors to widen them, get none.
pub fn intervals(
    central: &Summary,
    others: &[Summary],
    residuals: &[Residual],
    leave_out: Option<&str>,
) -> Vec<Interval> {
    let other_entries: Vec<Vec<(String, f64)>> = others.iter().map(Summary::entries).collect();
    let mut out = Vec::new();
    for (key, value) in central.entries() {
        let Some(metrics) = residual_metrics(&key) else {
            continue;
        };
        if !(value > 0.0 && value.is_finite()) {
            continue;
        }
        let mut logs = vec![0.0];
        for entries in &other_entries {
            if let Some((_, v)) = entries.iter().find(|(k, _)| *k == key) {
                if *v > 0.0 && v.is_finite() {
                    logs.push((v / value).ln());
                }
            }
        }
        let errors = errors_of(residuals, metrics, leave_out);
        let (lo, hi) = if errors.is_empty() {
            let Some(seeds) = SeedSpread::predictive(&logs) else {
                continue;
            };
            // Centred on the seeds' mean, the interval could leave out the given seed's own
            // figure, itself one of the draws (from 7 seeds on: Samuelson's bound passes the
            // t's reach): it is widened to hold it.
            let (lo, hi) = log_bounds(&[], Some(seeds));
            (lo.min(0.0), hi.max(0.0))
        } else {
            log_bounds(&errors, SeedSpread::around_given(&logs))
        };
        out.push(Interval {
            key,
            value,
            lo: value * lo.exp(),
            hi: value * hi.exp(),
        });
    }
    out
}

/// How a seed spread is shaped.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Shape {
    Normal,
    /// Student's t with this many degrees of freedom.
    StudentT(u32),
}

/// The seeds' part of an interval, in log space relative to the given seed's figure:
/// `centre + scale × X`, `X` of `shape`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct SeedSpread {
    centre: f64,
    scale: f64,
    shape: Shape,
}

impl SeedSpread {
    /// The seeds alone: what another draw of the workload would give, from the log figures
    /// of `n` seeds (the given one's, 0, included) as from a normal sample of unknown spread
    /// (the prediction interval): centred on their mean, Student's t of `n − 1` degrees of
    /// freedom scaled by their standard deviation × √(1 + 1/n). `None` for fewer than two.
    fn predictive(logs: &[f64]) -> Option<SeedSpread> {
        let (n, mean, sd) = mean_and_sd(logs)?;
        Some(SeedSpread {
            centre: mean,
            scale: sd * (1.0 + 1.0 / n as f64).sqrt(),
            shape: Shape::StudentT((n - 1) as u32),
        })
    }

    /// Beside a calibration's errors: a normal of the seeds' spread around the given seed's
    /// figure. The recorded errors already hold what parts a prediction from a measurement
    /// of its scenario (the workload's draw too, where the measured run drew its own); the
    /// seeds add the spread of the calibration's coefficient draws they are priced with.
    /// The sum is what the held-out checks measure (docs/results/intervals.md).
    fn around_given(logs: &[f64]) -> Option<SeedSpread> {
        let (_, _, sd) = mean_and_sd(logs)?;
        Some(SeedSpread {
            centre: 0.0,
            scale: sd,
            shape: Shape::Normal,
        })
    }

    /// The distribution function of `centre + scale × X` (`scale` > 0).
    fn cdf(&self, x: f64) -> f64 {
        let z = (x - self.centre) / self.scale;
        match self.shape {
            Shape::Normal => 0.5 * libm::erfc(-z / std::f64::consts::SQRT_2),
            Shape::StudentT(degrees) => student_t_cdf(z, degrees),
        }
    }
}

/// `(n, mean, sample standard deviation)` of `xs`; `None` for fewer than two values.
fn mean_and_sd(xs: &[f64]) -> Option<(usize, f64, f64)> {
    let n = xs.len();
    if n < 2 {
        return None;
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    Some((n, mean, var.sqrt()))
}

/// The [`LEVEL`] interval of `e + η` in log space, `e` drawn uniformly from `errors` (0
/// where there are none) and `η` from `seeds` (0 where there is none, or no spread).
fn log_bounds(errors: &[f64], seeds: Option<SeedSpread>) -> (f64, f64) {
    let errors = if errors.is_empty() {
        &[0.0][..]
    } else {
        errors
    };
    let tail = (1.0 - LEVEL) / 2.0;
    let spread = seeds.filter(|s| s.scale > 0.0 && s.scale.is_finite());
    let Some(s) = spread else {
        // Errors alone, moved by the seeds' centre: their percentiles.
        let centre = seeds.map_or(0.0, |s| s.centre);
        let mut sorted: Vec<f64> = errors.iter().map(|e| e + centre).collect();
        sorted.sort_by(f64::total_cmp);
        return (quantile(&sorted, tail), quantile(&sorted, 1.0 - tail));
    };
    // The mixture's distribution function: the mean over the errors of the spread's.
    let cdf = |x: f64| errors.iter().map(|e| s.cdf(x - e)).sum::<f64>() / errors.len() as f64;
    // Every term of the mixture is below `tail` left of the smallest error's own `tail`
    // quantile, and above `1 − tail` right of the largest's.
    let mut reach = s.scale;
    while s.cdf(s.centre + reach) < 1.0 - tail {
        reach *= 2.0;
    }
    let (min, max) = errors
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &e| {
            (a.min(e), b.max(e))
        });
    let bracket = (min + s.centre - reach, max + s.centre + reach);
    (
        solve_increasing(cdf, tail, bracket),
        solve_increasing(cdf, 1.0 - tail, bracket),
    )
}

/// The `x` in `bracket` where the non-decreasing `f` reaches `target`, by bisection to
/// 1e-10 (`f(bracket.0) <= target <= f(bracket.1)`; in log space, a ten-billionth of the
/// figure).
fn solve_increasing(f: impl Fn(f64) -> f64, target: f64, bracket: (f64, f64)) -> f64 {
    let (mut lo, mut hi) = bracket;
    while hi - lo > 1e-10 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        if f(mid) < target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// Student's t distribution function with `degrees` (≥ 1) degrees of freedom, exact
/// (Abramowitz & Stegun 26.7.3–4: a finite series in θ = atan(t/√ν), `degrees / 2` terms).
fn student_t_cdf(t: f64, degrees: u32) -> f64 {
    assert!(degrees >= 1, "Student's t needs a degree of freedom");
    if t.is_nan() {
        return f64::NAN;
    }
    let nu = degrees as f64;
    let theta = (t.abs() / nu.sqrt()).atan();
    let (sin, cos) = theta.sin_cos();
    let cos2 = cos * cos;
    // A(|t|): the probability of |T| < |t|.
    let within = if degrees % 2 == 1 {
        // θ + sinθ (cosθ + 2/3 cos³θ + … + (2·4⋯(ν−3))/(1·3⋯(ν−2)) cos^(ν−2)θ)
        let (mut term, mut sum) = (cos, 0.0);
        let mut k = 1.0;
        while k <= nu - 2.0 {
            sum += term;
            term *= cos2 * (k + 1.0) / (k + 2.0);
            k += 2.0;
        }
        2.0 / std::f64::consts::PI * (theta + sin * sum)
    } else {
        // sinθ (1 + 1/2 cos²θ + (1·3)/(2·4) cos⁴θ + … + (1·3⋯(ν−3))/(2·4⋯(ν−2)) cos^(ν−2)θ)
        let (mut term, mut sum) = (1.0, 0.0);
        let mut k = 0.0;
        while k <= nu - 2.0 {
            sum += term;
            term *= cos2 * (k + 1.0) / (k + 2.0);
            k += 2.0;
        }
        sin * sum
    };
    let within = within.clamp(0.0, 1.0);
    if t >= 0.0 {
        0.5 + 0.5 * within
    } else {
        0.5 - 0.5 * within
    }
}

/// The `p` quantile of sorted values, interpolated between neighbours.
fn quantile(sorted: &[f64], p: f64) -> f64 {
    let pos = p * (sorted.len() - 1) as f64;
    let (i, frac) = (pos.floor() as usize, pos.fract());
    match sorted.get(i + 1) {
        Some(next) => sorted[i] + frac * (next - sorted[i]),
        None => sorted[i],
    }
}

/// The seeds after the scenario's, `seeds − 1` of them: the workload seed (and a cluster's
/// router seed) moved by 1, 2, … (wrapping), each priced with the next of the calibration's
/// bootstrap draws where it has them (the scenario's `[sim]` overrides still on top; under a
/// draw with which the configuration no longer fits in memory, the fitted coefficients).
pub fn other_seeds(setup: &Setup, seeds: usize) -> Vec<Setup> {
    (1..seeds as u64)
        .map(|i| {
            let mut s = setup.clone();
            s.scenario.workload.seed = s.scenario.workload.seed.wrapping_add(i);
            if let Some(c) = s.scenario.cluster.as_mut() {
                c.router_seed = c.router_seed.wrapping_add(i);
            }
            if let Some(cal) = &setup.calibration {
                if !cal.draws.is_empty() {
                    let draw = &cal.draws[(i as usize - 1) % cal.draws.len()];
                    let drawn = cal.with(&Mechanisms::of(cal), draw);
                    let _ = s.set_calibration(drawn);
                }
            }
            s
        })
        .collect()
}

/// The summaries of `setup` under the other seeds ([`other_seeds`]), on `threads` workers
/// (1 where the caller's work already takes every core; each seed's run is deterministic,
/// so the result does not depend on the threads).
pub fn seeded_summaries(
    setup: &Setup,
    seeds: usize,
    threads: usize,
) -> Result<Vec<Summary>, SimError> {
    let setups = other_seeds(setup, seeds);
    crate::sweep::par_map(&setups, threads, None, |s| {
        crate::simulate::run(s).map(|r| r.summary)
    })
    .into_iter()
    .collect()
}

/// A run's intervals and what they are made of.
#[derive(Debug, Clone, PartialEq)]
pub struct RunIntervals {
    pub intervals: Vec<Interval>,
    pub basis: Basis,
}

impl RunIntervals {
    /// The intervals of the run of `setup` whose summary is `central`: `setup` simulated
    /// under `seeds − 1` more seeds, the calibration's errors added. `None` for one seed (the
    /// run's files as they were before intervals existed).
    pub fn of_run(
        setup: &Setup,
        central: &Summary,
        seeds: usize,
    ) -> Result<Option<RunIntervals>, SimError> {
        if seeds <= 1 {
            return Ok(None);
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let others = seeded_summaries(setup, seeds, cores)?;
        let mut run = RunIntervals::of_summaries(central, &others, residuals_of(setup), None);
        run.basis.draws = setup.calibration.as_ref().map_or(0, |c| c.draws.len());
        Ok(Some(run))
    }

    /// The intervals of `central` from the same run under other seeds (`others`) and the
    /// errors of `residuals` (the runs of group `leave_out` left out).
    pub fn of_summaries(
        central: &Summary,
        others: &[Summary],
        residuals: &[Residual],
        leave_out: Option<&str>,
    ) -> RunIntervals {
        RunIntervals {
            intervals: intervals(central, others, residuals, leave_out),
            basis: Basis {
                seeds: others.len() + 1,
                draws: 0,
                residual_runs: residuals
                    .iter()
                    .filter(|r| Some(r.group.as_str()) != leave_out)
                    .count(),
            },
        }
    }

    /// summary.json's keys: `KEY_lo` and `KEY_hi` for each figure with an interval.
    pub fn summary_keys(&self) -> Vec<(String, f64)> {
        self.intervals
            .iter()
            .flat_map(|i| {
                [
                    (format!("{}_lo", i.key), i.lo),
                    (format!("{}_hi", i.key), i.hi),
                ]
            })
            .collect()
    }

    /// The figure of `key`'s interval, if it has one.
    pub fn get(&self, key: &str) -> Option<&Interval> {
        self.intervals.iter().find(|i| i.key == key)
    }

    /// The console's lines.
    pub fn render(&self) -> String {
        render(&self.intervals, &self.basis)
    }
}

/// The residuals of the calibration `setup` prices with (none for a profiled cost model or
/// a pair no calibration file covers).
pub fn residuals_of(setup: &Setup) -> &[Residual] {
    setup
        .calibration
        .as_ref()
        .map_or(&[][..], |c| &c.residuals[..])
}

/// The intervals as console lines: `label  value  [lo, hi]`, for the figures vLLM's block
/// prints.
fn render(intervals: &[Interval], basis: &Basis) -> String {
    use std::fmt::Write as _;
    const SHOWN: [(&str, &str); 10] = [
        ("request_throughput", "Request throughput (req/s)"),
        ("output_throughput", "Output token throughput (tok/s)"),
        ("mean_ttft_ms", "Mean TTFT (ms)"),
        ("median_ttft_ms", "Median TTFT (ms)"),
        ("p99_ttft_ms", "P99 TTFT (ms)"),
        ("median_tpot_ms", "Median TPOT (ms)"),
        ("median_itl_ms", "Median ITL (ms)"),
        ("p99_itl_ms", "P99 ITL (ms)"),
        ("median_e2el_ms", "Median E2EL (ms)"),
        ("p99_e2el_ms", "P99 E2EL (ms)"),
    ];
    let mut s = String::new();
    if intervals.is_empty() {
        return s;
    }
    let _ = writeln!(s, "{:-^50}", format!(" {:.0}% interval ", LEVEL * 100.0));
    let _ = writeln!(s, "from {}", basis.describe());
    for (key, label) in SHOWN {
        if let Some(i) = intervals.iter().find(|i| i.key == key) {
            let _ = writeln!(
                s,
                "{:<33} {:>9.2}  [{:.2}, {:.2}]",
                format!("{label}:"),
                i.value,
                i.lo,
                i.hi
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Student's t quantile: the `t` with [`student_t_cdf`]`(t) = p`, `p` in (0, 1).
    fn student_t_quantile(p: f64, degrees: u32) -> f64 {
        assert!(p > 0.0 && p < 1.0, "a quantile of p in (0, 1), got {p}");
        let cdf = |t: f64| student_t_cdf(t, degrees);
        let mut reach = 1.0;
        while cdf(reach) < p.max(1.0 - p) {
            reach *= 2.0;
        }
        solve_increasing(cdf, p, (-reach, reach))
    }

    #[test]
    fn student_t_matches_its_tables() {
        for (p, nu, t) in [
            (0.95, 1, 6.313751514675043),
            (0.95, 2, 2.919985580353725),
            (0.95, 4, 2.131846786326649),
            (0.975, 10, 2.228138851986274),
            (0.95, 30, 1.697260886767654),
            (0.05, 999, -1.646380345427535),
        ] {
            // The tables' values to 1e-7 (their last digits differ between sources).
            let got = student_t_quantile(p, nu);
            assert!(
                (got - t).abs() < 1e-7,
                "t quantile {p} of {nu}: {got}, not {t}"
            );
            assert!(
                (student_t_cdf(got, nu) - p).abs() < 1e-10,
                "cdf {got} of {nu}"
            );
        }
        assert_eq!(student_t_cdf(0.0, 3), 0.5);
    }

    /// Seeds alone, the given seed far from the others: its figure stays inside its own
    /// interval. With errors, an interval may lie off the figure (a biased model's does).
    #[test]
    fn the_given_seeds_figure_is_inside_its_seeds_interval() {
        let summary = |x: f64| Summary {
            output_throughput: x,
            ..Summary::default()
        };
        let others: Vec<Summary> = (0..9).map(|i| summary(200.0 + i as f64)).collect();
        let iv = intervals(&summary(100.0), &others, &[], None);
        let iv = iv.iter().find(|i| i.key == "output_throughput").unwrap();
        assert!(
            iv.contains(100.0) && iv.lo == 100.0 && iv.hi > 200.0,
            "{iv:?}"
        );
        let biased = Residual {
            run: "r".into(),
            group: "g".into(),
            held_out: false,
            errors: [("output_throughput".to_string(), 1.0)].into(),
        };
        let iv = intervals(&summary(100.0), &others, &[biased], None);
        let iv = iv.iter().find(|i| i.key == "output_throughput").unwrap();
        assert!(iv.lo > 100.0, "{iv:?}");
    }

    #[test]
    fn seeds_alone_give_their_prediction_interval() {
        // Five seeds: mean ± t(4) × sd × √(1 + 1/5).
        let logs = [0.0, 0.1, -0.05, 0.2, 0.05];
        let seeds = SeedSpread::predictive(&logs).unwrap();
        assert!((seeds.centre - 0.06).abs() < 1e-12);
        assert_eq!(seeds.shape, Shape::StudentT(4));
        let half = 2.131846786326649 * 0.0961769203083567 * 1.2f64.sqrt();
        assert!((seeds.scale * 2.131846786326649 - half).abs() < 1e-12);
        let (lo, hi) = log_bounds(&[], Some(seeds));
        assert!((lo - (0.06 - half)).abs() < 1e-9 && (hi - (0.06 + half)).abs() < 1e-9);
        assert_eq!(SeedSpread::predictive(&[0.0]), None);
        // Beside errors: a normal of the seeds' spread around the given seed's figure.
        let around = SeedSpread::around_given(&logs).unwrap();
        let (lo, hi) = log_bounds(&[], Some(around));
        let half = 1.6448536269514722 * 0.0961769203083567;
        assert!(
            (lo + half).abs() < 1e-9 && (hi - half).abs() < 1e-9,
            "{lo} {hi}"
        );
    }

    /// What the seeds' part of an interval claims: that another draw of the workload lands
    /// inside 90% of the time. Checked on normal log figures, 4,000 times five seeds and
    /// one more draw each (the rule before held about 70%).
    #[test]
    fn another_seeds_figure_lands_in_the_seeds_interval_ninety_percent_of_the_time() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut normal = || {
            // Box–Muller.
            let (u, v): (f64, f64) = (1.0 - rng.gen::<f64>(), rng.gen());
            (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
        };
        let trials = 4000;
        let mut inside = 0;
        for _ in 0..trials {
            let draws: Vec<f64> = (0..5).map(|_| 0.3 * normal()).collect();
            let logs: Vec<f64> = draws.iter().map(|d| d - draws[0]).collect();
            let (lo, hi) = log_bounds(&[], SeedSpread::predictive(&logs));
            let next = 0.3 * normal() - draws[0];
            inside += usize::from(lo <= next && next <= hi);
        }
        let share = inside as f64 / trials as f64;
        assert!((0.88..=0.92).contains(&share), "{share}");
    }

    #[test]
    fn errors_alone_give_their_percentiles_bias_included() {
        // 101 errors from 0.0 to 1.0: every one under-predicted, so the interval lies above.
        let errors: Vec<f64> = (0..=100).map(|i| i as f64 / 100.0).collect();
        let (lo, hi) = log_bounds(&errors, None);
        assert!(
            (lo - 0.05).abs() < 1e-9 && (hi - 0.95).abs() < 1e-9,
            "{lo} {hi}"
        );
    }

    #[test]
    fn the_seed_spread_widens_the_errors_interval() {
        let errors: Vec<f64> = (0..=100).map(|i| (i as f64 - 50.0) / 500.0).collect();
        let (lo0, hi0) = log_bounds(&errors, None);
        let seeds = SeedSpread {
            centre: 0.0,
            scale: 0.05,
            shape: Shape::StudentT(4),
        };
        let (lo1, hi1) = log_bounds(&errors, Some(seeds));
        assert!(lo1 < lo0 && hi1 > hi0);
        // But by less than the two widths added (they combine, they do not stack).
        assert!(hi1 - hi0 < 2.132 * 0.05);
        // The mixture's 95th percentile, checked from its distribution function.
        let mixture = |x: f64| {
            errors
                .iter()
                .map(|e| student_t_cdf((x - e) / 0.05, 4))
                .sum::<f64>()
                / errors.len() as f64
        };
        assert!((mixture(hi1) - 0.95).abs() < 1e-9 && (mixture(lo1) - 0.05).abs() < 1e-9);
    }

    #[test]
    fn every_latency_and_throughput_key_has_its_metric_and_counts_have_none() {
        assert_eq!(residual_metrics("p95_tpot_ms"), Some(&["p99_itl_ms"][..]));
        assert_eq!(
            residual_metrics("mean_ttft_ms"),
            Some(&["median_ttft_ms"][..])
        );
        assert_eq!(
            residual_metrics("request_throughput"),
            Some(&["output_throughput"][..])
        );
        for k in [
            "completed",
            "std_ttft_ms",
            "duration",
            "slo_attainment",
            "peak_kv_usage",
        ] {
            assert_eq!(residual_metrics(k), None, "{k}");
        }
    }

    #[test]
    fn other_seeds_move_the_seed_and_take_the_calibrations_draws_in_turn() {
        use crate::calibration::Coefficients;
        let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/baseline.toml");
        let mut setup = crate::setup::load(file, &[]).unwrap();
        let mut cal = setup.calibration.clone().unwrap();
        let draw = |e: f64| Coefficients {
            compute_efficiency: e,
            ..Coefficients::of(&cal)
        };
        cal.draws = std::sync::Arc::from([draw(0.2), draw(0.3)]);
        setup.set_calibration(cal).unwrap();
        let seed = setup.scenario.workload.seed;
        let others = other_seeds(&setup, 4);
        let got: Vec<(u64, f64)> = others
            .iter()
            .map(|s| {
                let c = s.calibration.as_ref().unwrap();
                (s.scenario.workload.seed - seed, c.compute_efficiency)
            })
            .collect();
        assert_eq!(got, [(1, 0.2), (2, 0.3), (3, 0.2)]);
        // The given seed's setup keeps the fitted coefficients.
        assert_ne!(setup.calibration.unwrap().compute_efficiency, 0.2);
    }

    #[test]
    fn a_left_out_group_gives_none_of_its_errors() {
        let r = |group: &str, e: f64| Residual {
            run: format!("{group} run"),
            group: group.into(),
            held_out: false,
            errors: [("median_ttft_ms".to_string(), e)].into(),
        };
        let residuals = [r("a", 0.5), r("b", -0.1), r("b", 0.1)];
        assert_eq!(
            errors_of(&residuals, &["median_ttft_ms"], Some("a")),
            vec![-0.1, 0.1]
        );
        assert_eq!(errors_of(&residuals, &["median_ttft_ms"], None).len(), 3);
        assert!(errors_of(&residuals, &["p99_itl_ms"], None).is_empty());
    }
}
