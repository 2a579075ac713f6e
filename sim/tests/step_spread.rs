//! The spread of served steps a profile carries (`step_spread`, measured by `engine
//! profile`): what it does to a single stream's latencies, that it replays exactly, and that
//! a damaged one is refused by name; what a cold first step after idling (`after_idle`)
//! does to a request that arrives at an idle engine; and what the decode steps just after a
//! prefill (`after_prefill`) add.

mod common;

use infer_sim::cost::{AfterIdle, AfterPrefill, Profile, StepSpread};

/// The shipped CPU profile with `spread` in place of its own, written to a file of its own.
fn profile_with(name: &str, spread: Option<StepSpread>) -> String {
    edited_profile(name, |p| p.step_spread = spread)
}

/// The shipped CPU profile as `edit` leaves it, written to a file of its own.
fn edited_profile(name: &str, edit: impl FnOnce(&mut Profile)) -> String {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let text = std::fs::read_to_string(format!("{root}/profiles/cpu-2core-builtin-tiny.json"))
        .expect("the shipped CPU profile");
    let mut profile: Profile = serde_json::from_str(&text).expect("a profile");
    edit(&mut profile);
    let dir = std::env::temp_dir().join(format!("infer-step-spread-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string(&profile).unwrap()).unwrap();
    path.display().to_string()
}

/// Scenario `name` simulated on `profile`.
fn run_on(name: &str, profile: &str) -> infer_core::metrics::Summary {
    let o = profiled(profile);
    let o: Vec<&str> = o.iter().map(String::as_str).collect();
    common::run(name, &o).summary
}

fn profiled(profile: &str) -> Vec<String> {
    vec![
        "sim.cost_model=\"profiled\"".to_string(),
        format!("sim.profile={profile:?}"),
    ]
}

/// Served steps at 0.5x to 1.5x their typical time, evenly: one band.
fn uniform_spread() -> StepSpread {
    let steps: Vec<(f64, f64)> = (0..=1000)
        .map(|i| (1e-3, 1e-3 * (0.5 + i as f64 / 1000.0)))
        .collect();
    StepSpread::measure(&steps).expect("enough steps")
}

#[test]
fn a_spread_scales_the_itl_distribution_around_the_typical_step() {
    let run = |profile: &str| {
        let s = run_on("baseline", profile);
        (s.itl.median, s.itl.p99, s.itl.mean)
    };
    let (p50, p99, _) = run(&profile_with("steady", None));
    let (s50, s99, mean) = run(&profile_with("uniform", Some(uniform_spread())));
    // One request at a time: without a spread every gap is about one typical step.
    assert!(p99 / p50 < 1.2, "steady ITL P50 {p50}, P99 {p99}");
    // With it, the gaps are the typical step times a factor uniform on [0.5, 1.5] (mean 1):
    // the median stays, the 99th percentile is ~1.49x, the mean stays. The baseline's
    // ~2,500 gaps pin each within a few percent.
    assert!((s50 / p50 - 1.0).abs() < 0.05, "ITL P50 {p50} -> {s50}");
    assert!(
        (s99 / p50 - 1.49).abs() < 0.1,
        "ITL P99 {s99} over P50 {p50}"
    );
    assert!(
        (mean / p50 - 1.0).abs() < 0.05,
        "ITL mean {mean} over P50 {p50}"
    );
}

/// A skewed spread (one step in fifty at four times the median) keeps the mean step: the
/// fitted time is the mean, so a lone stream's throughput and mean ITL stay, while its
/// median gap shortens and its tail lengthens.
#[test]
fn a_skewed_spread_keeps_the_mean_step_and_moves_the_tail() {
    let steps: Vec<(f64, f64)> = (0..1000)
        .map(|i| (1e-3, 1e-3 * if i % 50 == 0 { 4.0 } else { 1.0 }))
        .collect();
    let run = |profile: &str| run_on("baseline", profile);
    let steady = run(&profile_with("skew-steady", None));
    let skewed = run(&profile_with(
        "skewed",
        Some(StepSpread::measure(&steps).unwrap()),
    ));
    let close = |a: f64, b: f64, tol: f64| (a / b - 1.0).abs() < tol;
    assert!(
        close(skewed.output_throughput, steady.output_throughput, 0.02),
        "throughput {} -> {}",
        steady.output_throughput,
        skewed.output_throughput
    );
    assert!(
        close(skewed.itl.mean, steady.itl.mean, 0.02),
        "ITL mean {} -> {}",
        steady.itl.mean,
        skewed.itl.mean
    );
    // Factors: 1 / 1.06 for 98% of steps, 4 / 1.06 for 2%.
    assert!(
        close(skewed.itl.median, steady.itl.median / 1.06, 0.03),
        "ITL P50 {} -> {}",
        steady.itl.median,
        skewed.itl.median
    );
    assert!(
        skewed.itl.p99 > 3.0 * steady.itl.median,
        "ITL P99 {} over P50 {}",
        skewed.itl.p99,
        steady.itl.median
    );
}

#[test]
fn a_spread_run_replays_exactly_and_draws_the_same_workload() {
    let spread = profile_with("replay", Some(uniform_spread()));
    let steady = profile_with("replay-steady", None);
    let rows = |profile: &str| {
        let o = profiled(profile);
        let o: Vec<&str> = o.iter().map(String::as_str).collect();
        common::replay("chunked_prefill", &o)
    };
    let a = rows(&spread);
    assert_eq!(a, rows(&spread), "same scenario and seed, same bytes");
    let b = rows(&steady);
    assert_ne!(a.0, b.0, "the spread moved the figures");
    assert_eq!(
        a.2, b.2,
        "arrivals and prompts do not depend on the spread's draws"
    );
}

/// Why the baseline scenario on `profile` is refused (it must be).
fn refusal(profile: &str) -> String {
    infer_sim::load(&common::path("baseline"), &profiled(profile))
        .err()
        .expect("refused")
        .to_string()
}

#[test]
fn a_damaged_spread_is_refused_by_name() {
    let mut spread = uniform_spread();
    spread.bands[0].quantiles[10] = 50.0;
    let path = profile_with("damaged", Some(spread));
    let e = refusal(&path);
    assert!(
        e.contains("sim.profile") && e.contains("step_spread.bands[0].quantiles must not decrease"),
        "{e}"
    );
}

/// Requests arriving every 250 ms find the engine idle: each one's first step (its prompt)
/// takes the cold factor, so TTFT grows by about its prefill's share, while the decodes
/// that follow (straight after a step) keep their time.
#[test]
fn a_cold_first_step_lengthens_ttft_and_leaves_itl() {
    let run = |profile: &str| run_on("continuous_batching", profile);
    let warm = run(&edited_profile("warm", |_| {}));
    let cold = run(&edited_profile("cold", |p| {
        p.after_idle = Some(AfterIdle {
            idle_s: 0.02,
            factor: 2.0,
            steps: 10,
        })
    }));
    assert!(
        cold.ttft.median > 1.3 * warm.ttft.median,
        "TTFT P50 {} -> {}",
        warm.ttft.median,
        cold.ttft.median
    );
    assert!(
        (cold.itl.median / warm.itl.median - 1.0).abs() < 0.02,
        "ITL P50 {} -> {}",
        warm.itl.median,
        cold.itl.median
    );
    let damaged = edited_profile("cold-damaged", |p| {
        p.after_idle = Some(AfterIdle {
            idle_s: 0.02,
            factor: -1.0,
            steps: 10,
        })
    });
    let e = refusal(&damaged);
    assert!(
        e.contains("sim.profile") && e.contains("after_idle.factor"),
        "{e}"
    );
}

/// One request at a time, each a single prefill step and then its decodes: with extras of
/// 0.5 and 0.25 ms for the first two decode steps after a prefill (and nothing else random),
/// every request ends exactly 0.75 ms later, its first token no later, and its first gap
/// between tokens becomes the longest.
#[test]
fn the_decode_steps_after_a_prefill_take_their_extra_seconds() {
    let steady = |p: &mut Profile| {
        p.step_spread = None;
        p.after_idle = None;
    };
    let run = |profile: &str| {
        let o = profiled(profile);
        let o: Vec<&str> = o.iter().map(String::as_str).collect();
        let (_, rows) = infer_sim::run_collect(&common::setup("baseline", &o)).unwrap();
        rows.records
    };
    // 0.5 and 0.25 ms, as measured after `prefill_tokens`, growing by `per_token` of it a
    // token beyond.
    let extras = |name: &str, prefill_tokens: f64, per_prefill_token: f64| {
        edited_profile(name, |p| {
            steady(p);
            p.after_prefill = Some(AfterPrefill {
                extra_s: vec![0.5e-3, 0.25e-3],
                steps: 10,
                prefill_tokens,
                per_prefill_token,
            })
        })
    };
    let before = run(&edited_profile("steady", steady));
    let after = run(&extras("after-prefill", 0.0, 0.0));
    assert_eq!(before.len(), after.len());
    for (b, a) in before.iter().zip(&after) {
        assert!(a.output_tokens > 3, "{} tokens", a.output_tokens);
        assert!(
            (a.ttft.unwrap() - b.ttft.unwrap()).abs() < 1e-12,
            "request {}",
            a.id
        );
        let later = a.e2e - b.e2e;
        assert!(
            (later - 0.75e-3).abs() < 1e-9,
            "request {} ended {later} s later",
            a.id
        );
        // The first gap, 0.5 ms longer, is now the longest (the steady ones grow with the
        // context by less than 0.25 ms).
        let gap = a.itl_max.unwrap() - b.itl_max.unwrap();
        assert!(
            (0.25e-3..=0.5e-3 + 1e-12).contains(&gap),
            "request {}: longest gap {gap} s longer",
            a.id
        );
    }
    // Scaled by the prefill's tokens: twice as much after 256 new tokens as after 128.
    let scaled = run(&extras("after-prefill-scaled", 128.0, 1.0 / 128.0));
    for (b, a) in before.iter().zip(&scaled) {
        let prefilled = (a.prompt_tokens - a.cached_tokens) as f64;
        let want = 0.75e-3 * prefilled / 128.0;
        let later = a.e2e - b.e2e;
        assert!(
            (later - want).abs() < 1e-9,
            "request {} ({prefilled} new prompt tokens) ended {later} s later, not {want}",
            a.id
        );
    }
    let damaged = edited_profile("after-prefill-damaged", |p| {
        p.after_prefill = Some(AfterPrefill {
            extra_s: vec![-1e-3],
            steps: 10,
            prefill_tokens: 0.0,
            per_prefill_token: 0.0,
        })
    });
    let e = refusal(&damaged);
    assert!(
        e.contains("sim.profile") && e.contains("after_prefill.extra_s"),
        "{e}"
    );
}

#[test]
fn a_damaged_overlap_loss_is_refused_by_name() {
    let damaged = edited_profile("overlap-damaged", |p| {
        p.client
            .as_mut()
            .expect("the shipped profile has a client path")
            .overlap_step_loss = 1.0
    });
    let e = refusal(&damaged);
    assert!(
        e.contains("sim.profile") && e.contains("client.overlap_step_loss"),
        "{e}"
    );
}
