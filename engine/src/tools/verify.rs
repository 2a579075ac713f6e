//! `engine verify`: predict → verify in one command. Profile the engine (or reuse a
//! profile), predict each scenario with the simulator on that profile, run the real server
//! and the bench client on the same scenario and seed, and write a predicted-vs-measured
//! table with overlaid charts. Both sides run the same core scheduler and the same prompts
//! (cut in the served model's own tokens), so the error measures the cost model.
//!
//! With `--measured DIR` nothing is profiled or served: the measurements and profiles kept
//! by an earlier `verify --out DIR` are predicted again. A change to the simulator is then
//! judged against the very runs it was judged against before, free of the drift that moves
//! a shared machine's figures between two measurements by as much as the change itself.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use infer_core::metrics::Summary;
use infer_core::workload::{Scenario, Tokenizer};

use infer_reports::verify::median;

use crate::loadgen::{self, BenchOptions};
use crate::server::step_log::{self, StepRecord};
use crate::server::{spawn_local, ServeConfig};
use crate::tools::profile::{profile_model, Target};

pub struct VerifyOptions {
    pub scenarios: Vec<PathBuf>,
    pub model: String,
    /// Where the model is profiled and served.
    pub target: Target,
    /// Reuse this profile instead of measuring one.
    pub profile: Option<PathBuf>,
    pub out: PathBuf,
    /// Overrides applied to every scenario (`key=value`).
    pub overrides: Vec<String>,
    /// A smaller profiling grid.
    pub quick_profile: bool,
    /// Profile, predict and measure this many times; the table compares the median
    /// prediction with the median measurement of each figure.
    pub repeat: usize,
    /// Seeds each prediction runs under for its 90% interval (`sim run --seeds`).
    pub seeds: usize,
    /// Predict the measurements an earlier `verify --out` kept here instead of measuring
    /// (its repetitions' profiles unless `profile` is given).
    pub measured: Option<PathBuf>,
}

/// Where an earlier `verify --out dir` kept each repetition: `dir/rep1` … `dir/repN`, or
/// `dir` itself for a single one.
pub fn kept_repetitions(dir: &Path) -> Result<Vec<PathBuf>> {
    let reps: Vec<PathBuf> = (1..)
        .map(|r| dir.join(format!("rep{r}")))
        .take_while(|d| d.is_dir())
        .collect();
    if !reps.is_empty() {
        return Ok(reps);
    }
    anyhow::ensure!(
        dir.is_dir(),
        "{}: no such directory (--measured takes the --out of an earlier `engine verify`)",
        dir.display()
    );
    Ok(vec![dir.to_path_buf()])
}

/// One scenario's outcome.
pub struct VerifyResult {
    pub scenario: String,
    pub verification: infer_reports::Verification,
    /// The cost model against the steps the measured run took.
    pub steps: Vec<StepFidelity>,
    /// Where the prediction is fragile (`sim run`'s warnings: saturation, extrapolation, …).
    pub warnings: Vec<String>,
    pub report: PathBuf,
    /// Each repetition's prediction beside its measurement, for the intervals' check.
    pub samples: Vec<Sample>,
}

/// One repetition's prediction of a scenario and its measurement.
#[derive(Debug, Clone)]
pub struct Sample {
    pub predicted: Summary,
    /// The prediction under the other seeds.
    pub others: Vec<Summary>,
    /// The measured figures, by summary key.
    pub measured: Vec<(String, f64)>,
}

/// How often one scenario's measurements of one figure fell inside their 90% interval.
#[derive(Debug, Clone, PartialEq)]
pub struct IntervalCheck {
    pub scenario: String,
    /// The summary key.
    pub metric: String,
    pub inside: usize,
    pub n: usize,
    /// Each interval's width, percent of its predicted figure.
    pub widths_pct: Vec<f64>,
}

/// Each repetition's measurements against their prediction's 90% interval. A profile has no
/// recorded model errors, so a scenario's intervals take them from the *other* scenarios of
/// this verification (every repetition's `ln(measured / predicted)`): leave one scenario
/// out, so that no interval is built from the figures that test it. With one scenario there
/// are none: the intervals are the seeds' alone.
pub fn interval_checks(results: &[VerifyResult]) -> Vec<IntervalCheck> {
    use infer_sim::interval::{self, Residual};
    let residuals: Vec<Residual> = results
        .iter()
        .flat_map(|r| {
            r.samples.iter().enumerate().map(|(i, s)| {
                let predicted = s.predicted.entries();
                let figures = infer_sim::fit::FIT_METRICS.iter().filter_map(|&k| {
                    let m = s.measured.iter().find(|(key, _)| key == k)?.1;
                    let p = predicted.iter().find(|(key, _)| key == k)?.1;
                    Some((k.to_string(), m, p))
                });
                Residual::new(
                    format!("{} repetition {}", r.scenario, i + 1),
                    r.scenario.clone(),
                    true,
                    figures,
                )
            })
        })
        .collect();
    let mut out: Vec<IntervalCheck> = Vec::new();
    for r in results {
        for s in &r.samples {
            let ivs = interval::intervals(&s.predicted, &s.others, &residuals, Some(&r.scenario));
            for (key, measured) in &s.measured {
                let Some(iv) = ivs.iter().find(|i| i.key == *key) else {
                    continue;
                };
                let at = match out
                    .iter()
                    .position(|c| c.scenario == r.scenario && c.metric == *key)
                {
                    Some(i) => i,
                    None => {
                        out.push(IntervalCheck {
                            scenario: r.scenario.clone(),
                            metric: key.clone(),
                            inside: 0,
                            n: 0,
                            widths_pct: Vec::new(),
                        });
                        out.len() - 1
                    }
                };
                let check = &mut out[at];
                check.n += 1;
                check.inside += usize::from(iv.contains(*measured));
                check.widths_pct.push(iv.relative_width() * 100.0);
            }
        }
    }
    out
}

