//! The analytic roofline cost model.
//!
//! For one step on one replica (tensor-parallel degree `tp`, per-GPU numbers):
//!
//! ```text
//! flops    = 2 × linear_params × new_tokens          matmuls of every layer
//!          + 2 × vocab × hidden × sampled             output head, sampling rows only
//!          + 4 × layers × heads × head_dim × pairs    QKᵀ and PV over query×key pairs
//! compute  = flops / tp / (peak_flops(weight dtype) × compute_efficiency)
//! bytes    = weight_bytes / tp                        every weight read once per step
//!          + kv_bytes_per_token / tp × (context_tokens + new_tokens)   KV read + written
//! memory   = bytes / (bandwidth × bandwidth_efficiency)
//! launch   = layers × kernels_per_layer × kernel_launch_s     eager
//!          = graph_launch_s                                   CUDA graphs, decode-only step
//! comm     = tp > 1: 2 all-reduces per layer of new_tokens × hidden × 2 bytes, ring:
//!            2 (tp − 1) / tp × bytes / peer_link + 10 µs each
//! spill    = 2 × spilled_bytes / host_link   (memory plan over-committed: out and back)
//! step     = max(compute, memory, launch) + comm + step_overhead_s
//!          + per_seq_overhead_s × scheduled sequences + spill
//! ```
//!
//! Compute and memory overlap (the roofline), and kernel launches overlap with execution:
//! the host runs ahead of the GPU, so launches only matter when each kernel is shorter than
//! its launch (small models, small batches): hence a third term of the max, not a sum.
//! The step overhead (scheduling, input preparation) and the per-sequence overhead (block
//! tables, sampling, detokenisation) are host work on the step's critical path.

use super::{ClientPath, CostModel, StepShape};
use crate::calibration::Calibration;
use crate::catalog::{HardwareSpec, ModelSpec};
use crate::memory::MemoryPlan;

/// Latency of one all-reduce call, independent of size.
const ALLREDUCE_LATENCY_S: f64 = 10e-6;

#[derive(Debug, Clone)]
pub struct Analytic {
    hw: HardwareSpec,
    model: ModelSpec,
    cal: Calibration,
    cuda_graphs: bool,
    spill_bytes: f64,
}

/// The terms of one step, for tests and calibration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Terms {
    pub compute: f64,
    pub memory: f64,
    pub launch: f64,
    pub comm: f64,
    pub host: f64,
    pub spill: f64,
}

impl Terms {
    pub fn total(&self) -> f64 {
        self.compute.max(self.memory).max(self.launch) + self.comm + self.host + self.spill
    }
}

impl Analytic {
    pub fn new(
        hw: HardwareSpec,
        model: ModelSpec,
        cal: Calibration,
        cuda_graphs: bool,
        memory: Option<&MemoryPlan>,
    ) -> Self {
        let spill_bytes = memory.map_or(0.0, |m| m.spill);
        Analytic {
            hw,
            model,
            cal,
            cuda_graphs,
            spill_bytes,
        }
    }

    pub fn calibration(&self) -> &Calibration {
        &self.cal
    }

    /// Matmul FLOPs of a step (everything but attention), over all GPUs.
    pub fn matmul_flops(model: &ModelSpec, s: &StepShape) -> f64 {
        2.0 * model.linear_params() * s.new_tokens() as f64
            + 2.0 * model.head_params() * s.sampled as f64
    }

    pub fn attention_flops(model: &ModelSpec, s: &StepShape) -> f64 {
        4.0 * (model.layers * model.heads * model.head_dim) as f64 * s.attention_pairs
    }

    pub fn terms(&self, s: &StepShape) -> Terms {
        let (m, hw, cal) = (&self.model, &self.hw, &self.cal);
        let tp = m.tp as f64;
        let flops = Self::matmul_flops(m, s) + Self::attention_flops(m, s);
        let compute = flops / tp / (hw.flops(m.weight_dtype) * cal.compute_efficiency);
        let kv = m.kv_bytes_per_token() * (s.context_tokens + s.new_tokens()) as f64;
        let memory = (m.weight_bytes() + kv) / tp / (hw.bandwidth * cal.bandwidth_efficiency);
        let decode_only = s.prefill_tokens == 0;
        let launch = if self.cuda_graphs && decode_only {
            hw.graph_launch_s
        } else {
            (m.layers * m.kernels_per_layer) as f64 * hw.kernel_launch_s
        };
        let comm = if m.tp > 1 {
            let bytes = (s.new_tokens() * m.hidden) as f64 * 2.0;
            let per_call = 2.0 * (tp - 1.0) / tp * bytes / hw.peer_link + ALLREDUCE_LATENCY_S;
            2.0 * m.layers as f64 * per_call
        } else {
            0.0
        };
        let host = cal.step_overhead_s + cal.per_seq_overhead_s * s.num_seqs as f64;
        let spill = 2.0 * self.spill_bytes / hw.host_link;
        Terms {
            compute,
            memory,
            launch,
            comm,
            host,
            spill,
        }
    }
}

