//! Property tests for the invariants of `docs/design.md`, over random request mixes, pool
//! sizes, chunk sizes, both backends and batching modes, prefix caching on and off (a paged
//! pool's blocks, contiguous slots' last tokens), both admission and both preemption
//! policies, first come first served and priority scheduling, with aborts and preemption:
//! every request
//! finishes or is aborted exactly once (INV-1); block references match the tables that hold
//! them, free + used = total, waiting requests hold nothing and the prefix cache's index
//! agrees with its blocks (INV-2, INV-3, INV-7, INV-8: checked every step by
//! `check_invariants`); after all requests end no block is held (INV-4); a step never
//! exceeds the token budget or the batch limit (INV-5); the same inputs give the same plans
//! (INV-6); whole-sequence admission never preempts (INV-9).

mod common;

use std::collections::HashMap;

use common::{drive, drive_forked, simple_cost};
use infer_core::{
    BatchingMode, FinishReason, KvAdmission, KvBackend, KvPreemption, KvVictim, Request, RequestId,
    SchedulerConfig, SchedulingPolicy, StopConditions,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    cfg: SchedulerConfig,
    requests: Vec<(f64, Request)>,
    aborts: Vec<(f64, u64)>,
}

/// The first fork id of request `i` (each has room for 3).
fn fork_id(i: u64, k: u64) -> u64 {
    1_000 + 4 * i + k
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (
        prop_oneof![Just(BatchingMode::Continuous), Just(BatchingMode::Static)],
        prop_oneof![Just(KvBackend::Paged), Just(KvBackend::Contiguous)],
        1usize..12, // max_batch_size
        4usize..96, // num_gpu_blocks
        prop_oneof![Just(1usize), Just(4), Just(16)],
        any::<bool>(),                 // chunked
        1usize..300,                   // chunk size (raised to max_batch_size below)
        any::<bool>(),                 // prefix caching
        32usize..400,                  // max_model_len
        prop::option::of(0usize..200), // unchunked step budget beyond the minimum
        (
            prop_oneof![
                Just(KvAdmission::Prompt),
                Just(KvAdmission::WholeSequence),
                Just(KvAdmission::FreeMargin)
            ],
            prop_oneof![Just(KvPreemption::Recompute), Just(KvPreemption::Wait)],
            prop_oneof![Just(0.0), 0.0f64..0.6], // kv_watermark
            prop_oneof![Just(KvVictim::Newest), Just(KvVictim::FewestOutputs)],
            prop_oneof![
                Just(SchedulingPolicy::Fcfs),
                Just(SchedulingPolicy::Priority)
            ],
        ),
        prop::option::of(1usize..600), // max_step_read_tokens
    )
        .prop_map(
            |(
                mode,
                kv,
                batch,
                blocks,
                bs,
                chunked,
                chunk,
                prefix,
                mml,
                budget,
                kv_policy,
                reads,
            )| {
                let (admission, dry, watermark, victim, policy) = kv_policy;
                let mut c = SchedulerConfig {
                    batching_mode: mode,
                    kv_cache_backend: kv,
                    max_batch_size: batch,
                    num_gpu_blocks: blocks,
                    block_size: bs,
                    chunked_prefill: chunked,
                    prefill_chunk_size: chunk.max(batch),
                    max_num_batched_tokens: budget.map(|extra| mml.max(batch) + extra),
                    prefix_caching: prefix,
                    max_model_len: mml,
                    max_waiting: None,
                    kv_admission: admission,
                    kv_preemption: dry,
                    kv_watermark: watermark,
                    kv_victim: victim,
                    max_step_read_tokens: reads,
                    scheduling_policy: policy,
                };
                if blocks * bs < mml {
                    c.num_gpu_blocks = mml.div_ceil(bs) + blocks % 8;
                }
                c
            },
        )
}

