//! Reading a Prometheus text exposition (the server's `/metrics`), just enough for the
//! load generator's time series: the value of a metric summed over its label sets.

/// The sum of every sample of `name` (counters also match `name_total`), or `None` if
/// the exposition has no such metric.
pub fn value(text: &str, name: &str) -> Option<f64> {
    let total = format!("{name}_total");
    let mut sum = None;
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (metric, rest) = match line.find(['{', ' ']) {
            Some(i) => (&line[..i], &line[i..]),
            None => continue,
        };
        if metric != name && metric != total {
            continue;
        }
        let after_labels = match rest.strip_prefix('{') {
            Some(r) => match r.find('}') {
                Some(i) => &r[i + 1..],
                None => continue,
            },
            None => rest,
        };
        if let Some(v) = after_labels
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *sum.get_or_insert(0.0) += v;
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_over_labels_and_accepts_total_suffix() {
        let text = "# HELP vllm:num_requests_running Running.\n\
# TYPE vllm:num_requests_running gauge\n\
vllm:num_requests_running{model_name=\"a\"} 3\n\
vllm:num_requests_running{model_name=\"b\"} 2\n\
vllm:prefix_cache_hits_total{model_name=\"a\"} 1024\n\
vllm:kv_cache_usage_perc 0.25\n";
        assert_eq!(value(text, "vllm:num_requests_running"), Some(5.0));
        assert_eq!(value(text, "vllm:prefix_cache_hits"), Some(1024.0));
        assert_eq!(value(text, "vllm:kv_cache_usage_perc"), Some(0.25));
        assert_eq!(value(text, "vllm:num_preemptions"), None);
    }
}
