//! `engine profile`: time real model steps over a grid of batch compositions and write the
//! profile the simulator's profiled cost model fits (format: `infer_sim::cost::profiled`).
//!
//! Grid: pure prefills (a fresh prompt, or a chunk after earlier chunks), pure decodes at
//! several batch sizes and context lengths, and mixed steps (a prefill chunk plus decodes),
//! which is what chunked prefill schedules. Each point is the median of a few runs after a
//! warm-up. The client path (HTTP, tokenisation, streaming) is measured on an in-process
//! server, so predicted TTFT includes it as a client sees it.

use std::time::Instant;

use anyhow::Result;

use crate::batch::{ForwardBatch, SeqChunk};
use crate::model::LoadedModel;

pub use infer_sim::cost::{Profile, ProfileClient, ProfilePoint};

/// One step to time: prefill chunks `(start, len)` and decodes at context `ctx`, the first
/// `shared` tokens of which every decode reads from the same blocks (a prefix-cache hit).
#[derive(Debug, Clone, Default)]
struct Shape {
    prefills: Vec<(usize, usize)>,
    decodes: usize,
    decode_ctx: usize,
    shared: usize,
}

/// Profile `model` (steps and client path) into the simulator's profile format.
pub async fn profile_model(model: &str, quick: bool) -> Result<Profile> {
    let m = model.to_string();
    let (lm, mut points) = tokio::task::spawn_blocking(move || {
        let lm = crate::model::load_model(&m, None, &candle_core::Device::Cpu)?;
        let points = crate::host::run_in_compute_pool("profile", || profile_steps(&lm, quick, 6))??;
        anyhow::Ok((lm, points))
    })
    .await??;
    drop(lm);
    let client = crate::verify::measure_client_path(model, &mut points).await?;
    Ok(Profile {
        model: model.to_string(),
        device: "cpu".into(),
        points,
        client: Some(client),
    })
}

fn grid(max_len: usize, quick: bool) -> Vec<Shape> {
    let mut g = Vec::new();
    let lens: &[usize] = if quick {
        &[64, 512]
    } else {
        &[16, 64, 128, 256, 512, 1024, 2048]
    };
    for &p in lens.iter().filter(|&&p| p < max_len) {
        g.push(Shape {
            prefills: vec![(0, p)],
            ..Shape::default()
        });
    }
    // Chunks that follow earlier chunks (or a prefix-cache hit).
    for &start in if quick {
        &[1024][..]
    } else {
        &[512, 1024, 1536][..]
    } {
        if start + 512 < max_len {
            g.push(Shape {
                prefills: vec![(start, 512)],
                ..Shape::default()
            });
        }
    }
    // Several prompts in one step (unchunked bursts), up to 4,096 tokens.
    let bursts: &[(usize, usize)] = if quick {
        &[(4, 256)]
    } else {
        &[(2, 256), (4, 256), (8, 256), (4, 1024)]
    };
    for &(n, len) in bursts.iter().filter(|&&(_, len)| len < max_len) {
        g.push(Shape {
            prefills: vec![(0, len); n],
            ..Shape::default()
        });
    }
    let batches: &[usize] = if quick {
        &[1, 16]
    } else {
        &[1, 2, 4, 8, 16, 24, 32]
    };
    let ctxs: &[usize] = if quick {
        &[256]
    } else {
        &[128, 512, 1024, 2048]
    };
    for &d in batches {
        for &c in ctxs.iter().filter(|&&c| c < max_len) {
            g.push(Shape {
                decodes: d,
                decode_ctx: c,
                ..Shape::default()
            });
        }
    }
    for &d in if quick { &[8][..] } else { &[4, 12, 24][..] } {
        for &p in if quick { &[256][..] } else { &[128, 488][..] } {
            g.push(Shape {
                prefills: vec![(0, p)],
                decodes: d,
                decode_ctx: 512,
                ..Shape::default()
            });
        }
    }
    // Decodes sharing a 1,024-token prefix (prefix caching): shared blocks read again.
    for &d in if quick { &[][..] } else { &[8, 24][..] } {
        if 1280 < max_len {
            g.push(Shape {
                decodes: d,
                decode_ctx: 1280,
                shared: 1024,
                ..Shape::default()
            });
        }
    }
    g
}