/// The checks as a table: one row per metric and a pooled one.
fn coverage_lines(checks: &[IntervalCheck], seeds: usize) -> String {
    if checks.is_empty() {
        return String::new();
    }
    let mut s = format!(
        "90% intervals ({seeds} seeds; each scenario's with the model errors of the other \
         scenarios here):\n\n| metric | inside | of | share | median width % |\n\
         |---|---:|---:|---:|---:|\n"
    );
    let mut metrics: Vec<&str> = Vec::new();
    for c in checks {
        if !metrics.contains(&c.metric.as_str()) {
            metrics.push(&c.metric);
        }
    }
    let row = |s: &mut String, name: &str, rows: Vec<&IntervalCheck>| {
        let inside: usize = rows.iter().map(|c| c.inside).sum();
        let n: usize = rows.iter().map(|c| c.n).sum();
        let widths: Vec<f64> = rows.iter().flat_map(|c| c.widths_pct.clone()).collect();
        s.push_str(&format!(
            "| {name} | {inside} | {n} | {:.0}% | {:.0} |\n",
            inside as f64 / n.max(1) as f64 * 100.0,
            median(widths).unwrap_or(0.0)
        ));
    };
    for m in metrics {
        row(&mut s, m, checks.iter().filter(|c| c.metric == m).collect());
    }
    row(&mut s, "pooled", checks.iter().collect());
    s
}

/// Predicted vs measured time of the steps of one kind in a step log.
#[derive(Debug, Clone, PartialEq)]
pub struct StepFidelity {
    /// `decode`, `prefill`, `mixed` or `all`.
    pub kind: &'static str,
    pub steps: usize,
    pub measured_s: f64,
    pub predicted_s: f64,
    /// Median over the steps of (predicted − measured) / measured, in %.
    pub median_error_pct: f64,
}

/// Compare `cost`'s step time with every logged step, by kind.
pub fn step_fidelity(
    steps: &[StepRecord],
    cost: &dyn infer_sim::cost::CostModel,
) -> Vec<StepFidelity> {
    let kind = |r: &StepRecord| match (r.shape.prefill_tokens > 0, r.shape.decode_seqs > 0) {
        (false, _) => "decode",
        (true, false) => "prefill",
        (true, true) => "mixed",
    };
    // A measured step includes its random pause: predict its mean too (a spread's factors
    // average 1). A step that started cold, one of the decode steps just after a prefill,
    // or one beside a request's path is priced as the simulator prices it. The log tells
    // how long the path was busy between two steps' starts, not when within that: the
    // overlap is taken as that time, at most the step's own (as `engine profile` measured
    // the loss), where the simulator counts only a path already busy as a step starts.
    let path = cost.client_path();
    let mut since_prefill = infer_sim::cost::SincePrefill::default();
    let priced: Vec<f64> = steps
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let idle = i.checked_sub(1).map(|p| r.idle_after(&steps[p]));
            let cold = cost
                .after_idle()
                .filter(|a| idle.is_some_and(|i| i >= a.idle_s));
            let at = since_prefill.next(r.shape.prefill_tokens);
            let after_prefill = cost.after_prefill().map_or(0.0, |a| a.extra(at));
            let base = cost.step_time(&r.shape) * cold.map_or(1.0, |a| a.factor);
            let path_s = match (r.path_busy_s, steps.get(i + 1).and_then(|n| n.path_busy_s)) {
                (Some(a), Some(b)) => (b - a).clamp(0.0, r.step_s),
                _ => 0.0,
            };
            base + path.overlap_late(base, path_s) + cost.step_jitter() + after_prefill
        })
        .collect();
    ["decode", "prefill", "mixed", "all"]
        .into_iter()
        .filter_map(|k| {
            let (of_kind, predicted): (Vec<&StepRecord>, Vec<f64>) = steps
                .iter()
                .zip(&priced)
                .filter(|(r, _)| k == "all" || kind(r) == k)
                .unzip();
            if of_kind.is_empty() {
                return None;
            }
            let errors = of_kind
                .iter()
                .zip(&predicted)
                .map(|(r, p)| (p / r.step_s - 1.0) * 100.0)
                .collect();
            Some(StepFidelity {
                kind: k,
                steps: of_kind.len(),
                measured_s: of_kind.iter().map(|r| r.step_s).sum(),
                predicted_s: predicted.iter().sum(),
                median_error_pct: median(errors).unwrap_or(0.0),
            })
        })
        .collect()
}

