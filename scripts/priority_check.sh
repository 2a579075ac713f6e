#!/usr/bin/env bash
# Priority scheduling on the CPU engine, measured and predicted.
#
# Profiles builtin:tiny (the full grid: the decode-heavy steps of an overloaded replica), then
# runs scenarios/priority_cpu.toml through `engine verify` first come, first served and
# priority-scheduled, ROUNDS (1) times each way, and prints each priority's TTFT and
# end-to-end latency, predicted by the simulator and measured on the engine (the median
# round's).
#
#   bash scripts/priority_check.sh [OUT_DIR]    (about two minutes a round on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/priority-check}
mkdir -p "$out"
cargo build --release -q -p infer-engine
engine=target/release/engine
$engine profile --out "$out/profile.json" > "$out/profile.log"
rounds=${ROUNDS:-1}
for r in $(seq 1 "$rounds"); do
  for policy in fcfs priority; do
    $engine verify scenarios/priority_cpu.toml --profile "$out/profile.json" \
      --out "$out/round-$r-$policy" --set server.scheduling_policy=$policy \
      > "$out/verify-$r-$policy.log" 2>&1
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def summary(r, policy, side):
    return json.load(open(f"{out}/round-{r}-{policy}/priority_cpu/{side}/summary.json"))
keys = [("TTFT P50 (ms)", "median_ttft_ms"), ("TTFT P99 (ms)", "p99_ttft_ms"),
        ("E2E P50 (ms)", "median_e2el_ms")]
print("| policy | priority | requests | metric | predicted | measured | error % |")
print("|---|---:|---:|---|---:|---:|---:|")
for policy in ("fcfs", "priority"):
    for p in (0, 1):
        n = summary(1, policy, "measured")[f"priority_{p}_completed"]
        for label, key in keys:
            k = f"priority_{p}_{key}"
            pred = summary(1, policy, "predicted")[k]
            meas = statistics.median(summary(r, policy, "measured")[k] for r in range(1, rounds + 1))
            print(f"| {policy} | {p} | {n} | {label} | {pred:.0f} | {meas:.0f} | {(pred / meas - 1) * 100:+.0f} |")
for policy in ("fcfs", "priority"):
    pred = summary(1, policy, "predicted")["output_throughput"]
    meas = statistics.median(summary(r, policy, "measured")["output_throughput"] for r in range(1, rounds + 1))
    print(f"{policy}: output throughput predicted {pred:.0f} tok/s, measured {meas:.0f} tok/s")
PY
