//! One definition of the serving metrics, used by the simulator, the server and the client,
//! matching vLLM's serving benchmark so numbers compare with published ones:
//!
//! * TTFT = first token − request start; E2E = last token − start;
//! * TPOT = (E2E − TTFT) / (output_tokens − 1), per request with more than one token;
//! * ITL = gaps between successive streamed chunks, pooled over all requests;
//! * throughputs over the run's duration; percentiles by linear interpolation (numpy's
//!   default); standard deviations over the population; reported in milliseconds.
//!
//! Per-token data is not kept for finished requests: each request becomes one
//! [`RequestRecord`], and ITL gaps go into a [`Samples`] pool that stays exact up to a
//! bound and then continues as a fine log-bucketed histogram (≤ 0.05% relative error).

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;
use std::fmt::Write as _;

use serde::ser::{Serialize, SerializeMap, Serializer};

/// One request's outcome: a row of `requests.csv`.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    pub id: u64,
    /// Send time, seconds from the run's start.
    pub start: f64,
    pub ttft: Option<f64>,
    pub e2e: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub cached_tokens: usize,
    pub preemptions: u32,
    /// Time from arrival at the scheduler to first scheduling, when known.
    pub queue_time: Option<f64>,
    /// Streamed chunks after the first, their mean and largest gap.
    pub itl_mean: Option<f64>,
    pub itl_max: Option<f64>,
    /// The replica that served it (routed runs).
    pub replica: Option<usize>,
    /// Its priority (`workload.priorities`; 0 without).
    pub priority: i64,
    pub error: Option<String>,
}

impl RequestRecord {
    pub const CSV_HEADER: &'static str =
        "id,start_s,ttft_ms,e2e_ms,tpot_ms,itl_mean_ms,itl_max_ms,\
prompt_tokens,output_tokens,cached_tokens,preemptions,queue_ms,replica,priority,success,error";

    pub fn success(&self) -> bool {
        self.error.is_none()
    }

    pub fn tpot(&self) -> Option<f64> {
        match self.ttft {
            Some(ttft) if self.output_tokens > 1 && self.success() => {
                Some((self.e2e - ttft) / (self.output_tokens - 1) as f64)
            }
            _ => None,
        }
    }

    pub fn to_csv_row(&self) -> String {
        let ms = |v: Option<f64>| v.map_or(String::new(), |x| format!("{:.3}", x * 1e3));
        let err = self
            .error
            .as_deref()
            .unwrap_or("")
            .replace(['"', '\n', '\r'], " ");
        format!(
            "{},{:.6},{},{:.3},{},{},{},{},{},{},{},{},{},{},{},\"{}\"",
            self.id,
            self.start,
            ms(self.ttft),
            self.e2e * 1e3,
            ms(self.tpot()),
            ms(self.itl_mean),
            ms(self.itl_max),
            self.prompt_tokens,
            self.output_tokens,
            self.cached_tokens,
            self.preemptions,
            ms(self.queue_time),
            self.replica.map_or(String::new(), |r| r.to_string()),
            self.priority,
            self.success(),
            err
        )
    }
}

/// A pool of non-negative samples with exact mean and std, and percentiles that are exact
/// up to `EXACT_LIMIT` samples and within 0.05% beyond.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    exact: Vec<f64>,
    /// Histogram mode (past `EXACT_LIMIT`): counts of buckets `lo`, `lo + 1`, …, dense so
    /// that a push is an index, not a tree insert (ITL pushes one per token).
    bucketed: bool,
    counts: Vec<u64>,
    lo: i32,
    /// Samples at or below `BUCKET_FLOOR` (counted as 0).
    zeros: u64,
    n: u64,
    sum: f64,
    sum_sq: f64,
}

const EXACT_LIMIT: usize = 1 << 21;
/// Histogram buckets split each power of two into 2^10 equal parts: a sample's exponent and
/// top ten mantissa bits are its bucket, so counting one is a shift (ITL counts one per
/// token), and a bucket's midpoint is within 2^-11 < 0.05% of every value in it.
const BUCKET_SHIFT: u32 = 52 - 10;
const BUCKET_FLOOR: f64 = 1e-9;
/// Larger samples (and infinities) count in the bucket of 1e12 s.
const BUCKET_CEIL: f64 = 1e12;

impl Samples {
    pub fn push(&mut self, x: f64) {
        self.n += 1;
        self.sum += x;
        self.sum_sq += x * x;
        if !self.bucketed && self.exact.len() < EXACT_LIMIT {
            self.exact.push(x);
            return;
        }
        if !self.bucketed {
            self.bucketed = true;
            for v in std::mem::take(&mut self.exact) {
                self.count(v);
            }
        }
        self.count(x);
    }

    fn count(&mut self, x: f64) {
        let Some(b) = bucket_of(x) else {
            self.zeros += 1;
            return;
        };
        if self.counts.is_empty() {
            self.lo = b;
        } else if b < self.lo {
            let grow = (self.lo - b) as usize;
            self.counts.splice(0..0, std::iter::repeat_n(0, grow));
            self.lo = b;
        }
        let i = (b - self.lo) as usize;
        if i >= self.counts.len() {
            self.counts.resize(i + 1, 0);
        }
        self.counts[i] += 1;
    }

    pub fn len(&self) -> usize {
        self.n as usize
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    pub fn stats(&mut self) -> Stats {
        if self.n == 0 {
            return Stats::default();
        }
        let n = self.n as f64;
        let mean = self.sum / n;
        let std = (self.sum_sq / n - mean * mean).max(0.0).sqrt();
        self.exact.sort_unstable_by(f64::total_cmp);
        Stats {
            mean,
            median: self.percentile(50.0),
            std,
            p90: self.percentile(90.0),
            p95: self.percentile(95.0),
            p99: self.percentile(99.0),
        }
    }

    /// Linear interpolation between the closest ranks (numpy's default). Needs `exact`
    /// sorted (done by `stats`).
    fn percentile(&self, q: f64) -> f64 {
        let rank = q / 100.0 * (self.n - 1) as f64;
        let (lo, hi) = (rank.floor() as u64, rank.ceil() as u64);
        let (a, b) = (self.nth(lo), self.nth(hi));
        a + (b - a) * (rank - lo as f64)
    }

    fn nth(&self, k: u64) -> f64 {
        if !self.bucketed {
            return self.exact[k as usize];
        }
        let mut seen = self.zeros;
        if seen > k {
            return 0.0;
        }
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen > k {
                return value_of(self.lo + i as i32);
            }
        }
        match self.counts.len() {
            0 => 0.0,
            len => value_of(self.lo + len as i32 - 1),
        }
    }
}

