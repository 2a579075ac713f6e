//! The `sim` binary end to end: files written, block printed, sweep table and CSV.

mod common;

use std::process::Command;

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("infer-sim-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn run_writes_the_three_files_and_prints_vllms_block() {
    let out = tmp("run");
    let o = Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(["run", &common::path("baseline"), "--seed", "3", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        stdout.contains("Serving Benchmark Result") && stdout.contains("prefix cache"),
        "{stdout}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["completed"], 10);
    assert!(summary["median_ttft_ms"].as_f64().unwrap() > 0.0);
    let req = std::fs::read_to_string(out.join("requests.csv")).unwrap();
    assert!(req.starts_with("id,start_s,ttft_ms"));
    assert_eq!(req.lines().count(), 11);
    let ts = std::fs::read_to_string(out.join("timeseries.csv")).unwrap();
    assert!(ts.starts_with("t_s,replica") && ts.lines().count() > 10);
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn sweep_writes_a_row_per_point() {
    let out = tmp("sweep");
    let o = Command::new(env!("CARGO_BIN_EXE_sim"))
        .args([
            "sweep",
            &common::path("l4_concurrency_sweep"),
            "--vary",
            "arrival.max_concurrency=1,4,16",
        ])
        .args(["--set", "workload.num_requests=48", "--quiet", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let csv = std::fs::read_to_string(out.join("sweep.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows.len(), 4, "{csv}");
    assert!(rows[0].starts_with("arrival.max_concurrency,completed"));
    // Throughput grows with concurrency (the L4 sweep's shape).
    let tput = |r: &str| r.split(',').nth(4).unwrap().parse::<f64>().unwrap();
    assert!(tput(rows[3]) > 3.0 * tput(rows[1]), "{csv}");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn bad_input_exits_non_zero_with_the_reason() {
    let o = Command::new(env!("CARGO_BIN_EXE_sim"))
        .args([
            "run",
            &common::path("baseline"),
            "--set",
            "server.hardware=nope",
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("unknown hardware `nope`") && err.contains("h100-80gb"),
        "{err}"
    );
}

#[test]
fn calibrate_fits_a_run_directory_it_wrote_and_the_file_it_writes_is_used() {
    // A simulated run is a measured run like any other: its directory keeps the scenario,
    // so `sim calibrate` can fit to it; the file it writes is read by a scenario naming it.
    let run = tmp("calibrate-run");
    let o = Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(["run", &common::path("baseline"), "--quiet", "--out"])
        .arg(&run)
        .args([
            "--set",
            "workload.num_requests=4",
            "--set",
            "workload.output_tokens=16",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let scenario = std::fs::read_to_string(run.join("scenario.toml")).unwrap();
    assert!(scenario.contains("num_requests = 4"), "{scenario}");
    let cal = tmp("calibrate-file").with_extension("toml");
    let o = Command::new(env!("CARGO_BIN_EXE_sim"))
        .arg("calibrate")
        .arg(&run)
        .args(["--fit", "step_overhead_s", "--out"])
        .arg(&cal)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("median |error| fit"), "{stdout}");
    let text = std::fs::read_to_string(&cal).unwrap();
    assert!(
        text.contains("[models.\"llama-3.2-3b\"]") && text.contains("rtx-5080"),
        "{text}"
    );
    // `--hold-out` takes every directory after it, as a shell glob gives them.
    let o = Command::new(env!("CARGO_BIN_EXE_sim"))
        .arg("calibrate")
        .arg(&run)
        .args(["--fit", "step_overhead_s", "--hold-out"])
        .arg(&run)
        .arg(&run)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        stdout.contains("median |error| fit (5 figures)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("median |error| held out (10 figures)"),
        "{stdout}"
    );
    // Unknown parameters and missing scenario files are refused by name.
    let o = Command::new(env!("CARGO_BIN_EXE_sim"))
        .arg("calibrate")
        .arg(&run)
        .args(["--fit", "speed"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown parameter `speed`"));
    std::fs::remove_file(run.join("scenario.toml")).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_sim"))
        .arg("calibrate")
        .arg(&run)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("no scenario.toml"));
    // The written file, referenced by a scenario.
    let o = Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(["run", &common::path("baseline"), "--out"])
        .arg(run.join("again"))
        .arg("--set")
        .arg(format!("sim.calibration={}", cal.display()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains(&cal.display().to_string()), "{stdout}");
    std::fs::remove_dir_all(&run).unwrap();
    std::fs::remove_file(&cal).unwrap();
}
