//! Scheduler overhead per step: `schedule` + `complete` with N running sequences in steady
//! decode, prefix caching on, half of the sequences sharing a prefix.
//!
//! `cargo run --release -p infer-core --example sched_bench`
//! prints `sched_step_us[seqs=N]: value us` for N = 1, 32, 256, 1024.

use std::time::Instant;

use infer_core::{Request, RequestId, Scheduler, SchedulerConfig};

fn bench(n: usize) -> (f64, f64) {
    let prompt_len = 256;
    let cfg = SchedulerConfig {
        max_batch_size: n,
        num_gpu_blocks: (n * (prompt_len + 2048) / 16).max(2048 / 16 + 1),
        prefill_chunk_size: 4096.max(n),
        max_model_len: 2048,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg);
    let shared: Vec<u32> = (0..128).map(|t| 50_000 + t).collect();
    let mut next_id = 0u64;
    let mut add = |s: &mut Scheduler, now: f64| {
        let i = next_id;
        next_id += 1;
        let mut prompt: Vec<u32> = if i.is_multiple_of(2) {
            shared.clone()
        } else {
            Vec::new()
        };
        while prompt.len() < prompt_len {
            prompt.push(
                (i as u32)
                    .wrapping_mul(7919)
                    .wrapping_add(prompt.len() as u32)
                    % 30_000,
            );
        }
        // Lengths spread so that some sequences finish and are replaced every few steps.
        let max_tokens = 200 + (i as usize * 37) % 1500;
        let max_tokens = max_tokens.min(2048 - prompt_len - 1);
        s.add_request(Request::new(i, prompt, max_tokens), now)
            .unwrap();
    };
    for _ in 0..n {
        add(&mut s, 0.0);
    }
    let mut now = 0.0;
    let step = |s: &mut Scheduler, now: &mut f64| {
        let plan = s.schedule(*now);
        let sampled: Vec<u32> = (0..plan.num_sampling())
            .map(|k| 7 + (k as u32 % 100))
            .collect();
        *now += 0.01;
        let events = s.complete(plan, &sampled, *now);
        let finished = events
            .iter()
            .filter(|e| matches!(e, infer_core::Event::Finished { .. }))
            .count();
        std::hint::black_box(&events);
        finished
    };
    // Warm up: prefill everything, reach steady decode.
    for _ in 0..50 {
        let done = step(&mut s, &mut now);
        for _ in 0..done {
            add(&mut s, now);
        }
    }
    let steps = (200_000 / n).clamp(200, 20_000);
    let t0 = Instant::now();
    let mut replaced = 0;
    for _ in 0..steps {
        let done = step(&mut s, &mut now);
        for _ in 0..done {
            add(&mut s, now);
        }
        replaced += done;
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / steps as f64;
    let st = s.stats();
    assert_eq!(
        st.num_running + st.num_waiting,
        n,
        "steady state keeps {n} live"
    );
    assert!(st.num_running + 8 >= n, "nearly all of them running");
    let _ = s.abort(RequestId(u64::MAX));
    (us, replaced as f64 / steps as f64)
}

fn main() {
    let mut per_seq = Vec::new();
    for n in [1, 32, 256, 1024] {
        let (us, churn) = bench(n);
        println!("sched_step_us[seqs={n}]: {us:.2} us");
        println!(
            "sched_step_ns_per_seq[seqs={n}]: {:.1} ns",
            us * 1e3 / n as f64
        );
        println!("sched_finished_per_step[seqs={n}]: {churn:.3} requests");
        per_seq.push(us / n as f64);
    }
    // Linear scaling means per-sequence cost does not grow with N.
    println!(
        "sched_per_seq_growth[1024 vs 32]: {:.2} x",
        per_seq[3] / per_seq[1]
    );
}
