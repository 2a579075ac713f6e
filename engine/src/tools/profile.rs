//! `engine profile`: time real model steps over a grid of batch compositions and write the
//! profile the simulator's profiled cost model fits (format: `infer_sim::cost::profiled`).
//!
//! Grid: pure prefills (a fresh prompt, a chunk after earlier chunks, bursts of prompts),
//! pure decodes at several batch sizes and context lengths (and over a shared prefix), and
//! mixed steps (a prefill chunk plus decodes), which is what chunked prefill schedules.
//! Each point is the median of warm, back-to-back runs in two rounds. The serving path
//! around the step (loop overhead, HTTP threads sharing the cores, tokenisation) is then
//! measured on an in-process server under a fixed calibration load and folded in, with how
//! far served steps spread around their typical time (the tails the simulator draws).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};

use crate::loadgen::{self, BenchOptions};
use crate::runtime::batch::{ForwardBatch, SeqChunk};
use crate::runtime::model::{LoadedModel, Model};
use crate::runtime::tokenizer::TextTokenizer;
use crate::server::step_log::{self, StepRecord};
use crate::server::{spawn_local, ServeConfig};
use crate::Device;
use infer_core::workload::Tokenizer;
use infer_core::StepShape;
use infer_sim::cost::CostModel;

pub use infer_sim::cost::{
    AfterIdle, AfterPrefill, Profile, ProfileClient, ProfilePoint, ProfileStructuredOutput,
    SincePrefill, StepSpread,
};

/// One step to time: prefill chunks `(start, len)` and decodes at context `ctx`, the first
/// `shared` tokens of which every decode reads from the same blocks (a prefix-cache hit).
#[derive(Debug, Clone, Default)]
struct Shape {
    prefills: Vec<(usize, usize)>,
    decodes: usize,
    decode_ctx: usize,
    shared: usize,
}

impl Shape {
    /// The profile point of this shape measured at `step_s`.
    fn point(&self, step_s: f64) -> ProfilePoint {
        let decode_context = self.decodes * (self.decode_ctx + 1);
        ProfilePoint {
            prefill_tokens: self.prefills.iter().map(|p| p.1).sum(),
            decode_seqs: self.decodes,
            context_tokens: self.prefills.iter().map(|&(a, n)| a + n).sum::<usize>()
                + decode_context,
            decode_context_tokens: Some(decode_context),
            // As the simulator counts it: every reader but the one that computed it.
            decode_shared_context_tokens: self.decodes.saturating_sub(1) * self.shared,
            attention_pairs: Some(
                self.prefills
                    .iter()
                    .map(|&(a, n)| (n * a) as f64 + (n * (n + 1)) as f64 / 2.0)
                    .sum::<f64>()
                    + decode_context as f64,
            ),
            chunk_self_pairs: Some(self.prefills.iter().map(|&(_, n)| (n * n) as f64).sum()),
            step_s,
        }
    }
}

/// Where a profile runs: the device, whether decode steps replay CUDA graphs, and whether
/// tokens are sampled on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub device: Device,
    pub cuda_graphs: bool,
    pub device_sampling: bool,
}

impl Target {
    pub const CPU: Target = Target {
        device: Device::Cpu,
        cuda_graphs: false,
        device_sampling: false,
    };

    /// The profile's device label: `cpu`, `cuda:0`, `cuda:0+graphs`,
    /// `cuda:0+graphs+device-sampling`.
    pub fn label(&self) -> String {
        let mut label = self.device.to_string();
        if self.cuda_graphs {
            label += "+graphs";
        }
        if self.device_sampling {
            label += "+device-sampling";
        }
        label
    }

    /// Sets the model up as the target says (graphs of up to `max_batch` sequences of
    /// `max_context` tokens).
    pub fn apply(&self, model: &Model, max_batch: usize, max_context: usize) -> Result<()> {
        if self.cuda_graphs {
            model.enable_cuda_graphs(max_batch, max_context)?;
        }
        if self.device_sampling {
            model.enable_device_sampling()?;
        }
        Ok(())
    }
}

/// Profile `model` (steps and client path) on `target` into the simulator's profile
/// format.
/// What `engine profile` prints: every profiled step beside the fitted cost model's time for
/// it, then the fitted model (or why the profile does not fit).
pub fn describe(profile: &Profile) -> String {
    let fit = infer_sim::cost::Profiled::fit(profile, Default::default());
    let mut s = String::new();
    for p in &profile.points {
        let fitted = match &fit {
            Ok(f) => {
                let t = f.predict_point(p);
                format!(
                    " (fit {:.3} ms, {:+.0}%)",
                    t * 1e3,
                    (t / p.step_s - 1.0) * 100.0
                )
            }
            Err(_) => String::new(),
        };
        s.push_str(&format!(
            "step_ms[prefill={},decode={},context={}]: {:.3} ms{fitted}\n",
            p.prefill_tokens,
            p.decode_seqs,
            p.context_tokens,
            p.step_s * 1e3
        ));
    }
    match &fit {
        Ok(fit) => s.push_str(&format!("{}\n", CostModel::describe(fit))),
        Err(e) => s.push_str(&format!("the profile does not fit: {e}\n")),
    }
    s
}

