//! Run directories, written through `infer_reports`' writer as the run goes, and console
//! text.

use std::fmt::Write as _;

pub use infer_core::metrics::{requests_csv, timeseries_csv};
use infer_core::metrics::{RequestRecord, TimePoint};
use infer_reports::{RunDirWriter, RunInfo};

use crate::interval::{RunIntervals, LEVEL};
use crate::setup::Setup;
use crate::simulate::{RunSink, SimResult};
use crate::stages::stage_table;

/// The simulator's runs go through the one writer of run directories (in `infer_reports`).
impl RunSink for RunDirWriter {
    fn request(&mut self, r: RequestRecord) {
        RunDirWriter::request(self, r);
    }

    fn sample(&mut self, p: TimePoint) {
        RunDirWriter::sample(self, p);
    }

    fn stop_reason(&self) -> Option<String> {
        self.error().map(ToString::to_string)
    }
}

/// What a simulated run directory's `run.json` says: the scenario, the cost model in full
/// and the warnings on the prediction.
pub fn run_info(setup: &Setup, intervals: Option<&RunIntervals>) -> RunInfo {
    RunInfo {
        warnings: setup.warnings.clone(),
        intervals: intervals.map_or(String::new(), |i| {
            format!(
                "{:.0}% intervals from {}",
                LEVEL * 100.0,
                i.basis.describe()
            )
        }),
        ..RunInfo::new("sim", &setup.scenario, setup.cost.describe())
    }
}

/// What `sim run` prints: the setup, warnings, vLLM's block, the intervals, the extra lines,
/// why requests failed and, for a staged arrival schedule, one row per stage.
pub fn console(setup: &Setup, result: &SimResult, intervals: Option<&RunIntervals>) -> String {
    let mut s = String::new();
    let sc = &setup.scenario;
    let replicas = sc.cluster.as_ref().map_or(String::new(), |c| {
        format!(
            ", {} replicas behind {:?} router (metrics delay {} s)",
            c.replicas, c.router, c.metrics_delay_s
        )
    });
    let _ = writeln!(s, "scenario {} ({}){}", sc.name, setup.file, replicas);
    // In short: the cost model in full (a calibration's provenance is a thousand
    // characters) is run.json's `backend`.
    let _ = writeln!(s, "cost model: {}", setup.cost.summary());
    // Memory is planned from the scenario's model and hardware whatever prices the steps
    // (a profile measures time, not memory): say so where they may differ.
    let whose = match setup.settings.cost_model {
        crate::settings::CostModelKind::Profiled => format!(
            " ({} on {}, the scenario's)",
            sc.server.model, sc.server.hardware
        ),
        crate::settings::CostModelKind::Analytic => String::new(),
    };
    let _ = writeln!(s, "memory per GPU{whose}: {}", setup.memory.describe());
    for w in &setup.warnings {
        let _ = writeln!(s, "{w}");
    }
    s.push_str(&result.summary.render());
    if let Some(i) = intervals {
        s.push_str(&i.render());
    }
    let _ = writeln!(s, "{}", result.stats.lines());
    for line in &result.failures {
        let _ = writeln!(s, "{line}");
    }
    if !result.stages.is_empty() {
        s.push_str(&stage_table(&result.stages));
    }
    s
}
