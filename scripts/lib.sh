# Shared by the scripts that start servers (cluster.sh, bench_transformers.sh, the client
# checks): sourced from the repository root after `cargo build --release`, not run.

engine=$PWD/target/release/engine
sim=$PWD/target/release/sim

# run_dir NAME: a fresh runs/NAME-<unix time>, printed as an absolute path.
run_dir() {
    local dir="runs/$1-$(date +%s)"
    mkdir -p "$dir"
    (cd "$dir" && pwd)
}

# Background processes, stopped on exit: `pids+=($!)` after starting one.
pids=()
stop_all() {
    for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done
    wait 2> /dev/null || true
}
trap stop_all EXIT

# wait_for URL [SECONDS [PID]]: until URL answers with success (default 60 s), else fails
# (which ends a `set -e` script, or runs what follows `||`); at once if process PID (the
# server starting) has exited.
wait_for() {
    local tries=$((${2:-60} * 10))
    for _ in $(seq "$tries"); do
        curl -sf "$1" > /dev/null 2>&1 && return 0
        if [ -n "${3:-}" ] && ! kill -0 "$3" 2> /dev/null; then
            echo "the server (pid $3) exited before $1 answered" >&2
            return 1
        fi
        sleep 0.1
    done
    echo "no answer from $1" >&2
    return 1
}

# served_model PORT: the served model's name and the directory its weights and tokenizer
# came from (`root`), as the server's /v1/models gives them: `read -r NAME DIR < <(…)`.
served_model() {
    curl -s "http://127.0.0.1:$1/v1/models" \
        | python3 -c 'import json,sys; m=json.load(sys.stdin)["data"][0]; print(m["id"], m["root"])'
}

# small_llama DIR: the small Llama the scripts serve (deterministic weights, a real Hugging
# Face directory, ~7 M parameters: steps cost more than the engine's per-step overhead).
small_llama() {
    "$engine" make-model --arch llama --layers 4 --hidden 256 --heads 8 --kv-heads 4 \
        --intermediate 768 --vocab 2048 --max-pos 4096 --out "$1" > /dev/null
}
