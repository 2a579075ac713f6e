//! Same scenario and seed → byte-identical summary.json and requests.csv.

mod common;

use infer_sim::output::{requests_csv, timeseries_csv};

fn files(name: &str, overrides: &[&str]) -> (String, String, String) {
    let r = common::run(name, overrides);
    let json = serde_json::to_string_pretty(&r.summary).unwrap();
    (
        json,
        requests_csv(&r.records),
        timeseries_csv(&r.timeseries),
    )
}

#[test]
fn single_replica_runs_replay_exactly() {
    let a = files("chunked_prefill", &[]);
    let b = files("chunked_prefill", &[]);
    assert_eq!(a, b);
    assert!(a.1.lines().count() == 49, "header + 48 requests");
    let c = files("chunked_prefill", &["workload.seed=7"]);
    assert_ne!(a.1, c.1, "another seed, another workload");
}

#[test]
fn routed_runs_replay_exactly() {
    let small = [
        "workload.num_requests=400",
        "workload.conversations.count=40",
        "arrival.max_concurrency=80",
    ];
    for router in ["chwbl", "random", "least-queue"] {
        let set = format!("cluster.router={router}");
        let o: Vec<&str> = small.iter().copied().chain([set.as_str()]).collect();
        let a = files("kubeai_prefix_routing", &o);
        let b = files("kubeai_prefix_routing", &o);
        assert_eq!(a, b, "{router}");
        assert!(
            a.1.contains(",7,true,"),
            "{router}: the replica column is filled"
        );
    }
}
