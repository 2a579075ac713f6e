#!/usr/bin/env bash
# A plan checked on the real engine (CPU): profile the engine on this machine, plan the
# scenario on that profile (`sim plan`), then serve N of the plan's configurations, spread
# from the best predicted to the worst, and measure each ROUNDS times with `engine verify`
# (`engine serve` + `engine bench` on the same scenario, seed and settings). Rounds are
# interleaved (every configuration once, then again), since this shared machine drifts
# more between runs far apart than between neighbours. Prints predicted against measured
# goodput with the measured spread, whether the plan's best is the measured best or within
# the repeat spread of it, and Kendall's tau-b between predicted and mean measured goodput.
#
#   bash scripts/plan_check.sh [SCENARIO] [OUT_DIR]
#       (scenarios/plan_cpu.toml: N=8 ROUNDS=3, about five minutes on 2 cores)
#   PROFILE=profile.json bash scripts/plan_check.sh …   (reuse a profile of this machine)
#   DEVICE=cuda bash scripts/plan_check.sh …   (on a GPU machine, with target/release/ built
#       with --features cuda beforehand: nothing is built there)
set -euo pipefail
cd "$(dirname "$0")/.."
scenario=${1:-scenarios/plan_cpu.toml}
out=${2:-runs/plan-check}
n=${N:-8}
rounds=${ROUNDS:-3}
device=${DEVICE:-cpu}
mkdir -p "$out"
if [ "$device" = cpu ]; then
  cargo build --release -q -p infer-sim -p infer-engine
fi
sim=target/release/sim
engine=target/release/engine
profile=${PROFILE:-$out/profile.json}
if [ -z "${PROFILE:-}" ]; then
  $engine profile --device "$device" --out "$profile" > "$out/profile.log" 2>&1
fi
profile=$(cd "$(dirname "$profile")" && pwd)/$(basename "$profile")
$sim plan "$scenario" --set "sim.cost_model=\"profiled\"" --set "sim.profile=\"$profile\"" \
  --out "$out/plan" --quiet | tee "$out/plan.log"

# The configurations to measure: the plan's own ranking (its `rank` column, 1 the best), N of
# them spread evenly over it.
python3 - "$out/plan/plan.csv" "$n" > "$out/chosen.tsv" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if not r["error"]]
rows.sort(key=lambda r: int(r["rank"]))
n = min(int(sys.argv[2]), len(rows))
picked = sorted({round(i * (len(rows) - 1) / max(n - 1, 1)) for i in range(n)})
for k in picked:
    r = rows[k]
    print(f"{r['rank']}\t{r['configuration']}\t{r['goodput_req_per_s']}\t{r['best']}\t{r['settings']}")
PY

for round in $(seq 1 "$rounds"); do
  i=0
  while IFS=$'\t' read -r rank name predicted best settings; do
    i=$((i + 1))
    sets=()
    IFS=';' read -ra parts <<< "$settings"
    for s in "${parts[@]}"; do sets+=(--set "$s"); done
    echo "round $round, configuration $i ($name)" >&2
    $engine verify "$scenario" --device "$device" --profile "$profile" "${sets[@]}" \
      --out "$out/measure/c$i-r$round" > "$out/measure-c$i-r$round.log" 2>&1
  done < "$out/chosen.tsv"
done

python3 - "$out" "$rounds" "$scenario" <<'PY'
import glob, json, math, statistics, sys
out, rounds, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3]
chosen = [l.rstrip("\n").split("\t") for l in open(f"{out}/chosen.tsv")]
rows = []
for i, (rank, name, predicted, best, _) in enumerate(chosen, 1):
    measured = []
    for r in range(1, rounds + 1):
        [summary] = glob.glob(f"{out}/measure/c{i}-r{r}/*/measured/summary.json")
        measured.append(json.load(open(summary))["request_goodput"])
    rows.append((int(rank), name, float(predicted), best == "true", measured))

def tau_b(x, y):
    c = d = tx = ty = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                c += 1
            else:
                d += 1
    denom = math.sqrt((c + d + tx) * (c + d + ty))
    return (c - d) / denom if denom else float("nan")

print(f"\nplan check of {scenario}: goodput (requests/s within the SLO), predicted by the "
      f"plan and measured on the engine ({rounds} rounds)")
print(f"{'rank':>4}  {'configuration':<62} {'predicted':>9} {'measured mean':>13} {'spread':>15}")
for rank, name, p, best, m in rows:
    mark = "  <- plan's best" if best else ""
    print(f"{rank:>4}  {name:<62} {p:>9.3f} {statistics.mean(m):>13.3f} "
          f"{min(m):>7.3f}-{max(m):<7.3f}{mark}")
means = [statistics.mean(m) for *_, m in rows]
tau = tau_b([r[2] for r in rows], means)
top = max(range(len(rows)), key=lambda i: means[i])
plan_best = next((i for i, r in enumerate(rows) if r[3]), None)
if plan_best is None:
    verdict = "the plan named no best configuration"
elif plan_best == top:
    verdict = "the plan's best is the measured best"
else:
    # Within the repeat spread: the two means differ by no more than the larger of the two
    # configurations' own spreads (max - min over the rounds).
    gap = means[top] - means[plan_best]
    spread = max(max(rows[i][4]) - min(rows[i][4]) for i in (plan_best, top))
    verdict = (f"the plan's best is within the measured repeat spread of the measured best "
               f"(means {gap:.3f} req/s apart, spread {spread:.3f})" if gap <= spread else
               f"the plan's best is NOT the measured best, nor within its repeat spread "
               f"(means {gap:.3f} req/s apart, spread {spread:.3f})")
print(f"{verdict}; measured best: {rows[top][1]}, {means[top]:.3f} req/s")
print(f"kendall_tau_b(predicted, measured mean goodput) = {tau:.3f} over {len(rows)} configurations")
PY