pub async fn profile_model(model: &str, target: Target, quick: bool) -> Result<Profile> {
    let m = model.to_string();
    let (lm, points) = tokio::task::spawn_blocking(move || {
        let lm = crate::runtime::model::load_model(&m, None, target.device)?;
        // The grid's decode batches go up to 32; contexts stay below 4,096.
        let max_len = lm.config.max_position_embeddings.min(4096);
        target.apply(&lm.model, 32, max_len)?;
        let (points, structured) = crate::runtime::host::run_in_compute_pool("profile", || {
            anyhow::Ok((
                profile_steps(&lm, quick, 6)?,
                measure_structured_output(&lm, quick)?,
            ))
        })??;
        anyhow::Ok((lm, (points, structured)))
    })
    .await??;
    let (mut points, structured_output) = points;
    drop(lm);
    let ServingPath {
        client,
        step_spread,
        after_prefill,
        after_idle,
    } = measure_serving_path(model, target, &mut points).await?;
    Ok(Profile {
        model: model.to_string(),
        device: target.label(),
        points,
        client: Some(client),
        structured_output,
        step_spread,
        after_prefill,
        after_idle,
    })
}

/// Structured output's host cost per token: sequences decode under the workload grammar
/// ([`workload_schema`], compact) through the engine core, greedy, and every constrained
/// token's grammar work — copying the logits, llguidance's mask, applying it, advancing the
/// grammar — is timed inside the sampler. The mean is what each constrained sequence adds
/// to a step (the engine thread does it between the forward and the next step, serially).
/// `None` when the model's vocabulary cannot be read as bytes (no grammar can run).
pub fn measure_structured_output(
    lm: &LoadedModel,
    quick: bool,
) -> Result<Option<ProfileStructuredOutput>> {
    use crate::runtime::engine_core::{EngineCore, EngineRequest};
    use crate::runtime::sampling::SamplingParams;
    use crate::runtime::structured::{workload_schema, Grammar, GrammarCompiler, WORKLOAD_GRAMMAR};
    let compiler =
        match GrammarCompiler::new(&lm.tokenizer, lm.config.vocab_size, &lm.eos_token_ids) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("structured output not profiled: {e:#}");
                return Ok(None);
            }
        };
    let grammar = Grammar::JsonSchema {
        schema: workload_schema(),
        any_whitespace: false,
    };
    let (seqs, tokens) = if quick { (4, 64) } else { (8, 256) };
    let vocab = lm.config.vocab_size as u32;
    let requests = (0..seqs)
        .map(|i| {
            anyhow::Ok(EngineRequest {
                prompt: (0..32)
                    .map(|k| ((k * 17 + i * 101 + 3) as u32) % vocab)
                    .collect(),
                params: SamplingParams::greedy(),
                max_tokens: tokens,
                stop_strings: Default::default(),
                stop_token_ids: Vec::new(),
                ignore_eos: false,
                keep_special_tokens: false,
                forks: Vec::new(),
                prompt_logprobs: None,
                constraint: Some(compiler.compile(&grammar)?),
                priority: 0,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let opts = crate::tools::generate::GenerateOptions::default();
    let mut core = EngineCore::new(lm, opts.scheduler_config(lm, &requests), 0)?;
    for (i, request) in requests.into_iter().enumerate() {
        core.add(i as u64, request, Instant::now())
            .map_err(|e| anyhow!("{e}"))?;
    }
    while core.has_unfinished() {
        let out = core.step();
        if let Some((_, _, why)) = out.failed.first() {
            return Err(anyhow!("structured output failed while profiling: {why}"));
        }
    }
    let (seconds, tokens) = core.constraint_cost();
    Ok(Some(ProfileStructuredOutput {
        token_s: seconds / tokens.max(1) as f64,
        tokens,
        grammar: WORKLOAD_GRAMMAR.to_string(),
    }))
}

fn grid(max_len: usize, quick: bool) -> Vec<Shape> {
    let mut g = Vec::new();
    let lens: &[usize] = if quick {
        &[64, 512]
    } else {
        &[16, 64, 128, 256, 512, 1024, 2048]
    };
    for &p in lens.iter().filter(|&&p| p < max_len) {
        g.push(Shape {
            prefills: vec![(0, p)],
            ..Shape::default()
        });
    }
    // Chunks that follow earlier chunks (or a prefix-cache hit).
    for &start in if quick {
        &[512, 1024][..]
    } else {
        &[512, 1024, 1536][..]
    } {
        if start + 512 < max_len {
            g.push(Shape {
                prefills: vec![(start, 512)],
                ..Shape::default()
            });
        }
    }
    // Short suffixes after a long cached prefix (a shared system prompt, a chat's next
    // turn): they read the whole prefix for few queries, which the 512-token chunks alone
    // cannot tell apart from their pairs.
    let suffixes: &[(usize, usize)] = if quick {
        &[(1024, 64)]
    } else {
        &[
            (512, 64),
            (1024, 64),
            (2048, 64),
            (512, 128),
            (1024, 128),
            (2048, 128),
        ]
    };
    for &(start, n) in suffixes.iter().filter(|&&(a, n)| a + n < max_len) {
        g.push(Shape {
            prefills: vec![(start, n)],
            ..Shape::default()
        });
    }
    // Several prompts in one step (unchunked bursts), up to 4,096 tokens.
    let bursts: &[(usize, usize)] = if quick {
        &[(4, 256)]
    } else {
        &[(2, 256), (4, 256), (8, 256), (4, 1024)]
    };
    for &(n, len) in bursts.iter().filter(|&&(_, len)| len < max_len) {
        g.push(Shape {
            prefills: vec![(0, len); n],
            ..Shape::default()
        });
    }
    let batches: &[usize] = if quick {
        &[1, 16]
    } else {
        &[1, 2, 4, 8, 16, 24, 32]
    };
    let ctxs: &[usize] = if quick {
        &[256, 1024]
    } else {
        &[128, 512, 1024, 2048]
    };
    for &d in batches {
        for &c in ctxs.iter().filter(|&&c| c < max_len) {
            g.push(Shape {
                decodes: d,
                decode_ctx: c,
                ..Shape::default()
            });
        }
    }
    for &d in if quick { &[8][..] } else { &[4, 12, 24][..] } {
        for &p in if quick { &[256][..] } else { &[128, 488][..] } {
            g.push(Shape {
                prefills: vec![(0, p)],
                decodes: d,
                decode_ctx: 512,
                ..Shape::default()
            });
        }
    }
    // Decodes sharing a 1,024-token prefix (prefix caching): shared blocks read again.
    for &d in if quick { &[][..] } else { &[8, 24][..] } {
        if 1280 < max_len {
            g.push(Shape {
                decodes: d,
                decode_ctx: 1280,
                shared: 1024,
                ..Shape::default()
            });
        }
    }
    g
}

/// Time the grid on `lm`: about `reps` timed runs per shape, in two rounds (each point
/// keeps the median).
pub fn profile_steps(lm: &LoadedModel, quick: bool, reps: usize) -> Result<Vec<ProfilePoint>> {
    let block_size = 16;
    let max_len = lm.config.max_position_embeddings.min(4096);
    let shapes = grid(max_len, quick);
    // One pool large enough for the largest shape; block tables are disjoint sets of it.
    let need = shapes
        .iter()
        .map(|s| {
            let p: usize = s
                .prefills
                .iter()
                .map(|&(a, n)| (a + n).div_ceil(block_size))
                .sum();
            p + s.decodes * (s.decode_ctx + 1).div_ceil(block_size)
                - s.decodes.saturating_sub(1) * (s.shared / block_size)
        })
        .max()
        .unwrap_or(1);
    let mut kv = lm.model.new_kv_cache(need, block_size)?;
    lm.model.fill_pattern(&mut kv)?;
    // Block ids in a scattered order, as a server's free list hands them out after a while
    // (reads then cross a page boundary at every block).
    let mut order: Vec<u32> = (0..need as u32).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let vocab = lm.config.vocab_size as u32;
    let mut batches = Vec::with_capacity(shapes.len());
    for shape in &shapes {
        let mut next_block = 0;
        let mut table = |len: usize| {
            let n = len.div_ceil(block_size);
            let t: Vec<u32> = order[next_block..next_block + n].to_vec();
            next_block += n;
            t
        };
        let mut seqs = Vec::new();
        for (i, &(start, n)) in shape.prefills.iter().enumerate() {
            let tokens = (0..n)
                .map(|k| ((k * 31 + i * 7 + 11) as u32) % vocab)
                .collect();
            seqs.push(SeqChunk {
                tokens,
                start_pos: start,
                block_table: table(start + n),
                sample: true,
                all_logits: false,
            });
        }
        let shared = table(shape.shared); // a whole number of blocks
        for i in 0..shape.decodes {
            let tok = ((i * 13 + 5) as u32) % vocab;
            let c = shape.decode_ctx;
            let mut block_table = shared.clone();
            block_table.extend(table(c + 1 - shape.shared));
            seqs.push(SeqChunk {
                tokens: vec![tok],
                start_pos: c,
                block_table,
                sample: true,
                all_logits: false,
            });
        }
        batches.push(ForwardBatch { seqs });
    }
    // Rounds over the whole grid, so that a slow spell of this shared machine lands on a
    // few samples of many points rather than on all of one point; within a round a shape
    // runs back to back after a warm-up, as a server's consecutive steps do (weights and
    // KV warm in cache; a shape timed cold after a large one would read the model from
    // DRAM and look up to twice as slow as serving finds it).
    let rounds = 2;
    let per_round = reps.max(2).div_ceil(rounds);
    let mut times = vec![Vec::new(); shapes.len()];
    let step = |batch: &ForwardBatch, kv: &mut crate::KvCache| -> Result<f64> {
        let t = Instant::now();
        let logits = lm.model.forward(batch, kv)?;
        // A real step also reads the logits back and samples (greedy, as the benchmarks do).
        for row in logits.iter() {
            std::hint::black_box(crate::runtime::sampling::argmax(row));
        }
        Ok(t.elapsed().as_secs_f64())
    };
    for _ in 0..rounds {
        for (batch, times) in batches.iter().zip(times.iter_mut()) {
            // Warm up for a few steps or 20 ms, then time at least `per_round` steps and
            // 30 ms' worth: sub-millisecond steps get enough samples for a steady median.
            let (mut warm, mut n) = (0.0, 0);
            while n < 2 || (warm < 0.02 && n < 50) {
                warm += step(batch, &mut kv)?;
                n += 1;
            }
            let (mut spent, mut n) = (0.0, 0);
            while n < per_round || (spent < 0.03 && n < 100) {
                let t = step(batch, &mut kv)?;
                times.push(t);
                spent += t;
                n += 1;
            }
        }
    }
    let points = shapes
        .iter()
        .zip(times)
        .map(|(shape, mut times)| {
            times.sort_by(f64::total_cmp);
            shape.point(times[times.len() / 2])
        })
        .collect();
    Ok(points)
}

/// A mixed load for calibrating the serving path: prompts of 64–1,024 tokens arriving as a
/// Poisson stream, decoding beside each other and beside chunked prefills. Fixed, so that
/// a profile never depends on the scenarios it will predict.
const CALIBRATION_SCENARIO: &str = r#"
name = "serving-calibration"
description = "engine profile: the serving path under a mixed load"
[workload]
num_requests = 48
warmup_requests = 1
seed = 7
prompt_tokens = { uniform = [64, 1024] }
output_tokens = { uniform = [32, 160] }
ignore_eos = true
[arrival]
kind = "poisson"
rate = 8.0
"#;

/// The client path's probes: one request at a time, one token out, as `engine bench` sends
/// them (streamed, the prompt a window of its text corpus cut in the model's own tokens,
/// like the runs' prompts: what tokenising costs depends on the text), the prompt of 16 tokens (the per-request part) or
/// of 1,024 (the per-token part; as long as the scenarios' longer prompts), about half each.
const PROBE_SCENARIO: &str = r#"
name = "client-path-probes"
description = "engine profile: one-token completions, one at a time"
[workload]
num_requests = 24
warmup_requests = 0
seed = 11
prompt_tokens = { mix = [ { weight = 1, uniform = [16, 16] }, { weight = 1, uniform = [1024, 1024] } ] }
output_tokens = 1
[arrival]
kind = "concurrency"
max_concurrency = 1
"#;

/// The serving path around the model step, measured on in-process servers with the bench
/// client beside them (as `engine verify` runs them, sharing this machine's cores):
///
/// * per step and per running sequence: a fixed mixed load ([`CALIBRATION_SCENARIO`]) is
///   served with a step log, and each busy step's period (start to the next step's start)
///   is compared with what the offline profile predicts for its shape. The excess — work
///   outside the forward (scheduling, detokenising, handing chunks to the streams) and the
///   forward's slowdown from HTTP and client threads sharing the cores — is fitted as a
///   per-step plus a per-sequence cost (least squares over the middle 80% of steps);
/// * per request and per prompt token: TTFT of one-token completions of a short and of a
///   1,024-token prompt ([`PROBE_SCENARIO`]), minus the steps that served them as the step
///   log measured them
///   ([`client_paths`]); the difference between the two gives the per-token part
///   (tokenising, hashing, copying), the short one the fixed part (HTTP);
/// * the spread of served steps: each busy step's period over its typical time (the
///   offline prediction plus the fitted excess), as quantiles per band of step time
///   ([`StepSpread`]): the simulator draws each step's factor from it, which is what its
///   tail latencies (ITL P99) need;
/// * the decode steps just after a prefill: what each of the first few takes beyond its
///   typical time, over what a steady one does ([`AfterPrefill`]); the excess and the
///   spread are measured on the other steps;
/// * the first step after an idle spell: its time over its typical time ([`AfterIdle`]),
///   what a request arriving at an idle engine pays on top of its prefill.
///
/// The step overheads are added to every profiled point (they are part of an engine step).
async fn measure_serving_path(
    model: &str,
    target: Target,
    points: &mut [ProfilePoint],
) -> Result<ServingPath> {
    let offline = infer_sim::cost::Profiled::fit(
        &Profile {
            model: model.to_string(),
            device: target.label(),
            points: points.to_vec(),
            client: None,
            structured_output: None,
            step_spread: None,
            after_prefill: None,
            after_idle: None,
        },
        Default::default(),
    )
    .map_err(|e| anyhow!("the profile does not fit: {e}"))?;
    let tmp = std::env::temp_dir().join(format!("infer-calibration-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let (log, scenario) = (tmp.join("steps.csv"), tmp.join("calibration.toml"));
    let probe_scenario = tmp.join("probes.toml");
    std::fs::write(&scenario, CALIBRATION_SCENARIO)?;
    std::fs::write(&probe_scenario, PROBE_SCENARIO)?;
    // The probes' prompts are cut in the model's own tokens, as `engine verify` cuts them.
    let dir = {
        let model = model.to_string();
        tokio::task::spawn_blocking(move || crate::tools::builtin::resolve(&model)).await??
    };
    let tokenizer: Arc<dyn Tokenizer> = Arc::new(TextTokenizer::from_dir(&dir)?);
    let cfg = ServeConfig {
        step_log: Some(log.clone()),
        device: target.device,
        cuda_graphs: target.cuda_graphs,
        device_sampling: target.device_sampling,
        ..ServeConfig::new(model)
    };
    let chunk = cfg.sched.prefill_chunk_size;
    let (addr, server) = spawn_local(cfg).await?;
    let base = format!("http://{addr}");
    let calibration = loadgen::run(&BenchOptions::new(&base, &scenario)).await;
    // One-token completions of a short and of a long prompt, one at a time (each starts
    // with its own number: the prefix cache never hits): TTFT minus the prompt's steps is
    // the client path, and its growth with the prompt is the per-token part (tokenising,
    // hashing, copying).
    let probes = match &calibration {
        Ok(_) => {
            let opts = BenchOptions {
                tokenizer: Some(tokenizer),
                ..BenchOptions::new(&base, &probe_scenario)
            };
            loadgen::run(&opts).await.and_then(|run| {
                run.records
                    .iter()
                    .map(|r| match r.ttft {
                        Some(ttft) => Ok((r.prompt_tokens, ttft)),
                        None => Err(anyhow!(
                            "a client-path probe failed: {}",
                            r.error.as_deref().unwrap_or("no token")
                        )),
                    })
                    .collect::<Result<Vec<(usize, f64)>>>()
            })
        }
        Err(_) => Ok(Vec::new()),
    };
    server.stop().await;
    calibration.context("the serving calibration")?;
    let probes = probes.context("the client-path probes")?;
    let steps = step_log::read(&log)?;
    let _ = std::fs::remove_dir_all(&tmp);
    let busy: Vec<BusyPeriod> = busy_periods(&steps).collect();
    let (per_step, per_seq) = serving_excess(&busy, &offline)?;
    let excess = |seqs: usize| per_step + per_seq * seqs as f64;
    let typical = |shape: &StepShape| offline.step_time(shape) + excess(shape.num_seqs);
    let against_typical = |steps: &mut dyn Iterator<Item = (&StepShape, f64)>| {
        steps
            .map(|(shape, served)| (typical(shape), served))
            .collect::<Vec<_>>()
    };
    let spread = StepSpread::measure(&against_typical(
        &mut busy
            .iter()
            .filter(|b| b.steady())
            .map(|b| (b.shape, b.period_s)),
    ));
    let after_prefill = AfterPrefill::measure(
        &busy
            .iter()
            .filter(|b| b.shape.prefill_tokens == 0 && b.quiet())
            .map(|b| {
                let at = b.since_prefill;
                (at.steps, at.prompt_tokens, typical(b.shape), b.period_s)
            })
            .collect::<Vec<_>>(),
    );
    // A step an arrival overlapped, against its typical time and what it pays after a
    // prefill (nothing, for a step with prompt tokens: it stands 0 steps after one).
    let overlap = overlap_step_loss(
        &busy
            .iter()
            .filter(|b| !b.quiet())
            .map(|b| {
                let after = after_prefill
                    .as_ref()
                    .map_or(0.0, |a| a.extra(b.since_prefill));
                (typical(b.shape) + after, b.period_s, b.path_s)
            })
            .collect::<Vec<_>>(),
    );
    let after_idle = AfterIdle::measure(&against_typical(&mut cold_steps(&steps)));
    let paths = client_paths(&probes, &steps, chunk)?;
    let (short, long) =
        short_and_long(&paths).ok_or_else(|| anyhow!("the client-path probes measured nothing"))?;
    let per_prompt_token_s = if long.0 > short.0 {
        ((long.1 - short.1) / (long.0 - short.0) as f64).max(0.0)
    } else {
        0.0
    };
    let request_s = (short.1 - per_prompt_token_s * short.0 as f64).max(0.0);
    for p in points.iter_mut() {
        p.step_s += excess(p.decode_seqs + usize::from(p.prefill_tokens > 0));
    }
    eprintln!(
        "serving overhead: {:.3} ms per step + {:.3} ms per sequence (over {} served steps)",
        per_step * 1e3,
        per_seq * 1e3,
        steps.len()
    );
    eprintln!(
        "client path: {:.3} ms per request + {:.2} us per prompt token (probes of {} and {} tokens)",
        request_s * 1e3,
        per_prompt_token_s * 1e6,
        short.0,
        long.0
    );
    match &spread {
        Some(s) => eprintln!("{}", s.describe()),
        None => eprintln!("step spread: too few busy served steps to measure it"),
    }
    match overlap {
        Ok((loss, n)) => eprintln!(
            "a step loses {:.0}% of its pace while a request is in the server's path \
             (median of {n} steps it mostly overlapped)",
            loss * 100.0
        ),
        Err(n) => eprintln!(
            "a step beside a request's path: too few overlapped steps to measure it ({n})"
        ),
    }
    match &after_prefill {
        Some(a) => eprintln!("{}", a.describe()),
        None => eprintln!("after a prefill: the decode steps took no longer than the rest"),
    }
    match &after_idle {
        Some(a) => eprintln!("{}", a.describe()),
        None => eprintln!("after idle: too few steps after an idle spell to measure it"),
    }
    let client = ProfileClient {
        request_s,
        per_prompt_token_s,
        stream_s: 0.0,
        overlap_step_loss: overlap.map_or(0.0, |(loss, _)| loss),
    };
    Ok(ServingPath {
        client,
        step_spread: spread,
        after_prefill,
        after_idle,
    })
}

/// What [`measure_serving_path`] measures.
struct ServingPath {
    client: ProfileClient,
    step_spread: Option<StepSpread>,
    after_prefill: Option<AfterPrefill>,
    after_idle: Option<AfterIdle>,
}

/// A busy served step ([`busy_periods`]).
struct BusyPeriod<'a> {
    shape: &'a StepShape,
    /// From its start to the next step's: what a decoding request sees between two tokens.
    period_s: f64,
    /// Where it stands after the last step with prompt tokens.
    since_prefill: SincePrefill,
    /// How long the server's request path was busy within the period (an arrival's
    /// parsing and tokenising, on the same cores); 0 where the log has no path clock.
    path_s: f64,
}

impl BusyPeriod<'_> {
    /// No request's path overlapped it ([`overlap_step_loss`] prices those).
    fn quiet(&self) -> bool {
        self.path_s <= 0.0
    }

    /// Quiet, and not one of the decode steps just after a prefill ([`AfterPrefill`]
    /// prices those).
    fn steady(&self) -> bool {
        self.quiet() && !(1..=AfterPrefill::MAX_STEPS).contains(&self.since_prefill.steps)
    }
}

/// Each busy served step with its period. Busy: the next step decodes (a sequence ran on,
/// so the engine went straight on to it) and starts within 5 ms of this one's end. A step
/// after which the engine ran dry and waited for an arrival is not one: its period holds
/// the wait, which the simulator's own arrivals already make. Nor is a step that started
/// cold ([`cold_steps`]): what it costs is measured apart.
fn busy_periods(steps: &[StepRecord]) -> impl Iterator<Item = BusyPeriod<'_>> {
    let mut counter = SincePrefill::default();
    let since_prefill: Vec<SincePrefill> = steps
        .iter()
        .map(|s| counter.next(s.shape.prefill_tokens))
        .collect();
    steps
        .windows(3)
        .enumerate()
        .filter(|(_, w)| {
            w[1].idle_after(&w[0]) < AfterIdle::IDLE_S
                && w[2].shape.decode_seqs > 0
                && w[2].idle_after(&w[1]) < 0.005
        })
        .map(move |(i, w)| BusyPeriod {
            shape: &w[1].shape,
            period_s: w[2].t_s - w[1].t_s,
            since_prefill: since_prefill[i + 1],
            path_s: match (w[1].path_busy_s, w[2].path_busy_s) {
                (Some(a), Some(b)) => (b - a).max(0.0),
                _ => 0.0,
            },
        })
}

/// The share of a step's pace lost while a request is in the server's path
/// ([`ClientPath::overlap_step_loss`](infer_sim::cost::ClientPath::overlap_step_loss)),
/// from busy periods that a request's path overlapped, each `(typical_s, period_s,
/// path_s)`: a period overlapped for `path_s` takes `typical + loss × path_s`, so each
/// period the path overlapped for at least half of it gives `(period − typical) / path_s`,
/// and the median of those is taken (a period lengthened by something else does not move
/// it). With fewer than 10 such periods, `Err` with their count; else the loss and the
/// count.
fn overlap_step_loss(periods: &[(f64, f64, f64)]) -> Result<(f64, usize), usize> {
    let mut losses: Vec<f64> = periods
        .iter()
        .filter(|&&(typical, period, path)| typical > 0.0 && path >= 0.5 * period)
        .map(|&(typical, period, path)| ((period - typical) / path).clamp(0.0, 0.95))
        .collect();
    if losses.len() < 10 {
        return Err(losses.len());
    }
    losses.sort_by(f64::total_cmp);
    Ok((losses[losses.len() / 2], losses.len()))
}

/// Each step that started at least [`AfterIdle::IDLE_S`] after the one before it ended (the
/// engine had run out of work), with its own time.
fn cold_steps(steps: &[StepRecord]) -> impl Iterator<Item = (&StepShape, f64)> {
    steps
        .windows(2)
        .filter(|w| w[1].idle_after(&w[0]) >= AfterIdle::IDLE_S)
        .map(|w| (&w[1].shape, w[1].step_s))
}

/// Each probe's client path: its TTFT less the time of the steps that served it, as the
/// step log measured them. The probes ran one at a time after everything else, so their
/// steps end the log, each probe's prompt in chunks as [`fresh_prompt_steps`] cuts it.
/// Measured rather than predicted steps, because a step's own noise (a tenth of a
/// 500-token prefill) is larger than the per-token part of the path being measured, and
/// because a probe's step starts cold, which the simulator prices apart ([`AfterIdle`]).
fn client_paths(
    probes: &[(usize, f64)],
    steps: &[StepRecord],
    chunk: usize,
) -> Result<Vec<(usize, f64)>> {
    let mut end = steps.len();
    let mut paths = Vec::with_capacity(probes.len());
    for &(tokens, ttft) in probes.iter().rev() {
        let expected = fresh_prompt_steps(tokens, chunk);
        let start = end.checked_sub(expected.len()).ok_or_else(|| {
            anyhow!(
                "the step log ends before the probes' steps: it has {} steps",
                steps.len()
            )
        })?;
        let served = &steps[start..end];
        for (step, want) in served.iter().zip(&expected) {
            let s = &step.shape;
            anyhow::ensure!(
                s.prefill_tokens == want.prefill_tokens && s.num_seqs == 1,
                "step at {:.3} s is not a probe's chunk of {} prompt tokens ({} new tokens, \
                 {} sequences): the probes' steps do not end the step log",
                step.t_s,
                want.prefill_tokens,
                s.prefill_tokens,
                s.num_seqs
            );
        }
        paths.push((tokens, ttft - served.iter().map(|s| s.step_s).sum::<f64>()));
        end = start;
    }
    paths.reverse();
    Ok(paths)
}

/// The client paths of the short probes and of the long ones, each as its median prompt
/// length and median seconds; `None` without probes. The two are split halfway between the
/// shortest and the longest prompt, since the server's count of a prompt cut at 16 or 1,024
/// tokens can come out a token off.
fn short_and_long(paths: &[(usize, f64)]) -> Option<((usize, f64), (usize, f64))> {
    let shortest = paths.iter().map(|p| p.0).min()?;
    let longest = paths.iter().map(|p| p.0).max()?;
    let medians = |long: bool| {
        let (mut tokens, mut times): (Vec<usize>, Vec<f64>) = paths
            .iter()
            .filter(|p| (2 * p.0 > shortest + longest) == long || shortest == longest)
            .copied()
            .unzip();
        tokens.sort_unstable();
        times.sort_by(f64::total_cmp);
        (tokens[tokens.len() / 2], times[times.len() / 2])
    };
    Some((medians(false), medians(true)))
}

/// The steps of a fresh `tokens`-token prompt prefilled alone in chunks of `chunk`.
fn fresh_prompt_steps(tokens: usize, chunk: usize) -> Vec<StepShape> {
    let chunk = chunk.max(1);
    (0..tokens)
        .step_by(chunk)
        .map(|start| {
            let end = (start + chunk).min(tokens);
            let n = end - start;
            StepShape {
                num_seqs: 1,
                prefill_tokens: n,
                prefill_seqs: 1,
                max_prefill_chunk: n,
                sampled: usize::from(end == tokens),
                context_tokens: end,
                attention_pairs: (n * start) as f64 + (n * (n + 1) / 2) as f64,
                chunk_self_pairs: (n * n) as f64,
                ..StepShape::default()
            }
        })
        .collect()
}

/// The served steps' excess over `offline`, fitted as `per_step + per_seq × sequences` by
/// least squares over the steady busy steps ([`BusyPeriod::steady`]), dropping the 10% largest and smallest
/// excesses (hiccups of a shared machine). Both parts are kept non-negative.
fn serving_excess(busy: &[BusyPeriod], offline: &infer_sim::cost::Profiled) -> Result<(f64, f64)> {
    use infer_sim::cost::CostModel;
    let mut xy: Vec<(f64, f64)> = busy
        .iter()
        .filter(|b| b.steady())
        .map(|b| {
            (
                b.shape.num_seqs as f64,
                b.period_s - offline.step_time(b.shape),
            )
        })
        .collect();
    anyhow::ensure!(
        xy.len() >= 50,
        "the serving-path calibration logged only {} busy steps",
        xy.len()
    );
    xy.sort_by(|a, b| a.1.total_cmp(&b.1));
    let cut = xy.len() / 10;
    let xy = &xy[cut..xy.len() - cut];
    let line = infer_sim::cost::Line::fit(xy).expect("at least 50 steps");
    let per_seq = line.slope.max(0.0);
    Ok(((line.mean_y - per_seq * line.mean_x).max(0.0), per_seq))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh prompt's chunks cover it once, with the causal pairs of one whole prompt.
    #[test]
    fn fresh_prompt_steps_cover_the_prompt() {
        let steps = fresh_prompt_steps(1100, 512);
        let lens: Vec<usize> = steps.iter().map(|s| s.prefill_tokens).collect();
        assert_eq!(lens, vec![512, 512, 76]);
        let pairs: f64 = steps.iter().map(|s| s.attention_pairs).sum();
        assert_eq!(pairs, (1100 * 1101 / 2) as f64);
        assert_eq!(steps.iter().map(|s| s.sampled).sum::<usize>(), 1);
        assert_eq!(steps.last().unwrap().context_tokens, 1100);
    }

    /// A step's period counts when the engine went straight on to the next step: the next
    /// decodes and starts at once. Not after it ran dry (the next is a fresh prefill) or
    /// waited past 5 ms, nor for a step that started cold (20 ms or more after the one
    /// before), which is measured apart.
    #[test]
    fn busy_periods_and_cold_steps_split_the_log() {
        let step = |t_s: f64, prefill: usize, decodes: usize| StepRecord {
            t_s,
            shape: StepShape {
                prefill_tokens: prefill,
                decode_seqs: decodes,
                num_seqs: decodes + usize::from(prefill > 0),
                ..StepShape::default()
            },
            forward_s: 0.0009,
            constraint_s: 0.0,
            step_s: 0.001,
            path_busy_s: None,
        };
        let steps = [
            step(0.000, 0, 1),
            step(0.001, 100, 1), // a prompt beside a decode, then both decode
            step(0.002, 0, 2),   // 0.5 ms of loop work after it: still busy
            step(0.0035, 0, 1),
            step(0.0045, 0, 1),  // the last token: the engine runs dry
            step(0.0060, 50, 0), // the next request, 0.5 ms later: warm
            step(0.0070, 0, 1),  // then 12 ms until the next step: not busy
            step(0.0200, 0, 1),  // 12 ms idle is not cold
            step(0.0210, 0, 1),  // the last token
            step(0.0600, 80, 0), // 38 ms idle: cold
            step(0.0610, 0, 1),
            step(0.0620, 0, 1),
        ];
        let round = |(shape, t): (&StepShape, f64)| (shape.prefill_tokens, (t * 1e4).round() / 1e4);
        let busy: Vec<(usize, f64)> = busy_periods(&steps)
            .map(|b| round((b.shape, b.period_s)))
            .collect();
        // Steps since the last prompt, for the busy ones.
        let since: Vec<usize> = busy_periods(&steps)
            .map(|b| b.since_prefill.steps)
            .collect();
        assert_eq!(since, [0, 1, 2, 0, 2, 1]);
        let steady: Vec<bool> = busy_periods(&steps).map(|b| b.steady()).collect();
        assert_eq!(steady, [true, false, false, true, false, false]);
        assert_eq!(
            busy,
            [
                (100, 0.001),
                (0, 0.0015),
                (0, 0.001),
                (50, 0.001),
                (0, 0.001),
                (0, 0.001)
            ]
        );
        let cold: Vec<(usize, f64)> = cold_steps(&steps).map(round).collect();
        assert_eq!(cold, [(80, 0.001)]);
    }

    /// A period's path time is the request path's clock from its step's start to the next
    /// one's; the loss is the median over periods the path mostly overlapped.
    #[test]
    fn overlapped_periods_measure_the_pace_a_step_loses() {
        let step = |t_s: f64, path_busy_s: f64| StepRecord {
            t_s,
            shape: StepShape {
                decode_seqs: 1,
                num_seqs: 1,
                ..StepShape::default()
            },
            forward_s: 0.0009,
            constraint_s: 0.0,
            step_s: 0.001,
            path_busy_s: Some(path_busy_s),
        };
        // Steps of 1 ms; a path busy from 2.5 ms to 6 ms, over which they took 2 ms.
        let steps = [
            step(0.000, 0.0),
            step(0.001, 0.0),
            step(0.002, 0.0),
            step(0.003, 0.0005),
            step(0.005, 0.0025),
            step(0.007, 0.0035),
            step(0.008, 0.0035),
        ];
        let paths: Vec<f64> = busy_periods(&steps)
            .map(|b| (b.path_s * 1e4).round() / 1e4)
            .collect();
        assert_eq!(paths, [0.0, 0.0005, 0.002, 0.001, 0.0]);
        let quiet: Vec<bool> = busy_periods(&steps).map(|b| b.steady()).collect();
        assert_eq!(quiet, [true, false, false, false, true]);
        // Periods of 1 ms typical that a path overlapped throughout, served in 5 ms: the
        // step kept a fifth of its pace.
        let slowed: Vec<(f64, f64, f64)> = (0..10).map(|_| (1e-3, 5e-3, 5e-3)).collect();
        let (loss, n) = overlap_step_loss(&slowed).unwrap();
        assert!((loss - 0.8).abs() < 1e-9 && n == 10, "{loss} over {n}");
        // Barely overlapped periods and outliers do not count or move it.
        let mut mixed = slowed.clone();
        mixed.extend((0..100).map(|_| (1e-3, 5e-3, 1e-4)));
        mixed.extend((0..3).map(|_| (1e-3, 50e-3, 40e-3)));
        assert!((overlap_step_loss(&mixed).unwrap().0 - 0.8).abs() < 1e-9);
        assert_eq!(overlap_step_loss(&slowed[..9]), Err(9), "too few");
    }

    /// The probes' steps end the log, a long prompt in chunks; each probe's client path is
    /// its TTFT less its own steps' measured time, and a log that does not end with them is
    /// refused.
    #[test]
    fn client_paths_take_each_probes_measured_steps_from_the_end_of_the_log() {
        let step = |prefill: usize, step_s: f64| StepRecord {
            t_s: 0.0,
            shape: StepShape {
                prefill_tokens: prefill,
                prefill_seqs: usize::from(prefill > 0),
                decode_seqs: usize::from(prefill == 0),
                num_seqs: 1,
                ..StepShape::default()
            },
            forward_s: step_s,
            constraint_s: 0.0,
            step_s,
            path_busy_s: None,
        };
        let steps = [
            step(0, 0.001), // the calibration's last decode
            step(15, 0.002),
            step(15, 0.003),
            step(512, 0.010),
            step(88, 0.004),
        ];
        let probes = [(15, 0.0025), (15, 0.004), (600, 0.020)];
        let paths = client_paths(&probes, &steps, 512).unwrap();
        let round = |(n, t): (usize, f64)| (n, (t * 1e6).round() / 1e6);
        let paths: Vec<(usize, f64)> = paths.into_iter().map(round).collect();
        assert_eq!(paths, [(15, 0.0005), (15, 0.001), (600, 0.006)]);
        let (short, long) = short_and_long(&paths).unwrap();
        assert_eq!((short, long), ((15, 0.001), (600, 0.006)));
        assert_eq!(short_and_long(&[]), None);
        // Counts a token off still fall in their half.
        let paths = [
            (16, 0.5),
            (15, 0.4),
            (17, 0.6),
            (1023, 2.0),
            (1024, 2.1),
            (1025, 1.9),
        ];
        assert_eq!(short_and_long(&paths), Some(((16, 0.5), (1024, 2.0))));
        // A probe whose steps are not there: the log does not end with the probes.
        let err = client_paths(&[(15, 0.002), (600, 0.02)], &steps[..3], 512).unwrap_err();
        assert!(err.to_string().contains("do not end the step log"), "{err}");
        assert!(client_paths(&probes, &steps[3..], 512).is_err());
    }
    use infer_core::StepShape;
    use infer_sim::cost::{CostModel, Profiled};

    /// Both grids determine a fit: enough shapes for the terms they exercise, and the
    /// shapes' counts agree with the simulator's (a linear truth is recovered).
    #[test]
    fn both_grids_fit_a_known_truth() {
        let truth = |p: &ProfilePoint| {
            1e-3 + 2e-4 * (p.prefill_tokens + p.decode_seqs) as f64 + 1e-7 * p.context_tokens as f64
        };
        for quick in [true, false] {
            let mut points: Vec<ProfilePoint> =
                grid(4096, quick).iter().map(|s| s.point(0.0)).collect();
            for p in &mut points {
                p.step_s = truth(p);
            }
            let profile = Profile {
                model: "m".into(),
                device: "d".into(),
                points: points.clone(),
                client: None,
                structured_output: None,
                step_spread: None,
                after_prefill: None,
                after_idle: None,
            };
            let fit = Profiled::fit(&profile, Default::default())
                .unwrap_or_else(|e| panic!("quick={quick}: {e}"));
            assert!(
                fit.rms_rel_error < 0.05,
                "quick={quick}: {}",
                fit.rms_rel_error
            );
            let decode = StepShape {
                decode_seqs: 16,
                context_tokens: 16 * 257,
                decode_context_tokens: 16 * 257,
                attention_pairs: (16 * 257) as f64,
                ..StepShape::default()
            };
            let want = 1e-3 + 2e-4 * 16.0 + 1e-7 * (16 * 257) as f64;
            assert!(
                (fit.step_time(&decode) - want).abs() / want < 0.05,
                "quick={quick}"
            );
            // A short suffix after a long prefix pays for reading the prefix once: the
            // truth's per-context-token term, which the short chunks let the fit see.
            let suffix = Shape {
                prefills: vec![(1500, 40)],
                ..Shape::default()
            }
            .point(0.0);
            let want = truth(&suffix);
            let got = fit.step_time(&StepShape {
                prefill_tokens: 40,
                prefill_seqs: 1,
                num_seqs: 1,
                context_tokens: suffix.context_tokens,
                attention_pairs: suffix.attention_pairs.unwrap(),
                chunk_self_pairs: suffix.chunk_self_pairs.unwrap(),
                ..StepShape::default()
            });
            // Priced as pairs alone it would come out 1.5% short. The quick grid has too
            // few fresh prompts to pin the dense term between its knots: 5% there.
            let tolerance = if quick { 0.05 } else { 0.002 };
            assert!(
                (got - want).abs() / want < tolerance,
                "quick={quick}: {got} vs {want}"
            );
        }
    }
}
