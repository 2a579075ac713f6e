//! How far to trust a prediction: warnings where it is fragile, printed with the run and
//! kept in its `run.json`.
//!
//! * near saturation: the offered load is close to (or past) the predicted capacity, where a
//!   small change of load or of a cost moves latency by a large factor;
//! * extrapolation: the scenario's steps are larger than anything the profile measured, or
//!   than the calibration's runs reached;
//! * uncalibrated: the analytic model prices a hardware and model pair no calibration
//!   covers (the catalog's roofline with generic efficiencies);
//! * a knife-edge: moving one calibrated coefficient within its spread moves a headline
//!   figure by more than a factor (detected by re-running the scenario so perturbed).

use infer_core::metrics::Summary;
use infer_core::workload::{ArrivalKind, ArrivalSpec, Scenario};

use crate::calibration::{Calibration, Mechanisms};
use crate::cost::ProfileCoverage;
use crate::error::SimError;
use crate::setup::Setup;

/// The offered load, as a fraction of the capacity, from which a run is near saturation.
pub const NEAR_SATURATION: f64 = 0.8;

/// The predicted capacity: requests per second the server completes of the scenario's
/// requests when it is kept full (a closed loop of twice as many clients as all replicas'
/// batches hold, or their KV pools where those hold fewer), so that the arrival process
/// no longer limits it. The workload's first 1,000 requests, or ten per client if that is
/// more, are run (a trace's rows as they are): enough that the end of the run, where the
/// last requests drain with the batch no longer full, weighs little, and few enough that a
/// run of millions pays little for it.
pub fn capacity(setup: &Setup) -> Result<Capacity, SimError> {
    let mut scenario = setup.scenario.clone();
    let replicas = scenario.cluster.as_ref().map_or(1, |c| c.replicas);
    // As many sequences as can run at once: the batch, or fewer where the KV pool holds
    // fewer (a paged sequence holds a block of its own at least, a slot one sequence).
    // Transformers' 1,024-sequence batch over a 64-block pool would otherwise keep 2,048
    // clients in flight, and a step cap reading a dozen of them per step (its
    // `max_step_read_tokens`) made that run take minutes.
    let cfg = scenario.server.scheduler_config();
    let resident = match cfg.kv_cache_backend {
        infer_core::KvBackend::Paged => cfg.num_gpu_blocks,
        infer_core::KvBackend::Contiguous => cfg.kv_capacity_tokens() / cfg.max_model_len,
    };
    let clients = 2 * cfg.max_batch_size.min(resident.max(1)) * replicas;
    scenario.arrival = ArrivalSpec {
        kind: ArrivalKind::Concurrency,
        rate: None,
        burstiness: None,
        max_concurrency: Some(clients),
        stages: Vec::new(),
    };
    let w = &mut scenario.workload;
    if w.trace.is_none() {
        // Measured requests; warm-up ones come on top.
        w.num_requests = (10 * clients).max(1000);
    }
    scenario.slo = None;
    let full = crate::setup::prepare(&setup.file, scenario)?;
    let run = crate::simulate::run(&full)?;
    Ok(Capacity {
        requests_per_s: run.summary.request_throughput,
        spilled_bytes: run.stats.spilled_bytes,
    })
}

/// What [`capacity`]'s run of the server kept full gives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    pub requests_per_s: f64,
    /// The activations its largest step spilled to host memory, which every later step of
    /// that run paid for: a lighter load whose batches stay smaller never spills, and can
    /// run well above this capacity until a burst fills the batch.
    pub spilled_bytes: f64,
}

impl Capacity {
    /// A capacity reached without spilling.
    pub fn of(requests_per_s: f64) -> Self {
        Capacity {
            requests_per_s,
            spilled_bytes: 0.0,
        }
    }
}

/// Add the warnings that take more simulations (saturation, knife-edge) to `setup`'s: for
/// one prediction (`sim run`, `engine verify`), not every point of a sweep or plan.
/// `text` and `overrides` are the scenario's, as `setup` was made from them.
pub fn check_fragility(
    setup: &mut Setup,
    text: &str,
    overrides: &[String],
) -> Result<(), SimError> {
    let saturation = saturation(setup)?;
    let knife_edge = knife_edge(setup, text, overrides)?;
    setup
        .warnings
        .extend(saturation.into_iter().chain(knife_edge));
    Ok(())
}

