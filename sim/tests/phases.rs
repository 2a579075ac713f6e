//! The benchmark log's phase effects, predicted with the RTX 5080 calibration. Each test
//! states its threshold; the published change is quoted beside it.

mod common;

use common::{phase_config, run_owned, with, SEED_MODELS};
#[test]
fn baseline_reproduces_the_calibration_rows() {
    // The log's Phase 5 baseline rows (TTFT P50, ITL P50), which the shipped calibration
    // was fitted to among 154 figures. Threshold: within 15% — a single row of a
    // compromise fit (Llama's ITL: 12.3 ms for the 11 ms published; the same single-request
    // decode is published at 12 ms in Phases 6-8: the log's own spread is ~9%).
    for (model, ttft, itl) in [
        ("llama-3.2-3b", 0.035, 0.011),
        ("qwen3-4b", 0.043, 0.015),
        ("gemma-3-1b", 0.025, 0.011),
    ] {
        let r = run_owned("baseline", &phase_config(model, "baseline"));
        let s = &r.summary;
        let ttft_err = (s.ttft.median - ttft).abs() / ttft;
        let itl_err = (s.itl.median - itl).abs() / itl;
        assert!(
            ttft_err < 0.15 && itl_err < 0.15,
            "{model}: TTFT {} ITL {}",
            s.ttft.median,
            s.itl.median
        );
        assert_eq!(s.completed, 10);
    }
}

#[test]
fn continuous_batching_lowers_ttft() {
    // Phase 4 → 5 on continuous_batching (contiguous KV, batch 8): TTFT P50 −30…−55%
    // (Gemma3 −30%, Qwen3 −45%, Llama −55%). Threshold: continuous at most 0.7 × static
    // for every model, the smallest published change.
    let phase5 = [
        "server.kv_cache_backend=contiguous",
        "server.max_batch_size=8",
        "server.chunked_prefill=false",
        "server.prefix_caching=false",
    ];
    for m in SEED_MODELS {
        let base = with(&[format!("server.model={m}")], &phase5);
        let cont = run_owned("continuous_batching", &base);
        let stat = run_owned(
            "continuous_batching",
            &with(&base, &["server.batching_mode=static"]),
        );
        let (c, s) = (cont.summary.ttft.median, stat.summary.ttft.median);
        assert!(c <= 0.7 * s, "{m}: continuous {c:.3}s vs static {s:.3}s");
    }
}

#[test]
fn paged_kv_raises_throughput_at_the_same_budget() {
    // Phase 5 → 6 on paged_attention: contiguous batch 8 → paged (24, or 16 for Qwen3):
    // +17…+32% output throughput over Phase 4. Threshold: at least +10% for every model.
    for m in SEED_MODELS {
        let paged = with(
            &phase_config(m, "paged_attention"),
            &[
                "server.chunked_prefill=false",
                "server.prefix_caching=false",
            ],
        );
        let contiguous = with(
            &paged,
            &[
                "server.kv_cache_backend=contiguous",
                "server.max_batch_size=8",
                "server.num_gpu_blocks=2048",
            ],
        );
        let p = run_owned("paged_attention", &paged)
            .summary
            .output_throughput;
        let c = run_owned("paged_attention", &contiguous)
            .summary
            .output_throughput;
        assert!(
            p >= 1.1 * c,
            "{m}: paged {p:.1} tok/s vs contiguous {c:.1} tok/s"
        );
    }
}

#[test]
fn chunked_prefill_cuts_the_itl_tail_severalfold() {
    // Phase 6 → 7 on chunked_prefill: ITL P99 1562 → 209 ms (Llama), 2203 → 207 (Qwen3).
    // Threshold: at least 3x lower for Llama and Qwen3.
    for m in ["llama-3.2-3b", "qwen3-4b"] {
        let chunked = with(
            &phase_config(m, "chunked_prefill"),
            &["server.prefix_caching=false"],
        );
        let whole = with(&chunked, &["server.chunked_prefill=false"]);
        let c = run_owned("chunked_prefill", &chunked).summary.itl.p99;
        let w = run_owned("chunked_prefill", &whole).summary.itl.p99;
        assert!(
            w >= 3.0 * c,
            "{m}: ITL P99 unchunked {w:.3}s vs chunked {c:.3}s"
        );
    }
}

