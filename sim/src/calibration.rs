//! Calibration coefficients of the analytic model, and how the RTX 5080 ones were found.
//!
//! The three seed models are calibrated on the RTX 5080 from the benchmark log's Phase 8
//! *baseline* rows only (sequential single requests, 256-token prompts, 256 output tokens):
//! TTFT P50 and ITL P50. Two numbers per model fix two coefficients:
//!
//! ```text
//! ITL  = decode step (1 sequence, ~384 tokens of context)
//!      = max(compute, memory, launch) + step_overhead + per_seq      → step_overhead
//! TTFT = client path + prefill step (256 tokens, 1 sequence)
//!      = client + matmul_flops / (peak × eff) ... + step_overhead + per_seq → compute_efficiency
//! ```
//!
//! The rest are fixed priors, not fitted: memory bandwidth efficiency 0.85 (GDDR7 streaming
//! reads), a per-sequence host overhead of 0.1 ms, and the client path of a local Python
//! HTTP server (3 ms request handling, 1 µs per prompt token to tokenise, 1 ms per
//! streamed chunk). Batched rows (Phases 6–8) are for checking, never for fitting; since a
//! single sequence cannot reveal how per-sequence host cost grows with batch size, that is
//! where the predictions are expected to be weakest.

use crate::catalog::{HardwareSpec, ModelSpec};
use crate::cost::{Analytic, ClientPath, StepShape};

#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    /// Fraction of the tensor-core peak the matmuls reach.
    pub compute_efficiency: f64,
    /// Fraction of the peak memory bandwidth streaming reads reach.
    pub bandwidth_efficiency: f64,
    /// Host time per step not hidden behind the GPU (scheduling, input preparation).
    pub step_overhead_s: f64,
    /// Host time per scheduled sequence (block tables, sampling, detokenising).
    pub per_seq_overhead_s: f64,
    pub client: ClientPath,
    /// Where the numbers come from (printed with each run).
    pub source: String,
}

/// A published single-request measurement to calibrate against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BaselineTarget {
    pub hardware: &'static str,
    pub model: &'static str,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub ttft_s: f64,
    pub itl_s: f64,
}

/// The benchmark log's Phase 8 baseline rows (TTFT P50, ITL P50).
pub const RTX5080_BASELINES: [BaselineTarget; 3] = [
    BaselineTarget {
        hardware: "rtx-5080",
        model: "llama-3.2-3b",
        prompt_tokens: 256,
        output_tokens: 256,
        ttft_s: 0.037,
        itl_s: 0.012,
    },
    BaselineTarget {
        hardware: "rtx-5080",
        model: "qwen3-4b",
        prompt_tokens: 256,
        output_tokens: 256,
        ttft_s: 0.045,
        itl_s: 0.015,
    },
    BaselineTarget {
        hardware: "rtx-5080",
        model: "gemma-3-1b",
        prompt_tokens: 256,
        output_tokens: 256,
        ttft_s: 0.026,
        itl_s: 0.011,
    },
];

/// The seed server's client path (local Python HTTP server, streaming SSE).
const SEED_SERVER_CLIENT: ClientPath = ClientPath {
    request_s: 3e-3,
    per_prompt_token_s: 1e-6,
    stream_s: 1e-3,
};

impl Calibration {
    /// Generic coefficients for a pair nobody calibrated: a vLLM-class server.
    pub fn default_for(hw: &HardwareSpec) -> Calibration {
        let _ = hw;
        Calibration {
            compute_efficiency: 0.5,
            bandwidth_efficiency: 0.8,
            step_overhead_s: 1.0e-3,
            per_seq_overhead_s: 30e-6,
            client: ClientPath {
                request_s: 2e-3,
                per_prompt_token_s: 1e-6,
                stream_s: 0.3e-3,
            },
            source: "uncalibrated defaults".into(),
        }
    }

    /// The calibration for a pair: fitted from its baseline target if there is one.
    pub fn for_pair(hw: &HardwareSpec, model: &ModelSpec) -> Result<Calibration, String> {
        match RTX5080_BASELINES
            .iter()
            .find(|t| t.hardware == hw.name && t.model == model.name)
        {
            Some(t) => calibrate(hw, model, t),
            None => Ok(Calibration::default_for(hw)),
        }
    }
}

