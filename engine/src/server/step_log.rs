//! A per-step trace of the engine loop (`engine serve --step-log FILE`): what each step held,
//! in the simulator's terms, and how long it took. It lets a cost model be checked step by
//! step against the steps a real run scheduled, instead of only through end-to-end
//! latencies (`engine verify` writes and reads it).

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use infer_core::StepShape;

/// Every field of [`StepShape`], in its order, between the time and the durations: a cost
/// model reads back the shape the scheduler planned, whatever mechanisms it prices. Then
/// the request path's busy clock at the step's start, and the step's forward passes (0:
/// one). Logs of earlier versions hold a prefix of these columns (without the passes, or
/// without the clock too) and still read.
pub const HEADER: &str = "t_s,num_seqs,prefill_tokens,prefill_seqs,max_prefill_chunk,\
max_prefill_context,decode_seqs,sampled,context_tokens,decode_context_tokens,\
max_decode_context,decode_shared_context_tokens,attention_pairs,chunk_self_pairs,constrained_seqs,\
forward_s,constraint_s,step_s,path_busy_s,forward_passes";

/// Columns of the oldest header still read (up to `step_s`).
const OLDEST_COLUMNS: usize = 18;

/// One step of the trace.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    /// When the step was scheduled, seconds since the engine started.
    pub t_s: f64,
    pub shape: StepShape,
    /// The model's forward, logits to the host and sampling.
    pub forward_s: f64,
    /// Of `forward_s`, structured output's grammar work (the mask and its bookkeeping).
    pub constraint_s: f64,
    /// The whole step: schedule, forward, sampling, scheduler update, streaming the tokens.
    pub step_s: f64,
    /// Seconds the server's request path had been busy at the step's start
    /// ([`RequestPath`](super::request_path::RequestPath)); the difference between two
    /// steps is how long an arrival's path overlapped the first. `None`: not recorded.
    pub path_busy_s: Option<f64>,
}

impl StepRecord {
    /// Seconds the engine waited between the end of `previous`, the step before this one,
    /// and this one's start (the engine had run out of work).
    pub fn idle_after(&self, previous: &StepRecord) -> f64 {
        self.t_s - previous.t_s - previous.step_s
    }
}

pub struct StepLog {
    out: BufWriter<File>,
}

impl StepLog {
    pub fn create(path: &Path) -> Result<StepLog> {
        // A missing directory is a typo more often than a wish: say so, create nothing.
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.is_dir() {
                anyhow::bail!(
                    "--step-log {}: the directory {} does not exist",
                    path.display(),
                    dir.display()
                );
            }
        }
        let file =
            File::create(path).with_context(|| format!("{}: cannot create", path.display()))?;
        let mut out = BufWriter::new(file);
        writeln!(out, "{HEADER}")?;
        Ok(StepLog { out })
    }

    /// Best effort: a full disk must not stop the server.
    pub fn record(&mut self, r: &StepRecord) {
        let s = &r.shape;
        let _ = writeln!(
            self.out,
            "{:.6},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{:.6},{:.6},{:.6},{},{}",
            r.t_s,
            s.num_seqs,
            s.prefill_tokens,
            s.prefill_seqs,
            s.max_prefill_chunk,
            s.max_prefill_context,
            s.decode_seqs,
            s.sampled,
            s.context_tokens,
            s.decode_context_tokens,
            s.max_decode_context,
            s.decode_shared_context_tokens,
            s.attention_pairs,
            s.chunk_self_pairs,
            s.constrained_seqs,
            r.forward_s,
            r.constraint_s,
            r.step_s,
            r.path_busy_s.map_or(String::new(), |b| format!("{b:.6}")),
            s.forward_passes,
        );
    }

    pub fn flush(&mut self) {
        let _ = self.out.flush();
    }
}

