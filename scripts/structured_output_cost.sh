#!/usr/bin/env bash
# Structured output's throughput cost on the CPU engine, measured and predicted.
#
# Profiles builtin:tiny (engine profile also measures the grammar's host cost per token),
# then runs scenarios/structured_output.toml through `engine verify` twice, every request
# constrained and none, and prints the throughput each way and the cost (the drop),
# predicted by the simulator and measured on the engine.
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
for f in 0 1; do
  $engine verify scenarios/structured_output.toml --profile "$out/profile.json" \
    --out "$out/fraction-$f" --repeat 3 --set workload.structured_output.fraction=$f \
    > "$out/verify-$f.log"
done
python3 - "$out" <<'PY'
import re, sys
out = sys.argv[1]
def throughput(f):
    for line in open(f"{out}/verify-{f}.log"):
        if "Throughput (tok/s)" in line:
            cells = [c.strip() for c in line.split("|")]
            return float(cells[3]), float(cells[4])
    raise SystemExit(f"no throughput row in {out}/verify-{f}.log")
(p0, m0), (p1, m1) = throughput(0), throughput(1)
pc, mc = 1 - p1 / p0, 1 - m1 / m0
print(f"throughput unconstrained: predicted {p0:.0f} tok/s, measured {m0:.0f} tok/s")
print(f"throughput constrained:   predicted {p1:.0f} tok/s, measured {m1:.0f} tok/s")
print(f"structured_output_cost: predicted {pc*100:.1f}%, measured {mc*100:.1f}%, "
      f"error of the prediction {(pc/mc-1)*100:+.0f}%")
PY
