#!/usr/bin/env bash
# Structured output's throughput cost on the CPU engine, measured and predicted.
#
# Profiles builtin:tiny (engine profile also measures the grammar's host cost per token),
# then runs scenarios/structured_output.toml through `engine verify` in ROUNDS (5) rounds of
# two runs, no request constrained and every one, and prints the throughput each way and the
# cost (the drop), predicted by the simulator and measured on the engine (the median round).
#
#   bash scripts/structured_output_cost.sh [OUT_DIR]    (about a minute on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/structured-output-cost}
mkdir -p "$out"
cargo build --release -q -p infer-engine
engine=target/release/engine
$engine profile --out "$out/profile.json" > "$out/profile.log"
python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['structured_output']; print(f\"grammar cost: {s['token_s']*1e6:.1f} us per constrained token over {s['tokens']} tokens ({s['grammar']})\")" "$out/profile.json"
# Rounds of one run each way back to back: the cost is a difference of two throughputs, and
# this shared machine drifts more between runs far apart than between neighbours.
rounds=${ROUNDS:-5}
for r in $(seq 1 "$rounds"); do
  for f in 0 1; do
    $engine verify scenarios/structured_output.toml --profile "$out/profile.json" \
      --out "$out/round-$r-fraction-$f" --set workload.structured_output.fraction=$f \
      > "$out/verify-$r-$f.log" 2>&1
  done
done
python3 - "$out" "$rounds" <<'PY'
import statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def throughput(r, f):
    for line in open(f"{out}/verify-{r}-{f}.log"):
        if "Throughput (tok/s)" in line:
            cells = [c.strip() for c in line.split("|")]
            return float(cells[3]), float(cells[4])
    raise SystemExit(f"no throughput row in {out}/verify-{r}-{f}.log")
runs = [(throughput(r, 0), throughput(r, 1)) for r in range(1, rounds + 1)]
(p0, _), (p1, _) = runs[0]
m0 = statistics.median(a[1] for a, _ in runs)
m1 = statistics.median(b[1] for _, b in runs)
costs = sorted(1 - b[1] / a[1] for a, b in runs)
pc, mc = 1 - p1 / p0, statistics.median(costs)
print(f"throughput unconstrained: predicted {p0:.0f} tok/s, measured {m0:.0f} tok/s (median of {rounds})")
print(f"throughput constrained:   predicted {p1:.0f} tok/s, measured {m1:.0f} tok/s (median of {rounds})")
print(f"measured cost per round: {', '.join(f'{c*100:.1f}%' for c in costs)}")
print(f"structured_output_cost: predicted {pc*100:.1f}%, measured {mc*100:.1f}% (median), "
      f"error of the prediction {(pc/mc-1)*100:+.0f}%")
PY
