//! Run directories (summary.json, requests.csv, timeseries.csv, run.json, scenario.toml)
//! and console text.

use crate::error::SimError;
use infer_core::FileError;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write as _};
use std::path::{Path, PathBuf};

pub use infer_core::metrics::{requests_csv, timeseries_csv};
use infer_core::metrics::{RequestRecord, RequestsCsvWriter, RunInfo, Summary, TimePoint};

use crate::setup::Setup;
use crate::simulate::{RunSink, SimResult};
use crate::stages::stage_table;

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
/// are streamed, summary.json and run.json (what produced it) written by `finish`. The one
/// writer of run directories: simulated and measured runs read back alike.
pub struct RunDirWriter {
    dir: PathBuf,
    requests: RequestsCsvWriter<BufWriter<File>>,
    timeseries: BufWriter<File>,
    /// The first write error; a failing disk must not stop the run, it fails `finish`.
    error: Option<SimError>,
}

impl RunDirWriter {
    /// Create `dir` (and parents) and open its streamed files.
    pub fn create(dir: &Path) -> Result<Self, SimError> {
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

    /// Write the summary and run.json, and flush the streamed files.
    pub fn finish(self, summary: &Summary, info: &RunInfo) -> Result<(), SimError> {
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
        let json = serde_json::to_string_pretty(summary)
            .map_err(|e| SimError::content(dir.join("summary.json").display(), e))?;
        write("summary.json", json + "\n")?;
        if !info.scenario_toml.is_empty() {
            let header =
                "# The scenario of this run, overrides applied (`sim calibrate` runs it again).\n";
            write("scenario.toml", format!("{header}{}", info.scenario_toml))?;
        }
        let info = serde_json::to_string_pretty(info)
            .map_err(|e| SimError::content(dir.join("run.json").display(), e))?;
        write("run.json", info + "\n")?;
        Ok(())
    }
}

impl RunSink for RunDirWriter {
    fn request(&mut self, r: RequestRecord) {
        let written = self.requests.push(r);
        self.note("requests.csv", written);
    }

    fn sample(&mut self, p: TimePoint) {
        let written = writeln!(self.timeseries, "{}", p.to_csv_row());
        self.note("timeseries.csv", written);
    }
}

/// Write a whole run's files into `dir` at once (see [`RunDirWriter`]).
pub fn write_run_files(
    dir: &Path,
    summary: &Summary,
    records: &[RequestRecord],
    timeseries: &[TimePoint],
    info: &RunInfo,
) -> Result<(), SimError> {
    let mut w = RunDirWriter::create(dir)?;
    for r in records {
        w.request(r.clone());
    }
    for p in timeseries {
        w.sample(*p);
    }
    w.finish(summary, info)
}

/// What `sim run` prints: the setup, warnings, vLLM's block, the extra line and, for a
/// staged arrival schedule, one row per stage.
pub fn console(setup: &Setup, result: &SimResult) -> String {
    let mut s = String::new();
    let sc = &setup.scenario;
    let replicas = sc.cluster.as_ref().map_or(String::new(), |c| {
        format!(
            ", {} replicas behind {:?} router (metrics delay {} s)",
            c.replicas, c.router, c.metrics_delay_s
        )
    });
    let _ = writeln!(s, "scenario {} ({}){}", sc.name, setup.file, replicas);
    let _ = writeln!(s, "cost model: {}", setup.cost.describe());
    let _ = writeln!(s, "memory per GPU: {}", setup.memory.describe());
    for w in &setup.warnings {
        let _ = writeln!(s, "{w}");
    }
    s.push_str(&result.summary.render());
    let _ = writeln!(s, "{}", result.stats.line());
    if !result.stages.is_empty() {
        s.push_str(&stage_table(&result.stages));
    }
    s
}