/// Time the grid on `lm`: about `reps` timed runs per shape, in two rounds (each point
/// keeps the median).
pub fn profile_steps(lm: &LoadedModel, quick: bool, reps: usize) -> Result<Vec<ProfilePoint>> {
    crate::host::keep_freed_memory();
    let block_size = 16;
    let max_len = lm.config.max_position_embeddings.min(4096);
    let shapes = grid(max_len, quick);
    // One pool large enough for the largest shape; block tables are disjoint sets of it.
    let need = shapes
        .iter()
        .map(|s| {
            let p: usize = s
                .prefills
                .iter()
                .map(|&(a, n)| (a + n).div_ceil(block_size))
                .sum();
            p + s.decodes * (s.decode_ctx + 1).div_ceil(block_size)
                - s.decodes.saturating_sub(1) * (s.shared / block_size)
        })
        .max()
        .unwrap_or(1);
    let mut kv = lm.model.new_kv_cache(need, block_size)?;
    kv.fill_pattern()?;
    // Block ids in a scattered order, as a server's free list hands them out after a while
    // (reads then cross a page boundary at every block).
    let mut order: Vec<u32> = (0..need as u32).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let vocab = lm.config.vocab_size as u32;
    let mut batches = Vec::with_capacity(shapes.len());
    for shape in &shapes {
        let mut next_block = 0;
        let mut table = |len: usize| {
            let n = len.div_ceil(block_size);
            let t: Vec<u32> = order[next_block..next_block + n].to_vec();
            next_block += n;
            t
        };
        let mut seqs = Vec::new();
        for (i, &(start, n)) in shape.prefills.iter().enumerate() {
            let tokens = (0..n)
                .map(|k| ((k * 31 + i * 7 + 11) as u32) % vocab)
                .collect();
            seqs.push(SeqChunk {
                tokens,
                start_pos: start,
                block_table: table(start + n),
                sample: true,
            });
        }
        let shared = table(shape.shared); // a whole number of blocks
        for i in 0..shape.decodes {
            let tok = ((i * 13 + 5) as u32) % vocab;
            let c = shape.decode_ctx;
            let mut block_table = shared.clone();
            block_table.extend(table(c + 1 - shape.shared));
            seqs.push(SeqChunk {
                tokens: vec![tok],
                start_pos: c,
                block_table,
                sample: true,
            });
        }
        batches.push(ForwardBatch { seqs });
    }
    // Rounds over the whole grid, so that a slow spell of this shared machine lands on a
    // few samples of many points rather than on all of one point; within a round a shape
    // runs back to back after a warm-up, as a server's consecutive steps do (weights and
    // KV warm in cache; a shape timed cold after a large one would read the model from
    // DRAM and look up to twice as slow as serving finds it).
    let rounds = 2;
    let per_round = reps.max(2).div_ceil(rounds);
    let mut times = vec![Vec::new(); shapes.len()];
    let step = |batch: &ForwardBatch, kv: &mut crate::KvCache| -> Result<f64> {
        let t = Instant::now();
        let logits = lm.model.forward(batch, kv)?;
        // A real step also reads the logits back and samples (greedy, as the benchmarks do).
        for row in logits.to_vec2::<f32>()? {
            std::hint::black_box(crate::sampling::argmax(&row));
        }
        Ok(t.elapsed().as_secs_f64())
    };
    for _ in 0..rounds {
        for (batch, times) in batches.iter().zip(times.iter_mut()) {
            // Warm up for a few steps or 20 ms, then time at least `per_round` steps and
            // 30 ms' worth: sub-millisecond steps get enough samples for a steady median.
            let (mut warm, mut n) = (0.0, 0);
            while n < 2 || (warm < 0.02 && n < 50) {
                warm += step(batch, &mut kv)?;
                n += 1;
            }
            let (mut spent, mut n) = (0.0, 0);
            while n < per_round || (spent < 0.03 && n < 100) {
                let t = step(batch, &mut kv)?;
                times.push(t);
                spent += t;
                n += 1;
            }
        }
    }
    let mut points = Vec::with_capacity(shapes.len());
    for (shape, mut times) in shapes.iter().zip(times) {
        times.sort_by(f64::total_cmp);
        let prefill_tokens: usize = shape.prefills.iter().map(|p| p.1).sum();
        let context_tokens: usize = shape.prefills.iter().map(|&(a, n)| a + n).sum::<usize>()
            + shape.decodes * (shape.decode_ctx + 1);
        let attention_pairs: f64 = shape
            .prefills
            .iter()
            .map(|&(a, n)| (n * a) as f64 + (n * (n + 1)) as f64 / 2.0)
            .sum::<f64>()
            + (shape.decodes * (shape.decode_ctx + 1)) as f64;
        points.push(ProfilePoint {
            prefill_tokens,
            decode_seqs: shape.decodes,
            context_tokens,
            decode_context_tokens: Some(shape.decodes * (shape.decode_ctx + 1)),
            // As the simulator counts it: every reader but the one that computed it.
            decode_shared_context_tokens: shape.decodes.saturating_sub(1) * shape.shared,
            attention_pairs: Some(attention_pairs),
            chunk_self_pairs: Some(shape.prefills.iter().map(|&(_, n)| (n * n) as f64).sum()),
            step_s: times[times.len() / 2],
        });
    }
    Ok(points)
}
