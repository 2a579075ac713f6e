//! `sim calibrate`: fit a calibration file's coefficients to measured runs.
//!
//! Targets are measured runs: run directories (from `engine bench` against any
//! OpenAI-compatible server, or `engine probe`; each keeps the scenario it ran as
//! `scenario.toml` and its figures in `summary.json`), or a table of published figures (a
//! TOML file of `[[run]]` entries naming a scenario, its overrides and the figures; see
//! `sim/calibrations/rtx5080-benchmark-log.toml`). Targets marked held out are predicted
//! with the fitted coefficients but never fitted to.
//!
//! For each model the fit minimises the mean Huber loss of the log errors of the figures
//! (`output_throughput`, TTFT and ITL P50/P99: whichever a target has) over the fitted
//! targets, by a pattern search in log space: every parameter is multiplied and divided
//! by a step factor in turn, an improvement is kept, and the step halves when none is
//! found. Each evaluation simulates every target of the model (milliseconds each), so a
//! fit takes seconds to a minute. The engine's mechanisms (padded prefill, logits) are given, or
//! searched over: each combination is fitted and the best kept.

use crate::error::SimError;
use infer_core::{FileError, KvBackend};
use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::calibration::{
    AttentionScores, ContiguousDecode, ContiguousKv, PackedAttention, PrefillBatching, Roofline,
};
use crate::calibration::{Calibration, CalibrationFile, Coefficients, Draw, LogitRows, Mechanisms};
use crate::interval::{self, Interval, Residual};
use crate::setup::{self, Setup};
use infer_core::metrics::Summary;

/// The figures a fit compares, by their summary.json names.
pub const FIT_METRICS: [&str; 5] = [
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p99_itl_ms",
];

/// One measured run to fit to (or to check against).
#[derive(Clone)]
pub struct Target {
    pub label: String,
    pub setup: Setup,
    /// (metric, measured value), metrics of [`FIT_METRICS`] only.
    pub measured: Vec<(String, f64)>,
    pub held_out: bool,
}

impl Target {
    pub fn model(&self) -> &'static str {
        self.setup.model.name
    }

    /// The run's figures under `cal` (its scenario's `[sim]` overrides on top), in the
    /// order of `measured`; NaN where the configuration does not fit in memory under `cal`
    /// or the run passes a bound.
    pub fn predict(&mut self, cal: &Calibration) -> Vec<f64> {
        let Some(summary) = self.summary(cal) else {
            return vec![f64::NAN; self.measured.len()];
        };
        let entries = summary.entries();
        self.measured
            .iter()
            .map(|(k, _)| {
                entries
                    .iter()
                    .find(|(name, _)| name == k)
                    .map_or(f64::NAN, |(_, v)| *v)
            })
            .collect()
    }
}

impl Target {
    /// The run's whole summary under `cal`; `None` where the configuration does not fit
    /// in memory under `cal` or the run passes a bound.
    pub fn summary(&mut self, cal: &Calibration) -> Option<Summary> {
        self.setup.set_calibration(cal.clone()).ok()?;
        // A calibration that takes a run past `[sim]`'s bounds predicts nothing.
        crate::run(&self.setup).ok().map(|r| r.summary)
    }

    /// The runs of one configuration (workload and server settings, any model): what a
    /// coverage test leaves out together.
    pub fn group(&self) -> String {
        let sc = &self.setup.scenario;
        format!("{}, {}", sc.name, infer_reports::phase_of(&sc.server))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PublishedFile {
    #[serde(default)]
    #[allow(dead_code)]
    description: String,
    run: Vec<PublishedRun>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PublishedRun {
    label: String,
    /// Relative to the published file.
    scenario: String,
    #[serde(default)]
    set: Vec<String>,
    #[serde(default)]
    held_out: bool,
    measured: BTreeMap<String, f64>,
}

/// The targets of a published-figures file.
pub fn load_published(path: &str) -> Result<Vec<Target>, SimError> {
    let text = std::fs::read_to_string(path).map_err(FileError::at(path, "read"))?;
    let file: PublishedFile =
        toml::from_str(&text).map_err(|e| SimError::content(path, e.to_string().trim_end()))?;
    let dir = Path::new(path).parent().unwrap_or(Path::new("."));
    file.run
        .into_iter()
        .map(|r| {
            let scenario = dir.join(&r.scenario).display().to_string();
            let in_run = |e: &dyn std::fmt::Display| {
                SimError::content(path, format!("run `{}`: {e}", r.label))
            };
            let setup = setup::load(&scenario, &r.set).map_err(|e| in_run(&e))?;
            let measured = measured_figures(r.measured.into_iter()).map_err(|e| in_run(&e))?;
            Ok(Target {
                label: r.label,
                setup,
                measured,
                held_out: r.held_out,
            })
        })
        .collect()
}

/// A run directory as a target: its `scenario.toml` simulated, its `summary.json` measured.
pub fn load_run_dir(dir: &str, held_out: bool) -> Result<Target, SimError> {
    let path = Path::new(dir);
    let scenario = path.join("scenario.toml");
    if !scenario.exists() {
        return Err(SimError::content(
            dir,
            "no scenario.toml (run directories written before it was kept cannot be \
             simulated again; run the load again)",
        ));
    }
    let setup = setup::load(&scenario.display().to_string(), &[])?;
    let summary = path.join("summary.json");
    let text = std::fs::read_to_string(&summary).map_err(FileError::at(&summary, "read"))?;
    let json: BTreeMap<String, serde_json::Value> = serde_json::from_str(&text)
        .map_err(|e| SimError::content(summary.display(), format!("not a summary: {e}")))?;
    let figures = json
        .into_iter()
        .filter_map(|(k, v)| v.as_f64().map(|v| (k, v)));
    let measured =
        measured_figures(figures).map_err(|e| SimError::content(summary.display(), e))?;
    Ok(Target {
        label: dir.trim_end_matches('/').to_string(),
        setup,
        measured,
        held_out,
    })
}

/// Keep the figures a fit compares, in [`FIT_METRICS`] order; refuse unknown names and
/// values that are not positive.
fn measured_figures(
    figures: impl Iterator<Item = (String, f64)>,
) -> Result<Vec<(String, f64)>, SimError> {
    let all: BTreeMap<String, f64> = figures.collect();
    let mut out = Vec::new();
    for m in FIT_METRICS {
        if let Some(&v) = all.get(m) {
            if !(v > 0.0 && v.is_finite()) {
                return Err(SimError::Invalid(format!(
                    "`{m}` must be a positive number, got {v}"
                )));
            }
            out.push((m.to_string(), v));
        }
    }
    if out.is_empty() {
        return Err(SimError::Invalid(format!(
            "no figure to fit: expected some of {}",
            FIT_METRICS.join(", ")
        )));
    }
    Ok(out)
}

/// A coefficient the fit may move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    ComputeEfficiency,
    AttentionEfficiency,
    DecodeAttentionEfficiency,
    BandwidthEfficiency,
    SingleDecodeBandwidthEfficiency,
    StepOverhead,
    PerSeqOverhead,
    ClientRequest,
    ClientStream,
    StaticBatchWindow,
    StaticStepOverhead,
    StaticPerSeqOverhead,
    StepJitter,
    PageFault,
}

impl Param {
    pub const ALL: [Param; 14] = [
        Param::ComputeEfficiency,
        Param::AttentionEfficiency,
        Param::DecodeAttentionEfficiency,
        Param::BandwidthEfficiency,
        Param::SingleDecodeBandwidthEfficiency,
        Param::StepOverhead,
        Param::PerSeqOverhead,
        Param::ClientRequest,
        Param::ClientStream,
        Param::StaticBatchWindow,
        Param::StaticStepOverhead,
        Param::StaticPerSeqOverhead,
        Param::StepJitter,
        Param::PageFault,
    ];

    /// The calibration file's key.
    pub fn name(self) -> &'static str {
        match self {
            Param::ComputeEfficiency => "compute_efficiency",
            Param::AttentionEfficiency => "attention_efficiency",
            Param::DecodeAttentionEfficiency => "decode_attention_efficiency",
            Param::BandwidthEfficiency => "bandwidth_efficiency",
            Param::SingleDecodeBandwidthEfficiency => "single_decode_bandwidth_efficiency",
            Param::StepOverhead => "step_overhead_s",
            Param::PerSeqOverhead => "per_seq_overhead_s",
            Param::ClientRequest => "client_request_s",
            Param::ClientStream => "client_stream_s",
            Param::StaticBatchWindow => "static_batch_window_s",
            Param::StaticStepOverhead => "static_step_overhead_s",
            Param::StaticPerSeqOverhead => "static_per_seq_overhead_s",
            Param::StepJitter => "step_jitter_s",
            Param::PageFault => "page_fault_s_per_gib",
        }
    }

    pub fn parse(s: &str) -> Result<Param, SimError> {
        Param::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Param::ALL.iter().map(|p| p.name()).collect();
                SimError::Invalid(format!(
                    "unknown parameter `{s}`; expected one of {}",
                    names.join(", ")
                ))
            })
    }

    fn slot(self, c: &mut Coefficients) -> &mut f64 {
        match self {
            Param::ComputeEfficiency => &mut c.compute_efficiency,
            Param::AttentionEfficiency => &mut c.attention_efficiency,
            Param::DecodeAttentionEfficiency => c
                .decode_attention_efficiency
                .get_or_insert(c.attention_efficiency),
            Param::BandwidthEfficiency => &mut c.bandwidth_efficiency,
            // Absent, a single sequence's decode reads as fast as any pass: a fit starts
            // there.
            Param::SingleDecodeBandwidthEfficiency => c
                .single_decode_bandwidth_efficiency
                .get_or_insert(c.bandwidth_efficiency),
            Param::StepOverhead => &mut c.step_overhead_s,
            Param::PerSeqOverhead => &mut c.per_seq_overhead_s,
            Param::ClientRequest => &mut c.client_request_s,
            Param::ClientStream => &mut c.client_stream_s,
            Param::StaticBatchWindow => &mut c.static_batch_window_s,
            // Absent, static batching's host costs are continuous batching's: a search
            // starts there.
            Param::StaticStepOverhead => c.static_step_overhead_s.get_or_insert(c.step_overhead_s),
            Param::StaticPerSeqOverhead => c
                .static_per_seq_overhead_s
                .get_or_insert(c.per_seq_overhead_s),
            Param::StepJitter => &mut c.step_jitter_s,
            // Absent, nothing is faulted in: a fit starts at 10 GB/s.
            Param::PageFault => c.page_fault_s_per_gib.get_or_insert(0.1),
        }
    }

    /// A duration in seconds (zero allowed), not a fraction of a peak.
    fn is_time(self) -> bool {
        !matches!(
            self,
            Param::ComputeEfficiency
                | Param::AttentionEfficiency
                | Param::DecodeAttentionEfficiency
                | Param::BandwidthEfficiency
                | Param::SingleDecodeBandwidthEfficiency
        )
    }

    /// (lowest, highest) value the fit may give.
    pub(crate) fn bounds(self) -> (f64, f64) {
        match self {
            // No GEMM or attention kernel sustains more than ~80% of the dense peak.
            Param::ComputeEfficiency | Param::AttentionEfficiency => (0.01, 0.8),
            // A decode kernel that walks a long context block by block can be 100x off.
            Param::DecodeAttentionEfficiency => (1e-3, 0.8),
            Param::BandwidthEfficiency | Param::SingleDecodeBandwidthEfficiency => (0.01, 1.0),
            _ => (1e-6, 1.0),
        }
    }
}

