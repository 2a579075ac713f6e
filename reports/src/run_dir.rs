//! Run directories as they are written: `summary.json`, `requests.csv` (in id order),
//! `timeseries.csv`, `run.json` (what produced the run) and `scenario.toml` (the scenario as
//! run). The one writer, for simulated runs (`sim run`, `engine verify`'s predictions) and
//! measured ones (`engine bench`, `engine probe`) alike; [`crate::run::Run`] reads them back.
//! The CSV rows are laid out by their records in `infer_core::metrics`, where the trace
//! reader also reads `requests.csv`.

use crate::error::ReportError;
use infer_core::FileError;
use std::fs::File;
use std::io::{BufWriter, Write as _};
use std::path::{Path, PathBuf};

use infer_core::metrics::{RequestRecord, RequestsCsvWriter, Summary, TimePoint};
use infer_core::scheduler::{BatchingMode, KvBackend};
use infer_core::workload::{ArrivalSpec, Scenario, ServerSpec};

/// What produced a run directory (`run.json`): enough for reports to label and group runs.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunInfo {
    /// "sim" or "engine".
    pub source: String,
    pub scenario: String,
    pub description: String,
    /// The benchmark log's phase this server configuration corresponds to ([`phase_of`]).
    pub phase: String,
    pub server: ServerSpec,
    pub arrival: ArrivalSpec,
    pub seed: u64,
    pub replicas: usize,
    pub router: Option<infer_core::router::RouterKind>,
    /// The cost model (sim) or the device and model path (engine).
    pub backend: String,
    /// The scenario as run (overrides applied), as TOML: written beside run.json as
    /// `scenario.toml`.
    #[serde(skip)]
    pub scenario_toml: String,
}

impl RunInfo {
    pub fn new(source: &str, scenario: &Scenario, backend: String) -> Self {
        RunInfo {
            source: source.to_string(),
            scenario: scenario.name.clone(),
            description: scenario.description.clone(),
            phase: phase_of(&scenario.server).to_string(),
            server: scenario.server.clone(),
            arrival: scenario.arrival.clone(),
            seed: scenario.workload.seed,
            replicas: scenario.cluster.as_ref().map_or(1, |c| c.replicas),
            router: scenario.cluster.as_ref().map(|c| c.router),
            backend,
            scenario_toml: toml::to_string(&scenario.resolved).unwrap_or_default(),
        }
    }
}

/// The benchmark log's phase for a server configuration: each phase adds one technique.
pub fn phase_of(s: &ServerSpec) -> &'static str {
    match (s.batching_mode, s.kv_cache_backend) {
        (BatchingMode::Static, _) => "P4 static",
        (BatchingMode::Continuous, KvBackend::Contiguous) => "P5 continuous",
        (BatchingMode::Continuous, KvBackend::Paged) => {
            match (s.chunked_prefill, s.prefix_caching, s.cuda_graphs) {
                (_, _, true) if s.chunked_prefill && s.prefix_caching => "P9 cuda-graphs",
                (false, false, _) => "P6 paged",
                (true, false, _) => "P7 chunked",
                (true, true, _) => "P8 prefix-caching",
                (false, true, _) => "P6 paged + prefix-caching",
            }
        }
    }
}

/// `runs/<name>-<unix time>`, with a `-k` suffix if that exists already: where every run
/// directory goes by default (`sim run`, `sim sweep`, `engine bench`, `engine verify`).
pub fn default_run_dir(name: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let base = format!("runs/{name}-{secs}");
    let mut dir = PathBuf::from(&base);
    let mut k = 1;
    while dir.exists() {
        dir = PathBuf::from(format!("{base}-{k}"));
        k += 1;
    }
    dir
}

/// A run directory written as the run goes: requests.csv (in id order) and timeseries.csv
/// are streamed, summary.json and run.json (what produced it) written by `finish`.
pub struct RunDirWriter {
    dir: PathBuf,
    requests: RequestsCsvWriter<BufWriter<File>>,
    timeseries: BufWriter<File>,
    /// The first write error; a failing disk must not stop the run, it fails `finish`.
    error: Option<ReportError>,
}

impl RunDirWriter {
    /// Create `dir` (and parents) and open its streamed files.
    pub fn create(dir: &Path) -> Result<Self, ReportError> {
        std::fs::create_dir_all(dir).map_err(FileError::at(dir, "create"))?;
        let open = |name: &str| {
            let p = dir.join(name);
            File::create(&p)
                .map(BufWriter::new)
                .map_err(FileError::at(p, "write"))
        };
        let requests = RequestsCsvWriter::new(open("requests.csv")?)
            .map_err(FileError::at(dir.join("requests.csv"), "write"))?;
        let mut timeseries = open("timeseries.csv")?;
        let header = writeln!(timeseries, "{}", TimePoint::CSV_HEADER);
        let mut w = RunDirWriter {
            dir: dir.to_path_buf(),
            requests,
            timeseries,
            error: None,
        };
        w.note("timeseries.csv", header);
        Ok(w)
    }

    fn note(&mut self, file: &str, r: std::io::Result<()>) {
        if let (Err(e), None) = (r, &self.error) {
            self.error = Some(FileError::at(self.dir.join(file), "write")(e).into());
        }
    }

    /// A finished request, in any order (rows are written in id order).
    pub fn request(&mut self, r: RequestRecord) {
        let written = self.requests.push(r);
        self.note("requests.csv", written);
    }

    /// A sample of the server's queues and KV use.
    pub fn sample(&mut self, p: TimePoint) {
        let written = writeln!(self.timeseries, "{}", p.to_csv_row());
        self.note("timeseries.csv", written);
    }

    /// Write the summary and run.json, and flush the streamed files.
    pub fn finish(self, summary: &Summary, info: &RunInfo) -> Result<(), ReportError> {
        let RunDirWriter {
            dir,
            requests,
            mut timeseries,
            error,
        } = self;
        if let Some(e) = error {
            return Err(e);
        }
        let failed = |name: &str, e: std::io::Error| FileError::at(dir.join(name), "write")(e);
        requests.finish().map_err(|e| failed("requests.csv", e))?;
        timeseries
            .flush()
            .map_err(|e| failed("timeseries.csv", e))?;
        let write = |name: &str, text: String| {
            std::fs::write(dir.join(name), text).map_err(|e| failed(name, e))
        };
        let unwritable = |name: &str, e: serde_json::Error| ReportError::Content {
            path: dir.join(name),
            line: None,
            reason: e.to_string(),
        };
        let json =
            serde_json::to_string_pretty(summary).map_err(|e| unwritable("summary.json", e))?;
        write("summary.json", json + "\n")?;
        if !info.scenario_toml.is_empty() {
            let header =
                "# The scenario of this run, overrides applied (`sim calibrate` runs it again).\n";
            write("scenario.toml", format!("{header}{}", info.scenario_toml))?;
        }
        let info = serde_json::to_string_pretty(info).map_err(|e| unwritable("run.json", e))?;
        write("run.json", info + "\n")?;
        Ok(())
    }
}

/// Write a whole run's files into `dir` at once (see [`RunDirWriter`]).
pub fn write_run_files(
    dir: &Path,
    summary: &Summary,
    records: &[RequestRecord],
    timeseries: &[TimePoint],
    info: &RunInfo,
) -> Result<(), ReportError> {
    let mut w = RunDirWriter::create(dir)?;
    for r in records {
        w.request(r.clone());
    }
    for p in timeseries {
        w.sample(*p);
    }
    w.finish(summary, info)
}