/// The saturation warning for an open-loop scenario with a rate (Poisson, gamma, uniform):
/// `None` below [`NEAR_SATURATION`] of the capacity, or for other arrivals.
pub fn saturation(setup: &Setup) -> Result<Option<String>, SimError> {
    let a = &setup.scenario.arrival;
    let rate = match (a.kind, a.rate) {
        (ArrivalKind::Poisson | ArrivalKind::Gamma | ArrivalKind::Uniform, Some(r)) => r,
        _ => return Ok(None),
    };
    // The capacity's own run keeps twice the batch's clients in flight: it can pass the
    // run's bounds where the prediction does not (transformers' description, 1,024
    // sequences a step, each step's attention growing with their square). A warning's
    // simulation does not fail the prediction: it says what it could not tell.
    match capacity(setup) {
        Ok(capacity) => Ok(saturation_warning(rate, &capacity)),
        Err(e) => Ok(Some(format!(
            "warning: capacity not estimated: this workload with the server kept full \
             (twice as many clients as it runs at once) did not run within the bounds:\n  {e}"
        ))),
    }
}

/// The warning for an offered `rate` (requests/s) against a predicted `capacity`.
pub fn saturation_warning(rate: f64, capacity: &Capacity) -> Option<String> {
    let spill = if capacity.spilled_bytes > 0.0 {
        format!(
            "\n  kept full, its largest steps spill {:.2} GiB of activations to host memory and \
             every later step pays for it: a load whose batches never grow that large runs \
             faster, until a burst fills the batch",
            capacity.spilled_bytes / (1u64 << 30) as f64
        )
    } else {
        String::new()
    };
    let capacity = capacity.requests_per_s;
    let load = rate / capacity;
    if load.is_nan() || load < NEAR_SATURATION {
        return None;
    }
    let (what, consequence) = if load >= 1.0 {
        (
            "over capacity",
            "once a queue builds it does not drain, so latencies grow with num_requests",
        )
    } else {
        (
            "near saturation",
            "here small changes of load or of a step's cost move latencies by large factors",
        )
    };
    Some(format!(
        "warning: {what}: the offered {rate} requests/s are {:.0}% of the predicted capacity, \
         {capacity:.3} requests/s\n  (this workload with the server kept full): {consequence}\
         {spill}",
        load * 100.0
    ))
}

/// What a cost model was measured on: a profile's steps, or a calibration's runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measured {
    Profile,
    Calibration,
}

/// Where a scenario outgrows what its cost model was measured on: one warning per
/// dimension.
pub fn extrapolation(
    coverage: &ProfileCoverage,
    scenario: &Scenario,
    measured: Measured,
) -> Vec<String> {
    let r = reach(scenario);
    [
        ("a step's new tokens", r.new_tokens, coverage.new_tokens),
        ("the decode batch", r.decode_seqs, coverage.decode_seqs),
        (
            "a sequence's context",
            r.sequence_context,
            coverage.sequence_context,
        ),
    ]
    .into_iter()
    .filter(|&(_, reach, measured)| reach > measured)
    .map(|(what, reach, most)| match measured {
        Measured::Profile => format!(
            "warning: extrapolation: {what} can reach {reach}, the profile measured at most \
             {most}:\n  the cost model extrapolates there (profile a larger grid, or read \
             the figures as rough)"
        ),
        Measured::Calibration => format!(
            "warning: extrapolation: {what} can reach {reach}, the calibration's runs reached \
             at most {most}:\n  its coefficients and errors extrapolate there (calibrate on \
             runs that reach it, or read the figures and intervals as rough)"
        ),
    })
    .collect()
}

/// How far a scenario can reach in each dimension a cost model is measured in: its largest
/// step's new tokens, its decode batch and a sequence's context.
pub fn reach(scenario: &Scenario) -> ProfileCoverage {
    let cfg = scenario.server.scheduler_config();
    let w = &scenario.workload;
    let (_, longest_prompt) = scenario.prompt_range();
    let step = crate::memory::largest_step(&cfg, scenario.prompt_range());
    let mut batch = cfg.max_batch_size.min(w.num_requests.max(1));
    if let Some(c) = scenario.arrival.max_concurrency {
        batch = batch.min(c);
    }
    let context = (longest_prompt + w.output_tokens.max()).min(cfg.max_model_len);
    ProfileCoverage {
        new_tokens: step.prefill_tokens + step.decode_seqs,
        decode_seqs: batch,
        sequence_context: context,
    }
}

