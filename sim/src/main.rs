//! `sim`: predict what a serving knob does before building or deploying it.
//!
//! ```text
//! sim run SCENARIO [--set key=value]… [--goodput ttft:MS …] [--out DIR] [--seed N] [--quiet]
//! sim sweep SCENARIO --vary key=v1,v2,… [--vary …] [--set …] [--goodput …] [--out DIR]
//!     [--threads N]
//! sim plan SCENARIO [--slo ttft:MS tpot:MS e2el:MS] [--attainment F] [--vary key=v1,v2,…]…
//!     [--config NAME:key=v,key=v]… [--capacity] [--target-rate R] [--set …] [--out DIR]
//!     [--threads N]
//! sim catalog
//! sim calibrate [RUN_DIR…] [--published FILE]… [--hold-out RUN_DIR]… [--fit P,…]
//!     [--prefill-batching packed|padded] [--logits sampled|all]
//!     [--attention-scores fused|materialized] [--contiguous-kv reserved|grown]
//!     [--roofline overlap|serial]
//!     [--search-mechanisms]
//!     [--spill-bandwidth-gb-s X] [--reserved-gib X] [--graph-replay-factor X]
//!     [--start FILE] [--engine TEXT] [--out FILE]
//! sim report RUN_DIR… [--baseline RUN_DIR] [--out DIR]
//! ```

use infer_core::FileError;
use infer_reports::{default_run_dir, RunDirWriter};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use infer_sim::interval::{RunIntervals, MAX_SEEDS};
use infer_sim::{calibration, catalog, fit, output, plan, sweep};

