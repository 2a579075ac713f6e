//! A per-step trace of the engine loop (`engine serve --step-log FILE`): what each step held,
//! in the simulator's terms, and how long it took. It lets a cost model be checked step by
//! step against the steps a real run scheduled, instead of only through end-to-end
//! latencies (`engine verify` writes and reads it).

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use infer_core::StepShape;

pub const HEADER: &str =
    "t_s,num_seqs,prefill_tokens,decode_seqs,context_tokens,decode_context_tokens,\
decode_shared_context_tokens,attention_pairs,chunk_self_pairs,forward_s,step_s";

/// One step of the trace.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    /// When the step was scheduled, seconds since the engine started.
    pub t_s: f64,
    pub shape: StepShape,
    /// The model's forward, logits to the host and sampling.
    pub forward_s: f64,
    /// The whole step: schedule, forward, sampling, scheduler update, streaming the tokens.
    pub step_s: f64,
}

pub struct StepLog {
    out: BufWriter<File>,
}

impl StepLog {
    pub fn create(path: &Path) -> Result<StepLog> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("{}: cannot create", dir.display()))?;
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
            "{:.6},{},{},{},{},{},{},{},{},{:.6},{:.6}",
            r.t_s,
            s.num_seqs,
            s.prefill_tokens,
            s.decode_seqs,
            s.context_tokens,
            s.decode_context_tokens,
            s.decode_shared_context_tokens,
            s.attention_pairs,
            s.chunk_self_pairs,
            r.forward_s,
            r.step_s
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
    anyhow::ensure!(
        header == HEADER,
        "{}: not a step log (header {header:?})",
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
        if f.len() != 11 {
            return Err(bad());
        }
        let u = |j: usize| f[j].parse::<usize>().map_err(|_| bad());
        let x = |j: usize| f[j].parse::<f64>().map_err(|_| bad());
        steps.push(StepRecord {
            t_s: x(0)?,
            shape: StepShape {
                num_seqs: u(1)?,
                prefill_tokens: u(2)?,
                decode_seqs: u(3)?,
                context_tokens: u(4)?,
                decode_context_tokens: u(5)?,
                decode_shared_context_tokens: u(6)?,
                attention_pairs: x(7)?,
                chunk_self_pairs: x(8)?,
                ..StepShape::default()
            },
            forward_s: x(9)?,
            step_s: x(10)?,
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
        let path = dir.path().join("sub/steps.csv");
        let rec = StepRecord {
            t_s: 1.25,
            shape: StepShape {
                num_seqs: 3,
                prefill_tokens: 64,
                decode_seqs: 3,
                context_tokens: 964,
                decode_context_tokens: 900,
                decode_shared_context_tokens: 512,
                attention_pairs: 900.0 + 64.0 * 65.0 / 2.0,
                chunk_self_pairs: 4096.0,
                ..StepShape::default()
            },
            forward_s: 0.012,
            step_s: 0.0135,
        };
        let mut log = StepLog::create(&path).unwrap();
        log.record(&rec);
        log.flush();
        let back = read(&path).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].shape.decode_context_tokens, 900);
        assert_eq!(back[0].shape.num_seqs, 3);
        assert_eq!(back[0].shape.decode_shared_context_tokens, 512);
        assert_eq!(back[0].shape.attention_pairs, rec.shape.attention_pairs);
        assert_eq!((back[0].forward_s, back[0].step_s), (0.012, 0.0135));
        std::fs::write(&path, "a,b\n").unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("not a step log"), "{e}");
    }
}
