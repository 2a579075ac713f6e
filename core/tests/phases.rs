//! One test per serving mechanism of the benchmark log's Phases 4–8, on the core alone.

mod common;

use std::sync::Arc;

use common::{drive, simple_cost};
use infer_core::workload::{ApproxTokenizer, Scenario, WorkloadGenerator};
use infer_core::{BatchingMode, FinishReason, KvBackend, Request, SchedulerConfig};

fn scenario(name: &str) -> Scenario {
    let path = format!("{}/../scenarios/{name}.toml", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    Scenario::parse(&path, &text, &[]).unwrap()
}

/// The scenario's requests with their open-loop arrival times (burst/uniform/poisson).
fn requests_of(s: &Scenario) -> Vec<(f64, Request)> {
    let gen = WorkloadGenerator::new(s.workload.clone(), Arc::new(ApproxTokenizer::default()));
    let times = gen.arrivals(&s.arrival).times.expect("open-loop scenario");
    times
        .enumerate()
        .map(|(i, t)| {
            let r = gen.request(i);
            (t, Request::new(i as u64, r.prompt_ids, r.max_tokens))
        })
        .collect()
}

fn small(mode: BatchingMode) -> SchedulerConfig {
    SchedulerConfig {
        batching_mode: mode,
        max_batch_size: 4,
        chunked_prefill: false,
        prefix_caching: false,
        ..SchedulerConfig::default()
    }
}

/// Four requests start together (request 0 is short); a fifth arrives at 0.05 s.
fn batch_then_latecomer() -> Vec<(f64, Request)> {
    let mut reqs: Vec<(f64, Request)> = (0..4)
        .map(|i| {
            (
                0.0,
                Request::new(i, vec![1; 32], if i == 0 { 2 } else { 20 }),
            )
        })
        .collect();
    reqs.push((0.05, Request::new(4, vec![2; 32], 5)));
    reqs
}

/// When request `id` was first scheduled.
fn first_step_of(log: &common::RunLog, id: u64) -> f64 {
    log.steps
        .iter()
        .find(|s| s.seqs.iter().any(|x| x.0 == id))
        .unwrap()
        .time
}

#[test]
fn static_batching_waits_for_the_whole_batch() {
    let reqs = batch_then_latecomer();
    let (log, _) = drive(small(BatchingMode::Static), reqs, |_| 0.01, vec![]);
    let batch_end = log
        .finished()
        .iter()
        .filter(|(id, ..)| *id < 4)
        .map(|(id, ..)| *id)
        .collect::<Vec<_>>();
    assert_eq!(batch_end.len(), 4);
    let last_of_batch = log
        .events
        .iter()
        .filter(|(_, e)| matches!(e, infer_core::Event::Finished { request, .. } if request.0 < 4))
        .map(|(t, _)| *t)
        .fold(0.0, f64::max);
    let first_step_of_5 = first_step_of(&log, 4);
    assert!(
        first_step_of_5 >= last_of_batch,
        "request 4 ran at {first_step_of_5} before the batch ended at {last_of_batch}"
    );
}

/// A static batch is admitted whole with chunked prefill too: eight 300-token prompts and a
/// 512-token chunk make one batch of eight, its prompts prefilled over the next steps, and
/// nothing joins it until it ends (before, the chunk bounded the batch to two prompts).
#[test]
fn a_static_batch_with_chunked_prefill_is_admitted_whole() {
    let cfg = SchedulerConfig {
        max_batch_size: 8,
        chunked_prefill: true,
        prefill_chunk_size: 512,
        ..small(BatchingMode::Static)
    };
    let reqs: Vec<(f64, Request)> = (0..12)
        .map(|i| (0.0, Request::new(i, vec![i as u32 + 7; 300], 4)))
        .collect();
    let (log, sched) = drive(cfg, reqs, |_| 0.01, vec![]);
    assert_eq!(log.finished().len(), 12);
    assert_eq!(sched.stats().num_preemptions, 0);
    // Every step's tokens within the chunk; the first eight prompts' work all before the
    // last four's.
    assert!(log
        .steps
        .iter()
        .all(|s| s.seqs.iter().map(|x| x.2).sum::<usize>() <= 512));
    let batch_end = (0..8).map(|id| last_step_of(&log, id)).fold(0.0, f64::max);
    for id in 8..12 {
        assert!(first_step_of(&log, id) > batch_end, "request {id}");
    }
    // The eight were admitted at the first step, their prompts prefilled in order over the
    // steps after (2,400 tokens: five chunks).
    assert_eq!(log.steps[0].num_running, 8);
    let prefilled: Vec<f64> = (0..8).map(|id| prefill_end(&log, id)).collect();
    assert!(prefilled.windows(2).all(|w| w[0] <= w[1]), "{prefilled:?}");
    assert!(prefilled[7] <= log.steps[4].time, "{prefilled:?}");
}

/// When request `id` was last scheduled.
fn last_step_of(log: &common::RunLog, id: u64) -> f64 {
    log.steps
        .iter()
        .filter(|s| s.seqs.iter().any(|x| x.0 == id))
        .map(|s| s.time)
        .fold(0.0, f64::max)
}

/// The step that computed the last of request `id`'s 300 prompt tokens.
fn prefill_end(log: &common::RunLog, id: u64) -> f64 {
    log.steps
        .iter()
        .find(|s| s.seqs.iter().any(|x| x.0 == id && x.1 + x.2 == 300))
        .unwrap()
        .time
}

#[test]
fn continuous_batching_admits_on_the_next_step() {
    let reqs = batch_then_latecomer();
    let (log, _) = drive(small(BatchingMode::Continuous), reqs, |_| 0.01, vec![]);
    let first_step_of_5 = first_step_of(&log, 4);
    // It arrives at 0.05 and a slot is free (request 0 ended at 0.03): the next step takes it.
    assert!(
        first_step_of_5 <= 0.05 + 0.01 + 1e-9,
        "admitted at {first_step_of_5}"
    );
}

#[test]
fn paged_runs_24_where_contiguous_runs_8_at_the_same_budget() {
    let s = scenario("paged_attention");
    let reqs = requests_of(&s);
    let base = SchedulerConfig {
        chunked_prefill: false,
        prefix_caching: false,
        ..s.server.scheduler_config()
    };
    assert_eq!(base.num_gpu_blocks * base.block_size, 32_768);
    let contiguous = SchedulerConfig {
        kv_cache_backend: KvBackend::Contiguous,
        ..base.clone()
    };
    let (clog, _) = drive(contiguous, reqs.clone(), simple_cost, vec![]);
    let (plog, _) = drive(base, reqs, simple_cost, vec![]);
    let peak = |l: &common::RunLog| l.steps.iter().map(|s| s.num_running).max().unwrap();
    assert_eq!(peak(&clog), 8);
    assert_eq!(peak(&plog), 24);
    assert_eq!(clog.finished().len(), 48);
    assert_eq!(plog.finished().len(), 48);
}

#[test]
fn chunked_prefill_keeps_the_budget_and_never_starves_decodes() {
    let s = scenario("chunked_prefill");
    // Enough blocks that nothing is preempted, so every decode should run every step.
    let cfg = SchedulerConfig {
        num_gpu_blocks: 8192,
        prefix_caching: false,
        ..s.server.scheduler_config()
    };
    let budget = cfg.prefill_chunk_size;
    let (log, sched) = drive(cfg, requests_of(&s), simple_cost, vec![]);
    assert_eq!(sched.stats().num_preemptions, 0);
    assert_eq!(log.finished().len(), 48);
    assert!(log.steps.iter().all(|s| s.num_tokens <= budget));
    assert!(
        log.steps.iter().any(|s| s.num_tokens == budget),
        "prefills fill the budget"
    );
    // From its first token to its last, a request decodes in every step.
    for (id, ..) in log.finished() {
        let steps: Vec<usize> = log
            .steps
            .iter()
            .enumerate()
            .filter(|(_, s)| s.seqs.iter().any(|x| x.0 == id && x.3))
            .map(|(i, _)| i)
            .collect();
        assert!(
            steps.windows(2).all(|w| w[1] == w[0] + 1),
            "request {id} skipped a step"
        );
    }
    // Long prompts were split into chunks.
    assert!(log
        .steps
        .iter()
        .any(|s| s.seqs.iter().any(|x| !x.3 && x.1 > 0 && x.2 > 0)));
}

#[test]
fn unchunked_prefill_processes_whole_prompts() {
    let s = scenario("chunked_prefill");
    let cfg = SchedulerConfig {
        chunked_prefill: false,
        prefix_caching: false,
        ..s.server.scheduler_config()
    };
    let (log, _) = drive(cfg, requests_of(&s), simple_cost, vec![]);
    assert!(log
        .steps
        .iter()
        .flat_map(|s| &s.seqs)
        .all(|x| x.3 || x.1 == 0));
    assert!(
        log.steps.iter().any(|s| s.num_tokens > 2048),
        "several long prefills in one step"
    );
}

#[test]
fn prefix_caching_skips_the_shared_1024_tokens() {
    let s = scenario("prefix_caching");
    let cfg = s.server.scheduler_config();
    let (on, _) = drive(cfg.clone(), requests_of(&s), simple_cost, vec![]);
    let off_cfg = SchedulerConfig {
        prefix_caching: false,
        ..cfg
    };
    let (off, _) = drive(off_cfg, requests_of(&s), simple_cost, vec![]);
    assert_eq!(on.finished().len(), 48);
    assert_eq!(
        on.prefill_tokens(0),
        off.prefill_tokens(0),
        "the first request computes everything"
    );
    for id in 1..48 {
        let saved = off.prefill_tokens(id) as i64 - on.prefill_tokens(id) as i64;
        assert!(
            (1008..=1040).contains(&saved),
            "request {id} saved {saved} tokens"
        );
    }
    let cached: Vec<usize> = on
        .finished()
        .iter()
        .filter(|f| f.0 > 0)
        .map(|f| f.2.cached_tokens)
        .collect();
    assert!(cached.iter().all(|&c| c >= 1024), "{cached:?}");
}

#[test]
fn a_full_cache_evicts_instead_of_failing() {
    // 64 blocks of 16 tokens; each request needs ~40 blocks and leaves them cached.
    let cfg = SchedulerConfig {
        num_gpu_blocks: 64,
        max_batch_size: 4,
        prefill_chunk_size: 128,
        max_model_len: 1024,
        ..SchedulerConfig::default()
    };
    let reqs: Vec<(f64, Request)> = (0..20)
        .map(|i| {
            let prompt: Vec<u32> = (0..500).map(|t| (t * 13 + i * 1000) as u32).collect();
            (i as f64 * 0.5, Request::new(i as u64, prompt, 100))
        })
        .collect();
    let (log, sched) = drive(cfg, reqs, simple_cost, vec![]);
    let done = log.finished();
    assert_eq!(done.len(), 20);
    assert!(done.iter().all(|(_, r, _)| *r == FinishReason::Length));
    assert!(log.rejected.is_empty());
    assert_eq!(sched.stats().num_free_blocks, 64);
}

/// The prefix cache's queries are the prompts' first lookups, as vLLM counts them: a
/// preempted sequence's lookup again, prompt and output, is not one more query.
#[test]
fn prefix_queries_count_each_prompt_once_through_preemption() {
    let cfg = SchedulerConfig {
        num_gpu_blocks: 24,
        block_size: 4,
        max_batch_size: 4,
        chunked_prefill: false,
        prefix_caching: true,
        max_model_len: 96,
        ..SchedulerConfig::default()
    };
    let reqs: Vec<(f64, Request)> = (0..4)
        .map(|i| (0.0, Request::new(i, vec![5 + i as u32; 12], 30)))
        .collect();
    let (_, sched) = drive(cfg, reqs, simple_cost, vec![]);
    let stats = sched.stats();
    assert!(stats.num_preemptions > 0);
    assert_eq!(stats.prefix_queries, 4 * 12);
}

#[test]
fn running_out_of_blocks_preempts_and_recomputes() {
    // Prompts fit, but decodes outgrow the pool: the newest sequence is preempted, then
    // finishes later with its full output.
    let cfg = SchedulerConfig {
        num_gpu_blocks: 24,
        block_size: 4,
        max_batch_size: 4,
        chunked_prefill: false,
        prefix_caching: false,
        max_model_len: 96,
        ..SchedulerConfig::default()
    };
    let reqs: Vec<(f64, Request)> = (0..4)
        .map(|i| (0.0, Request::new(i, vec![5; 12], 30)))
        .collect();
    let (log, sched) = drive(cfg, reqs, simple_cost, vec![]);
    assert!(sched.stats().num_preemptions > 0);
    let first_victim = log
        .steps
        .iter()
        .find(|s| !s.preempted.is_empty())
        .unwrap()
        .preempted[0];
    assert_eq!(first_victim, 3, "newest first");
    let done = log.finished();
    assert_eq!(done.len(), 4);
    assert!(done
        .iter()
        .all(|(_, r, s)| *r == FinishReason::Length && s.output_tokens == 30));
    assert!(done.iter().any(|(_, _, s)| s.preemptions > 0));
}
