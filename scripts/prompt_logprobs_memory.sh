#!/usr/bin/env bash
# Peak memory of `engine serve` across one request that scores a long prompt (`echo` with
# `logprobs`, what evaluation harnesses send), without chunked prefill: the server's peak
# resident set (VmHWM) before and after the request, the request's time, and its logprobs
# (written to OUT/logprobs.json, to compare two builds). Model: a generated Llama with a
# 32,000-token vocabulary (2 layers, hidden 256, intermediate 512), so the logits dominate.
#
#   bash scripts/prompt_logprobs_memory.sh [ENGINE] [PROMPT_TOKENS] [OUT]
#       (target/release/engine, 6000 tokens, runs/prompt-logprobs-memory)
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${1:-target/release/engine}
n=${2:-6000}
out=${3:-runs/prompt-logprobs-memory}
port=${PORT:-8391}
mkdir -p "$out"
[ -f "$out/model/config.json" ] || $engine make-model --arch llama --layers 2 --hidden 256 \
  --heads 4 --kv-heads 2 --intermediate 512 --vocab 32000 --max-pos 8192 \
  --out "$out/model" > /dev/null
$engine serve --model "$out/model" --port "$port" --chunked-prefill false \
  --prefix-caching false --max-model-len 8192 --num-gpu-blocks 1024 > "$out/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2> /dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
  kill -0 $pid 2> /dev/null || { cat "$out/serve.log"; exit 1; }
  sleep 0.5
done
hwm() { awk '/VmHWM/ {print $2}' "/proc/$pid/status"; }
before=$(hwm)
python3 - "$port" "$n" "$out/logprobs.json" <<'PY'
import json, sys, time, urllib.request
port, n, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
base = f"http://127.0.0.1:{port}"
model = json.load(urllib.request.urlopen(f"{base}/v1/models"))["data"][0]["id"]
body = {"model": model, "prompt": [(7 * i) % 31000 + 100 for i in range(n)], "echo": True,
        "logprobs": 1, "max_tokens": 1, "temperature": 0}
req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
t = time.time()
logprobs = json.load(urllib.request.urlopen(req, timeout=600))["choices"][0]["logprobs"]
took = time.time() - t
json.dump(logprobs, open(path, "w"))
scored = sum(v is not None for v in logprobs["token_logprobs"])
print(f"{n}-token prompt scored ({scored} logprobs) in {took:.2f} s")
PY
echo "peak resident set: ${before} kB after start, $(hwm) kB after the request"