/// The histogram bucket of `x`: `None` at or below the floor (and for NaN).
fn bucket_of(x: f64) -> Option<i32> {
    if x.is_nan() || x <= BUCKET_FLOOR {
        return None;
    }
    let b =
        (x.min(BUCKET_CEIL).to_bits() >> BUCKET_SHIFT) - (BUCKET_FLOOR.to_bits() >> BUCKET_SHIFT);
    Some(b as i32)
}

/// The midpoint of bucket `b`.
fn value_of(b: i32) -> f64 {
    let bits =
        |b: u64| f64::from_bits((b + (BUCKET_FLOOR.to_bits() >> BUCKET_SHIFT)) << BUCKET_SHIFT);
    (bits(b as u64) + bits(b as u64 + 1)) / 2.0
}

/// Mean, median, standard deviation and tail percentiles of one metric (seconds).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Stats {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
}

impl Stats {
    pub fn of(values: impl IntoIterator<Item = f64>) -> Stats {
        let mut s = Samples::default();
        values.into_iter().for_each(|v| s.push(v));
        s.stats()
    }
}

/// The run summary: vLLM's result keys, then ours.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Summary {
    pub completed: usize,
    pub failed: usize,
    pub duration: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft: Stats,
    pub tpot: Stats,
    pub itl: Stats,
    pub e2el: Stats,
    pub prefix_cache_hit_rate: f64,
    pub num_preemptions: u64,
    pub peak_kv_usage: f64,
    pub max_concurrency: Option<usize>,
    /// With an SLO only.
    pub goodput: Option<Goodput>,
    /// Each priority's requests, lowest value first, when the run had any other than 0.
    pub by_priority: Vec<PrioritySummary>,
}

/// The requests of one priority: how many, and their latencies.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PrioritySummary {
    pub priority: i64,
    pub completed: usize,
    pub failed: usize,
    pub ttft: Stats,
    pub e2el: Stats,
    /// With an SLO only: the share of this priority's requests within it (failed ones
    /// missing it).
    pub slo_attainment: Option<f64>,
}

/// Requests within the SLO: per second of the run (vLLM's `request_goodput`) and as a
/// fraction of all requests sent (failed ones count as missing it).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Goodput {
    pub request_goodput: f64,
    pub slo_attainment: f64,
}

impl Summary {
    /// The summary as ordered (key, value) pairs with vLLM's key names; latencies in ms.
    pub fn entries(&self) -> Vec<(String, f64)> {
        let mut out = vec![
            ("completed".to_string(), self.completed as f64),
            ("failed".into(), self.failed as f64),
            ("duration".into(), self.duration),
            ("total_input_tokens".into(), self.total_input_tokens as f64),
            (
                "total_output_tokens".into(),
                self.total_output_tokens as f64,
            ),
            ("request_throughput".into(), self.request_throughput),
            ("output_throughput".into(), self.output_throughput),
            ("total_token_throughput".into(), self.total_token_throughput),
        ];
        for (name, s) in [
            ("ttft", self.ttft),
            ("tpot", self.tpot),
            ("itl", self.itl),
            ("e2el", self.e2el),
        ] {
            for (stat, v) in [
                ("mean", s.mean),
                ("median", s.median),
                ("std", s.std),
                ("p90", s.p90),
                ("p95", s.p95),
                ("p99", s.p99),
            ] {
                out.push((format!("{stat}_{name}_ms"), v * 1e3));
            }
        }
        out.push(("prefix_cache_hit_rate".into(), self.prefix_cache_hit_rate));
        out.push(("num_preemptions".into(), self.num_preemptions as f64));
        out.push(("peak_kv_usage".into(), self.peak_kv_usage));
        if let Some(g) = self.goodput {
            out.push(("request_goodput".into(), g.request_goodput));
            out.push(("slo_attainment".into(), g.slo_attainment));
        }
        for c in &self.by_priority {
            let p = c.priority;
            out.push((format!("priority_{p}_completed"), c.completed as f64));
            out.push((format!("priority_{p}_failed"), c.failed as f64));
            if let Some(a) = c.slo_attainment {
                out.push((format!("priority_{p}_slo_attainment"), a));
            }
            for (name, s) in [("ttft", c.ttft), ("e2el", c.e2el)] {
                for (stat, v) in [("mean", s.mean), ("median", s.median), ("p99", s.p99)] {
                    out.push((format!("priority_{p}_{stat}_{name}_ms"), v * 1e3));
                }
            }
        }
        out
    }

