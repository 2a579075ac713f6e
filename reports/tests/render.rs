//! Every table and chart type rendered from the fixture runs under tests/fixtures/, which
//! are small `sim run` outputs:
//!
//! * cp_p6, cp_p7: chunked_prefill, 12 requests, without / with chunked prefill;
//! * l4_c1, l4_c4, l4_c8: l4_concurrency_sweep, 8 requests at concurrency 1, 4, 8;
//! * llmd_precise-prefix, llmd_random: llmd_shared_prefix on 2 replicas, 3 stages
//!   (2, 4, 8 QPS over 4, 4, 3 s), 32 output tokens.
//!
//! Expected figures are the fixtures' own (summary.json, and `sim run`'s stage table).

use std::path::{Path, PathBuf};

use infer_reports::chart::PANEL_SIZE;
use infer_reports::compare::{against_baseline, phase_comparisons};
use infer_reports::load::{concurrency_table, load_points};
use infer_reports::run::{labels, series_labels};
use infer_reports::tables::workload_table;
use infer_reports::{predicted_vs_measured, write_report, write_verify_report, Run};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn load(name: &str) -> Run {
    Run::load(fixture(name)).expect("fixture loads")
}

/// A fresh output directory under cargo's per-test temporary area.
fn out_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn png_size(path: &Path) -> (u32, u32) {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut reader = png::Decoder::new(file).read_info().expect("a valid PNG");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("decodes");
    (info.width, info.height)
}

const ALL: [&str; 7] = [
    "cp_p6",
    "cp_p7",
    "l4_c1",
    "l4_c4",
    "l4_c8",
    "llmd_precise-prefix",
    "llmd_random",
];

#[test]
fn workload_table_holds_the_summary_figures() {
    let (p6, p7) = (load("cp_p6"), load("cp_p7"));
    let runs = [&p6, &p7];
    let ls = labels(&runs);
    assert_eq!(ls, ["P6 paged", "P7 chunked"], "columns named by phase");
    let t = workload_table(&runs, &ls);
    let cell = |row: &str, col: &str| t.cell(row, col).unwrap().to_string();
    assert_eq!(cell("Throughput (tok/s)", "P6 paged"), "356.8");
    assert_eq!(cell("Throughput (tok/s)", "P7 chunked"), "361.4");
    assert_eq!(cell("TTFT P50 (ms)", "P6 paged"), "255");
    assert_eq!(cell("TTFT P99 (ms)", "P7 chunked"), "642");
    assert_eq!(cell("ITL P99 (ms)", "P6 paged"), "237");
    assert_eq!(cell("ITL P99 (ms)", "P7 chunked"), "66");
    assert_eq!(cell("Latency P50 (s)", "P7 chunked"), "3.723");
    assert_eq!(cell("Errors", "P6 paged"), "0");
    let text = t.render();
    assert!(
        text.starts_with("| Metric             | P6 paged | P7 chunked |\n"),
        "{text}"
    );
}