/// The parameters fitted when none are named (static batching's own host costs only
/// for a model whose fitted runs batch both ways: [`params_for`]).
pub const DEFAULT_PARAMS: [Param; 8] = [
    Param::ComputeEfficiency,
    Param::AttentionEfficiency,
    Param::StepOverhead,
    Param::PerSeqOverhead,
    Param::ClientRequest,
    Param::StaticBatchWindow,
    Param::StaticStepOverhead,
    Param::StaticPerSeqOverhead,
];

/// Whether one model's fitted runs batch both statically and continuously: what static
/// batching's own host costs need. Without a static run nothing measures them (the fit
/// would set them to what costs nothing, zero); without a continuous one the shared host
/// costs are static batching's, fitted as such.
fn batches_both_ways<'a>(targets: impl IntoIterator<Item = &'a Target>) -> bool {
    let (mut fixed, mut continuous) = (false, false);
    for t in targets.into_iter().filter(|t| !t.held_out) {
        match t.setup.scenario.server.batching_mode {
            infer_core::BatchingMode::Static => fixed = true,
            infer_core::BatchingMode::Continuous => continuous = true,
        }
    }
    fixed && continuous
}

fn is_static_host(p: Param) -> bool {
    matches!(p, Param::StaticStepOverhead | Param::StaticPerSeqOverhead)
}

/// The models `targets` run, each once, in name order.
fn model_names(targets: &[Target]) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = targets.iter().map(|t| t.model()).collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// `params` as one model's fitted runs can determine them: static batching's own host
/// costs only where they batch both ways.
fn params_for(params: &[Param], both_ways: bool) -> Vec<Param> {
    params
        .iter()
        .copied()
        .filter(|&p| both_ways || !is_static_host(p))
        .collect()
}

/// The models of `targets` whose fitted runs cannot determine some of `params`, and which:
/// what `sim calibrate --fit` warns of.
pub fn unfittable(params: &[Param], targets: &[Target]) -> Vec<(&'static str, Vec<Param>)> {
    model_names(targets)
        .into_iter()
        .filter_map(|name| {
            let mine = targets.iter().filter(|t| t.model() == name);
            if batches_both_ways(mine) {
                return None;
            }
            let dropped: Vec<Param> = params
                .iter()
                .copied()
                .filter(|&p| is_static_host(p))
                .collect();
            (!dropped.is_empty()).then_some((name, dropped))
        })
        .collect()
}

/// One model's fit.
#[derive(Debug, Clone)]
pub struct ModelFit {
    pub model: String,
    pub coefficients: Coefficients,
    /// Mean Huber loss of the log errors over the fitted targets' figures.
    pub loss: f64,
    pub evaluations: usize,
}

/// Mean Huber loss of the log errors of the fitted (not held-out) `targets` under `cal`:
/// squared up to [`HUBER_DELTA`], linear beyond, so that a figure the model cannot
/// describe (a mechanism it lacks) does not drag every other figure off to half-fit it.
fn loss(targets: &mut [&mut Target], cal: &Calibration) -> f64 {
    let (mut sum, mut n) = (0.0, 0usize);
    for t in targets.iter_mut().filter(|t| !t.held_out) {
        let predicted = t.predict(cal);
        for ((_, m), p) in t.measured.iter().zip(predicted) {
            sum += figure_loss(*m, p);
            n += 1;
        }
    }
    if n == 0 {
        0.0
    } else {
        sum / n as f64
    }
}

