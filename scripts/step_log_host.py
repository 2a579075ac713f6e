#!/usr/bin/env python3
"""The host's share of each engine step, from a step log (`engine serve --step-log FILE`).

A step's `forward_s` is the model's forward and sampling; `step_s` is the whole step
(scheduling, the forward, the scheduler's update, detokenising and streaming the tokens).
Their difference is host work the GPU waits through unless the engine overlaps it with the
next step: what overlapping could save at most. Printed for decode-only steps, by batch
size (medians), with at least MIN_STEPS steps each:

    python3 scripts/step_log_host.py STEPS.csv [MIN_STEPS]
"""

import csv
import statistics
import sys


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    path = sys.argv[1]
    min_steps = int(sys.argv[2]) if len(sys.argv) == 3 else 20
    by_batch: dict[int, list[tuple[float, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            # A server stopped mid-write leaves a partial last line.
            if not row.get("step_s") or int(row["prefill_tokens"]) != 0:
                continue
            by_batch.setdefault(int(row["decode_seqs"]), []).append(
                (float(row["forward_s"]), float(row["step_s"]))
            )
    print("decode_seqs  steps  forward_ms  step_ms  host_ms  host_share")
    shown = 0
    for batch, steps in sorted(by_batch.items()):
        if len(steps) < min_steps:
            continue
        forward = statistics.median(s[0] for s in steps)
        step = statistics.median(s[1] for s in steps)
        host = statistics.median(s[1] - s[0] for s in steps)
        print(
            f"{batch:11d}  {len(steps):5d}  {forward * 1e3:10.3f}  {step * 1e3:7.3f}"
            f"  {host * 1e3:7.3f}  {host / step:10.3f}"
        )
        shown += 1
    if shown == 0:
        print(f"{path}: no decode batch size with {min_steps} steps or more", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
