//! A run directory, loaded: `summary.json` as key → value, `run.json` (what produced it), and
//! `requests.csv` / `timeseries.csv` as [`Frame`]s.

use crate::error::ReportError;
use infer_core::FileError;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::run_dir::RunInfo;
use infer_core::workload::ArrivalKind;

pub use crate::frame::Frame;
use crate::frame::Kind;

#[derive(Debug, Clone)]
pub struct Run {
    pub dir: PathBuf,
    /// `run.json`; absent in run directories written before it existed.
    pub info: Option<RunInfo>,
    /// The numeric entries of `summary.json` (vLLM's keys and ours).
    pub summary: BTreeMap<String, f64>,
    /// `requests.csv`, one row per request.
    pub requests: Frame,
    /// `timeseries.csv`; empty when the file is absent (a client-side benchmark may not see
    /// the server's queue).
    pub timeseries: Frame,
}

impl Run {
    pub fn load(dir: impl AsRef<Path>) -> Result<Run, ReportError> {
        let dir = dir.as_ref().to_path_buf();
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read_to_string(&p).map_err(FileError::at(p, "read"))
        };
        let not_json = |name: &str, e: serde_json::Error| ReportError::Content {
            path: dir.join(name),
            line: Some(e.line()),
            reason: e.to_string(),
        };
        let summary: BTreeMap<String, serde_json::Value> =
            serde_json::from_str(&read("summary.json")?)
                .map_err(|e| not_json("summary.json", e))?;
        let summary = summary
            .into_iter()
            .filter_map(|(k, v)| v.as_f64().map(|v| (k, v)))
            .collect();
        let info = match dir.join("run.json").exists() {
            true => Some(
                serde_json::from_str(&read("run.json")?).map_err(|e| not_json("run.json", e))?,
            ),
            false => None,
        };
        let requests = Frame::read_csv(&dir.join("requests.csv"), REQUESTS)?;
        let ts_path = dir.join("timeseries.csv");
        let timeseries = match ts_path.exists() {
            true => Frame::read_csv(&ts_path, TIMESERIES)?,
            false => Frame::empty(),
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
    pub fn successful(&self) -> Frame {
        match self.requests.bools("success") {
            Some(ok) => {
                let mask: Vec<bool> = ok.iter().map(|b| *b == Some(true)).collect();
                self.requests.filter(&mask)
            }
            None => self.requests.clone(),
        }
    }
}

// Types are fixed rather than inferred: an all-empty column (no replica in a single-server
// run) is still numeric.
const REQUESTS: &[(&str, Kind)] = &[
    ("id", Kind::Number),
    ("start_s", Kind::Number),
    ("ttft_ms", Kind::Number),
    ("e2e_ms", Kind::Number),
    ("tpot_ms", Kind::Number),
    ("itl_mean_ms", Kind::Number),
    ("itl_max_ms", Kind::Number),
    ("prompt_tokens", Kind::Number),
    ("output_tokens", Kind::Number),
    ("cached_tokens", Kind::Number),
    ("preemptions", Kind::Number),
    ("queue_ms", Kind::Number),
    ("replica", Kind::Number),
    ("priority", Kind::Number),
    ("success", Kind::Bool),
    ("error", Kind::Text),
];

const TIMESERIES: &[(&str, Kind)] = &[
    ("t_s", Kind::Number),
    ("replica", Kind::Number),
    ("waiting", Kind::Number),
    ("running", Kind::Number),
    ("kv_usage", Kind::Number),
    ("prefix_queries", Kind::Number),
    ("prefix_hits", Kind::Number),
    ("preemptions", Kind::Number),
];

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
