//! `sim plan`: the command end to end, its refusals, and capacity moving the obvious way
//! (more replicas or looser objectives never lower it).

mod common;

use std::process::{Command, Output};

use infer_core::metrics::Slo;
use infer_sim::plan::{self, Base, Configuration, PlanSpec};
use proptest::prelude::*;

fn sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(args)
        .output()
        .unwrap()
}

fn tmp(name: &str) -> String {
    let d = std::env::temp_dir().join(format!("infer-sim-plan-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d.display().to_string()
}

/// The shipped CPU plan: eight configurations from its `[plan]` table, each with a
/// capacity, the best one named and holding the SLO, files byte-identical on a second run.
#[test]
fn the_cpu_plan_ranks_eight_configurations_and_is_deterministic() {
    let scenario = common::path("plan_cpu");
    let (a, b) = (tmp("a"), tmp("b"));
    let mut csv = Vec::new();
    for out in [&a, &b] {
        let o = sim(&[
            "plan",
            &scenario,
            "--capacity",
            // Short searches for a debug build (the shipped plan's default is 1,000).
            "--set",
            "plan.sustained_requests=128",
            "--out",
            out,
            "--quiet",
        ]);
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(stdout.contains("8 configurations"), "{stdout}");
        assert!(stdout.contains("best: "), "{stdout}");
        csv.push(std::fs::read_to_string(format!("{out}/plan.csv")).unwrap());
        let md = std::fs::read_to_string(format!("{out}/plan.md")).unwrap();
        assert!(md.contains("## Pareto front"), "{md}");
    }
    assert_eq!(csv[0], csv[1], "the same plan twice differs");
    let rows: Vec<&str> = csv[0].lines().collect();
    assert_eq!(rows.len(), 9, "{}", csv[0]);
    let head: Vec<&str> = rows[0].split(',').collect();
    let col = |name: &str| head.iter().position(|h| *h == name).unwrap();
    let best: Vec<&str> = rows[1..]
        .iter()
        .filter(|r| r.split(',').nth(col("best")) == Some("true"))
        .copied()
        .collect();
    assert_eq!(best.len(), 1, "{}", csv[0]);
    let cells: Vec<&str> = best[0].split(',').collect();
    // The best has the most capacity; every capacity is a rate found (none failed).
    let capacity = |r: &str| -> f64 {
        r.split(',')
            .nth(col("capacity_req_per_s"))
            .unwrap()
            .parse()
            .unwrap()
    };
    let top = capacity(best[0]);
    assert!(rows[1..].iter().all(|r| capacity(r) <= top), "{}", csv[0]);
    assert_eq!(cells[col("meets_slo")], "true");
    // `rank` orders every configuration, the best first, by capacity per GPU.
    assert_eq!(cells[col("rank")], "1");
    let cell =
        |r: &str, name: &str| -> f64 { r.split(',').nth(col(name)).unwrap().parse().unwrap() };
    let mut ranked: Vec<(f64, f64)> = rows[1..]
        .iter()
        .map(|r| (cell(r, "rank"), cell(r, "capacity_per_gpu")))
        .collect();
    ranked.sort_by(|x, y| x.0.total_cmp(&y.0));
    let ranks: Vec<f64> = ranked.iter().map(|r| r.0).collect();
    assert_eq!(ranks, (1..=8).map(f64::from).collect::<Vec<_>>());
    assert!(ranked.windows(2).all(|w| w[0].1 >= w[1].1), "{ranked:?}");
    for dir in [a, b] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// Bad input is refused before anything runs, naming what to fix.
#[test]
fn bad_plans_are_refused_naming_the_key() {
    let scenario = common::path("plan_cpu");
    let chunked = common::path("chunked_prefill");
    let dir = std::env::temp_dir().join(format!("infer-sim-plan-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let typo = dir.join("typo.toml");
    let text = std::fs::read_to_string(&scenario)
        .unwrap()
        .replace("attainment = 0.9", "atainment = 0.9")
        .replace(
            "../profiles",
            &format!("{}/../profiles", env!("CARGO_MANIFEST_DIR")),
        );
    std::fs::write(&typo, text).unwrap();
    let typo = typo.display().to_string();
    for (args, says) in [
        (
            vec!["plan", &scenario, "--vary", "server.max_bath_size=8,16"],
            "server.max_bath_size",
        ),
        (
            vec!["plan", &scenario, "--vary", "server.max_batch_size=8,abc"],
            "--vary server.max_batch_size=abc",
        ),
        (
            vec!["plan", &scenario, "--vary", "server.max_batch_size="],
            "empty key or value",
        ),
        (vec!["plan", &scenario, "--slo", "500"], "--slo 500: expected METRIC:MS"),
        (vec!["plan", &scenario, "--slo", "p99:500"], "the metric must be ttft"),
        (vec!["plan", &scenario, "--attainment", "1.5"], "--attainment"),
        (vec!["plan", &scenario, "--attainment", "0"], "(0, 1]"),
        (vec!["plan", &chunked], "a plan needs latency objectives"),
        (vec!["plan", &typo], "plan.atainment"),
        (
            vec!["plan", &scenario, "--config", "P1"],
            "--config `P1`: expected NAME:key=value",
        ),
        (
            vec!["plan", &chunked, "--slo", "ttft:500", "--capacity", "--set", "arrival.kind=\"burst\""],
            "a capacity search varies the arrival rate",
        ),
        (
            vec!["plan", &scenario, "--target-rate", "8"],
            "needs a [cluster] table",
        ),
        (
            vec![
                "plan",
                &scenario,
                "--vary",
                "server.max_batch_size=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50",
                "--vary",
                "server.prefill_chunk_size=16,32,48,64,80,96,112,128,144,160,176,192,208,224,240,256,272,288,304,320,336,352,368,384,400,416,432,448,464,480,496,512,528,544,560,576,592,608,624,640,656,672,688,704,720,736,752,768,784,800",
                "--vary",
                "server.block_size=16,32,48,64,80,96,112,128,144,160,176,192,208,224,240,256,272,288,304,320,336,352,368,384,400,416,432,448,464,480,496,512,528,544,560,576,592,608,624,640,656,672,688,704,720,736,752,768,784,800",
            ],
            "more than 100000",
        ),
    ] {
        let o = sim(&args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

fn spec(ttft_ms: f64, tpot_ms: f64) -> PlanSpec {
    PlanSpec {
        slo: Slo {
            ttft_ms: Some(ttft_ms),
            tpot_ms: Some(tpot_ms),
            e2el_ms: None,
        },
        attainment: 0.9,
        axes: Vec::new(),
        configs: Vec::new(),
        capacity: true,
        target_rate: None,
        // Short searches: each case runs a few dozen simulations in a debug build.
        sustained_requests: 64,
    }
}

/// The capacity of the CPU plan's workload on `replicas` replicas (round robin), with the
/// server settings `settings`.
fn capacity(spec: &PlanSpec, replicas: usize, settings: &[String]) -> f64 {
    let file = common::path("plan_cpu");
    let text = std::fs::read_to_string(&file).unwrap();
    let overrides = vec![
        format!("slo.ttft_ms={:?}", spec.slo.ttft_ms.unwrap()),
        format!("slo.tpot_ms={:?}", spec.slo.tpot_ms.unwrap()),
        // Fewer requests than the shipped plan: each case runs a few dozen simulations.
        "workload.num_requests=32".to_string(),
        format!("cluster.replicas={replicas}"),
        "cluster.router=\"round-robin\"".to_string(),
    ];
    let base = Base {
        file: &file,
        text: &text,
        overrides: &overrides,
    };
    let c = Configuration {
        name: "case".into(),
        config: String::new(),
        assignment: Vec::new(),
        settings: settings.to_vec(),
    };
    let e = plan::evaluate(&base, spec, &c).unwrap_or_else(|e| panic!("{settings:?}: {e}"));
    e.capacity.unwrap().rate
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    /// More replicas never lower capacity, and looser objectives never lower it.
    #[test]
    fn capacity_is_monotone_in_replicas_and_objectives(
        batch in prop::sample::select(vec![2usize, 4, 8, 16]),
        chunk in prop::sample::select(vec![64usize, 128, 512]),
        prefix in any::<bool>(),
        ttft in 100.0f64..1000.0,
        tpot in 3.0f64..30.0,
        looser in 1.0f64..3.0,
    ) {
        let settings = vec![
            format!("server.max_batch_size={batch}"),
            format!("server.prefill_chunk_size={chunk}"),
            format!("server.prefix_caching={prefix}"),
        ];
        let tight = spec(ttft, tpot);
        let one = capacity(&tight, 1, &settings);
        let two = capacity(&tight, 2, &settings);
        prop_assert!(two >= one, "1 replica: {one} req/s, 2 replicas: {two} req/s");
        let loose = capacity(&spec(ttft * looser, tpot * looser), 1, &settings);
        prop_assert!(loose >= one, "tight: {one} req/s, {looser}x looser: {loose} req/s");
    }
}

/// A plan says which of its configurations rest on fragile predictions.
#[test]
fn a_plan_names_the_warnings_of_its_configurations() {
    let scenario = common::path("plan_cpu");
    let out = tmp("warnings");
    let o = sim(&[
        "plan",
        &scenario,
        "--vary",
        "server.max_batch_size=16,64",
        "--out",
        &out,
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}");
    assert!(
        stdout.contains("warning: extrapolation: the decode batch can reach 64")
            && stdout.contains("(1 of 2 configurations)"),
        "{stdout}"
    );
    let md = std::fs::read_to_string(format!("{out}/plan.md")).unwrap();
    assert!(md.contains("the cost model extrapolates there"), "{md}");
    std::fs::remove_dir_all(out).unwrap();
}

/// A replica of a tensor-parallel model takes its degree in GPUs: the catalog's 70B (tp 4)
/// on 2 replicas is 8 GPUs, and its goodput per GPU a quarter of one replica's (before, a
/// plan counted one GPU a replica and ranked a 70B above an 8B on per-GPU figures 4x too
/// high).
#[test]
fn a_tensor_parallel_replica_counts_its_gpus() {
    let file = common::path("chunked_prefill");
    let text = std::fs::read_to_string(&file).unwrap();
    let overrides = vec![
        "server.hardware=\"h100-80gb\"".to_string(),
        "workload.num_requests=16".to_string(),
        "cluster.replicas=2".to_string(),
        "cluster.router=\"round-robin\"".to_string(),
    ];
    let base = Base {
        file: &file,
        text: &text,
        overrides: &overrides,
    };
    let mut spec = spec(2000.0, 100.0);
    spec.capacity = false;
    let gpus = |model: &str| {
        let c = Configuration {
            name: model.into(),
            config: String::new(),
            assignment: Vec::new(),
            settings: vec![format!("server.model=\"{model}\"")],
        };
        let e = plan::evaluate(&base, &spec, &c).unwrap_or_else(|e| panic!("{model}: {e}"));
        assert!(
            (e.goodput_per_gpu() * e.figures.gpus as f64 - e.figures.goodput).abs() < 1e-9,
            "{model}"
        );
        e.figures.gpus
    };
    assert_eq!(gpus("llama-3.1-70b"), 8);
    assert_eq!(gpus("llama-3.1-8b"), 2);
}
