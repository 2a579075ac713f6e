//! `engine probe`: a fixed, short set of loads against any OpenAI-compatible server, whose
//! run directories `sim calibrate` fits. Black box: it needs no profile and nothing from
//! the server but its API.
//!
//! Each probe isolates what one group of coefficients decides:
//!
//! | probe | load | reveals |
//! |---|---|---|
//! | `single-{128,512,1024}` | one request at a time, 16 output tokens | TTFT vs prompt length: compute and attention efficiency, client path |
//! | `decode-{1,4,16}` | 1, 4, 16 closed-loop clients, 64-token prompts, 64 output tokens | ITL vs batch: memory time, step and per-sequence overhead |
//! | `decode-long` | 8 clients at once, 1,024-token prompts, 128 output tokens | ITL of many decodes at long context: the decode attention over the KV cache |
//! | `interference` | 4 clients, 32 prompts, one in seven 1,024 tokens | prefills stalling decodes: how the engine batches them |
//! | `shared-prefix` | 2 clients, a 512-token prefix shared by every prompt | the prefix cache |
//!
//! A probe's scenario is the base scenario's `[server]` and `[sim]` (which must describe the
//! server: its model, GPU and scheduler settings, as a scenario for the simulator does)
//! with the probe's own `[workload]` and `[arrival]`. Each probe's run directory keeps that
//! scenario (`scenario.toml`) beside its figures.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use infer_core::metrics::Summary;
use infer_core::workload::Scenario;

use super::BenchOptions;

/// One probe load: its name and its `[workload]` and `[arrival]` tables (TOML).
pub struct Probe {
    pub name: &'static str,
    workload: &'static str,
    arrival: &'static str,
}

pub const PROBES: [Probe; 9] = [
    Probe {
        name: "single-128",
        workload: "num_requests = 5\nwarmup_requests = 1\nprompt_tokens = 128\noutput_tokens = 16",
        arrival: "kind = \"sequential\"",
    },
    Probe {
        name: "single-512",
        workload: "num_requests = 5\nwarmup_requests = 1\nprompt_tokens = 512\noutput_tokens = 16",
        arrival: "kind = \"sequential\"",
    },
    Probe {
        name: "single-1024",
        workload: "num_requests = 5\nwarmup_requests = 1\nprompt_tokens = 1024\noutput_tokens = 16",
        arrival: "kind = \"sequential\"",
    },
    Probe {
        name: "decode-1",
        workload: "num_requests = 4\nwarmup_requests = 1\nprompt_tokens = 64\noutput_tokens = 64",
        arrival: "kind = \"concurrency\"\nmax_concurrency = 1",
    },
    Probe {
        name: "decode-4",
        workload: "num_requests = 9\nwarmup_requests = 1\nprompt_tokens = 64\noutput_tokens = 64",
        arrival: "kind = \"concurrency\"\nmax_concurrency = 4",
    },
    Probe {
        name: "decode-16",
        workload: "num_requests = 33\nwarmup_requests = 1\nprompt_tokens = 64\noutput_tokens = 64",
        arrival: "kind = \"concurrency\"\nmax_concurrency = 16",
    },
    // Eight at once and twice the output of the short decodes, so that the median gap is a
    // step of eight decodes at 1,024+ tokens of context each — what the seed workloads'
    // chunked_prefill and prefix_caching run. With four clients and 64 tokens, each
    // prompt's prefill outlasted the others' decodes: its median gap was a step of four
    // decodes at most, and no probe measured many decodes at long context.
    Probe {
        name: "decode-long",
        workload:
            "num_requests = 9\nwarmup_requests = 1\nprompt_tokens = 1024\noutput_tokens = 128",
        arrival: "kind = \"concurrency\"\nmax_concurrency = 8",
    },
    // Few long prompts among many short ones, so that the median TTFT is a short prompt's,
    // firmly: with a quarter long (seventeen requests, seven of them long as drawn) it sat
    // between the short prompts that waited behind a long one and those that did not, and
    // moved from 2.1 to 4.5 s between two measurements of the same server.
    Probe {
        name: "interference",
        workload: "num_requests = 33\nwarmup_requests = 1\noutput_tokens = 32\n\
                   prompt_tokens = { mix = [ { weight = 0.85, uniform = [32, 64] }, \
                   { weight = 0.15, fixed = 1024 } ] }",
        arrival: "kind = \"concurrency\"\nmax_concurrency = 4",
    },
    Probe {
        name: "shared-prefix",
        workload: "num_requests = 9\nwarmup_requests = 1\nshared_prefix_tokens = 512\n\
                   prompt_tokens = { uniform = [16, 32] }\noutput_tokens = 16",
        arrival: "kind = \"concurrency\"\nmax_concurrency = 2",
    },
];

/// The probe's scenario: `base`'s `[server]` and `[sim]` with the probe's workload. Each
/// probe has its own seed, so that its prompts share no prefix with another probe's (the
/// simulator replays each probe on an empty prefix cache).
pub fn scenario_text(base: &Scenario, probe: &Probe) -> Result<String> {
    let seed = 1000
        + PROBES
            .iter()
            .position(|p| p.name == probe.name)
            .unwrap_or(0);
    // Outputs run to their length unless the base scenario says the server refuses
    // `ignore_eos` (transformers' does): `--set workload.ignore_eos=false`.
    let mut out = format!(
        "name = \"probe-{}\"\ndescription = \"engine probe: {}\"\n\n[workload]\nseed = {seed}\n\
         ignore_eos = {}\n{}\n\n[arrival]\n{}\n",
        probe.name, probe.name, base.workload.ignore_eos, probe.workload, probe.arrival
    );
    for section in ["server", "sim"] {
        if let Some(v) = base.resolved.get(section) {
            let table = toml::Table::from_iter([(section.to_string(), v.clone())]);
            out.push('\n');
            out.push_str(&toml::to_string(&table).context("a scenario table serialises")?);
        }
    }
    Ok(out)
}

