//! Comparisons between runs: the log's "Phase N vs N−1" tables (each cell
//! `before → after (±x%)`), and regression flags of candidates against a baseline.

use std::fmt;

use crate::markdown::Table;
use crate::metric::{change_pct, format_pct, Metric, BASELINE_ROWS, LOG_ROWS};
use crate::run::Run;

/// One metric of a baseline and a candidate run.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    pub metric: Metric,
    pub base: Option<f64>,
    pub cand: Option<f64>,
}

impl Delta {
    pub fn change_pct(&self) -> Option<f64> {
        change_pct(self.base?, self.cand?)
    }

    pub fn regressed(&self) -> bool {
        match (self.base, self.cand) {
            (Some(b), Some(c)) => self.metric.regressed(b, c),
            _ => false,
        }
    }

    /// `22.5 → 219.3 (+875%)`, with a warning sign when past the metric's threshold.
    pub fn cell(&self) -> String {
        let m = &self.metric;
        let flag = if self.regressed() { " ⚠" } else { "" };
        format!(
            "{} → {} ({}){flag}",
            m.format(self.base),
            m.format(self.cand),
            format_pct(self.change_pct())
        )
    }
}

pub fn compare(base: &Run, cand: &Run, metrics: &[Metric]) -> Vec<Delta> {
    metrics
        .iter()
        .map(|m| Delta {
            metric: *m,
            base: m.value(base),
            cand: m.value(cand),
        })
        .collect()
}

/// A metric of a candidate that is worse than the baseline beyond its threshold.
#[derive(Debug, Clone, PartialEq)]
pub struct Regression {
    pub baseline: String,
    pub candidate: String,
    pub metric: &'static str,
    pub base: f64,
    pub cand: f64,
    /// How much worse, in percent (infinite from a zero baseline).
    pub worse_pct: f64,
    pub threshold_pct: f64,
}

impl fmt::Display for Regression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let worse = match self.worse_pct.is_finite() {
            true => format!("{:.0}% worse", self.worse_pct),
            false => "worse".into(),
        };
        write!(
            f,
            "{}: {} {} → {} ({worse} than {}; threshold {:.0}%)",
            self.candidate,
            self.metric,
            trim(self.base),
            trim(self.cand),
            self.baseline,
            self.threshold_pct
        )
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Each candidate against the baseline on the log's metrics: a table with one column per
/// candidate, and the regressions among its cells.
pub fn against_baseline(
    baseline: (&str, &Run),
    candidates: &[(String, &Run)],
) -> (Table, Vec<Regression>) {
    let (base_label, base) = baseline;
    let mut header = vec!["Metric".to_string()];
    header.extend(
        candidates
            .iter()
            .map(|(l, _)| format!("{base_label} → {l}")),
    );
    let mut t = Table::new(header);
    let deltas: Vec<Vec<Delta>> = candidates
        .iter()
        .map(|(_, c)| compare(base, c, &BASELINE_ROWS))
        .collect();
    for (i, m) in BASELINE_ROWS.iter().enumerate() {
        t.row(std::iter::once(m.name.to_string()).chain(deltas.iter().map(|d| d[i].cell())));
    }
    let regressions = candidates
        .iter()
        .zip(&deltas)
        .flat_map(|((label, _), ds)| {
            ds.iter().filter(|d| d.regressed()).map(|d| Regression {
                baseline: base_label.to_string(),
                candidate: label.clone(),
                metric: d.metric.short,
                base: d.base.unwrap_or(f64::NAN),
                cand: d.cand.unwrap_or(f64::NAN),
                worse_pct: d
                    .metric
                    .worse_pct(d.base.unwrap_or(0.0), d.cand.unwrap_or(0.0)),
                threshold_pct: d.metric.threshold_pct,
            })
        })
        .collect();
    (t, regressions)
}

