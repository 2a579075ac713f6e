//! `sim plan`: which configuration to run under latency objectives, and how much traffic
//! each configuration holds.
//!
//! A plan's configurations are named bundles of settings (`--config NAME:key=v,…` or the
//! scenario's `[plan.configs]`; the benchmark log's phases are such bundles), each crossed
//! with the product of the varied keys (`--vary key=v1,v2,…` or `[plan] vary`), all on the
//! scenario's workload. Each is simulated (in parallel, as `sim sweep` does) and given:
//!
//! * goodput: requests per second within every objective (vLLM's `request_goodput`), SLO
//!   attainment (the fraction of requests within them) and cost (GPUs: replicas × the
//!   model's tensor-parallel degree);
//! * with `--capacity`, its capacity: the highest arrival rate of the same arrival process
//!   at which the attainment still reaches the target over at least `sustained_requests`
//!   requests (1,000 by default), found by bracketing the rate;
//! * with `--target-rate R`, the fewest replicas that hold R.
//!
//! The best configuration is the one that holds the target rate on the fewest GPUs (with a
//! target rate), else the most capacity per GPU (with `--capacity`), else the most goodput
//! per GPU among those whose attainment reaches the target. The Pareto front is the set of
//! configurations no other beats at the scenario's rate on goodput per GPU and on the P99
//! of every metric the SLO names at once.
//!
//! `search` holds the capacity and replica searches, `render` the plan's CSV, console text
//! and report.

use std::fmt::Write as _;

use infer_core::metrics::{Slo, Summary};
use infer_core::workload::{ArrivalKind, Scenario};

use crate::error::SimError;
use crate::simulate::RunStats;
use crate::sweep::{self, Axis};

mod render;
mod search;

pub use render::{answer, console, csv, describe_slo, report};
pub use search::{search_capacity, search_replicas, Capacity, MAX_REPLICAS};

/// The most configurations a plan may have: at a few milliseconds each that is minutes,
/// and a larger space is a typo (an axis of a thousand values) more often than a plan.
pub const MAX_CONFIGS: usize = 100_000;

/// A named bundle of settings (`--config NAME:key=v,key=v`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedConfig {
    pub name: String,
    /// `key=value` overrides, as `--set` takes them.
    pub settings: Vec<String>,
}

/// Parse `NAME:key=v,key=v`; commas inside brackets, braces or quotes do not split.
pub fn parse_config(s: &str) -> Result<NamedConfig, SimError> {
    let bad = |why: &str| SimError::Invalid(format!("--config `{s}`: {why}"));
    let (name, settings) = s
        .split_once(':')
        .ok_or_else(|| bad("expected NAME:key=value,key=value"))?;
    let name = name.trim();
    if name.is_empty() {
        return Err(bad("the configuration has no name"));
    }
    let settings = sweep::split_list(settings);
    if let Some(v) = settings.iter().find(|v| !v.contains('=')) {
        return Err(bad(&format!("`{v}` is not key=value")));
    }
    Ok(NamedConfig {
        name: name.to_string(),
        settings,
    })
}

/// What a plan searches and for what, from the scenario's `[plan]` table and the command
/// line (which replaces the table's entries it gives).
#[derive(Debug, Clone, PartialEq)]
pub struct PlanSpec {
    /// The objectives a request must meet (the scenario's `[slo]` or `--slo`).
    pub slo: Slo,
    /// The fraction of requests that must meet them, in (0, 1].
    pub attainment: f64,
    pub axes: Vec<Axis>,
    pub configs: Vec<NamedConfig>,
    /// Search each configuration's capacity.
    pub capacity: bool,
    /// Find each configuration's fewest replicas that hold this rate.
    pub target_rate: Option<f64>,
    /// Requests each simulation of a capacity or replica search runs, at least (the
    /// workload's first ones): a rate held for 48 requests is a burst survived, not a load
    /// sustained.
    pub sustained_requests: usize,
}

/// The `[plan]` table's entries (all optional).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PlanTable {
    pub attainment: Option<f64>,
    pub axes: Vec<Axis>,
    pub configs: Vec<NamedConfig>,
    pub capacity: Option<bool>,
    pub target_rate: Option<f64>,
    pub sustained_requests: Option<usize>,
}

