//! Goodput as `vllm bench serve --goodput` defines it, recomputed from the run's own rows.

mod common;

#[test]
fn goodput_is_the_requests_within_every_objective_per_second() {
    // Objectives near the run's medians, so that some requests meet them and some do not.
    let probe = common::run("chunked_prefill", &[]).summary;
    let ttft_ms = probe.ttft.median * 1e3;
    let tpot_ms = probe.tpot.p90 * 1e3;
    let set = [
        format!("slo.ttft_ms={ttft_ms}"),
        format!("slo.tpot_ms={tpot_ms}"),
    ];
    let o: Vec<&str> = set.iter().map(String::as_str).collect();
    let (r, rows) = infer_sim::run_collect(&common::setup("chunked_prefill", &o)).unwrap();
    let good = rows
        .records
        .iter()
        .filter(|q| {
            let tpot = if q.output_tokens > 1 {
                (q.e2e - q.ttft.unwrap()) / (q.output_tokens - 1) as f64
            } else {
                0.0
            };
            q.error.is_none() && q.ttft.unwrap() * 1e3 <= ttft_ms && tpot * 1e3 <= tpot_ms
        })
        .count();
    assert!(0 < good && good < rows.records.len(), "{good}: a split");
    let g = r.summary.goodput.expect("the SLO is set");
    assert!((g.request_goodput - good as f64 / r.summary.duration).abs() < 1e-12);
    assert!((g.slo_attainment - good as f64 / rows.records.len() as f64).abs() < 1e-12);
    // The run itself is unchanged by measuring goodput.
    assert_eq!(r.summary.ttft, probe.ttft);
    assert!(probe.goodput.is_none());
}

#[test]
fn the_command_line_form_is_the_slo_table() {
    let setup = common::setup("baseline", &["slo.ttft_ms=50.0", "slo.e2el_ms=900.0"]);
    let slo = setup.scenario.slo.expect("set");
    assert_eq!(
        (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms),
        (Some(50.0), None, Some(900.0))
    );
    let args = ["ttft:50".to_string(), "e2el:900".to_string()];
    let o = infer_core::metrics::Slo::overrides(&args).unwrap();
    let o: Vec<&str> = o.iter().map(String::as_str).collect();
    assert_eq!(common::setup("baseline", &o).scenario.slo, Some(slo));
}