/// The leading number of a phase name ("P7 chunked" → 7).
pub fn phase_number(phase: &str) -> Option<u32> {
    let digits: String = phase
        .strip_prefix('P')?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// A "Phase N vs N−1" table: one scenario, two phases, one column per model and setting.
#[derive(Debug, Clone)]
pub struct PhaseComparison {
    pub scenario: String,
    pub from: u32,
    pub to: u32,
    pub table: Table,
}

impl PhaseComparison {
    pub fn title(&self) -> String {
        format!(
            "Phase {} vs Phase {} — {}",
            self.to, self.from, self.scenario
        )
    }
}

/// For each scenario and setting, runs ordered by phase; every step to the next phase
/// present becomes a column of that (scenario, from, to) table. A step's two runs share
/// everything but the techniques that make the phases ([`apart_from_phase`]): runs of two
/// phases on other hardware or at another load are not a step (they were, and the table
/// credited a 25× faster GPU to chunked prefill). Runs of one phase that differ in other
/// knobs are left to `--baseline` comparisons, and so are runs off the log's ladder
/// ("P6 paged + prefix-caching").
pub fn phase_comparisons(runs: &[&Run]) -> Vec<PhaseComparison> {
    let mut out: Vec<(PhaseComparison, Vec<Vec<Delta>>)> = Vec::new();
    for (scenario, group) in crate::tables::by_scenario(runs) {
        let mut settings: Vec<(String, Vec<(u32, &Run)>)> = Vec::new();
        for r in &group {
            let phase = r.phase();
            let (Some(key), Some(p)) = (apart_from_phase(r), phase_number(&phase)) else {
                continue;
            };
            if phase.contains('+') {
                continue;
            }
            match settings.iter_mut().find(|(k, _)| *k == key) {
                Some((_, steps)) => steps.push((p, r)),
                None => settings.push((key, vec![(p, r)])),
            }
        }
        for (_, mut steps) in settings {
            // Stable: of two runs of one phase, the first given is the one compared.
            steps.sort_by_key(|(p, _)| *p);
            steps.dedup_by_key(|(p, _)| *p);
            for pair in steps.windows(2) {
                let ((from, base), (to, cand)) = (pair[0], pair[1]);
                let deltas = compare(base, cand, &LOG_ROWS);
                let model = cand.model();
                let mut column = format!("{model} P{from} → P{to}").trim().to_string();
                let slot = out
                    .iter_mut()
                    .find(|(c, _)| c.scenario == scenario && c.from == from && c.to == to);
                if slot
                    .as_ref()
                    .is_some_and(|(c, _)| c.table.header.contains(&column))
                {
                    // The same step in another setting: told apart by its runs.
                    column = format!("{column} ({} → {})", base.dir_name(), cand.dir_name());
                }
                match slot {
                    Some((c, cols)) => {
                        c.table.header.push(column);
                        cols.push(deltas);
                    }
                    None => out.push((
                        PhaseComparison {
                            scenario: scenario.clone(),
                            from,
                            to,
                            table: Table::new(["Metric".to_string(), column]),
                        },
                        vec![deltas],
                    )),
                }
            }
        }
    }
    out.into_iter()
        .map(|(mut c, cols)| {
            for (i, m) in LOG_ROWS.iter().enumerate() {
                c.table.row(
                    std::iter::once(m.name.to_string()).chain(cols.iter().map(|d| d[i].cell())),
                );
            }
            c
        })
        .collect()
}

/// Everything a run was run with but the techniques that make the benchmark log's phases
/// (batching, KV backend, chunked prefill, prefix caching, CUDA graphs) and the batch and
/// pool sizes the log changes with its KV backend (paged blocks let P6 run 24 sequences
/// where P5's contiguous slots ran 8): which driver, the server's other settings (model,
/// hardware, context…), the workload, the arrivals, the seed and the cluster. `None` for a run without
/// `run.json`. (An engine run's GPU is not in `run.json`: two engine runs on two GPUs
/// still pair.)
fn apart_from_phase(r: &Run) -> Option<String> {
    let i = r.info.as_ref()?;
    let ladder = infer_core::workload::ServerSpec::default();
    let server = infer_core::workload::ServerSpec {
        batching_mode: ladder.batching_mode,
        kv_cache_backend: ladder.kv_cache_backend,
        chunked_prefill: ladder.chunked_prefill,
        prefix_caching: ladder.prefix_caching,
        cuda_graphs: ladder.cuda_graphs,
        max_batch_size: ladder.max_batch_size,
        num_gpu_blocks: ladder.num_gpu_blocks,
        block_size: ladder.block_size,
        ..i.server.clone()
    };
    let setup = (
        &i.source,
        server,
        i.workload.as_ref().map(resolved_workload),
        &i.arrival,
        i.seed,
        i.replicas,
        i.router,
    );
    serde_json::to_string(&setup).ok()
}

/// A run's `[workload]` as it was resolved: parsed, so that a default written out and the
/// same default left out read the same (the table as written where it does not parse, as a
/// newer version's keys would not).
fn resolved_workload(table: &serde_json::Value) -> String {
    match serde_json::from_value::<infer_core::workload::WorkloadSpec>(table.clone()) {
        Ok(spec) => format!("{spec:?}"),
        Err(_) => table.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_numbers_parse_from_core_phase_names() {
        assert_eq!(phase_number("P7 chunked"), Some(7));
        assert_eq!(phase_number("P10 something"), Some(10));
        assert_eq!(phase_number("static"), None);
    }

    #[test]
    fn a_regression_reads_as_a_sentence() {
        let r = Regression {
            baseline: "P7".into(),
            candidate: "P8".into(),
            metric: "TTFT P50",
            base: 100.0,
            cand: 125.0,
            worse_pct: 25.0,
            threshold_pct: 10.0,
        };
        assert_eq!(
            r.to_string(),
            "P8: TTFT P50 100 → 125 (25% worse than P7; threshold 10%)"
        );
    }
}