fn case() -> impl Strategy<Value = Case> {
    let request = (
        0usize..4,     // which shared base prompt
        0usize..120,   // shared part length
        1usize..80,    // unique part length
        1usize..40,    // max_tokens
        0.0f64..0.5,   // arrival
        any::<bool>(), // ignore_eos
    );
    (
        config(),
        prop::collection::vec(request, 1..40),
        prop::collection::vec((0.0f64..0.6, 0u64..40), 0..6),
    )
        .prop_map(|(cfg, reqs, aborts)| {
            let requests = reqs
                .into_iter()
                .enumerate()
                .map(|(i, (base, shared, unique, max_tokens, t, ignore_eos))| {
                    let mut prompt: Vec<u32> =
                        (0..shared).map(|k| (base * 1000 + k) as u32).collect();
                    prompt.extend((0..unique).map(|k| (100_000 + i * 1000 + k) as u32));
                    let stop = StopConditions {
                        max_tokens,
                        ignore_eos,
                        // Token ids the test model samples include these now and then.
                        eos_token_ids: vec![17, 48],
                        stop_token_ids: vec![],
                    };
                    (
                        t,
                        Request {
                            id: infer_core::RequestId(i as u64),
                            prompt,
                            stop,
                        },
                    )
                })
                .collect();
            Case {
                cfg,
                requests,
                aborts,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold(c in case()) {
        let (log, sched) = drive(c.cfg.clone(), c.requests.clone(), simple_cost, c.aborts.clone());
        // With chunking, a given max_num_batched_tokens is the chunk budget (vLLM's).
        let budget = match (c.cfg.chunked_prefill, c.cfg.max_num_batched_tokens) {
            (_, Some(b)) => b,
            (true, None) => c.cfg.prefill_chunk_size,
            (false, None) => usize::MAX,
        };
        for s in &log.steps {
            prop_assert!(s.num_tokens <= budget, "INV-5: step of {} tokens > budget {}", s.num_tokens, budget);
            prop_assert!(s.seqs.len() <= c.cfg.max_batch_size, "INV-5: batch limit");
            prop_assert!(s.num_running <= c.cfg.max_batch_size, "INV-5: batch limit");
            // A step reads at most its limit of computed context, or its first sequence's
            // alone where that is more (the first always runs).
            if let (Some(limit), Some(first)) = (c.cfg.max_step_read_tokens, s.seqs.first()) {
                let reads: usize = s.seqs.iter().map(|x| x.1).sum();
                prop_assert!(reads <= limit.max(first.1), "step reads {} > limit {}", reads, limit);
            }
            // No request appears twice in a step (INV-5).
            let mut ids: Vec<u64> = s.seqs.iter().map(|x| x.0).collect();
            ids.sort_unstable();
            ids.dedup();
            prop_assert_eq!(ids.len(), s.seqs.len());
        }
        // Every accepted request ends exactly once: finished by the scheduler or aborted.
        let aborted: Vec<u64> = c.aborts.iter().map(|a| a.1).collect();
        let mut ends: HashMap<u64, usize> = HashMap::new();
        for (id, reason, stats) in log.finished() {
            *ends.entry(id).or_default() += 1;
            prop_assert!(stats.output_tokens >= 1);
            let req = &c.requests[id as usize].1;
            prop_assert!(stats.output_tokens <= req.stop.max_tokens);
            if reason == FinishReason::Length {
                prop_assert!(stats.output_tokens == req.stop.max_tokens
                    || stats.prompt_tokens + stats.output_tokens >= c.cfg.max_model_len);
            }
        }
        for (_, r) in &c.requests {
            let id = r.id.0;
            if log.rejected.contains(&id) {
                continue;
            }
            let n = ends.get(&id).copied().unwrap_or(0);
            prop_assert!(n <= 1, "INV-1: request {} ended {} times", id, n);
            prop_assert!(n == 1 || aborted.contains(&id), "INV-1: request {} never ended", id);
        }
        // Nothing is held once everything has ended (INV-4).
        prop_assert!(!sched.has_unfinished());
        let st = sched.stats();
        prop_assert_eq!(st.num_free_blocks, st.num_blocks);
        prop_assert_eq!(sched.kv().total_refs(), 0);
        // Whole-sequence admission keeps every admitted sequence's blocks in the pool:
        // decodes never preempt (INV-9).
        if c.cfg.kv_admission == KvAdmission::WholeSequence {
            prop_assert_eq!(st.num_preemptions, 0, "INV-9");
        }
    }

    /// Some requests fork 1–3 more sequences (OpenAI's `n`), in every configuration: the
    /// invariants hold every step (shared blocks counted once per holder), nothing is held at
    /// the end, each fork ends exactly once when its parent was not aborted (a parent
    /// aborted before its first token takes its forks with it), and none is planned twice.
    #[test]
    fn invariants_hold_with_forks(c in case(), n in prop::collection::vec(0u64..4, 40)) {
        let requests: Vec<(f64, Request, Vec<RequestId>)> = c
            .requests
            .iter()
            .map(|(t, r)| {
                let forks = (0..n[r.id.0 as usize]).map(|k| RequestId(fork_id(r.id.0, k))).collect();
                (*t, r.clone(), forks)
            })
            .collect();
        let (log, sched) = drive_forked(c.cfg.clone(), requests, simple_cost, c.aborts.clone());
        for s in &log.steps {
            let mut ids: Vec<u64> = s.seqs.iter().map(|x| x.0).collect();
            ids.sort_unstable();
            ids.dedup();
            prop_assert_eq!(ids.len(), s.seqs.len());
            prop_assert!(s.seqs.len() <= c.cfg.max_batch_size);
        }
        let mut ends: HashMap<u64, usize> = HashMap::new();
        for (id, _, _) in log.finished() {
            *ends.entry(id).or_default() += 1;
        }
        let aborted: Vec<u64> = c.aborts.iter().map(|a| a.1).collect();
        for (_, r) in &c.requests {
            let id = r.id.0;
            if log.rejected.contains(&id) {
                continue;
            }
            for k in 0..n[id as usize] {
                let f = ends.get(&fork_id(id, k)).copied().unwrap_or(0);
                prop_assert!(f <= 1, "fork {} of {} ended {} times", k, id, f);
                prop_assert!(f == 1 || aborted.contains(&id), "fork {} of {} never ended", k, id);
            }
        }
        prop_assert!(!sched.has_unfinished());
        let st = sched.stats();
        prop_assert_eq!(st.num_free_blocks, st.num_blocks);
        prop_assert_eq!(sched.kv().total_refs(), 0);
        if c.cfg.kv_admission == KvAdmission::WholeSequence {
            prop_assert_eq!(st.num_preemptions, 0, "forks are admitted like the rest");
        }
    }

    /// INV-6: the same inputs give the same plans and events.
    #[test]
    fn same_inputs_same_plans(c in case()) {
        let (a, _) = drive(c.cfg.clone(), c.requests.clone(), simple_cost, c.aborts.clone());
        let (b, _) = drive(c.cfg, c.requests, simple_cost, c.aborts);
        prop_assert_eq!(a, b);
    }
}

/// The generated cases reach the interesting regimes: preemption, waits for a block, prefix hits, aborts of
/// live requests, and both stop reasons. (Guards the strategies above from drifting into
/// cases too easy to break anything.)
#[test]
fn cases_cover_preemption_prefix_hits_and_aborts() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut preemptions, mut hits, mut aborted_live, mut stops, mut lengths) = (0, 0, 0, 0, 0);
    let (mut waits, mut slot_hits) = (0, 0);
    for _ in 0..300 {
        let c = case().new_tree(&mut runner).unwrap().current();
        let (log, sched) = drive(
            c.cfg.clone(),
            c.requests.clone(),
            simple_cost,
            c.aborts.clone(),
        );
        let st = sched.stats();
        preemptions += st.num_preemptions;
        waits += st.num_kv_waits;
        hits += st.prefix_hits;
        if c.cfg.kv_cache_backend == KvBackend::Contiguous {
            slot_hits += st.prefix_hits;
        }
        let finished: Vec<u64> = log.finished().iter().map(|f| f.0).collect();
        aborted_live += c
            .aborts
            .iter()
            .filter(|a| (a.1 as usize) < c.requests.len() && !log.rejected.contains(&a.1))
            .filter(|a| !finished.contains(&a.1))
            .count();
        stops += log
            .finished()
            .iter()
            .filter(|f| f.1 == FinishReason::Stop)
            .count();
        lengths += log
            .finished()
            .iter()
            .filter(|f| f.1 == FinishReason::Length)
            .count();
    }
    eprintln!("coverage: {preemptions} preemptions, {waits} waits for a block, {hits} hit tokens ({slot_hits} in slots), {aborted_live} live aborts, {stops} stop, {lengths} length");
    assert!(preemptions > 50, "preemptions {preemptions}");
    assert!(waits > 50, "waits for a block {waits}");
    assert!(hits > 1000, "prefix hit tokens {hits}");
    assert!(
        slot_hits > 100,
        "prefix hit tokens in contiguous slots {slot_hits}"
    );
    assert!(aborted_live > 20, "aborted live requests {aborted_live}");
    assert!(stops > 20 && lengths > 100, "stop {stops} length {lengths}");
}