impl PlanTable {
    /// Read a scenario's `[plan]` table; an error names `plan.<key>`.
    pub fn parse(file: &str, table: &toml::Table) -> Result<PlanTable, SimError> {
        let key_err = |key: &str, reason: String| SimError::Key {
            file: file.to_string(),
            key: format!("plan.{key}"),
            reason,
        };
        let mut out = PlanTable::default();
        for (key, value) in table {
            match key.as_str() {
                "attainment" => {
                    out.attainment = Some(number(value).ok_or_else(|| {
                        key_err(key, format!("expected a number in (0, 1], got {value}"))
                    })?)
                }
                "target_rate" => {
                    out.target_rate = Some(number(value).ok_or_else(|| {
                        key_err(key, format!("expected requests per second, got {value}"))
                    })?)
                }
                "sustained_requests" => {
                    out.sustained_requests = Some(
                        value
                            .as_integer()
                            .and_then(|n| usize::try_from(n).ok())
                            .filter(|&n| n >= 1)
                            .ok_or_else(|| {
                                key_err(key, format!("expected a number of requests, got {value}"))
                            })?,
                    )
                }
                "capacity" => {
                    out.capacity = Some(value.as_bool().ok_or_else(|| {
                        key_err(key, format!("expected true or false, got {value}"))
                    })?)
                }
                "vary" => {
                    for v in strings(value).ok_or_else(|| {
                        key_err(key, "expected a list of \"key=v1,v2,…\" strings".into())
                    })? {
                        out.axes
                            .push(sweep::parse_axis(&v).map_err(|e| key_err(key, e.to_string()))?);
                    }
                }
                "configs" => {
                    let t = value.as_table().ok_or_else(|| {
                        key_err(key, "expected a table of NAME = [\"key=value\", …]".into())
                    })?;
                    for (name, settings) in t {
                        let settings = strings(settings)
                            .filter(|s| s.iter().all(|v| v.contains('=')))
                            .ok_or_else(|| {
                                key_err(
                                    &format!("configs.{name}"),
                                    "expected a list of \"key=value\" strings".into(),
                                )
                            })?;
                        out.configs.push(NamedConfig {
                            name: name.clone(),
                            settings,
                        });
                    }
                }
                _ => {
                    return Err(key_err(
                        key,
                        "unknown key (expected attainment, vary, configs, capacity, target_rate, \
                         sustained_requests)"
                            .into(),
                    ))
                }
            }
        }
        Ok(out)
    }
}

fn number(v: &toml::Value) -> Option<f64> {
    v.as_float().or_else(|| v.as_integer().map(|i| i as f64))
}

fn strings(v: &toml::Value) -> Option<Vec<String>> {
    v.as_array()?
        .iter()
        .map(|s| s.as_str().map(str::to_string))
        .collect()
}