pub async fn verify(opts: &VerifyOptions) -> Result<Vec<VerifyResult>> {
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("{}: cannot create", opts.out.display()))?;
    // The tokenizer alone: the weights load where the model is profiled and served.
    let model = opts.model.clone();
    let dir = tokio::task::spawn_blocking(move || crate::tools::builtin::resolve(&model)).await??;
    let tokenizer: Arc<dyn Tokenizer> =
        Arc::new(crate::runtime::tokenizer::TextTokenizer::from_dir(&dir)?);
    let kept = match &opts.measured {
        Some(dir) => kept_repetitions(dir)?.into_iter().map(Some).collect(),
        None => vec![None; opts.repeat.max(1)],
    };
    let reps = kept.len();
    let mut runs: Vec<Vec<VerifyResult>> = Vec::with_capacity(reps);
    for (r, kept) in kept.iter().enumerate() {
        let out = if reps == 1 {
            opts.out.clone()
        } else {
            eprintln!("repetition {} of {reps}", r + 1);
            opts.out.join(format!("rep{}", r + 1))
        };
        runs.push(verify_once(opts, &out, kept.as_deref(), tokenizer.clone()).await?);
    }
    let last = runs.pop().expect("at least one repetition");
    Ok(last
        .into_iter()
        .enumerate()
        .map(|(i, res)| {
            let reps: Vec<&VerifyResult> = runs.iter().map(|r| &r[i]).chain([&res]).collect();
            let verifications: Vec<_> = reps.iter().map(|r| r.verification.clone()).collect();
            VerifyResult {
                scenario: res.scenario.clone(),
                verification: infer_reports::Verification::combine(&verifications),
                steps: combine_steps(&reps),
                warnings: res.warnings.clone(),
                report: res.report.clone(),
                samples: reps.iter().flat_map(|r| r.samples.clone()).collect(),
            }
        })
        .collect())
}

/// Step-time comparisons of repetitions, kind by kind: counts and times add up, the median
/// step error is the median of the repetitions' medians.
fn combine_steps(reps: &[&VerifyResult]) -> Vec<StepFidelity> {
    let mut out: Vec<StepFidelity> = Vec::new();
    for f in reps.iter().flat_map(|r| &r.steps) {
        match out.iter_mut().find(|o| o.kind == f.kind) {
            Some(o) => {
                o.steps += f.steps;
                o.measured_s += f.measured_s;
                o.predicted_s += f.predicted_s;
            }
            None => out.push(f.clone()),
        }
    }
    for o in &mut out {
        let medians = reps
            .iter()
            .flat_map(|r| &r.steps)
            .filter(|f| f.kind == o.kind)
            .map(|f| f.median_error_pct)
            .collect();
        o.median_error_pct = median(medians).unwrap_or(0.0);
    }
    out
}

/// One repetition: profile (unless a profile is given), then predict and measure each
/// scenario, writing under `out`; or, with `kept` (a repetition of an earlier verify),
/// predict what it measured, on its profile.
async fn verify_once(
    opts: &VerifyOptions,
    out: &Path,
    kept: Option<&Path>,
    tokenizer: Arc<dyn Tokenizer>,
) -> Result<Vec<VerifyResult>> {
    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let profile_path = match (&opts.profile, kept) {
        (Some(p), _) => p.clone(),
        (None, Some(kept)) => kept.join("profile.json"),
        (None, None) => {
            let path = out.join("profile.json");
            eprintln!("profiling {} …", opts.model);
            let profile = profile_model(&opts.model, opts.target, opts.quick_profile).await?;
            std::fs::write(&path, serde_json::to_string_pretty(&profile)? + "\n")
                .with_context(|| format!("{}: cannot write", path.display()))?;
            path
        }
    };
    let profile_abs = std::fs::canonicalize(&profile_path)
        .with_context(|| format!("{}: not found", profile_path.display()))?;

    let mut results = Vec::new();
    for scenario_path in &opts.scenarios {
        let file = scenario_path.display().to_string();
        let text = std::fs::read_to_string(scenario_path)
            .with_context(|| format!("{file}: cannot read scenario"))?;
        let scenario = Scenario::parse(&file, &text, &opts.overrides)?;
        let dir = out.join(&scenario.name);
        let measured_at = match kept {
            Some(kept) => {
                let at = kept.join(&scenario.name);
                check_kept_run(&at.join("measured"), &scenario)?;
                at
            }
            None => dir.clone(),
        };

        // Predict.
        let mut sim_overrides = opts.overrides.clone();
        sim_overrides.push("sim.cost_model=\"profiled\"".into());
        sim_overrides.push(format!(
            "sim.profile={:?}",
            profile_abs.display().to_string()
        ));
        let mut setup = infer_sim::prepare(&file, Scenario::parse(&file, &text, &sim_overrides)?)?;
        infer_sim::trust::check_fragility(&mut setup, &text, &sim_overrides)?;
        let mut files = infer_reports::RunDirWriter::create(&dir.join("predicted"))?
            .with_limit(setup.settings.max_output_bytes(), "sim.max_output_mib");
        let predicted = infer_sim::run_with(&setup, tokenizer.clone(), &mut files)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let others = infer_sim::interval::seeded_summaries(&setup, opts.seeds, cores)?;
        let intervals = infer_sim::interval::RunIntervals::of_summaries(
            &predicted.summary,
            &others,
            infer_sim::interval::residuals_of(&setup),
            None,
        );
        files.finish_with(
            &predicted.summary,
            &intervals.summary_keys(),
            &infer_sim::output::run_info(&setup, Some(&intervals)),
        )?;

        // Measure, or take the kept measurement.
        if kept.is_none() {
            measure(opts, scenario_path, &scenario, &tokenizer, &dir).await?;
        }
        let measured_dir = measured_at.join("measured");
        let steps_path = measured_at.join("measured-steps.csv");

        let report =
            infer_reports::write_verify_report(&dir.join("predicted"), &measured_dir, &dir)?;
        let p = infer_reports::Run::load(dir.join("predicted"))?;
        let m = infer_reports::Run::load(&measured_dir)?;
        let verification = infer_reports::predicted_vs_measured(&p, &m);
        let steps = step_fidelity(&step_log::read(&steps_path)?, setup.cost.as_ref());
        // The table's figures, and each priority's (a workload of several).
        let measured = verification
            .rows
            .iter()
            .filter_map(|row| Some((row.metric.key.to_string(), m.metric(row.metric.key)?)))
            .chain(
                (m.summary.iter())
                    .filter(|(k, _)| k.starts_with("priority_"))
                    .map(|(k, &v)| (k.clone(), v)),
            )
            .collect();
        results.push(VerifyResult {
            scenario: scenario.name.clone(),
            verification,
            steps,
            warnings: setup.warnings.clone(),
            report,
            samples: vec![Sample {
                predicted: predicted.summary,
                others,
                measured,
            }],
        });
    }
    Ok(results)
}

