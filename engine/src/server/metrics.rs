//! `/metrics` in Prometheus text format with vLLM's metric names and labels, so that
//! dashboards and routers built for vLLM (llm-d, KubeAI, vllm-router) work unchanged.

use std::fmt::Write as _;

use infer_core::{FinishReason, SchedulerStats};

/// A cumulative histogram with fixed upper bounds (seconds).
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

// vLLM's bucket bounds.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Tokens per step (vLLM's capture sizes up to its default batched-token budgets).
const ITERATION_TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
/// vLLM's 1-2-5 series for token counts (up to a 128k context).
const TOKEN_COUNT_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
];
const N_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];

/// Everything `/metrics` reports; updated by the engine loop, read by the HTTP handler.
#[derive(Debug, Clone)]
pub struct ServerMetrics {
    pub model_name: String,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub sched: SchedulerStats,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub success_stop: u64,
    pub success_length: u64,
    pub success_abort: u64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue: Histogram,
    /// Tokens per engine step.
    pub iteration_tokens: Histogram,
    pub request_prompt_tokens: Histogram,
    pub request_generation_tokens: Histogram,
    pub params_n: Histogram,
    pub params_max_tokens: Histogram,
    /// First scheduled → finished, first scheduled → first token, first token → finished.
    pub inference_time: Histogram,
    pub prefill_time: Histogram,
    pub decode_time: Histogram,
}

impl ServerMetrics {
    pub fn new(model_name: &str, block_size: usize, num_gpu_blocks: usize) -> Self {
        ServerMetrics {
            model_name: model_name.to_string(),
            block_size,
            num_gpu_blocks,
            sched: SchedulerStats::default(),
            prompt_tokens: 0,
            generation_tokens: 0,
            success_stop: 0,
            success_length: 0,
            success_abort: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_BUCKETS),
            queue: Histogram::new(REQUEST_BUCKETS),
            iteration_tokens: Histogram::new(ITERATION_TOKEN_BUCKETS),
            request_prompt_tokens: Histogram::new(TOKEN_COUNT_BUCKETS),
            request_generation_tokens: Histogram::new(TOKEN_COUNT_BUCKETS),
            params_n: Histogram::new(N_BUCKETS),
            params_max_tokens: Histogram::new(TOKEN_COUNT_BUCKETS),
            inference_time: Histogram::new(REQUEST_BUCKETS),
            prefill_time: Histogram::new(REQUEST_BUCKETS),
            decode_time: Histogram::new(REQUEST_BUCKETS),
        }
    }

    pub fn finished(&mut self, reason: FinishReason) {
        match reason {
            FinishReason::Stop => self.success_stop += 1,
            FinishReason::Length => self.success_length += 1,
            FinishReason::Abort => self.success_abort += 1,
        }
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        // vLLM v1's labels: the model, and the engine index (one engine per server here).
        let l = format!(
            "model_name=\"{}\",engine=\"0\"",
            escape_label(&self.model_name)
        );
        let gauge = |s: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(
                s,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{l}}} {v}"
            );
        };
        let counter = |s: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                s,
                "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{{{l}}} {v}"
            );
        };
        gauge(
            &mut s,
            "vllm:num_requests_running",
            "Requests in the running batch.",
            self.sched.num_running as f64,
        );
        gauge(
            &mut s,
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled.",
            self.sched.num_waiting as f64,
        );
        gauge(
            &mut s,
            "vllm:kv_cache_usage_perc",
            "Fraction of KV blocks in use (1 = full).",
            self.sched.kv_usage,
        );
        counter(
            &mut s,
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            self.sched.prefix_queries,
        );
        counter(
            &mut s,
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            self.sched.prefix_hits,
        );
        counter(
            &mut s,
            "vllm:num_preemptions",
            "Preemptions (recompute).",
            self.sched.num_preemptions,
        );
        counter(
            &mut s,
            "vllm:prompt_tokens",
            "Prompt tokens of finished requests.",
            self.prompt_tokens,
        );
        counter(
            &mut s,
            "vllm:generation_tokens",
            "Generated tokens.",
            self.generation_tokens,
        );
        let _ = writeln!(s, "# HELP vllm:request_success_total Finished requests by reason.\n# TYPE vllm:request_success_total counter");
        for (reason, v) in [
            ("stop", self.success_stop),
            ("length", self.success_length),
            ("abort", self.success_abort),
        ] {
            let _ = writeln!(
                s,
                "vllm:request_success_total{{{l},finished_reason=\"{reason}\"}} {v}"
            );
        }
        let _ = writeln!(
            s,
            "# HELP vllm:cache_config_info KV cache configuration.\n# TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{{l},block_size=\"{}\",num_gpu_blocks=\"{}\"}} 1",
            self.block_size, self.num_gpu_blocks
        );
        self.ttft.render(
            &mut s,
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            &l,
        );
        self.itl.render(
            &mut s,
            "vllm:inter_token_latency_seconds",
            "Time between tokens.",
            &l,
        );
        self.e2e.render(
            &mut s,
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            &l,
        );
        self.queue.render(
            &mut s,
            "vllm:request_queue_time_seconds",
            "Time waiting before first scheduled.",
            &l,
        );
        // vLLM v1 observes the same per-token intervals under this older name.
        self.itl.render(
            &mut s,
            "vllm:time_per_output_token_seconds",
            "Time per output token (the inter-token intervals).",
            &l,
        );
        for (h, name, help) in [
            (
                &self.iteration_tokens,
                "vllm:iteration_tokens_total",
                "Tokens per engine step.",
            ),
            (
                &self.request_prompt_tokens,
                "vllm:request_prompt_tokens",
                "Prompt tokens per finished request.",
            ),
            (
                &self.request_generation_tokens,
                "vllm:request_generation_tokens",
                "Generated tokens per finished request.",
            ),
            (
                &self.params_n,
                "vllm:request_params_n",
                "The n request parameter.",
            ),
            (
                &self.params_max_tokens,
                "vllm:request_params_max_tokens",
                "The max_tokens request parameter.",
            ),
            (
                &self.inference_time,
                "vllm:request_inference_time_seconds",
                "First scheduled to finished.",
            ),
            (
                &self.prefill_time,
                "vllm:request_prefill_time_seconds",
                "First scheduled to first token.",
            ),
            (
                &self.decode_time,
                "vllm:request_decode_time_seconds",
                "First token to finished.",
            ),
        ] {
            h.render(&mut s, name, help, &l);
        }
        s
    }
}