impl CostModel for Analytic {
    fn step_time(&self, s: &StepShape) -> f64 {
        self.terms(s).total()
    }

    fn client_path(&self) -> ClientPath {
        self.cal.client
    }

    fn describe(&self) -> String {
        let c = &self.cal;
        format!(
            "analytic roofline: {} on {}{} (compute eff {:.3}, bandwidth eff {:.2}, step overhead \
             {:.2} ms, per-seq {:.3} ms, client {:.2}+{:.2} ms; {})",
            self.model.name,
            self.hw.name,
            if self.cuda_graphs {
                " with CUDA graphs"
            } else {
                ""
            },
            c.compute_efficiency,
            c.bandwidth_efficiency,
            c.step_overhead_s * 1e3,
            c.per_seq_overhead_s * 1e3,
            c.client.request_s * 1e3,
            c.client.stream_s * 1e3,
            c.source
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibration::Calibration;
    use crate::catalog::{find_hardware, find_model};

    fn model(hw: &str, m: &str, graphs: bool) -> Analytic {
        let (hw, m) = (find_hardware(hw).unwrap(), find_model(m).unwrap());
        let cal = Calibration::default_for(&hw);
        Analytic::new(hw, m, cal, graphs, None)
    }

    fn decode(seqs: usize, ctx: usize) -> StepShape {
        StepShape {
            num_seqs: seqs,
            decode_seqs: seqs,
            sampled: seqs,
            context_tokens: seqs * ctx,
            decode_context_tokens: seqs * ctx,
            attention_pairs: (seqs * ctx) as f64,
            ..StepShape::default()
        }
    }

    fn prefill(n: usize) -> StepShape {
        StepShape {
            num_seqs: 1,
            prefill_tokens: n,
            prefill_seqs: 1,
            max_prefill_chunk: n,
            sampled: 1,
            context_tokens: n,
            attention_pairs: (n * (n + 1) / 2) as f64,
            ..StepShape::default()
        }
    }

    #[test]
    fn decode_is_memory_bound_and_long_prefill_compute_bound() {
        let a = model("h100-80gb", "llama-3.1-8b", false);
        let t = a.terms(&decode(1, 512));
        assert!(t.memory > t.compute * 10.0, "{t:?}");
        // 16 GB of weights at 3.35 TB/s x efficiency: about 6 ms.
        assert!((4e-3..8e-3).contains(&t.memory), "{t:?}");
        let t = a.terms(&prefill(4096));
        assert!(t.compute > t.memory, "{t:?}");
        // Batching decodes is nearly free until compute catches up with memory.
        let one = a.step_time(&decode(1, 512));
        let many = a.step_time(&decode(64, 512));
        assert!(many < one * 2.0, "{one} vs {many}");
    }

    #[test]
    fn attention_cost_grows_with_context() {
        let a = model("l4", "llama-3.1-8b", false);
        assert!(a.step_time(&decode(32, 8000)) > a.step_time(&decode(32, 500)) * 1.2);
    }

    #[test]
    fn cuda_graphs_remove_the_launch_floor_of_small_models() {
        let eager = model("h100-80gb", "qwen2.5-0.5b", false);
        let graphs = model("h100-80gb", "qwen2.5-0.5b", true);
        let t = eager.terms(&decode(1, 256));
        assert!(
            t.launch > t.memory,
            "a 0.5B decode is launch-bound eagerly: {t:?}"
        );
        assert!(graphs.step_time(&decode(1, 256)) < eager.step_time(&decode(1, 256)));
        // Prefill stays eager.
        assert_eq!(
            graphs.step_time(&prefill(256)),
            eager.step_time(&prefill(256))
        );
    }

    #[test]
    fn tensor_parallel_splits_work_and_pays_for_all_reduce() {
        let a = model("h100-80gb", "llama-3.1-70b", false);
        let t = a.terms(&decode(8, 9000));
        assert!(t.comm > 0.0);
        // 141 GB of weights over 4 GPUs at 3.35 TB/s: ~10.5 ms at 100%.
        assert!((10e-3..16e-3).contains(&t.memory), "{t:?}");
    }
}