/// One figure's share of the loss: the Huber loss of its log error.
fn figure_loss(measured: f64, predicted: f64) -> f64 {
    let e = if predicted > 0.0 && predicted.is_finite() {
        (predicted / measured).ln()
    } else {
        10.0 // a run that produced no figure is as wrong as can be
    };
    huber(e)
}

/// Where the loss turns from squared to linear: a log error of 0.25 (about 28%).
const HUBER_DELTA: f64 = 0.25;

fn huber(e: f64) -> f64 {
    let a = e.abs();
    if a <= HUBER_DELTA {
        a * a
    } else {
        HUBER_DELTA * (2.0 * a - HUBER_DELTA)
    }
}

/// Fit `params` of one model's calibration to its targets, starting from `start`.
pub fn fit_model(
    targets: &mut [&mut Target],
    start: &Calibration,
    mechanisms: &Mechanisms,
    params: &[Param],
) -> ModelFit {
    // A start whose decode efficiency equals its prompts' leaves it tied (absent): unless
    // fitted, it follows wherever the fit moves `attention_efficiency`.
    let mut best = Coefficients::of(start);
    // A multiplicative search cannot leave zero: start such coefficients at 1 ms.
    for &p in params {
        let v = p.slot(&mut best);
        if *v == 0.0 {
            *v = 1e-3;
        }
    }
    let cal = |c: &Coefficients| start.with(mechanisms, c);
    let mut best_loss = loss(targets, &cal(&best));
    let mut evaluations = 1;
    let mut factor: f64 = 2.0;
    while factor > 1.002 && evaluations < 4000 {
        let mut improved = false;
        for &p in params {
            for dir in [factor, 1.0 / factor] {
                let mut c = best;
                let (lo, hi) = p.bounds();
                let v = p.slot(&mut c);
                let moved = (*v * dir).clamp(lo, hi);
                if moved == *v {
                    continue;
                }
                *v = moved;
                let l = loss(targets, &cal(&c));
                evaluations += 1;
                if l < best_loss {
                    best_loss = l;
                    best = c;
                    improved = true;
                    break;
                }
            }
        }
        if !improved {
            factor = factor.sqrt();
        }
    }
    // A time the measurements do not call for is zero, not whatever the search left.
    for &p in params {
        if p.is_time() {
            let mut c = best;
            *p.slot(&mut c) = 0.0;
            let l = loss(targets, &cal(&c));
            evaluations += 1;
            if l <= best_loss {
                best_loss = l;
                best = c;
            }
        }
    }
    ModelFit {
        model: targets
            .first()
            .map_or(String::new(), |t| t.model().to_string()),
        coefficients: best,
        loss: best_loss,
        evaluations,
    }
}

/// A whole calibration: every model of `targets` fitted under `mechanisms`.
pub struct Fit {
    pub hardware: String,
    pub mechanisms: Mechanisms,
    pub models: Vec<ModelFit>,
}

impl Fit {
    /// The sum of the models' losses (what mechanism search compares).
    pub fn loss(&self) -> f64 {
        self.models.iter().map(|m| m.loss).sum()
    }

    pub fn file(&self, engine: &str, source: &str) -> CalibrationFile {
        CalibrationFile {
            hardware: self.hardware.clone(),
            engine: engine.to_string(),
            source: source.to_string(),
            runs_fitted: None,
            runs_held_out: None,
            mechanisms: self.mechanisms,
            models: self
                .models
                .iter()
                .map(|m| (m.model.clone(), m.coefficients.rounded()))
                .collect(),
            residuals: Vec::new(),
            draws: Vec::new(),
            reach: None,
        }
    }

    /// A calibration file's coefficients, as a fit (to predict with them).
    pub fn of_file(file: &CalibrationFile) -> Fit {
        Fit {
            hardware: file.hardware.clone(),
            mechanisms: file.mechanisms,
            models: file
                .models
                .iter()
                .map(|(name, c)| ModelFit {
                    model: name.clone(),
                    coefficients: *c,
                    loss: f64::NAN,
                    evaluations: 0,
                })
                .collect(),
        }
    }
}

/// Starts for a fitted decode attention far below the roofline: from near the prompts'
/// efficiency the search sits on a plateau (halving it changes nothing a short context
/// shows), and the log's decodes sit at ~0.002, below a start at 0.01's plateau too.
fn far_below_the_roofline(base: &Calibration) -> [Calibration; 2] {
    [0.01, 0.001].map(|e| Calibration {
        decode_attention_efficiency: e,
        ..base.clone()
    })
}

/// Fit every model of `targets` under `mechanisms`. All targets must be on one GPU.
///
/// With `start` (an earlier calibration file, with the name it was read as), each model's
/// search starts from that file's coefficients, and what `params` does not name keeps the
/// file's value: a second stage that refits a few coefficients of a calibration without
/// moving the rest.
pub fn fit_all(
    targets: &mut [Target],
    mechanisms: &Mechanisms,
    params: &[Param],
    start: Option<(&str, &CalibrationFile)>,
) -> Result<Fit, SimError> {
    let hardware = match targets.first() {
        Some(t) => t.setup.hardware.clone(),
        None => return Err(SimError::Invalid("no targets to fit".into())),
    };
    if let Some(t) = targets
        .iter()
        .find(|t| t.setup.hardware.name != hardware.name)
    {
        return Err(SimError::Invalid(format!(
            "`{}` runs on {}, the others on {}: one calibration file is for one GPU",
            t.label, t.setup.hardware.name, hardware.name
        )));
    }
    // A start file's faults name it and the key at fault.
    let in_start = |key: &str, reason: String| SimError::Key {
        file: start.map_or(String::new(), |(name, _)| name.to_string()),
        key: key.to_string(),
        reason,
    };
    if let Some((_, file)) = start {
        if file.hardware != hardware.name {
            return Err(in_start(
                "hardware",
                format!(
                    "the start calibration is for {}, the runs ran on {}",
                    file.hardware, hardware.name
                ),
            ));
        }
        // Its coefficients were fitted under its mechanisms: kept under others, they would
        // describe an engine that was never measured.
        if file.mechanisms != *mechanisms {
            return Err(in_start(
                "mechanisms",
                format!(
                    "the start calibration was fitted under other mechanisms ({}); give the \
                     same ones ({} asked)",
                    file.mechanisms.describe(),
                    mechanisms.describe()
                ),
            ));
        }
    }
    let names = model_names(targets);
    let mut models = Vec::new();
    for name in names {
        let mut mine: Vec<&mut Target> = targets.iter_mut().filter(|t| t.model() == name).collect();
        let params = &params_for(params, batches_both_ways(mine.iter().map(|t| &**t)));
        if mine.iter().all(|t| t.held_out) {
            return Err(SimError::Invalid(format!(
                "every target of {name} is held out: nothing to fit"
            )));
        }
        let generic = Calibration::default_for(&hardware);
        let mut starts = match start {
            // A second stage starts where the first one ended.
            Some((_, file)) => {
                let coefficients = file.models.get(name).ok_or_else(|| {
                    in_start(
                        "models",
                        format!(
                            "the start calibration has no coefficients for {name} (it has {})",
                            file.models.keys().cloned().collect::<Vec<_>>().join(", ")
                        ),
                    )
                })?;
                vec![generic.with(mechanisms, coefficients)]
            }
            // The generic defaults and a host-bound engine (a Python server), so that a local
            // minimum of one is not the answer when the other does better.
            None => vec![
                generic.clone(),
                Calibration {
                    step_overhead_s: 3e-3,
                    per_seq_overhead_s: 1e-3,
                    ..generic
                },
            ],
        };
        if params.contains(&Param::DecodeAttentionEfficiency) {
            starts.extend(far_below_the_roofline(&starts[0]));
        }
        let best = starts
            .iter()
            .map(|s| fit_model(&mut mine, s, mechanisms, params))
            .min_by(|a, b| a.loss.total_cmp(&b.loss))
            .expect("at least one start");
        models.push(best);
    }
    Ok(Fit {
        hardware: hardware.name.to_string(),
        mechanisms: *mechanisms,
        models,
    })
}

