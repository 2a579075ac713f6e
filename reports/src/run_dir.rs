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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use infer_core::metrics::{RequestRecord, RequestsCsvWriter, Summary, SummaryJson, TimePoint};
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
    /// The scenario's `[workload]` as run (overrides applied): two runs are compared phase
    /// against phase only on the same one. Absent from older runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<serde_json::Value>,
    /// The cost model (sim) or the device and model path (engine).
    pub backend: String,
    /// Where the prediction is fragile (sim: near saturation, extrapolation, uncalibrated),
    /// as printed with the run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// What summary.json's intervals (`KEY_lo`, `KEY_hi`) are made of, where it has them.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub intervals: String,
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
            phase: phase_of(&scenario.server),
            server: scenario.server.clone(),
            arrival: scenario.arrival.clone(),
            seed: scenario.workload.seed,
            replicas: scenario.cluster.as_ref().map_or(1, |c| c.replicas),
            router: scenario.cluster.as_ref().map(|c| c.router),
            workload: scenario
                .resolved
                .get("workload")
                .and_then(|w| serde_json::to_value(w).ok()),
            backend,
            warnings: Vec::new(),
            intervals: String::new(),
            scenario_toml: toml::to_string(&scenario.resolved).unwrap_or_default(),
        }
    }
}

