//! The commands the documentation shows run as written: every fenced ```bash line of
//! README.md and docs/guide/*.md that is cheap, and the examples `sim <command> --help`
//! ends with. A flag that does not exist, a file that is not there or a run that fails
//! fails here rather than for a reader.
//!
//! Commands run with bash from a scratch directory that links every top-level entry of the
//! repository but `runs/`, `target/` and `.git/`: relative paths resolve as from the
//! repository root, and run directories (`--out runs/…` or the default) land in the
//! scratch's own `runs/`, which starts absent as on a fresh clone. `./target/release/sim`,
//! `cargo run --release -p infer-sim --bin sim --` and an installed `sim` are this build's.
//!
//! Skipped, by kind ([`Kind::Skip`] names each):
//! * builds and test runs (`cargo build`, `install`, `test`, `cargo run … --example`):
//!   minutes, and CI runs them anyway;
//! * the engine (`./target/release/engine …`): another crate's binary, and most of its
//!   commands need a model, a server or a port (its `--help` examples are its own test);
//! * what needs a server: `curl`, `until`, `kill`, `for` loops starting servers, routers;
//! * a GPU (`scripts/gpu-pack.sh`, `gpu-check.sh`) and Python (`pip`, `python3`, `lm_eval`);
//! * long runs: `sim calibrate` (half a minute in a release build, far more here).
//!
//! A line of a kind not listed fails the test, so that a new command is classified here.

#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// What to do with a documented command line.
#[derive(Debug, PartialEq)]
enum Kind {
    /// Run it, as rewritten.
    Run(String),
    /// Skip it, for this reason.
    Skip(&'static str),
}

const SIM_FORMS: [&str; 3] = [
    "./target/release/sim ",
    "cargo run --release -p infer-sim --bin sim -- ",
    "sim ",
];

fn classify(line: &str, sim: &str) -> Kind {
    let first = line.split_whitespace().next().unwrap_or("");
    let assignment = first.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_')
    });
    if assignment || first == "mkdir" {
        return Kind::Run(line.to_string());
    }
    if let Some(args) = SIM_FORMS.iter().find_map(|f| line.strip_prefix(f)) {
        return match args.split_whitespace().next() {
            Some("calibrate") if !args.contains("--help") => Kind::Skip("long run: sim calibrate"),
            _ => Kind::Run(format!("'{sim}' {args}")),
        };
    }
    match first {
        "cargo" => Kind::Skip("build or test run"),
        "./target/release/engine" | "engine" => Kind::Skip("the engine"),
        "curl" | "until" | "kill" | "for" | "vllm-router" | "sglang-router" => {
            Kind::Skip("needs a server")
        }
        "pip" | "python3" | "lm_eval" => Kind::Skip("needs Python"),
        "scripts/gpu-pack.sh" | "bash" if line.contains("gpu-") => Kind::Skip("needs a GPU"),
        _ => panic!("a documented command of no known kind (classify it here): {line}"),
    }
}

/// The ```bash blocks of a Markdown file, each as its command lines (continuations joined).
fn bash_blocks(markdown: &str) -> Vec<Vec<String>> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in markdown.lines() {
        match (&mut current, line.trim_start()) {
            (None, l) if l.starts_with("```bash") => current = Some(Vec::new()),
            (Some(_), l) if l.starts_with("```") => blocks.extend(current.take()),
            (Some(block), l) => match block.last_mut() {
                Some(last) if last.ends_with('\\') => {
                    last.pop();
                    last.push_str(l);
                }
                _ if l.is_empty() || l.starts_with('#') => {}
                _ => block.push(l.to_string()),
            },
            (None, _) => {}
        }
    }
    blocks
}

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// A fresh directory that looks like the repository root, without runs/ and target/.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("infer-docs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(repository()).unwrap() {
        let entry = entry.unwrap();
        let file_name = entry.file_name();
        if !["runs", "target", ".git"].contains(&file_name.to_str().unwrap_or("")) {
            std::os::unix::fs::symlink(entry.path(), dir.join(&file_name)).unwrap();
        }
    }
    dir
}