#[test]
fn prefix_caching_lowers_ttft() {
    // Phase 7 → 8 on prefix_caching: TTFT P50 −28% (Llama), −12% (Qwen3), −7% (Gemma3).
    // Threshold: at least −10% for every model, and most prompt tokens hit.
    for m in SEED_MODELS {
        let on = phase_config(m, "prefix_caching");
        let off = with(&on, &["server.prefix_caching=false"]);
        let hit = run_owned("prefix_caching", &on);
        let miss = run_owned("prefix_caching", &off);
        let (a, b) = (hit.summary.ttft.median, miss.summary.ttft.median);
        assert!(
            a <= 0.9 * b,
            "{m}: TTFT P50 cached {a:.3}s vs uncached {b:.3}s"
        );
        assert!(
            hit.summary.prefix_cache_hit_rate > 0.8,
            "{m}: hit rate {}",
            hit.summary.prefix_cache_hit_rate
        );
        assert_eq!(miss.summary.prefix_cache_hit_rate, 0.0);
    }
}

#[test]
fn the_qwen3_vram_cliff_is_not_silent() {
    // Phase 6 tuning: Qwen3-4B at batch 24 / 2048 blocks collapsed 3x; 16 / 1024 was fine.
    let o = [
        "server.model=qwen3-4b",
        "server.chunked_prefill=false",
        "server.prefix_caching=false",
    ];
    let cliff = common::setup("paged_attention", &o);
    assert!(
        cliff.warnings.iter().any(|w| w.contains("over-committed")),
        "{:?}",
        cliff.warnings
    );
    let tuned: Vec<&str> = o
        .iter()
        .copied()
        .chain(["server.max_batch_size=16", "server.num_gpu_blocks=1024"])
        .collect();
    assert!(common::setup("paged_attention", &tuned).warnings.is_empty());
}

#[test]
fn the_shipped_calibration_predicts_the_held_out_phases_within_a_quarter() {
    // The shipped RTX 5080 calibration was fitted to the log's Phases 4–5 only; over the
    // held-out Phases 6–8 (three models, five workloads) the median |error| of every
    // figure must stay within 25% (issue target; `log_check` prints the table).
    use infer_sim::calibration::CalibrationFile;
    use infer_sim::fit;
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/calibrations");
    let mut targets = fit::load_published(&format!("{dir}/rtx5080-benchmark-log.toml")).unwrap();
    // 75 phase runs and the four runs of Phase 6's batch-size sweep on Qwen3.
    assert_eq!(targets.len(), 79);
    let name = format!("{dir}/rtx5080-seed-server.toml");
    let file = CalibrationFile::parse(&name, &std::fs::read_to_string(&name).unwrap()).unwrap();
    let rows = fit::rows(&mut targets, &fit::Fit::of_file(&file));
    for (metric, e) in fit::median_errors(&rows, true) {
        let e = e.unwrap();
        assert!(
            e <= 25.0,
            "{metric}: median |error| {e:.1}% over Phases 6-8"
        );
    }
    // The log's largest phase effect, held out: Phase 6 collapsed on chunked_prefill for
    // Llama and Qwen3 and Phase 7's chunking brought it back (+875% and +782% throughput,
    // -93% ITL P50). Predicted with the right sign and within a factor of two of the change
    // (Llama's throughput: +652% for +875%; `log_check` prints every effect).
    let figure = |label: &str, metric: &str| {
        let r = rows
            .iter()
            .find(|r| r.label == label && r.metric == metric)
            .unwrap_or_else(|| panic!("{label} {metric}"));
        (r.measured, r.predicted)
    };
    for model in ["llama-3.2-3b", "qwen3-4b"] {
        for metric in ["output_throughput", "median_itl_ms"] {
            let (m6, p6) = figure(&format!("P6 chunked_prefill {model}"), metric);
            let (m7, p7) = figure(&format!("P7 chunked_prefill {model}"), metric);
            let (published, predicted) = (m7 / m6 - 1.0, p7 / p6 - 1.0);
            assert!(
                (0.5..=2.0).contains(&(predicted / published)),
                "{model} {metric}: P7 vs P6 published {:+.0}%, predicted {:+.0}%",
                published * 100.0,
                predicted * 100.0
            );
        }
    }
}