/// Serve `scenario` (read from `scenario_path`) on the engine and run the bench client against it, keeping the
/// run under `dir/measured` and the server's steps in `dir/measured-steps.csv`.
async fn measure(
    opts: &VerifyOptions,
    scenario_path: &Path,
    scenario: &Scenario,
    tokenizer: &Arc<dyn Tokenizer>,
    dir: &Path,
) -> Result<()> {
    let cfg = ServeConfig {
        sched: scenario.server.scheduler_config(),
        kv_cache_dtype: scenario.server.kv_cache_dtype,
        seed: 0,
        step_log: Some(dir.join("measured-steps.csv")),
        device: opts.target.device,
        cuda_graphs: opts.target.cuda_graphs,
        device_sampling: opts.target.device_sampling,
        ..ServeConfig::new(&opts.model)
    };
    let (addr, server) = spawn_local(cfg).await?;
    let mut b = BenchOptions::new(&format!("http://{addr}"), scenario_path);
    b.overrides = opts.overrides.clone();
    b.tokenizer = Some(tokenizer.clone());
    b.out = Some(dir.join("measured"));
    let measured = loadgen::run(&b).await;
    server.stop().await;
    measured.map(|_| ())
}

/// Refuse a kept measurement of anything but `scenario` as given (overrides applied): the
/// `scenario.toml` its run kept must be the same scenario.
fn check_kept_run(measured: &Path, scenario: &Scenario) -> Result<()> {
    let path = measured.join("scenario.toml");
    let file = path.display().to_string();
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "{file}: cannot read (no measurement of {} kept there)",
            scenario.name
        )
    })?;
    let kept = Scenario::parse(&file, &text, &[])?;
    anyhow::ensure!(
        toml::to_string(&kept.resolved)? == toml::to_string(&scenario.resolved)?,
        "{file}: measured a different scenario from {} as given here (a changed file or \
         --set): predict it from the scenario and overrides it was measured with",
        scenario.name
    );
    Ok(())
}

/// The fidelity table over several scenarios, in markdown.
fn fidelity_table(results: &[VerifyResult], checks: &[IntervalCheck]) -> String {
    let mut s = String::from(
        "| scenario | metric | predicted | measured | error % | in 90% interval |\n\
         |---|---|---:|---:|---:|---:|\n",
    );
    for r in results {
        for row in &r.verification.rows {
            // One decimal, three digits for sub-10 figures (a CPU's ITL of 0.283 ms).
            let f = |v: Option<f64>| {
                v.map_or("–".to_string(), |x| {
                    infer_reports::metric::format_digits(x, 1, 3)
                })
            };
            let inside = checks
                .iter()
                .find(|c| c.scenario == r.scenario && c.metric == row.metric.key)
                .map_or("–".to_string(), |c| format!("{}/{}", c.inside, c.n));
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {inside} |\n",
                r.scenario,
                row.metric.name,
                f(row.predicted),
                f(row.measured),
                row.error_pct
                    .map_or("–".to_string(), |e| format!("{e:+.1}"))
            ));
        }
    }
    s
}