impl PlanSpec {
    /// Check what no simulation can fix: an objective, an attainment in (0, 1], distinct
    /// keys and names, a positive target rate.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |s: String| Err(SimError::Invalid(s));
        if let Err((key, why)) = self.slo.validate() {
            return bad(format!(
                "a plan needs latency objectives (--slo ttft:MS tpot:MS e2el:MS, or the \
                 scenario's [slo] table): slo.{key}: {why}"
            ));
        }
        if !(self.attainment > 0.0 && self.attainment <= 1.0) {
            return bad(format!(
                "--attainment (plan.attainment) must be in (0, 1], got {}",
                self.attainment
            ));
        }
        sweep::check_distinct(&self.axes)?;
        for (i, c) in self.configs.iter().enumerate() {
            if self.configs[..i].iter().any(|d| d.name == c.name) {
                return bad(format!("--config {}: the name is used twice", c.name));
            }
        }
        if let Some(r) = self.target_rate {
            if !(r > 0.0 && r.is_finite()) {
                return bad(format!("--target-rate must be > 0 requests/s, got {r}"));
            }
        }
        Ok(())
    }

    /// Every configuration: each named one (or the scenario as it is) crossed with the
    /// grid of the varied keys.
    pub fn configurations(&self) -> Result<Vec<Configuration>, SimError> {
        let named = if self.configs.is_empty() {
            vec![NamedConfig {
                name: String::new(),
                settings: Vec::new(),
            }]
        } else {
            self.configs.clone()
        };
        // Counted without overflow: 16 axes of 16 values would wrap a plain product to 0.
        if sweep::grid_size(&self.axes, named.len()).is_none_or(|n| n > MAX_CONFIGS) {
            return Err(SimError::Invalid(format!(
                "the plan has {} configurations, more than {MAX_CONFIGS}: {} named × {}",
                sweep::grid_size_text(&self.axes, named.len()),
                named.len(),
                sweep::axis_sizes(&self.axes)
            )));
        }
        let grid = sweep::grid(&self.axes);
        Ok(named
            .iter()
            .flat_map(|c| {
                grid.iter().map(move |point| {
                    let mut name = c.name.clone();
                    for (k, v) in point {
                        if !name.is_empty() {
                            name.push(' ');
                        }
                        let short = k.rsplit('.').next().unwrap_or(k);
                        let _ = write!(name, "{short}={v}");
                    }
                    if name.is_empty() {
                        name = "as given".into();
                    }
                    Configuration {
                        name,
                        config: c.name.clone(),
                        assignment: point.clone(),
                        settings: c
                            .settings
                            .iter()
                            .cloned()
                            .chain(point.iter().map(|(k, v)| format!("{k}={v}")))
                            .collect(),
                    }
                })
            })
            .collect())
    }
}

/// One configuration of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Configuration {
    /// The named configuration and the varied values, e.g. `P8 max_batch_size=16`.
    pub name: String,
    /// The named configuration's name (empty without named configurations).
    pub config: String,
    /// The varied keys' values.
    pub assignment: Vec<(String, String)>,
    /// Every override it adds to the scenario.
    pub settings: Vec<String>,
}

/// A configuration's figures at the scenario's rate (latencies in ms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    /// Replicas × the model's tensor-parallel degree.
    pub gpus: usize,
    pub goodput: f64,
    pub attainment: f64,
    pub output_throughput: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub tpot_p50_ms: f64,
    pub tpot_p99_ms: f64,
    pub e2el_p99_ms: f64,
}

impl Figures {
    fn of(s: &Summary, st: &RunStats, gpus_per_replica: usize) -> Figures {
        let g = s.goodput.unwrap_or_default();
        Figures {
            gpus: st.replicas.max(1) * gpus_per_replica,
            goodput: g.request_goodput,
            attainment: g.slo_attainment,
            output_throughput: s.output_throughput,
            ttft_p50_ms: s.ttft.median * 1e3,
            ttft_p99_ms: s.ttft.p99 * 1e3,
            tpot_p50_ms: s.tpot.median * 1e3,
            tpot_p99_ms: s.tpot.p99 * 1e3,
            e2el_p99_ms: s.e2el.p99 * 1e3,
        }
    }

    /// The P99 of each metric the SLO names (lower is better), for the Pareto front.
    fn latencies(&self, slo: &Slo) -> Vec<f64> {
        let mut v = Vec::new();
        if slo.ttft_ms.is_some() {
            v.push(self.ttft_p99_ms);
        }
        if slo.tpot_ms.is_some() {
            v.push(self.tpot_p99_ms);
        }
        if slo.e2el_ms.is_some() {
            v.push(self.e2el_p99_ms);
        }
        v
    }
}

/// A configuration's outcome.
#[derive(Debug)]
pub struct Outcome {
    pub configuration: Configuration,
    pub result: Result<Evaluated, SimError>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Evaluated {
    pub figures: Figures,
    /// The model's tensor-parallel degree: the GPUs of one replica.
    pub gpus_per_replica: usize,
    pub capacity: Option<Capacity>,
    /// Fewest replicas holding the target rate (`Some(None)`: not within the maximum).
    pub replicas_for_target: Option<Option<usize>>,
    /// What preparing the configuration warned of (uncalibrated, extrapolation, memory).
    pub warnings: Vec<String>,
}

impl Evaluated {
    pub fn meets(&self, attainment: f64) -> bool {
        self.figures.attainment >= attainment
    }

