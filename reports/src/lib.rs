//! infer-reports: tables, charts and comparisons built from run directories (`summary.json`,
//! `requests.csv`, `timeseries.csv`, `run.json`), for `sim report`, `engine report` and
//! `engine verify`.
//!
//! * [`report::write_report`]: `report.md` with the benchmark log's per-workload tables,
//!   "Phase N vs N−1" tables, per-stage and concurrency tables, charts (PNG + SVG), and
//!   regressions against a baseline (thresholds in [`metric`]);
//! * [`verify::write_verify_report`] / [`verify::predicted_vs_measured`]: a simulator
//!   prediction against an engine measurement.

pub mod chart;
pub mod compare;
pub mod error;
pub mod figures;
pub mod frame;
pub mod load;
pub mod markdown;
pub mod metric;
pub mod report;
pub mod run;
pub mod tables;
pub mod verify;

pub use error::ReportError;
pub use report::{write_report, Report};
pub use run::Run;
pub use verify::{predicted_vs_measured, write_verify_report, Verification};