/// Each priority's figures, predicted beside measured (medians over the repetitions), for
/// the scenarios whose requests had priorities other than 0; empty when none had.
fn priority_table(results: &[VerifyResult]) -> String {
    const FIGURES: [(&str, &str); 3] = [
        ("TTFT P50 (ms)", "median_ttft_ms"),
        ("TTFT P99 (ms)", "p99_ttft_ms"),
        ("E2E P50 (ms)", "median_e2el_ms"),
    ];
    let mut rows = String::new();
    for r in results {
        let Some(first) = r.samples.first() else {
            continue;
        };
        for c in &first.predicted.by_priority {
            for (name, figure) in FIGURES {
                let key = format!("priority_{}_{figure}", c.priority);
                let predicted = median(
                    (r.samples.iter())
                        .filter_map(|x| x.predicted.entries().into_iter().find(|e| e.0 == key))
                        .map(|e| e.1)
                        .collect(),
                );
                let measured = median(
                    (r.samples.iter())
                        .filter_map(|x| x.measured.iter().find(|e| e.0 == key))
                        .map(|e| e.1)
                        .collect(),
                );
                let f = |v: Option<f64>| {
                    v.map_or("–".to_string(), |x| {
                        infer_reports::metric::format_digits(x, 1, 3)
                    })
                };
                let error = match (predicted, measured) {
                    (Some(p), Some(m)) if m > 0.0 => format!("{:+.1}", (p / m - 1.0) * 100.0),
                    _ => "–".to_string(),
                };
                rows.push_str(&format!(
                    "| {} | {} | {name} | {} | {} | {error} |\n",
                    r.scenario,
                    c.priority,
                    f(predicted),
                    f(measured)
                ));
            }
        }
    }
    if rows.is_empty() {
        return rows;
    }
    format!(
        "\nEach priority:\n\n| scenario | priority | metric | predicted | measured | error % |\n\
         |---|---:|---|---:|---:|---:|\n{rows}"
    )
}

/// The headline figures of a fidelity table: TTFT P50, ITL P50, E2E P50 and throughput.
pub const HEADLINE: [infer_reports::metric::Metric; 4] = [
    infer_reports::metric::TTFT_P50,
    infer_reports::metric::ITL_P50,
    infer_reports::metric::LATENCY_P50,
    infer_reports::metric::THROUGHPUT,
];

/// Over the headline figures of all scenarios: (median |error %|, largest |error %|, how
/// many exceed 25%). `None` when no figure has an error.
fn headline(results: &[VerifyResult]) -> Option<(f64, f64, usize)> {
    let errors: Vec<f64> = results
        .iter()
        .flat_map(|r| &r.verification.rows)
        .filter(|row| HEADLINE.iter().any(|m| m.key == row.metric.key))
        .filter_map(|row| row.error_pct.map(f64::abs))
        .collect();
    let largest = errors.iter().copied().reduce(f64::max)?;
    let over = errors.iter().filter(|&&e| e > 25.0).count();
    Some((median(errors)?, largest, over))
}

/// The step-time table over several scenarios, in markdown.
fn step_table(results: &[VerifyResult]) -> String {
    let mut s = String::from(
        "| scenario | steps | count | measured (s) | predicted (s) | error of the sum % | median step error % |\n\
         |---|---|---:|---:|---:|---:|---:|\n",
    );
    for r in results {
        for f in &r.steps {
            s.push_str(&format!(
                "| {} | {} | {} | {:.2} | {:.2} | {:+.1} | {:+.1} |\n",
                r.scenario,
                f.kind,
                f.steps,
                f.measured_s,
                f.predicted_s,
                (f.predicted_s / f.measured_s - 1.0) * 100.0,
                f.median_error_pct
            ));
        }
    }
    s
}

/// Writes `fidelity.md` (the fidelity table, its headline and the step table) under the
/// run's output directory and returns what `engine verify` prints.
pub fn write_report(opts: &VerifyOptions, results: &[VerifyResult]) -> Result<String> {
    let checks = interval_checks(results);
    let table = fidelity_table(results, &checks) + &priority_table(results);
    let coverage = coverage_lines(&checks, opts.seeds);
    let steps = step_table(results);
    let headline = match headline(results) {
        Some((median, max, over)) => format!(
            "Over TTFT P50, ITL P50, E2E P50 and throughput: median |error| {median:.1}%, \
             largest {max:.1}%, {over} above 25%.\n"
        ),
        None => String::new(),
    };
    let warnings: String = results
        .iter()
        .flat_map(|r| {
            r.warnings
                .iter()
                .map(move |w| format!("- {}: {w}\n", r.scenario))
        })
        .collect();
    let warnings = if warnings.is_empty() {
        warnings
    } else {
        format!("\nWarnings on the predictions (how far to trust them):\n\n{warnings}")
    };
    let reps = match &opts.measured {
        Some(dir) => format!(
            "The measurements of {} predicted again{}.\n\n",
            dir.display(),
            if opts.repeat > 1 {
                format!(" (medians of its {} repetitions)", opts.repeat)
            } else {
                String::new()
            }
        ),
        None if opts.repeat > 1 => format!(
            "Medians of {} repetitions (profile, predict, measure).\n\n",
            opts.repeat
        ),
        None => String::new(),
    };
    std::fs::write(
        opts.out.join("fidelity.md"),
        format!(
            "{reps}{table}\n{headline}\n{coverage}{warnings}\nStep times, the cost model against \
             the measured run's steps, each priced as the simulator prices it (after an idle spell, \
             after a prefill, beside a request's path):\n\n{steps}"
        ),
    )?;
    let mut printed = format!("{reps}{table}\n{headline}\n{coverage}{warnings}\n{steps}");
    for r in results {
        if let Some(e) = r.verification.median_abs_error_pct {
            // Over every figure of the table, not the headline's four.
            let n = r
                .verification
                .rows
                .iter()
                .filter(|row| row.error_pct.is_some())
                .count();
            printed.push_str(&format!(
                "{}: median |error| over its {n} figures {e:.1}%\n",
                r.scenario
            ));
        }
    }
    printed.push_str(&format!("reports under {}\n", opts.out.display()));
    Ok(printed)
}