    pub fn capacity_per_gpu(&self) -> Option<f64> {
        self.capacity.map(|c| c.rate / self.figures.gpus as f64)
    }

    pub fn goodput_per_gpu(&self) -> f64 {
        self.figures.goodput / self.figures.gpus as f64
    }

    /// The GPUs of the fewest replicas holding the target rate, when some do.
    pub fn gpus_for_target(&self) -> Option<usize> {
        self.replicas_for_target
            .flatten()
            .map(|r| r * self.gpus_per_replica)
    }
}

/// The scenario a plan runs: its file, text and the overrides every configuration shares.
pub struct Base<'a> {
    pub file: &'a str,
    pub text: &'a str,
    pub overrides: &'a [String],
}

impl Base<'_> {
    fn overrides(&self, extra: &[String]) -> Vec<String> {
        [self.overrides, extra].concat()
    }
}

/// Simulate one configuration, then search its capacity and replicas as the plan asks.
pub fn evaluate(base: &Base, spec: &PlanSpec, c: &Configuration) -> Result<Evaluated, SimError> {
    let scenario = Scenario::parse(base.file, base.text, &base.overrides(&c.settings))?;
    let setup = crate::setup::prepare(base.file, scenario)?;
    let run = crate::simulate::run(&setup)?;
    // A replica of a tensor-parallel model takes its degree in GPUs (the catalog's 70B: 4).
    let gpus_per_replica = setup.model.tp.max(1);
    let figures = Figures::of(&run.summary, &run.stats, gpus_per_replica);
    // The searches' runs: at least `sustained_requests` of the workload (a trace's rows as
    // they are).
    let w = &setup.scenario.workload;
    let sustained = (w.trace.is_none() && w.num_requests < spec.sustained_requests).then(|| {
        // Measured requests (warm-up ones come on top, and must be fewer).
        format!(
            "workload.num_requests={}",
            spec.sustained_requests.max(w.warmup_requests + 1)
        )
    });
    let attainment_at = |extra: Vec<String>| -> Result<bool, SimError> {
        let mut settings = c.settings.clone();
        settings.extend(sustained.clone());
        settings.extend(extra);
        holds(base, &settings, spec.attainment)
    };
    let capacity = if spec.capacity {
        let start = rate_of(base.file, &setup.scenario)?;
        Some(search_capacity(start, |r| {
            attainment_at(vec![format!("arrival.rate={r:?}")])
        })?)
    } else {
        None
    };
    let replicas_for_target = match spec.target_rate {
        Some(rate) => Some(search_replicas(MAX_REPLICAS, |n| {
            attainment_at(vec![
                format!("arrival.rate={rate:?}"),
                format!("cluster.replicas={n}"),
            ])
        })?),
        None => None,
    };
    Ok(Evaluated {
        figures,
        gpus_per_replica,
        capacity,
        replicas_for_target,
        warnings: setup.warnings,
    })
}

/// Whether the scenario with `settings` holds its objectives for `attainment` of its
/// requests. The run stops early once too many requests have missed them for the answer
/// to change (a search's runs report nothing else).
fn holds(base: &Base, settings: &[String], attainment: f64) -> Result<bool, SimError> {
    let scenario = Scenario::parse(base.file, base.text, &base.overrides(settings))?;
    let setup = crate::setup::prepare(base.file, scenario)?;
    let mut watch = SloWatch {
        slo: setup.scenario.slo.unwrap_or_default(),
        requests: setup.scenario.workload.num_requests,
        attainment,
        missed: 0,
    };
    let tokenizer = crate::simulate::approx_tokenizer(&setup);
    match crate::simulate::run_with(&setup, tokenizer, &mut watch) {
        Ok(r) => Ok(r
            .summary
            .goodput
            .is_some_and(|g| g.slo_attainment >= attainment)),
        Err(SimError::Output(_)) if watch.lost() => Ok(false),
        Err(e) => Err(e),
    }
}

