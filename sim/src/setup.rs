//! From a scenario to what a run needs: catalog entries, the memory plan and a cost model.
//! Every refusal here names the file and the key, as scenario errors do.

use infer_core::{FileError, KvBackend};
use std::sync::Arc;

use infer_core::workload::{KvCacheDtype, Scenario, ScenarioError};

use crate::calibration::{Calibration, CalibrationFile};
use crate::catalog::{find_hardware, resolve_model, Dtype, HardwareSpec, ModelSpec};
use crate::cost::{Analytic, CostModel, Profiled};
use crate::error::SimError;
use crate::memory::{self, DoesNotFit, MemoryPlan};
use crate::settings::{readable, CostModelKind, SimSettings};

/// A scenario made ready to simulate.
#[derive(Clone)]
pub struct Setup {
    pub file: String,
    pub scenario: Scenario,
    pub settings: SimSettings,
    pub hardware: HardwareSpec,
    pub model: ModelSpec,
    pub memory: MemoryPlan,
    pub cost: Arc<dyn CostModel>,
    /// The analytic model's calibration as it prices this scenario (overrides applied);
    /// `None` for a profiled cost model.
    pub calibration: Option<Calibration>,
    /// Things the user should know before reading the numbers (memory over-commit, …).
    pub warnings: Vec<String>,
    /// The trace the workload replays (`[workload] trace`), read from its file.
    pub trace: Option<Arc<infer_core::workload::Trace>>,
}

impl Setup {
    /// Run with `cal` (the scenario's `[sim]` overrides on top) instead of the calibration
    /// the scenario names: what `sim calibrate` tries. Analytic cost model only.
    pub fn set_calibration(&mut self, mut cal: Calibration) -> Result<(), DoesNotFit> {
        apply_overrides(&mut cal, &self.settings);
        let cfg = self.scenario.server.scheduler_config();
        let cal = cal.for_server(&cfg);
        let memory = plan_memory(&self.hardware, &self.model, &cfg, &cal)?;
        self.calibration = Some(cal.clone());
        self.cost = Arc::new(analytic(
            &self.hardware,
            &self.model,
            cal,
            &self.scenario.server,
        ));
        self.memory = with_largest_step(memory, &*self.cost, &self.scenario, &self.model);
        Ok(())
    }
}

/// The analytic model of `server`: with CUDA graphs, decode batches up to its
/// `max_batch_size` replay.
fn analytic(
    hw: &HardwareSpec,
    model: &ModelSpec,
    cal: Calibration,
    server: &infer_core::workload::ServerSpec,
) -> Analytic {
    let graphs_up_to = server.cuda_graphs.then_some(server.max_batch_size);
    Analytic::new(hw.clone(), model.clone(), cal, graphs_up_to)
}

/// The memory plan on `hw` with the device memory `cal` says the engine never gets.
fn plan_memory(
    hw: &HardwareSpec,
    model: &ModelSpec,
    cfg: &infer_core::SchedulerConfig,
    cal: &Calibration,
) -> Result<MemoryPlan, DoesNotFit> {
    let mut hw = hw.clone();
    if let Some(gib) = cal.reserved_gib {
        hw.reserved_bytes = gib * 1024.0 * 1024.0 * 1024.0;
    }
    memory::plan(&hw, model, cfg, cal.contiguous_kv)
}

/// `memory` with the cost model's activations for the largest step the scenario allows,
/// where the cost model prices activations (the analytic one does); else (the engine's
/// measured profile) estimated for the engine's largest forward pass.
fn with_largest_step(
    memory: MemoryPlan,
    cost: &dyn CostModel,
    scenario: &Scenario,
    model: &ModelSpec,
) -> MemoryPlan {
    let cfg = scenario.server.scheduler_config();
    let step = memory::largest_step(&cfg, scenario.prompt_range());
    match cost.activation_bytes(&step) {
        bytes if bytes > 0.0 => memory.with_activations(bytes),
        _ => memory::with_engine_passes(memory, model, &cfg),
    }
}