pub fn default_out() -> PathBuf {
    infer_reports::default_run_dir("verify")
}

#[cfg(test)]
mod tests {
    use super::*;
    use infer_core::StepShape;
    use infer_sim::cost::{AfterIdle, AfterPrefill, ClientPath, CostModel};

    /// 1 ms per new token, with what a step costs after an idle spell or a prefill when
    /// given.
    #[derive(Default)]
    struct PerToken {
        after_idle: Option<AfterIdle>,
        after_prefill: Option<AfterPrefill>,
        path: ClientPath,
    }
    impl CostModel for PerToken {
        fn step_time(&self, s: &StepShape) -> f64 {
            1e-3 * s.new_tokens() as f64
        }
        fn after_idle(&self) -> Option<AfterIdle> {
            self.after_idle
        }
        fn after_prefill(&self) -> Option<&AfterPrefill> {
            self.after_prefill.as_ref()
        }
        fn client_path(&self) -> ClientPath {
            self.path
        }
        fn describe(&self) -> String {
            "per token".into()
        }
    }

    fn step(prefill: usize, decodes: usize, step_s: f64) -> StepRecord {
        StepRecord {
            t_s: 0.0,
            shape: StepShape {
                prefill_tokens: prefill,
                decode_seqs: decodes,
                ..StepShape::default()
            },
            forward_s: step_s,
            constraint_s: 0.0,
            step_s,
            path_busy_s: None,
        }
    }

    #[test]
    fn step_fidelity_compares_each_kind() {
        // Decodes take twice the prediction, the prefill exactly it; no mixed steps.
        let steps = [step(0, 4, 0.008), step(0, 2, 0.004), step(100, 0, 0.1)];
        let f = step_fidelity(&steps, &PerToken::default());
        let kinds: Vec<&str> = f.iter().map(|x| x.kind).collect();
        assert_eq!(kinds, ["decode", "prefill", "all"]);
        assert_eq!(f[0].steps, 2);
        assert!((f[0].median_error_pct + 50.0).abs() < 1e-9);
        assert!((f[0].predicted_s - 0.006).abs() < 1e-12);
        assert!(f[1].median_error_pct.abs() < 1e-9);
        assert!((f[2].measured_s - 0.112).abs() < 1e-12);
        let table = step_table(&[VerifyResult {
            scenario: "s".into(),
            verification: infer_reports::Verification {
                rows: Vec::new(),
                median_abs_error_pct: None,
            },
            steps: f,
            warnings: Vec::new(),
            report: PathBuf::new(),
            samples: Vec::new(),
        }]);
        assert!(
            table.contains("| s | decode | 2 | 0.01 | 0.01 | -50.0 | -50.0 |"),
            "{table}"
        );
    }

    #[test]
    fn a_step_after_the_engine_idled_is_priced_cold_as_the_simulator_prices_it() {
        let at = |t_s: f64, r: StepRecord| StepRecord { t_s, ..r };
        let steps = [
            // The first step: no idle spell is known before it.
            at(0.0, step(100, 0, 0.1)),
            // 0.4 s after the first ended: cold, 1.5 × 0.1 s.
            at(0.5, step(100, 0, 0.15)),
            // 10 ms after: warm.
            at(0.66, step(100, 0, 0.1)),
        ];
        // Half as much again after 20 ms idle.
        let cold = PerToken {
            after_idle: Some(AfterIdle {
                idle_s: 0.02,
                factor: 1.5,
                steps: 10,
            }),
            ..PerToken::default()
        };
        let prefill = &step_fidelity(&steps, &cold)[0];
        assert_eq!(prefill.kind, "prefill");
        assert!(
            (prefill.predicted_s - 0.35).abs() < 1e-12,
            "{}",
            prefill.predicted_s
        );
        assert!(prefill.median_error_pct.abs() < 1e-9);
        // Priced warm, the cold step would be a third short.
        let warm = &step_fidelity(&steps, &PerToken::default())[0];
        assert!((warm.predicted_s - 0.3).abs() < 1e-12);
    }

