#!/usr/bin/env bash
# GuideLLM (vLLM's load generator) against `engine serve`, unmodified, beside `engine bench`
# measuring the same server with the same shape of load: two clients timing one server.
#
#   pip install "guidellm==0.8.1"
#   cargo build --release -p infer-engine
#   bash scripts/guidellm_check.sh [MODEL]      # MODEL: a model directory or builtin:tiny
#
# Each client runs the load twice, alternating (guidellm, bench, guidellm, bench), so that
# a drift of the shared machine shows as a spread within a client, not a gap between them:
# a closed loop of 1 client, then of 4 ($STREAMS), $REQUESTS requests of $PROMPT prompt tokens (cut with
# the served model's tokenizer by both) and exactly $OUTPUT output tokens (`ignore_eos`),
# through /v1/completions. Then guidellm through /v1/chat/completions, its default, and
# /v1/responses, as a check that every request is answered, and `engine bench --endpoint
# /v1/chat/completions` with 4 streams, judged against the server as through completions.
# Prefix caching is off: guidellm's prompts and the scenario's differ, and a cached prefix
# would favour whichever repeats more. The server's /metrics before and after each run give
# its own mean TTFT, gap between tokens and E2E over the run, which each client's figures are
# set beside (less `engine bench`'s short test request, measured alone just before). Exit status 1 when a client fails a request, or when `engine bench`'s mean TTFT,
# TPOT or E2E differs from the server's own for the same run by more than $TOLERANCE (a
# fraction, default 0.05) and 1 ms. guidellm's are shown, not judged. Between the clients
# more than timing differs: when each stream sends its next request shapes how the server
# batches them.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
MODEL=${1:-builtin:tiny}
PORT=${PORT:-8124}
OUT=${OUT:-runs/guidellm}
ENGINE=${ENGINE:-$engine}
STREAMS=${STREAMS:-1 4}
REQUESTS=${REQUESTS:-48}
PROMPT=${PROMPT:-256}
OUTPUT=${OUTPUT:-64}
TOLERANCE=${TOLERANCE:-0.05}
# The server and the client each on their own cores: a client that takes CPU from the server
# (guidellm is Python, in several processes) would make the server slower, not its timing worse.
SERVER_CPUS=${SERVER_CPUS:-0}
CLIENT_CPUS=${CLIENT_CPUS:-1}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
rm -rf "$OUT" && mkdir -p "$OUT"

taskset -c "$SERVER_CPUS" "$ENGINE" serve --model "$MODEL" --port "$PORT" --no-enable-prefix-caching \
    > "$OUT/serve.log" 2>&1 &
pids+=($!)
wait_for "http://127.0.0.1:$PORT/health" 300 "${pids[-1]}" || { cat "$OUT/serve.log"; exit 1; }
read -r NAME DIR < <(served_model "$PORT")
echo "serving $NAME from $DIR"

# The server's own timing of a run: its /metrics before and after.
scrape() { curl -sf "http://127.0.0.1:$PORT/metrics" > "$OUT/$1.prom"; }
guidellm_run() { # ROUTE STREAMS TAG
    scrape "$3.before"
    taskset -c "$CLIENT_CPUS" guidellm run \
        --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=$NAME,request_format=$1" \
        --profile "kind=concurrent,streams=$2" \
        --constraint "kind=max_requests,count=$REQUESTS" \
        --data "kind=synthetic_text,prompt_tokens=$PROMPT,output_tokens=$OUTPUT" \
        --tokenizer "kind=huggingface_auto,model=$DIR" \
        --output "kind=json,path=$OUT/$3.json" \
        --disable-console-interactive > "$OUT/$3.log" 2>&1 \
        || { tail -30 "$OUT/$3.log"; exit 1; }
    scrape "$3.after"
}
bench_run() { # STREAMS TAG [ENDPOINT]
    local endpoint=${3:-/v1/completions} prompt='"prompt": "Hello"'
    [ "$endpoint" = /v1/chat/completions ] && prompt='"messages": [{"role": "user", "content": "Hello"}]'
    # `engine bench` sends one short test request before its run, which the server's
    # figures count: the same request sent alone first says what to take away for it.
    scrape "$2.probe0"
    curl -sf "http://127.0.0.1:$PORT$endpoint" -H 'content-type: application/json' \
        -d "{\"model\": \"$NAME\", $prompt, \"max_tokens\": 2, \"temperature\": 0, \"ignore_eos\": true}" \
        > /dev/null
    scrape "$2.probe1"
    scrape "$2.before"
    taskset -c "$CLIENT_CPUS" "$ENGINE" bench --scenario scenarios/paged_attention.toml --server "http://127.0.0.1:$PORT" \
        --tokenizer "$DIR" --no-progress --out "$OUT/$2" \
        --set "workload.num_requests=$REQUESTS" --set workload.warmup_requests=0 \
        --set "workload.prompt_tokens=$PROMPT" --set "workload.output_tokens=$OUTPUT" \
        --set workload.ignore_eos=true \
        --set arrival.kind=concurrency --set "arrival.max_concurrency=$1" --endpoint "$endpoint" \
        > "$OUT/$2.log" 2>&1 || { tail -30 "$OUT/$2.log"; exit 1; }
    scrape "$2.after"
}
for streams in $STREAMS; do
    for round in 1 2; do
        echo "== $streams streams, round $round: guidellm, then engine bench"
        guidellm_run /v1/completions "$streams" "guidellm-c$streams-$round"
        bench_run "$streams" "bench-c$streams-$round"
    done