/// Run `lines` as one bash script in `dir`; on failure, what it printed.
fn run_script(dir: &Path, lines: &[String]) -> Result<(), String> {
    let script = format!("set -euxo pipefail\n{}\n", lines.join("\n"));
    let o = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(dir)
        .output()
        .unwrap();
    match o.status.success() {
        true => Ok(()),
        false => Err(format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )),
    }
}

#[test]
fn every_cheap_documented_command_runs_as_written() {
    let sim = env!("CARGO_BIN_EXE_sim");
    let root = repository();
    let mut pages = vec![root.join("README.md")];
    let mut guides: Vec<PathBuf> = std::fs::read_dir(root.join("docs/guide"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    guides.sort();
    pages.extend(guides);

    let dir = scratch("pages");
    let (mut ran, mut skipped, mut failures) = (0, Vec::new(), Vec::new());
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for block in bash_blocks(&text) {
            // A block runs in one shell, so that its variables reach its later lines.
            let mut script = Vec::new();
            for line in &block {
                match classify(line, sim) {
                    Kind::Run(l) => script.push(l),
                    Kind::Skip(why) => skipped.push(format!("{why}: {line}")),
                }
            }
            if script.iter().any(|l| l.contains(sim)) {
                ran += script.iter().filter(|l| l.contains(sim)).count();
                if let Err(out) = run_script(&dir, &script) {
                    failures.push(format!("{}:\n{out}", page.display()));
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    // The README's tour and the simulator's and reports' guides at least.
    assert!(
        ran >= 10,
        "only {ran} commands ran; skipped:\n{}",
        skipped.join("\n")
    );
}

#[test]
fn every_sim_help_example_runs() {
    let sim = env!("CARGO_BIN_EXE_sim");
    let help = |args: &[&str]| {
        let o = Command::new(sim).args(args).output().unwrap();
        assert!(o.status.success(), "sim {args:?}");
        String::from_utf8(o.stdout).unwrap()
    };
    let top = help(&["--help"]);
    let commands: Vec<&str> = top
        .lines()
        .skip_while(|l| *l != "Commands:")
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert!(
        commands.contains(&"run") && commands.contains(&"report"),
        "{top}"
    );
    let dir = scratch("help");
    let mut ran = 0;
    for command in commands {
        let text = help(&[command, "--help"]);
        let example: Vec<String> = text
            .lines()
            .skip_while(|l| !l.starts_with("Example"))
            .filter_map(|l| l.trim().strip_prefix("sim "))
            .map(|args| format!("sim {args}"))
            .collect();
        assert!(
            !example.is_empty(),
            "sim {command} --help: no example\n{text}"
        );
        let mut script = Vec::new();
        for line in &example {
            if let Kind::Run(l) = classify(line, sim) {
                script.push(l);
            }
        }
        ran += script.len();
        if let Err(out) = run_script(&dir, &script) {
            panic!("sim {command} --help's example:\n{out}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(ran >= 5, "{ran} example commands ran");
}

#[test]
fn commands_are_classified_and_blocks_extracted() {
    let md = "text\n```bash\nA=1 \\\n  B\n# a comment\n./target/release/sim run x.toml\n```\n\
              ```text\nsim run not-a-command\n```\n";
    assert_eq!(
        bash_blocks(md),
        [vec![
            "A=1 B".to_string(),
            "./target/release/sim run x.toml".into()
        ]]
    );
    assert_eq!(
        classify(
            "cargo run --release -p infer-sim --bin sim -- run a.toml",
            "/b/sim"
        ),
        Kind::Run("'/b/sim' run a.toml".into())
    );
    assert_eq!(
        classify("./target/release/sim calibrate --out x", "/b/sim"),
        Kind::Skip("long run: sim calibrate")
    );
    assert_eq!(
        classify("./target/release/engine serve &", "/b/sim"),
        Kind::Skip("the engine")
    );
}
