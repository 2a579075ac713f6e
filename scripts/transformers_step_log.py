#!/usr/bin/env python3
"""`transformers serve` with a step log in the format of `engine serve --step-log`: what its
continuous-batching scheduler ran, step by step, and how long each step took. A foreign
server's timings at the client show what happened, not why; with this log the simulator's
cost model is checked step by step against the steps the server really ran:

    TRANSFORMERS_STEP_LOG=steps.csv python3 scripts/transformers_step_log.py serve MODEL ...
    cargo run --release -p infer-engine --example step_check -- steps.csv SCENARIO.toml ...

The arguments after the script are `transformers`' own. It wraps three methods of the
installed transformers (5.24): the schedulers' `schedule_batch`, which picks a step's
requests; the batch processor's `update_batch`, which ends the step; and the offloading
manager's `offload_requests`, which evicts requests when the KV pool is full (each eviction
is reported on stderr, as `step-log: evicted N before step K`). A step's row is written and
flushed when it ends: the loop stops the server with a signal.

Columns as `engine/src/server/step_log.rs` defines them. A step starts when its scheduling
starts (`t_s`, seconds since the first) and ends when its tokens are handed to the streams
(`step_s`); `forward_s` is the same span (transformers runs them in one thread, in series),
and nothing is constrained. A sequence is a decode when it computes one token and samples
it; `decode_shared_context_tokens` is 0 (which blocks a decode shares is not tracked).
"""

import os
import sys
import time

from transformers.cli.transformers import main
from transformers.generation.continuous_batching import continuous_api, offloading_manager
from transformers.generation.continuous_batching import scheduler as cb_scheduler

# engine/src/server/step_log.rs HEADER, in its order.
HEADER = (
    "t_s,num_seqs,prefill_tokens,prefill_seqs,max_prefill_chunk,max_prefill_context,"
    "decode_seqs,sampled,context_tokens,decode_context_tokens,max_decode_context,"
    "decode_shared_context_tokens,attention_pairs,chunk_self_pairs,constrained_seqs,"
    "forward_s,constraint_s,step_s"
)
OUT = open(os.environ.get("TRANSFORMERS_STEP_LOG", "steps-transformers.csv"), "w")
OUT.write(HEADER + "\n")
OUT.flush()
T0 = time.monotonic()
PENDING = []  # (start, shape) of the scheduled step whose update has not come yet
STEP = [0]
EVICTED = [0]


def shape(batch):
    """The step's shape: each request's past (what it had computed before the step) and
    new tokens, as `StepShape::of` counts them."""
    s = dict(num_seqs=len(batch), prefill_tokens=0, prefill_seqs=0, max_prefill_chunk=0,
             max_prefill_context=0, decode_seqs=0, sampled=0, context_tokens=0,
             decode_context_tokens=0, max_decode_context=0, decode_shared_context_tokens=0,
             attention_pairs=0.0, chunk_self_pairs=0.0, constrained_seqs=0)
    for f in batch:
        q, past = f.query_length, f.state.current_len()
        context = past + q
        s["context_tokens"] += context
        s["attention_pairs"] += q * past + q * (q + 1) / 2
        s["sampled"] += int(f.has_new_token)
        if q == 1 and f.has_new_token:
            s["decode_seqs"] += 1
            s["decode_context_tokens"] += context
            s["max_decode_context"] = max(s["max_decode_context"], context)
        else:
            s["prefill_seqs"] += 1
            s["prefill_tokens"] += q
            s["max_prefill_chunk"] = max(s["max_prefill_chunk"], q)
            s["max_prefill_context"] = max(s["max_prefill_context"], context)
            s["chunk_self_pairs"] += q * q
    return s


def wrap_schedule(original):
    def schedule_batch(self, token_budget, cache_budget):
        start = time.monotonic()
        result = original(self, token_budget, cache_budget)
        if result[0]:
            PENDING.append((start, shape(result[0])))
        return result

    return schedule_batch


def wrap_update(original):
    def update_batch(self):
        result = original(self)
        if PENDING:
            start, s = PENDING.pop(0)
            span = time.monotonic() - start
            fields = [f"{start - T0:.6f}"] + [str(v) for v in s.values()]
            fields += [f"{span:.6f}", "0", f"{span:.6f}"]
            OUT.write(",".join(fields) + "\n")
            OUT.flush()
            STEP[0] += 1
        return result

    return update_batch


def wrap_offload(original):
    def offload_requests(self):
        before = len(self.scheduler.active_requests)
        result = original(self)
        evicted = before - len(self.scheduler.active_requests)
        if evicted > 0:
            print(f"step-log: evicted {evicted} before step {STEP[0] + 1}", file=sys.stderr,
                  flush=True)
        return result

    return offload_requests


for cls in (cb_scheduler.FIFOScheduler, cb_scheduler.PrefillFirstScheduler):
    cls.schedule_batch = wrap_schedule(cls.schedule_batch)
continuous_api.ContinuousBatchProcessor.update_batch = wrap_update(
    continuous_api.ContinuousBatchProcessor.update_batch)
offloading_manager.OffloadingManager.offload_requests = wrap_offload(
    offloading_manager.OffloadingManager.offload_requests)

if __name__ == "__main__":
    sys.argv[0] = "transformers"
    sys.exit(main())
