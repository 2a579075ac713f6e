//! Same scenario and seed → byte-identical summary.json and requests.csv.

mod common;

use infer_sim::output::{requests_csv, timeseries_csv};

fn files(name: &str, overrides: &[&str]) -> (String, String, String) {
    let (r, rows) = infer_sim::run_collect(&common::setup(name, overrides)).unwrap();
    assert_eq!(r.summary.failed, 0, "{name}");
    let json = serde_json::to_string_pretty(&r.summary).unwrap();
    (
        json,
        requests_csv(&rows.records),
        timeseries_csv(&rows.timeseries),
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
    // The last: replicas drawing their step pauses from one stream, in event order.
    for (router, jitter) in [
        ("chwbl", "0"),
        ("random", "0"),
        ("least-queue", "0"),
        ("chwbl", "0.002"),
    ] {
        let set = format!("cluster.router={router}");
        let jitter = format!("sim.step_jitter_s={jitter}");
        let o: Vec<&str> = small
            .iter()
            .copied()
            .chain([set.as_str(), jitter.as_str()])
            .collect();
        let a = files("kubeai_prefix_routing", &o);
        let b = files("kubeai_prefix_routing", &o);
        assert_eq!(a, b, "{router}");
        assert!(
            a.1.contains(",7,0,true,"),
            "{router}: the replica column is filled"
        );
    }
}

/// `sim run` streams its rows into the run directory as requests end; the files are the
/// ones a run kept in memory would write (requests in id order), for a routed run whose
/// requests finish far out of order too.
#[test]
fn streamed_run_directories_match_collected_rows() {
    let cases: [(&str, &[&str]); 2] = [
        ("chunked_prefill", &[]),
        (
            "kubeai_prefix_routing",
            &[
                "workload.num_requests=300",
                "workload.conversations.count=30",
            ],
        ),
    ];
    for (name, overrides) in cases {
        let setup = common::setup(name, overrides);
        let (want, rows) = infer_sim::run_collect(&setup).unwrap();
        let dir = std::env::temp_dir().join(format!("infer-stream-{name}-{}", std::process::id()));
        let mut files = infer_reports::RunDirWriter::create(&dir).unwrap();
        let tokenizer = infer_sim::simulate::approx_tokenizer(&setup);
        let got = infer_sim::run_with(&setup, tokenizer, &mut files).unwrap();
        let info = infer_reports::RunInfo::new("sim", &setup.scenario, "test".into());
        files.finish(&got.summary, &info).unwrap();
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        assert_eq!(read("requests.csv"), requests_csv(&rows.records), "{name}");
        assert_eq!(
            read("timeseries.csv"),
            timeseries_csv(&rows.timeseries),
            "{name}"
        );
        assert_eq!(
            read("summary.json"),
            serde_json::to_string_pretty(&want.summary).unwrap() + "\n"
        );
        let ids: Vec<u64> = rows.records.iter().map(|r| r.id).collect();
        assert_eq!(ids, (0..ids.len() as u64).collect::<Vec<_>>(), "{name}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