/// A probe that ran: its directory and figures.
pub struct ProbeRun {
    pub name: &'static str,
    pub dir: PathBuf,
    pub summary: Summary,
}

/// Run the probes named in `only` (all when empty) against `opts.server`, each into
/// `out/<name>/`; `opts.scenario` and `opts.overrides` give the base scenario.
pub async fn run(opts: &BenchOptions, out: &Path, only: &[String]) -> Result<Vec<ProbeRun>> {
    for name in only {
        if !PROBES.iter().any(|p| p.name == name) {
            let names: Vec<_> = PROBES.iter().map(|p| p.name).collect();
            return Err(anyhow!(
                "unknown probe `{name}`; expected some of {}",
                names.join(", ")
            ));
        }
    }
    let path = opts.scenario.display().to_string();
    let text = std::fs::read_to_string(&opts.scenario)
        .with_context(|| format!("{path}: cannot read scenario"))?;
    let base = Scenario::parse(&path, &text, &opts.overrides)?;
    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let mut runs = Vec::new();
    for probe in PROBES
        .iter()
        .filter(|p| only.is_empty() || only.iter().any(|n| n == p.name))
    {
        let file = out.join(format!("{}.toml", probe.name));
        std::fs::write(&file, scenario_text(&base, probe)?)
            .with_context(|| format!("{}: cannot write", file.display()))?;
        let dir = out.join(probe.name);
        // The simulator replays each probe on an empty cache: empty the server's where it
        // offers vLLM's endpoint; servers without it are probed as they are.
        let _ = super::reset_prefix_cache(opts).await;
        let probe_opts = BenchOptions {
            scenario: file,
            overrides: Vec::new(),
            out: Some(dir.clone()),
            reset_prefix_cache: false,
            ..opts.clone()
        };
        let r = super::run(&probe_opts)
            .await
            .with_context(|| format!("probe {}", probe.name))?;
        runs.push(ProbeRun {
            name: probe.name,
            dir,
            summary: r.summary,
        });
    }
    Ok(runs)
}

/// What `engine probe` prints: one line per probe, then how to fit them.
pub fn render(runs: &[ProbeRun], out: &Path) -> String {
    let mut s = format!(
        "{:<14} {:>9} {:>12} {:>11} {:>11}  run directory\n",
        "probe", "requests", "output tok/s", "TTFT P50 ms", "ITL P50 ms"
    );
    for r in runs {
        let m = &r.summary;
        s.push_str(&format!(
            "{:<14} {:>9} {:>12.1} {:>11.1} {:>11.1}  {}\n",
            r.name,
            format!("{}/{}", m.completed, m.completed + m.failed),
            m.output_throughput,
            m.ttft.median * 1e3,
            m.itl.median * 1e3,
            r.dir.display()
        ));
    }
    s.push_str(&format!(
        "fit them: sim calibrate {}/*/ --out calibration.toml\n",
        out.display()
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_probe_scenario_parses_and_keeps_the_base_server() {
        let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/baseline.toml");
        let text = std::fs::read_to_string(file).unwrap();
        let base = Scenario::parse(file, &text, &["server.max_batch_size=7".into()]).unwrap();
        for p in &PROBES {
            let t = scenario_text(&base, p).unwrap();
            let s = Scenario::parse(p.name, &t, &[]).unwrap_or_else(|e| panic!("{e}\n{t}"));
            assert_eq!(s.server, base.server, "{}", p.name);
            assert_eq!(s.server.max_batch_size, 7);
            assert!(s.workload.ignore_eos && s.workload.warmup_requests == 1);
        }
        // A server that refuses `ignore_eos` is probed without it.
        let off = ["workload.ignore_eos=false".to_string()];
        let base = Scenario::parse(file, &text, &off).unwrap();
        for p in &PROBES {
            let s = Scenario::parse(p.name, &scenario_text(&base, p).unwrap(), &[]).unwrap();
            assert!(!s.workload.ignore_eos, "{}", p.name);
        }
        let seeds: std::collections::BTreeSet<u64> = PROBES
            .iter()
            .map(|p| {
                let t = scenario_text(&base, p).unwrap();
                Scenario::parse(p.name, &t, &[]).unwrap().workload.seed
            })
            .collect();
        assert_eq!(seeds.len(), PROBES.len(), "every probe has its own prompts");
    }

    /// The interference probe's median TTFT must be a short prompt's: its long prompts, as
    /// its seed draws them, are well under half the measured requests (a median between
    /// the short prompts that waited behind a long one and those that did not moved 2x
    /// between two measurements of one server).
    #[test]
    fn the_interference_probe_draws_few_long_prompts() {
        use infer_core::workload::corpus::ApproxTokenizer;
        use infer_core::workload::generate::WorkloadGenerator;
        let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/baseline.toml");
        let base = Scenario::parse(file, &std::fs::read_to_string(file).unwrap(), &[]).unwrap();
        let probe = PROBES.iter().find(|p| p.name == "interference").unwrap();
        let s = Scenario::parse(probe.name, &scenario_text(&base, probe).unwrap(), &[]).unwrap();
        let n = s.workload.num_requests;
        let gen =
            WorkloadGenerator::new(s.workload, std::sync::Arc::new(ApproxTokenizer::default()));
        let long = (0..n)
            .filter(|&i| gen.request(i).prompt_ids.len() >= 1000)
            .count();
        assert!((1..=n / 5).contains(&long), "{long} long prompts of {n}");
    }
}
