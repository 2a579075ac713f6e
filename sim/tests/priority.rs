//! Priority scheduling in the simulator: `scenarios/priority_scheduling.toml` sends one
//! request in five at priority 0 and the rest at 1, just past what the replica serves.

mod common;

use infer_core::metrics::{PrioritySummary, Summary};

fn class(s: &Summary, priority: i64) -> PrioritySummary {
    *s.by_priority
        .iter()
        .find(|c| c.priority == priority)
        .unwrap_or_else(|| panic!("priority {priority} in {:?}", s.by_priority))
}

/// Under priority scheduling the priority-0 requests wait for nobody of priority 1: their
/// TTFT is a fraction of the others' and of their own under first come, first served,
/// where both classes wait alike. The requests and the throughput are the same.
#[test]
fn priority_scheduling_serves_the_lowest_value_first() {
    let run = |policy: &str| {
        let set = format!("server.scheduling_policy={policy}");
        infer_sim::run_collect(&common::setup("priority_scheduling", &[&set])).unwrap()
    };
    let ((ranked, ranked_rows), (fcfs, fcfs_rows)) = (run("priority"), run("fcfs"));
    let (ranked, fcfs) = (&ranked.summary, &fcfs.summary);
    let (first, rest) = (class(ranked, 0), class(ranked, 1));
    assert_eq!(first.completed + rest.completed, 300);
    // One in five drawn from the seed, the same requests under both policies.
    assert!((40..=80).contains(&first.completed), "{first:?}");
    assert_eq!(first.completed, class(fcfs, 0).completed);
    let priorities = |rows: &infer_sim::Rows| -> Vec<i64> {
        rows.records.iter().map(|r| r.priority).collect::<Vec<_>>()
    };
    assert_eq!(priorities(&ranked_rows), priorities(&fcfs_rows));
    assert!(
        first.ttft.median * 5.0 < rest.ttft.median,
        "{first:?} {rest:?}"
    );
    assert!(
        first.ttft.median * 5.0 < class(fcfs, 0).ttft.median,
        "{first:?} {:?}",
        class(fcfs, 0)
    );
    let (a, b) = (class(fcfs, 0).ttft.median, class(fcfs, 1).ttft.median);
    assert!(
        a < 2.0 * b && b < 2.0 * a,
        "first come, first served: {a} {b}"
    );
    assert!((ranked.output_throughput / fcfs.output_throughput - 1.0).abs() < 0.05);
    // The summary's keys, and none without priorities.
    let json = serde_json::to_value(ranked).unwrap();
    assert_eq!(json["priority_0_completed"], first.completed);
    assert!(json["priority_1_median_ttft_ms"].as_f64().unwrap() > 0.0);
    let plain = common::run("chunked_prefill", &[]).summary;
    assert!(plain.by_priority.is_empty());
    assert!(!serde_json::to_string(&plain).unwrap().contains("priority_"));
}

/// With an SLO, each priority's share of requests within it, which add up to the run's:
/// priority scheduling keeps the interactive class within a TTFT objective the batch class
/// mostly misses.
#[test]
fn each_priority_has_its_share_within_the_slo() {
    let setup = common::setup("priority_scheduling", &["slo.ttft_ms=2000"]);
    let s = infer_sim::run(&setup).unwrap().summary;
    let (first, rest) = (class(&s, 0), class(&s, 1));
    let (a, b) = (first.slo_attainment.unwrap(), rest.slo_attainment.unwrap());
    assert!(a > 0.95 && b < 0.5, "{a} {b}");
    let n = |c: &PrioritySummary| (c.completed + c.failed) as f64;
    let all = s.goodput.unwrap().slo_attainment;
    assert!(((a * n(&first) + b * n(&rest)) / (n(&first) + n(&rest)) - all).abs() < 1e-12);
    let json = serde_json::to_value(&s).unwrap();
    assert_eq!(json["priority_0_slo_attainment"], a);
    assert!(s.render().contains("Priority 0 within SLO (%):"));
    // Without an SLO, none.
    let plain = infer_sim::run(&common::setup("priority_scheduling", &[])).unwrap();
    assert!(plain
        .summary
        .by_priority
        .iter()
        .all(|c| c.slo_attainment.is_none()));
}