/// A copy of fixture `name` whose summary.json holds `extra` keys too (a prediction's
/// interval).
fn with_keys(name: &str, extra: &[(&str, f64)]) -> Run {
    let dir = out_dir(&format!("keys-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let text = std::fs::read_to_string(dir.join("summary.json")).unwrap();
    let mut summary: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).unwrap();
    for (k, v) in extra {
        summary.insert(k.to_string(), (*v).into());
    }
    std::fs::write(
        dir.join("summary.json"),
        serde_json::to_string(&summary).unwrap(),
    )
    .unwrap();
    Run::load(&dir).unwrap()
}

#[test]
fn a_predictions_interval_is_shown_in_its_cell_and_drawn_as_a_band() {
    let p6 = with_keys(
        "cp_p6",
        &[
            ("output_throughput_lo", 300.0),
            ("output_throughput_hi", 410.25),
        ],
    );
    let p7 = load("cp_p7");
    let runs = [&p6, &p7];
    let t = workload_table(&runs, &labels(&runs));
    assert_eq!(
        t.cell("Throughput (tok/s)", "P6 paged").unwrap(),
        "356.8 [300.0–410.2]"
    );
    assert_eq!(t.cell("Throughput (tok/s)", "P7 chunked").unwrap(), "361.4");
    let band = |lo: f64, hi: f64| [("median_ttft_ms_lo", lo), ("median_ttft_ms_hi", hi)];
    let (c1, c4) = (
        with_keys("l4_c1", &band(10.0, 20.0)),
        with_keys("l4_c4", &band(30.0, 50.0)),
    );
    let runs = [&c1, &c4];
    let names = vec!["sweep".to_string(); 2];
    let figure = infer_reports::figures::concurrency_figure(&runs, &names);
    let ttft = &figure.panels[1].series[0];
    assert_eq!(ttft.band.len(), 2, "{ttft:?}");
    assert_eq!((ttft.band[0].1, ttft.band[1].2), (10.0, 50.0));
    assert!(
        figure.panels[0].series[0].band.is_empty(),
        "no interval, no band"
    );
    figure.render(&out_dir("band-chart")).unwrap();
}

#[test]
fn csv_percentiles_agree_with_the_summary() {
    // requests.csv rounds to the microsecond; summary.json is computed before rounding.
    for name in ["cp_p6", "llmd_random"] {
        let r = load(name);
        let ok = r.successful();
        for (q, key) in [
            (0.5, "median_ttft_ms"),
            (0.99, "p99_ttft_ms"),
            (0.5, "median_e2el_ms"),
        ] {
            let col = if key.contains("ttft") {
                "ttft_ms"
            } else {
                "e2e_ms"
            };
            let got = ok.quantile(col, q).unwrap();
            let want = r.metric(key).unwrap();
            assert!((got - want).abs() < 2e-3, "{name} {key}: {got} vs {want}");
        }
    }
}

#[test]
fn stage_points_match_the_simulators_stage_table() {
    let r = load("llmd_precise-prefix");
    let pts = load_points(&r);
    let got: Vec<(f64, usize, String, String)> = pts
        .iter()
        .map(|p| {
            (
                p.qps,
                p.requests,
                format!("{:.1}", p.output_throughput),
                format!("{:.3}", p.ttft_p90_s),
            )
        })
        .collect();
    // `sim run` printed: stage 0 2.0 QPS 7 req 56.0 tok/s p90 0.182; 4.0 12 96.0 0.035;
    // 8.0 19 202.7 0.033.
    let want = [
        (2.0, 7, "56.0", "0.182"),
        (4.0, 12, "96.0", "0.035"),
        (8.0, 19, "202.7", "0.033"),
    ];
    let want: Vec<(f64, usize, String, String)> = want
        .iter()
        .map(|&(q, n, t, p)| (q, n, t.to_string(), p.to_string()))
        .collect();
    assert_eq!(got, want);
    assert!(
        load_points(&load("l4_c1")).is_empty(),
        "a closed loop has no QPS"
    );
}

#[test]
fn phase_comparison_has_before_after_and_delta() {
    let (p6, p7) = (load("cp_p6"), load("cp_p7"));
    // Given newest first: the comparison still runs from the lower phase up.
    let cs = phase_comparisons(&[&p7, &p6]);
    assert_eq!(cs.len(), 1);
    assert_eq!(cs[0].title(), "Phase 7 vs Phase 6 — chunked_prefill");
    let col = "llama-3.2-3b P6 → P7";
    assert_eq!(
        cs[0].table.cell("Throughput (tok/s)", col),
        Some("356.8 → 361.4 (+1%)")
    );
    assert_eq!(
        cs[0].table.cell("ITL P99 (ms)", col),
        Some("237 → 66 (-72%)")
    );
    let routers = [&load("llmd_precise-prefix"), &load("llmd_random")];
    assert!(
        phase_comparisons(&routers).is_empty(),
        "same phase: no step"
    );
}

/// A phase step's two runs differ in the phase's techniques only: P7 on other hardware, at
/// another rate or from the other driver is not a step from P6 (before, its table credited
/// the whole difference to chunked prefill), and a configuration off the log's ladder is
/// not a phase.
#[test]
fn a_phase_step_differs_in_its_techniques_only() {
    let (p6, p7) = (load("cp_p6"), load("cp_p7"));
    let changed = |f: &dyn Fn(&mut infer_reports::RunInfo)| {
        let mut r = load("cp_p7");
        f(r.info.as_mut().unwrap());
        r
    };
    let h100 = changed(&|i| i.server.hardware = "h100-80gb".into());
    let faster = changed(&|i| i.arrival.rate = Some(12.0));
    let engine = changed(&|i| i.source = "engine".into());
    let longer = changed(&|i| i.server.max_model_len *= 2);
    // Another workload under the same scenario name (`--set workload.…`).
    let other_prompts = changed(&|i| {
        i.workload = Some(serde_json::json!({"num_requests": 10, "prompt_tokens": 4096}))
    });
    for other in [&h100, &faster, &engine, &longer, &other_prompts] {
        assert!(phase_comparisons(&[&p6, other]).is_empty());
        let cs = phase_comparisons(&[&p6, other, &p7]);
        assert_eq!(cs.len(), 1);
        assert_eq!(
            cs[0]
                .table
                .cell("Throughput (tok/s)", "llama-3.2-3b P6 → P7"),
            Some("356.8 → 361.4 (+1%)")
        );
        assert_eq!(cs[0].table.header.len(), 2, "{:?}", cs[0].table.header);
    }
    // The same step on two GPUs: two columns, the second told apart by its runs.
    let mut p6_h100 = load("cp_p6");
    p6_h100.info.as_mut().unwrap().server.hardware = "h100-80gb".into();
    let cs = phase_comparisons(&[&p6, &p7, &p6_h100, &h100]);
    assert_eq!(cs.len(), 1);
    assert_eq!(cs[0].table.header.len(), 3, "{:?}", cs[0].table.header);
    let off_ladder = changed(&|i| i.phase = "P6 paged + prefix-caching".into());
    assert!(phase_comparisons(&[&off_ladder, &p7]).is_empty());
    // The same workload, one with its defaults written out: a step.
    let workload = |i: &mut infer_reports::RunInfo, defaults: bool| {
        let mut w = serde_json::json!({"num_requests": 10, "prompt_tokens": 4096});
        if defaults {
            w["warmup_requests"] = 0.into();
            w["ignore_eos"] = false.into();
            w["seed"] = 42.into();
        }
        i.workload = Some(w);
    };
    let mut p6_set = load("cp_p6");
    workload(p6_set.info.as_mut().unwrap(), false);
    let p7_set = changed(&|i| workload(i, true));
    assert_eq!(phase_comparisons(&[&p6_set, &p7_set]).len(), 1);
    // The batch and pool sizes the log changes with its KV backend do not part a step.
    let bigger = changed(&|i| i.server.num_gpu_blocks *= 2);
    assert_eq!(phase_comparisons(&[&p6, &bigger]).len(), 1);
}

#[test]
fn regressions_are_flagged_past_thresholds_only() {
    let (p6, p7) = (load("cp_p6"), load("cp_p7"));
    // P7 as baseline, P6 as candidate: ITL P99 66 → 237 ms is a regression; TTFT P99
    // 642 → 743 (+16%) is within the 20% band; throughput -1% within 5%.
    let (table, found) = against_baseline(("P7", &p7), &[("P6".to_string(), &p6)]);
    let metrics: Vec<&str> = found.iter().map(|r| r.metric).collect();
    assert_eq!(metrics, ["ITL P99"]);
    assert_eq!(
        table.cell("ITL P99 (ms)", "P7 → P6"),
        Some("66 → 237 (+259%) ⚠")
    );
    assert_eq!(
        table.cell("TTFT P99 (ms)", "P7 → P6"),
        Some("642 → 743 (+16%)")
    );
    // Latency P99 is compared too, with its 20% band.
    let p99 = p7.summary["p99_e2el_ms"];
    let slower = with_keys("cp_p7", &[("p99_e2el_ms", p99 * 1.25)]);
    let (_, found) = against_baseline(("P7", &p7), &[("slower".to_string(), &slower)]);
    let metrics: Vec<&str> = found.iter().map(|r| r.metric).collect();
    assert_eq!(metrics, ["Latency P99"]);
}

#[test]
fn concurrency_table_orders_by_clients() {
    let runs = [&load("l4_c8"), &load("l4_c1"), &load("l4_c4")];
    let ls = labels(&runs);
    assert_eq!(
        ls,
        ["l4_c8", "l4_c1", "l4_c4"],
        "same config: directory names"
    );
    assert_eq!(
        series_labels(&runs),
        ["P9 cuda-graphs"; 3],
        "one sweep series"
    );
    let t = concurrency_table(&runs, &ls);
    let order: Vec<&str> = t.rows.iter().map(|r| r[1].as_str()).collect();
    assert_eq!(order, ["1", "4", "8"]);
    assert_eq!(t.cell("l4_c1", "out tok/s"), Some("193"));
    assert_eq!(t.cell("l4_c8", "out tok/s"), Some("1412"));
    assert_eq!(t.cell("l4_c4", "TTFT p50 (ms)"), Some("16.0"));
}

#[test]
fn report_writes_every_table_and_chart() {
    let out = out_dir("report");
    let dirs: Vec<PathBuf> = ALL.iter().map(|n| fixture(n)).collect();
    let report = write_report(&dirs, Some(&fixture("cp_p7")), &out).expect("report");
    let md = std::fs::read_to_string(&report.path).unwrap();

    for section in [
        "## Runs",
        "## chunked_prefill",
        "### Phase 7 vs Phase 6 — chunked_prefill",
        "## l4_concurrency_sweep",
        "### Concurrency sweep",
        "## llmd_shared_prefix",
        "### Per-stage results — precise-prefix",
        "### Per-stage results — random",
        "## Against the baseline (cp_p7, scenario chunked_prefill)",
        "**1 regression(s) against the baseline `cp_p7`:**",
    ] {
        assert!(md.contains(section), "missing {section:?}");
    }
    assert!(md.contains("| Throughput (tok/s) |    356.8 |      361.4 |"));
    assert_eq!(report.regressions.len(), 1);
    assert_eq!(report.regressions[0].metric, "ITL P99");

    let one = PANEL_SIZE;
    let expected = [
        ("chunked_prefill_ttft_cdf", one),
        ("chunked_prefill_itl_cdf", one),
        ("chunked_prefill_waiting_queue_vs_time", one),
        ("chunked_prefill_kv_cache_usage_vs_time", one),
        ("l4_concurrency_sweep_concurrency_sweep", (3 * one.0, one.1)),
        ("llmd_shared_prefix_latency_vs_qps", one),
        ("llmd_shared_prefix_throughput_vs_qps", one),
        ("llmd_shared_prefix_ttft_p90_vs_qps", one),
        (
            "llmd_shared_prefix_replica_load_llmd_random",
            (2 * one.0, one.1),
        ),
        (
            "llmd_shared_prefix_replica_load_llmd_precise-prefix",
            (2 * one.0, one.1),
        ),
    ];
    for (name, size) in expected {
        let png = out.join("charts").join(format!("{name}.png"));
        assert_eq!(png_size(&png), size, "{name}");
        let svg = std::fs::read_to_string(out.join("charts").join(format!("{name}.svg"))).unwrap();
        assert!(svg.starts_with("<svg"), "{name}.svg");
        assert!(
            md.contains(&format!("(charts/{name}.png)")),
            "{name} linked"
        );
    }
    assert!(report.charts.iter().all(|c| c.exists()));
    // No QPS charts for runs without a rate sweep or stages.
    assert!(!out
        .join("charts/l4_concurrency_sweep_latency_vs_qps.png")
        .exists());
}

#[test]
fn predicted_vs_measured_table_and_charts() {
    let (pred, meas) = (load("cp_p7"), load("cp_p6"));
    let v = predicted_vs_measured(&pred, &meas);
    let row = |name: &str| v.rows.iter().find(|r| r.metric.short == name).unwrap();
    let tp = row("Throughput");
    let want = (tp.predicted.unwrap() - tp.measured.unwrap()) / tp.measured.unwrap() * 100.0;
    assert!((tp.error_pct.unwrap() - want).abs() < 1e-9);
    assert_eq!(row("TTFT P50").predicted, pred.metric("median_ttft_ms"));
    assert_eq!(row("ITL P99").measured, meas.metric("p99_itl_ms"));
    assert_eq!(
        row("Latency P99").measured,
        meas.metric("p99_e2el_ms").map(|v| v / 1e3)
    );
    let mut abs: Vec<f64> = v.rows.iter().map(|r| r.error_pct.unwrap().abs()).collect();
    abs.sort_by(f64::total_cmp);
    assert_eq!(v.median_abs_error_pct, Some(abs[3]), "7 metrics: the 4th");
    let t = v.table();
    assert_eq!(t.cell("Throughput (tok/s)", "Predicted"), Some("361.4"));
    assert_eq!(t.cell("Throughput (tok/s)", "Measured"), Some("356.8"));
    assert_eq!(t.cell("Throughput (tok/s)", "Error"), Some("+1.3%"));

    let out = out_dir("verify");
    let path = write_verify_report(&fixture("cp_p7"), &fixture("cp_p6"), &out).unwrap();
    let md = std::fs::read_to_string(path).unwrap();
    assert!(md.contains("Median absolute error: "));
    for name in ["verify_ttft_cdf", "verify_itl_cdf", "verify_e2e_cdf"] {
        assert_eq!(
            png_size(&out.join(format!("charts/{name}.png"))),
            PANEL_SIZE
        );
        assert!(md.contains(&format!("charts/{name}.png")));
    }
}

/// A run's warnings (a prediction's fragility, an interrupted measurement) are in the
/// report beside its details: its figures alone would not show them.
#[test]
fn a_runs_warnings_are_in_the_report() {
    let dir = out_dir("warned_run");
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture("cp_p7")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let info = dir.join("run.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&info).unwrap()).unwrap();
    v["warnings"] = serde_json::json!(["interrupted at 8.9 s: 32 of 40 requests sent"]);
    std::fs::write(&info, v.to_string()).unwrap();

    let out = out_dir("warned_report");
    let report = write_report(&[fixture("cp_p6"), dir.clone()], None, &out).unwrap();
    let md = std::fs::read_to_string(&report.path).unwrap();
    let details = &md[md.find("### Run details").unwrap()..];
    assert!(
        details.contains("  - ⚠ interrupted at 8.9 s: 32 of 40 requests sent\n"),
        "{details}"
    );
    assert_eq!(details.matches('⚠').count(), 1, "{details}");
}
