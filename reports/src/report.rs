//! `report.md` for a set of run directories: per scenario, the log's table, phase-vs-phase
//! comparisons, per-stage and concurrency tables and the charts; then, with a baseline,
//! every run of the baseline's scenario against it, with regressions flagged. `sim report` and `engine report` call
//! [`write_report`].

use crate::error::ReportError;
use infer_core::FileError;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::chart::Figure;
use crate::compare::{against_baseline, phase_comparisons, Regression};
use crate::figures;
use crate::load::{concurrency_table, load_points, load_table};
use crate::run::{labels, series_labels, Run};
use crate::tables::{by_scenario, run_details, runs_table, workload_table};

/// What a report wrote and found.
#[derive(Debug, Clone)]
pub struct Report {
    pub path: PathBuf,
    /// PNG and SVG files, under `<out>/charts/`.
    pub charts: Vec<PathBuf>,
    /// Candidates worse than the baseline beyond a metric's threshold (empty without one).
    pub regressions: Vec<Regression>,
}

/// Loads the runs (the baseline first, if given and not among them) and writes
/// `<out>/report.md` and its charts.
pub fn write_report(
    dirs: &[PathBuf],
    baseline: Option<&Path>,
    out: &Path,
) -> Result<Report, ReportError> {
    let mut runs = Vec::new();
    let same = |a: &Path, b: &Path| a.canonicalize().ok() == b.canonicalize().ok();
    if let Some(b) = baseline {
        if !dirs.iter().any(|d| same(d, b)) {
            runs.push(Run::load(b)?);
        }
    }
    for d in dirs {
        runs.push(Run::load(d)?);
    }
    let base_index = baseline.and_then(|b| runs.iter().position(|r| same(&r.dir, b)));
    render(&runs, base_index, out)
}

/// The report of loaded runs; `baseline` indexes `runs`.
pub fn render(runs: &[Run], baseline: Option<usize>, out: &Path) -> Result<Report, ReportError> {
    if runs.is_empty() {
        return Err(ReportError::NoRuns);
    }
    std::fs::create_dir_all(out).map_err(FileError::at(out, "create"))?;
    let all: Vec<&Run> = runs.iter().collect();
    let names = labels(&all);
    let charts_dir = out.join("charts");
    let mut md = String::from("# Serving report\n\n");
    let mut charts = Vec::new();

    let mut regressions = Vec::new();
    let mut baseline_md = String::new();
    if let Some(b) = baseline {
        // Only runs of the baseline's scenario: across workloads every metric moves and a
        // flag would mean nothing.
        let scenario = runs[b].scenario();
        let candidates: Vec<(String, &Run)> = (0..runs.len())
            .filter(|&i| i != b && runs[i].scenario() == scenario)
            .map(|i| (names[i].clone(), &runs[i]))
            .collect();
        if !candidates.is_empty() {
            let (table, found) = against_baseline((&names[b], &runs[b]), &candidates);
            baseline_md = format!(
                "## Against the baseline ({}, scenario {scenario})\n\n{}\n{}\n",
                names[b],
                table.render(),
                THRESHOLDS
            );
            regressions = found;
        }
        md += &match regressions.len() {
            0 => format!("No regressions against the baseline `{}`.\n\n", names[b]),
            n => {
                let mut s = format!(
                    "**{n} regression(s) against the baseline `{}`:**\n\n",
                    names[b]
                );
                for r in &regressions {
                    let _ = writeln!(s, "- ⚠ {r}");
                }
                s + "\n"
            }
        };
    }

    md += &format!(
        "## Runs\n\n{}\n### Run details\n\n{}\n",
        runs_table(&all, &names).render(),
        run_details(&all, &names)
    );

    for (scenario, group) in by_scenario(&all) {
        let local = labels(&group);
        let description = group[0]
            .info
            .as_ref()
            .map_or("", |i| i.description.as_str());
        let _ = write!(md, "## {scenario}\n\n");
        if !description.is_empty() {
            let _ = write!(md, "{description}\n\n");
        }
        md += &workload_table(&group, &local).render();
        md += "\n";
        for c in phase_comparisons(&group) {
            let _ = write!(md, "### {}\n\n{}\n", c.title(), c.table.render());
        }

        let mut figures = vec![
            figures::ttft_cdf(&group, &local),
            figures::itl_cdf(&group, &local),
            figures::waiting_vs_time(&group, &local),
            figures::kv_usage_vs_time(&group, &local),
        ];

        // Load figures: every stage of a staged run and every run with a fixed rate is a
        // point; worth a chart when a series has more than one.
        let series = series_labels(&group);
        let mut load_series: Vec<(String, Vec<crate::load::LoadPoint>)> = Vec::new();
        for ((r, s), l) in group.iter().zip(&series).zip(&local) {
            let pts = load_points(r);
            if pts.len() > 1 {
                let _ = write!(
                    md,
                    "### Per-stage results — {l}\n\n{}\n",
                    load_table(&pts).render()
                );
            }
            match load_series.iter_mut().find(|(n, _)| n == s) {
                Some((_, v)) => v.extend(pts),
                None => load_series.push((s.clone(), pts)),
            }
        }
        for (_, pts) in &mut load_series {
            pts.sort_by(|a, b| a.qps.total_cmp(&b.qps));
        }
        if load_series.iter().any(|(_, p)| p.len() > 1) {
            figures.extend(figures::qps_figures(&load_series));
        }

        let sweep: Vec<usize> = (0..group.len())
            .filter(|&i| group[i].concurrency().is_some())
            .collect();
        if sweep.len() > 1 {
            let runs: Vec<&Run> = sweep.iter().map(|&i| group[i]).collect();
            let l: Vec<String> = sweep.iter().map(|&i| local[i].clone()).collect();
            let s: Vec<String> = sweep.iter().map(|&i| series[i].clone()).collect();
            let _ = write!(
                md,
                "### Concurrency sweep\n\n{}\n",
                concurrency_table(&runs, &l).render()
            );
            figures.push(figures::concurrency_figure(&runs, &s));
        }

        for (r, l) in group.iter().zip(&local) {
            if r.replicas() > 1 && r.timeseries.height() > 0 {
                let name = format!("replica_load_{}", slug(&r.dir_name()));
                figures.push(figures::replica_load(r, l, &name));
            }
        }

        md += "### Charts\n\n";
        for mut f in figures.into_iter().filter(Figure::has_data) {
            f.name = format!("{}_{}", slug(&scenario), f.name);
            charts.extend(f.render(&charts_dir)?);
            let _ = write!(
                md,
                "![{t}](charts/{n}.png)  \n{t} ([SVG](charts/{n}.svg))\n\n",
                t = f.title,
                n = f.name
            );
        }
        md += ITL_NOTE;
    }
    md += &baseline_md;

    let path = out.join("report.md");
    std::fs::write(&path, md).map_err(FileError::at(&path, "write"))?;
    Ok(Report {
        path,
        charts,
        regressions,
    })
}

const THRESHOLDS: &str = "A candidate is flagged (⚠) when worse than the baseline by more \
than: throughput 5% lower; TTFT, ITL or latency P50 10% higher; P99 20% higher; any \
increase in errors.\n";

const ITL_NOTE: &str = "ITL percentiles in the tables pool every gap between tokens \
(vLLM's definition); the ITL CDF plots each request's mean gap, since requests.csv keeps \
one row per request.\n\n";

/// A file-name-safe form of a label.
fn slug(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '-' | '_' => c,
            _ => '_',
        })
        .collect()
}