/// Read and parse a scenario file (errors name the file).
pub fn load(path: &str, overrides: &[String]) -> Result<Setup, SimError> {
    let text = std::fs::read_to_string(path).map_err(FileError::at(path, "read"))?;
    let scenario = Scenario::parse(path, &text, overrides)?;
    prepare(path, scenario)
}

pub fn prepare(file: &str, scenario: Scenario) -> Result<Setup, SimError> {
    let at = |key: &str, reason: String| ScenarioError {
        file: file.to_string(),
        key: key.to_string(),
        reason,
    };
    let settings = SimSettings::from_scenario(&scenario).map_err(|(k, r)| at(&k, r))?;
    let hardware = find_hardware(&scenario.server.hardware)
        .map_err(|e| at("server.hardware", e.to_string()))?;
    let mut model =
        resolve_model(&scenario.server.model).map_err(|e| at("server.model", e.to_string()))?;
    // The weights and KV as the server holds them (transformers on a CPU: the config's f32).
    if let Some(dtype) = settings.dtype {
        model.weight_dtype = dtype;
        model.kv_dtype = dtype;
    }
    // An fp8 KV cache halves (from bf16) what the pool holds per token and what a step
    // reads of it: the memory plan and the analytic cost both follow `kv_dtype`.
    if scenario.server.kv_cache_dtype == KvCacheDtype::Fp8 {
        model.kv_dtype = Dtype::Fp8;
    }
    let cfg = scenario.server.scheduler_config();
    let mut cal = match &settings.calibration {
        Some(p) => {
            let path = infer_core::workload::resolve_path(p, file);
            let name = path.display().to_string();
            std::fs::read_to_string(&path)
                .map_err(|e| SimError::from(FileError::at(&path, "read")(e)))
                .and_then(|text| CalibrationFile::parse(&name, &text))
                .and_then(|f| f.calibration(&name, &hardware, &model))
                .map_err(|r| at("sim.calibration", r.to_string()))?
        }
        None => Calibration::for_pair(&hardware, &model)
            .map_err(|r| at("server.model", r.to_string()))?,
    };
    apply_overrides(&mut cal, &settings);
    let cal = cal.for_server(&cfg);
    let uncalibrated = cal.source == crate::calibration::UNCALIBRATED;
    let memory =
        plan_memory(&hardware, &model, &cfg, &cal).map_err(|r| at("server.num_gpu_blocks", r.0))?;
    let mut warnings: Vec<String> = scenario.arrival.unused_keys();
    if cfg.kv_cache_backend != KvBackend::Contiguous {
        // A contiguous cache's mechanisms, asked for in `[sim]`, describe no cache here.
        let asked = [
            ("contiguous_kv", settings.contiguous_kv.is_some()),
            ("contiguous_decode", settings.contiguous_decode.is_some()),
            ("micro_batches", settings.micro_batches.is_some()),
        ];
        for (key, _) in asked.iter().filter(|(_, set)| *set) {
            warnings.push(format!(
                "warning: sim.{key} has no effect: server.kv_cache_backend is not contiguous"
            ));
        }
    }
    let calibration = (settings.cost_model == CostModelKind::Analytic).then(|| cal.clone());
    let cost: Arc<dyn CostModel> = match settings.cost_model {
        CostModelKind::Analytic => {
            if uncalibrated {
                warnings.push(crate::trust::uncalibrated(hardware.name, model.name));
            }
            if let Some(reach) = &cal.reach {
                warnings.extend(crate::trust::extrapolation(
                    reach,
                    &scenario,
                    crate::trust::Measured::Calibration,
                ));
            }
            Arc::new(analytic(&hardware, &model, cal, &scenario.server))
        }
        CostModelKind::Profiled => {
            let p = settings.profile.as_deref().expect("validated");
            let path = infer_core::workload::resolve_path(p, file);
            let text = std::fs::read_to_string(&path).map_err(|e| {
                at(
                    "sim.profile",
                    format!("{}: cannot read: {e}", path.display()),
                )
            })?;
            let mut fit = Profiled::from_json(&text, cal.client)
                .map_err(|r| at("sim.profile", format!("{}: {r}", path.display())))?;
            fit.step_jitter_s = cal.step_jitter_s;
            // A profile's measured client path would otherwise win over `[sim]`'s, and a
            // client cost set there would change nothing.
            let mut client = fit.client_path();
            let set = |slot: &mut f64, v: Option<f64>| *slot = v.unwrap_or(*slot);
            set(&mut client.request_s, settings.client_request_s);
            set(
                &mut client.per_prompt_token_s,
                settings.client_per_prompt_token_s,
            );
            set(&mut client.stream_s, settings.client_stream_s);
            fit.set_client(client);
            if fit.rms_rel_error > 0.25 {
                warnings.push(format!(
                    "warning: the profile fit is loose (rms error {:.0}%)",
                    fit.rms_rel_error * 100.0
                ));
            }
            warnings.extend(crate::trust::extrapolation(
                &fit.coverage,
                &scenario,
                crate::trust::Measured::Profile,
            ));
            if scenario.server.kv_cache_dtype == KvCacheDtype::Fp8 {
                warnings.push(
                    "warning: server.kv_cache_dtype = \"fp8\" sizes the memory plan, but the \
                     profile's step times are the ones it measured (profile the engine with \
                     the fp8 cache, or use the analytic cost model)"
                        .to_string(),
                );
            }
            Arc::new(fit)
        }
    };
    let constrained = scenario
        .workload
        .structured_output
        .is_some_and(|s| s.fraction > 0.0);
    if constrained && cost.constrained_token_s().is_none() {
        return Err(at(
            "workload.structured_output",
            "the cost model has no cost for structured output: use a profile that measured \
             it (`engine profile` writes `structured_output`; sim.cost_model = \"profiled\")"
                .to_string(),
        )
        .into());
    }
    let memory = with_largest_step(memory, &*cost, &scenario, &model);
    warnings.splice(0..0, memory.warning());
    let limit = settings.max_memory_bytes();
    if let Some((key, bytes, what)) = memory_floor(&scenario, file)
        .into_iter()
        .find(|(_, bytes, _)| *bytes > limit as f64)
    {
        return Err(at(
            key,
            format!(
                "{what}: at least {:.0} MiB of the simulator's memory, beyond sim.max_memory_mib \
                 = {} MiB (raise the limit if the machine has the memory)",
                bytes / MIB,
                limit >> 20
            ),
        )
        .into());
    }
    let trace = infer_core::workload::Trace::of_scenario(&scenario, file)?;
    if let Some((key, span, what)) = arrival_span(&scenario, trace.as_deref()) {
        let limit = settings.max_simulated_s();
        if span > limit || span.is_nan() {
            return Err(at(
                key,
                format!(
                    "{what} span {span:.3e} s of simulated time, beyond sim.max_simulated_s = \
                     {} s: a run that long is a mistake (raise sim.max_simulated_s if not)",
                    readable(limit)
                ),
            )
            .into());
        }
    }
    Ok(Setup {
        trace,
        file: file.to_string(),
        scenario,
        settings,
        hardware,
        model,
        memory,
        cost,
        calibration,
        warnings,
    })
}

