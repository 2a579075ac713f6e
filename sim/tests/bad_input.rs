//! Wrong input is refused with the file, the key and the numbers.

mod common;

fn err(name: &str, overrides: &[&str]) -> String {
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    match infer_sim::load(&common::path(name), &o) {
        Ok(_) => panic!("{overrides:?} was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unknown_hardware_and_models_list_the_valid_names() {
    let e = err("baseline", &["server.hardware=tpu-v5"]);
    assert!(
        e.contains("baseline.toml") && e.contains("server.hardware"),
        "{e}"
    );
    assert!(
        e.contains("tpu-v5") && e.contains("rtx-5080, l4, a100-80gb, h100-80gb, h200"),
        "{e}"
    );
    let e = err("baseline", &["server.model=llama-9"]);
    assert!(
        e.contains("server.model") && e.contains("qwen3-4b") && e.contains("llama-3.1-70b"),
        "{e}"
    );
}

#[test]
fn a_kv_pool_too_small_for_one_sequence_is_rejected_with_numbers() {
    let e = err("baseline", &["server.num_gpu_blocks=128"]);
    assert!(
        e.contains("128 blocks x 16 tokens = 2048 tokens") && e.contains("4096"),
        "{e}"
    );
    let e = err(
        "baseline",
        &["server.model=llama-3.1-70b", "server.hardware=l4"],
    );
    assert!(e.contains("does not fit") && e.contains("GiB"), "{e}");
}

#[test]
fn file_and_sim_table_errors_are_named() {
    let e = infer_sim::load("/nonexistent/x.toml", &[]).err().unwrap();
    assert!(
        matches!(&e, infer_sim::SimError::File(f)
            if f.path.as_os_str() == "/nonexistent/x.toml" && f.action == "read"),
        "{e}"
    );
    let e = err("baseline", &["sim.warp_factor=9"]);
    assert!(
        e.contains("sim.warp_factor") && e.contains("unknown key"),
        "{e}"
    );
    // A known mechanism key with a value it does not take names the values it does.
    let e = err("baseline", &["sim.contiguous_decode=\"sideways\""]);
    assert!(
        e.contains("sim.contiguous_decode") && e.contains("`ragged` or `padded`"),
        "{e}"
    );
    let e = err(
        "baseline",
        &["sim.cost_model=profiled", "sim.profile=/nonexistent/p.json"],
    );
    assert!(
        e.contains("sim.profile") && e.contains("/nonexistent/p.json"),
        "{e}"
    );
    let e = err("baseline", &["server.max_batch_size=0"]);
    assert!(e.contains("server.max_batch_size"), "{e}");
}

#[test]
fn a_profile_file_drives_the_profiled_model() {
    // Steps of a made-up GPU: 5 ms + 50 us per prompt token + 0.3 ms per decode.
    let mut points = Vec::new();
    for p in [0usize, 64, 256, 512] {
        for d in [0usize, 1, 4, 16] {
            if p + d == 0 {
                continue;
            }
            let c = p + d * 300;
            points.push(serde_json::json!({
                "prefill_tokens": p, "decode_seqs": d, "context_tokens": c,
                "step_s": 0.005 + 50e-6 * p as f64 + 0.3e-3 * d as f64
            }));
        }
    }
    let profile = serde_json::json!({ "model": "llama-3.2-3b", "device": "rtx-5080", "points": points,
        "client": { "request_s": 0.0, "stream_s": 0.0 } });
    let dir = std::env::temp_dir().join(format!("infer-sim-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("profile.json");
    std::fs::write(&file, profile.to_string()).unwrap();
    let set = format!("sim.profile={}", file.display());
    let r = common::run("baseline", &["sim.cost_model=profiled", &set]);
    // Sequential 256-token prompts: TTFT = one 256-token step, ITL = one 1-decode step.
    let ttft = 0.005 + 50e-6 * 256.0;
    assert!(
        (r.summary.ttft.median - ttft).abs() < 1e-4,
        "{}",
        r.summary.ttft.median
    );
    assert!(
        (r.summary.itl.median - 0.0053).abs() < 1e-4,
        "{}",
        r.summary.itl.median
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The bad-scenario catalogue: at least 70 wrong values over every section, each refused
/// before anything runs with the file and the key in the message (no panic, no run that
/// eats the machine's memory).
#[test]
fn every_bad_scenario_of_the_catalogue_is_refused_naming_file_and_key() {
    // (scenario, override, the key the error must name)
    let cases: &[(&str, &str, &str)] = &[
        // [workload]
        (
            "baseline",
            "workload.num_requests=0",
            "workload.num_requests",
        ),
        (
            "baseline",
            "workload.num_requests=-5",
            "workload.num_requests",
        ),
        (
            "baseline",
            "workload.num_requests=\"ten\"",
            "workload.num_requests",
        ),
        (
            "baseline",
            "workload.num_requests=1.5",
            "workload.num_requests",
        ),
        (
            "baseline",
            "workload.warmup_requests=10",
            "workload.warmup_requests",
        ),
        (
            "baseline",
            "workload.warmup_requests=-1",
            "workload.warmup_requests",
        ),
        ("baseline", "workload.seed=-1", "workload.seed"),
        // 256 + 3,900 tokens past a 4,096-token context: every request refused.
        (
            "baseline",
            "workload.output_tokens=3900",
            "workload.output_tokens",
        ),
        (
            "baseline",
            "workload.seed=\"18446744073709551616\"",
            "workload.seed",
        ),
        ("cluster_cpu", "cluster.replicas=100000", "cluster.replicas"),
        (
            "baseline",
            "server.max_model_len=100000000",
            "server.max_model_len",
        ),
        ("baseline", "server.max_model_len=0", "server.max_model_len"),
        (
            "baseline",
            "sim.client_request_s=1e300",
            "sim.client_request_s",
        ),
        ("baseline", "workload.seed=\"x\"", "workload.seed"),
        (
            "baseline",
            "workload.prompt_tokens=0",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens=-3",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens=10000000000",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens=4096",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens=\"long\"",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={uniform=[10]}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={uniform=[50,10]}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={uniform=[-1,10]}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={lognormal={median=100,sigma=60}}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={lognormal={median=-1,sigma=1,max=100}}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={normal={mean=100,std=-1,max=200}}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={normal={mean=100,std=10,min=50,max=20}}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={normal={mean=100,std=10,spread=3}}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={zipf={s=1}}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={uniform=[1,2],fixed=3}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={mix=[]}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={mix=[{fixed=10}]}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.prompt_tokens={mix=[{weight=0,fixed=10}]}",
            "workload.prompt_tokens",
        ),
        (
            "baseline",
            "workload.output_tokens=0",
            "workload.output_tokens",
        ),
        (
            "baseline",
            "workload.output_tokens=10000000000",
            "workload.output_tokens",
        ),
        (
            "baseline",
            "workload.output_tokens={lognormal={median=100,sigma=2}}",
            "workload.output_tokens",
        ),
        (
            "baseline",
            "workload.ignore_eos=\"yes\"",
            "workload.ignore_eos",
        ),
        (
            "baseline",
            "workload.shared_prefix_tokens=10000000000",
            "workload.shared_prefix_tokens",
        ),
        (
            "baseline",
            "workload.shared_prefix_tokens=4096",
            "workload.shared_prefix_tokens",
        ),
        (
            "baseline",
            "workload.shared_prefix_tokens=-1",
            "workload.shared_prefix_tokens",
        ),
        (
            "baseline",
            "workload.groups={count=0,prompts_per_group=2,system_tokens=10}",
            "workload.groups",
        ),
        (
            "baseline",
            "workload.groups={count=2,prompts_per_group=0,system_tokens=10}",
            "workload.groups",
        ),
        (
            "baseline",
            "workload.groups={count=2,prompts_per_group=2,system_tokens=5000}",
            "workload.groups",
        ),
        (
            "baseline",
            "workload.conversations={count=0,min_turns=2}",
            "workload.conversations",
        ),
        (
            "baseline",
            "workload.conversations={count=5,min_turns=4,max_turns=2}",
            "workload.conversations",
        ),
        (
            "baseline",
            "workload.conversations={count=5,min_turns=0}",
            "workload.conversations",
        ),
        ("baseline", "workload.colour=\"blue\"", "workload.colour"),
        // [arrival]
        ("baseline", "arrival.kind=\"teleport\"", "arrival.kind"),
        ("baseline", "arrival.kind=\"poisson\"", "arrival.rate"),
        ("baseline", "arrival.kind=5", "arrival.kind"),
        ("chunked_prefill", "arrival.rate=0", "arrival.rate"),
        ("chunked_prefill", "arrival.rate=-2", "arrival.rate"),
        ("chunked_prefill", "arrival.rate=\"fast\"", "arrival.rate"),
        (
            "chunked_prefill",
            "arrival.burstiness=0",
            "arrival.burstiness",
        ),
        (
            "chunked_prefill",
            "arrival.burstiness=-1",
            "arrival.burstiness",
        ),
        (
            "chunked_prefill",
            "arrival.max_concurrency=0",
            "arrival.max_concurrency",
        ),
        (
            "chunked_prefill",
            "arrival.max_concurrency=-4",
            "arrival.max_concurrency",
        ),
        (
            "baseline",
            "arrival.kind=\"concurrency\"",
            "arrival.max_concurrency",
        ),
        ("baseline", "arrival.kind=\"stages\"", "arrival.stages"),
        (
            "baseline",
            "arrival.stages=[{rate=-1,duration_s=10}]",
            "arrival.stages",
        ),
        (
            "baseline",
            "arrival.stages=[{rate=1,duration_s=0}]",
            "arrival.stages",
        ),
        ("baseline", "arrival.stages=[{rate=1}]", "arrival.stages"),
        (
            "baseline",
            "arrival.stages=[{rate=1,duration_s=5,burst=2}]",
            "arrival.stages",
        ),
        ("baseline", "arrival.speed=3", "arrival.speed"),
        // [server]
        ("baseline", "server.model=\"llama-9\"", "server.model"),
        ("baseline", "server.hardware=\"tpu-v5\"", "server.hardware"),
        (
            "baseline",
            "server.batching_mode=\"eager\"",
            "server.batching_mode",
        ),
        (
            "baseline",
            "server.kv_cache_backend=\"magic\"",
            "server.kv_cache_backend",
        ),
        (
            "baseline",
            "server.max_batch_size=0",
            "server.max_batch_size",
        ),
        (
            "baseline",
            "server.max_batch_size=-1",
            "server.max_batch_size",
        ),
        (
            "baseline",
            "server.num_gpu_blocks=0",
            "server.num_gpu_blocks",
        ),
        (
            "baseline",
            "server.num_gpu_blocks=18446744073709551615",
            "server.num_gpu_blocks",
        ),
        ("baseline", "server.block_size=0", "server.block_size"),
        (
            "baseline",
            "server.prefill_chunk_size=0",
            "server.prefill_chunk_size",
        ),
        ("baseline", "server.max_model_len=0", "server.max_model_len"),
        ("baseline", "server.kv_watermark=1.5", "server.kv_watermark"),
        (
            "baseline",
            "server.kv_watermark=-0.1",
            "server.kv_watermark",
        ),
        (
            "baseline",
            "server.chunked_prefill=\"on\"",
            "server.chunked_prefill",
        ),
        (
            "baseline",
            "server.prefix_caching=1",
            "server.prefix_caching",
        ),
        (
            "baseline",
            "server.cuda_graphs=\"no\"",
            "server.cuda_graphs",
        ),
        ("baseline", "server.max_waiting=0", "server.max_waiting"),
        ("baseline", "server.tensor_magic=2", "server.tensor_magic"),
        // [cluster]
        (
            "kubeai_prefix_routing",
            "cluster.replicas=0",
            "cluster.replicas",
        ),
        (
            "kubeai_prefix_routing",
            "cluster.replicas=-2",
            "cluster.replicas",
        ),
        (
            "kubeai_prefix_routing",
            "cluster.router=\"psychic\"",
            "cluster.router",
        ),
        (
            "kubeai_prefix_routing",
            "cluster.metrics_delay_s=-1",
            "cluster.metrics_delay_s",
        ),
        ("kubeai_prefix_routing", "cluster.zones=3", "cluster.zones"),
        // [sim]
        ("baseline", "sim.cost_model=\"oracle\"", "sim.cost_model"),
        ("baseline", "sim.cost_model=\"profiled\"", "sim.profile"),
        (
            "baseline",
            "sim.timeseries_interval_s=1e-12",
            "sim.timeseries_interval_s",
        ),
        (
            "baseline",
            "sim.timeseries_interval_s=0",
            "sim.timeseries_interval_s",
        ),
        (
            "baseline",
            "sim.compute_efficiency=0",
            "sim.compute_efficiency",
        ),
        (
            "baseline",
            "sim.compute_efficiency=1.5",
            "sim.compute_efficiency",
        ),
        (
            "baseline",
            "sim.bandwidth_efficiency=-0.2",
            "sim.bandwidth_efficiency",
        ),
        ("baseline", "sim.step_overhead_s=-1", "sim.step_overhead_s"),
        (
            "baseline",
            "sim.per_seq_overhead_s=\"slow\"",
            "sim.per_seq_overhead_s",
        ),
        (
            "baseline",
            "sim.client_stream_s=-0.5",
            "sim.client_stream_s",
        ),
        ("baseline", "sim.warp_factor=9", "sim.warp_factor"),
        (
            "baseline",
            "sim.contiguous_decode=\"sideways\"",
            "sim.contiguous_decode",
        ),
        // [slo]
        ("baseline", "slo.ttft_ms=0", "slo.ttft_ms"),
        ("baseline", "slo.tpot_ms=-5", "slo.tpot_ms"),
        ("baseline", "slo.e2el_ms=\"fast\"", "slo.e2el_ms"),
        ("baseline", "slo.itl_ms=5", "slo.itl_ms"),
        ("baseline", "slo={}", "slo"),
        // Override syntax.
        ("baseline", "server.max_batch_size", "server.max_batch_size"),
        (
            "baseline",
            "server..max_batch_size=2",
            "server..max_batch_size",
        ),
        (
            "baseline",
            "server.max_batch_size=[1,",
            "server.max_batch_size",
        ),
        ("baseline", "=3", "=3"),
    ];
    let mut refused = 0;
    for &(name, set, key) in cases {
        let e = err(name, &[set]);
        let file = format!("{name}.toml");
        assert!(e.contains(&file) && e.contains(key), "{set}: {e}");
        refused += 1;
    }
    // Syntax errors in the file itself: the line and column.
    let base = std::fs::read_to_string(common::path("baseline")).unwrap();
    let broken = [
        base.replace("num_requests = 10", "num_requests = "),
        base.replace("[server]", "[server"),
        base.replace("seed = 42", "seed = 42 42"),
        base.replace("kind = \"sequential\"", "kind = \"sequential"),
        base.replace("block_size = 16", "block_size = 16\nblock_size = 32"),
    ];
    for text in &broken {
        let e = infer_core::workload::Scenario::parse("broken.toml", text, &[])
            .expect_err("refused")
            .to_string();
        assert!(e.contains("broken.toml") && e.contains("line"), "{e}");
        refused += 1;
    }
    let total = cases.len() + broken.len();
    assert!(total >= 70, "{total} cases");
    println!("reliability: simulator bad input: {refused} of {total} scenarios refused naming file and key");
}

/// A scratch directory for this test process.
fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("infer-bad-input-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A `requests`-format trace replayed by the trace_replay scenario.
fn trace_overrides(dir: &std::path::Path, rows: &str, time_scale: &str) -> Vec<String> {
    let path = dir.join("trace.csv");
    std::fs::write(
        &path,
        format!("start_s,prompt_tokens,output_tokens\n{rows}"),
    )
    .unwrap();
    vec![
        format!(
            "workload.trace={{path=\"{}\",format=\"requests\",time_scale={time_scale}}}",
            path.display()
        ),
        format!("workload.num_requests={}", rows.lines().count()),
    ]
}

fn trace_err(dir: &std::path::Path, rows: &str, time_scale: &str) -> String {
    match infer_sim::load(
        &common::path("trace_replay"),
        &trace_overrides(dir, rows, time_scale),
    ) {
        Ok(_) => panic!("{rows} at time_scale {time_scale} was accepted"),
        Err(e) => e.to_string(),
    }
}

/// Inputs the simulator accepted and then ran for ever, writing timeseries rows by the
/// gigabyte (issue 40): each is now refused before the run, naming the key, or ends within
/// its bounds.
#[test]
fn inputs_that_never_ended_are_refused_or_bounded() {
    // An arrival schedule that alone outlasts sim.max_simulated_s (30 days by default).
    for rate in ["1e-12", "5e-324"] {
        let e = err(
            "baseline",
            &["arrival.kind=\"poisson\"", &format!("arrival.rate={rate}")],
        );
        assert!(
            e.contains("arrival.rate") && e.contains("sim.max_simulated_s"),
            "{rate}: {e}"
        );
    }
    // A step pause that stalls the clock.
    let e = err("baseline", &["sim.step_jitter_s=1e300"]);
    assert!(e.contains("sim.step_jitter_s") && e.contains("60"), "{e}");
    // Trace times far apart, written or scaled.
    let dir = scratch("trace-times");
    let e = trace_err(&dir, "0,10,10\n1e300,10,10\n", "1.0");
    assert!(
        e.contains("workload.trace") && e.contains("sim.max_simulated_s"),
        "{e}"
    );
    let e = trace_err(&dir, "0,10,10\n1,10,10\n2,10,10\n", "1e12");
    assert!(
        e.contains("workload.trace") && e.contains("sim.max_simulated_s"),
        "{e}"
    );
    // A row whose prompt alone would be 40 GB of token ids.
    let e = trace_err(&dir, "0,10000000000,10\n", "1.0");
    assert!(e.contains("line 2") && e.contains("at most"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();

    // At run time, where nothing could be checked before (a closed loop): the clock's bound.
    let setup = common::setup("baseline", &["sim.max_simulated_s=1"]);
    let e = infer_sim::run(&setup).unwrap_err().to_string();
    assert!(
        e.contains("baseline.toml") && e.contains("sim.max_simulated_s"),
        "{e}"
    );

    // A long idle stretch within the bound: the rows follow what happens, not the clock
    // (three requests over about 20,000 s were 200,000 rows of an idle server).
    let setup = common::setup(
        "baseline",
        &[
            "workload.num_requests=3",
            "workload.output_tokens=4",
            "arrival.kind=\"poisson\"",
            "arrival.rate=1e-4",
        ],
    );
    let (r, rows) = infer_sim::run_collect(&setup).unwrap();
    assert_eq!(r.summary.completed, 3);
    assert!(r.summary.duration > 1000.0, "{}", r.summary.duration);
    assert!(
        rows.timeseries.len() < 100,
        "{} rows",
        rows.timeseries.len()
    );
    // The means still count the idle time: KV use over the run is almost nothing.
    assert!(r.stats.mean_kv_usage < 0.01, "{}", r.stats.mean_kv_usage);
}

/// Memory past `sim.max_memory_mib` ends the run with an error naming it, never an abort.
#[cfg(target_os = "linux")]
#[test]
fn memory_past_its_bound_ends_the_run_naming_the_key() {
    let setup = common::setup(
        "baseline",
        &["sim.max_memory_mib=1", "workload.output_tokens=512"],
    );
    let e = infer_sim::run(&setup).unwrap_err().to_string();
    assert!(e.contains("sim.max_memory_mib") && e.contains("MiB"), "{e}");
}

/// A request whose prompt and max_tokens pass max_model_len fails as the engine's API (and
/// vLLM's) refuses it, with its message, rather than being cut short at the context's end
/// (before, it generated up to the context and counted as a success).
#[test]
fn a_request_past_the_context_fails_as_the_server_refuses_it() {
    let s = common::setup(
        "baseline",
        &[
            "workload.prompt_tokens=3000",
            "workload.output_tokens={ uniform = [10, 2000] }",
            "workload.num_requests=10",
            "workload.warmup_requests=0",
        ],
    );
    let (r, rows) = infer_sim::run_collect(&s).unwrap();
    assert!(
        r.summary.failed > 0 && r.summary.completed > 0,
        "{:?}",
        r.summary
    );
    for rec in &rows.records {
        match &rec.error {
            Some(e) => assert!(
                e.contains("maximum context length is 4096 tokens, but you requested"),
                "{e}"
            ),
            None => assert!(rec.prompt_tokens + rec.output_tokens <= 4096),
        }
    }
    // And `sim run` says why, with the first such request's message.
    let first = rows.records.iter().find(|r| r.error.is_some()).unwrap();
    let printed = infer_sim::output::console(&s, &r, None);
    let line = printed
        .lines()
        .find(|l| l.starts_with(&format!("failed: {} of 10 requests", r.summary.failed)))
        .unwrap_or_else(|| panic!("{printed}"));
    assert!(line.ends_with(first.error.as_deref().unwrap()), "{line}");
}