/// The benchmark log's phase for a server configuration: each phase adds one technique.
/// A configuration off the log's ladder is named by the nearest phase and what it adds
/// ("P6 paged + prefix-caching", "P7 chunked + cuda-graphs").
pub fn phase_of(s: &ServerSpec) -> String {
    let phase = match (s.batching_mode, s.kv_cache_backend) {
        (BatchingMode::Static, _) => "P4 static",
        (BatchingMode::Continuous, KvBackend::Contiguous) => "P5 continuous",
        (BatchingMode::Continuous, KvBackend::Paged) => {
            match (s.chunked_prefill, s.prefix_caching, s.cuda_graphs) {
                (true, true, true) => return "P9 cuda-graphs".into(),
                (false, false, _) => "P6 paged",
                (true, false, _) => "P7 chunked",
                (true, true, _) => "P8 prefix-caching",
                (false, true, _) => "P6 paged + prefix-caching",
            }
        }
    };
    if s.cuda_graphs {
        format!("{phase} + cuda-graphs")
    } else {
        phase.to_string()
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

/// The files a run directory holds, `summary.json` last: a directory is a complete run
/// when it has a summary ([`crate::run::Run::load`] needs one), so the summary is the last
/// file to land.
const RUN_FILES: [&str; 5] = [
    "requests.csv",
    "timeseries.csv",
    "scenario.toml",
    "run.json",
    "summary.json",
];

/// A run directory written as the run goes: requests.csv (in id order) and timeseries.csv
/// are streamed, summary.json and run.json (what produced it) written by `finish`.
///
/// Everything is written into a hidden sibling, `.NAME.partial`, locked while the run
/// writes, and moved into `NAME` only by `finish`: a run that fails or is killed never
/// leaves a directory that looks complete (a failed one removes its partial files; a killed
/// one's are cleared by the next run into the same directory), and a second run writing
/// into the same directory at the same time is refused rather than interleaved with the
/// first.
pub struct RunDirWriter {
    dir: PathBuf,
    partial: PathBuf,
    /// Held (an exclusive lock on `partial/.lock`) until the files are in place.
    lock: Option<File>,
    /// Taken by `finish`.
    requests: Option<RequestsCsvWriter<CountingWriter>>,
    timeseries: CountingWriter,
    /// Bytes written to both streamed files.
    written: Arc<AtomicU64>,
    /// Total bytes the streamed files may reach (`None`: no limit), and the key that sets it.
    limit: Option<(u64, String)>,
    /// The first write error; a failing disk must not stop the run, it fails `finish`.
    error: Option<ReportError>,
}

/// A buffered file that adds the bytes written through it to a count.
struct CountingWriter {
    file: BufWriter<File>,
    written: Arc<AtomicU64>,
}

impl std::io::Write for CountingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.written.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

impl RunDirWriter {
    /// Start writing the run directory `dir` (parents are created). Refused when another
    /// run is writing into `dir`, or when `dir` exists and is not a run directory (it would
    /// be mixed with files that are not the run's).
    pub fn create(dir: &Path) -> Result<Self, ReportError> {
        let refuse = |reason: String| ReportError::Content {
            path: dir.to_path_buf(),
            line: None,
            reason,
        };
        let name = dir
            .file_name()
            .ok_or_else(|| refuse("not a directory name to write a run into".into()))?;
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if dir.exists() && !is_run_dir(dir) {
            return Err(refuse(
                "exists and is not a run directory (no summary.json, or files a run does not \
                 write): choose another directory"
                    .into(),
            ));
        }
        let partial = parent.join(format!(".{}.partial", name.to_string_lossy()));
        std::fs::create_dir_all(&partial).map_err(FileError::at(&partial, "create"))?;
        let lock_path = partial.join(".lock");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(FileError::at(&lock_path, "create"))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(refuse(format!(
                    "another run is writing into it (its files are in {} until it ends)",
                    partial.display()
                )))
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(FileError::at(&lock_path, "lock")(e).into())
            }
        }
        // A killed run's files: not this run's.
        let stale = std::fs::read_dir(&partial).map_err(FileError::at(&partial, "read"))?;
        for entry in stale.filter_map(|e| e.ok()) {
            if entry.file_name() != ".lock" {
                let p = entry.path();
                std::fs::remove_file(&p).map_err(FileError::at(&p, "remove"))?;
            }
        }
        let written = Arc::new(AtomicU64::new(0));
        let open = |name: &str| {
            let p = partial.join(name);
            File::create(&p)
                .map(|file| CountingWriter {
                    file: BufWriter::new(file),
                    written: written.clone(),
                })
                .map_err(FileError::at(dir.join(name), "write"))
        };
        let requests = RequestsCsvWriter::new(open("requests.csv")?)
            .map_err(FileError::at(dir.join("requests.csv"), "write"))?
            .spilling_into(partial.clone());
        let mut timeseries = open("timeseries.csv")?;
        let header = writeln!(timeseries, "{}", TimePoint::CSV_HEADER);
        let mut w = RunDirWriter {
            dir: dir.to_path_buf(),
            partial,
            lock: Some(lock),
            requests: Some(requests),
            timeseries,
            written,
            limit: None,
            error: None,
        };
        w.note("timeseries.csv", header);
        Ok(w)
    }

    /// Bound the streamed files' total size: past `bytes`, nothing more is written and the
    /// writer is [`full`](Self::full) (its error names `key`, the setting that sets it).
    pub fn with_limit(mut self, bytes: u64, key: &str) -> Self {
        self.limit = Some((bytes, key.to_string()));
        self
    }

    /// The directory the run lands in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes written to the streamed files so far.
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// Why the run can no longer be written (a write failed or the size limit was reached),
    /// if it cannot: the caller may as well stop.
    pub fn error(&self) -> Option<&ReportError> {
        self.error.as_ref()
    }

    fn note(&mut self, file: &str, r: std::io::Result<()>) {
        if let (Err(e), None) = (r, &self.error) {
            self.error = Some(FileError::at(self.dir.join(file), "write")(e).into());
        }
        if let (Some((bytes, key)), None) = (&self.limit, &self.error) {
            if self.written() > *bytes {
                self.error = Some(ReportError::Content {
                    path: self.dir.clone(),
                    line: None,
                    reason: format!(
                        "the run's files passed {} MiB ({key}): raise it, or shorten the run",
                        bytes >> 20
                    ),
                });
            }
        }
    }

    /// A finished request, in any order (rows are written in id order).
    pub fn request(&mut self, r: RequestRecord) {
        if let (None, Some(w)) = (&self.error, &mut self.requests) {
            let written = w.push(r);
            self.note("requests.csv", written);
        }
    }

    /// A sample of the server's queues and KV use.
    pub fn sample(&mut self, p: TimePoint) {
        if self.error.is_none() {
            let written = writeln!(self.timeseries, "{}", p.to_csv_row());
            self.note("timeseries.csv", written);
        }
    }

    /// Writes a whole run at once into a directory claimed before it ran (so that a
    /// directory that cannot take it is refused before the run, not after).
    pub fn write_all(
        mut self,
        summary: &Summary,
        records: &[RequestRecord],
        timeseries: &[TimePoint],
        info: &RunInfo,
    ) -> Result<(), ReportError> {
        for r in records {
            self.request(r.clone());
        }
        for p in timeseries {
            self.sample(*p);
        }
        self.finish(summary, info)
    }

    /// Write the summary and run.json, flush the streamed files, and move them all into the
    /// run directory.
    pub fn finish(self, summary: &Summary, info: &RunInfo) -> Result<(), ReportError> {
        self.finish_with(summary, &[], info)
    }

    /// [`finish`](Self::finish), with figures of ours after vLLM's keys in summary.json (a
    /// prediction's interval).
    pub fn finish_with(
        mut self,
        summary: &Summary,
        extra: &[(String, f64)],
        info: &RunInfo,
    ) -> Result<(), ReportError> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let (dir, partial) = (self.dir.clone(), self.partial.clone());
        let failed = |name: &str, e: std::io::Error| FileError::at(dir.join(name), "write")(e);
        self.requests
            .take()
            .expect("finish runs once")
            .finish()
            .and_then(|mut w| w.flush())
            .map_err(|e| failed("requests.csv", e))?;
        self.timeseries
            .flush()
            .map_err(|e| failed("timeseries.csv", e))?;
        let write = |name: &str, text: String| {
            std::fs::write(partial.join(name), text).map_err(|e| failed(name, e))
        };
        let unwritable = |name: &str, e: serde_json::Error| ReportError::Content {
            path: dir.join(name),
            line: None,
            reason: e.to_string(),
        };
        let json = serde_json::to_string_pretty(&SummaryJson { summary, extra })
            .map_err(|e| unwritable("summary.json", e))?;
        write("summary.json", json + "\n")?;
        if !info.scenario_toml.is_empty() {
            let header =
                "# The scenario of this run, overrides applied (`sim calibrate` runs it again).\n";
            write("scenario.toml", format!("{header}{}", info.scenario_toml))?;
        }
        let info = serde_json::to_string_pretty(info).map_err(|e| unwritable("run.json", e))?;
        write("run.json", info + "\n")?;
        self.land()
    }

    /// Move the files from the partial directory into the run directory: a rename of the
    /// whole directory when it is new; else file by file, the old summary removed first and
    /// the new one moved last, so that the directory is never a complete run of mixed files.
    fn land(&mut self) -> Result<(), ReportError> {
        let (dir, partial) = (&self.dir, &self.partial);
        let mv = |from: &Path, to: &Path| {
            std::fs::rename(from, to).map_err(|e| FileError::at(to, "write")(e))
        };
        if !dir.exists() {
            mv(partial, dir)?;
            let _ = std::fs::remove_file(dir.join(".lock"));
        } else {
            if !is_run_dir(dir) {
                return Err(ReportError::Content {
                    path: dir.clone(),
                    line: None,
                    reason: "became something other than a run directory while the run was \
                             written: the run's files were not moved into it"
                        .into(),
                });
            }
            // The old run stops looking complete before any of its files is replaced.
            let _ = std::fs::remove_file(dir.join("summary.json"));
            for f in RUN_FILES.iter().filter(|f| **f != "summary.json") {
                let (from, to) = (partial.join(f), dir.join(f));
                if from.exists() {
                    mv(&from, &to)?;
                } else {
                    // A file of the old run that this one does not write (scenario.toml).
                    let _ = std::fs::remove_file(&to);
                }
            }
            mv(&partial.join("summary.json"), &dir.join("summary.json"))?;
            let _ = std::fs::remove_dir_all(partial);
        }
        self.lock = None;
        Ok(())
    }
}