/// `sim sweep` over the policy: each priority's columns beside the run's, so the figure
/// priority scheduling moves is in the table; a workload of one priority has none.
#[test]
fn a_sweep_has_each_prioritys_columns() {
    let file = common::path("priority_scheduling");
    let text = std::fs::read_to_string(&file).unwrap();
    let axes = [infer_sim::sweep::parse_axis("server.scheduling_policy=fcfs,priority").unwrap()];
    let slo = ["slo.ttft_ms=2000".to_string()];
    let points = infer_sim::sweep::run(&file, &text, &slo, &axes, 2, false, 1);
    let csv = infer_sim::sweep::csv(&axes, &points);
    let rows: Vec<Vec<&str>> = csv.lines().map(|l| l.split(',').collect()).collect();
    let col = |name: &str| rows[0].iter().position(|c| *c == name).unwrap();
    let figure = |row: usize, name: &str| rows[row][col(name)].parse::<f64>().unwrap();
    // fcfs, then priority: the interactive class's median TTFT falls, and all of it is
    // within the objective.
    let (fcfs, ranked) = (1, 2);
    assert!(
        figure(ranked, "priority_0_ttft_p50_ms") * 5.0 < figure(fcfs, "priority_0_ttft_p50_ms")
    );
    assert_eq!(figure(ranked, "priority_0_slo_attainment"), 1.0);
    for name in ["priority_1_ttft_p99_ms", "priority_1_e2el_p50_ms", "error"] {
        col(name);
    }
    assert!(infer_sim::sweep::table(&axes, &points).contains("p0_ttft_p50"));
    let plain = common::path("chunked_prefill");
    let text = std::fs::read_to_string(&plain).unwrap();
    let axes = [infer_sim::sweep::parse_axis("server.max_batch_size=8").unwrap()];
    let points = infer_sim::sweep::run(&plain, &text, &[], &axes, 1, false, 1);
    assert!(!infer_sim::sweep::csv(&axes, &points).contains("priority_"));
}

/// A run's requests.csv replays with each request's priority: the classes, and what
/// priority scheduling does to them, come back.
#[test]
fn a_replayed_requests_csv_keeps_each_requests_priority() {
    let (r, rows) = infer_sim::run_collect(&common::setup("priority_scheduling", &[])).unwrap();
    let csv = infer_sim::output::requests_csv(&rows.records);
    let path = std::env::temp_dir().join(format!("infer-priority-{}.csv", std::process::id()));
    std::fs::write(&path, csv).unwrap();
    let trace = format!(
        "workload.trace={{ path = \"{}\", format = \"requests\" }}",
        path.display()
    );
    // The priority each request will have, known without making it (bench's test request).
    let setup = common::setup(
        "trace_replay",
        &[
            &trace,
            "workload.num_requests=300",
            "server.scheduling_policy=priority",
        ],
    );
    let spec = setup.scenario.workload.trace.as_ref().unwrap();
    let trace_file =
        infer_core::workload::Trace::load(spec, &common::path("trace_replay")).unwrap();
    let gen = infer_core::workload::WorkloadGenerator::new(
        setup.scenario.workload.clone(),
        std::sync::Arc::new(infer_core::workload::ApproxTokenizer::default()),
    )
    .with_trace(std::sync::Arc::new(trace_file));
    for i in [0, 1, 7, 150, 299] {
        assert_eq!(gen.priority_of(i), gen.request(i).priority, "request {i}");
    }
    assert!((0..300).any(|i| gen.priority_of(i) == 1));
    let replay = infer_sim::run(&common::setup(
        "trace_replay",
        &[
            &trace,
            "workload.num_requests=300",
            "server.scheduling_policy=priority",
        ],
    ))
    .unwrap();
    std::fs::remove_file(&path).unwrap();
    for p in [0, 1] {
        let (a, b) = (class(&r.summary, p), class(&replay.summary, p));
        assert_eq!(a.completed, b.completed, "priority {p}");
    }
    assert!(class(&replay.summary, 0).ttft.median * 5.0 < class(&replay.summary, 1).ttft.median);
}