#[test]
fn the_logs_cuda_graph_slowdown_is_predicted_from_its_replay_profile() {
    // Phase 9 turned on CUDA graphs and every low-concurrency run got slower: the log's
    // Triton kernels replayed ~2x slower inside graphs (its profile: 17.9 vs 10.0 ms at
    // batch 1, 31.6 vs 12.9 ms at batch 8). The shipped calibration takes its
    // graph_replay_factor from that profile, not from Phase 9's tables, which stay held
    // out: their median |error| within 25%, the baseline's throughput drop (-38%, -35%,
    // -42%) predicted as a drop for every model, and the long-context break-even (Llama's
    // chunked_prefill and prefix_caching: -2% and 0%) as a change within 5%: the replay
    // spares the decode attention that long contexts spend their steps in.
    use infer_sim::calibration::CalibrationFile;
    use infer_sim::fit;
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/calibrations");
    let mut targets = fit::load_published(&format!("{dir}/rtx5080-benchmark-log.toml")).unwrap();
    targets
        .extend(fit::load_published(&format!("{dir}/rtx5080-benchmark-log-phase9.toml")).unwrap());
    let name = format!("{dir}/rtx5080-seed-server.toml");
    let file = CalibrationFile::parse(&name, &std::fs::read_to_string(&name).unwrap()).unwrap();
    let rows = fit::rows(&mut targets, &fit::Fit::of_file(&file));
    let phase9: Vec<fit::Row> = rows
        .iter()
        .filter(|r| r.label.starts_with("P9 "))
        .cloned()
        .collect();
    assert_eq!(phase9.len(), 75, "15 runs x 5 figures");
    for (metric, e) in fit::median_errors(&phase9, true) {
        let e = e.unwrap();
        assert!(e <= 25.0, "{metric}: median |error| {e:.1}% over Phase 9");
    }
    let predicted = |label: &str| {
        rows.iter()
            .find(|r| r.label == label && r.metric == "output_throughput")
            .unwrap_or_else(|| panic!("{label}"))
            .predicted
    };
    for model in ["llama-3.2-3b", "qwen3-4b", "gemma-3-1b"] {
        let (p8, p9) = (
            predicted(&format!("P8 baseline {model}")),
            predicted(&format!("P9 baseline {model}")),
        );
        assert!(p9 < p8, "{model}: P9 {p9:.1} tok/s, P8 {p8:.1}");
    }
    for workload in ["chunked_prefill", "prefix_caching"] {
        let (p8, p9) = (
            predicted(&format!("P8 {workload} llama-3.2-3b")),
            predicted(&format!("P9 {workload} llama-3.2-3b")),
        );
        assert!(
            (p9 / p8 - 1.0).abs() < 0.05,
            "{workload}: P9 {p9:.1} tok/s, P8 {p8:.1}"
        );
    }
}

#[test]
fn the_start_up_plan_bounds_every_steps_activations() {
    // The start-up plan prices the largest step the configuration and the workload allow
    // with the cost model's own bytes (padding, all-position logits, materialised scores),
    // so no step of the run can hold more: checked for the log's Phase 6, 7 and 8 servers on
    // every seed workload, and the Phase 6 chunked_prefill collapse is warned about.
    for model in ["llama-3.2-3b", "qwen3-4b"] {
        for workload in [
            "baseline",
            "continuous_batching",
            "paged_attention",
            "chunked_prefill",
            "prefix_caching",
        ] {
            // Phase 6, 7 and 8 servers: no chunking, chunking, chunking + prefix caching.
            for (chunked, cached) in [("false", "false"), ("true", "false"), ("true", "true")] {
                let o = common::with(
                    &common::phase_config(model, workload),
                    &[
                        &format!("server.chunked_prefill={chunked}"),
                        &format!("server.prefix_caching={cached}"),
                    ],
                );
                let o: Vec<&str> = o.iter().map(String::as_str).collect();
                let setup = common::setup(workload, &o);
                let r = infer_sim::run(&setup).unwrap();
                let (planned, peak) = (setup.memory.activations, r.stats.peak_activation_bytes);
                assert!(
                    peak > 0.0 && peak <= planned,
                    "{model} {workload} chunked={chunked} cached={cached}: peak {peak:.3e} B, planned {planned:.3e} B"
                );
                if workload == "chunked_prefill" && chunked == "false" {
                    assert!(
                        setup.warnings.iter().any(|w| w.contains("over-committed")),
                        "{model}: {:?}",
                        setup.warnings
                    );
                }
            }
        }
    }
}

#[test]
fn a_pool_that_runs_dry_preempts_or_waits_as_the_scenario_says() {
    // Qwen3's Phase 7 on chunked_prefill: 1,024 blocks for 16 sequences of ~1.2k tokens run
    // dry. `recompute` preempts; `wait` keeps the sequences that cannot grow waiting, so it
    // preempts only when every one waits — far less often — and every request still ends.
    let base = with(
        &phase_config("qwen3-4b", "chunked_prefill"),
        &["server.prefix_caching=false"],
    );
    let recompute = common::run_owned("chunked_prefill", &base);
    let wait = common::run_owned(
        "chunked_prefill",
        &with(&base, &["server.kv_preemption=wait"]),
    );
    assert!(
        recompute.stats.preemptions > 20,
        "{}",
        recompute.stats.lines()
    );
    assert_eq!(recompute.stats.kv_waits, 0);
    assert!(wait.stats.kv_waits > 0, "{}", wait.stats.lines());
    assert!(
        wait.stats.preemptions * 4 < recompute.stats.preemptions,
        "wait {} vs recompute {}",
        wait.stats.lines(),
        recompute.stats.lines()
    );
    assert_eq!(wait.summary.completed, recompute.summary.completed);
}
