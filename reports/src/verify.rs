//! Predicted vs measured: a simulator run against an engine run of the same scenario. Both
//! drive the same core, so the errors here measure the cost model.

use crate::error::ReportError;
use infer_core::FileError;
use std::path::{Path, PathBuf};

use crate::chart::Figure;
use crate::figures::cdf_panel;
use crate::markdown::Table;
use crate::metric::{self, Metric};
use crate::run::Run;

/// The metrics compared, in this order.
pub const VERIFY_METRICS: [Metric; 7] = [
    metric::TTFT_P50,
    metric::TTFT_P99,
    metric::ITL_P50,
    metric::ITL_P99,
    metric::LATENCY_P50,
    metric::LATENCY_P99,
    metric::THROUGHPUT,
];

#[derive(Debug, Clone, PartialEq)]
pub struct VerifyRow {
    pub metric: Metric,
    pub predicted: Option<f64>,
    pub measured: Option<f64>,
    /// (predicted − measured) / measured, in percent; `None` without both or from a zero
    /// measurement.
    pub error_pct: Option<f64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Verification {
    pub rows: Vec<VerifyRow>,
    /// Median of |error %| over the rows that have one.
    pub median_abs_error_pct: Option<f64>,
}

pub fn predicted_vs_measured(predicted: &Run, measured: &Run) -> Verification {
    Verification::from_values(
        VERIFY_METRICS
            .iter()
            .map(|m| (*m, m.value(predicted), m.value(measured))),
    )
}

impl Verification {
    fn from_values(values: impl Iterator<Item = (Metric, Option<f64>, Option<f64>)>) -> Self {
        let rows: Vec<VerifyRow> = values
            .map(|(metric, p, me)| VerifyRow {
                metric,
                predicted: p,
                measured: me,
                error_pct: match (p, me) {
                    (Some(p), Some(me)) if me != 0.0 => Some((p - me) / me.abs() * 100.0),
                    _ => None,
                },
            })
            .collect();
        let abs: Vec<f64> = rows
            .iter()
            .filter_map(|r| r.error_pct.map(f64::abs))
            .collect();
        Verification {
            median_abs_error_pct: median(abs),
            rows,
        }
    }

    /// Repetitions of one comparison (rows in the same order): per metric, the median of
    /// the predictions against the median of the measurements, so that the drift of a
    /// noisy machine between repetitions averages out instead of landing on one side.
    pub fn combine(reps: &[Verification]) -> Verification {
        let Some(first) = reps.first() else {
            return Verification::from_values(std::iter::empty());
        };
        Verification::from_values(first.rows.iter().enumerate().map(|(i, row)| {
            let of = |get: fn(&VerifyRow) -> Option<f64>| {
                median(
                    reps.iter()
                        .filter_map(|v| v.rows.get(i).and_then(get))
                        .collect(),
                )
            };
            (row.metric, of(|r| r.predicted), of(|r| r.measured))
        }))
    }
}

/// Median by linear interpolation (the mean of the middle two for an even count).
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(match n % 2 {
        1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    })
}

impl Verification {
    pub fn table(&self) -> Table {
        let mut t = Table::new(["Metric", "Predicted", "Measured", "Error"]);
        for r in &self.rows {
            let err = r.error_pct.map_or("n/a".into(), |e| format!("{e:+.1}%"));
            t.row([
                r.metric.name.to_string(),
                r.metric.format(r.predicted),
                r.metric.format(r.measured),
                err,
            ]);
        }
        t
    }

    pub fn markdown(&self) -> String {
        let mae = self
            .median_abs_error_pct
            .map_or("n/a".into(), |e| format!("{e:.1}%"));
        format!("{}\nMedian absolute error: {mae}\n", self.table().render())
    }
}

/// TTFT, ITL (per-request mean) and E2E CDFs of both runs overlaid.
pub fn verify_figures(predicted: &Run, measured: &Run) -> Vec<Figure> {
    let runs = [predicted, measured];
    let labels = ["predicted".to_string(), "measured".to_string()];
    let mut itl = cdf_panel(&runs, &labels, "itl_mean_ms", "ITL");
    itl.title = "ITL CDF (per-request mean ITL): predicted vs measured".into();
    itl.x_label = "Mean inter-token latency of a request (ms)".into();
    let mut ttft = cdf_panel(&runs, &labels, "ttft_ms", "TTFT");
    ttft.title = "TTFT CDF: predicted vs measured".into();
    let mut e2e = cdf_panel(&runs, &labels, "e2e_ms", "End-to-end latency");
    e2e.title = "E2E latency CDF: predicted vs measured".into();
    vec![
        Figure::single("verify_ttft_cdf", ttft),
        Figure::single("verify_itl_cdf", itl),
        Figure::single("verify_e2e_cdf", e2e),
    ]
}

/// Writes `verify.md` (the table, the median absolute error and the overlaid CDFs) into
/// `out`; returns its path. What `engine verify` calls.
pub fn write_verify_report(
    predicted: &Path,
    measured: &Path,
    out: &Path,
) -> Result<PathBuf, ReportError> {
    let (p, m) = (Run::load(predicted)?, Run::load(measured)?);
    let v = predicted_vs_measured(&p, &m);
    let mut md = format!(
        "# Predicted vs measured\n\nPredicted: `{}`  \nMeasured: `{}`\n\nError = (predicted − measured) / measured.\n\n",
        predicted.display(),
        measured.display()
    );
    md.push_str(&v.markdown());
    let charts = out.join("charts");
    for f in verify_figures(&p, &m) {
        if f.has_data() {
            f.render(&charts)?;
            md.push_str(&format!(
                "\n![{t}](charts/{n}.png) ([SVG](charts/{n}.svg))\n",
                t = f.title,
                n = f.name
            ));
        }
    }
    let path = out.join("verify.md");
    std::fs::write(&path, md).map_err(FileError::at(&path, "write"))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetitions_combine_by_the_median_of_each_side() {
        let rep = |p: f64, m: f64| {
            Verification::from_values(
                [
                    (metric::TTFT_P50, Some(p), Some(m)),
                    (metric::THROUGHPUT, None, Some(m)),
                ]
                .into_iter(),
            )
        };
        let v = Verification::combine(&[rep(10.0, 8.0), rep(30.0, 10.0), rep(12.0, 12.0)]);
        assert_eq!(v.rows.len(), 2);
        assert_eq!(
            (v.rows[0].predicted, v.rows[0].measured),
            (Some(12.0), Some(10.0))
        );
        assert!((v.rows[0].error_pct.unwrap() - 20.0).abs() < 1e-9);
        assert_eq!((v.rows[1].predicted, v.rows[1].error_pct), (None, None));
        assert_eq!(v.median_abs_error_pct, v.rows[0].error_pct);
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
    }
}