    /// vLLM's `Serving Benchmark Result` block.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let line = |s: &mut String, k: &str, v: String| {
            let _ = writeln!(s, "{k:<40} {v:<10}");
        };
        let _ = writeln!(s, "{:=^50}", " Serving Benchmark Result ");
        line(&mut s, "Successful requests:", self.completed.to_string());
        line(&mut s, "Failed requests:", self.failed.to_string());
        if let Some(c) = self.max_concurrency {
            line(&mut s, "Maximum request concurrency:", c.to_string());
        }
        line(
            &mut s,
            "Benchmark duration (s):",
            format!("{:.2}", self.duration),
        );
        line(
            &mut s,
            "Total input tokens:",
            self.total_input_tokens.to_string(),
        );
        line(
            &mut s,
            "Total generated tokens:",
            self.total_output_tokens.to_string(),
        );
        line(
            &mut s,
            "Request throughput (req/s):",
            format!("{:.2}", self.request_throughput),
        );
        if let Some(g) = self.goodput {
            line(
                &mut s,
                "Request goodput (req/s):",
                format!("{:.2}", g.request_goodput),
            );
            line(
                &mut s,
                "Requests within SLO (%):",
                format!("{:.2}", g.slo_attainment * 100.0),
            );
        }
        line(
            &mut s,
            "Output token throughput (tok/s):",
            format!("{:.2}", self.output_throughput),
        );
        line(
            &mut s,
            "Total Token throughput (tok/s):",
            format!("{:.2}", self.total_token_throughput),
        );
        for (title, short, st) in [
            ("Time to First Token", "TTFT", self.ttft),
            ("Time per Output Token (excl. 1st token)", "TPOT", self.tpot),
            ("Inter-token Latency", "ITL", self.itl),
            ("End-to-end Latency", "E2EL", self.e2el),
        ] {
            let _ = writeln!(s, "{:-^50}", title);
            line(
                &mut s,
                &format!("Mean {short} (ms):"),
                format!("{:.2}", st.mean * 1e3),
            );
            line(
                &mut s,
                &format!("Median {short} (ms):"),
                format!("{:.2}", st.median * 1e3),
            );
            line(
                &mut s,
                &format!("P99 {short} (ms):"),
                format!("{:.2}", st.p99 * 1e3),
            );
        }
        if !self.by_priority.is_empty() {
            let _ = writeln!(s, "{:-^50}", "By Priority (lowest value first)");
            for c in &self.by_priority {
                let p = c.priority;
                line(
                    &mut s,
                    &format!("Priority {p} requests (ok/failed):"),
                    format!("{}/{}", c.completed, c.failed),
                );
                if let Some(a) = c.slo_attainment {
                    line(
                        &mut s,
                        &format!("Priority {p} within SLO (%):"),
                        format!("{:.2}", a * 100.0),
                    );
                }
                for (short, st) in [("TTFT", c.ttft), ("E2EL", c.e2el)] {
                    line(
                        &mut s,
                        &format!("Priority {p} median/P99 {short} (ms):"),
                        format!("{:.2}/{:.2}", st.median * 1e3, st.p99 * 1e3),
                    );
                }
            }
        }
        let _ = writeln!(s, "{:=^50}", "");
        s
    }
}

impl Serialize for Summary {
    fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        SummaryJson {
            summary: self,
            extra: &[],
        }
        .serialize(ser)
    }
}

/// `summary.json`: vLLM's keys, then figures of ours after them (a prediction's interval,
/// `median_ttft_ms_lo` and `median_ttft_ms_hi`, …).
pub struct SummaryJson<'a> {
    pub summary: &'a Summary,
    pub extra: &'a [(String, f64)],
}

impl Serialize for SummaryJson<'_> {
    fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        let entries = self.summary.entries();
        let mut m = ser.serialize_map(Some(entries.len() + 1 + self.extra.len()))?;
        for (k, v) in &entries {
            // Counts as integers, like vLLM's JSON.
            if matches!(
                k.as_str(),
                "completed"
                    | "failed"
                    | "total_input_tokens"
                    | "total_output_tokens"
                    | "num_preemptions"
            ) || (k.starts_with("priority_")
                && (k.ends_with("_completed") || k.ends_with("_failed")))
            {
                m.serialize_entry(k, &(*v as u64))?;
            } else {
                m.serialize_entry(k, v)?;
            }
        }
        m.serialize_entry("max_concurrency", &self.summary.max_concurrency)?;
        for (k, v) in self.extra {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// The failed requests' errors by kind, for the few lines a run prints: errors that differ
/// only in their numbers ("… you requested 1406 tokens …", "… 1395 tokens …") are one
/// kind. At most [`FailureTally::MAX_KINDS`] kinds are kept; later ones are only counted.
#[derive(Debug, Clone, Default)]
pub struct FailureTally {
    /// In the order first seen.
    kinds: Vec<FailureKind>,
    index: FxHashMap<String, usize>,
    /// Failures of kinds past the first `MAX_KINDS`.
    failures_of_later_kinds: usize,
}

#[derive(Debug, Clone)]
struct FailureKind {
    count: usize,
    first_id: u64,
    first: String,
    /// Every error of the kind is its first, word for word.
    all_alike: bool,
}

impl FailureTally {
    pub const MAX_KINDS: usize = 64;
    /// How many kinds [`FailureTally::lines`] names.
    const SHOWN: usize = 3;

    pub fn add(&mut self, id: u64, error: &str) {
        let kind = kind_of(error);
        if let Some(&k) = self.index.get(&kind) {
            let k = &mut self.kinds[k];
            k.count += 1;
            k.all_alike &= k.first == error;
        } else if self.kinds.len() < Self::MAX_KINDS {
            self.index.insert(kind, self.kinds.len());
            self.kinds.push(FailureKind {
                count: 1,
                first_id: id,
                first: error.to_string(),
                all_alike: true,
            });
        } else {
            self.failures_of_later_kinds += 1;
        }
    }

    /// The most frequent kinds first, one line each, of `total` requests; then one line
    /// for the rest.
    pub fn lines(&self, total: usize) -> Vec<String> {
        let mut kinds: Vec<&FailureKind> = self.kinds.iter().collect();
        kinds.sort_by_key(|k| std::cmp::Reverse(k.count)); // stable: first seen first
        let mut lines: Vec<String> = kinds
            .iter()
            .take(Self::SHOWN)
            .map(|k| {
                let n = k.count;
                if k.all_alike {
                    format!("failed: {n} of {total} requests: {}", k.first)
                } else {
                    format!(
                        "failed: {n} of {total} requests, the first (request {}): {}",
                        k.first_id, k.first
                    )
                }
            })
            .collect();
        let rest: usize = kinds
            .iter()
            .skip(Self::SHOWN)
            .map(|k| k.count)
            .sum::<usize>()
            + self.failures_of_later_kinds;
        if rest > 0 {
            lines.push(format!(
                "failed: {rest} more of {total} requests, with other errors (each request's \
                 is in requests.csv)"
            ));
        }
        lines
    }
}

/// An error with its numbers blanked out: what errors of one kind share.
fn kind_of(error: &str) -> String {
    let mut kind = String::with_capacity(error.len());
    for c in error.chars() {
        if !c.is_ascii_digit() {
            kind.push(c);
        } else if !kind.ends_with('#') {
            kind.push('#');
        }
    }
    kind
}

/// `requests.csv` of a whole run at once: the header and one row per record, in id order
/// (through [`RequestsCsvWriter`], the one place rows are laid out).
pub fn requests_csv(records: &[RequestRecord]) -> String {
    let mut w = RequestsCsvWriter::new(Vec::with_capacity(records.len() * 96 + 128))
        .expect("writing to memory");
    for r in records {
        w.push(r.clone()).expect("writing to memory");
    }
    String::from_utf8(w.finish().expect("writing to memory")).expect("rows are UTF-8")
}

/// `timeseries.csv`: the header and one row per point.
pub fn timeseries_csv(points: &[TimePoint]) -> String {
    let mut s = String::with_capacity(points.len() * 48 + 96);
    s.push_str(TimePoint::CSV_HEADER);
    s.push('\n');
    for p in points {
        s.push_str(&p.to_csv_row());
        s.push('\n');
    }
    s
}

/// A point of `timeseries.csv`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimePoint {
    pub t: f64,
    pub replica: usize,
    pub waiting: usize,
    pub running: usize,
    pub kv_usage: f64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
}

