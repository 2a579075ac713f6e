#!/usr/bin/env bash
# Requests through the routers users put in front of replicas: two `engine serve` replicas
# behind vllm-router, then behind sglang-router (both re-serialise each body with their own
# defaults written out, which the server must take as the client's request). Runs the
# prefix-sharing load (scripts/prefix_load.py: 48 completions) and one chat completion
# through each, and prints what came back.
#
#   ROUTERS_BIN=/path/to/venv/bin bash scripts/router_compat_check.sh
#       (pip install vllm-router sglang-router into that venv; release binaries built)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${ROUTERS_BIN:-$(dirname "$(command -v vllm-router)")}
engine=target/release/engine
pids=()
cleanup() { kill "${pids[@]}" 2> /dev/null || true; wait 2> /dev/null || true; }
trap cleanup EXIT
for i in 0 1; do
  $engine serve --port 840$i > /tmp/router-check-replica$i.log 2>&1 &
  pids+=($!)
done
for i in 0 1; do until curl -sf http://127.0.0.1:840$i/health > /dev/null; do sleep 0.5; done; done
workers=(http://127.0.0.1:8400 http://127.0.0.1:8401)
for router in vllm-router sglang-router; do
  if [ "$router" = vllm-router ]; then
    "$bin/vllm-router" --port 8500 --worker-urls "${workers[@]}" --policy round_robin \
      > /tmp/router-check-$router.log 2>&1 &
  else
    "$bin/sglang-router" launch --port 8500 --worker-urls "${workers[@]}" --policy round_robin \
      > /tmp/router-check-$router.log 2>&1 &
  fi
  rpid=$!
  until curl -sf http://127.0.0.1:8500/v1/models > /dev/null 2>&1; do
    kill -0 $rpid 2> /dev/null || { cat /tmp/router-check-$router.log; exit 1; }
    sleep 0.5
  done
  echo "== $router"
  python3 scripts/prefix_load.py http://127.0.0.1:8500
  curl -s http://127.0.0.1:8500/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "builtin:tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}' \
    | python3 -c 'import json, sys; r = json.load(sys.stdin); print("chat:", r.get("error") or (r["choices"][0]["finish_reason"], r["usage"]))'
  kill $rpid; wait $rpid 2> /dev/null || true
done
