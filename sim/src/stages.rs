//! Per-stage figures of a staged arrival schedule, tallied as requests end.

use std::fmt::Write as _;

use infer_core::metrics::{RequestRecord, Samples, Stats};
use infer_core::workload::ArrivalSpec;

/// One stage's figures. Requests are grouped by the stage they were sent in;
/// `output_throughput` is their output tokens over the stage's duration (offered output
/// load, as inference-perf's per-stage reports count it), wherever they finished.
#[derive(Debug, Clone, PartialEq)]
pub struct StageRow {
    pub stage: usize,
    pub rate: f64,
    pub requests: usize,
    pub output_throughput: f64,
    pub ttft: Stats,
    pub tpot: Stats,
}

/// Successful requests folded into their send stage.
#[derive(Debug, Clone)]
pub struct StageTally {
    arrival: ArrivalSpec,
    stages: Vec<Tally>,
}

#[derive(Debug, Clone, Default)]
struct Tally {
    requests: usize,
    output_tokens: usize,
    ttft: Samples,
    tpot: Samples,
}

impl StageTally {
    pub fn new(arrival: &ArrivalSpec) -> Self {
        StageTally {
            arrival: arrival.clone(),
            stages: vec![Tally::default(); arrival.stages.len()],
        }
    }

    pub fn add(&mut self, r: &RequestRecord) {
        if !r.success() {
            return;
        }
        let Some(t) = self
            .arrival
            .stage_of(r.start)
            .and_then(|i| self.stages.get_mut(i))
        else {
            return;
        };
        t.requests += 1;
        t.output_tokens += r.output_tokens;
        if let Some(v) = r.ttft {
            t.ttft.push(v);
        }
        if let Some(v) = r.tpot() {
            t.tpot.push(v);
        }
    }

    pub fn rows(mut self) -> Vec<StageRow> {
        let arrival = self.arrival;
        self.stages
            .iter_mut()
            .zip(&arrival.stages)
            .enumerate()
            .map(|(i, (t, st))| StageRow {
                stage: i,
                rate: st.rate,
                requests: t.requests,
                output_throughput: t.output_tokens as f64 / st.duration_s,
                ttft: t.ttft.stats(),
                tpot: t.tpot.stats(),
            })
            .collect()
    }
}

/// The rows as `sim run` prints them.
pub fn stage_table(rows: &[StageRow]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>5} {:>6} {:>8} {:>12} {:>13} {:>13} {:>13}",
        "stage", "QPS", "requests", "out tok/s", "TTFT p90 (s)", "TTFT mean (s)", "TPOT mean (ms)"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:>5} {:>6.1} {:>8} {:>12.1} {:>13.3} {:>13.3} {:>13.1}",
            r.stage,
            r.rate,
            r.requests,
            r.output_throughput,
            r.ttft.p90,
            r.ttft.mean,
            r.tpot.mean * 1e3
        );
    }
    // The stage a figure belongs to is the one its request was sent in, not the one it
    // ended in: said once under the table, as its header cannot.
    s.push_str(
        "(a stage's figures are of the requests sent in it that completed, whenever they \
         ended;\nout tok/s is their output tokens over the stage's duration, as \
         inference-perf counts a stage)\n",
    );
    s
}
