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
