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
        let l = format!("model_name=\"{}\"", escape_label(&self.model_name));
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
            t.contains(r#"vllm:num_requests_running{model_name="a\"b\\c\nd"} 0"#),
            "{t}"
        );
    }

    #[test]
    fn renders_vllm_names() {
        let mut m = ServerMetrics::new("tiny", 16, 2048);
        m.ttft.observe(0.03);
        m.generation_tokens = 7;
        m.finished(FinishReason::Length);
        let t = m.render();
        for name in [
            "vllm:num_requests_running{model_name=\"tiny\"} 0",
            "vllm:generation_tokens_total{model_name=\"tiny\"} 7",
            "vllm:request_success_total{model_name=\"tiny\",finished_reason=\"length\"} 1",
            "vllm:cache_config_info{model_name=\"tiny\",block_size=\"16\",num_gpu_blocks=\"2048\"} 1",
            "vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.04\"} 1",
            "vllm:time_to_first_token_seconds_count{model_name=\"tiny\"} 1",
        ] {
            assert!(t.contains(name), "missing {name}");
        }
    }
}