/// Counts the requests of a run that miss the objectives, and stops the run once the
/// attainment can no longer reach its target.
struct SloWatch {
    slo: Slo,
    requests: usize,
    attainment: f64,
    missed: usize,
}

impl SloWatch {
    /// The attainment is below target even if every request still to come meets the
    /// objectives (the recorder's own formula: met over all measured requests).
    fn lost(&self) -> bool {
        let n = self.requests;
        (n.saturating_sub(self.missed) as f64 / n.max(1) as f64) < self.attainment
    }
}

impl crate::simulate::RunSink for SloWatch {
    fn request(&mut self, r: infer_core::metrics::RequestRecord) {
        if !self.slo.met_by(&r) {
            self.missed += 1;
        }
    }

    fn sample(&mut self, _: infer_core::metrics::TimePoint) {}

    fn stop_reason(&self) -> Option<String> {
        self.lost()
            .then(|| "stopped early: the objectives' attainment is lost".to_string())
    }
}

/// The rate a capacity search starts from: the scenario's own, for the arrival kinds that
/// have one.
fn rate_of(file: &str, sc: &Scenario) -> Result<f64, SimError> {
    match (sc.arrival.kind, sc.arrival.rate) {
        (ArrivalKind::Poisson | ArrivalKind::Gamma | ArrivalKind::Uniform, Some(r)) => Ok(r),
        (kind, _) => Err(SimError::Key {
            file: file.to_string(),
            key: "arrival.kind".into(),
            reason: format!(
                "a capacity search varies the arrival rate: it needs kind = \"poisson\", \
                 \"gamma\" or \"uniform\" with a rate, not \"{}\"",
                kind.name()
            ),
        }),
    }
}

/// Check every varied value and every named configuration on its own before the plan runs,
/// so that a bad key or value is named once rather than failing thousands of points.
pub fn check_space(base: &Base, spec: &PlanSpec) -> Result<(), SimError> {
    let check = |what: String, settings: &[String]| -> Result<(), SimError> {
        let mut overrides = base.overrides.to_vec();
        overrides.extend_from_slice(settings);
        Scenario::parse(base.file, base.text, &overrides)
            .map_err(SimError::from)
            .and_then(|sc| crate::setup::prepare(base.file, sc))
            .map(|_| ())
            .map_err(|e| SimError::Invalid(format!("{what}: {e}")))
    };
    for c in &spec.configs {
        check(format!("configuration {}", c.name), &c.settings)?;
    }
    sweep::check_values(base.file, base.text, base.overrides, &spec.axes)?;
    let sc = Scenario::parse(base.file, base.text, base.overrides)?;
    if spec.capacity {
        rate_of(base.file, &sc)?;
    }
    let has_cluster = sc.cluster.is_some()
        || spec
            .configs
            .iter()
            .any(|c| c.settings.iter().any(|s| s.starts_with("cluster.")));
    if spec.target_rate.is_some() && !has_cluster {
        return Err(SimError::Invalid(
            "--target-rate varies the number of replicas: the scenario needs a [cluster] \
             table (its router spreads the load), e.g. --set cluster.replicas=1 \
             --set cluster.router=round-robin"
                .into(),
        ));
    }
    Ok(())
}

/// A plan's outcomes, ranked.
pub struct Plan {
    pub spec: PlanSpec,
    pub outcomes: Vec<Outcome>,
    /// Index of the best configuration, if any holds the SLO.
    pub best: Option<usize>,
    /// Whether each outcome is on the Pareto front.
    pub pareto: Vec<bool>,
}

impl Plan {
    pub fn new(spec: PlanSpec, outcomes: Vec<Outcome>) -> Plan {
        let best = best(&spec, &outcomes);
        let pareto = pareto_front(&spec, &outcomes);
        Plan {
            spec,
            outcomes,
            best,
            pareto,
        }
    }

    fn meeting(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|o| {
                o.result
                    .as_ref()
                    .is_ok_and(|e| e.meets(self.spec.attainment))
            })
            .count()
    }
}

