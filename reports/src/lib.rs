//! infer-reports: run directories (`summary.json`, `requests.csv`, `timeseries.csv`,
//! `run.json`, `scenario.toml`), and the tables, charts and comparisons built from them, for
//! `sim report`, `engine report` and `engine verify`.
//!
//! * [`run_dir`]: the one writer of run directories (`sim run`, `engine bench`, …), with
//!   `run.json`'s [`RunInfo`] and the benchmark log's phase of a server ([`phase_of`]);
//!   [`run::Run`] reads them back;
//! * `report::write_report`: `report.md` with the benchmark log's per-workload tables,
//!   "Phase N vs N−1" tables, per-stage and concurrency tables, charts (PNG + SVG), and
//!   regressions against a baseline (thresholds in [`metric`]);
//! * `verify::write_verify_report` / `verify::predicted_vs_measured`: a simulator
//!   prediction against an engine measurement.
//!
//! Those two and the charts are the `charts` feature (on by default); without it the crate
//! is run directories and tables, all `sim` needs to write runs.

#[cfg(feature = "charts")]
pub mod chart;
pub mod compare;
pub mod error;
#[cfg(feature = "charts")]
pub mod figures;
pub mod frame;
pub mod load;
pub mod markdown;
pub mod metric;
#[cfg(feature = "charts")]
pub mod report;
pub mod run;
pub mod run_dir;
pub mod tables;
#[cfg(feature = "charts")]
pub mod verify;

pub use error::ReportError;
#[cfg(feature = "charts")]
pub use report::{write_report, Report};
pub use run::Run;
pub use run_dir::{default_run_dir, phase_of, write_run_files, RunDirWriter, RunInfo};
#[cfg(feature = "charts")]
pub use verify::{predicted_vs_measured, write_verify_report, Verification};
