//! The `sim` binary end to end: files written, block printed, sweep table and CSV.

mod common;

use std::ffi::OsStr;
use std::process::{Command, Output};

/// `sim ARGS…`, run to its end.
fn sim<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(args)
        .output()
        .unwrap()
}

/// `sim ARGS…`, which must succeed: its standard output.
fn sim_ok<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> String {
    let o = sim(args);
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("infer-sim-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn run_writes_the_three_files_and_prints_vllms_block() {
    let out = tmp("run");
    let baseline = common::path("baseline");
    let stdout = sim_ok([
        "run".as_ref(),
        baseline.as_ref(),
        "--seed".as_ref(),
        "3".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
    ]);
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
    let scenario = common::path("l4_concurrency_sweep");
    // The L4 sweep at three concurrencies, with `extra` arguments: its sweep.csv.
    let sweep = |name: &str, extra: &[&str]| {
        let out = tmp(name);
        let mut args: Vec<std::ffi::OsString> = [
            "sweep",
            scenario.as_str(),
            "--vary",
            "arrival.max_concurrency=1,4,16",
            "--set",
            "workload.num_requests=48",
            "--quiet",
        ]
        .iter()
        .chain(extra)
        .map(|a| std::ffi::OsString::from(*a))
        .collect();
        args.extend(["--out".into(), out.clone().into_os_string()]);
        sim_ok(args);
        let csv = std::fs::read_to_string(out.join("sweep.csv")).unwrap();
        std::fs::remove_dir_all(&out).unwrap();
        csv
    };
    let csv = sweep("sweep", &[]);
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows.len(), 4, "{csv}");
    assert!(rows[0].starts_with("arrival.max_concurrency,completed,failed,"));
    for r in &rows[1..] {
        assert!(
            r.starts_with(&format!("{},48,0,", &r[..r.find(',').unwrap()])),
            "{r}"
        );
    }
    // Throughput grows with concurrency (the L4 sweep's shape).
    let tput = |r: &str| r.split(',').nth(5).unwrap().parse::<f64>().unwrap();
    assert!(tput(rows[3]) > 3.0 * tput(rows[1]), "{csv}");
    assert!(!rows[0].contains("_lo"), "one seed: no intervals");
    // With seeds, each figure that has one gets its interval; the figures do not change.
    let with = sweep("sweep-seeds", &["--seeds", "3"]);
    let head: Vec<&str> = with.lines().next().unwrap().split(',').collect();
    let col = |name: &str| head.iter().position(|h| *h == name).unwrap();
    for (a, b) in csv.lines().zip(with.lines()).skip(1) {
        let b: Vec<&str> = b.split(',').collect();
        assert!(b.join(",").starts_with(a), "{a} / {b:?}");
        let (lo, v, hi) = (
            b[col("out_tok_per_s_lo")].parse::<f64>().unwrap(),
            b[col("out_tok_per_s")].parse::<f64>().unwrap(),
            b[col("out_tok_per_s_hi")].parse::<f64>().unwrap(),
        );
        // An uncalibrated pair has no recorded errors: the seeds' alone, which always hold
        // the given seed's figure (no width at all where every seed gives the same).
        assert!(0.0 < lo && lo <= v && v <= hi, "{lo} {v} {hi}");
    }
}