const MIB: f64 = 1024.0 * 1024.0;

/// Bytes a run of `scenario` certainly holds at one moment, where they are known before it
/// runs: (the key that drives them, the bytes, what holds them). Each is a floor (token ids
/// alone, not their text; the pool's free list alone), so a run refused here would have
/// passed `sim.max_memory_mib` anyway, but only after allocating it all at once, before
/// the run's periodic looks at memory could stop it.
fn memory_floor(scenario: &Scenario, file: &str) -> Vec<(&'static str, f64, String)> {
    use infer_core::workload::ArrivalKind;
    // A token id is a u32; a paged pool keeps a free-list link of 12 bytes per block
    // (core's `FreeQueue`), written for every block as the pool is built.
    const ID_BYTES: f64 = 4.0;
    const POOL_BLOCK_BYTES: f64 = 12.0;
    let w = &scenario.workload;
    let n = w.num_requests;
    let mut floor = Vec::new();
    if let Some(spec) = &w.trace {
        let path = spec.resolve(file);
        if let Ok(meta) = std::fs::metadata(&path) {
            floor.push((
                "workload.trace",
                meta.len() as f64,
                format!("the trace {} is read whole", path.display()),
            ));
        }
    }
    let cfg = scenario.server.scheduler_config();
    if cfg.kv_cache_backend == KvBackend::Paged {
        let replicas = scenario.cluster.as_ref().map_or(1, |c| c.replicas);
        floor.push((
            "server.num_gpu_blocks",
            replicas as f64 * cfg.num_gpu_blocks as f64 * POOL_BLOCK_BYTES,
            format!(
                "{replicas} replica(s) (cluster.replicas) of {} KV blocks each",
                cfg.num_gpu_blocks
            ),
        ));
    }
    // Closed-loop clients all send their first request at the start, generated at once.
    if scenario.arrival.kind == ArrivalKind::Concurrency && w.trace.is_none() {
        let clients = scenario.arrival.max_concurrency.unwrap_or(1).min(n);
        let key = if clients < n {
            "arrival.max_concurrency"
        } else {
            "workload.num_requests"
        };
        let fewest = w.shared_prefix_tokens.unwrap_or(0)
            + w.groups.map_or(0, |g| g.system_tokens)
            + w.conversations.map_or(0, |c| c.system_tokens)
            + w.prompt_tokens.min();
        floor.push((
            key,
            clients as f64 * fewest as f64 * ID_BYTES,
            format!("{clients} clients' first prompts of at least {fewest} tokens, sent at once"),
        ));
    }
    // A conversation's turn holds every earlier turn and reply: turn t of the last round
    // the run reaches is one prompt, generated whole however long it is.
    if let Some(c) = w.conversations {
        let t = c
            .min_turns
            .saturating_sub(1)
            .min(n.saturating_sub(1) / c.count.max(1));
        let tokens = c.system_tokens as f64
            + (t + 1) as f64 * w.prompt_tokens.min() as f64
            + t as f64 * w.output_tokens.min() as f64;
        floor.push((
            "workload.conversations",
            tokens * ID_BYTES,
            format!(
                "turn {} of a conversation is one prompt of at least {tokens:.0} tokens",
                t + 1
            ),
        ));
    }
    floor
}