/// Read a trace written by [`StepLog`].
pub fn read(path: &Path) -> Result<Vec<StepRecord>> {
    let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut lines = BufReader::new(file).lines();
    let header = lines.next().transpose()?.unwrap_or_default();
    let fields = header.split(',').count();
    anyhow::ensure!(
        fields >= OLDEST_COLUMNS && HEADER.split(',').take(fields).eq(header.split(',')),
        "{}: not a step log of this version (header {header:?}); record it again with \
         `engine serve --step-log`",
        path.display()
    );
    let mut steps = Vec::new();
    for (i, line) in lines.enumerate() {
        let line = line?;
        let f: Vec<&str> = line.split(',').collect();
        let bad = || {
            anyhow!(
                "{}: line {}: malformed step {line:?}",
                path.display(),
                i + 2
            )
        };
        if f.len() != fields {
            return Err(bad());
        }
        let u = |j: usize| f[j].parse::<usize>().map_err(|_| bad());
        let x = |j: usize| f[j].parse::<f64>().map_err(|_| bad());
        steps.push(StepRecord {
            t_s: x(0)?,
            shape: StepShape {
                num_seqs: u(1)?,
                prefill_tokens: u(2)?,
                prefill_seqs: u(3)?,
                max_prefill_chunk: u(4)?,
                max_prefill_context: u(5)?,
                decode_seqs: u(6)?,
                sampled: u(7)?,
                context_tokens: u(8)?,
                decode_context_tokens: u(9)?,
                max_decode_context: u(10)?,
                decode_shared_context_tokens: u(11)?,
                attention_pairs: x(12)?,
                chunk_self_pairs: x(13)?,
                constrained_seqs: u(14)?,
                // The log keeps the plan's totals, not its slots.
                slot_passes: Default::default(),
                forward_passes: match f.get(19) {
                    Some(n) if !n.is_empty() => u(19)?,
                    _ => 0,
                },
            },
            forward_s: x(15)?,
            constraint_s: x(16)?,
            step_s: x(17)?,
            path_busy_s: match f.get(18) {
                Some(b) if !b.is_empty() => Some(x(18)?),
                _ => None,
            },
        });
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_reads_back_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        // A missing directory is refused, not created.
        let e = StepLog::create(&dir.path().join("typo/steps.csv"))
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
        assert!(!dir.path().join("typo").exists());
        let path = dir.path().join("steps.csv");
        let rec = StepRecord {
            t_s: 1.25,
            shape: StepShape {
                num_seqs: 4,
                prefill_tokens: 64,
                prefill_seqs: 1,
                max_prefill_chunk: 64,
                max_prefill_context: 320,
                decode_seqs: 3,
                sampled: 4,
                context_tokens: 1220,
                decode_context_tokens: 900,
                max_decode_context: 500,
                decode_shared_context_tokens: 512,
                attention_pairs: 900.0 + 64.0 * 256.0 + 64.0 * 65.0 / 2.0,
                chunk_self_pairs: 4096.0,
                constrained_seqs: 2,
                slot_passes: Default::default(),
                forward_passes: 3,
            },
            forward_s: 0.012,
            constraint_s: 0.00025,
            step_s: 0.0135,
            path_busy_s: Some(0.75),
        };
        let unclocked = StepRecord {
            path_busy_s: None,
            ..rec.clone()
        };
        let mut log = StepLog::create(&path).unwrap();
        log.record(&rec);
        log.record(&unclocked);
        log.flush();
        let back = read(&path).unwrap();
        assert_eq!(
            back,
            vec![rec.clone(), unclocked.clone()],
            "every field comes back"
        );
        // Logs from before the passes, and from before the clock too, read without them.
        let drop_last = |text: &str| -> String {
            text.lines()
                .map(|l| l.rsplit_once(',').unwrap().0.to_string() + "\n")
                .collect()
        };
        let without_passes = drop_last(&std::fs::read_to_string(&path).unwrap());
        assert!(
            without_passes.starts_with("t_s,")
                && without_passes
                    .lines()
                    .next()
                    .unwrap()
                    .ends_with(",path_busy_s")
        );
        std::fs::write(&path, &without_passes).unwrap();
        let one_pass = |r: &StepRecord| StepRecord {
            shape: StepShape {
                forward_passes: 0,
                ..r.shape
            },
            ..r.clone()
        };
        assert_eq!(
            read(&path).unwrap(),
            vec![one_pass(&rec), one_pass(&unclocked)]
        );
        let without_path = drop_last(&without_passes);
        assert!(without_path.lines().next().unwrap().ends_with(",step_s"));
        std::fs::write(&path, without_path).unwrap();
        assert_eq!(
            read(&path).unwrap(),
            vec![one_pass(&unclocked), one_pass(&unclocked)]
        );
        std::fs::write(&path, "a,b\n").unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("not a step log"), "{e}");
    }
}