    #[test]
    fn a_step_beside_a_requests_path_is_priced_slowed_as_the_simulator_prices_it() {
        let at = |t_s: f64, path_busy_s: f64, r: StepRecord| StepRecord {
            t_s,
            path_busy_s: Some(path_busy_s),
            ..r
        };
        // 1 ms decode steps; a step keeps a fifth of its pace while a path is busy.
        let steps = [
            // Quiet.
            at(0.0, 0.0, step(0, 1, 0.001)),
            // The path busy throughout its 5 ms: 1 ms at a fifth of the pace.
            at(0.001, 0.0, step(0, 1, 0.005)),
            // Half a millisecond of path left: 1 ms + 0.8 × 0.5 ms.
            at(0.006, 0.005, step(0, 1, 0.0014)),
            // Quiet again; the last step, whose overlap the log cannot tell, too.
            at(0.0074, 0.0055, step(0, 1, 0.001)),
            at(0.0084, 0.0055, step(0, 1, 0.001)),
        ];
        let slowed = PerToken {
            path: ClientPath {
                overlap_step_loss: 0.8,
                ..ClientPath::default()
            },
            ..PerToken::default()
        };
        let decode = &step_fidelity(&steps, &slowed)[0];
        assert!(
            (decode.predicted_s - 0.0094).abs() < 1e-12,
            "{}",
            decode.predicted_s
        );
        assert!(decode.median_error_pct.abs() < 1e-9);
        // Without the loss, each overlapped step is priced at its quiet 1 ms.
        let quiet = &step_fidelity(&steps, &PerToken::default())[0];
        assert!((quiet.predicted_s - 0.005).abs() < 1e-12);
    }

    #[test]
    fn the_decode_steps_after_a_prefill_are_priced_as_the_simulator_prices_them() {
        let at = |t_s: f64, r: StepRecord| StepRecord { t_s, ..r };
        let steps = [
            at(0.000, step(0, 1, 0.001)), // no prefill before it: steady
            at(0.001, step(100, 0, 0.1)),
            at(0.101, step(0, 1, 0.051)),
            at(0.152, step(0, 1, 0.021)),
            at(0.173, step(0, 1, 0.001)),
        ];
        // The first two decode steps after a prefill 50 and 20 ms more.
        let slow = PerToken {
            after_prefill: Some(AfterPrefill {
                extra_s: vec![0.05, 0.02],
                steps: 10,
                prefill_tokens: 0.0,
                per_prefill_token: 0.0,
            }),
            ..PerToken::default()
        };
        let decode = &step_fidelity(&steps, &slow)[0];
        assert_eq!((decode.kind, decode.steps), ("decode", 4));
        assert!(
            (decode.predicted_s - 0.074).abs() < 1e-12,
            "{}",
            decode.predicted_s
        );
        assert!(decode.median_error_pct.abs() < 1e-9);
    }

    fn result(errors: &[(infer_reports::metric::Metric, f64)]) -> VerifyResult {
        let rows = errors
            .iter()
            .map(|&(metric, e)| infer_reports::verify::VerifyRow {
                metric,
                predicted: Some(100.0 + e),
                measured: Some(100.0),
                error_pct: Some(e),
            })
            .collect();
        VerifyResult {
            scenario: "s".into(),
            verification: infer_reports::Verification {
                rows,
                median_abs_error_pct: None,
            },
            steps: vec![StepFidelity {
                kind: "all",
                steps: 10,
                measured_s: 1.0,
                predicted_s: 1.1,
                median_error_pct: errors.len() as f64,
            }],
            warnings: Vec::new(),
            report: PathBuf::new(),
            samples: Vec::new(),
        }
    }

    /// A workload of two priorities gets a table of each one's figures, predicted beside
    /// measured (the median over repetitions); one of a single priority none.
    #[test]
    fn each_priority_is_predicted_beside_its_measurement() {
        let stats = |median_s: f64| infer_core::metrics::Stats {
            median: median_s,
            p99: 2.0 * median_s,
            ..Default::default()
        };
        let sample = |p0_ms: f64, measured_p0_ms: f64| {
            let class = |priority, ttft_s| infer_core::metrics::PrioritySummary {
                priority,
                completed: 10,
                ttft: stats(ttft_s),
                e2el: stats(1.0),
                ..Default::default()
            };
            Sample {
                predicted: Summary {
                    by_priority: vec![class(0, p0_ms / 1e3), class(1, 2.0)],
                    ..Default::default()
                },
                others: Vec::new(),
                measured: vec![
                    ("priority_0_median_ttft_ms".into(), measured_p0_ms),
                    ("priority_1_median_ttft_ms".into(), 2500.0),
                ],
            }
        };
        let mut r = result(&[]);
        r.samples = vec![sample(50.0, 60.0), sample(40.0, 80.0), sample(45.0, 70.0)];
        let table = priority_table(&[r]);
        assert!(
            table.contains("| s | 0 | TTFT P50 (ms) | 45.0 | 70.0 | -35.7 |"),
            "{table}"
        );
        assert!(
            table.contains("| s | 1 | TTFT P50 (ms) | 2000.0 | 2500.0 | -20.0 |"),
            "{table}"
        );
        assert!(
            table.contains("| s | 1 | TTFT P99 (ms) | 4000.0 | – | – |"),
            "{table}"
        );
        assert_eq!(priority_table(&[result(&[])]), "");
    }