/// The figure a configuration is ranked by (higher is better), `None` when it cannot be
/// chosen (a failed simulation, the SLO missed, the target rate not held).
fn merit(spec: &PlanSpec, e: &Evaluated) -> Option<f64> {
    if e.replicas_for_target.is_some() {
        return e.gpus_for_target().map(|n| -(n as f64));
    }
    if let Some(c) = e.capacity_per_gpu() {
        return (c > 0.0).then_some(c);
    }
    e.meets(spec.attainment).then(|| e.goodput_per_gpu())
}

/// How a configuration ranks, `None` when it cannot be chosen: by merit (higher first), ties
/// by the P99 latencies summed (lower first), then by plan order.
fn standing(spec: &PlanSpec, o: &Outcome) -> Option<(f64, f64)> {
    let e = o.result.as_ref().ok()?;
    let m = merit(spec, e)?;
    Some((m, e.figures.latencies(&spec.slo).iter().sum()))
}

/// Configurations `a` and `b` (plan indices) in rank order ([`standing`]).
fn rank_order(spec: &PlanSpec, outcomes: &[Outcome], a: usize, b: usize) -> std::cmp::Ordering {
    use std::cmp::Ordering::{Greater, Less};
    match (standing(spec, &outcomes[a]), standing(spec, &outcomes[b])) {
        (Some((ma, la)), Some((mb, lb))) => {
            mb.total_cmp(&ma).then(la.total_cmp(&lb)).then(a.cmp(&b))
        }
        (Some(_), None) => Less,
        (None, Some(_)) => Greater,
        (None, None) => a.cmp(&b),
    }
}

/// The best configuration: the first in rank order, if it can be chosen.
fn best(spec: &PlanSpec, outcomes: &[Outcome]) -> Option<usize> {
    (0..outcomes.len())
        .filter(|&i| standing(spec, &outcomes[i]).is_some())
        .min_by(|&a, &b| rank_order(spec, outcomes, a, b))
}