/// The KV layouts `sim calibrate --search-policies` tries (`server.kv_cache_backend`, its
/// name, what it is), each with its prefix reuse: how a server holds its sequences, which
/// decides when a prompt is admitted (a free slot, or free blocks) and what it finds
/// cached (its slot's last prompt, or any earlier prompt's full blocks).
pub const KV_POLICIES: [(KvBackend, &str, &str); 2] = [
    (
        KvBackend::Paged,
        "paged",
        "paged blocks with a global prefix cache (vLLM, SGLang, transformers)",
    ),
    (
        KvBackend::Contiguous,
        "contiguous",
        "contiguous slots each reusing its last prompt (llama.cpp's server)",
    ),
];

/// `targets` with every run's `server.kv_cache_backend` set to `backend`.
pub fn with_kv_backend(targets: &[Target], backend: KvBackend) -> Result<Vec<Target>, SimError> {
    targets
        .iter()
        .map(|t| {
            let mut scenario = t.setup.scenario.clone();
            scenario.server.kv_cache_backend = backend;
            Ok(Target {
                label: t.label.clone(),
                setup: setup::prepare(&t.setup.file, scenario)?,
                measured: t.measured.clone(),
                held_out: t.held_out,
            })
        })
        .collect()
}

/// Each run's loss in `rows`, as the fit counts it (the mean of its figures'
/// [`figure_loss`]), in the order the runs come.
pub fn run_losses(rows: &[Row]) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64, usize)> = Vec::new();
    for r in rows {
        let loss = figure_loss(r.measured, r.predicted);
        match out.last_mut() {
            Some((label, sum, n)) if *label == r.label => {
                *sum += loss;
                *n += 1;
            }
            _ => out.push((r.label.clone(), loss, 1)),
        }
    }
    out.into_iter()
        .map(|(label, sum, n)| (label, sum / n as f64))
        .collect()
}

/// Which of the searched mechanisms are given, and so held at `given`'s value.
#[derive(Debug, Clone, Copy, Default)]
pub struct Held {
    pub prefill_batching: bool,
    pub logits: bool,
    pub attention_scores: bool,
    pub contiguous_kv: bool,
    pub contiguous_decode: bool,
    pub packed_attention: bool,
    pub roofline: bool,
}

/// The mechanism combinations a search tries: every value of each mechanism not `held`
/// (spill bandwidth, reserved memory and graph replay, and what is held, as `given`).
pub fn mechanism_candidates(given: &Mechanisms, held: Held) -> Vec<Mechanisms> {
    /// Every candidate so far with each of `values` put in by `put` (unless held): the
    /// product of the mechanisms, the first one outermost.
    fn times<T: Copy>(
        out: Vec<Mechanisms>,
        held: bool,
        values: &[T],
        put: impl Fn(&mut Mechanisms, T),
    ) -> Vec<Mechanisms> {
        if held {
            return out;
        }
        out.iter()
            .flat_map(|m| {
                values.iter().map(|&v| {
                    let mut m = *m;
                    put(&mut m, v);
                    m
                })
            })
            .collect()
    }
    let mut out = vec![*given];
    out = times(
        out,
        held.prefill_batching,
        &[PrefillBatching::Packed, PrefillBatching::Padded],
        |m, v| m.prefill_batching = v,
    );
    out = times(
        out,
        held.logits,
        &[LogitRows::Sampled, LogitRows::All],
        |m, v| m.logits = v,
    );
    out = times(
        out,
        held.attention_scores,
        &[AttentionScores::Fused, AttentionScores::Materialized],
        |m, v| m.attention_scores = v,
    );
    out = times(
        out,
        held.contiguous_kv,
        &[ContiguousKv::Reserved, ContiguousKv::Grown],
        |m, v| m.contiguous_kv = v,
    );
    out = times(
        out,
        held.contiguous_decode,
        &[ContiguousDecode::Ragged, ContiguousDecode::Padded],
        |m, v| m.contiguous_decode = v,
    );
    out = times(
        out,
        held.packed_attention,
        &[PackedAttention::Ragged, PackedAttention::Masked],
        |m, v| m.packed_attention = v,
    );
    times(
        out,
        held.roofline,
        &[Roofline::Overlap, Roofline::Serial],
        |m, v| m.roofline = v,
    )
}

/// One predicted figure beside its measurement.
#[derive(Debug, Clone)]
pub struct Row {
    pub label: String,
    pub metric: String,
    pub measured: f64,
    pub predicted: f64,
    pub held_out: bool,
}

impl Row {
    /// Signed error, percent of the measurement.
    pub fn error_pct(&self) -> f64 {
        (self.predicted - self.measured) / self.measured * 100.0
    }
}

/// Every target's figures predicted with the fitted calibration.
pub fn rows(targets: &mut [Target], fit: &Fit) -> Vec<Row> {
    let mut out = Vec::new();
    for t in targets.iter_mut() {
        let Some(m) = fit.models.iter().find(|m| m.model == t.model()) else {
            continue;
        };
        let start = Calibration::default_for(&t.setup.hardware);
        let cal = start.with(&fit.mechanisms, &m.coefficients);
        let predicted = t.predict(&cal);
        for ((metric, measured), p) in t.measured.iter().zip(predicted) {
            out.push(Row {
                label: t.label.clone(),
                metric: metric.clone(),
                measured: *measured,
                predicted: p,
                held_out: t.held_out,
            });
        }
    }
    out
}