impl TimePoint {
    pub const CSV_HEADER: &'static str =
        "t_s,replica,waiting,running,kv_usage,prefix_queries,prefix_hits,preemptions";

    pub fn to_csv_row(&self) -> String {
        format!(
            "{:.6},{},{},{},{:.6},{},{},{}",
            self.t,
            self.replica,
            self.waiting,
            self.running,
            self.kv_usage,
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions
        )
    }
}

/// A request's stream as its client saw it: when the first chunk came, how many came, and
/// the sum and largest of the gaps between them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Timeline {
    pub first: Option<f64>,
    pub chunks: usize,
    pub itl_sum: f64,
    pub itl_max: f64,
}

#[derive(Debug, Clone)]
struct Live {
    start: f64,
    prompt_tokens: usize,
    priority: i64,
    /// When the last chunk came (the start before the first).
    last: f64,
    timeline: Timeline,
    /// The gaps between its chunks, pooled into the ITL once it completes (as vLLM pools
    /// the gaps of successful requests only).
    gaps: Vec<f64>,
}

/// Service-level objectives as `vllm bench serve --goodput` takes them (milliseconds): a
/// completed request whose TTFT, TPOT and end-to-end latency are each at or below the
/// objectives given counts toward goodput. A scenario's `[slo]` table, or
/// `--goodput ttft:MS tpot:MS e2el:MS` on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slo {
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    #[serde(default)]
    pub tpot_ms: Option<f64>,
    #[serde(default)]
    pub e2el_ms: Option<f64>,
}

impl Slo {
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        for (key, v) in [
            ("ttft_ms", self.ttft_ms),
            ("tpot_ms", self.tpot_ms),
            ("e2el_ms", self.e2el_ms),
        ] {
            if let Some(v) = v {
                if !(v > 0.0 && v.is_finite()) {
                    return Err((key, format!("must be a positive number of ms, got {v}")));
                }
            }
        }
        if self.ttft_ms.is_none() && self.tpot_ms.is_none() && self.e2el_ms.is_none() {
            return Err((
                "ttft_ms",
                "an [slo] table needs at least one of ttft_ms, tpot_ms, e2el_ms".into(),
            ));
        }
        Ok(())
    }

    /// Whether a request met every objective (vLLM: a request with one output token has
    /// TPOT 0; a failed request meets none).
    pub fn met_by(&self, r: &RequestRecord) -> bool {
        let Some(ttft) = r.ttft.filter(|_| r.success()) else {
            return false;
        };
        let within = |limit_ms: Option<f64>, v: f64| limit_ms.is_none_or(|l| v * 1e3 <= l);
        within(self.ttft_ms, ttft)
            && within(self.tpot_ms, r.tpot().unwrap_or(0.0))
            && within(self.e2el_ms, r.e2e)
    }

    /// `--goodput ttft:MS tpot:MS e2el:MS` as scenario overrides (`slo.ttft_ms=MS`, …).
    pub fn overrides(args: &[String]) -> Result<Vec<String>, BadSlo> {
        Self::overrides_of("--goodput", args)
    }

    /// The same objectives given under another flag (`sim plan --slo`), named in errors.
    pub fn overrides_of(flag: &str, args: &[String]) -> Result<Vec<String>, BadSlo> {
        args.iter()
            .map(|a| {
                let (k, v) = a.split_once(':').ok_or_else(|| {
                    BadSlo(format!("{flag} {a}: expected METRIC:MS, e.g. ttft:500"))
                })?;
                if !matches!(k, "ttft" | "tpot" | "e2el") {
                    return Err(BadSlo(format!(
                        "{flag} {a}: the metric must be ttft, tpot or e2el (as vLLM's)"
                    )));
                }
                let ms: f64 = v
                    .parse()
                    .map_err(|_| BadSlo(format!("{flag} {a}: `{v}` is not a number of ms")))?;
                Ok(format!("slo.{k}_ms={ms:?}"))
            })
            .collect()
    }
}

/// A `--goodput` (or `--slo`) argument that cannot be used, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadSlo(pub String);

/// Turns per-request timelines into [`RequestRecord`]s and a [`Summary`].
/// Turns per-request timelines into [`RequestRecord`]s and folds each into the run's
/// [`Summary`] as it ends. It keeps no finished records: the caller keeps or writes the
/// ones `finish` and `fail` return, so a run's memory depends on the requests in flight.
#[derive(Debug, Default)]
pub struct MetricsRecorder {
    live: FxHashMap<u64, Live>,
    itl: Samples,
    ttft: Samples,
    tpot: Samples,
    e2el: Samples,
    completed: usize,
    failed: usize,
    input_tokens: usize,
    output_tokens: usize,
    last_end: f64,
    slo: Option<Slo>,
    /// Requests that met the SLO.
    good: usize,
    failures: FailureTally,
    /// Each priority's requests.
    by_priority: BTreeMap<i64, PrioritySamples>,
}