/// How much simulated time the arrival schedule alone spans, where it is known before the
/// run: (the key that sets it, the span, what spans it).
fn arrival_span(
    scenario: &Scenario,
    trace: Option<&infer_core::workload::Trace>,
) -> Option<(&'static str, f64, String)> {
    use infer_core::workload::ArrivalKind;
    let a = &scenario.arrival;
    let n = scenario.workload.num_requests;
    match a.kind {
        ArrivalKind::Uniform | ArrivalKind::Poisson | ArrivalKind::Gamma => {
            let rate = a.rate?;
            Some((
                "arrival.rate",
                n.saturating_sub(1) as f64 / rate,
                format!("{n} requests at {} requests/s", readable(rate)),
            ))
        }
        ArrivalKind::Stages => Some((
            "arrival.stages",
            a.stages.iter().map(|s| s.duration_s).sum(),
            "the stages".to_string(),
        )),
        ArrivalKind::Trace => {
            let last = trace?.rows.get(n.checked_sub(1)?)?;
            Some((
                "workload.trace",
                last.t_s,
                format!("the trace's first {n} requests (time_scale applied)"),
            ))
        }
        _ => None,
    }
}

/// Put the scenario's `[sim]` overrides on top of a calibration.
pub(crate) fn apply_overrides(cal: &mut Calibration, s: &SimSettings) {
    let before = cal.clone();
    let set = |slot: &mut f64, v: Option<f64>| {
        if let Some(v) = v {
            *slot = v;
        }
    };
    set(&mut cal.compute_efficiency, s.compute_efficiency);
    // Decodes' attention follows the prompts' unless the calibration or `[sim]` sets it.
    let tied = cal.decode_attention_efficiency == cal.attention_efficiency;
    set(&mut cal.attention_efficiency, s.attention_efficiency);
    if tied {
        cal.decode_attention_efficiency = cal.attention_efficiency;
    }
    set(
        &mut cal.decode_attention_efficiency,
        s.decode_attention_efficiency,
    );
    set(&mut cal.bandwidth_efficiency, s.bandwidth_efficiency);
    if s.single_decode_bandwidth_efficiency.is_some() {
        cal.single_decode_bandwidth_efficiency = s.single_decode_bandwidth_efficiency;
    }
    // `step_overhead_s` and `per_seq_overhead_s` set the host costs of whatever batching
    // the scenario runs; `static_…` ones set static batching's alone.
    if let Some(v) = s.step_overhead_s {
        cal.step_overhead_s = v;
        cal.static_step_overhead_s = None;
    }
    if let Some(v) = s.per_seq_overhead_s {
        cal.per_seq_overhead_s = v;
        cal.static_per_seq_overhead_s = None;
    }
    if s.static_step_overhead_s.is_some() {
        cal.static_step_overhead_s = s.static_step_overhead_s;
    }
    if s.static_per_seq_overhead_s.is_some() {
        cal.static_per_seq_overhead_s = s.static_per_seq_overhead_s;
    }
    set(&mut cal.step_jitter_s, s.step_jitter_s);
    if s.page_fault_s_per_gib.is_some() {
        cal.page_fault_s_per_gib = s.page_fault_s_per_gib;
    }
    set(&mut cal.client.request_s, s.client_request_s);
    set(
        &mut cal.client.per_prompt_token_s,
        s.client_per_prompt_token_s,
    );
    set(&mut cal.client.stream_s, s.client_stream_s);
    set(&mut cal.static_batch_window_s, s.static_batch_window_s);
    if let Some(g) = s.spill_bandwidth_gb_s {
        cal.spill_bandwidth = Some(g * 1e9);
    }
    if let Some(g) = s.reserved_gib {
        cal.reserved_gib = Some(g);
    }
    set(&mut cal.graph_replay_factor, s.graph_replay_factor);
    if let Some(u) = s.micro_batch_tokens {
        cal.micro_batch_tokens = Some(u as usize);
    }
    cal.prefill = s.prefill_batching.unwrap_or(cal.prefill);
    cal.logits = s.logits.unwrap_or(cal.logits);
    cal.attention_scores = s.attention_scores.unwrap_or(cal.attention_scores);
    cal.contiguous_kv = s.contiguous_kv.unwrap_or(cal.contiguous_kv);
    cal.contiguous_decode = s.contiguous_decode.unwrap_or(cal.contiguous_decode);
    cal.micro_batches = s.micro_batches.unwrap_or(cal.micro_batches);
    cal.packed_attention = s.packed_attention.unwrap_or(cal.packed_attention);
    cal.roofline = s.roofline.unwrap_or(cal.roofline);
    if *cal != before {
        cal.source.push_str(", with [sim] overrides");
        cal.label.push_str(", with [sim] overrides");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use infer_core::BatchingMode;

    fn settings(set: &[&str]) -> SimSettings {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scenarios/baseline.toml"
        ))
        .unwrap();
        let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        let s = Scenario::parse("baseline.toml", &text, &set).unwrap();
        SimSettings::from_scenario(&s).unwrap()
    }

    fn load_err(name: &str, set: &[&str]) -> String {
        let file = format!("{}/../scenarios/{name}.toml", env!("CARGO_MANIFEST_DIR"));
        let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        match load(&file, &set) {
            Ok(_) => panic!("{set:?} was accepted"),
            Err(e) => e.to_string(),
        }
    }

    /// What a run would allocate at once, before its first look at memory, is refused
    /// before it starts, naming the key that drives it and `sim.max_memory_mib`.
    #[test]
    fn memory_a_run_would_take_at_once_is_refused_before_it_runs() {
        // 200,000 clients' first prompts of 2,000 tokens: 1.5 GiB of token ids at the start.
        let closed_loop = [
            "arrival.kind=concurrency",
            "arrival.max_concurrency=200000",
            "workload.num_requests=200000",
            "workload.prompt_tokens=2000",
            "sim.max_memory_mib=500",
        ];
        let e = load_err("baseline", &closed_loop);
        assert!(
            e.contains(
                "key `workload.num_requests`: 200000 clients' first prompts of at least \
                 2000 tokens, sent at once: at least 1526 MiB"
            ) && e.contains("beyond sim.max_memory_mib = 500 MiB"),
            "{e}"
        );
        // Fewer clients than requests: the clients drive it.
        let mut fewer = closed_loop.to_vec();
        fewer[2] = "workload.num_requests=300000";
        let e = load_err("baseline", &fewer);
        assert!(e.contains("key `arrival.max_concurrency`"), "{e}");
        // Under the limit, or with its default, the same workload is taken.
        let mut smaller = closed_loop.to_vec();
        smaller[1] = "arrival.max_concurrency=1000";
        assert!(load(
            &format!("{}/../scenarios/baseline.toml", env!("CARGO_MANIFEST_DIR")),
            &smaller.iter().map(|s| s.to_string()).collect::<Vec<_>>()
        )
        .is_ok());
        // 16 KV pools of 20M blocks, built before the first event.
        let e = load_err(
            "baseline",
            &[
                "server.model=qwen2.5-0.5b",
                "server.hardware=h200",
                "server.kv_cache_dtype=fp8",
                "server.block_size=1",
                "server.num_gpu_blocks=20000000",
                "cluster={replicas=16, router=\"round-robin\"}",
                "sim.max_memory_mib=500",
            ],
        );
        assert!(
            e.contains(
                "key `server.num_gpu_blocks`: 16 replica(s) (cluster.replicas) of \
                 20000000 KV blocks each: at least 3662 MiB"
            ) && e.contains("sim.max_memory_mib = 500 MiB"),
            "{e}"
        );
        // The 100,000th turn of one conversation: one prompt of 2e8 tokens.
        let e = load_err(
            "baseline",
            &[
                "workload.conversations={count=1, min_turns=100000}",
                "workload.num_requests=100000",
                "workload.prompt_tokens=1000",
                "workload.output_tokens=1000",
                "sim.max_memory_mib=500",
            ],
        );
        assert!(
            e.contains(
                "key `workload.conversations`: turn 100000 of a conversation is one \
                 prompt of at least 199999000 tokens"
            ) && e.contains("sim.max_memory_mib = 500 MiB"),
            "{e}"
        );
        // A trace is read whole (the shipped sample is 1,434 bytes).
        let e = load_err("trace_replay", &["sim.max_memory_mib=0.001"]);
        assert!(
            e.contains("key `workload.trace`: the trace") && e.contains("is read whole"),
            "{e}"
        );
    }

    /// A profile's measured client path gives way to `[sim]`'s client costs, as a
    /// calibration's does: a key set there is honoured whichever cost model runs.
    #[test]
    fn sim_client_costs_override_a_profiles_measured_ones() {
        let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/plan_cpu.toml");
        let client = |set: &[&str]| {
            let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
            load(file, &set).unwrap().cost.client_path()
        };
        let measured = client(&[]);
        assert!(measured.request_s > 0.0, "the shipped profile measured it");
        let set = client(&["sim.client_request_s=0.25", "sim.client_stream_s=0.001"]);
        assert_eq!(set.request_s, 0.25);
        assert_eq!(set.stream_s, 0.001);
        // What is not set stays the profile's.
        assert_eq!(set.per_prompt_token_s, measured.per_prompt_token_s);
        assert_eq!(set.overlap_step_loss, measured.overlap_step_loss);
    }

    /// An impossible pair count in a profile names the file, the point and the key.
    #[test]
    fn a_profiles_impossible_pair_count_names_the_file_point_and_key() {
        let shipped = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../profiles/cpu-2core-builtin-tiny.json"
        );
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(shipped).unwrap()).unwrap();
        json["points"][3]["attention_pairs"] = serde_json::json!(1e308);
        let dir = std::env::temp_dir().join(format!("infer-sim-pairs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("pairs.json");
        std::fs::write(&bad, json.to_string()).unwrap();
        let e = load_err(
            "baseline",
            &[
                "sim.cost_model=profiled",
                &format!("sim.profile={:?}", bad.display().to_string()),
            ],
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            e.contains("key `sim.profile`")
                && e.contains(&format!(
                    "{}: points[3].attention_pairs is 1e308",
                    bad.display()
                )),
            "{e}"
        );
    }

    #[test]
    fn a_tiny_rate_or_time_limit_reads_as_a_person_writes_it() {
        let file = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scenarios/chunked_prefill.toml"
        );
        let text = std::fs::read_to_string(file).unwrap();
        let err = |set: &str| {
            let s = Scenario::parse(file, &text, &[set.to_string()]).unwrap();
            prepare(file, s).map(|_| ()).unwrap_err().to_string()
        };
        let e = err("arrival.rate=1e-300");
        assert!(
            e.contains("key `arrival.rate`: 48 requests at 1e-300 requests/s span"),
            "{e}"
        );
        let e = err("sim.max_simulated_s=1e-300");
        assert!(e.contains("beyond sim.max_simulated_s = 1e-300 s:"), "{e}");
    }

    /// Static batching prices its steps with its own host costs where a calibration has
    /// them; `[sim] step_overhead_s` sets the host cost of whatever batching runs, and
    /// `[sim] static_…` static batching's alone.
    #[test]
    fn static_batching_has_its_own_host_costs_and_overrides_reach_the_right_ones() {
        let hw = find_hardware("rtx-5080").unwrap();
        let mut cal = Calibration::default_for(&hw);
        cal.step_overhead_s = 4e-3;
        cal.per_seq_overhead_s = 1e-3;
        cal.static_step_overhead_s = Some(2e-3);
        cal.static_per_seq_overhead_s = Some(0.5e-3);
        let resolved = |cal: &Calibration, mode| {
            let cfg = infer_core::SchedulerConfig {
                batching_mode: mode,
                ..Default::default()
            };
            let c = cal.clone().for_server(&cfg);
            (c.step_overhead_s, c.per_seq_overhead_s)
        };
        assert_eq!(resolved(&cal, BatchingMode::Continuous), (4e-3, 1e-3));
        assert_eq!(resolved(&cal, BatchingMode::Static), (2e-3, 0.5e-3));

        let mut one = cal.clone();
        apply_overrides(&mut one, &settings(&["sim.step_overhead_s=0.003"]));
        assert_eq!(resolved(&one, BatchingMode::Static), (3e-3, 0.5e-3));
        assert_eq!(resolved(&one, BatchingMode::Continuous), (3e-3, 1e-3));

        let mut own = cal.clone();
        apply_overrides(
            &mut own,
            &settings(&[
                "sim.static_step_overhead_s=0.001",
                "sim.static_per_seq_overhead_s=0.0002",
            ]),
        );
        assert_eq!(resolved(&own, BatchingMode::Static), (1e-3, 0.2e-3));
        assert_eq!(resolved(&own, BatchingMode::Continuous), (4e-3, 1e-3));

        // Through a whole setup: the shipped calibration's static costs price a static
        // run's steps, not a continuous one's.
        let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/baseline.toml");
        let step = |set: &[&str]| {
            let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
            let setup = load(file, &set).unwrap();
            // One decode at 512 tokens of context.
            let shape = infer_core::StepShape {
                num_seqs: 1,
                decode_seqs: 1,
                sampled: 1,
                context_tokens: 512,
                decode_context_tokens: 512,
                ..Default::default()
            };
            setup.cost.step_time(&shape)
        };
        let model = "server.model=llama-3.2-3b";
        let shipped = Calibration::for_pair(&hw, &resolve_model("llama-3.2-3b").unwrap()).unwrap();
        let gap = shipped.static_step_overhead_s.unwrap()
            + shipped.static_per_seq_overhead_s.unwrap()
            - shipped.step_overhead_s
            - shipped.per_seq_overhead_s;
        assert!(
            gap.abs() > 1e-5,
            "the shipped file sets its own: {shipped:?}"
        );
        let continuous = step(&[model]);
        let statically = step(&[model, "server.batching_mode=static"]);
        assert!(
            (statically - continuous - gap).abs() < 1e-9,
            "{statically} - {continuous} != {gap}"
        );
    }

    /// `contiguous_decode = padded` prices decodes over a contiguous cache at the longest
    /// context; over a paged cache a decode reads its own blocks, whatever the setting.
    #[test]
    fn padded_decodes_apply_to_a_contiguous_cache_only() {
        let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/baseline.toml");
        // Two decodes, at 100 and 900 tokens of context.
        let shape = infer_core::StepShape {
            num_seqs: 2,
            decode_seqs: 2,
            sampled: 2,
            context_tokens: 1000,
            decode_context_tokens: 1000,
            max_decode_context: 900,
            attention_pairs: 1000.0,
            ..Default::default()
        };
        let setup = |set: &[&str]| {
            let mut set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
            set.push("sim.decode_attention_efficiency=0.002".into());
            load(file, &set).unwrap()
        };
        let step = |set: &[&str]| setup(set).cost.step_time(&shape);
        let contiguous = "server.kv_cache_backend=contiguous";
        let no_sharing = "server.prefix_caching=false";
        let padded = "sim.contiguous_decode=padded";
        let paged = "server.kv_cache_backend=paged";
        assert!(step(&[contiguous, no_sharing, padded]) > step(&[contiguous, no_sharing]));
        assert_eq!(step(&[paged, padded]), step(&[paged]));
        // Asked for in `[sim]` where it cannot apply, it says so.
        let said = |set: &[&str]| {
            setup(set)
                .warnings
                .iter()
                .any(|w| w.contains("sim.contiguous_decode has no effect"))
        };
        assert!(said(&[paged, padded]));
        assert!(!said(&[contiguous, no_sharing, padded]));
    }

    #[test]
    fn an_fp8_kv_cache_halves_the_pool_and_what_a_decode_reads() {
        let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/baseline.toml");
        let setup = |set: &[&str]| {
            let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
            load(file, &set)
        };
        let (bf16, fp8) = (
            setup(&[]).unwrap(),
            setup(&["server.kv_cache_dtype=fp8"]).unwrap(),
        );
        assert_eq!(bf16.model.kv_dtype, Dtype::Bf16);
        assert_eq!(fp8.model.kv_dtype, Dtype::Fp8);
        assert_eq!(fp8.model.weight_dtype, bf16.model.weight_dtype);
        assert_eq!(fp8.memory.kv_pool * 2.0, bf16.memory.kv_pool);
        // 32 decodes at 4k tokens of context: the KV read dominates, and halves.
        let shape = infer_core::StepShape {
            num_seqs: 32,
            decode_seqs: 32,
            sampled: 32,
            context_tokens: 32 * 4096,
            decode_context_tokens: 32 * 4096,
            max_decode_context: 4096,
            attention_pairs: (32 * 4096) as f64,
            ..Default::default()
        };
        let (slow, fast) = (bf16.cost.step_time(&shape), fp8.cost.step_time(&shape));
        assert!(fast <= slow, "fp8 {fast} s vs bf16 {slow} s");
        // The RTX 5080's calibration prices the seed engine's decode attention by its
        // compute (which fp8 does not shrink: it is converted to compute in); where the
        // attention keeps up with memory, the step saves the read of half the KV's bytes.
        let memory_bound = "sim.decode_attention_efficiency=1.0";
        let bf16 = setup(&[memory_bound]).unwrap();
        let fp8 = setup(&[memory_bound, "server.kv_cache_dtype=fp8"]).unwrap();
        let (slow, fast) = (bf16.cost.step_time(&shape), fp8.cost.step_time(&shape));
        let half_kv = bf16.model.kv_bytes_per_token() * shape.context_tokens as f64 / 2.0;
        let bandwidth = bf16.hardware.bandwidth * bf16.calibration.unwrap().bandwidth_efficiency;
        let saved = half_kv / bandwidth;
        assert!(
            slow - fast > 0.9 * saved && slow - fast < 1.1 * saved,
            "fp8 {fast} s vs bf16 {slow} s: {saved} s expected saved"
        );
        // vLLM's other name is accepted; its e5m2 (which no driver here stores) is not.
        let alias = setup(&["server.kv_cache_dtype=fp8_e4m3"]).unwrap();
        assert_eq!(alias.model.kv_dtype, Dtype::Fp8);
        let err = setup(&["server.kv_cache_dtype=fp8_e5m2"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("kv_cache_dtype"), "{err}");
    }
}