#[test]
fn bad_input_exits_non_zero_with_the_reason() {
    let o = sim([
        "run",
        &common::path("baseline"),
        "--set",
        "server.hardware=nope",
        "--quiet",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("unknown hardware `nope`") && err.contains("h100-80gb"),
        "{err}"
    );
}

/// A short baseline run simulated into a fresh directory named `name`: a run directory to
/// calibrate from.
/// A run directory's scenario.toml names its files (a trace, a profile) by absolute paths:
/// simulated again from another directory, it finds them (relative to the scenario's own
/// folder, `traces/…` and `../profiles/…` named nothing next to the run).
#[test]
fn a_run_directorys_scenario_runs_again_from_anywhere() {
    let (first, again, elsewhere) = (tmp("anywhere-1"), tmp("anywhere-2"), tmp("anywhere-cwd"));
    std::fs::create_dir_all(&elsewhere).unwrap();
    for (scenario, extra) in [
        ("trace_replay", "workload.num_requests=8"),
        ("plan_cpu", "workload.num_requests=8"),
    ] {
        let _ = std::fs::remove_dir_all(&first);
        let _ = std::fs::remove_dir_all(&again);
        sim_ok([
            "run".as_ref(),
            common::path(scenario).as_ref(),
            "--quiet".as_ref(),
            "--set".as_ref(),
            OsStr::new(extra),
            "--out".as_ref(),
            first.as_os_str(),
        ]);
        let o = Command::new(env!("CARGO_BIN_EXE_sim"))
            .current_dir(&elsewhere)
            .arg("run")
            .arg(first.join("scenario.toml"))
            .args(["--quiet", "--out"])
            .arg(&again)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{scenario}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(
            std::fs::read(first.join("summary.json")).unwrap(),
            std::fs::read(again.join("summary.json")).unwrap(),
            "{scenario}"
        );
    }
    for d in [first, again, elsewhere] {
        let _ = std::fs::remove_dir_all(d);
    }
}

fn simulated_run(name: &str) -> std::path::PathBuf {
    let run = tmp(name);
    let baseline = common::path("baseline");
    sim_ok([
        "run".as_ref(),
        baseline.as_ref(),
        "--quiet".as_ref(),
        "--out".as_ref(),
        run.as_os_str(),
        "--set".as_ref(),
        "workload.num_requests=4".as_ref(),
        "--set".as_ref(),
        "workload.output_tokens=16".as_ref(),
    ]);
    run
}

#[test]
fn calibrate_fits_a_run_directory_it_wrote_and_the_file_it_writes_is_used() {
    // A simulated run is a measured run like any other: its directory keeps the scenario,
    // so `sim calibrate` can fit to it; the file it writes is read by a scenario naming it.
    let run = simulated_run("calibrate-run");
    let baseline = common::path("baseline");
    let scenario = std::fs::read_to_string(run.join("scenario.toml")).unwrap();
    assert!(scenario.contains("num_requests = 4"), "{scenario}");
    let cal = tmp("calibrate-file").with_extension("toml");
    let stdout = sim_ok([
        "calibrate".as_ref(),
        run.as_os_str(),
        "--fit".as_ref(),
        "step_overhead_s".as_ref(),
        "--out".as_ref(),
        cal.as_os_str(),
    ]);
    assert!(stdout.contains("median |error| fit"), "{stdout}");
    let text = std::fs::read_to_string(&cal).unwrap();
    assert!(
        text.contains("[models.\"llama-3.2-3b\"]") && text.contains("rtx-5080"),
        "{text}"
    );
    // `--hold-out` takes every directory after it, as a shell glob gives them.
    let held = [
        simulated_run("calibrate-held-1"),
        simulated_run("calibrate-held-2"),
    ];
    let stdout = sim_ok([
        "calibrate".as_ref(),
        run.as_os_str(),
        "--fit".as_ref(),
        "step_overhead_s".as_ref(),
        "--hold-out".as_ref(),
        held[0].as_os_str(),
        held[1].as_os_str(),
    ]);
    for d in &held {
        std::fs::remove_dir_all(d).unwrap();
    }
    assert!(
        stdout.contains("median |error| fit (5 figures)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("median |error| held out (10 figures)"),
        "{stdout}"
    );
    // Static batching's own host costs, named for a model whose runs batch one way: not
    // fitted, said so, and none written.
    let o = sim([
        "calibrate".as_ref(),
        run.as_os_str(),
        "--fit".as_ref(),
        "step_overhead_s,static_step_overhead_s".as_ref(),
        "--out".as_ref(),
        cal.as_os_str(),
    ]);
    assert!(o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("llama-3.2-3b: static_step_overhead_s not fitted"),
        "{err}"
    );
    let text = std::fs::read_to_string(&cal).unwrap();
    assert!(!text.contains("\nstatic_step_overhead_s ="), "{text}");
    // Unknown parameters and missing scenario files are refused by name.
    let o = sim([
        "calibrate".as_ref(),
        run.as_os_str(),
        "--fit".as_ref(),
        "speed".as_ref(),
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown parameter `speed`"));
    std::fs::remove_file(run.join("scenario.toml")).unwrap();
    let o = sim(["calibrate".as_ref(), run.as_os_str()]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no scenario.toml"));
    // The written file, referenced by a scenario.
    let stdout = sim_ok([
        "run".to_string(),
        baseline,
        "--out".into(),
        run.join("again").display().to_string(),
        "--set".into(),
        format!("sim.calibration={}", cal.display()),
    ]);
    // The console names the file and the fit's size; run.json has the path and the command.
    let name = cal.file_name().unwrap().to_string_lossy();
    assert!(
        stdout.contains(&format!("calibration: {name} (1 runs fitted, 0 held out)")),
        "{stdout}"
    );
    let info = std::fs::read_to_string(run.join("again/run.json")).unwrap();
    assert!(
        info.contains(&cal.display().to_string()) && info.contains("`sim calibrate "),
        "{info}"
    );
    std::fs::remove_dir_all(&run).unwrap();
    std::fs::remove_file(&cal).unwrap();
}

#[test]
fn a_second_stage_takes_its_start_files_mechanisms_and_refuses_others() {
    let run = simulated_run("second-stage-run");
    let first = tmp("second-stage-first").with_extension("toml");
    let second = tmp("second-stage-second").with_extension("toml");
    let calibrate = |extra: &[&str], out: &std::path::Path| {
        let mut args: Vec<std::ffi::OsString> = vec!["calibrate".into(), run.clone().into()];
        args.extend(extra.iter().map(|a| a.into()));
        args.extend(["--out".into(), out.as_os_str().to_owned()]);
        sim(args)
    };
    let o = calibrate(
        &[
            "--fit",
            "step_overhead_s",
            "--roofline",
            "serial",
            "--logits",
            "all",
            "--reserved-gib",
            "1.5",
        ],
        &first,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let start = first.display().to_string();
    // No mechanism flags: the start file's, kept in the file written.
    let o = calibrate(
        &["--start", &start, "--fit", "step_jitter_s,step_overhead_s"],
        &second,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&second).unwrap();
    assert!(
        text.contains("roofline = \"serial\"")
            && text.contains("logits = \"all\"")
            && text.contains("reserved_gib = 1.5"),
        "{text}"
    );
    // A flag naming the start file's own mechanism is no conflict; one naming another is
    // refused.
    for (roofline, accepted) in [("serial", true), ("overlap", false)] {
        let args = [
            "--start",
            &start,
            "--fit",
            "step_overhead_s",
            "--roofline",
            roofline,
        ];
        let o = calibrate(&args, &second);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.success(), accepted, "--roofline {roofline}: {err}");
        if !accepted {
            assert!(err.contains("fitted under other mechanisms"), "{err}");
        }
    }
    // `--fit none`: the start file's coefficients kept, its errors on the runs recorded,
    // and the intervals checked on the held-out ones.
    let held = simulated_run("second-stage-held");
    let o = calibrate(
        &[
            "--start",
            &start,
            "--fit",
            "none",
            "--hold-out",
            &held.display().to_string(),
        ],
        &second,
    );
    std::fs::remove_dir_all(&held).unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        stdout.contains("90% intervals on the held-out runs"),
        "{stdout}"
    );
    assert!(stdout.contains("pooled"), "{stdout}");
    let text = std::fs::read_to_string(&second).unwrap();
    let first_text = std::fs::read_to_string(&first).unwrap();
    let models = |t: &str| {
        t[t.find("[models").unwrap()..t.find("[[residuals]]").unwrap_or(t.len())]
            .trim()
            .to_string()
    };
    assert_eq!(models(&text), models(&first_text), "coefficients kept");
    assert_eq!(text.matches("[[residuals]]").count(), 2, "{text}");
    assert!(text.contains("errors recorded by `sim calibrate"), "{text}");
    let o = sim([
        "calibrate".as_ref(),
        run.as_os_str(),
        "--fit".as_ref(),
        "none".as_ref(),
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--fit none keeps the --start file"));
    // The same run twice would share its recorded errors: refused.
    let o = sim(["calibrate".as_ref(), run.as_os_str(), run.as_os_str()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("two runs are labelled"),
        "{err}"
    );
    // A bootstrap coefficient that does not exist is refused before any fitting.
    let o = sim([
        "calibrate".as_ref(),
        run.as_os_str(),
        "--bootstrap".as_ref(),
        "2".as_ref(),
        "--bootstrap-fit".as_ref(),
        "step_overheads".as_ref(),
    ]);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(
        !o.status.success() && err.contains("step_overheads"),
        "{err}"
    );
    assert!(
        !out.contains("median |error|"),
        "refused before the fit: {out}"
    );
    // A start file's model that no run covers keeps its coefficients (written to the start's
    // own path, it would otherwise be lost).
    let at = first_text.find("[models").unwrap();
    let end = first_text[at + 1..]
        .find("\n[")
        .map_or(first_text.len(), |i| at + 1 + i);
    let section = &first_text[at..end];
    let header = section.lines().next().unwrap();
    let other = section.replacen(header, "[models.qwen3-4b]", 1);
    let two_models = format!("{}\n{other}\n{}", &first_text[..end], &first_text[end..]);
    std::fs::write(&first, &two_models).unwrap();
    let o = calibrate(&["--start", &start, "--fit", "step_overhead_s"], &second);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("qwen3-4b: no run of it here, kept from the start file"),
        "{stdout}"
    );
    let text = std::fs::read_to_string(&second).unwrap();
    assert!(text.contains("[models.qwen3-4b]"), "{text}");
    std::fs::remove_dir_all(&run).unwrap();
    for f in [first, second] {
        std::fs::remove_file(f).unwrap();
    }
}

/// The run directory's bounds, end to end: output past `sim.max_output_mib` fails the run
/// and leaves no directory; a directory that is not a run's is never written into; a seed
/// past 2^63 is a seed.
#[test]
fn run_directories_are_bounded_and_land_whole() {
    let out = tmp("bounded");
    let baseline = common::path("baseline");
    let o = sim([
        "run".as_ref(),
        baseline.as_ref(),
        "--set".as_ref(),
        "sim.max_output_mib=0.002".as_ref(),
        "--set".as_ref(),
        "workload.num_requests=2000".as_ref(),
        "--set".as_ref(),
        "workload.output_tokens=2".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && stderr.contains("sim.max_output_mib"),
        "{stderr}"
    );
    assert!(!out.exists(), "a failed run left {}", out.display());
    let partial = out.with_file_name(format!(
        ".{}.partial",
        out.file_name().unwrap().to_string_lossy()
    ));
    assert!(!partial.exists(), "a failed run left {}", partial.display());

    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "not a run").unwrap();
    let o = sim([
        "run".as_ref(),
        baseline.as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && stderr.contains("not a run directory"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);
    std::fs::remove_dir_all(&out).unwrap();

    sim_ok([
        "run".as_ref(),
        baseline.as_ref(),
        "--seed".as_ref(),
        "18446744073709551615".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
    ]);
    let info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(info["seed"].as_u64(), Some(u64::MAX));
    std::fs::remove_dir_all(&out).unwrap();
}