done
for route in chat/completions responses; do
    echo "== guidellm through /v1/$route"
    guidellm_run "/v1/$route" 4 "guidellm-${route%%/*}"
done
echo "== engine bench through /v1/chat/completions"
bench_run 4 bench-chat /v1/chat/completions

python3 - "$OUT" "$TOLERANCE" "$REQUESTS" $STREAMS <<'EOF'
import json, statistics, sys
out, tolerance, requests = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
streams = sys.argv[4:]

def guidellm(tag):
    b = json.load(open(f"{out}/{tag}.json"))["benchmarks"][0]
    m = b["metrics"]
    ok = m["request_totals"]["successful"]
    if ok != requests:
        sys.exit(f"{tag}: {ok} of {requests} requests succeeded")
    tokens = m["output_token_count"]["successful"]["total_sum"]
    return {
        "mean TTFT ms": m["time_to_first_token_ms"]["successful"]["mean"],
        "median TTFT ms": m["time_to_first_token_ms"]["successful"]["median"],
        # guidellm's inter-token latency is vLLM's TPOT: (E2E - TTFT) / (tokens - 1).
        "mean TPOT ms": m["inter_token_latency_ms"]["successful"]["mean"],
        "mean E2E ms": 1000 * m["request_latency"]["successful"]["mean"],
        "output tok/s": tokens / b["duration"],
        "output tokens": tokens,
    }

def bench(tag):
    s = json.load(open(f"{out}/{tag}/summary.json"))
    if s["completed"] != requests:
        sys.exit(f"{tag}: {s['completed']} of {requests} requests completed")
    return {
        "mean TTFT ms": s["mean_ttft_ms"],
        "median TTFT ms": s["median_ttft_ms"],
        "mean TPOT ms": s["mean_tpot_ms"],
        "mean E2E ms": s["mean_e2el_ms"],
        "output tok/s": s["output_throughput"],
        "output tokens": s["total_output_tokens"],
    }

for route in ("chat/completions", "responses"):
    guidellm(f"guidellm-{route.split('/')[0]}")  # exits unless every request was answered
    print(f"guidellm through /v1/{route}: {requests} of {requests} requests answered")

def server(tag):
    """The server's means over the run: TTFT, the gap between tokens, E2E (vLLM's names).
    Under `engine bench`, less its test request, as the same request sent alone before
    measured it."""
    def read(which):
        m = {}
        for line in open(f"{out}/{tag}.{which}.prom"):
            if line.startswith("vllm:") and ("_sum{" in line or "_count{" in line):
                name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                m[name] = m.get(name, 0) + value
        return m
    a, b = read("before"), read("after")
    if tag.startswith("bench"):
        p0, p1 = read("probe0"), read("probe1")
        b = {k: v - (p1[k] - p0[k]) for k, v in b.items()}
    mean = lambda k: 1000 * (b[k + "_sum"] - a[k + "_sum"]) / (b[k + "_count"] - a[k + "_count"])
    return {
        "mean TTFT ms": mean("vllm:time_to_first_token_seconds"),
        # Every request generates the same number of tokens: the mean gap is the mean TPOT.
        "mean TPOT ms": mean("vllm:inter_token_latency_seconds"),
        "mean E2E ms": mean("vllm:e2e_request_latency_seconds"),
    }

failed = False

def judge(client, own, what):
    global failed
    for key in ("mean TTFT ms", "mean TPOT ms", "mean E2E ms"):
        if abs(client[key] - own[key]) > max(tolerance * own[key], 1.0):
            failed = True
            print(f"  engine bench's {key}, {what}: {client[key]:.1f}, the server's {own[key]:.1f}")

client, own = bench("bench-chat"), server("bench-chat")
print(f"\nengine bench through /v1/chat/completions, {requests} requests from 4 streams")
print("| figure | engine bench | server |\n|---|---|---|")
for key in own:
    print(f"| {key} | {client[key]:.1f} | {own[key]:.1f} |")
judge(client, own, "through chat")

for c in streams:
    runs = {n: [f(f"{n}-c{c}-{r}") for r in (1, 2)] for n, f in (("guidellm", guidellm), ("bench", bench))}
    print(f"\n/v1/completions, {requests} requests from {c} stream(s); each client's two runs")
    seen = {n: [server(f"{n}-c{c}-{r}") for r in (1, 2)] for n in ("guidellm", "bench")}
    print("| figure | guidellm | server, under guidellm | engine bench | server, under bench | bench / guidellm |")
    print("|---|---|---|---|---|---|")
    fmt = lambda xs: " / ".join(f"{x:.1f}" for x in xs) if xs[0] is not None else "–"
    for key in runs["guidellm"][0]:
        g = [r[key] for r in runs["guidellm"]]
        e = [r[key] for r in runs["bench"]]
        sg = [r.get(key) for r in seen["guidellm"]]
        se = [r.get(key) for r in seen["bench"]]
        ratio = statistics.mean(e) / statistics.mean(g)
        print(f"| {key} | {fmt(g)} | {fmt(sg)} | {fmt(e)} | {fmt(se)} | {ratio:.3f} |")
    for r in (0, 1):
        judge(runs["bench"][r], seen["bench"][r], f"{c} stream(s), run {r + 1}")
sys.exit(1 if failed else 0)
EOF
