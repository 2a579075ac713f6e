//! Output a person can read: the main command's console and `sim report`'s tables stay
//! narrow, and what is long (a calibration's provenance, a run's directory) goes where there
//! is room for it (run.json, the report's details).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// `sim ARGS…`, which must succeed: its standard output.
fn sim_ok(args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "sim {args:?}: {stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("infer-sim-readable-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn text(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn the_main_commands_console_has_no_line_over_200_characters() {
    // README's main command, as it runs: `sim run scenarios/chunked_prefill.toml`.
    let out = tmp("main");
    let stdout = sim_ok(&["run", &common::path("chunked_prefill"), "--out", text(&out)]);
    for line in stdout.lines() {
        assert!(
            line.chars().count() <= 200,
            "{} characters: {line}",
            line.chars().count()
        );
    }
    // The calibration in short on the console (file, engine, fit size), in full in run.json.
    assert!(
        stdout.contains(
            "calibration: rtx5080-seed-server.toml (the benchmark log's Python server \
             (Phases 4-8); 34 runs fitted, 45 held out)"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("compute eff 0.800"), "{stdout}");
    let info = std::fs::read_to_string(out.join("run.json")).unwrap();
    assert!(
        info.contains("sim/calibrations/rtx5080-seed-server.toml: `sim calibrate --published"),
        "{info}"
    );
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn a_reports_table_cells_are_at_most_80_characters() {
    let root = tmp("report");
    let scenario = common::path("chunked_prefill");
    let (p8, p6, report) = (root.join("p8"), root.join("p6"), root.join("report"));
    sim_ok(&["run", &scenario, "--quiet", "--out", text(&p8)]);
    sim_ok(&[
        "run",
        &scenario,
        "--quiet",
        "--set",
        "server.chunked_prefill=false",
        "--out",
        text(&p6),
    ]);
    sim_ok(&["report", text(&p6), text(&p8), "--out", text(&report)]);
    let md = std::fs::read_to_string(report.join("report.md")).unwrap();
    let cells: Vec<&str> = md
        .lines()
        .filter(|l| l.starts_with('|'))
        .flat_map(|l| l.trim_matches('|').split('|').map(str::trim))
        .collect();
    assert!(cells.len() > 50, "{md}");
    for cell in cells {
        assert!(cell.chars().count() <= 80, "{cell}");
    }
    // The long fields are below the table: each run's directory and backend in full.
    let details = &md[md.find("### Run details").expect("a details section")..];
    for dir in [&p6, &p8] {
        assert!(
            details.contains(&format!("`{}`", dir.display())),
            "{details}"
        );
    }
    assert!(details.contains("`sim calibrate --published"), "{details}");
    std::fs::remove_dir_all(&root).unwrap();
}