/// Solve step overhead and compute efficiency so that a single request of the target's
/// shape reproduces its TTFT and ITL exactly (see the module comment).
pub fn calibrate(
    hw: &HardwareSpec,
    model: &ModelSpec,
    t: &BaselineTarget,
) -> Result<Calibration, String> {
    let mut cal = Calibration {
        compute_efficiency: 1.0,
        bandwidth_efficiency: 0.85,
        step_overhead_s: 0.0,
        per_seq_overhead_s: 0.1e-3,
        client: SEED_SERVER_CLIENT,
        source: format!(
            "calibrated on {} baseline TTFT {:.0} ms / ITL {:.0} ms",
            t.hardware,
            t.ttft_s * 1e3,
            t.itl_s * 1e3
        ),
    };
    let p = t.prompt_tokens;
    let ctx = p + t.output_tokens / 2;
    let decode = StepShape {
        num_seqs: 1,
        decode_seqs: 1,
        sampled: 1,
        context_tokens: ctx,
        decode_context_tokens: ctx,
        attention_pairs: ctx as f64,
        ..StepShape::default()
    };
    let prefill = StepShape {
        num_seqs: 1,
        prefill_tokens: p,
        prefill_seqs: 1,
        max_prefill_chunk: p,
        sampled: 1,
        context_tokens: p,
        attention_pairs: (p * (p + 1) / 2) as f64,
        ..StepShape::default()
    };
    // Decode: with step overhead 0 the terms give the GPU part; the rest is overhead.
    let probe = Analytic::new(hw.clone(), model.clone(), cal.clone(), false, None);
    let d = probe.terms(&decode);
    let gpu = d.compute.max(d.memory).max(d.launch);
    cal.step_overhead_s = t.itl_s - gpu - cal.per_seq_overhead_s;
    if cal.step_overhead_s < 0.0 {
        return Err(format!(
            "{} on {}: ITL {:.1} ms is below the roofline's {:.1} ms",
            model.name,
            hw.name,
            t.itl_s * 1e3,
            gpu * 1e3
        ));
    }
    // Prefill: what remains of TTFT after the client path and host overheads is compute.
    let client = cal.client.request_delay(p) + cal.client.stream_s;
    let compute_s = t.ttft_s - client - cal.step_overhead_s - cal.per_seq_overhead_s;
    let pre = probe.terms(&prefill);
    let flops = (Analytic::matmul_flops(model, &prefill)
        + Analytic::attention_flops(model, &prefill))
        / model.tp as f64;
    if compute_s <= pre.memory.max(pre.launch) {
        return Err(format!(
            "{} on {}: TTFT {:.1} ms leaves {:.1} ms for the prefill, below its memory time",
            model.name,
            hw.name,
            t.ttft_s * 1e3,
            compute_s * 1e3
        ));
    }
    cal.compute_efficiency = flops / (hw.flops(model.weight_dtype) * compute_s);
    if cal.compute_efficiency > 1.0 {
        return Err(format!(
            "{} on {}: TTFT implies more than peak FLOP/s",
            model.name, hw.name
        ));
    }
    Ok(cal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{find_hardware, find_model};
    use infer_core::workload::Scenario;

    #[test]
    fn calibrated_coefficients_are_physically_plausible() {
        let hw = find_hardware("rtx-5080").unwrap();
        for t in RTX5080_BASELINES {
            let c = Calibration::for_pair(&hw, &find_model(t.model).unwrap()).unwrap();
            assert!(
                (0.1..0.9).contains(&c.compute_efficiency),
                "{}: {c:?}",
                t.model
            );
            assert!(
                (1e-3..10e-3).contains(&c.step_overhead_s),
                "{}: {c:?}",
                t.model
            );
        }
    }

    #[test]
    fn overrides_in_the_sim_table_reach_the_calibration() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scenarios/baseline.toml"
        ))
        .unwrap();
        let s = Scenario::parse(
            "baseline.toml",
            &text,
            &["sim.step_overhead_s=0.002".into()],
        )
        .unwrap();
        let settings = crate::settings::SimSettings::from_scenario(&s).unwrap();
        assert_eq!(settings.step_overhead_s, Some(0.002));
    }
}
