//! A run directory, loaded: `summary.json` as key → value, `run.json` (what produced it), and
//! `requests.csv` / `timeseries.csv` as polars DataFrames.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use infer_core::metrics::RunInfo;
use infer_core::workload::ArrivalKind;
use polars::prelude::*;

#[derive(Debug, Clone)]
pub struct Run {
    pub dir: PathBuf,
    /// `run.json`; absent in run directories written before it existed.
    pub info: Option<RunInfo>,
    /// The numeric entries of `summary.json` (vLLM's keys and ours).
    pub summary: BTreeMap<String, f64>,
    /// `requests.csv`, one row per request.
    pub requests: DataFrame,
    /// `timeseries.csv`; empty when the file is absent (a client-side benchmark may not see
    /// the server's queue).
    pub timeseries: DataFrame,
}

impl Run {
    pub fn load(dir: impl AsRef<Path>) -> Result<Run, String> {
        let dir = dir.as_ref().to_path_buf();
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read_to_string(&p).map_err(|e| format!("{}: cannot read: {e}", p.display()))
        };
        let summary: BTreeMap<String, serde_json::Value> =
            serde_json::from_str(&read("summary.json")?)
                .map_err(|e| format!("{}/summary.json: {e}", dir.display()))?;
        let summary = summary
            .into_iter()
            .filter_map(|(k, v)| v.as_f64().map(|v| (k, v)))
            .collect();
        let info = match dir.join("run.json").exists() {
            true => Some(
                serde_json::from_str(&read("run.json")?)
                    .map_err(|e| format!("{}/run.json: {e}", dir.display()))?,
            ),
            false => None,
        };
        let requests = read_csv(&dir.join("requests.csv"), requests_types())?;
        let ts_path = dir.join("timeseries.csv");
        let timeseries = match ts_path.exists() {
            true => read_csv(&ts_path, timeseries_types())?,
            false => DataFrame::empty(),
        };
        Ok(Run {
            dir,
            info,
            summary,
            requests,
            timeseries,
        })
    }

    /// A `summary.json` entry.
    pub fn metric(&self, key: &str) -> Option<f64> {
        self.summary.get(key).copied()
    }

    /// The directory's own name.
    pub fn dir_name(&self) -> String {
        self.dir.file_name().map_or_else(
            || self.dir.display().to_string(),
            |n| n.to_string_lossy().into(),
        )
    }

    /// The scenario name (from run.json), else the directory name.
    pub fn scenario(&self) -> String {
        self.info
            .as_ref()
            .map_or_else(|| self.dir_name(), |i| i.scenario.clone())
    }

    pub fn model(&self) -> String {
        self.info
            .as_ref()
            .map_or_else(String::new, |i| i.server.model.clone())
    }

    pub fn phase(&self) -> String {
        self.info
            .as_ref()
            .map_or_else(String::new, |i| i.phase.clone())
    }

    /// The router of a multi-replica run.
    pub fn router(&self) -> String {
        match &self.info {
            Some(i) if i.replicas > 1 => i.router.map_or(String::new(), |r| {
                serde_json::to_value(r)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_else(|| format!("{r:?}"))
            }),
            _ => String::new(),
        }
    }

    pub fn replicas(&self) -> usize {
        self.info.as_ref().map_or(1, |i| i.replicas)
    }

    /// The closed-loop client count of a `concurrency` run.
    pub fn concurrency(&self) -> Option<usize> {
        let i = self.info.as_ref()?;
        match i.arrival.kind {
            ArrivalKind::Concurrency => i.arrival.max_concurrency,
            _ => None,
        }
    }

    /// Successful requests only: failed ones have no TTFT and would skew latencies.
    pub fn successful(&self) -> DataFrame {
        let ok = self
            .requests
            .column("success")
            .and_then(|c| c.bool().cloned());
        match ok {
            Ok(mask) => self
                .requests
                .filter(&mask)
                .unwrap_or_else(|_| DataFrame::empty()),
            Err(_) => self.requests.clone(),
        }
    }
}

/// The non-null values of a numeric column as f64 (empty if the column is absent).
pub fn values(df: &DataFrame, name: &str) -> Vec<f64> {
    let Ok(col) = df.column(name) else {
        return Vec::new();
    };
    let Ok(col) = col.cast(&DataType::Float64) else {
        return Vec::new();
    };
    col.f64()
        .map(|ca| ca.iter().flatten().collect())
        .unwrap_or_default()
}

