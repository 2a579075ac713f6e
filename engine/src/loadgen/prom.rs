//! Reading a Prometheus text exposition (the server's `/metrics`), just enough for the
//! load generator's time series: a metric's samples summed or averaged over label sets.

/// The sum of every sample of `name` (counters also match `name_total`), or `None` if
/// the exposition has no such metric: a counter's or a count's total over label sets.
pub fn value(text: &str, name: &str) -> Option<f64> {
    let mut samples = samples(text, name).peekable();
    samples.peek()?;
    Some(samples.sum())
}

/// The mean of every sample of `name`, or `None` if there is none: a fraction's value over
/// label sets (vLLM's data-parallel engines each report their own KV usage, as
/// `engine="0"`, `engine="1"`, ...; summed, two half-full pools would read 100%).
pub fn mean(text: &str, name: &str) -> Option<f64> {
    let (n, sum) = samples(text, name).fold((0usize, 0.0), |(n, s), v| (n + 1, s + v));
    (n > 0).then(|| sum / n as f64)
}

/// The values of every sample of `name` (or `name_total`), whatever their labels.
fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = f64> + 'a {
    text.lines().filter_map(move |line| {
        if line.starts_with('#') || line.is_empty() {
            return None;
        }
        let i = line.find(['{', ' '])?;
        let (metric, rest) = (&line[..i], &line[i..]);
        let total = metric.strip_suffix("_total") == Some(name);
        if metric != name && !total {
            return None;
        }
        let after_labels = match rest.strip_prefix('{') {
            Some(r) => &r[r.find('}')? + 1..],
            None => rest,
        };
        after_labels.split_whitespace().next()?.parse::<f64>().ok()
    })
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

    #[test]
    fn fractions_are_averaged_over_label_sets() {
        let text = "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
vllm:kv_cache_usage_perc{engine=\"1\"} 0.25\n";
        assert_eq!(mean(text, "vllm:kv_cache_usage_perc"), Some(0.375));
        assert_eq!(value(text, "vllm:kv_cache_usage_perc"), Some(0.75));
        assert_eq!(mean(text, "vllm:num_preemptions"), None);
    }
}