/// The requests of one priority as they end.
#[derive(Debug, Clone, Default)]
struct PrioritySamples {
    completed: usize,
    failed: usize,
    /// Within the SLO.
    good: usize,
    ttft: Samples,
    e2el: Samples,
}

impl MetricsRecorder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Count goodput against `slo` (from now on).
    pub fn with_slo(mut self, slo: Option<Slo>) -> Self {
        self.slo = slo;
        self
    }

    /// The client sent request `id` at `t`.
    pub fn start(&mut self, id: u64, t: f64, prompt_tokens: usize) {
        let live = Live {
            start: t,
            prompt_tokens,
            priority: 0,
            last: t,
            timeline: Timeline::default(),
            gaps: Vec::new(),
        };
        self.live.insert(id, live);
    }

    /// A streamed chunk (one or more tokens) of request `id` arrived at `t`.
    pub fn chunk(&mut self, id: u64, t: f64) {
        let Some(l) = self.live.get_mut(&id) else {
            return;
        };
        let tl = &mut l.timeline;
        if tl.first.is_none() {
            tl.first = Some(t);
        } else {
            let gap = t - l.last;
            l.gaps.push(gap);
            tl.itl_sum += gap;
            tl.itl_max = tl.itl_max.max(gap);
        }
        tl.chunks += 1;
        l.last = t;
    }

    /// An inter-token gap of a measured request, from a driver that keeps the timeline
    /// itself (the simulator: the scheduler's token times). Pairs with [`Self::finish_timed`].
    pub fn gap(&mut self, gap: f64) {
        self.itl.push(gap);
    }

    /// Request `id`'s priority, where it has one other than 0.
    pub fn set_priority(&mut self, id: u64, priority: i64) {
        if let Some(l) = self.live.get_mut(&id) {
            l.priority = priority;
        }
    }

    /// The server's own prompt token count for `id` (it tokenises the text itself).
    pub fn set_prompt_tokens(&mut self, id: u64, prompt_tokens: usize) {
        if let Some(l) = self.live.get_mut(&id) {
            l.prompt_tokens = prompt_tokens;
        }
    }

    /// Request `id` completed at `t`: its record, or `None` for a request never started.
    #[allow(clippy::too_many_arguments)]
    pub fn finish(
        &mut self,
        id: u64,
        t: f64,
        output_tokens: usize,
        cached_tokens: usize,
        preemptions: u32,
        queue_time: Option<f64>,
        replica: Option<usize>,
    ) -> Option<RequestRecord> {
        let live = self.live.get_mut(&id)?;
        let timeline = live.timeline;
        for gap in std::mem::take(&mut live.gaps) {
            self.itl.push(gap);
        }
        self.finish_timed(
            id,
            t,
            timeline,
            output_tokens,
            cached_tokens,
            preemptions,
            queue_time,
            replica,
        )
    }

    /// [`Self::finish`] for a driver that kept the timeline itself and sent its gaps with
    /// [`Self::gap`]: the first token seen at `timeline.first`, `timeline.chunks` chunks
    /// (tokens), their gaps summing to `timeline.itl_sum`, the largest `timeline.itl_max`.
    #[allow(clippy::too_many_arguments)]
    pub fn finish_timed(
        &mut self,
        id: u64,
        t: f64,
        timeline: Timeline,
        output_tokens: usize,
        cached_tokens: usize,
        preemptions: u32,
        queue_time: Option<f64>,
        replica: Option<usize>,
    ) -> Option<RequestRecord> {
        let l = self.live.remove(&id)?;
        let gaps = timeline.chunks.saturating_sub(1);
        let record = RequestRecord {
            id,
            start: l.start,
            ttft: timeline.first.map(|f| f - l.start),
            e2e: t - l.start,
            prompt_tokens: l.prompt_tokens,
            output_tokens,
            cached_tokens,
            preemptions,
            queue_time,
            itl_mean: (gaps > 0).then(|| timeline.itl_sum / gaps as f64),
            itl_max: (gaps > 0).then_some(timeline.itl_max),
            replica,
            priority: l.priority,
            error: None,
        };
        self.fold(&record);
        Some(record)
    }

    /// Forget request `id`, which neither completed nor failed: a run interrupted while it
    /// was in flight. It has no record, and its gaps are not pooled. Whether it was live.
    pub fn abandon(&mut self, id: u64) -> bool {
        self.live.remove(&id).is_some()
    }

    /// Request `id` failed at `t` (its gaps are not pooled: as vLLM's, the ITL is that of
    /// completed requests).
    pub fn fail(&mut self, id: u64, t: f64, error: String) -> RequestRecord {
        let l = self.live.remove(&id);
        let (start, prompt_tokens, priority) =
            l.map_or((t, 0, 0), |l| (l.start, l.prompt_tokens, l.priority));
        let record = RequestRecord {
            id,
            start,
            ttft: None,
            // (A driver may end a request it never started at its last event, before it.)
            e2e: (t - start).max(0.0),
            prompt_tokens,
            output_tokens: 0,
            cached_tokens: 0,
            preemptions: 0,
            queue_time: None,
            itl_mean: None,
            itl_max: None,
            replica: None,
            priority,
            error: Some(error),
        };
        self.fold(&record);
        record
    }

    fn fold(&mut self, r: &RequestRecord) {
        self.last_end = self.last_end.max(r.start + r.e2e);
        let good = self.slo.is_some_and(|s| s.met_by(r));
        self.good += usize::from(good);
        let class = self.by_priority.entry(r.priority).or_default();
        class.good += usize::from(good);
        if r.error.is_some() {
            class.failed += 1;
        } else {
            class.completed += 1;
            if let Some(ttft) = r.ttft {
                class.ttft.push(ttft);
            }
            class.e2el.push(r.e2e);
        }
        if let Some(e) = &r.error {
            self.failed += 1;
            self.failures.add(r.id, e);
            return;
        }
        self.completed += 1;
        self.input_tokens += r.prompt_tokens;
        self.output_tokens += r.output_tokens;
        if let Some(ttft) = r.ttft {
            self.ttft.push(ttft);
        }
        if let Some(tpot) = r.tpot() {
            self.tpot.push(tpot);
        }
        self.e2el.push(r.e2e);
    }

    /// The failed requests' errors in a few lines (see [`FailureTally::lines`]).
    pub fn failure_lines(&self) -> Vec<String> {
        self.failures.lines(self.completed + self.failed)
    }

    /// When the last request that ended, ended (seconds from the run's start).
    pub fn last_end(&self) -> f64 {
        self.last_end
    }

    /// The summary over a run of `duration` seconds.
    pub fn summary(&mut self, duration: f64) -> Summary {
        let (input, output) = (self.input_tokens, self.output_tokens);
        let per_s = |x: f64| if duration > 0.0 { x / duration } else { 0.0 };
        Summary {
            completed: self.completed,
            failed: self.failed,
            duration,
            total_input_tokens: input,
            total_output_tokens: output,
            request_throughput: per_s(self.completed as f64),
            output_throughput: per_s(output as f64),
            total_token_throughput: per_s((input + output) as f64),
            ttft: self.ttft.stats(),
            tpot: self.tpot.stats(),
            itl: self.itl.stats(),
            e2el: self.e2el.stats(),
            goodput: self.slo.map(|_| {
                let all = (self.completed + self.failed).max(1) as f64;
                Goodput {
                    request_goodput: per_s(self.good as f64),
                    slo_attainment: self.good as f64 / all,
                }
            }),
            by_priority: if self.by_priority.keys().any(|&p| p != 0) {
                (self.by_priority.iter_mut())
                    .map(|(&priority, c)| PrioritySummary {
                        priority,
                        completed: c.completed,
                        failed: c.failed,
                        ttft: c.ttft.stats(),
                        e2el: c.e2el.stats(),
                        slo_attainment: self
                            .slo
                            .map(|_| c.good as f64 / (c.completed + c.failed).max(1) as f64),
                    })
                    .collect()
            } else {
                Vec::new()
            },
            ..Summary::default()
        }
    }
}