    /// A sample whose prediction has median TTFT `predicted` ms under every seed, measured
    /// `measured` ms.
    fn sample(predicted: f64, measured: f64) -> Sample {
        let summary = Summary {
            ttft: infer_core::metrics::Stats {
                median: predicted / 1e3,
                ..Default::default()
            },
            ..Default::default()
        };
        Sample {
            others: vec![summary.clone(); 2],
            predicted: summary,
            measured: vec![("median_ttft_ms".into(), measured)],
        }
    }

    #[test]
    fn each_scenarios_interval_takes_the_model_errors_of_the_others_only() {
        let with = |scenario: &str, samples: Vec<Sample>| VerifyResult {
            scenario: scenario.into(),
            samples,
            ..result(&[])
        };
        // b's measurements sit 10-30% above its predictions; a's own errors (-50%) must
        // not widen a's interval, so it is about 100 × [1.10, 1.30].
        let a = with(
            "a",
            vec![
                sample(100.0, 125.0),
                sample(100.0, 105.0),
                sample(100.0, 50.0),
            ],
        );
        let b = with(
            "b",
            vec![
                sample(100.0, 110.0),
                sample(100.0, 120.0),
                sample(100.0, 130.0),
            ],
        );
        let checks = interval_checks(&[a, b]);
        let of = |s: &str| checks.iter().find(|c| c.scenario == s).unwrap();
        assert_eq!((of("a").inside, of("a").n), (1, 3), "{checks:?}");
        // b's interval comes from a's errors: from -0.69 to +0.22 in log space, so 110 and
        // 120 are in it and 130 is not.
        assert_eq!((of("b").inside, of("b").n), (2, 3), "{checks:?}");
        let widths = &of("a").widths_pct;
        assert!(
            widths.iter().all(|w| (15.0..20.0).contains(w)),
            "{widths:?}"
        );
        let table = coverage_lines(&checks, 3);
        assert!(table.contains("| pooled | 3 | 6 | 50% |"), "{table}");
    }

    #[test]
    fn the_headline_counts_only_the_four_figures() {
        use infer_reports::metric::{ITL_P50, ITL_P99, LATENCY_P50, THROUGHPUT, TTFT_P50};
        let a = result(&[(TTFT_P50, 5.0), (ITL_P50, -30.0), (ITL_P99, 90.0)]);
        let b = result(&[(LATENCY_P50, 8.0), (THROUGHPUT, -2.0)]);
        let (median, max, over) = headline(&[a, b]).unwrap();
        assert_eq!((median, max, over), (6.5, 30.0, 1));
        assert!(headline(&[]).is_none());
    }

    #[test]
    fn kept_repetitions_are_the_rep_directories_or_the_directory_itself() {
        let tmp = tempfile::tempdir().unwrap();
        let single = tmp.path().join("single");
        std::fs::create_dir(&single).unwrap();
        assert_eq!(kept_repetitions(&single).unwrap(), vec![single.clone()]);
        let reps = tmp.path().join("reps");
        for r in ["rep1", "rep2", "rep4"] {
            std::fs::create_dir_all(reps.join(r)).unwrap();
        }
        // rep4 is not a repetition of a run of three: rep3 is missing.
        assert_eq!(
            kept_repetitions(&reps).unwrap(),
            vec![reps.join("rep1"), reps.join("rep2")]
        );
        let err = kept_repetitions(&tmp.path().join("absent")).unwrap_err();
        assert!(err.to_string().contains("no such directory"), "{err}");
    }

    #[test]
    fn a_kept_measurement_of_another_scenario_is_refused() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scenarios/paged_attention.toml"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let parse = |overrides: &[&str]| {
            let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
            Scenario::parse(path, &text, &o).unwrap()
        };
        let measured = parse(&["workload.num_requests=8"]);
        // The run directory as the bench writes it.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("measured");
        infer_reports::RunDirWriter::create(&dir)
            .unwrap()
            .finish(
                &Summary::default(),
                &infer_reports::RunInfo::new("engine", &measured, "test".into()),
            )
            .unwrap();
        check_kept_run(&dir, &parse(&["workload.num_requests=8"])).unwrap();
        for other in [
            &[][..],
            &["workload.num_requests=8", "server.max_batch_size=4"][..],
        ] {
            let err = check_kept_run(&dir, &parse(other)).unwrap_err().to_string();
            assert!(err.contains("measured a different scenario"), "{err}");
        }
        let err = check_kept_run(&tmp.path().join("none"), &measured).unwrap_err();
        assert!(
            err.to_string()
                .contains("no measurement of paged_attention"),
            "{err}"
        );
    }

    #[test]
    fn repetitions_add_their_steps() {
        let (a, b, c) = (result(&[]), result(&[]), result(&[(TTFT_P50_M, 1.0)]));
        let f = combine_steps(&[&a, &b, &c]);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].steps, 30);
        assert!((f[0].predicted_s - 3.3).abs() < 1e-9);
        assert_eq!(f[0].median_error_pct, 0.0);
    }

    const TTFT_P50_M: infer_reports::metric::Metric = infer_reports::metric::TTFT_P50;
}