impl Drop for RunDirWriter {
    /// A run that did not finish leaves nothing behind.
    fn drop(&mut self) {
        // The lock is let go only once the files are in place.
        if self.lock.is_some() {
            let _ = std::fs::remove_dir_all(&self.partial);
        }
    }
}

/// Whether `dir` can take a run's files: empty, a run directory (a summary or run.json,
/// whatever else a user put beside them), or only files a run writes (one whose files were
/// being moved when it was killed).
fn is_run_dir(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    let names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.is_empty()
        || names.iter().any(|n| n == "summary.json" || n == "run.json")
        || names.iter().all(|n| RUN_FILES.contains(&n.as_str()))
}

/// Write a whole run's files into `dir` at once (see [`RunDirWriter`]).
pub fn write_run_files(
    dir: &Path,
    summary: &Summary,
    records: &[RequestRecord],
    timeseries: &[TimePoint],
    info: &RunInfo,
) -> Result<(), ReportError> {
    RunDirWriter::create(dir)?.write_all(summary, records, timeseries, info)
}

#[cfg(test)]
mod tests {
    use super::*;
    use infer_core::metrics::MetricsRecorder;

    /// CUDA graphs are named wherever they are on, not only on the log's P9.
    #[test]
    fn phases_name_cuda_graphs_off_the_ladder_too() {
        let with = |chunked, prefix, graphs| {
            phase_of(&ServerSpec {
                chunked_prefill: chunked,
                prefix_caching: prefix,
                cuda_graphs: graphs,
                ..ServerSpec::default()
            })
        };
        assert_eq!(with(true, true, true), "P9 cuda-graphs");
        assert_eq!(with(true, true, false), "P8 prefix-caching");
        assert_eq!(with(false, false, true), "P6 paged + cuda-graphs");
        assert_eq!(with(true, false, true), "P7 chunked + cuda-graphs");
        assert_eq!(
            with(false, true, true),
            "P6 paged + prefix-caching + cuda-graphs"
        );
    }