/// Writes `requests.csv` in id order while records arrive in finishing order: a record is
/// held only until every earlier id has been written, so memory follows the requests that
/// overtook a slower one, not the run. Ids are expected to be 0, 1, 2, …; `finish` writes
/// whatever is still held, in order.
///
/// An overloaded run can have millions of overtakers (every request refused while the
/// oldest one still waits): given a directory ([`Self::spilling_into`]), past
/// [`Self::HOLD_AT`] held rows the writer moves them, sorted, into a file there, and merges
/// its files back as their turn comes, so memory stays bounded whatever the order.
pub struct RequestsCsvWriter<W: std::io::Write> {
    out: W,
    next: u64,
    held: BTreeMap<u64, RequestRecord>,
    spill_dir: Option<std::path::PathBuf>,
    /// Held rows moved to disk: sorted runs, each read from its front.
    spilled: Vec<SpilledRun>,
    spills: usize,
}

/// A file of rows in id order, and its first unwritten row.
struct SpilledRun {
    path: std::path::PathBuf,
    lines: std::io::Lines<std::io::BufReader<std::fs::File>>,
    head: Option<(u64, String)>,
}

impl SpilledRun {
    fn advance(&mut self) -> std::io::Result<()> {
        self.head = match self.lines.next().transpose()? {
            Some(line) => {
                let id = line
                    .split(',')
                    .next()
                    .and_then(|id| id.parse().ok())
                    .ok_or_else(|| std::io::Error::other("a spilled row lost its id"))?;
                Some((id, line))
            }
            None => None,
        };
        Ok(())
    }
}

impl<W: std::io::Write> RequestsCsvWriter<W> {
    /// Held rows past which they move to disk (when there is a directory for them): about
    /// 16 MiB of records.
    pub const HOLD_AT: usize = 1 << 16;

    pub fn new(mut out: W) -> std::io::Result<Self> {
        writeln!(out, "{}", RequestRecord::CSV_HEADER)?;
        Ok(RequestsCsvWriter {
            out,
            next: 0,
            held: BTreeMap::new(),
            spill_dir: None,
            spilled: Vec::new(),
            spills: 0,
        })
    }

    /// Keep held rows past [`Self::HOLD_AT`] in files in `dir` (removed by `finish`).
    pub fn spilling_into(mut self, dir: std::path::PathBuf) -> Self {
        self.spill_dir = Some(dir);
        self
    }

    pub fn push(&mut self, r: RequestRecord) -> std::io::Result<()> {
        self.held.insert(r.id, r);
        while self.write_next()? {}
        if self.held.len() > Self::HOLD_AT {
            self.spill()?;
        }
        Ok(())
    }

    /// Write row `next` if it is held or at the front of a spilled run.
    fn write_next(&mut self) -> std::io::Result<bool> {
        if let Some(r) = self.held.remove(&self.next) {
            writeln!(self.out, "{}", r.to_csv_row())?;
        } else if let Some(run) = self
            .spilled
            .iter_mut()
            .find(|run| run.head.as_ref().is_some_and(|(id, _)| *id == self.next))
        {
            let (_, line) = run.head.take().expect("found by its head");
            writeln!(self.out, "{line}")?;
            run.advance()?;
        } else {
            return Ok(false);
        }
        self.next += 1;
        Ok(true)
    }

    /// Move every held row, in id order, into a new file.
    fn spill(&mut self) -> std::io::Result<()> {
        let Some(dir) = &self.spill_dir else {
            return Ok(());
        };
        let path = dir.join(format!(".requests-held-{}.csv", self.spills));
        self.spills += 1;
        use std::io::Write as _;
        let mut file = std::io::BufWriter::new(std::fs::File::create(&path)?);
        for r in std::mem::take(&mut self.held).into_values() {
            writeln!(file, "{}", r.to_csv_row())?;
        }
        file.flush()?;
        drop(file);
        let mut run = SpilledRun {
            lines: std::io::BufRead::lines(std::io::BufReader::new(std::fs::File::open(&path)?)),
            path,
            head: None,
        };
        run.advance()?;
        self.spilled.push(run);
        Ok(())
    }