/// How far each coefficient is moved, at most, either way, to look for a knife-edge: a
/// cliff within a small move. The calibration's bootstrap refits narrow it where they pin
/// the coefficient down closer; a wider spread than this is the coefficient's uncertainty,
/// which the intervals carry.
pub const DEFAULT_SPREAD: f64 = 0.10;
/// A headline figure moving by more than this factor makes a knife-edge.
pub const KNIFE_EDGE_FACTOR: f64 = 1.5;
/// The most requests a knife-edge check simulates (the workload's first ones).
const KNIFE_EDGE_REQUESTS: usize = 1000;

/// A calibrated coefficient's value.
type Coefficient = fn(&Calibration) -> f64;

/// The calibrated coefficients a knife-edge check moves, by their `[sim]` keys.
const COEFFICIENTS: [(&str, Coefficient); 6] = [
    ("compute_efficiency", |c| c.compute_efficiency),
    ("attention_efficiency", |c| c.attention_efficiency),
    ("decode_attention_efficiency", |c| {
        c.decode_attention_efficiency
    }),
    ("bandwidth_efficiency", |c| c.bandwidth_efficiency),
    ("step_overhead_s", |c| c.step_overhead_s),
    ("per_seq_overhead_s", |c| c.per_seq_overhead_s),
];

/// The headline figures a knife-edge is looked for in (`engine verify`'s: throughput and
/// the medians of TTFT, ITL and end-to-end latency).
fn headline(s: &Summary) -> [(&'static str, f64, &'static str); 4] {
    [
        ("output throughput", s.output_throughput, "tok/s"),
        ("TTFT P50", s.ttft.median * 1e3, "ms"),
        ("ITL P50", s.itl.median * 1e3, "ms"),
        ("E2EL P50", s.e2el.median * 1e3, "ms"),
    ]
}

/// Requests of each knife-edge run: the first [`KNIFE_EDGE_REQUESTS`], but at least one
/// past the warm-up, which a scenario may make as long.
fn knife_edge_requests(num_requests: usize, warmup_requests: usize) -> usize {
    num_requests.min(KNIFE_EDGE_REQUESTS.max(warmup_requests + 1))
}

/// The knife-edge warning of an analytically priced scenario: each calibrated coefficient
/// is moved in turn by ±[`DEFAULT_SPREAD`], narrowed to the range of its calibration's
/// bootstrap refits (`[[draws]]`) where they move it, within the bounds a fit may give it (the
/// scenario's first
/// [`KNIFE_EDGE_REQUESTS`] requests simulated each time), and the move of the most
/// sensitive one is named if it moves a headline figure by more than [`KNIFE_EDGE_FACTOR`].
pub fn knife_edge(
    setup: &Setup,
    text: &str,
    overrides: &[String],
) -> Result<Option<String>, SimError> {
    let Some(cal) = &setup.calibration else {
        return Ok(None);
    };
    let w = &setup.scenario.workload;
    let capped = if w.trace.is_none() {
        Some(format!(
            "workload.num_requests={}",
            knife_edge_requests(w.num_requests, w.warmup_requests)
        ))
    } else {
        None
    };
    let run = |extra: Option<String>| -> Result<Summary, SimError> {
        let mut o = overrides.to_vec();
        o.extend(capped.clone());
        o.extend(extra);
        crate::sweep::simulate(&setup.file, text, &o).map(|(s, _)| s)
    };
    let base = headline(&run(None)?);
    let cfg = setup.scenario.server.scheduler_config();
    let drawn: Vec<Calibration> = cal
        .draws
        .iter()
        .map(|d| cal.with(&Mechanisms::of(cal), d).for_server(&cfg))
        .collect();
    let mut worst: Option<Move> = None;
    for (key, value) in COEFFICIENTS {
        let v = value(cal);
        // ±DEFAULT_SPREAD, narrowed to the bootstrap refits' range where they move it (a
        // coefficient the runs pin down closer gets a smaller move; one they leave wide
        // open is uncertain, which the intervals carry, not a cliff); within what a fit
        // may give (an efficiency at its ceiling only moves down).
        let (min, max) = crate::fit::Param::parse(key)?.bounds();
        let (mut lo, mut hi) = (
            (v * (1.0 - DEFAULT_SPREAD)).max(min.min(v)),
            (v * (1.0 + DEFAULT_SPREAD)).min(max.max(v)),
        );
        let refits = drawn.iter().map(value);
        let (d_lo, d_hi) = refits.fold((v, v), |(a, b), x| (a.min(x), b.max(x)));
        let measured = d_hi > d_lo;
        if measured {
            (lo, hi) = (lo.max(d_lo), hi.min(d_hi));
        }
        let low = headline(&run(Some(format!("sim.{key}={lo:?}")))?);
        let high = headline(&run(Some(format!("sim.{key}={hi:?}")))?);
        for ((b, l), h) in base.iter().zip(&low).zip(&high) {
            let (a, z) = (l.1.min(h.1), l.1.max(h.1));
            // Against the figure at the calibration's own value, too.
            let factor = (z / a).max(z / b.1).max(b.1 / a);
            if factor.is_finite() && worst.as_ref().is_none_or(|w| factor > w.factor) {
                worst = Some(Move {
                    factor,
                    key,
                    range: (lo, hi),
                    refits: if measured { drawn.len() } else { 0 },
                    figure: b.0,
                    values: (l.1, h.1),
                    unit: b.2,
                });
            }
        }
    }
    Ok(worst.filter(|w| w.factor > KNIFE_EDGE_FACTOR).map(|w| {
        let (range, spread) = match w.refits {
            0 => (
                format!("up to ±{:.0}%", DEFAULT_SPREAD * 100.0),
                " (the spread is a default: the calibration records none for it)",
            ),
            n => (
                format!(
                    "within its {n} bootstrap refits, at most ±{:.0}%",
                    DEFAULT_SPREAD * 100.0
                ),
                "",
            ),
        };
        format!(
            "warning: knife-edge: {} from {:.4} to {:.4} ({range}) moves {} from {:.1} to \
             {:.1} {} (×{:.2}):\n  the prediction rests on a coefficient the calibration does \
             not pin down that finely{spread}",
            w.key, w.range.0, w.range.1, w.figure, w.values.0, w.values.1, w.unit, w.factor
        )
    }))
}