/// `resamples` refits of `params` for each model of `fit`, each on a bootstrap resample of
/// the model's fitted targets (as many, drawn with replacement; seeded, so the same every
/// time), starting from the fitted coefficients: the coefficients' spread, as the
/// calibration file's `[[draws]]`. The resamples run on every core.
pub fn bootstrap(targets: &[Target], fit: &Fit, params: &[Param], resamples: usize) -> Vec<Draw> {
    use rand::{Rng, SeedableRng};
    let mut jobs: Vec<(usize, u64)> = Vec::new();
    for (m, model) in fit.models.iter().enumerate() {
        // A model without fitted runs has nothing to resample.
        if targets
            .iter()
            .any(|t| t.model() == model.model && !t.held_out)
        {
            jobs.extend((0..resamples as u64).map(|b| (m, b)));
        }
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    crate::sweep::par_map(&jobs, threads, Some("bootstrap"), |&(m, b)| {
        let model = &fit.models[m];
        let mine: Vec<&Target> = targets
            .iter()
            .filter(|t| t.model() == model.model && !t.held_out)
            .collect();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(b);
        let mut resample: Vec<Target> = (0..mine.len())
            .map(|_| mine[rng.gen_range(0..mine.len())].clone())
            .collect();
        let params = params_for(params, batches_both_ways(resample.iter()));
        let start = Calibration::default_for(&resample[0].setup.hardware)
            .with(&fit.mechanisms, &model.coefficients);
        let mut refs: Vec<&mut Target> = resample.iter_mut().collect();
        Draw {
            model: model.model.clone(),
            coefficients: fit_model(&mut refs, &start, &fit.mechanisms, &params)
                .coefficients
                .rounded(),
        }
    })
}

/// Each target's model error, `ln(measured / predicted)` per metric `rows` has for it (a
/// figure the calibration cannot predict is left out): the calibration file's
/// `[[residuals]]`.
pub fn residuals(targets: &[Target], rows: &[Row]) -> Vec<Residual> {
    targets
        .iter()
        .map(|t| {
            let figures = rows
                .iter()
                .filter(|r| r.label == t.label)
                .map(|r| (r.metric.clone(), r.measured, r.predicted));
            let mut r = Residual::new(t.label.clone(), t.group(), t.held_out, figures);
            // Four significant digits: the file is read by people too.
            for e in r.errors.values_mut() {
                *e = format!("{e:.3e}").parse().expect("a number");
            }
            r
        })
        .collect()
}

/// How far the targets reach (their largest step, decode batch and context): a
/// calibration file's `[reach]`, beyond which its predictions extrapolate.
pub fn reach(targets: &[Target]) -> Option<crate::cost::ProfileCoverage> {
    targets
        .iter()
        .map(|t| crate::trust::reach(&t.setup.scenario))
        .reduce(|a, b| a.max(b))
}

/// The (run, key) pairs where a fitted run's own `[sim]` table sets a coefficient being
/// fitted: the scenario's `[sim]` keys are put back on top of every calibration it is
/// priced with, so the fit cannot move that coefficient for that run.
pub fn pinned_by_runs(targets: &[Target], params: &[Param]) -> Vec<(String, &'static str)> {
    let mut out = Vec::new();
    for t in targets.iter().filter(|t| !t.held_out) {
        let Some(sim) = &t.setup.scenario.sim else {
            continue;
        };
        for p in params {
            if sim.contains_key(p.name()) {
                out.push((t.label.clone(), p.name()));
            }
        }
    }
    out
}

/// One held-out figure against its interval.
#[derive(Debug, Clone)]
pub struct Covered {
    pub label: String,
    pub metric: String,
    pub measured: f64,
    pub interval: Interval,
}

/// The held-out figures against their intervals, and the held-out runs that could not be
/// predicted at all (no model, a failed simulation): the worst misses, said beside the
/// count rather than hidden from it.
#[derive(Debug, Clone, Default)]
pub struct Coverage {
    pub covered: Vec<Covered>,
    pub unpredicted: Vec<String>,
}

/// Each held-out target's figures against their 90% intervals: the target run under
/// `seeds` seeds with the fitted calibration, and the errors of `residuals` *except* those
/// of the target's own configuration (its group: the runs of the other models too). So no
/// interval is built from the figure that tests it, nor from its siblings.
pub fn coverage(
    targets: &mut [Target],
    fit: &Fit,
    residuals: &[Residual],
    draws: &[Draw],
    seeds: usize,
) -> Coverage {
    let mut out = Vec::new();
    let mut unpredicted = Vec::new();
    for t in targets.iter_mut().filter(|t| t.held_out) {
        let Some(m) = fit.models.iter().find(|m| m.model == t.model()) else {
            unpredicted.push(t.label.clone());
            continue;
        };
        let mut cal =
            Calibration::default_for(&t.setup.hardware).with(&fit.mechanisms, &m.coefficients);
        cal.draws = draws
            .iter()
            .filter(|d| d.model == m.model)
            .map(|d| d.coefficients)
            .collect();
        let Some(central) = t.summary(&cal) else {
            unpredicted.push(t.label.clone());
            continue;
        };
        let Ok(others) = interval::seeded_summaries(&t.setup, seeds, 1) else {
            unpredicted.push(t.label.clone());
            continue;
        };
        let group = t.group();
        let intervals = interval::intervals(&central, &others, residuals, Some(&group));
        for (metric, measured) in &t.measured {
            if let Some(i) = intervals.iter().find(|i| i.key == *metric) {
                out.push(Covered {
                    label: t.label.clone(),
                    metric: metric.clone(),
                    measured: *measured,
                    interval: i.clone(),
                });
            }
        }
    }
    Coverage {
        covered: out,
        unpredicted,
    }
}

/// The coverage in lines: per metric and pooled, how many held-out figures fell inside
/// their interval and the intervals' median width (percent of the predicted figure).
pub fn render_coverage(coverage: &Coverage, seeds: usize) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let covered = &coverage.covered;
    if !coverage.unpredicted.is_empty() {
        let _ = writeln!(
            s,
            "\n{} held-out runs could not be predicted, so are in no count below: {}",
            coverage.unpredicted.len(),
            coverage.unpredicted.join(", ")
        );
    }
    if covered.is_empty() {
        return s;
    }
    let _ = writeln!(
        s,
        "\n{:.0}% intervals on the held-out runs ({seeds} seeds; each from the errors of the \
         runs of the other configurations):",
        interval::LEVEL * 100.0
    );
    let line = |s: &mut String, name: &str, rows: Vec<&Covered>| {
        let inside = rows
            .iter()
            .filter(|c| c.interval.contains(c.measured))
            .count();
        let mut widths: Vec<f64> = rows
            .iter()
            .map(|c| c.interval.relative_width() * 100.0)
            .collect();
        widths.sort_by(f64::total_cmp);
        let _ = writeln!(
            s,
            "  {name:<18} {inside:>4}/{:<4} inside ({:.0}%), median width {:.0}%",
            rows.len(),
            inside as f64 / rows.len() as f64 * 100.0,
            median(&widths)
        );
    };
    for m in FIT_METRICS {
        let rows: Vec<&Covered> = covered.iter().filter(|c| c.metric == m).collect();
        if !rows.is_empty() {
            line(&mut s, m, rows);
        }
    }
    line(&mut s, "pooled", covered.iter().collect());
    s
}

/// ", static batching's host X ms + Y ms per sequence" where a calibration has its own.
/// ", single-sequence decode bandwidth_efficiency X" where the fit has its own, else "".
fn single_decode_note(c: &Coefficients) -> String {
    c.single_decode_bandwidth_efficiency
        .map(|e| format!(", single-sequence decode bandwidth_efficiency {e:.3}"))
        .unwrap_or_default()
}

fn static_host_note(c: &Coefficients) -> String {
    if c.static_step_overhead_s.is_none() && c.static_per_seq_overhead_s.is_none() {
        return String::new();
    }
    let (step, per_seq) = c.static_host();
    format!(
        ", static batching's host {:.2} ms + {:.3} ms per sequence",
        step * 1e3,
        per_seq * 1e3
    )
}

/// Median |error| in percent per metric, of the rows with `held_out == held`; `None` for a
/// metric without rows.
pub fn median_errors(rows: &[Row], held: bool) -> Vec<(&'static str, Option<f64>)> {
    FIT_METRICS
        .iter()
        .map(|&m| {
            let mut e: Vec<f64> = rows
                .iter()
                .filter(|r| r.held_out == held && r.metric == m)
                .map(|r| r.error_pct().abs())
                .collect();
            e.sort_by(f64::total_cmp);
            (m, (!e.is_empty()).then(|| median(&e)))
        })
        .collect()
}

