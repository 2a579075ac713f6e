#!/usr/bin/env bash
# `engine bench` against a server that is not infer: Hugging Face's `transformers serve`
# (OpenAI-compatible, from PyPI), on the same generated model as `engine serve`, with the
# same scenario — then each request's prompt tokens as each server counted them.
#
#   pip install torch "transformers[serving]"    # once, from PyPI
#   scripts/bench_transformers.sh [SCENARIO] [REQUESTS]
#
# SCENARIO defaults to scenarios/paged_attention.toml, REQUESTS to 16; outputs are cut to 16
# tokens (transformers serves one request at a time without --continuous-batching) and
# `ignore_eos` is off (transformers refuses the field: engine bench says so and how to turn
# it off). Prompts are cut in the model's own tokens (`--tokenizer`). `/v1/models` of
# transformers serve answers 500 for a local directory, so the model is named (`--model`).
# Writes runs/bench-transformers-<time>/: model/, transformers/, infer/, report/.
set -euo pipefail
cd "$(dirname "$0")/.."

scenario=${1:-scenarios/paged_attention.toml}
requests=${2:-16}
command -v transformers > /dev/null \
    || { echo "transformers not found: pip install torch \"transformers[serving]\"" >&2; exit 2; }
cargo build --release -q -p infer-engine -p infer-sim
source scripts/lib.sh
out=$(run_dir bench-transformers)
small_llama "$out/model"
sets=(--set "workload.num_requests=$requests" --set workload.output_tokens=16
    --set workload.ignore_eos=false --set workload.warmup_requests=0)
load=(--scenario "$scenario" --model "$out/model" --tokenizer "$out/model" --no-progress
    "${sets[@]}")

transformers serve "$out/model" --port 8600 --device cpu > "$out/transformers.log" 2>&1 &
pids+=($!)
wait_for http://127.0.0.1:8600/health 120
"$engine" bench --server http://127.0.0.1:8600 "${load[@]}" --out "$out/transformers" \
    | tee "$out/transformers.txt"

"$engine" serve --model "$out/model" --port 8601 > "$out/infer.log" 2>&1 &
pids+=($!)
wait_for http://127.0.0.1:8601/health
"$engine" bench --server http://127.0.0.1:8601 "${load[@]}" --out "$out/infer" > "$out/infer.txt"

# The lengths the scenario asks for: the simulator's requests of the same workload.
"$sim" run "$scenario" "${sets[@]}" --out "$out/intended" > /dev/null

# Each request's prompt and output tokens as each server counted them (requests.csv columns).
python3 - "$out" << 'EOF'
import csv, sys
out = sys.argv[1]
def rows(name):
    return {int(r["id"]): r for r in csv.DictReader(open(f"{out}/{name}/requests.csv"))}
t, i, want = rows("transformers"), rows("infer"), rows("intended")
failed = sum(r["success"] != "true" for r in t.values())
exact = sum(t[k]["prompt_tokens"] == want[k]["prompt_tokens"] for k in t)
same = sum(t[k]["prompt_tokens"] == i[k]["prompt_tokens"] for k in t)
print(f"transformers serve: {len(t)} requests, {failed} failed; prompt tokens it counted equal "
      f"the scenario's for {exact} of {len(t)}, infer's count for {same} of {len(t)}")
print("id  prompt tokens (scenario / transformers / infer)  output tokens (transformers / infer)")
for k in sorted(t):
    print(f"{k:>2}  {want[k]['prompt_tokens']:>6} / {t[k]['prompt_tokens']:>6} / "
          f"{i[k]['prompt_tokens']:<6}                    {t[k]['output_tokens']:>4} / "
          f"{i[k]['output_tokens']}")
EOF
"$sim" report "$out/infer" "$out/transformers" --out "$out/report" > /dev/null
echo "runs: $out (report: $out/report/report.md)"