    /// Records in memory waiting for an earlier id.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    pub fn finish(mut self) -> std::io::Result<W> {
        // The rest in id order: the smallest of what is held and the spilled runs' fronts.
        loop {
            let held = self.held.keys().next().copied();
            let spilled = self
                .spilled
                .iter()
                .enumerate()
                .filter_map(|(i, run)| run.head.as_ref().map(|(id, _)| (*id, i)))
                .min();
            match (held, spilled) {
                (None, None) => break,
                (Some(h), s) if s.is_none_or(|(id, _)| h < id) => {
                    let r = self.held.remove(&h).expect("its first key");
                    writeln!(self.out, "{}", r.to_csv_row())?;
                }
                (_, Some((_, i))) => {
                    let (_, line) = self.spilled[i].head.take().expect("its front");
                    writeln!(self.out, "{line}")?;
                    self.spilled[i].advance()?;
                }
                (Some(_), None) => unreachable!("matched above"),
            }
        }
        for run in self.spilled.drain(..) {
            std::fs::remove_file(&run.path)?;
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_told_by_kind_the_most_frequent_first() {
        let mut t = FailureTally::default();
        t.add(7, "HTTP 503: busy");
        for (id, n) in [(3, 1406), (4, 1395), (5, 1406)] {
            t.add(
                id,
                &format!("maximum context length is 1350 tokens, you requested {n}"),
            );
        }
        t.add(8, "HTTP 503: busy");
        t.add(9, "HTTP 503: busy");
        t.add(10, "cut short");
        t.add(11, "timed out after 30 s");
        assert_eq!(
            t.lines(20),
            [
                "failed: 3 of 20 requests: HTTP 503: busy", // seen first of the two
                "failed: 3 of 20 requests, the first (request 3): maximum context length is \
                 1350 tokens, you requested 1406",
                "failed: 1 of 20 requests: cut short",
                "failed: 1 more of 20 requests, with other errors (each request's is in \
                 requests.csv)",
            ]
        );
        let mut many = FailureTally::default();
        for k in 0..FailureTally::MAX_KINDS + 10 {
            many.add(k as u64, &"x".repeat(k + 1));
        }
        assert_eq!(many.kinds.len(), FailureTally::MAX_KINDS);
        assert!(many.lines(100)[3].starts_with("failed: 71 more of 100 requests"));
        assert!(FailureTally::default().lines(5).is_empty());
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let s = Stats::of([1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s.median, 2.5);
        assert!((s.p90 - 3.7).abs() < 1e-12);
        assert!((s.p99 - 3.97).abs() < 1e-12);
        assert_eq!(s.mean, 2.5);
        assert!((s.std - 1.118_033_988_749_895).abs() < 1e-12);
    }

    #[test]
    fn a_bucket_midpoint_is_within_half_a_permille_of_its_values() {
        let mut x = 2e-9;
        while x < 1e11 {
            let b = bucket_of(x).unwrap();
            let error = (value_of(b) - x).abs() / x;
            assert!(
                error < 5e-4,
                "{x}: bucket {b} reads {} ({error})",
                value_of(b)
            );
            assert!(
                bucket_of(x * 1.002).unwrap() > b,
                "{x}: buckets wider than 0.2%"
            );
            x *= 1.000_7;
        }
    }

    #[test]
    fn histogram_mode_stays_within_tolerance() {
        let mut s = Samples::default();
        for i in 0..(EXACT_LIMIT + 1000) {
            s.push(0.001 + (i % 1000) as f64 * 1e-5);
        }
        let st = s.stats();
        let expected_median = 0.001 + 499.5e-5;
        assert!(
            (st.median - expected_median).abs() / expected_median < 1e-3,
            "{}",
            st.median
        );
        assert!(s.exact.is_empty(), "exact values are released");
        // Zeros, huge values and infinities are counted without growing the histogram
        // past its bound.
        s.push(0.0);
        s.push(1e300);
        s.push(f64::INFINITY);
        let max = bucket_of(BUCKET_CEIL).unwrap();
        assert!(s.counts.len() <= (max - s.lo + 1) as usize);
        assert_eq!(s.zeros, 1);
    }

    /// A driver that keeps the timeline itself (the simulator) gets the same record and
    /// pool as one that reports every chunk.
    #[test]
    fn a_timeline_kept_by_the_driver_records_the_same() {
        let mut by_chunk = MetricsRecorder::new();
        by_chunk.start(1, 0.0, 100);
        for t in [0.5, 0.6, 0.8, 1.1] {
            by_chunk.chunk(1, t);
        }
        let a = by_chunk.finish(1, 1.1, 4, 0, 0, Some(0.1), None).unwrap();
        let mut timed = MetricsRecorder::new();
        timed.start(1, 0.0, 100);
        for gap in [0.6 - 0.5, 0.8 - 0.6, 1.1 - 0.8] {
            timed.gap(gap);
        }
        let timeline = Timeline {
            first: Some(0.5),
            chunks: 4,
            itl_sum: (0.6 - 0.5) + (0.8 - 0.6) + (1.1 - 0.8),
            itl_max: 1.1 - 0.8,
        };
        let b = timed
            .finish_timed(1, 1.1, timeline, 4, 0, 0, Some(0.1), None)
            .unwrap();
        assert_eq!(a, b);
        assert_eq!(by_chunk.summary(2.0), timed.summary(2.0));
    }

    #[test]
    fn request_metrics_follow_vllm_definitions() {
        let mut m = MetricsRecorder::new();
        m.start(1, 0.0, 100);
        for t in [0.5, 0.6, 0.8, 1.1] {
            m.chunk(1, t);
        }
        let done = m.finish(1, 1.1, 4, 0, 0, Some(0.1), None).unwrap();
        // A request that fails after two chunks: its gap (0.3) is not pooled, as vLLM's
        // ITL is over completed requests only.
        m.start(2, 1.0, 50);
        m.chunk(2, 1.1);
        m.chunk(2, 1.4);
        m.fail(2, 1.5, "boom".into());
        assert_eq!(
            m.last_end(),
            1.5,
            "the failure, after the completion at 1.1"
        );
        let s = m.summary(2.0);
        assert_eq!((s.completed, s.failed), (1, 1));
        assert!((s.ttft.median - 0.5).abs() < 1e-12);
        assert!((s.tpot.mean - 0.2).abs() < 1e-12, "(1.1-0.5)/3");
        assert!(
            (s.itl.median - 0.2).abs() < 1e-12,
            "gaps 0.1, 0.2, 0.3 (with the failed one's 0.3, 0.25)"
        );
        assert!((s.e2el.mean - 1.1).abs() < 1e-12);
        assert_eq!(s.output_throughput, 2.0);
        let block = s.render();
        assert!(block.contains("Successful requests:                     1"));
        let row = done.to_csv_row();
        assert!(
            row.starts_with("1,0.000000,500.000,1100.000,200.000"),
            "{row}"
        );
    }

    #[test]
    fn goodput_counts_requests_within_every_objective_as_vllm_does() {
        let slo = Slo {
            ttft_ms: Some(100.0),
            tpot_ms: Some(20.0),
            e2el_ms: None,
        };
        let mut m = MetricsRecorder::new().with_slo(Some(slo));
        // (id, ttft s, e2e s, output tokens): TPOT = (e2e - ttft) / (n - 1).
        let runs = [
            (0, 0.100, 0.100 + 9.0 * 0.019, 10), // TTFT exactly at its limit: good
            (1, 0.101, 0.2, 10),                 // TTFT over
            (2, 0.05, 0.05 + 9.0 * 0.021, 10),   // TPOT over
            (3, 0.05, 0.05, 1),                  // one token: TPOT 0, good
        ];
        for (id, ttft, e2e, n) in runs {
            m.start(id, 0.0, 10);
            m.chunk(id, ttft);
            m.finish(id, e2e, n, 0, 0, None, None);
        }
        m.start(4, 0.0, 10);
        m.fail(4, 0.01, "refused".into());
        let s = m.summary(2.0);
        let g = s.goodput.expect("an SLO was set");
        assert_eq!(g.request_goodput, 1.0, "2 good requests over 2 s");
        assert_eq!(g.slo_attainment, 0.4, "2 of 5, the failed one included");
        assert!(s
            .render()
            .contains("Request goodput (req/s):                 1.00"));
        let keys: Vec<String> = s.entries().into_iter().map(|(k, _)| k).collect();
        assert!(keys.contains(&"request_goodput".to_string()));
        let plain = MetricsRecorder::new().summary(1.0);
        assert!(plain.goodput.is_none() && !plain.render().contains("goodput"));
        assert_eq!(
            Slo::overrides(&["ttft:500".into(), "e2el:2000.5".into()]).unwrap(),
            ["slo.ttft_ms=500.0", "slo.e2el_ms=2000.5"]
        );
        for bad in ["ttft", "itl:5", "tpot:fast"] {
            let e = Slo::overrides(&[bad.into()]).unwrap_err();
            assert!(e.0.contains(bad), "{e}");
        }
    }

    #[test]
    fn requests_csv_writer_spills_overtakers_past_its_bound_and_merges_them_back() {
        let dir = std::env::temp_dir().join(format!("infer-spill-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let n = 3 * RequestsCsvWriter::<Vec<u8>>::HOLD_AT as u64 + 17;
        // Adversarial: request 0 finishes last (every other row overtakes it), then a
        // shuffle (rows come back from several spilled files and memory at once).
        let shuffled = {
            let mut ids: Vec<u64> = (0..n).collect();
            let mut x = 0x9e37_79b9_u64;
            for i in (1..ids.len()).rev() {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                ids.swap(i, (x >> 33) as usize % (i + 1));
            }
            ids
        };
        for order in [(1..n).chain([0]).collect::<Vec<u64>>(), shuffled] {
            let mut w = RequestsCsvWriter::new(Vec::new())
                .unwrap()
                .spilling_into(dir.clone());
            let mut most = 0;
            for &id in &order {
                w.push(record(id)).unwrap();
                most = most.max(w.held());
            }
            assert!(
                most <= RequestsCsvWriter::<Vec<u8>>::HOLD_AT + 1,
                "{most} held"
            );
            let text = String::from_utf8(w.finish().unwrap()).unwrap();
            let ids: Vec<u64> = text
                .lines()
                .skip(1)
                .map(|l| l.split(',').next().unwrap().parse().unwrap())
                .collect();
            assert_eq!(ids, (0..n).collect::<Vec<u64>>());
            assert_eq!(
                std::fs::read_dir(&dir).unwrap().count(),
                0,
                "spill files left"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn record(id: u64) -> RequestRecord {
        RequestRecord {
            id,
            start: id as f64,
            ttft: Some(0.1),
            e2e: 1.0,
            prompt_tokens: 1,
            output_tokens: 1,
            cached_tokens: 0,
            preemptions: 0,
            queue_time: None,
            itl_mean: None,
            itl_max: None,
            replica: None,
            priority: 0,
            error: None,
        }
    }

    #[test]
    fn requests_csv_writer_orders_rows_and_holds_only_overtakers() {
        let rec = record;
        let mut w = RequestsCsvWriter::new(Vec::new()).unwrap();
        for id in [1, 2, 0, 4] {
            w.push(rec(id)).unwrap();
        }
        assert_eq!(w.held(), 1, "0..=2 written, 4 waits for 3");
        let text = String::from_utf8(w.finish().unwrap()).unwrap();
        let ids: Vec<&str> = text.lines().skip(1).map(|l| &l[..1]).collect();
        assert_eq!(ids, ["0", "1", "2", "4"]);
        assert_eq!(text.lines().next(), Some(RequestRecord::CSV_HEADER));
        let shuffled: Vec<RequestRecord> = [4, 0, 2, 1].map(rec).to_vec();
        assert_eq!(
            text,
            requests_csv(&shuffled),
            "the whole-run form sorts the same way"
        );
    }
}
