//! The scenario's `[sim]` table: simulator-only settings, parsed strictly.
//!
//! ```toml
//! [sim]
//! cost_model = "analytic"          # analytic | profiled
//! profile = "profiles/x.json"      # for profiled: a file written by `engine profile`
//! timeseries_interval_s = 0.1      # spacing of timeseries.csv points
//! # calibration overrides, each optional; those only the analytic model reads
//! # (ANALYTIC_ONLY: all but step_jitter_s and client_…) are refused beside
//! # cost_model = "profiled", and `profile` beside the analytic model:
//! compute_efficiency = 0.4
//! attention_efficiency = 0.1
//! decode_attention_efficiency = 0.003
//! bandwidth_efficiency = 0.85
//! single_decode_bandwidth_efficiency = 0.6  # a decode pass of one sequence (GEMV)
//! step_overhead_s = 0.004
//! per_seq_overhead_s = 0.0001
//! step_jitter_s = 0.002            # mean random host pause per step
//! page_fault_s_per_gib = 0.2       # faulting in a buffer past the allocator's mmap threshold
//! client_request_s = 0.003
//! client_per_prompt_token_s = 1e-6
//! client_stream_s = 0.001
//! static_batch_window_s = 0.05
//! static_step_overhead_s = 0.003   # static batching's own host costs (step_overhead_s and
//! static_per_seq_overhead_s = 1e-3 # per_seq_overhead_s set those of any batching)
//! # how the engine runs (analytic):
//! calibration = "calibrations/x.toml"  # a file written by `sim calibrate`
//! prefill_batching = "packed"      # packed | padded
//! logits = "sampled"               # sampled | all
//! attention_scores = "fused"       # fused | materialized
//! contiguous_kv = "reserved"       # reserved | grown
//! contiguous_decode = "ragged"     # ragged | padded (decodes over a contiguous cache)
//! packed_attention = "ragged"      # ragged | masked (every query of a pass × all its keys)
//! dtype = "bf16"                   # f32 | bf16 | fp8: the weights and KV as the server holds them
//! roofline = "overlap"             # overlap | serial
//! spill_bandwidth_gb_s = 50        # host paging speed once memory spills
//! reserved_gib = 1.5               # device memory the engine never gets (default: the
//!                                  # catalog's estimate; a desktop's display takes more)
//! graph_replay_factor = 2.1        # CUDA-graph decode pass: × its time w/o decode attention (>= 1)
//! micro_batch_tokens = 512         # a packed step as passes of at most this many tokens
//! micro_batches = "slot_runs"      # tokens | slot_runs (passes of consecutive slots only)
//! # bounds of a run (a run past one ends with an error naming its key):
//! max_simulated_s = 2592000        # simulated time (default 30 days)
//! max_output_mib = 4096            # run directory's streamed files (requests, timeseries)
//! max_memory_mib = 8192            # the simulator's resident memory
//! ```

use infer_core::workload::Scenario;
use serde::Deserialize;