/// The fit as text: every figure beside its measurement, the coefficients per model and
/// the median |error| per metric, fitted and held out.
pub fn render(rows: &[Row], fit: &Fit) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<44} {:<18} {:>10} {:>10} {:>7}  set",
        "run", "metric", "measured", "predicted", "error%"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:<44} {:<18} {:>10.1} {:>10.1} {:>+7.0}  {}",
            r.label,
            r.metric,
            r.measured,
            r.predicted,
            r.error_pct(),
            if r.held_out { "held out" } else { "fit" }
        );
    }
    let _ = writeln!(s, "\nmechanisms: {}", fit.mechanisms.describe());
    for f in &fit.models {
        let c = &f.coefficients;
        let _ = writeln!(
            s,
            "{}: compute_efficiency {:.3}, attention_efficiency {:.3} (decode {:.4}), \
             bandwidth_efficiency {:.3}, step_overhead {:.2} ms, per_seq_overhead {:.3} ms, client request {:.2} ms, \
             stream {:.2} ms, static batch window {:.1} ms{}{}{} (loss {:.4}, {} evaluations)",
            f.model,
            c.compute_efficiency,
            c.attention_efficiency,
            c.decode_attention_efficiency
                .unwrap_or(c.attention_efficiency),
            c.bandwidth_efficiency,
            c.step_overhead_s * 1e3,
            c.per_seq_overhead_s * 1e3,
            c.client_request_s * 1e3,
            c.client_stream_s * 1e3,
            c.static_batch_window_s * 1e3,
            static_host_note(c),
            single_decode_note(c),
            crate::calibration::jitter_note(c.step_jitter_s),
            f.loss,
            f.evaluations
        );
    }
    for (held, name) in [(false, "fit"), (true, "held out")] {
        let n = rows.iter().filter(|r| r.held_out == held).count();
        if n == 0 {
            continue;
        }
        let _ = write!(s, "median |error| {name} ({n} figures):");
        for (m, e) in median_errors(rows, held) {
            if let Some(e) = e {
                let _ = write!(s, " {m} {e:.0}%");
            }
        }
        let _ = writeln!(s);
    }
    s
}

fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small run of the baseline scenario (few steps: the tests fit many times over).
    fn target(label: &str, set: &[&str], held_out: bool) -> Target {
        let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/baseline.toml");
        let small = [
            "workload.num_requests=4",
            "workload.warmup_requests=0",
            "workload.output_tokens=8",
        ];
        let set: Vec<String> = small.iter().chain(set).map(|s| s.to_string()).collect();
        Target {
            label: label.into(),
            setup: setup::load(file, &set).unwrap(),
            measured: Vec::new(),
            held_out,
        }
    }

    /// Measurements with known coefficients: `t`'s figures as `cal` predicts them.
    fn measure_under(t: &mut Target, cal: &Calibration) {
        t.measured = FIT_METRICS.iter().map(|m| (m.to_string(), 1.0)).collect();
        let got = t.predict(cal);
        for ((_, v), g) in t.measured.iter_mut().zip(got) {
            *v = g;
        }
    }

    /// Targets `t0`, `t1`, … with the overrides of `sets`, "measured" under `truth`.
    fn measured_targets(sets: &[Vec<&str>], truth: &Calibration) -> Vec<Target> {
        let mut targets: Vec<Target> = sets
            .iter()
            .enumerate()
            .map(|(i, o)| target(&format!("t{i}"), o, false))
            .collect();
        for t in &mut targets {
            measure_under(t, truth);
        }
        targets
    }

    /// Overrides of three Llama runs: a single stream, a single stream of 1,024-token
    /// prompts, and four streams at once.
    fn llama_runs() -> [Vec<&'static str>; 3] {
        [
            vec!["server.model=llama-3.2-3b"],
            vec!["server.model=llama-3.2-3b", "workload.prompt_tokens=1024"],
            vec![
                "server.model=llama-3.2-3b",
                "arrival.kind=concurrency",
                "arrival.max_concurrency=4",
                "workload.num_requests=8",
            ],
        ]
    }

    /// A calibration file holding `c` for Llama on the RTX 5080, default mechanisms.
    fn llama_file(c: Coefficients) -> CalibrationFile {
        Fit {
            hardware: "rtx-5080".into(),
            mechanisms: Mechanisms::default(),
            models: vec![ModelFit {
                model: "llama-3.2-3b".into(),
                coefficients: c,
                loss: f64::NAN,
                evaluations: 0,
            }],
        }
        .file("", "")
    }

    /// A held-out run that cannot be predicted is named beside the coverage, not dropped
    /// from it unsaid.
    #[test]
    fn held_out_runs_without_a_prediction_are_said_not_dropped() {
        let truth = Calibration::default_for(&crate::catalog::find_hardware("rtx-5080").unwrap());
        let [single, ..] = llama_runs();
        let mut targets = measured_targets(&[single], &truth);
        targets[0].held_out = true;
        let no_models = Fit {
            hardware: "rtx-5080".into(),
            mechanisms: Mechanisms::default(),
            models: Vec::new(),
        };
        let c = coverage(&mut targets, &no_models, &[], &[], 2);
        assert!(c.covered.is_empty());
        assert_eq!(c.unpredicted, vec![targets[0].label.clone()]);
        assert!(render_coverage(&c, 2).contains("1 held-out runs could not be predicted"));
    }

    /// A fitted run whose own `[sim]` sets a coefficient being fitted is named: that value
    /// prices it whatever the fit tries.
    #[test]
    fn runs_that_pin_a_fitted_coefficient_are_named() {
        let truth = Calibration::default_for(&crate::catalog::find_hardware("rtx-5080").unwrap());
        let pinned = vec!["server.model=llama-3.2-3b", "sim.step_overhead_s=0.004"];
        let t = measured_targets(&[pinned], &truth);
        assert_eq!(
            pinned_by_runs(&t, &[Param::StepOverhead, Param::PerSeqOverhead]),
            vec![(t[0].label.clone(), "step_overhead_s")]
        );
    }

    #[test]
    fn a_fit_recovers_the_coefficients_that_made_its_targets() {
        // Make "measurements" with known coefficients, then fit from the defaults.
        let [single, long_prompt, batch_of_4] = llama_runs();
        let overrides = [single, long_prompt, batch_of_4];
        let mut truth =
            Calibration::default_for(&crate::catalog::find_hardware("rtx-5080").unwrap());
        truth.compute_efficiency = 0.3;
        truth.step_overhead_s = 4e-3;
        truth.per_seq_overhead_s = 1e-3;
        let mut targets = measured_targets(&overrides, &truth);
        let params = [
            Param::ComputeEfficiency,
            Param::StepOverhead,
            Param::PerSeqOverhead,
        ];
        let fit = fit_all(&mut targets, &Mechanisms::default(), &params, None).unwrap();
        let c = fit.models[0].coefficients;
        let close = |a: f64, b: f64| (a - b).abs() / b < 0.1;
        assert!(close(c.compute_efficiency, 0.3), "{c:?}");
        assert!(close(c.step_overhead_s, 4e-3), "{c:?}");
        assert!(close(c.per_seq_overhead_s, 1e-3), "{c:?}");
        let rows = rows(&mut targets, &fit);
        for (m, e) in median_errors(&rows, false) {
            assert!(e.unwrap() < 2.0, "{m}: {e:?}");
        }
    }

    /// Runs made under contiguous slots are predicted as made under that layout and far
    /// worse under paged blocks: four streams where two slots of `max_model_len` fit (the
    /// paged pool admits all four at once). What `--search-policies` reports per run.
    #[test]
    fn runs_support_the_kv_layout_that_made_them() {
        let truth = Calibration::default_for(&crate::catalog::find_hardware("rtx-5080").unwrap());
        let slots = vec![
            "server.model=llama-3.2-3b",
            "server.kv_cache_backend=contiguous",
            "server.num_gpu_blocks=512",
            "arrival.kind=concurrency",
            "arrival.max_concurrency=4",
            "workload.num_requests=8",
        ];
        let mut made = measured_targets(&[slots], &truth);
        let fit = fit_all(
            &mut made,
            &Mechanisms::default(),
            &[Param::StepOverhead],
            None,
        )
        .unwrap();
        let loss_under = |backend| {
            let mut ts = with_kv_backend(&made, backend).unwrap();
            assert_eq!(ts[0].setup.scenario.server.kv_cache_backend, backend);
            let losses = run_losses(&rows(&mut ts, &fit));
            assert_eq!(losses.len(), 1);
            assert_eq!(losses[0].0, "t0");
            losses[0].1
        };
        let (slots, paged) = (
            loss_under(KvBackend::Contiguous),
            loss_under(KvBackend::Paged),
        );
        assert!(slots < 1e-3, "{slots}");
        assert!(
            paged > 10.0 * slots.max(1e-3),
            "slots {slots}, paged {paged}"
        );
    }

    /// Bootstrap refits: the same every time (seeded), one per resample and model, each
    /// moving only the coefficients named; and their residuals are ln(measured/predicted).
    /// A single stream's decode and a batch's decodes tell the two bandwidths apart: the fit
    /// recovers a single-sequence efficiency far below the batches' (and leaves it absent
    /// when not asked to fit it).
    #[test]
    fn a_fit_tells_a_single_sequences_decode_from_a_batchs() {
        let [single, _, batch_of_4] = llama_runs();
        let overrides = [single, batch_of_4];
        let mut truth =
            Calibration::default_for(&crate::catalog::find_hardware("rtx-5080").unwrap());
        truth.bandwidth_efficiency = 0.7;
        truth.single_decode_bandwidth_efficiency = Some(0.3);
        let mut targets = measured_targets(&overrides, &truth);
        let params = [
            Param::BandwidthEfficiency,
            Param::SingleDecodeBandwidthEfficiency,
        ];
        let fit = fit_all(&mut targets, &Mechanisms::default(), &params, None).unwrap();
        let c = fit.models[0].coefficients;
        let close = |a: f64, b: f64| (a - b).abs() / b < 0.1;
        assert!(close(c.bandwidth_efficiency, 0.7), "{c:?}");
        let single = c.single_decode_bandwidth_efficiency.expect("fitted");
        assert!(close(single, 0.3), "{c:?}");
        assert!(render(&rows(&mut targets, &fit), &fit).contains("single-sequence decode"));
        let fit = fit_all(&mut targets, &Mechanisms::default(), &params[..1], None).unwrap();
        assert_eq!(
            fit.models[0]
                .coefficients
                .single_decode_bandwidth_efficiency,
            None
        );
    }

    #[test]
    fn bootstrap_refits_are_seeded_and_move_only_what_they_refit() {
        let mut truth =
            Calibration::default_for(&crate::catalog::find_hardware("rtx-5080").unwrap());
        truth.step_overhead_s = 4e-3;
        let sets = [
            vec!["server.model=llama-3.2-3b"],
            vec!["server.model=llama-3.2-3b", "workload.prompt_tokens=1024"],
            vec!["server.model=llama-3.2-3b", "workload.output_tokens=4"],
        ];
        let mut targets = measured_targets(&sets, &truth);
        // Measurements a little off the truth, so resamples disagree.
        for (t, f) in targets.iter_mut().zip([1.1, 0.9, 1.0]) {
            for (_, v) in &mut t.measured {
                *v *= f;
            }
        }
        let params = [Param::StepOverhead];
        let fit = fit_all(&mut targets, &Mechanisms::default(), &params, None).unwrap();
        let draws = bootstrap(&targets, &fit, &params, 4);
        assert_eq!(draws, bootstrap(&targets, &fit, &params, 4), "seeded");
        assert_eq!(draws.len(), 4);
        let fitted = fit.models[0].coefficients.rounded();
        for d in &draws {
            assert_eq!(d.model, "llama-3.2-3b");
            let moved = Coefficients {
                step_overhead_s: fitted.step_overhead_s,
                ..d.coefficients
            };
            assert_eq!(moved, fitted, "only step_overhead_s moves");
        }
        let spread: Vec<f64> = draws
            .iter()
            .map(|d| d.coefficients.step_overhead_s)
            .collect();
        assert!(
            spread.iter().any(|&v| v != spread[0]),
            "resamples differ: {spread:?}"
        );
        let rows = rows(&mut targets, &fit);
        let res = residuals(&targets, &rows);
        assert_eq!(res.len(), 3);
        let r = rows.iter().find(|r| r.label == "t0").unwrap();
        let e = res[0].errors[&r.metric];
        assert!((e - (r.measured / r.predicted).ln()).abs() < 1e-3, "{e}");
    }

    /// A second stage (`sim calibrate --start FILE --fit …`): the named coefficient moves
    /// to what made the targets, every other one stays at the start file's value even where
    /// that value is wrong; a start without the targets' model is refused by name.
    #[test]
    fn a_second_stage_fits_only_what_it_names() {
        let hw = crate::catalog::find_hardware("rtx-5080").unwrap();
        let mut truth = Calibration::default_for(&hw);
        truth.per_seq_overhead_s = 2e-3;
        truth.step_overhead_s = 5e-3;
        let mut targets = vec![target("t", &["server.model=llama-3.2-3b"], false)];
        measure_under(&mut targets[0], &truth);
        let mut started = Coefficients::of(&truth);
        started.step_overhead_s = 1e-3; // off: the second stage fits it
        started.per_seq_overhead_s = 3e-3; // off, and kept: it is not named
        started.compute_efficiency = 0.4; // off the generic default too, and kept
        assert_ne!(started.compute_efficiency, truth.compute_efficiency);
        assert_eq!(started.decode_attention_efficiency, None, "tied");
        let mut file = llama_file(started);
        let fit = fit_all(
            &mut targets,
            &Mechanisms::default(),
            &[Param::StepOverhead],
            Some(("start.toml", &file)),
        )
        .unwrap();
        let c = fit.models[0].coefficients;
        assert_eq!(c.per_seq_overhead_s, 3e-3, "{c:?}");
        assert_eq!(c.compute_efficiency, 0.4, "{c:?}");
        assert_eq!(c.decode_attention_efficiency, None, "still tied: {c:?}");
        assert!(
            (c.step_overhead_s - 1e-3).abs() > 1e-3,
            "the named coefficient moved off its start: {c:?}"
        );
        assert!(
            fit.models[0].loss
                < 0.5 * {
                    let from = truth.with(&Mechanisms::default(), &started);
                    let mut mine: Vec<&mut Target> = targets.iter_mut().collect();
                    loss(&mut mine, &from)
                }
        );
        // From a tied start (the first stage's), the decode attention is fitted on its own
        // and comes out untied, at the slow kernel that made the figures. Eight long
        // decodes at once, so that attention outlasts the weights' reading.
        let mut slow = truth.clone();
        slow.decode_attention_efficiency = 0.003;
        let mut long = vec![target(
            "long",
            &[
                "server.model=llama-3.2-3b",
                "workload.prompt_tokens=2048",
                "workload.num_requests=8",
                "arrival.kind=concurrency",
                "arrival.max_concurrency=8",
            ],
            false,
        )];
        measure_under(&mut long[0], &slow);
        let tied = llama_file(Coefficients::of(&truth));
        let fit = fit_all(
            &mut long,
            &Mechanisms::default(),
            &[Param::DecodeAttentionEfficiency],
            Some(("start.toml", &tied)),
        )
        .unwrap();
        let d = fit.models[0].coefficients.decode_attention_efficiency;
        assert!(d.is_some_and(|d| (d / 0.003 - 1.0).abs() < 0.2), "{d:?}");

        let refused = |file: &CalibrationFile, mechanisms: &Mechanisms, targets: &mut [Target]| {
            fit_all(
                targets,
                mechanisms,
                &[Param::StepOverhead],
                Some(("start.toml", file)),
            )
            .err()
            .unwrap()
            .to_string()
        };
        let padded = Mechanisms {
            prefill_batching: PrefillBatching::Padded,
            ..Mechanisms::default()
        };
        let e = refused(&file, &padded, &mut targets);
        assert!(
            e.starts_with("start.toml: key `mechanisms`")
                && e.contains("other mechanisms")
                && e.contains("Padded"),
            "{e}"
        );
        let elsewhere = CalibrationFile {
            hardware: "l4".into(),
            ..file.clone()
        };
        let e = refused(&elsewhere, &Mechanisms::default(), &mut targets);
        assert!(
            e.starts_with("start.toml: key `hardware`")
                && e.contains("l4")
                && e.contains("rtx-5080"),
            "{e}"
        );
        file.models.clear();
        let e = refused(&file, &Mechanisms::default(), &mut targets);
        assert!(
            e.starts_with("start.toml: key `models`")
                && e.contains("no coefficients for llama-3.2-3b"),
            "{e}"
        );
    }

    #[test]
    fn a_search_tries_every_mechanism_not_given_and_holds_those_given() {
        let given = Mechanisms {
            prefill_batching: PrefillBatching::Packed,
            roofline: Roofline::Serial,
            reserved_gib: Some(1.5),
            ..Mechanisms::default()
        };
        let all = mechanism_candidates(&given, Held::default());
        assert_eq!(all.len(), 128);
        assert!(all
            .iter()
            .any(|m| m.prefill_batching == PrefillBatching::Padded));
        let held = Held {
            prefill_batching: true,
            roofline: true,
            ..Held::default()
        };
        let some = mechanism_candidates(&given, held);
        assert_eq!(some.len(), 32);
        assert!(some
            .iter()
            .all(|m| m.prefill_batching == PrefillBatching::Packed
                && m.roofline == Roofline::Serial
                && m.reserved_gib == Some(1.5)));
        let distinct: std::collections::BTreeSet<String> =
            some.iter().map(Mechanisms::describe).collect();
        assert_eq!(
            distinct.len(),
            32,
            "every combination of the other five, once"
        );
    }

    #[test]
    fn held_out_targets_are_never_fitted_to() {
        let mut targets = vec![
            target("fit", &["server.model=llama-3.2-3b"], false),
            target("held", &["server.model=llama-3.2-3b"], true),
        ];
        targets[0].measured = vec![("median_itl_ms".into(), 12.0)];
        // Absurd on purpose: if it were fitted to, the fit would move far from 12 ms.
        targets[1].measured = vec![("median_itl_ms".into(), 500.0)];
        let fit = fit_all(
            &mut targets,
            &Mechanisms::default(),
            &[Param::StepOverhead],
            None,
        )
        .unwrap();
        let rows = rows(&mut targets, &fit);
        assert!(rows[0].error_pct().abs() < 2.0, "{rows:?}");
        assert!(rows[1].error_pct() < -90.0, "{rows:?}");
        let mut only_held = vec![target("held", &["server.model=llama-3.2-3b"], true)];
        only_held[0].measured = vec![("median_itl_ms".into(), 12.0)];
        let e = fit_all(
            &mut only_held,
            &Mechanisms::default(),
            &[Param::StepOverhead],
            None,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("held out"), "{e}");
    }

    /// Static batching's own host costs: fitted only for a model whose fitted runs batch
    /// both ways, and then recovered beside continuous batching's; a model without static
    /// runs keeps none (not the zero that nothing measured would give).
    #[test]
    fn static_batchings_host_costs_are_fitted_apart_where_runs_show_them() {
        let with_model = |model: &'static str, set: &[&'static str], statically: bool| {
            let mut v = vec![model];
            v.extend_from_slice(set);
            if statically {
                v.push("server.batching_mode=static");
            }
            v
        };
        let four = [
            "arrival.kind=concurrency",
            "arrival.max_concurrency=4",
            "workload.num_requests=8",
        ];
        let (llama, gemma) = ("server.model=llama-3.2-3b", "server.model=gemma-3-1b");
        let mut targets = vec![
            target("cont-1", &with_model(llama, &[], false), false),
            target("cont-4", &with_model(llama, &four, false), false),
        ];
        let has_static = |targets: &mut [Target]| unfittable(&DEFAULT_PARAMS, targets).is_empty();
        assert!(!has_static(&mut targets));
        targets.push(target("static-1", &with_model(llama, &[], true), true));
        assert!(
            !has_static(&mut targets),
            "a held-out static run is not fitted to"
        );
        targets.push(target("static-4", &with_model(llama, &four, true), false));
        assert!(has_static(&mut targets));
        // Gemma3 runs continuous batching only.
        targets.push(target("gemma-1", &with_model(gemma, &[], false), false));
        targets.push(target("gemma-4", &with_model(gemma, &four, false), false));
        assert_eq!(
            unfittable(&DEFAULT_PARAMS, &targets),
            vec![(
                "gemma-3-1b",
                vec![Param::StaticStepOverhead, Param::StaticPerSeqOverhead]
            )]
        );

        let mut truth =
            Calibration::default_for(&crate::catalog::find_hardware("rtx-5080").unwrap());
        truth.step_overhead_s = 4e-3;
        truth.per_seq_overhead_s = 1e-3;
        truth.static_step_overhead_s = Some(2e-3);
        truth.static_per_seq_overhead_s = Some(0.4e-3);
        for t in &mut targets {
            t.held_out = false;
            measure_under(t, &truth);
        }
        let fit = fit_all(
            &mut targets,
            &Mechanisms::default(),
            &[
                Param::StepOverhead,
                Param::PerSeqOverhead,
                Param::StaticStepOverhead,
                Param::StaticPerSeqOverhead,
            ],
            None,
        )
        .unwrap();
        let of = |name: &str| {
            fit.models
                .iter()
                .find(|m| m.model == name)
                .unwrap()
                .coefficients
        };
        let c = of("llama-3.2-3b");
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() / b < 0.1);
        assert!(close(Some(c.step_overhead_s), 4e-3), "{c:?}");
        assert!(close(Some(c.per_seq_overhead_s), 1e-3), "{c:?}");
        assert!(close(c.static_step_overhead_s, 2e-3), "{c:?}");
        assert!(close(c.static_per_seq_overhead_s, 0.4e-3), "{c:?}");
        let g = of("gemma-3-1b");
        assert!(close(Some(g.step_overhead_s), 4e-3), "{g:?}");
        assert_eq!(g.static_step_overhead_s, None, "{g:?}");
        assert_eq!(g.static_per_seq_overhead_s, None, "{g:?}");
    }

    #[test]
    fn bad_figures_and_parameters_are_refused_by_name() {
        let e = measured_figures([("median_ttft_ms".to_string(), -1.0)].into_iter())
            .unwrap_err()
            .to_string();
        assert!(e.contains("median_ttft_ms"), "{e}");
        let e = measured_figures([("bogus".to_string(), 1.0)].into_iter())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no figure"), "{e}");
        let e = Param::parse("speed").unwrap_err().to_string();
        assert!(e.contains("per_seq_overhead_s"), "{e}");
    }
}
