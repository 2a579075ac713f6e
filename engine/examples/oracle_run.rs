//! The engine's side of the oracle check (`scripts/oracle_check.py`): runs a batch of token
//! sequences through the model runner as a server would — each prompt prefilled in chunks,
//! then one decode step per fed token with every sequence in the step — and writes the logits
//! the oracle (Hugging Face transformers on the same safetensors) is compared with.
//!
//!   oracle_run --model DIR --device cpu|cuda [--cuda-graphs] [--chunk 512]
//!       [--kv-cache-dtype auto|fp8] IN.json OUT.f32 ...
//!
//! (several IN OUT pairs: one process, so the model loads and the kernels compile once)
//!
//! IN.json: `{"prompt_len": L, "seqs": [[token ids: the prompt, then the oracle's D tokens]]}`,
//! every sequence of the same length L + D. OUT.f32: little-endian f32 logits
//! `[seqs, D, vocab]`: row j is the prediction of token L + j — the prompt's last position,
//! then one decode step per fed token (the last token is only predicted, never fed). Teacher
//! forcing: the fed tokens are the oracle's, so one early divergence does not hide the rest.
//!
//! Block tables are scrambled (each sequence's blocks in reverse order, interleaved with the
//! others'), so keys are read where the table says, not in allocation order.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use infer_core::workload::KvCacheDtype;
use infer_engine::{load_model_dir, Device, ForwardBatch, LoadedModel, SeqChunk};

const BLOCK: usize = 16;

struct Args {
    model: PathBuf,
    device: Device,
    graphs: bool,
    chunk: usize,
    kv_cache_dtype: KvCacheDtype,
    /// (IN.json, OUT.f32) pairs.
    cases: Vec<(PathBuf, PathBuf)>,
}

fn args() -> Result<Args> {
    let mut it = std::env::args().skip(1);
    let (mut model, mut device, mut graphs, mut chunk) = (None, Device::Cpu, false, 512);
    let mut kv_cache_dtype = KvCacheDtype::Auto;
    let mut files = Vec::new();
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().with_context(|| format!("{name} needs a value"));
        match a.as_str() {
            "--model" => model = Some(PathBuf::from(value("--model")?)),
            "--device" => device = Device::parse(&value("--device")?)?,
            "--cuda-graphs" => graphs = true,
            "--chunk" => chunk = value("--chunk")?.parse().context("--chunk")?,
            "--kv-cache-dtype" => {
                kv_cache_dtype = value("--kv-cache-dtype")?
                    .parse()
                    .map_err(|e: String| anyhow::anyhow!("--kv-cache-dtype: {e}"))?
            }
            _ if a.starts_with("--") => bail!("unknown option {a}"),
            _ => files.push(PathBuf::from(a)),
        }
    }
    ensure!(
        !files.is_empty() && files.len() % 2 == 0,
        "usage: oracle_run --model DIR [...] IN.json OUT.f32 [IN.json OUT.f32 ...]"
    );
    ensure!(chunk > 0, "--chunk must be positive");
    Ok(Args {
        model: model.context("--model DIR is required")?,
        device,
        graphs,
        chunk,
        kv_cache_dtype,
        cases: files
            .chunks(2)
            .map(|p| (p[0].clone(), p[1].clone()))
            .collect(),
    })
}

fn main() -> Result<()> {
    let a = args()?;
    let mut lm = load_model_dir(&a.model, None, a.device)?;
    lm.model.set_kv_cache_dtype(a.kv_cache_dtype);
    for (input, output) in &a.cases {
        run_case(&lm, &a, input, output).with_context(|| format!("case {}", input.display()))?;
    }
    Ok(())
}

fn run_case(lm: &LoadedModel, a: &Args, input: &Path, output: &Path) -> Result<()> {
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(input)?)?;
    let prompt_len = spec["prompt_len"].as_u64().context("prompt_len")? as usize;
    let seqs: Vec<Vec<u32>> = serde_json::from_value(spec["seqs"].clone()).context("seqs")?;
    let total = seqs.first().context("no sequence")?.len();
    ensure!(
        prompt_len > 0 && total > prompt_len && seqs.iter().all(|s| s.len() == total),
        "every sequence must hold the prompt ({prompt_len}) and at least one token to feed"
    );
    let vocab = lm.config.vocab_size;
    ensure!(
        seqs.iter().flatten().all(|&t| (t as usize) < vocab),
        "a token id past the vocabulary ({vocab})"
    );
    if a.graphs {
        lm.model.enable_cuda_graphs(seqs.len(), total)?;
    }
    // Sequence s owns blocks s, s + n, s + 2n, ... in reverse order.
    let per_seq = total.div_ceil(BLOCK);
    let n = seqs.len();
    let mut kv = lm.model.new_kv_cache(n * per_seq, BLOCK)?;
    let tables: Vec<Vec<u32>> = (0..n)
        .map(|s| (0..per_seq).rev().map(|b| (b * n + s) as u32).collect())
        .collect();

    let mut rows: Vec<Vec<Vec<f32>>> = vec![Vec::new(); n];
    for (s, seq) in seqs.iter().enumerate() {
        let mut start = 0;
        while start < prompt_len {
            let end = (start + a.chunk).min(prompt_len);
            let step = ForwardBatch {
                seqs: vec![SeqChunk {
                    tokens: seq[start..end].to_vec(),
                    start_pos: start,
                    block_table: tables[s].clone(),
                    sample: end == prompt_len,
                    all_logits: false,
                }],
            };
            let logits = lm.model.forward(&step, &mut kv)?;
            if end == prompt_len {
                rows[s].push(logits.row(0).to_vec());
            }
            start = end;
        }
    }
    for pos in prompt_len..total - 1 {
        let step = ForwardBatch {
            seqs: seqs
                .iter()
                .zip(&tables)
                .map(|(seq, table)| SeqChunk {
                    tokens: vec![seq[pos]],
                    start_pos: pos,
                    block_table: table.clone(),
                    sample: true,
                    all_logits: false,
                })
                .collect(),
        };
        let logits = lm.model.forward(&step, &mut kv)?;
        for (s, row) in rows.iter_mut().enumerate() {
            row.push(logits.row(s).to_vec());
        }
    }
    let mut out = std::io::BufWriter::new(std::fs::File::create(output)?);
    for row in rows.iter().flatten() {
        for x in row {
            out.write_all(&x.to_le_bytes())?;
        }
    }
    out.flush()?;
    eprintln!(
        "oracle_run: {n} sequences x {} rows x {vocab} logits -> {}",
        total - prompt_len,
        output.display()
    );
    Ok(())
}