/// A quantile (`q` in 0..=1) of a numeric column by linear interpolation between closest
/// ranks: numpy's default and core's definition, so it agrees with summary.json.
pub fn quantile(df: &DataFrame, name: &str, q: f64) -> Option<f64> {
    let col = df.column(name).ok()?.cast(&DataType::Float64).ok()?;
    col.f64().ok()?.quantile(q, QuantileMethod::Linear).ok()?
}

pub fn mean(df: &DataFrame, name: &str) -> Option<f64> {
    let col = df.column(name).ok()?.cast(&DataType::Float64).ok()?;
    col.f64().ok()?.mean()
}

fn read_csv(path: &Path, types: Vec<(&str, DataType)>) -> Result<DataFrame, String> {
    // Types are fixed rather than inferred: an all-empty column (no replica in a
    // single-server run) would otherwise come back as strings.
    let schema: Schema = types
        .into_iter()
        .map(|(n, t)| Field::new(n.into(), t))
        .collect();
    CsvReadOptions::default()
        .with_has_header(true)
        .with_schema_overwrite(Some(Arc::new(schema)))
        .try_into_reader_with_file_path(Some(path.to_path_buf()))
        .and_then(|r| r.finish())
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn requests_types() -> Vec<(&'static str, DataType)> {
    use DataType::{Boolean, Float64, Int64, String};
    vec![
        ("id", Int64),
        ("start_s", Float64),
        ("ttft_ms", Float64),
        ("e2e_ms", Float64),
        ("tpot_ms", Float64),
        ("itl_mean_ms", Float64),
        ("itl_max_ms", Float64),
        ("prompt_tokens", Int64),
        ("output_tokens", Int64),
        ("cached_tokens", Int64),
        ("preemptions", Int64),
        ("queue_ms", Float64),
        ("replica", Int64),
        ("success", Boolean),
        ("error", String),
    ]
}

fn timeseries_types() -> Vec<(&'static str, DataType)> {
    use DataType::{Float64, Int64};
    vec![
        ("t_s", Float64),
        ("replica", Int64),
        ("waiting", Int64),
        ("running", Int64),
        ("kv_usage", Float64),
        ("prefix_queries", Int64),
        ("prefix_hits", Int64),
        ("preemptions", Int64),
    ]
}

/// Column labels for runs shown side by side: the shortest description that tells them
/// apart (phase, model, router, or combinations), else the directory names.
pub fn labels(runs: &[&Run]) -> Vec<String> {
    for describe in DESCRIPTIONS {
        let ls: Vec<String> = runs.iter().map(|r| describe(r)).collect();
        if ls.iter().all(|l| !l.is_empty()) && distinct(&ls) {
            return ls;
        }
    }
    runs.iter().map(|r| r.dir_name()).collect()
}

/// Series names for charts whose points come from several runs of one configuration (a
/// QPS or concurrency sweep): runs share a name exactly when model, phase and router match.
pub fn series_labels(runs: &[&Run]) -> Vec<String> {
    let keys: Vec<String> = runs.iter().map(|r| config_key(r)).collect();
    for describe in DESCRIPTIONS {
        let ls: Vec<String> = runs.iter().map(|r| describe(r)).collect();
        let same_grouping = (0..runs.len())
            .all(|i| (0..runs.len()).all(|j| (ls[i] == ls[j]) == (keys[i] == keys[j])));
        if ls.iter().all(|l| !l.is_empty()) && same_grouping {
            return ls;
        }
    }
    keys
}

type Describe = fn(&Run) -> String;

const DESCRIPTIONS: [Describe; 5] = [
    |r| r.phase(),
    |r| r.model(),
    |r| r.router(),
    |r| join(&[r.model(), r.phase()]),
    config_key,
];

fn config_key(r: &Run) -> String {
    let key = join(&[r.model(), r.phase(), r.router()]);
    if key.is_empty() {
        r.dir_name()
    } else {
        key
    }
}

fn join(parts: &[String]) -> String {
    parts
        .iter()
        .filter(|p| !p.is_empty())
        .cloned()
        .collect::<Vec<_>>()
        .join(" · ")
}

fn distinct(ls: &[String]) -> bool {
    let mut sorted = ls.to_vec();
    sorted.sort();
    sorted.dedup();
    sorted.len() == ls.len()
}