/// A label value as the Prometheus text format wants it: `\`, `"` and newlines escaped.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        let t = ServerMetrics::new("a\"b\\c\nd", 16, 2048).render();
        assert!(
            t.contains(r#"vllm:num_requests_running{model_name="a\"b\\c\nd",engine="0"} 0"#),
            "{t}"
        );
    }

    #[test]
    fn renders_vllm_names() {
        let mut m = ServerMetrics::new("tiny", 16, 2048);
        m.ttft.observe(0.03);
        m.generation_tokens = 7;
        m.finished(FinishReason::Length);
        m.iteration_tokens.observe(24.0);
        m.request_prompt_tokens.observe(300.0);
        m.params_max_tokens.observe(16.0);
        m.decode_time.observe(0.7);
        let t = m.render();
        let l = "model_name=\"tiny\",engine=\"0\"";
        for name in [
            format!("vllm:num_requests_running{{{l}}} 0"),
            format!("vllm:generation_tokens_total{{{l}}} 7"),
            format!("vllm:request_success_total{{{l},finished_reason=\"length\"}} 1"),
            format!("vllm:cache_config_info{{{l},block_size=\"16\",num_gpu_blocks=\"2048\"}} 1"),
            format!("vllm:time_to_first_token_seconds_bucket{{{l},le=\"0.04\"}} 1"),
            format!("vllm:time_to_first_token_seconds_count{{{l}}} 1"),
            format!("vllm:iteration_tokens_total_bucket{{{l},le=\"16\"}} 0"),
            format!("vllm:iteration_tokens_total_bucket{{{l},le=\"32\"}} 1"),
            format!("vllm:request_prompt_tokens_bucket{{{l},le=\"500\"}} 1"),
            format!("vllm:request_params_max_tokens_sum{{{l}}} 16"),
            format!("vllm:request_decode_time_seconds_count{{{l}}} 1"),
            format!("vllm:time_per_output_token_seconds_count{{{l}}} 0"),
            format!("vllm:request_inference_time_seconds_count{{{l}}} 0"),
            format!("vllm:request_prefill_time_seconds_count{{{l}}} 0"),
            format!("vllm:request_generation_tokens_count{{{l}}} 0"),
            format!("vllm:request_params_n_count{{{l}}} 0"),
        ] {
            assert!(t.contains(&name), "missing {name}");
        }
    }
}
