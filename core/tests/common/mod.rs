//! A minimal driver for scheduler tests: a logical clock, a fixed cost per step, and a
//! deterministic "model" that samples token ids from (request, step).

#![allow(dead_code)]

use infer_core::{
    AddOptions, Event, FinishReason, Request, RequestId, Scheduler, SchedulerConfig, StepPlan,
};

/// What one step looked like.
#[derive(Debug, Clone, PartialEq)]
pub struct StepLog {
    pub time: f64,
    pub num_tokens: usize,
    pub num_running: usize,
    /// (request, num_computed, num_new, is_decode)
    pub seqs: Vec<(u64, usize, usize, bool)>,
    pub preempted: Vec<u64>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunLog {
    pub steps: Vec<StepLog>,
    /// (time, event)
    pub events: Vec<(f64, Event)>,
    pub rejected: Vec<u64>,
}

impl RunLog {
    pub fn finished(&self) -> Vec<(u64, FinishReason, infer_core::RequestStats)> {
        self.events
            .iter()
            .filter_map(|(_, e)| match e {
                Event::Finished {
                    request,
                    reason,
                    stats,
                } => Some((request.0, *reason, *stats)),
                _ => None,
            })
            .collect()
    }

    pub fn first_token_time(&self, id: u64) -> Option<f64> {
        self.events.iter().find_map(|(t, e)| match e {
            Event::Token {
                request,
                prev_token_time: None,
                ..
            } if request.0 == id => Some(*t),
            _ => None,
        })
    }

    /// Prompt (non-decode) tokens computed for request `id`.
    pub fn prefill_tokens(&self, id: u64) -> usize {
        self.steps
            .iter()
            .flat_map(|s| s.seqs.iter())
            .filter(|(r, _, _, d)| *r == id && !d)
            .map(|(_, _, n, _)| n)
            .sum()
    }
}

pub fn sample(plan: &StepPlan) -> Vec<u32> {
    plan.seqs
        .iter()
        .filter(|s| s.samples)
        .map(|s| 10 + ((s.request.0 * 31 + plan.step * 7) % 1000) as u32)
        .collect()
}

/// Run `requests` (arrival time, request) to completion; each step costs
/// `step_cost(plan)` seconds. `abort_at` lists (time, id) cancellations.
pub fn drive(
    cfg: SchedulerConfig,
    requests: Vec<(f64, Request)>,
    step_cost: impl Fn(&StepPlan) -> f64,
    abort_at: Vec<(f64, u64)>,
) -> (RunLog, Scheduler) {
    let requests = requests
        .into_iter()
        .map(|(t, r)| (t, r, Vec::new()))
        .collect();
    drive_forked(cfg, requests, step_cost, abort_at)
}

/// [`drive`] with requests that fork more sequences (OpenAI's `n`): `(arrival, request,
/// fork ids)`.
pub fn drive_forked(
    cfg: SchedulerConfig,
    mut requests: Vec<(f64, Request, Vec<RequestId>)>,
    step_cost: impl Fn(&StepPlan) -> f64,
    mut abort_at: Vec<(f64, u64)>,
) -> (RunLog, Scheduler) {
    requests.sort_by(|a, b| a.0.total_cmp(&b.0));
    abort_at.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut sched = Scheduler::new(cfg);
    let mut log = RunLog::default();
    let mut now = 0.0;
    let (mut next_req, mut next_abort) = (0, 0);
    let mut idle_steps = 0;
    loop {
        while next_req < requests.len() && requests[next_req].0 <= now {
            let (t, r, forks) = requests[next_req].clone();
            let id = r.id.0;
            // Three priorities, which priority scheduling orders by and first come, first
            // served ignores.
            let opts = AddOptions {
                forks,
                priority: (id % 3) as i64 - 1,
                ..AddOptions::default()
            };
            if sched.add_with(r, opts, t).is_err() {
                log.rejected.push(id);
            }
            next_req += 1;
        }
        while next_abort < abort_at.len() && abort_at[next_abort].0 <= now {
            sched.abort(RequestId(abort_at[next_abort].1));
            next_abort += 1;
        }
        if !sched.has_unfinished() {
            if next_req == requests.len() {
                break;
            }
            now = requests[next_req].0;
            continue;
        }
        let plan = sched.schedule(now);
        let stats = sched.stats();
        if plan.is_empty() {
            // Nothing can run (e.g. static batch finished, or waiting for blocks): advance.
            // With nothing left to arrive or be aborted, nothing can change: a livelock.
            idle_steps += 1;
            assert!(
                idle_steps < 1000 || next_req < requests.len() || next_abort < abort_at.len(),
                "livelock: {} requests unfinished, nothing scheduled for {idle_steps} steps",
                sched.num_unfinished()
            );
            let next = requests
                .get(next_req)
                .map_or(now + 1e-3, |r| r.0.max(now + 1e-3));
            sched.complete(plan, &[], now);
            now = next;
            continue;
        }
        idle_steps = 0;
        // Steps that run but never finish the work (preemption ping-pong) are a livelock too.
        assert!(
            log.steps.len() < 20_000,
            "livelock: {} requests unfinished after {} steps",
            sched.num_unfinished(),
            log.steps.len()
        );
        log.steps.push(StepLog {
            time: now,
            num_tokens: plan.num_tokens(),
            num_running: stats.num_running,
            seqs: plan
                .seqs
                .iter()
                .map(|s| (s.request.0, s.num_computed, s.num_new_tokens, s.is_decode))
                .collect(),
            preempted: plan.preempted.iter().map(|r| r.0).collect(),
        });
        let tokens = sample(&plan);
        now += step_cost(&plan);
        for e in sched.complete(plan, &tokens, now) {
            log.events.push((now, e));
        }
        // INV-1…5, 7, 8 of docs/design.md, every step.
        sched.check_invariants().expect("invariants");
    }
    (log, sched)
}

/// A step costs a fixed overhead plus a per-token term (enough to order events).
pub fn simple_cost(plan: &StepPlan) -> f64 {
    0.010 + plan.num_tokens() as f64 * 20e-6
}
