//! The random host pause per step (`step_jitter_s`): what it does to a single stream's
//! latencies, and that it replays exactly.

mod common;

/// ITL and TTFT (P50, P99) of the baseline workload (one request at a time) under `extra`.
fn latencies(extra: &[&str]) -> ([f64; 2], [f64; 2]) {
    let r = common::run("baseline", extra);
    let s = &r.summary;
    ([s.itl.median, s.itl.p99], [s.ttft.median, s.ttft.p99])
}

#[test]
fn a_step_jitter_lifts_the_itl_tail_by_its_exponential_quantiles() {
    let mean = 0.002;
    let ([p50, p99], [t50, _]) = latencies(&[]);
    let ([j50, j99], [u50, _]) = latencies(&["sim.step_jitter_s=0.002"]);
    // An exponential pause of mean m adds m·ln 2 to the median gap and m·ln 100 to the
    // 99th percentile; the baseline's ~2,000 gaps pin both within a quarter.
    let median_shift = (j50 - p50) / (mean * 2f64.ln());
    let tail_shift = (j99 - p99) / (mean * 100f64.ln());
    assert!(
        (0.75..1.25).contains(&median_shift),
        "ITL P50 {p50} -> {j50}: {median_shift:.2} of m ln 2"
    );
    assert!(
        (0.75..1.25).contains(&tail_shift),
        "ITL P99 {p99} -> {j99}: {tail_shift:.2} of m ln 100"
    );
    // TTFT is one prompt pass (~30 ms here) and pays one pause, not a share of the pass:
    // its median moves by a few m, drawn over ten requests.
    assert!(
        (u50 - t50).abs() < 3.0 * mean,
        "TTFT P50 {t50} -> {u50}: a pause of mean {mean} s"
    );
}

#[test]
fn a_jittered_run_replays_exactly_and_draws_the_same_workload() {
    let rows = |extra: &[&str]| common::replay("chunked_prefill", extra);
    let jitter = ["sim.step_jitter_s=0.003"];
    let a = rows(&jitter);
    assert_eq!(a, rows(&jitter), "same scenario and seed, same bytes");
    let steady = rows(&[]);
    assert_ne!(a.0, steady.0, "the jitter moved the figures");
    assert_eq!(
        a.2, steady.2,
        "arrivals and prompts do not depend on the jitter's draws"
    );
}

#[test]
fn a_negative_jitter_is_refused_by_name() {
    let e = infer_sim::load(
        &common::path("baseline"),
        &["sim.step_jitter_s=-1".to_string()],
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(
        e.contains("sim.step_jitter_s") && e.contains("between 0 and"),
        "{e}"
    );
}
