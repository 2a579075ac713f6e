//! Warnings where a prediction is fragile: each fires where it should and not elsewhere,
//! and `sim run` prints them and keeps them in run.json.

mod common;

use std::process::Command;

use infer_sim::trust;

/// The warnings of preparing the scenario (uncalibrated, extrapolation, memory).
fn warnings(name: &str, overrides: &[&str]) -> Vec<String> {
    common::setup(name, overrides).warnings
}

/// And the saturation warning, which simulates the scenario's capacity.
fn with_saturation(name: &str, overrides: &[&str]) -> Vec<String> {
    let setup = common::setup(name, overrides);
    let mut w = setup.warnings.clone();
    w.extend(trust::saturation(&setup).unwrap());
    w
}

fn has(w: &[String], what: &str) -> bool {
    w.iter().any(|w| w.contains(what))
}

#[test]
fn saturation_fires_near_capacity_and_not_below() {
    let capacity = trust::capacity(&common::setup("chunked_prefill", &[]))
        .unwrap()
        .requests_per_s;
    assert!(capacity > 0.0);
    let at = |fraction: f64| {
        let rate = format!("arrival.rate={:?}", capacity * fraction);
        with_saturation("chunked_prefill", &[&rate])
    };
    let near = at(0.95);
    assert!(
        has(&near, "near saturation") && has(&near, "95% of the predicted capacity"),
        "{near:?}"
    );
    assert!(has(&at(1.5), "over capacity"));
    let light = at(0.5);
    assert!(
        !has(&light, "saturation") && !has(&light, "capacity"),
        "{light:?}"
    );
    // Closed-loop arrivals have no offered rate to compare.
    assert!(!has(
        &with_saturation("l4_concurrency_sweep", &[]),
        "capacity"
    ));
}

#[test]
fn uncalibrated_pairs_are_named_and_calibrated_ones_are_not() {
    assert!(!has(&warnings("chunked_prefill", &[]), "uncalibrated"));
    let w = warnings("chunked_prefill", &["server.hardware=h200"]);
    assert!(
        has(
            &w,
            "uncalibrated: no calibration covers llama-3.2-3b on h200"
        ),
        "{w:?}"
    );
    // A profile prices the steps: no roofline, no warning.
    assert!(!has(&warnings("plan_cpu", &[]), "uncalibrated"));
}

#[test]
fn extrapolation_beyond_the_profile_is_named() {
    // The shipped CPU profile measured decode batches up to 32 and sequences up to ~4k.
    assert!(!has(&warnings("plan_cpu", &[]), "extrapolation"));
    let w = warnings(
        "plan_cpu",
        &[
            "server.max_batch_size=64",
            "server.max_model_len=16384",
            "workload.output_tokens=8192",
        ],
    );
    assert!(has(&w, "the decode batch can reach 64"), "{w:?}");
    assert!(has(&w, "a sequence's context can reach"), "{w:?}");
}

#[test]
fn extrapolation_beyond_the_calibrations_runs_is_named() {
    // The shipped RTX 5080 calibration's runs (the log's Phases 4-9) batch at most 24.
    for name in [
        "chunked_prefill",
        "baseline",
        "paged_attention",
        "prefix_caching",
    ] {
        let w = warnings(name, &[]);
        assert!(!has(&w, "extrapolation"), "{name}: {w:?}");
    }
    let w = warnings("chunked_prefill", &["server.max_batch_size=48"]);
    assert!(
        has(
            &w,
            "the decode batch can reach 48, the calibration's runs reached at most 24"
        ),
        "{w:?}"
    );
}

#[test]
fn sim_run_prints_the_warnings_and_keeps_them_in_run_json() {
    let out = std::env::temp_dir().join(format!("infer-sim-trust-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let o = Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(["run", &common::path("chunked_prefill"), "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // As shipped, the workload's 6 requests/s are past the Phase 8 server's capacity.
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("warning: over capacity"), "{stdout}");
    let run: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    let kept: Vec<&str> = run["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    assert!(kept.iter().any(|w| w.contains("over capacity")), "{kept:?}");
    std::fs::remove_dir_all(&out).unwrap();
}

fn knife_edge(name: &str, overrides: &[&str]) -> Option<String> {
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    let setup = common::setup(name, overrides);
    let text = std::fs::read_to_string(common::path(name)).unwrap();
    trust::knife_edge(&setup, &text, &o).unwrap()
}

/// The benchmark log's Phase 6 collapse on chunked_prefill hangs on one coefficient (the
/// prompt attention efficiency): the check finds it there and nowhere on Phase 8.
#[test]
fn the_knife_edge_fires_on_phase_6_chunked_prefill_and_not_on_phase_8() {
    let p6 = knife_edge(
        "chunked_prefill",
        &[
            "server.chunked_prefill=false",
            "server.prefix_caching=false",
        ],
    )
    .expect("Phase 6 is a knife-edge");
    assert!(p6.contains("knife-edge: attention_efficiency"), "{p6}");
    assert_eq!(knife_edge("chunked_prefill", &[]), None, "Phase 8");
    // A profile has no calibrated coefficients to move.
    assert_eq!(knife_edge("plan_cpu", &[]), None);
}