use crate::calibration::{
    AttentionScores, ContiguousDecode, ContiguousKv, LogitRows, MicroBatches, PackedAttention,
    PrefillBatching, Roofline,
};
use crate::catalog::Dtype;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CostModelKind {
    #[default]
    Analytic,
    Profiled,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimSettings {
    #[serde(default)]
    pub cost_model: CostModelKind,
    pub profile: Option<String>,
    pub timeseries_interval_s: Option<f64>,
    pub compute_efficiency: Option<f64>,
    pub attention_efficiency: Option<f64>,
    pub decode_attention_efficiency: Option<f64>,
    pub bandwidth_efficiency: Option<f64>,
    pub single_decode_bandwidth_efficiency: Option<f64>,
    pub step_overhead_s: Option<f64>,
    pub per_seq_overhead_s: Option<f64>,
    pub step_jitter_s: Option<f64>,
    pub page_fault_s_per_gib: Option<f64>,
    pub client_request_s: Option<f64>,
    pub client_per_prompt_token_s: Option<f64>,
    pub client_stream_s: Option<f64>,
    pub static_batch_window_s: Option<f64>,
    pub static_step_overhead_s: Option<f64>,
    pub static_per_seq_overhead_s: Option<f64>,
    pub calibration: Option<String>,
    pub prefill_batching: Option<PrefillBatching>,
    pub logits: Option<LogitRows>,
    pub attention_scores: Option<AttentionScores>,
    pub contiguous_kv: Option<ContiguousKv>,
    pub contiguous_decode: Option<ContiguousDecode>,
    pub packed_attention: Option<PackedAttention>,
    pub dtype: Option<Dtype>,
    pub roofline: Option<Roofline>,
    pub spill_bandwidth_gb_s: Option<f64>,
    pub reserved_gib: Option<f64>,
    pub graph_replay_factor: Option<f64>,
    /// Whole tokens (read as a number, as every key of the table).
    pub micro_batch_tokens: Option<f64>,
    pub micro_batches: Option<MicroBatches>,
    pub max_simulated_s: Option<f64>,
    pub max_output_mib: Option<f64>,
    pub max_memory_mib: Option<f64>,
}

pub const DEFAULT_TIMESERIES_INTERVAL_S: f64 = 0.1;
/// 30 days: longer than any trace or benchmark, short enough that a mistyped rate (1e-12
/// requests/s) is an error rather than a run that never ends.
pub const DEFAULT_MAX_SIMULATED_S: f64 = 30.0 * 86_400.0;
pub const DEFAULT_MAX_OUTPUT_MIB: f64 = 4096.0;
pub const DEFAULT_MAX_MEMORY_MIB: f64 = 8192.0;
/// The most any per-step or per-request cost may be: a minute is already absurd for one
/// step, and past it a typo (`step_jitter_s = 1e300`) would stall the clock.
pub(crate) const MAX_COST_S: f64 = 60.0;

impl SimSettings {
    /// The `[sim]` table of `scenario`; an error names the key (`sim.…`) and the reason.
    pub fn from_scenario(scenario: &Scenario) -> Result<SimSettings, (String, String)> {
        let Some(table) = &scenario.sim else {
            return Ok(SimSettings::default());
        };
        let s: SimSettings = parse_table(table)?;
        let fraction = [
            ("compute_efficiency", s.compute_efficiency),
            ("attention_efficiency", s.attention_efficiency),
            ("decode_attention_efficiency", s.decode_attention_efficiency),
            ("bandwidth_efficiency", s.bandwidth_efficiency),
            (
                "single_decode_bandwidth_efficiency",
                s.single_decode_bandwidth_efficiency,
            ),
        ];
        for (key, v) in fraction {
            if let Some(v) = v {
                if !(v > 0.0 && v <= 1.0) {
                    return Err((format!("sim.{key}"), format!("must be in (0, 1], got {v}")));
                }
            }
        }
        let non_negative = [
            ("step_overhead_s", s.step_overhead_s),
            ("per_seq_overhead_s", s.per_seq_overhead_s),
            ("step_jitter_s", s.step_jitter_s),
            ("page_fault_s_per_gib", s.page_fault_s_per_gib),
            ("client_request_s", s.client_request_s),
            ("client_per_prompt_token_s", s.client_per_prompt_token_s),
            ("client_stream_s", s.client_stream_s),
            ("static_batch_window_s", s.static_batch_window_s),
            ("static_step_overhead_s", s.static_step_overhead_s),
            ("static_per_seq_overhead_s", s.static_per_seq_overhead_s),
        ];
        for (key, v) in non_negative {
            if let Some(v) = v {
                if !(0.0..=MAX_COST_S).contains(&v) {
                    return Err((
                        format!("sim.{key}"),
                        format!(
                            "must be between 0 and {MAX_COST_S} seconds, got {}",
                            readable(v)
                        ),
                    ));
                }
            }
        }
        if let Some(v) = s.spill_bandwidth_gb_s {
            if !(v > 0.0 && v.is_finite()) {
                return Err((
                    "sim.spill_bandwidth_gb_s".into(),
                    format!("must be > 0 GB/s, got {v}"),
                ));
            }
        }
        if let Some(v) = s.reserved_gib {
            if !(v >= 0.0 && v.is_finite()) {
                return Err((
                    "sim.reserved_gib".into(),
                    format!("must be >= 0 GiB, got {v}"),
                ));
            }
        }
        if let Some(reason) = s
            .graph_replay_factor
            .and_then(crate::calibration::graph_replay_refusal)
        {
            return Err(("sim.graph_replay_factor".into(), reason));
        }
        if let Some(u) = s.micro_batch_tokens {
            if !(u >= 1.0 && u.fract() == 0.0 && u <= 1e9) {
                return Err((
                    "sim.micro_batch_tokens".into(),
                    format!("must be a whole number of tokens, at least 1, got {u}"),
                ));
            }
        }
        if let Some(v) = s.timeseries_interval_s {
            // Finer points than a millisecond would be rows by the billion for long runs.
            if !(v >= 1e-3 && v.is_finite()) {
                return Err((
                    "sim.timeseries_interval_s".into(),
                    format!("must be at least 0.001 seconds, got {v}"),
                ));
            }
        }
        let bounds = [
            ("max_simulated_s", s.max_simulated_s, "seconds"),
            ("max_output_mib", s.max_output_mib, "MiB"),
            ("max_memory_mib", s.max_memory_mib, "MiB"),
        ];
        for (key, v, unit) in bounds {
            if let Some(v) = v {
                if !(v > 0.0 && v < 1e15) {
                    return Err((
                        format!("sim.{key}"),
                        format!("must be a positive number of {unit}, got {}", readable(v)),
                    ));
                }
            }
        }
        if s.cost_model == CostModelKind::Profiled && s.profile.is_none() {
            return Err((
                "sim.profile".into(),
                "cost_model = \"profiled\" needs a profile file".into(),
            ));
        }
        // A key only another cost model reads would change nothing: refuse it rather than
        // let a run look as if it had been honoured (an accepted key is one that acts).
        if s.cost_model == CostModelKind::Analytic && s.profile.is_some() {
            return Err((
                "sim.profile".into(),
                "is read by the profiled cost model only, and sim.cost_model is \"analytic\" \
                 (the default): set cost_model = \"profiled\" to price steps from the profile, \
                 or remove the key"
                    .into(),
            ));
        }
        if s.cost_model == CostModelKind::Profiled {
            if let Some(key) = ANALYTIC_ONLY.iter().find(|k| table.contains_key(**k)) {
                return Err((
                    format!("sim.{key}"),
                    "is read by the analytic cost model only, and sim.cost_model is \
                     \"profiled\" (its steps are priced from the profile's measurements): \
                     remove the key, or set cost_model = \"analytic\""
                        .into(),
                ));
            }
        }
        Ok(s)
    }

    pub fn timeseries_interval(&self) -> f64 {
        self.timeseries_interval_s
            .unwrap_or(DEFAULT_TIMESERIES_INTERVAL_S)
    }

    /// Simulated seconds a run may reach (`sim.max_simulated_s`).
    pub fn max_simulated_s(&self) -> f64 {
        self.max_simulated_s.unwrap_or(DEFAULT_MAX_SIMULATED_S)
    }

    /// Bytes a run directory's streamed files may reach (`sim.max_output_mib`).
    pub fn max_output_bytes(&self) -> u64 {
        (self.max_output_mib.unwrap_or(DEFAULT_MAX_OUTPUT_MIB) * MIB) as u64
    }

    /// Resident bytes the simulator may reach (`sim.max_memory_mib`).
    pub fn max_memory_bytes(&self) -> u64 {
        (self.max_memory_mib.unwrap_or(DEFAULT_MAX_MEMORY_MIB) * MIB) as u64
    }
}

/// The keys both cost models read (see [`ANALYTIC_ONLY`] for the others).
const SHARED: [&str; 14] = [
    "cost_model",
    "profile",
    "timeseries_interval_s",
    "step_jitter_s",
    "client_request_s",
    "client_per_prompt_token_s",
    "client_stream_s",
    "calibration",
    "contiguous_kv",
    "dtype",
    "reserved_gib",
    "max_simulated_s",
    "max_output_mib",
    "max_memory_mib",
];

/// `[sim]` keys only the analytic cost model reads (through its calibration): the profiled
/// model prices a step from its profile alone. The other keys are read by both: the run's
/// bounds and timeseries, the memory plan (`dtype`, `reserved_gib`, `contiguous_kv`), the
/// client path and step jitter (`client_…`, `step_jitter_s`), and `calibration`, whose
/// client path, jitter and memory reserve a profiled run keeps.
const ANALYTIC_ONLY: [&str; 21] = [
    "compute_efficiency",
    "attention_efficiency",
    "decode_attention_efficiency",
    "bandwidth_efficiency",
    "single_decode_bandwidth_efficiency",
    "step_overhead_s",
    "per_seq_overhead_s",
    "page_fault_s_per_gib",
    "static_batch_window_s",
    "static_step_overhead_s",
    "static_per_seq_overhead_s",
    "prefill_batching",
    "logits",
    "attention_scores",
    "contiguous_decode",
    "packed_attention",
    "roofline",
    "spill_bandwidth_gb_s",
    "graph_replay_factor",
    "micro_batch_tokens",
    "micro_batches",
];

/// Deserialize the table, turning serde's message into (key, reason).
fn parse_table(table: &toml::Table) -> Result<SimSettings, (String, String)> {
    // Check keys first so an unknown one is named precisely.
    for k in table.keys() {
        if !SHARED.contains(&k.as_str()) && !ANALYTIC_ONLY.contains(&k.as_str()) {
            return Err((
                format!("sim.{k}"),
                format!(
                    "unknown key; expected one of {}",
                    [&SHARED[..], &ANALYTIC_ONLY[..]].concat().join(", ")
                ),
            ));
        }
    }
    for (k, v) in table {
        // Accept integers where seconds or fractions are expected (`step_overhead_s = 0`).
        let one = toml::Table::from_iter([(k.clone(), coerce(v.clone()))]);
        if let Err(e) = SimSettings::deserialize(toml::Value::Table(one)) {
            return Err((format!("sim.{k}"), e.message().to_string()));
        }
    }
    let coerced: toml::Table = table
        .iter()
        .map(|(k, v)| (k.clone(), coerce(v.clone())))
        .collect();
    SimSettings::deserialize(toml::Value::Table(coerced))
        .map_err(|e| ("sim".into(), e.message().to_string()))
}

const MIB: f64 = 1024.0 * 1024.0;

/// A number as a person would write it: `1e300`, not three hundred digits.
pub(crate) fn readable(v: f64) -> String {
    if v == 0.0 || (1e-4..1e7).contains(&v.abs()) || !v.is_finite() {
        format!("{v}")
    } else {
        format!("{v:e}")
    }
}

fn coerce(v: toml::Value) -> toml::Value {
    match v {
        toml::Value::Integer(i) => toml::Value::Float(i as f64),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(sim: &str) -> Scenario {
        let text = format!(
            "name = \"t\"\n[workload]\nnum_requests = 1\nprompt_tokens = 8\noutput_tokens = 8\n\
             [arrival]\nkind = \"sequential\"\n[sim]\n{sim}\n"
        );
        Scenario::parse("t.toml", &text, &[]).unwrap()
    }

    #[test]
    fn settings_parse_strictly() {
        let s =
            SimSettings::from_scenario(&scenario("step_overhead_s = 0\ncompute_efficiency = 0.5"))
                .unwrap();
        assert_eq!(s.step_overhead_s, Some(0.0));
        assert_eq!(s.cost_model, CostModelKind::Analytic);
        let (k, r) = SimSettings::from_scenario(&scenario("bogus = 1")).unwrap_err();
        assert_eq!(k, "sim.bogus");
        assert!(r.contains("unknown key"), "{r}");
        let (k, _) = SimSettings::from_scenario(&scenario("compute_efficiency = 1.5")).unwrap_err();
        assert_eq!(k, "sim.compute_efficiency");
        let (k, r) = SimSettings::from_scenario(&scenario("cost_model = \"magic\"")).unwrap_err();
        assert_eq!(k, "sim.cost_model");
        assert!(r.contains("analytic"), "{r}");
        let (k, _) =
            SimSettings::from_scenario(&scenario("cost_model = \"profiled\"")).unwrap_err();
        assert_eq!(k, "sim.profile");
        let (k, _) = SimSettings::from_scenario(&scenario("attention_efficiency = 2")).unwrap_err();
        assert_eq!(k, "sim.attention_efficiency");
        let (k, r) =
            SimSettings::from_scenario(&scenario("static_step_overhead_s = -1")).unwrap_err();
        assert_eq!(k, "sim.static_step_overhead_s");
        assert!(r.contains("between 0 and 60"), "{r}");
        // A pause that would stall the clock for ever.
        let (k, r) = SimSettings::from_scenario(&scenario("step_jitter_s = 1e300")).unwrap_err();
        assert_eq!(k, "sim.step_jitter_s");
        assert!(r.contains("1e300"), "{r}");
        for bound in ["max_simulated_s", "max_output_mib", "max_memory_mib"] {
            for bad in ["0", "-1", "inf", "nan"] {
                let (k, _) =
                    SimSettings::from_scenario(&scenario(&format!("{bound} = {bad}"))).unwrap_err();
                assert_eq!(k, format!("sim.{bound}"));
            }
        }
        let s = SimSettings::from_scenario(&scenario("dtype = \"f32\"")).unwrap();
        assert_eq!(s.dtype, Some(Dtype::F32));
        let (k, r) = SimSettings::from_scenario(&scenario("dtype = \"f16\"")).unwrap_err();
        assert_eq!(k, "sim.dtype");
        assert!(r.contains("bf16"), "{r}");
        let (k, _) =
            SimSettings::from_scenario(&scenario("page_fault_s_per_gib = -0.1")).unwrap_err();
        assert_eq!(k, "sim.page_fault_s_per_gib");
        let s = SimSettings::from_scenario(&scenario("max_output_mib = 1")).unwrap();
        assert_eq!(s.max_output_bytes(), 1 << 20);
        assert_eq!(s.max_simulated_s(), DEFAULT_MAX_SIMULATED_S);
        let (k, _) = SimSettings::from_scenario(&scenario("reserved_gib = -1")).unwrap_err();
        assert_eq!(k, "sim.reserved_gib");
        let (k, r) =
            SimSettings::from_scenario(&scenario("graph_replay_factor = 0.8")).unwrap_err();
        assert_eq!(k, "sim.graph_replay_factor");
        assert!(r.contains(">= 1") && r.contains("0.8"), "{r}");
        for bad in ["0", "0.5", "-16"] {
            let (k, r) =
                SimSettings::from_scenario(&scenario(&format!("micro_batch_tokens = {bad}")))
                    .unwrap_err();
            assert_eq!(k, "sim.micro_batch_tokens", "{bad}");
            assert!(r.contains("whole number of tokens"), "{r}");
        }
        let s = SimSettings::from_scenario(&scenario("micro_batch_tokens = 512")).unwrap();
        assert_eq!(s.micro_batch_tokens, Some(512.0));
        let s = SimSettings::from_scenario(&scenario("roofline = \"serial\"\nreserved_gib = 3"))
            .unwrap();
        assert_eq!(s.roofline, Some(crate::calibration::Roofline::Serial));
        assert_eq!(s.reserved_gib, Some(3.0));
    }

    /// A key only the other cost model reads is refused, naming the key and the model.
    #[test]
    fn keys_of_a_cost_model_not_in_use_are_refused() {
        let profiled = "cost_model = \"profiled\"\nprofile = \"p.json\"";
        for key in ANALYTIC_ONLY {
            assert!(!SHARED.contains(&key), "{key}");
            let value = match key {
                "prefill_batching" => "\"packed\"",
                "logits" => "\"sampled\"",
                "attention_scores" => "\"fused\"",
                "contiguous_decode" | "packed_attention" => "\"ragged\"",
                "roofline" => "\"overlap\"",
                "micro_batches" => "\"tokens\"",
                "graph_replay_factor" => "2",
                "micro_batch_tokens" => "512",
                _ => "0.5",
            };
            let line = format!("{key} = {value}");
            // Taken by the analytic model (the default) ...
            assert!(
                SimSettings::from_scenario(&scenario(&line)).is_ok(),
                "{line}"
            );
            // ... refused beside a profile.
            let (k, r) =
                SimSettings::from_scenario(&scenario(&format!("{profiled}\n{line}"))).unwrap_err();
            assert_eq!(k, format!("sim.{key}"));
            assert!(
                r.contains("read by the analytic cost model only")
                    && r.contains("sim.cost_model is \"profiled\""),
                "{r}"
            );
        }
        // A profile without the profiled model would price nothing.
        for analytic in ["", "cost_model = \"analytic\"\n"] {
            let (k, r) =
                SimSettings::from_scenario(&scenario(&format!("{analytic}profile = \"p.json\"")))
                    .unwrap_err();
            assert_eq!(k, "sim.profile");
            assert!(
                r.contains("read by the profiled cost model only")
                    && r.contains("sim.cost_model is \"analytic\""),
                "{r}"
            );
        }
        // Keys both models read stay accepted beside a profile.
        let shared = "step_jitter_s = 0.001\nclient_request_s = 0.002\n\
                      client_per_prompt_token_s = 1e-6\nclient_stream_s = 0.001\n\
                      dtype = \"f32\"\nreserved_gib = 1\ncontiguous_kv = \"grown\"\n\
                      calibration = \"c.toml\"\ntimeseries_interval_s = 0.5\n\
                      max_simulated_s = 10\nmax_output_mib = 10\nmax_memory_mib = 100";
        let s = SimSettings::from_scenario(&scenario(&format!("{profiled}\n{shared}"))).unwrap();
        assert_eq!(s.cost_model, CostModelKind::Profiled);
        assert_eq!(s.client_request_s, Some(0.002));
    }
}