/// Whether each outcome is on the Pareto front of goodput per GPU against the P99 of each
/// metric the SLO names, all at the scenario's rate (a capacity is each configuration's own
/// rate, so latencies there compare nothing).
fn pareto_front(spec: &PlanSpec, outcomes: &[Outcome]) -> Vec<bool> {
    let objective = |e: &Evaluated| -> Vec<f64> {
        let mut v = vec![-e.goodput_per_gpu()];
        v.extend(e.figures.latencies(&spec.slo));
        v
    };
    let points: Vec<Option<Vec<f64>>> = outcomes
        .iter()
        .map(|o| o.result.as_ref().ok().map(objective))
        .collect();
    let dominates = |a: &[f64], b: &[f64]| {
        a.iter().zip(b).all(|(x, y)| x <= y) && a.iter().zip(b).any(|(x, y)| x < y)
    };
    points
        .iter()
        .map(|p| {
            p.as_ref()
                .is_some_and(|p| !points.iter().flatten().any(|q| dominates(q, p)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> PlanSpec {
        PlanSpec {
            slo: Slo {
                ttft_ms: Some(500.0),
                tpot_ms: Some(50.0),
                e2el_ms: None,
            },
            attainment: 0.9,
            axes: Vec::new(),
            configs: Vec::new(),
            capacity: false,
            target_rate: None,
            sustained_requests: 1000,
        }
    }

    /// Stopping a search's run once its attainment is lost gives the answer the whole run
    /// gives, at every rate from well below capacity to far above it.
    #[test]
    fn early_stopping_never_changes_whether_a_rate_holds() {
        let file = format!(
            "{}/../scenarios/chunked_prefill.toml",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(&file).unwrap();
        let overrides = vec![
            "slo.ttft_ms=2000.0".to_string(),
            "slo.tpot_ms=60.0".to_string(),
        ];
        let base = Base {
            file: &file,
            text: &text,
            overrides: &overrides,
        };
        let mut both = [0, 0];
        for rate in [0.5, 1.0, 1.3, 1.4, 1.6, 3.0, 6.0] {
            for attainment in [0.5, 0.9, 0.99] {
                let settings = vec![format!("arrival.rate={rate:?}")];
                let (summary, _) =
                    sweep::simulate(&file, &text, &base.overrides(&settings)).unwrap();
                let whole = summary.goodput.unwrap().slo_attainment >= attainment;
                assert_eq!(
                    holds(&base, &settings, attainment).unwrap(),
                    whole,
                    "rate {rate}, attainment {attainment}"
                );
                both[usize::from(whole)] += 1;
            }
        }
        assert!(both[0] > 0 && both[1] > 0, "both answers occur: {both:?}");
    }

    #[test]
    fn named_configurations_cross_the_grid() {
        let mut s = spec();
        s.configs = vec![
            parse_config("P6:server.chunked_prefill=false,server.prefix_caching=false").unwrap(),
            parse_config("P8:server.chunked_prefill=true").unwrap(),
        ];
        s.axes = vec![sweep::parse_axis("server.max_batch_size=8,16").unwrap()];
        let c = s.configurations().unwrap();
        assert_eq!(c.len(), 4);
        assert_eq!(c[1].name, "P6 max_batch_size=16");
        assert_eq!(
            c[1].settings,
            vec![
                "server.chunked_prefill=false",
                "server.prefix_caching=false",
                "server.max_batch_size=16"
            ]
        );
        assert_eq!(c[2].config, "P8");
        // Without named configurations the scenario itself is crossed with the grid.
        s.configs.clear();
        assert_eq!(s.configurations().unwrap().len(), 2);
        s.axes.clear();
        assert_eq!(s.configurations().unwrap()[0].name, "as given");
    }

    #[test]
    fn bad_plans_are_named() {
        for (bad, says) in [
            ("P6", "NAME:key=value"),
            (":server.x=1", "no name"),
            ("P6:server.x", "not key=value"),
        ] {
            let e = parse_config(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let mut s = spec();
        s.attainment = 1.5;
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--attainment"));
        s.attainment = 0.0;
        assert!(s.validate().is_err());
        s.attainment = 1.0;
        s.validate().unwrap();
        s.slo = Slo::default();
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("latency objectives"));
        let mut s = spec();
        s.axes = vec![
            sweep::parse_axis("server.max_batch_size=8").unwrap(),
            sweep::parse_axis("server.max_batch_size=16").unwrap(),
        ];
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("varied twice"));
        let mut s = spec();
        s.axes = (0..6)
            .map(|k| sweep::parse_axis(&format!("k{k}=1,2,3,4,5,6,7,8,9,10")).unwrap())
            .collect();
        assert!(s
            .configurations()
            .unwrap_err()
            .to_string()
            .contains("1000000 configurations"));
        // A product past what a usize counts is refused alike, not wrapped to 0.
        s.axes = (0..16)
            .map(|k| sweep::parse_axis(&format!("k{k}={}", ["1"; 16].join(","))).unwrap())
            .collect();
        let e = s.configurations().unwrap_err().to_string();
        assert!(
            e.starts_with("the plan has 1.8e19 configurations, more than 100000: 1 named × k0"),
            "{e}"
        );
    }

    #[test]
    fn plan_tables_parse_and_refuse_unknown_keys() {
        let t: toml::Table = toml::from_str(
            r#"
            attainment = 0.99
            vary = ["server.max_batch_size=8,16"]
            capacity = true
            [configs]
            P6 = ["server.chunked_prefill=false"]
            "#,
        )
        .unwrap();
        let p = PlanTable::parse("f.toml", &t).unwrap();
        assert_eq!(p.attainment, Some(0.99));
        assert_eq!(p.axes[0].values, vec!["8", "16"]);
        assert_eq!(p.configs[0].name, "P6");
        assert_eq!(p.capacity, Some(true));
        for (text, key) in [
            ("atainment = 0.9", "plan.atainment"),
            ("attainment = \"high\"", "plan.attainment"),
            ("vary = \"server.x=1\"", "plan.vary"),
            ("vary = [\"server.x=\"]", "plan.vary"),
            ("[configs]\nP6 = [\"server.x\"]", "plan.configs.P6"),
        ] {
            let t: toml::Table = toml::from_str(text).unwrap();
            let e = PlanTable::parse("f.toml", &t).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("f.toml"), "{text}: {e}");
        }
    }

    fn outcome(name: &str, gpus: usize, goodput: f64, attainment: f64, ttft: f64) -> Outcome {
        Outcome {
            configuration: Configuration {
                name: name.into(),
                config: String::new(),
                assignment: Vec::new(),
                settings: Vec::new(),
            },
            result: Ok(Evaluated {
                figures: Figures {
                    gpus,
                    goodput,
                    attainment,
                    output_throughput: 0.0,
                    ttft_p50_ms: ttft / 2.0,
                    ttft_p99_ms: ttft,
                    tpot_p50_ms: 10.0,
                    tpot_p99_ms: 20.0,
                    e2el_p99_ms: 0.0,
                },
                gpus_per_replica: 1,
                capacity: None,
                replicas_for_target: None,
                warnings: Vec::new(),
            }),
        }
    }

    #[test]
    fn best_holds_the_slo_and_the_front_is_undominated() {
        let plan = Plan::new(
            spec(),
            vec![
                outcome("fast but misses", 1, 5.0, 0.5, 3000.0),
                outcome("good", 1, 4.0, 0.95, 300.0),
                outcome("good, two GPUs", 2, 6.0, 0.99, 200.0),
                outcome("dominated", 1, 3.0, 0.95, 400.0),
            ],
        );
        assert_eq!(plan.best, Some(1));
        assert_eq!(plan.pareto, vec![true, true, true, false]);
        let csv = csv(&plan);
        assert_eq!(csv.lines().count(), 5);
        assert!(csv.lines().nth(2).unwrap().ends_with(",1,true,,"));
        // Every row, a failed configuration's too, has its cells under their header: the
        // rank in `rank`, the reason in `error`, the figures blank.
        let outcomes = vec![
            outcome("fast but misses", 1, 5.0, 0.5, 3000.0),
            outcome("good", 1, 4.0, 0.95, 300.0),
            outcome("two GPUs", 2, 6.0, 0.99, 200.0),
            outcome("dominated", 1, 3.0, 0.95, 400.0),
            Outcome {
                result: Err(SimError::Invalid("it failed".into())),
                ..outcome("failed", 1, 0.0, 0.0, 0.0)
            },
        ];
        let with_failed = super::render::csv(&Plan::new(spec(), outcomes));
        let rows: Vec<Vec<&str>> = with_failed
            .lines()
            .map(|l| l.split(',').collect())
            .collect();
        let col = |name: &str| rows[0].iter().position(|h| *h == name).unwrap();
        assert!(
            rows.iter().all(|r| r.len() == rows[0].len()),
            "{with_failed}"
        );
        let failed = &rows[5];
        assert_eq!(
            (
                failed[col("rank")],
                failed[col("best")],
                failed[col("error")]
            ),
            ("5", "", "it failed")
        );
        assert_eq!(failed[col("gpus")], "");
        let ranks: Vec<&str> = rows[1..].iter().map(|r| r[col("rank")]).collect();
        assert_eq!(ranks, vec!["4", "1", "2", "3", "5"]);
        let text = console(&plan, 10);
        assert!(text
            .contains("4 configurations, 3 meet TTFT ≤ 500 ms, TPOT ≤ 50 ms for 90% of requests"));
        assert!(text.contains("best: good ("), "{text}");
        // A tie on merit goes to the lower latencies, in the answer and the ranking alike.
        let tied = Plan::new(
            spec(),
            vec![
                outcome("slower", 1, 4.0, 0.95, 400.0),
                outcome("faster", 1, 4.0, 0.95, 300.0),
            ],
        );
        assert_eq!(tied.best, Some(1));
        assert_eq!(render::ranked(&tied), vec![1, 0]);
        let none = Plan::new(spec(), vec![outcome("misses", 1, 5.0, 0.5, 100.0)]);
        assert_eq!(none.best, None);
        assert!(answer(&none).contains("no configuration holds the SLO"));
    }
}
