#!/usr/bin/env bash
# A cluster as users run one: N `engine serve` replicas behind vllm-router, measured by
# `engine bench` through the router, beside `sim run` of the same cluster scenario with the
# simulator's closest router policy — both run directories and one report.
#
#   pip install vllm-router                      # once, from PyPI
#   scripts/cluster.sh [SCENARIO] [REPLICAS] [POLICY]
#
# SCENARIO   a scenario with a [cluster] table (default scenarios/cluster_cpu.toml); every
#            replica runs its [server] (`engine serve --scenario`).
# REPLICAS   default 2. Replica i is pinned to core i mod (cores) with taskset, so that
#            replicas do not share cores while there are enough of them (the simulator's
#            replicas are separate machines); the router and the load generator share.
# POLICY     vllm-router's policy (default cache_aware). The simulator runs the closest:
#              random -> random             round_robin -> round-robin
#              cache_aware -> approx-prefix kv_aware -> precise-prefix (replicas publish
#              power_of_two -> power-of-two              their KV events to the router)
#              consistent_hash -> chwbl
#
# The model is a small Llama generated here (`engine make-model`, deterministic weights, a
# real Hugging Face directory), profiled on one core (`engine profile --quick`) so that the
# simulator prices its steps from this machine's measurements. Writes
# runs/cluster-<time>/: model/, profile.json, predicted/, measured/, report/report.md.
# Ports: replicas 8400.., router 8500, KV events 5550.. (kv_aware).
set -euo pipefail
cd "$(dirname "$0")/.."

scenario=${1:-scenarios/cluster_cpu.toml}
replicas=${2:-2}
policy=${3:-cache_aware}
case "$policy" in
    random) sim_router=random ;;
    round_robin) sim_router=round-robin ;;
    cache_aware) sim_router=approx-prefix ;;
    kv_aware) sim_router=precise-prefix ;;
    power_of_two) sim_router=power-of-two ;;
    consistent_hash) sim_router=chwbl ;;
    *) echo "unknown policy $policy" >&2; exit 2 ;;
esac
command -v vllm-router > /dev/null || { echo "vllm-router not found: pip install vllm-router" >&2; exit 2; }

cargo build --release -q -p infer-engine -p infer-sim
source scripts/lib.sh
out=$(run_dir cluster)
small_llama "$out/model"
echo "profiling the model on one core ..."
taskset -c 0 "$engine" profile --model "$out/model" --quick --out "$out/profile.json" > "$out/profile.log"

cores=$(nproc)
workers=()
sources=()
for i in $(seq 0 $((replicas - 1))); do
    port=$((8400 + i))
    events=()
    if [ "$policy" = kv_aware ]; then
        events=(--kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$((5550 + i))\"}")
        sources+=(--kv-event-source "http://127.0.0.1:$port=tcp://127.0.0.1:$((5550 + i))")
    fi
    taskset -c $((i % cores)) "$engine" serve --model "$out/model" --port "$port" \
        --scenario "$scenario" "${events[@]}" > "$out/replica-$i.log" 2>&1 &
    pids+=($!)
    workers+=("http://127.0.0.1:$port")
done
for w in "${workers[@]}"; do wait_for "$w/health"; done
kv_model=()
[ "$policy" = kv_aware ] && kv_model=(--kv-event-model "$out/model")
vllm-router --port 8500 --worker-urls "${workers[@]}" --policy "$policy" "${sources[@]}" \
    "${kv_model[@]}" > "$out/router.log" 2>&1 &
pids+=($!)
wait_for http://127.0.0.1:8500/health
echo "$replicas replicas behind vllm-router ($policy); measuring ..."

# Both runs record the scenario as run: the served model, this many replicas, this router.
same=(--set "cluster.replicas=$replicas" --set "cluster.router=\"$sim_router\""
    --set "server.model=\"$out/model\"")
# The router's /metrics is one replica's: counters and KV usage come from every replica.
"$engine" bench --server http://127.0.0.1:8500 --scenario "$scenario" "${same[@]}" \
    --model "$out/model" --tokenizer "$out/model" --metrics-from "${workers[@]}" \
    --out "$out/measured" --no-progress | tee "$out/measured.txt"
"$sim" run "$scenario" --out "$out/predicted" "${same[@]}" \
    --set 'sim.cost_model="profiled"' --set "sim.profile=\"$out/profile.json\"" \
    | tee "$out/predicted.txt"
"$sim" report "$out/predicted" "$out/measured" --baseline "$out/predicted" --out "$out/report"
echo "cluster run: $out (report: $out/report/report.md)"