    /// A fresh directory under the system's temporary folder.
    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("infer-run-dir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn info() -> RunInfo {
        let text = "name = \"t\"\n[workload]\nnum_requests = 1\nprompt_tokens = 8\n\
                    output_tokens = 8\n[arrival]\nkind = \"sequential\"\n";
        let sc = Scenario::parse("t.toml", text, &[]).unwrap();
        RunInfo::new("sim", &sc, "test".into())
    }

    fn record(id: u64) -> RequestRecord {
        let mut m = MetricsRecorder::new();
        m.start(id, 0.0, 8);
        m.fail(id, 0.5, "test".into())
    }

    fn summary() -> Summary {
        MetricsRecorder::new().summary(1.0)
    }

    fn partial_of(dir: &Path) -> PathBuf {
        let name = dir.file_name().unwrap().to_string_lossy();
        dir.parent().unwrap().join(format!(".{name}.partial"))
    }

    #[test]
    fn a_second_writer_into_the_same_directory_is_refused_and_runs_land_whole() {
        let root = scratch("second");
        let dir = root.join("run");
        let mut first = RunDirWriter::create(&dir).unwrap();
        first.request(record(0));
        // Nothing looks like a run until the first writer finishes.
        assert!(!dir.exists());
        let e = RunDirWriter::create(&dir)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("another run is writing"), "{e}");
        first.finish(&summary(), &info()).unwrap();
        assert!(dir.join("summary.json").exists() && dir.join("requests.csv").exists());
        assert!(!partial_of(&dir).exists());
        // Once it is done, a run into the same directory replaces its files, keeping what
        // else the user put there.
        std::fs::write(dir.join("notes.md"), "mine").unwrap();
        let mut second = RunDirWriter::create(&dir).unwrap();
        second.request(record(0));
        second.request(record(1));
        second.finish(&summary(), &info()).unwrap();
        let rows = std::fs::read_to_string(dir.join("requests.csv")).unwrap();
        assert_eq!(rows.lines().count(), 3, "{rows}");
        assert_eq!(
            std::fs::read_to_string(dir.join("notes.md")).unwrap(),
            "mine"
        );
        assert!(!dir.join(".lock").exists() && !partial_of(&dir).exists());
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_failed_or_killed_run_never_leaves_a_complete_looking_directory() {
        let root = scratch("failed");
        let dir = root.join("run");
        // Failed: dropped without finishing.
        let mut w = RunDirWriter::create(&dir).unwrap();
        w.request(record(0));
        drop(w);
        assert!(!dir.exists() && !partial_of(&dir).exists());
        // Killed: its partial files stay, unlocked; the next run clears them.
        let partial = partial_of(&dir);
        std::fs::create_dir_all(&partial).unwrap();
        std::fs::write(partial.join("requests.csv"), "torn").unwrap();
        std::fs::write(partial.join(".lock"), "").unwrap();
        assert!(!dir.exists());
        let mut w = RunDirWriter::create(&dir).unwrap();
        w.request(record(0));
        w.finish(&summary(), &info()).unwrap();
        let rows = std::fs::read_to_string(dir.join("requests.csv")).unwrap();
        assert!(
            !rows.contains("torn") && rows.lines().count() == 2,
            "{rows}"
        );
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_directory_that_is_not_a_run_is_not_written_into() {
        let root = scratch("foreign");
        std::fs::write(root.join("thesis.tex"), "years of work").unwrap();
        let e = RunDirWriter::create(&root)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("not a run directory"), "{e}");
        assert_eq!(
            std::fs::read_to_string(root.join("thesis.tex")).unwrap(),
            "years of work"
        );
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn the_size_limit_stops_writing_and_fails_the_run_naming_its_key() {
        let root = scratch("limit");
        let dir = root.join("run");
        let mut w = RunDirWriter::create(&dir)
            .unwrap()
            .with_limit(4096, "sim.max_output_mib");
        let mut id = 0;
        while w.error().is_none() {
            w.request(record(id));
            id += 1;
            assert!(id < 1000, "the limit never tripped");
        }
        assert!(w.written() < 4096 + 1024, "{}", w.written());
        let e = w.finish(&summary(), &info()).unwrap_err().to_string();
        assert!(e.contains("sim.max_output_mib"), "{e}");
        assert!(!dir.exists() && !partial_of(&dir).exists());
        std::fs::remove_dir_all(root).unwrap();
    }
}
