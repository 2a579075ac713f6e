//! The metrics the tables show, each with its summary.json key, how it is printed, which
//! direction is better, and how much worse a candidate may be before it is a regression.
//!
//! Regression thresholds (candidate vs baseline, in the metric's bad direction):
//!
//! | metric                      | flagged when                  |
//! |-----------------------------|-------------------------------|
//! | output throughput           | more than 5% lower            |
//! | TTFT / ITL / latency P50    | more than 10% higher          |
//! | TTFT / ITL / latency P99    | more than 20% higher          |
//! | errors (failed requests)    | any increase                  |
//!
//! Tails get a wider band because a P99 over a few hundred requests rests on a handful of
//! them and moves more from run to run than a median does.

use crate::run::Run;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Better {
    Higher,
    Lower,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Metric {
    /// Row label with unit, as in the benchmark log ("TTFT P50 (ms)").
    pub name: &'static str,
    /// Without unit, for comparison tables ("TTFT P50").
    pub short: &'static str,
    /// summary.json key.
    pub key: &'static str,
    /// Multiplies the summary value into the printed unit (ms → s for latency).
    pub scale: f64,
    /// Decimals printed, at the least (see [`Metric::format`]).
    pub decimals: usize,
    /// Significant digits printed, at the least: a sub-millisecond ITL on a CPU shows as
    /// 0.41, not 0, while the log's tens of milliseconds keep no decimals.
    pub significant: usize,
    pub better: Better,
    /// How much worse, in percent, a candidate may be before it is flagged.
    pub threshold_pct: f64,
}

pub const THROUGHPUT: Metric = Metric {
    name: "Throughput (tok/s)",
    short: "Throughput",
    key: "output_throughput",
    scale: 1.0,
    decimals: 1,
    significant: 0,
    better: Better::Higher,
    threshold_pct: 5.0,
};
pub const TTFT_P50: Metric = latency("TTFT P50 (ms)", "TTFT P50", "median_ttft_ms", 10.0);
pub const TTFT_P99: Metric = latency("TTFT P99 (ms)", "TTFT P99", "p99_ttft_ms", 20.0);
pub const ITL_P50: Metric = latency("ITL P50 (ms)", "ITL P50", "median_itl_ms", 10.0);
pub const ITL_P99: Metric = latency("ITL P99 (ms)", "ITL P99", "p99_itl_ms", 20.0);
pub const LATENCY_P50: Metric = seconds("Latency P50 (s)", "Latency P50", "median_e2el_ms", 10.0);
pub const LATENCY_P99: Metric = seconds("Latency P99 (s)", "Latency P99", "p99_e2el_ms", 20.0);
pub const ERRORS: Metric = Metric {
    name: "Errors",
    short: "Errors",
    key: "failed",
    scale: 1.0,
    decimals: 0,
    significant: 0,
    better: Better::Lower,
    threshold_pct: 0.0,
};

/// The rows of the benchmark log's per-workload tables, in its order.
pub const LOG_ROWS: [Metric; 7] = [
    THROUGHPUT,
    TTFT_P50,
    TTFT_P99,
    ITL_P50,
    ITL_P99,
    LATENCY_P50,
    ERRORS,
];

/// The rows of a comparison against a baseline: the log's, and the latency P99 its
/// regression thresholds name.
pub const BASELINE_ROWS: [Metric; 8] = [
    THROUGHPUT,
    TTFT_P50,
    TTFT_P99,
    ITL_P50,
    ITL_P99,
    LATENCY_P50,
    LATENCY_P99,
    ERRORS,
];

const fn latency(name: &'static str, short: &'static str, key: &'static str, t: f64) -> Metric {
    Metric {
        name,
        short,
        key,
        scale: 1.0,
        decimals: 0,
        significant: 2,
        better: Better::Lower,
        threshold_pct: t,
    }
}

const fn seconds(name: &'static str, short: &'static str, key: &'static str, t: f64) -> Metric {
    Metric {
        name,
        short,
        key,
        scale: 1e-3,
        decimals: 3,
        significant: 2,
        better: Better::Lower,
        threshold_pct: t,
    }
}

/// `v` with `decimals` decimals, more where it needs them to show `significant` digits
/// (at most 6).
pub fn format_digits(v: f64, decimals: usize, significant: usize) -> String {
    let mut decimals = decimals;
    if significant > 0 && v != 0.0 && v.is_finite() {
        // Digits before the point (0 for 0.41, -1 for 0.041).
        let integer = v.abs().log10().floor() as i64 + 1;
        decimals = decimals.max((significant as i64 - integer).clamp(0, 6) as usize);
    }
    format!("{v:.decimals$}")
}

impl Metric {
    /// The value in the printed unit.
    pub fn value(&self, run: &Run) -> Option<f64> {
        run.metric(self.key).map(|v| v * self.scale)
    }

    /// `decimals` decimals, more where the value needs them for `significant` digits.
    pub fn format(&self, v: Option<f64>) -> String {
        v.map_or_else(
            || "–".into(),
            |v| format_digits(v, self.decimals, self.significant),
        )
    }

    /// The value as a table cell: with its 90% interval, `value [lo–hi]`, where the run has
    /// one (a prediction's summary.json keeps it as `KEY_lo` and `KEY_hi`).
    pub fn cell(&self, run: &Run) -> String {
        let value = self.format(self.value(run));
        let bound = |end: &str| run.metric(&format!("{}_{end}", self.key));
        match (bound("lo"), bound("hi")) {
            (Some(lo), Some(hi)) => format!(
                "{value} [{}–{}]",
                self.format(Some(lo * self.scale)),
                self.format(Some(hi * self.scale))
            ),
            _ => value,
        }
    }

    /// How much worse `cand` is than `base`, in percent (negative: better); infinite when
    /// the baseline is zero and the candidate is worse.
    pub fn worse_pct(&self, base: f64, cand: f64) -> f64 {
        let worse_by = match self.better {
            Better::Higher => base - cand,
            Better::Lower => cand - base,
        };
        if base == 0.0 {
            return match worse_by {
                w if w > 0.0 => f64::INFINITY,
                w if w < 0.0 => f64::NEG_INFINITY,
                _ => 0.0,
            };
        }
        worse_by / base.abs() * 100.0
    }

    pub fn regressed(&self, base: f64, cand: f64) -> bool {
        self.worse_pct(base, cand) > self.threshold_pct
    }
}

/// Relative change in percent, as the log prints deltas; `None` from a zero baseline.
pub fn change_pct(base: f64, cand: f64) -> Option<f64> {
    match base {
        _ if base == cand => Some(0.0),
        0.0 => None,
        _ => Some((cand - base) / base.abs() * 100.0),
    }
}

/// "+874%", "-1%", "0%".
pub fn format_pct(p: Option<f64>) -> String {
    match p {
        None => "n/a".into(),
        Some(p) if p.round() == 0.0 => "0%".into(),
        Some(p) => format!("{p:+.0}%"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_follow_the_metric_direction() {
        assert!(THROUGHPUT.regressed(100.0, 94.0), "-6% throughput");
        assert!(!THROUGHPUT.regressed(100.0, 96.0), "-4% is within noise");
        assert!(
            !THROUGHPUT.regressed(100.0, 200.0),
            "faster is never a regression"
        );
        assert!(TTFT_P50.regressed(100.0, 111.0));
        assert!(!TTFT_P99.regressed(100.0, 119.0), "tails get 20%");
        assert!(TTFT_P99.regressed(100.0, 121.0));
        assert!(ERRORS.regressed(0.0, 1.0), "any new error");
        assert!(!ERRORS.regressed(0.0, 0.0));
    }

    #[test]
    fn values_keep_two_significant_digits_where_the_log_has_none() {
        let f = |m: Metric, v: f64| m.format(Some(v));
        assert_eq!(f(TTFT_P50, 255.4), "255");
        assert_eq!(f(TTFT_P50, 86.2), "86");
        assert_eq!(f(TTFT_P50, 8.71), "8.7");
        assert_eq!(f(ITL_P50, 0.411), "0.41");
        assert_eq!(f(ITL_P50, 0.0412), "0.041");
        assert_eq!(f(ITL_P50, 0.0), "0");
        assert_eq!(f(LATENCY_P50, 0.1771), "0.177");
        assert_eq!(f(THROUGHPUT, 2048.23), "2048.2");
        assert_eq!(f(ERRORS, 3.0), "3");
        assert_eq!(ITL_P50.format(None), "–");
    }

    #[test]
    fn percentages_print_like_the_log() {
        assert_eq!(format_pct(change_pct(22.5, 219.3)), "+875%");
        assert_eq!(format_pct(change_pct(276.6, 272.6)), "-1%");
        assert_eq!(format_pct(change_pct(77.0, 77.2)), "0%");
        assert_eq!(format_pct(change_pct(0.0, 3.0)), "n/a");
        assert_eq!(format_pct(change_pct(0.0, 0.0)), "0%");
    }
}
