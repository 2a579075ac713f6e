#!/usr/bin/env bash
# lm-evaluation-harness against `engine serve`, unmodified, beside lm-eval's own Hugging Face
# backend on the same safetensors. Local tasks only (scripts/lm_eval/: no dataset download).
#
#   pip install "lm_eval[api,hf]==0.4.13"
#   cargo build --release -p infer-engine
#   bash scripts/lm_eval_check.sh [MODEL]      # MODEL: a model directory or builtin:tiny
#
# 1. `local-completions` (token-id prompts, lm-eval's default, four per request) scores the
#    multiple-choice task's loglikelihoods twice: with the server's tokenizer, which lm-eval
#    finds at /tokenizer_info and uses through /tokenize (no BOS), and with the model
#    directory's tokenizer and `add_bos_token=True`. Each is compared with lm-eval's `hf`
#    backend tokenising the same way (add_bos_token False, then True).
# 2. `local-chat-completions` runs the generation task through the chat template.
# Exit status 1 when a loglikelihood differs by more than 1e-4 or a run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
MODEL=${1:-builtin:tiny}
PORT=${PORT:-8123}
OUT=${OUT:-runs/lm_eval}
ENGINE=${ENGINE:-$engine}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
rm -rf "$OUT" && mkdir -p "$OUT"

"$ENGINE" serve --model "$MODEL" --port "$PORT" --dtype f32 > "$OUT/serve.log" 2>&1 &
pids+=($!)
wait_for "http://127.0.0.1:$PORT/health" 300 "${pids[-1]}" || { cat "$OUT/serve.log"; exit 1; }
read -r NAME DIR < <(served_model "$PORT")
echo "serving $NAME from $DIR"

TASKS=(--include_path scripts/lm_eval --log_samples)
API="model=$NAME,base_url=http://127.0.0.1:$PORT/v1/completions,num_concurrent=1,max_retries=1"
run() { # NAME ARGS...: one lm_eval run, its log and samples under $OUT/NAME
    local name=$1; shift
    echo "== lm_eval $name"
    lm_eval "$@" "${TASKS[@]}" --output_path "$OUT/$name" > "$OUT/$name.log" 2>&1 \
        || { tail -30 "$OUT/$name.log"; exit 1; }
    grep -E "^\|" "$OUT/$name.log" | tail -n +3
}
run api_remote --model local-completions --batch_size 4 --tasks infer_local_mc \
    --model_args "$API,tokenized_requests=True"
run hf_nobos --model hf --device cpu --batch_size 4 --tasks infer_local_mc \
    --model_args "pretrained=$DIR,dtype=float32,add_bos_token=False"
run api_bos --model local-completions --batch_size 4 --tasks infer_local_mc \
    --model_args "$API,tokenized_requests=True,tokenizer_backend=huggingface,tokenizer=$DIR,add_bos_token=True"
run hf_bos --model hf --device cpu --batch_size 4 --tasks infer_local_mc \
    --model_args "pretrained=$DIR,dtype=float32,add_bos_token=True"
run chat --model local-chat-completions --apply_chat_template --tasks infer_local_gen \
    --model_args "model=$NAME,base_url=http://127.0.0.1:$PORT/v1/chat/completions,max_retries=1"

python3 - "$OUT" <<'EOF'
import glob, json, sys
out = sys.argv[1]

def loglikelihoods(run):
    [path] = glob.glob(f"{out}/{run}/*/samples_infer_local_mc_*.jsonl")
    rows = {}
    for line in open(path):
        s = json.loads(line)
        rows[s["doc_id"]] = [float(r[0][0]) for r in s["resps"]]
    return rows

worst = 0.0
print("\n| infer (local-completions) | lm-eval hf | loglikelihoods | max abs difference |")
print("|---|---|---:|---:|")
for api, hf, how in [("api_remote", "hf_nobos", "server tokenizer, no BOS"),
                     ("api_bos", "hf_bos", "HF tokenizer, BOS")]:
    a, h = loglikelihoods(api), loglikelihoods(hf)
    assert a.keys() == h.keys(), "the two runs scored different documents"
    diffs = [abs(x - y) for k in a for x, y in zip(a[k], h[k], strict=True)]
    worst = max(worst, max(diffs))
    print(f"| {how} | add_bos_token={hf == 'hf_bos'} | {len(diffs)} | {max(diffs):.2e} |")
[chat] = glob.glob(f"{out}/chat/*/samples_infer_local_gen_*.jsonl")
gens = [json.loads(line)["resps"][0][0] for line in open(chat)]
print(f"\nlocal-chat-completions: {len(gens)} generations, {sum(bool(g) for g in gens)} non-empty")
if worst > 1e-4:
    sys.exit(f"FAIL: a loglikelihood differs by {worst:.2e} (> 1e-4)")
print("OK: every loglikelihood within 1e-4 of lm-eval's hf backend")
EOF