#[derive(Parser)]
#[command(
    name = "sim",
    about = "Discrete-event simulator of the infer serving core",
    version,
    after_help = "Example (from the repository root):\n  sim run scenarios/chunked_prefill.toml"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Simulate one scenario and write summary.json, requests.csv and timeseries.csv.
    #[command(
        after_help = "Example: the chunked-prefill workload on the Phase 6 server (no chunked prefill, no prefix caching)\n  \
        sim run scenarios/chunked_prefill.toml --set server.chunked_prefill=false --set server.prefix_caching=false --out runs/p6"
    )]
    Run {
        scenario: String,
        /// Override a scenario key, e.g. --set server.prefix_caching=false.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Run directory (default: runs/<name>-<unix time>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Workload seed (overrides workload.seed).
        #[arg(long)]
        seed: Option<u64>,
        /// Service-level objectives for goodput, as vLLM's: `ttft:MS tpot:MS e2el:MS` (any
        /// of them; the scenario's `[slo]` table otherwise).
        #[arg(long, num_args = 1.., value_name = "METRIC:MS")]
        goodput: Vec<String>,
        /// Print only the run directory.
        #[arg(long)]
        quiet: bool,
        /// Seeds to run for the figures' 90% intervals: the given one (whose figures are
        /// vLLM's keys) and the N − 1 after it. 1: no intervals.
        #[arg(long, default_value_t = infer_sim::interval::DEFAULT_SEEDS, value_name = "N")]
        seeds: usize,
    },
    /// Simulate the grid of --vary values in parallel and write sweep.csv.
    #[command(after_help = "Example:\n  \
        sim sweep scenarios/paged_attention.toml --vary server.max_batch_size=8,16,24 --out runs/sweep-batch")]
    Sweep {
        scenario: String,
        /// An axis: key=v1,v2,… (repeatable; the grid is their product).
        #[arg(long = "vary", value_name = "KEY=V1,V2,…", required = true)]
        vary: Vec<String>,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long)]
        seed: Option<u64>,
        #[arg(long, num_args = 1.., value_name = "METRIC:MS")]
        goodput: Vec<String>,
        /// Worker threads (default: the machine's cores).
        #[arg(long)]
        threads: Option<usize>,
        #[arg(long)]
        quiet: bool,
        /// Seeds per point for the figures' 90% intervals (`COLUMN_lo`, `COLUMN_hi` in
        /// sweep.csv), as `sim run --seeds`; 1 (the default): none, each point runs once.
        #[arg(long, default_value_t = 1, value_name = "N")]
        seeds: usize,
    },
    /// Find the best configuration under latency objectives: simulate every configuration
    /// (named bundles of settings, each crossed with the varied keys) in parallel and print
    /// and write (plan.csv, plan.md) its goodput, SLO attainment, GPUs and the Pareto front;
    /// with --capacity, the highest arrival rate each holds; with --target-rate, the fewest
    /// replicas that hold it. A scenario's `[plan]` table gives the same.
    #[command(
        after_help = "Example: three batch sizes under TTFT 2 s and TPOT 60 ms for 90% of requests\n  \
        sim plan scenarios/chunked_prefill.toml --slo ttft:2000 tpot:60 --vary server.max_batch_size=8,16,24 --out runs/plan-batch"
    )]
    Plan {
        scenario: String,
        /// The objectives a request must meet, as vLLM's --goodput: `ttft:MS tpot:MS
        /// e2el:MS` (any of them), added to the scenario's `[slo]` table.
        #[arg(long, num_args = 1.., value_name = "METRIC:MS")]
        slo: Vec<String>,
        /// The fraction of requests that must meet every objective, in (0, 1] (default:
        /// `[plan] attainment`, else 0.9).
        #[arg(long, value_name = "F")]
        attainment: Option<f64>,
        /// A varied key: key=v1,v2,… (repeatable; the grid is their product). Replaces
        /// `[plan] vary`.
        #[arg(long = "vary", value_name = "KEY=V1,V2,…")]
        vary: Vec<String>,
        /// A named configuration: NAME:key=value,key=value (repeatable); each is crossed
        /// with the grid. Replaces `[plan.configs]`.
        #[arg(long = "config", value_name = "NAME:KEY=V,…")]
        config: Vec<String>,
        /// Search each configuration's capacity: the highest arrival rate (same process)
        /// at which the attainment holds.
        #[arg(long)]
        capacity: bool,
        /// Find each configuration's fewest replicas that hold this many requests per second
        /// (the scenario needs a [cluster] table).
        #[arg(long, value_name = "REQ_PER_S")]
        target_rate: Option<f64>,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Plan directory (default: runs/<name>-plan-<unix time>).
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long)]
        seed: Option<u64>,
        /// Worker threads (default: the machine's cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Print only the answer and the files.
        #[arg(long)]
        quiet: bool,
    },
    /// List the hardware and models the simulator knows.
    #[command(after_help = "Example:\n  sim catalog")]
    Catalog,
    /// Fit a calibration file (the analytic model's coefficients per model) to measured
    /// runs, print the fit and the held-out error, and write the file for scenarios to
    /// reference (`[sim] calibration = "…"`).
    #[command(
        after_help = "Example: fit the benchmark log's published figures (about half a minute)\n  \
        sim calibrate --published sim/calibrations/rtx5080-benchmark-log.toml --prefill-batching padded --out runs/rtx5080.toml"
    )]
    Calibrate {
        /// Run directories to fit (from `engine bench` or `engine probe`).
        #[arg(value_name = "RUN_DIR")]
        runs: Vec<String>,
        /// Run directories to predict but not fit (held out); takes every directory that
        /// follows it (`--hold-out runs/x/*/`).
        #[arg(long = "hold-out", value_name = "RUN_DIR", num_args = 1..)]
        hold_out: Vec<String>,
        /// A table of published figures (TOML `[[run]]` entries; see
        /// sim/calibrations/rtx5080-benchmark-log.toml).
        #[arg(long, value_name = "FILE")]
        published: Vec<String>,
        /// Coefficients to fit, comma-separated (default: compute_efficiency,
        /// attention_efficiency, step_overhead_s, per_seq_overhead_s, client_request_s,
        /// static_batch_window_s, static_step_overhead_s, static_per_seq_overhead_s; the
        /// last two only for a model whose fitted runs batch both statically and
        /// continuously).  With `--start`, name the few a second stage refits. Also:
        /// decode_attention_efficiency, bandwidth_efficiency, single_decode_bandwidth_efficiency,
        /// client_stream_s, step_jitter_s, page_fault_s_per_gib. `none` with `--start`: keep every coefficient, and only record the start file's
        /// errors on the runs (its `[[residuals]]`) and check its intervals.
        #[arg(long, value_delimiter = ',', value_name = "PARAM,…")]
        fit: Vec<String>,
        /// Seeds each held-out run is simulated with for the intervals' coverage check.
        #[arg(long, default_value_t = infer_sim::interval::DEFAULT_SEEDS, value_name = "N")]
        seeds: usize,
        /// Refit the coefficients on N bootstrap resamples of each model's fitted runs and
        /// record them (`[[draws]]`): their spread, which a prediction's seeds take in turn.
        #[arg(long, default_value_t = 0, value_name = "N")]
        bootstrap: usize,
        /// The coefficients the bootstrap refits (default: those `--fit` names; needed with
        /// `--fit none`).
        #[arg(long, value_delimiter = ',', value_name = "PARAM,…")]
        bootstrap_fit: Vec<String>,
        /// How the measured engine batches prompts: packed (vLLM, infer; the default),
        /// padded or sequential (one prompt per pass).
        #[arg(long, value_enum)]
        prefill_batching: Option<calibration::PrefillBatching>,
        /// Which positions get logits: sampled (vLLM, infer; the default) or all.
        #[arg(long, value_enum)]
        logits: Option<calibration::LogitRows>,
        /// Whether the engine's attention keeps score matrices in device memory: fused
        /// (flash attention; the default) or materialized (eager attention).
        #[arg(long, value_enum)]
        attention_scores: Option<calibration::AttentionScores>,
        /// Whether a contiguous KV cache takes its memory up front (reserved; the default)
        /// or as it fills (grown: Hugging Face's DynamicCache).
        #[arg(long, value_enum)]
        contiguous_kv: Option<calibration::ContiguousKv>,
        /// How decodes attend over a contiguous KV cache: ragged (each over its own
        /// context; the default) or padded (one batch tensor padded to the longest context:
        /// Hugging Face attention over a batched cache).
        #[arg(long, value_enum)]
        contiguous_decode: Option<calibration::ContiguousDecode>,
        /// Which keys a packed pass's queries are scored against: ragged (each sequence's
        /// own; the default) or masked (every key of the pass, the sequences kept apart by
        /// a mask: transformers' continuous batching without flash attention).
        #[arg(long, value_enum)]
        packed_attention: Option<calibration::PackedAttention>,
        /// Whether the engine overlaps compute with memory traffic (a GPU; the default) or
        /// not (serial: a CPU engine on few cores).
        #[arg(long, value_enum)]
        roofline: Option<calibration::Roofline>,
        /// Try every combination of prefill batching (packed, padded), logits, attention
        /// scores, contiguous KV, contiguous decode, packed attention and roofline — those
        /// the flags do not give — and keep the best fit.
        #[arg(long)]
        search_mechanisms: bool,
        /// Fit the runs again under each KV layout with its prefix reuse — paged blocks
        /// with a global prefix cache, contiguous slots each reusing its last prompt
        /// (`server.kv_cache_backend`) — and print which the runs support: each layout's
        /// fit loss, the chosen one, and per run the layout that predicts it better. The
        /// file keeps the fit under the layout the runs' scenarios give.
        #[arg(long)]
        search_policies: bool,
        /// Host paging speed once device memory spills, GB/s (default: the host link).
        #[arg(long, value_name = "GB_S")]
        spill_bandwidth_gb_s: Option<f64>,
        /// Device memory the engine never gets, GiB (default: the catalog's estimate for
        /// the hardware; a desktop driving a display keeps more).
        #[arg(long, value_name = "GIB")]
        reserved_gib: Option<f64>,
        /// With CUDA graphs, a decode pass replayed from a graph takes this many times its
        /// eager GPU time without its decode attention's compute, never less than eager
        /// (default 1: graphs only save kernel launches).
        #[arg(long, value_name = "FACTOR")]
        graph_replay_factor: Option<f64>,
        /// A packed step of more new tokens than this runs as several passes of at most
        /// this many, each reading the weights (llama.cpp's server: `--ubatch-size`, 512 by
        /// default). Default: one pass.
        #[arg(long, value_name = "TOKENS", value_parser = clap::value_parser!(u64).range(1..))]
        micro_batch_tokens: Option<u64>,
        /// Which sequences a micro-batch may hold: tokens (any; the default) or slot-runs
        /// (only sequences in consecutive slots of a contiguous cache, an equal number of
        /// tokens each: llama.cpp's server with a KV stream per slot).
        #[arg(long, value_enum)]
        micro_batches: Option<calibration::MicroBatches>,
        /// Start from this calibration file's coefficients and keep those `--fit` does not
        /// name (a second stage: refit a few coefficients of an existing calibration). Its
        /// mechanisms are the fit's: every mechanism flag left out takes the file's value
        /// (not the default each flag names), and one that names another is refused.
        #[arg(long, value_name = "FILE")]
        start: Option<PathBuf>,
        /// What was measured (written into the file).
        #[arg(long, default_value = "")]
        engine: String,
        /// Where to write the calibration file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Write report.md (tables, phase comparisons, charts) for run directories, flagging
    /// regressions against --baseline.
    #[cfg(feature = "report")]
    #[command(
        after_help = "Example: Phase 6 (no chunked prefill, no prefix caching) against Phase 8 (the baseline)\n  \
        sim run scenarios/chunked_prefill.toml --out runs/p8\n  \
        sim run scenarios/chunked_prefill.toml --set server.chunked_prefill=false --set server.prefix_caching=false --out runs/p6\n  \
        sim report runs/p6 runs/p8 --baseline runs/p8 --out runs/p6-vs-p8"
    )]
    Report {
        #[arg(required = true, value_name = "RUN_DIR")]
        runs: Vec<PathBuf>,
        /// Compare every run against this one and flag regressions.
        #[arg(long, value_name = "RUN_DIR")]
        baseline: Option<PathBuf>,
        /// Report directory (default: runs/report-<unix time>).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// `sim calibrate --search-policies`: `targets` fitted (by `fit_best`) under each KV layout
/// of [`fit::KV_POLICIES`]; prints each layout's loss, the chosen one, and per run the
/// layout that predicts it better. Returns the fit under the layout every run gives, if
/// they give one.
fn search_kv_policies(
    targets: &[fit::Target],
    fit_best: &dyn Fn(&mut Vec<fit::Target>) -> anyhow::Result<fit::Fit>,
) -> anyhow::Result<Option<fit::Fit>> {
    let given: Vec<_> = targets
        .iter()
        .map(|t| t.setup.scenario.server.kv_cache_backend)
        .collect();
    /// One layout fitted: its loss and each run's.
    struct Tried {
        backend: infer_core::KvBackend,
        name: &'static str,
        what: &'static str,
        loss: f64,
        runs: Vec<(String, f64)>,
    }
    let mut tried = Vec::new();
    let mut kept = None;
    for (backend, name, what) in fit::KV_POLICIES {
        let mut ts = fit::with_kv_backend(targets, backend)?;
        if backend == infer_core::KvBackend::Contiguous {
            if let Some(t) = ts.iter().find(|t| {
                let s = &t.setup.scenario.server;
                s.num_gpu_blocks * s.block_size < s.max_model_len
            }) {
                println!(
                    "policy {what}: not tried: `{}` has no room for one slot",
                    t.label
                );
                continue;
            }
        }
        let f = fit_best(&mut ts)?;
        let runs = fit::run_losses(&fit::rows(&mut ts, &f));
        let theirs = given.iter().all(|&g| g == backend);
        let mark = if theirs { " (the runs' scenarios)" } else { "" };
        println!("policy {what}: fit loss {:.4}{mark}", f.loss());
        tried.push(Tried {
            backend,
            name,
            what,
            loss: f.loss(),
            runs,
        });
        if theirs {
            kept = Some(f);
        }
    }
    // The lowest loss; a tie (runs that do not tell the layouts apart) goes to theirs.
    let theirs = |t: &Tried| given.iter().all(|&g| g == t.backend);
    let Some(chosen) = tried
        .iter()
        .min_by(|a, b| a.loss.total_cmp(&b.loss).then(theirs(b).cmp(&theirs(a))))
    else {
        return Ok(kept);
    };
    let name = chosen.name;
    println!(
        "chosen policy: {} (server.kv_cache_backend = \"{name}\")",
        chosen.what
    );
    if let [a, b] = &tried[..] {
        // Per run: predicted better by a, by b, or alike under both.
        let mut support: [Vec<&str>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        for ((label, la), (_, lb)) in a.runs.iter().zip(&b.runs) {
            let run = label.rsplit('/').next().unwrap_or(label);
            let side = match la.total_cmp(lb) {
                std::cmp::Ordering::Less => 0,
                std::cmp::Ordering::Greater => 1,
                std::cmp::Ordering::Equal => 2,
            };
            support[side].push(run);
        }
        let how = [
            format!("predicted better by {}", a.what),
            format!("predicted better by {}", b.what),
            "predicted alike under both".to_string(),
        ];
        for (runs, how) in support.iter().zip(how) {
            if !runs.is_empty() {
                println!("  runs {how}: {} ({})", runs.len(), runs.join(", "));
            }
        }
    }
    if given.iter().any(|&g| g != chosen.backend) {
        println!(
            "note: the runs' scenarios describe another layout; to predict with this one, \
             set `server.kv_cache_backend = \"{name}\"` in each run's scenario.toml and \
             calibrate again"
        );
    }
    Ok(kept)
}

fn main() -> ExitCode {
    match real_main(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sim: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The overrides `--set`, `--seed` and `--goodput` stand for.
fn overrides(
    mut set: Vec<String>,
    seed: Option<u64>,
    goodput: &[String],
) -> anyhow::Result<Vec<String>> {
    if let Some(s) = seed {
        // A TOML integer stops at 2^63 - 1; larger seeds go as strings.
        if i64::try_from(s).is_ok() {
            set.push(format!("workload.seed={s}"));
        } else {
            set.push(format!("workload.seed=\"{s}\""));
        }
    }
    set.extend(infer_core::metrics::Slo::overrides(goodput)?);
    Ok(set)
}

/// Refuse a `--seeds` outside 1 to [`MAX_SEEDS`]: each seed is a whole simulation, and
/// a count past memory would abort before the first.
fn check_seeds(seeds: usize) -> anyhow::Result<()> {
    if !(1..=MAX_SEEDS).contains(&seeds) {
        anyhow::bail!("--seeds must be 1 to {MAX_SEEDS}, got {seeds}");
    }
    Ok(())
}

/// Refuse a `--bootstrap` past [`MAX_SEEDS`]: each draw is a whole refit, and a
/// prediction's seeds take the draws in turn, so no prediction would use more.
fn check_bootstrap(bootstrap: usize) -> anyhow::Result<()> {
    if bootstrap > MAX_SEEDS {
        anyhow::bail!(
            "--bootstrap must be 0 to {MAX_SEEDS}, got {bootstrap} (a prediction's seeds take \
             the draws in turn, and --seeds stops at {MAX_SEEDS})"
        );
    }
    Ok(())
}

fn real_main(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Catalog => {
            print!("{}", catalog::render());
            Ok(())
        }
        Command::Calibrate {
            runs,
            hold_out,
            published,
            fit,
            seeds,
            bootstrap,
            bootstrap_fit,
            prefill_batching,
            logits,
            attention_scores,
            contiguous_kv,
            contiguous_decode,
            packed_attention,
            roofline,
            search_mechanisms,
            search_policies,
            spill_bandwidth_gb_s,
            reserved_gib,
            graph_replay_factor,
            micro_batch_tokens,
            micro_batches,
            start,
            engine,
            out,
        } => {
            check_seeds(seeds)?;
            check_bootstrap(bootstrap)?;
            let mut targets = Vec::new();
            for p in &published {
                targets.extend(fit::load_published(p)?);
            }
            for d in &runs {
                targets.push(fit::load_run_dir(d, false)?);
            }
            for d in &hold_out {
                targets.push(fit::load_run_dir(d, true)?);
            }
            // A run's errors are recorded by its label: two runs of one label would share them.
            let mut labels: Vec<&str> = targets.iter().map(|t| t.label.as_str()).collect();
            labels.sort_unstable();
            if let Some(w) = labels.windows(2).find(|w| w[0] == w[1]) {
                anyhow::bail!(
                    "two runs are labelled {:?}: give each run once (a run directory, or a \
                     published run, appears twice)",
                    w[0]
                );
            }
            // The bootstrap's coefficients, checked before the fit rather than after it.
            let bootstrap_named = bootstrap_fit
                .iter()
                .map(|p| fit::Param::parse(p))
                .collect::<Result<Vec<_>, _>>()?;
            let params = if fit.is_empty() {
                fit::DEFAULT_PARAMS.to_vec()
            } else if fit == ["none"] {
                if start.is_none() {
                    anyhow::bail!("--fit none keeps the --start file's coefficients: give --start");
                }
                Vec::new()
            } else {
                let named = fit
                    .iter()
                    .map(|p| fit::Param::parse(p))
                    .collect::<Result<Vec<_>, _>>()?;
                for (model, dropped) in fit::unfittable(&named, &targets) {
                    let names: Vec<_> = dropped.iter().map(|p| p.name()).collect();
                    eprintln!(
                        "note: {model}: {} not fitted: its fitted runs do not batch both \
                         statically and continuously (static batching's host costs stay as they were)",
                        names.join(", ")
                    );
                }
                named
            };
            if bootstrap > 0 && params.is_empty() && bootstrap_named.is_empty() {
                anyhow::bail!(
                    "--bootstrap with --fit none: name what it refits with --bootstrap-fit"
                );
            }
            for (label, key) in fit::pinned_by_runs(&targets, &params) {
                eprintln!(
                    "warning: run {label} sets [sim] {key} in its scenario: that value prices it \
                     whatever the fit tries, so the fit learns nothing of {key} from it (remove \
                     the key from the run's scenario.toml)"
                );
            }
            if let Some(v) = spill_bandwidth_gb_s {
                if !(v > 0.0 && v.is_finite()) {
                    anyhow::bail!("--spill-bandwidth-gb-s must be > 0, got {v}");
                }
            }
            if let Some(v) = reserved_gib {
                if !(v >= 0.0 && v.is_finite()) {
                    anyhow::bail!("--reserved-gib must be >= 0, got {v}");
                }
            }
            if let Some(reason) = graph_replay_factor.and_then(calibration::graph_replay_refusal) {
                anyhow::bail!("--graph-replay-factor {reason}");
            }
            if search_mechanisms && start.is_some() {
                anyhow::bail!(
                    "--start keeps a calibration's coefficients, fitted under its mechanisms: \
                     it cannot be combined with --search-mechanisms"
                );
            }
            let start_name = start.as_ref().map(|p| p.display().to_string());
            let start = match &start {
                Some(path) => {
                    let text =
                        std::fs::read_to_string(path).map_err(FileError::at(path, "read"))?;
                    let name = start_name.as_deref().unwrap_or_default();
                    Some(calibration::CalibrationFile::parse(name, &text)?)
                }
                None => None,
            };
            // What the flags leave out: the start file's mechanisms, else the defaults.
            let base = start.as_ref().map(|f| f.mechanisms).unwrap_or_default();
            let given = calibration::Mechanisms {
                prefill_batching: prefill_batching.unwrap_or(base.prefill_batching),
                logits: logits.unwrap_or(base.logits),
                attention_scores: attention_scores.unwrap_or(base.attention_scores),
                contiguous_kv: contiguous_kv.unwrap_or(base.contiguous_kv),
                contiguous_decode: contiguous_decode.unwrap_or(base.contiguous_decode),
                packed_attention: packed_attention.unwrap_or(base.packed_attention),
                roofline: roofline.unwrap_or(base.roofline),
                spill_bandwidth_gb_s: spill_bandwidth_gb_s.or(base.spill_bandwidth_gb_s),
                reserved_gib: reserved_gib.or(base.reserved_gib),
                graph_replay_factor: graph_replay_factor.or(base.graph_replay_factor),
                micro_batch_tokens: micro_batch_tokens
                    .map(|u| u as usize)
                    .or(base.micro_batch_tokens),
                micro_batches: micro_batches.unwrap_or(base.micro_batches),
            };
            // The best fit of `targets` over the mechanisms searched.
            let fit_best = |targets: &mut Vec<fit::Target>| -> anyhow::Result<fit::Fit> {
                let candidates = if search_mechanisms {
                    // The mechanisms the flags give are facts about the server; search the
                    // rest, but not a contiguous cache's where no fitted run has one
                    // (nothing tells them apart).
                    let contiguous = targets.iter().any(|t| {
                        !t.held_out
                            && t.setup.scenario.server.kv_cache_backend
                                == infer_core::KvBackend::Contiguous
                    });
                    let held = fit::Held {
                        prefill_batching: prefill_batching.is_some(),
                        logits: logits.is_some(),
                        attention_scores: attention_scores.is_some(),
                        contiguous_kv: contiguous_kv.is_some() || !contiguous,
                        contiguous_decode: contiguous_decode.is_some() || !contiguous,
                        packed_attention: packed_attention.is_some(),
                        roofline: roofline.is_some(),
                    };
                    fit::mechanism_candidates(&given, held)
                } else {
                    vec![given]
                };
                let mut best: Option<fit::Fit> = None;
                for m in candidates {
                    let named_start = start_name.as_deref().zip(start.as_ref());
                    let f = fit::fit_all(targets, &m, &params, named_start)?;
                    if search_mechanisms {
                        println!("mechanisms {}: fit loss {:.4}", m.describe(), f.loss());
                    }
                    if best.as_ref().is_none_or(|b| f.loss() < b.loss()) {
                        best = Some(f);
                    }
                }
                Ok(best.expect("at least one candidate"))
            };
            // The search fits the runs' own layout too: that fit is kept, not redone.
            let searched = if search_policies {
                search_kv_policies(&targets, &fit_best)?
            } else {
                None
            };
            let best = match searched {
                Some(fit) => fit,
                None => fit_best(&mut targets)?,
            };
            let rows = fit::rows(&mut targets, &best);
            print!("{}", fit::render(&rows, &best));
            let residuals = fit::residuals(&targets, &rows);
            let bootstrap_params = if bootstrap_named.is_empty() {
                params.clone()
            } else {
                bootstrap_named
            };
            let mut draws = fit::bootstrap(&targets, &best, &bootstrap_params, bootstrap);
            if let (Some(start), true, 0) = (&start, params.is_empty(), bootstrap) {
                // Nothing refitted and nothing resampled: the start's coefficients are the
                // file's, and so are their draws.
                draws = start.draws.clone();
            }
            let coverage = fit::coverage(&mut targets, &best, &residuals, &draws, seeds);
            print!("{}", fit::render_coverage(&coverage, seeds));
            if let Some(out) = out {
                let command: Vec<String> = std::env::args().skip(1).collect();
                let mut held_out = targets.iter().filter(|t| t.held_out).count();
                let mut fitted = targets.len() - held_out;
                let mut source = format!(
                    "`sim {}`: {fitted} runs fitted, {held_out} held out",
                    command.join(" "),
                );
                match &start {
                    // Nothing refitted: the file is the start's, with the errors recorded.
                    Some(start) if params.is_empty() => {
                        source = format!(
                            "{}; errors recorded by `sim {}` on {} runs",
                            start.source,
                            command.join(" "),
                            targets.len()
                        );
                        fitted = start.runs_fitted.unwrap_or(fitted);
                        held_out = start.runs_held_out.unwrap_or(held_out);
                    }
                    // The first stage, so that the file says how to make it from nothing.
                    Some(start) => source = format!("{source}; started from {}", start.source),
                    None => {}
                }
                // A second stage describes the engine its start file does, unless told.
                let engine = match &start {
                    Some(file) if engine.is_empty() => file.engine.clone(),
                    _ => engine.clone(),
                };
                let mut file = calibration::CalibrationFile {
                    runs_fitted: Some(fitted),
                    runs_held_out: Some(held_out),
                    residuals,
                    draws,
                    reach: fit::reach(&targets),
                    ..best.file(&engine, &source)
                };
                // The start's models no run here covers keep their coefficients and draws
                // (written to the start's own path, they would otherwise be lost).
                if let Some(start) = &start {
                    for (name, c) in &start.models {
                        if !file.models.contains_key(name) {
                            file.models.insert(name.clone(), *c);
                            // Unless --fit none kept every draw of the start already.
                            if !file.draws.iter().any(|d| &d.model == name) {
                                let theirs = start.draws.iter().filter(|d| &d.model == name);
                                file.draws.extend(theirs.cloned());
                            }
                            println!("{name}: no run of it here, kept from the start file");
                        }
                    }
                }
                let text = format!(
                    "# Written by `sim calibrate`; a scenario uses it with\n\
                     # [sim] calibration = \"{}\"\n{}",
                    out.display(),
                    file.to_toml()
                );
                if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir).map_err(FileError::at(dir, "create"))?;
                }
                std::fs::write(&out, text).map_err(FileError::at(&out, "write"))?;
                println!("calibration file: {}", out.display());
            }
            Ok(())
        }
        #[cfg(feature = "report")]
        Command::Report {
            runs,
            baseline,
            out,
        } => {
            let out = out.unwrap_or_else(|| default_run_dir("report"));
            let report = infer_reports::write_report(&runs, baseline.as_deref(), &out)?;
            for r in &report.regressions {
                println!("regression: {r}");
            }
            println!("report: {}", report.path.display());
            Ok(())
        }
        Command::Run {
            scenario,
            set,
            out,
            seed,
            goodput,
            quiet,
            seeds,
        } => {
            check_seeds(seeds)?;
            let overrides = overrides(set, seed, &goodput)?;
            let text =
                std::fs::read_to_string(&scenario).map_err(FileError::at(&scenario, "read"))?;
            let sc = infer_core::workload::Scenario::parse(&scenario, &text, &overrides)?;
            let mut setup = infer_sim::prepare(&scenario, sc)?;
            infer_sim::trust::check_fragility(&mut setup, &text, &overrides)?;
            let dir = out.unwrap_or_else(|| default_run_dir(&setup.scenario.name));
            let mut files = RunDirWriter::create(&dir)?
                .with_limit(setup.settings.max_output_bytes(), "sim.max_output_mib");
            let tokenizer = infer_sim::simulate::approx_tokenizer(&setup);
            let result = infer_sim::run_with(&setup, tokenizer, &mut files)?;
            let intervals = RunIntervals::of_run(&setup, &result.summary, seeds)?;
            let keys = intervals.as_ref().map_or(Vec::new(), |i| i.summary_keys());
            let info = output::run_info(&setup, intervals.as_ref());
            files.finish_with(&result.summary, &keys, &info)?;
            if quiet {
                for w in &setup.warnings {
                    eprintln!("{w}");
                }
            } else {
                print!("{}", output::console(&setup, &result, intervals.as_ref()));
            }
            println!("run directory: {}", dir.display());
            Ok(())
        }
        Command::Plan {
            scenario,
            slo,
            attainment,
            vary,
            config,
            capacity,
            target_rate,
            set,
            out,
            seed,
            threads,
            quiet,
        } => {
            let started = std::time::Instant::now();
            let text =
                std::fs::read_to_string(&scenario).map_err(FileError::at(&scenario, "read"))?;
            let mut base = overrides(set, seed, &[])?;
            base.extend(infer_core::metrics::Slo::overrides_of("--slo", &slo)?);
            let sc = infer_core::workload::Scenario::parse(&scenario, &text, &base)?;
            let table = match &sc.plan {
                Some(t) => plan::PlanTable::parse(&scenario, t)?,
                None => plan::PlanTable::default(),
            };
            let spec = plan::PlanSpec {
                slo: sc.slo.unwrap_or_default(),
                attainment: attainment.or(table.attainment).unwrap_or(0.9),
                axes: if vary.is_empty() {
                    table.axes
                } else {
                    vary.iter()
                        .map(|v| sweep::parse_axis(v))
                        .collect::<Result<_, _>>()?
                },
                configs: if config.is_empty() {
                    table.configs
                } else {
                    config
                        .iter()
                        .map(|c| plan::parse_config(c))
                        .collect::<Result<_, _>>()?
                },
                capacity: capacity || table.capacity.unwrap_or(false),
                target_rate: target_rate.or(table.target_rate),
                sustained_requests: table.sustained_requests.unwrap_or(1000),
            };
            spec.validate()?;
            let configurations = spec.configurations()?;
            let base = plan::Base {
                file: &scenario,
                text: &text,
                overrides: &base,
            };
            plan::check_space(&base, &spec)?;
            let threads = threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            let outcomes =
                sweep::par_map(&configurations, threads, (!quiet).then_some("plan"), |c| {
                    plan::Outcome {
                        configuration: c.clone(),
                        result: plan::evaluate(&base, &spec, c),
                    }
                });
            let plan = plan::Plan::new(spec, outcomes);
            let dir = out.unwrap_or_else(|| default_run_dir(&format!("{}-plan", sc.name)));
            std::fs::create_dir_all(&dir).map_err(FileError::at(&dir, "create"))?;
            let command: Vec<String> = std::env::args().skip(1).collect();
            for (name, body) in [
                ("plan.csv", plan::csv(&plan)),
                (
                    "plan.md",
                    plan::report(&plan, &scenario, &format!("sim {}", command.join(" "))),
                ),
            ] {
                let path = dir.join(name);
                std::fs::write(&path, body).map_err(FileError::at(&path, "write"))?;
            }
            if quiet {
                print!("{}", plan::answer(&plan));
            } else {
                print!("{}", plan::console(&plan, 20));
            }
            println!(
                "plan files: {0}/plan.csv, {0}/plan.md ({1:.1} s)",
                dir.display(),
                started.elapsed().as_secs_f64()
            );
            Ok(())
        }
        Command::Sweep {
            scenario,
            vary,
            set,
            out,
            seed,
            goodput,
            threads,
            quiet,
            seeds,
        } => {
            let text =
                std::fs::read_to_string(&scenario).map_err(FileError::at(&scenario, "read"))?;
            let axes = vary
                .iter()
                .map(|v| sweep::parse_axis(v))
                .collect::<Result<Vec<_>, _>>()?;
            sweep::check_grid(&axes)?;
            check_seeds(seeds)?;
            let base = overrides(set, seed, &goodput)?;
            // Fail fast on a scenario that is wrong at every point, and on a varied key or
            // value that is wrong at every point that has it (as `sim plan` does).
            let first = infer_sim::prepare(
                &scenario,
                infer_core::workload::Scenario::parse(&scenario, &text, &base)?,
            )?;
            sweep::check_values(&scenario, &text, &base, &axes)?;
            let threads = threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            let points = sweep::run(&scenario, &text, &base, &axes, threads, !quiet, seeds);
            let dir =
                out.unwrap_or_else(|| default_run_dir(&format!("{}-sweep", first.scenario.name)));
            std::fs::create_dir_all(&dir).map_err(FileError::at(&dir, "create"))?;
            let path = dir.join("sweep.csv");
            std::fs::write(&path, sweep::csv(&axes, &points))
                .map_err(FileError::at(&path, "write"))?;
            if !quiet {
                print!("{}", sweep::table(&axes, &points));
            }
            println!("sweep file: {}", path.display());
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{check_bootstrap, check_seeds, Cli};
    use clap::CommandFactory;

    #[test]
    fn seeds_and_bootstrap_draws_are_bounded() {
        assert!(check_seeds(1).is_ok() && check_seeds(1000).is_ok());
        for bad in [0, 1001, usize::MAX] {
            let e = check_seeds(bad).unwrap_err().to_string();
            assert_eq!(e, format!("--seeds must be 1 to 1000, got {bad}"));
        }
        assert!(check_bootstrap(0).is_ok() && check_bootstrap(1000).is_ok());
        let e = check_bootstrap(100_000_000_000).unwrap_err().to_string();
        assert!(
            e.starts_with("--bootstrap must be 0 to 1000, got 100000000000"),
            "{e}"
        );
    }

    /// Every subcommand's `--help` ends with a command to copy (the docs test runs them).
    #[test]
    fn every_subcommands_help_has_an_example() {
        let mut sim = Cli::command();
        assert!(sim.render_long_help().to_string().contains("Example"));
        // clap's own `help` subcommand aside.
        for sub in sim.get_subcommands_mut().filter(|s| s.get_name() != "help") {
            let help = sub.render_long_help().to_string();
            assert!(help.contains("Example"), "sim {}: {help}", sub.get_name());
        }
    }
}
