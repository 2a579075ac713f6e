//! Wrong input is refused with the file, the key and the numbers.

mod common;

fn err(name: &str, overrides: &[&str]) -> String {
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    match infer_sim::load(&common::path(name), &o) {
        Ok(_) => panic!("{overrides:?} was accepted"),
        Err(e) => e,
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
        e.contains("/nonexistent/x.toml") && e.contains("cannot read"),
        "{e}"
    );
    let e = err("baseline", &["sim.warp_factor=9"]);
    assert!(
        e.contains("sim.warp_factor") && e.contains("unknown key"),
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