/// The largest move of a headline figure a knife-edge check found.
struct Move {
    /// Largest over smallest of the figure at the two ends and at the calibration's value.
    factor: f64,
    /// The coefficient moved, and its two ends.
    key: &'static str,
    range: (f64, f64),
    /// How many bootstrap refits gave the range (0: the default spread).
    refits: usize,
    /// The figure, its values at the two ends, and its unit.
    figure: &'static str,
    values: (f64, f64),
    unit: &'static str,
}

/// The warning for the analytic model on a pair no calibration covers.
pub fn uncalibrated(hardware: &str, model: &str) -> String {
    format!(
        "warning: uncalibrated: no calibration covers {model} on {hardware}: steps are priced by \
         the catalog's roofline\n  with generic efficiencies, and figures can be off by a \
         factor (fit one with `sim calibrate`, or price steps with an `engine profile`)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The knife-edge runs keep a request past the warm-up: a scenario warming up with
    /// 1,000 requests was refused by its own check, naming warmup_requests.
    #[test]
    fn knife_edge_runs_measure_past_a_long_warm_up() {
        assert_eq!(knife_edge_requests(5000, 10), KNIFE_EDGE_REQUESTS);
        assert_eq!(knife_edge_requests(300, 10), 300);
        assert_eq!(knife_edge_requests(2000, 1000), 1001);
        assert_eq!(knife_edge_requests(1500, 1499), 1500);
    }

    #[test]
    fn saturation_is_named_from_80_percent() {
        let ten = Capacity::of(10.0);
        assert_eq!(saturation_warning(4.0, &ten), None);
        assert_eq!(saturation_warning(7.9, &ten), None);
        let near = saturation_warning(9.5, &ten).unwrap();
        assert!(
            near.contains("near saturation") && near.contains("95%"),
            "{near}"
        );
        let over = saturation_warning(12.0, &ten).unwrap();
        assert!(
            over.contains("over capacity") && over.contains("120%") && !over.contains("spill"),
            "{over}"
        );
        // No capacity at all (nothing completes): over it.
        assert!(saturation_warning(1.0, &Capacity::of(0.0))
            .unwrap()
            .contains("over capacity"));
        // A capacity whose run spilled says so: a lighter load may not.
        let spilling = Capacity {
            requests_per_s: 10.0,
            spilled_bytes: 2.5 * (1u64 << 30) as f64,
        };
        let over = saturation_warning(12.0, &spilling).unwrap();
        assert!(over.contains("spill 2.50 GiB of activations"), "{over}");
    }
}
