#!/usr/bin/env bash
# The GPU check, run on a GPU machine from the folder scripts/gpu-pack.sh made (no Rust, no
# network needed). Prints `name: value unit` lines and writes its log and reports under
# $OUT (default gpu-pack/out):
#   1. every CUDA kernel against its CPU reference (relative error <= 1e-2 in bf16);
#   2. GPU-vs-CPU logits parity for generated Llama, Qwen2, Qwen3, Mistral, Gemma 3 and Phi-3 models, mixed steps
#      and CUDA-graph replays; the runner against Hugging Face transformers on the same
#      safetensors (oracle); compute-sanitizer memcheck over a served run with graphs;
#   3. decode steps at batch 1/8/32/64 and contexts 512/2,048/4,096, eager and graphed,
#      greedy and top-p, on 32k- and 128k-vocabulary models: ms, tok/s, and the bytes a step
#      must read over a read-only kernel's bandwidth; prefill tok/s at 512 and 2,048 tokens
#      (gpu_bench);
#   4. kernel figures (kernel_bench), then peers on the same GPU at the same shapes and
#      infer / peer per figure (peers: scripts/gpu_peers.py; llama_cpp: llama.cpp built here
#      with CUDA, minutes of compiling, on the same weights);
#   5. the engine on the GPU with a generated ~1B Llama (Llama-3.2-1B's shape, random
#      weights): `engine generate` eager and with graphs, `engine serve
#      --gpu-memory-utilization` driven by `engine bench`, `engine profile`, then
#      `engine verify` on the five seed workloads in the Phase 8 configuration, whose
#      fidelity table is copied to $OUT/fidelity-gpu.md.
#   6. the benchmark log's phase table (P4-P9) measured on the GPU with the same model.
# QUICK=1 stops after step 4 (the engine steps take several minutes); ONLY="a b" runs only the
# steps named (nvrtc_compile gpu_kernels gpu_parity oracle oracle_fp8 served_oracle memcheck gpu_bench kernel_bench
# peers llama_cpp generate generate_graphs serve_bench profile verify phase_table). The correctness check
# first, on its own: ONLY="nvrtc_compile gpu_kernels gpu_parity oracle memcheck".
# Steps run in order and the script goes on after a failure, so one run shows everything.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
out="${OUT:-$here/out}"
# python3's tarfile, not tar: a GPU machine may lack xz.
untar() { python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$@"; }
# The binaries travel xz-compressed (a quarter of their size: the carry limit is 64 MiB).
[ -d "$bin" ] || untar "$here/bin.tar.xz" "$here" || exit 1
mkdir -p "$out"
export INFER_CACHE="${INFER_CACHE:-$out/cache}"
status=0
# Whether a selected step runs the generated ~1B model (made once, by the make_model step).
needs_model() {
    local s
    for s in generate generate_graphs serve_bench profile verify phase_table; do
        [[ " ${ONLY:-$s} " == *" $s "* ]] && return 0
    done
    return 1
}
step() { # name command...
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $1 "* ]] && ! { [ "$1" = make_model ] && needs_model; }; then
        return 0
    fi
    echo "=== $1" | tee -a "$out/check.log"
    shift
    if ! "$@" 2>&1 | tee -a "$out/check.log"; then
        echo "FAILED: $*" | tee -a "$out/check.log"
        status=1
    fi
}

# wait_port PORT PID LOG: until a server (PID, logging to LOG) listens on PORT; its log's
# tail and 1 when it dies first. The port opens once the model is loaded and the pool made.
wait_port() {
    for _ in $(seq 300); do
        (echo >/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0
        kill -0 "$2" 2>/dev/null || { tail -30 "$3"; return 1; }
        sleep 1
    done
    echo "nothing listens on port $1 after 300 s"; return 1
}

# stop_server PID [SECONDS] [TARGET]: SIGINT to TARGET (default PID; under a sanitizer, the
# server it runs), then at most SECONDS (default 60) for PID to exit; past that, the server's
# threads are shown (state, kernel wait channel, and stacks through gdb or cuda-gdb: the GPU
# machines have only the latter) and both are killed, so a hung exit cannot take the steps
# after it. PID's exit status.
stop_server() {
    local pid=$1 secs=${2:-60} target=${3:-$1} gdb t
    kill -INT "$target" 2>/dev/null
    for _ in $(seq "$secs"); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
        echo "server $target: no exit $secs s after SIGINT; its threads (name, state, kernel wait):"
        for t in /proc/"$target"/task/*; do
            echo "  $(cat "$t/comm") $(awk '{print $3}' "$t/stat") $(cat "$t/wchan" 2>/dev/null)"
        done
        gdb="$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null)"
        [ -n "$gdb" ] && timeout 60 "$gdb" -batch -ex "thread apply all bt 12" -p "$target" \
            2>/dev/null | grep -E "^Thread|^#" | head -150
        kill -9 "$target" "$pid" 2>/dev/null
    fi
    wait "$pid"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# NVRTC from the toolkit (nvcc's), or from PyTorch's wheel when that is all there is.
if [ -z "${INFER_NVRTC_LIB:-}" ]; then
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
        $(python3 -c 'import nvidia.cuda_nvrtc, os; print(os.path.dirname(nvidia.cuda_nvrtc.__file__) + "/lib")' 2>/dev/null); do
        if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then export INFER_NVRTC_LIB="$d"; break; fi
    done
fi
# cuBLAS likewise.
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__) + "/lib")' 2>/dev/null); do
    if ls "$d"/libcublas.so* >/dev/null 2>&1; then export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; break; fi
done
echo "NVRTC: ${INFER_NVRTC_LIB:-system path}" | tee -a "$out/check.log"

step nvrtc_compile "$bin/nvrtc_compile" --nocapture
# Tests in parallel (one thread each): their CPU references at 2,048-token prompts and
# 8,000-token contexts took 200 s of an H200's 15 minutes one at a time.
step gpu_kernels "$bin/gpu_kernels" --ignored --nocapture
step gpu_parity "$bin/gpu_parity" --ignored --nocapture --test-threads 1
# The runner against Hugging Face transformers (f32, on the GPU) on the same safetensors, for
# the three architectures at 32 query heads: prompts of 128 / 1,024 / 4,096 tokens, batch
# 1 / 8 / 32, 64 teacher-forced decodes, eager and graphed (scripts/oracle_check.py).
oracle_model() { # arch: the model's folder, made once
    local dir="$INFER_CACHE/oracle-$1"
    [ -f "$dir/model.safetensors" ] || "$bin/engine" make-model --arch "$1" --layers 4 \
        --hidden 2048 --heads 32 --kv-heads 8 --head-dim 64 --intermediate 8192 \
        --vocab 32768 --max-pos 8192 --sliding-window 1024 --dtype bf16 --out "$dir" >&2 || return 1
    echo "$dir"
}
oracle() {
    local arch dir rc=0
    for arch in llama qwen3 gemma3; do
        dir="$(oracle_model "$arch")" || return 1
        python3 "$here/oracle_check.py" --model "$dir" --runner "$bin/oracle_run" --device cuda \
            --torch-device cuda --cuda-graphs --prompt-lens 128,1024,4096 --batches 1,8,32 \
            --decode 64 --label "$arch (4 layers, 32 heads)" --out "$out/oracle" || rc=1
    done
    return $rc
}
step oracle oracle
# The fp8 KV cache against the same oracle: lossy by design, so judged by how far it moves the
# distribution (mean KL per case at most 0.01 nats; the CPU's fp8 cache measured 0.9-1.3e-3 on
# the 0.5B model) rather than by greedy flips, which are reported. Graphs on, Llama only.
oracle_fp8() {
    local dir
    dir="$(oracle_model llama)" || return 1
    python3 "$here/oracle_check.py" --model "$dir" --runner "$bin/oracle_run" --device cuda \
        --torch-device cuda --cuda-graphs --prompt-lens 128,1024,4096 --batches 1,8 \
        --decode 64 --kv-cache-dtype fp8 --tol inf --max-mean-kl 0.01 \
        --label "llama (4 layers, 32 heads)" --out "$out/oracle"
}
step oracle_fp8 oracle_fp8
# The served path against the same oracle (scripts/served_oracle.py): 48 concurrent greedy
# requests of 128 / 1,024 / 4,096 prompt tokens, a third sharing long prefixes, into a pool of
# 16,384 tokens (so prefix hits and preemptions both happen, and must), eager and with graphs
# and device sampling; each position's token and top-5 logprobs against transformers. For
# Llama also unchunked without a token budget, graphs and device sampling on: steps of
# several whole prompts past the memory plan's 8,192 tokens run as several forward passes.
served_oracle() {
    local arch dir mode pid rc=0
    for arch in ${SERVED_ARCHS:-llama qwen3 gemma3}; do
        dir="$(oracle_model "$arch")" || return 1
        local modes="eager graphs"
        [ "$arch" = llama ] && modes+=" unchunked"
        for mode in $modes; do
            local flags=() require=(--require-prefix-hits --require-preemption)
            [ "$mode" = graphs ] && flags=(--cuda-graphs --device-sampling)
            [ "$mode" = unchunked ] && flags=(--cuda-graphs --device-sampling --chunked-prefill=false) \
                && require=(--require-prefix-hits)
            "$bin/engine" serve --device cuda --model "$dir" --num-gpu-blocks 1024 \
                --max-model-len 8192 --port 8767 "${flags[@]}" >"$out/served-$arch-$mode.log" 2>&1 &
            pid=$!
            wait_port 8767 $pid "$out/served-$arch-$mode.log" || { rc=1; continue; }
            python3 "$here/served_oracle.py" --server http://127.0.0.1:8767 --model "$dir" \
                --torch-device cuda --prompt-lens 128,1024,4096 --requests 48 --decode 32 \
                "${require[@]}" \
                --label "$arch (4 layers, 32 heads), $mode" --out "$out/oracle" || rc=1
            stop_server $pid
        done
    done
    return $rc
}
step served_oracle served_oracle
# compute-sanitizer's memcheck over a short served run with graphs (the served path: memory
# plan, live pool, graph capture and replay, preemption-free short load).
memcheck() {
    local sanitizer dir pid rc
    sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)"
    [ -n "$sanitizer" ] || { echo "compute-sanitizer not found"; return 1; }
    dir="$(oracle_model llama)" || return 1
    "$sanitizer" --tool memcheck --leak-check no --error-exitcode 9 "$bin/engine" serve \
        --device cuda --cuda-graphs --device-sampling --model "$dir" --max-model-len 2048 --port 8766 \
        >"$out/memcheck-serve.log" 2>&1 &
    pid=$!
    wait_port 8766 $pid "$out/memcheck-serve.log" || return 1
    "$bin/engine" bench --server http://127.0.0.1:8766 --scenario "$here/scenarios/chunked_prefill.toml" \
        --set workload.num_requests=24 --no-progress --out "$out/memcheck-bench" | tail -5
    # The server is stopped, not the sanitizer: signalled itself, the sanitizer leaves
    # without its summary, and a run without "0 errors" proves nothing.
    # Its exit is bounded: twice on an H200 the sanitizer's run did not end within minutes of
    # the server's "shutting down".
    stop_server $pid 90 "$(pgrep -P $pid || echo $pid)"; rc=$?
    tail -4 "$out/memcheck-serve.log"
    grep -E "ERROR SUMMARY|Invalid|out of bounds" "$out/memcheck-serve.log" | head -20
    grep -q "ERROR SUMMARY: 0 errors" "$out/memcheck-serve.log" || rc=1
    return $rc
}
step memcheck memcheck
step gpu_bench "$bin/gpu_bench"
step kernel_bench "$bin/kernel_bench"
# Peers on this GPU at the same shapes: PyTorch's flash SDPA at kernel_bench's prefill shapes,
# transformers' decode on gpu_bench's model (PEERS_COMPILE=1 adds torch.compile with a static
# cache: minutes of compiling); then infer / peer per figure from the three logs.
# bench_model VOCAB: gpu_bench's model of that vocabulary (32768 or 128256), made once where
# gpu_bench makes it; prints its folder.
bench_model() {
    local model="$INFER_CACHE/bench-llama-1b-bf16-v1"
    [ "$1" = 128256 ] && model="$INFER_CACHE/bench-llama-1b-v128k-bf16-v1"
    [ -f "$model/model.safetensors" ] || "$bin/engine" make-model --arch llama --layers 16 \
        --hidden 2048 --heads 32 --kv-heads 8 --head-dim 64 --intermediate 8192 \
        --vocab "$1" --max-pos 8192 --dtype bf16 --out "$model" >&2 || return 1
    echo "$model"
}
peers() {
    local model
    model="$(bench_model 32768)" || return 1
    python3 "$here/gpu_peers.py" measure "$model" ${PEERS_COMPILE:+--compile} \
        | tee "$out/peers.log" || return 1
    peer_table
}
# infer / peer for every figure the logs so far hold (this run's and earlier ones' in $OUT).
peer_table() {
    awk '/^=== (gpu_bench|kernel_bench)$/{keep=1; next} /^=== /{keep=0} keep' "$out/check.log" \
        > "$out/infer-bench.log"
    python3 "$here/gpu_peers.py" table "$out/infer-bench.log" "$out/peers.log" \
        "$out/llama-cpp.log" | tee "$out/peers.md"
}
step peers peers
# llama.cpp with CUDA, built here from the trimmed source scripts/gpu-pack.sh packed (for this
# GPU's architecture only; the build stays in LLAMA_CPP_BUILD for the next call on a warm
# machine), on gpu_bench's two models converted to bf16 GGUFs by llama.cpp's converter.
llama_cpp() {
    local build=${LLAMA_CPP_BUILD:-$here/../target/llama-cpp-build} arch
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
    [ -d "$build/llama.cpp" ] || { mkdir -p "$build" && untar "$here/llama.cpp.tar.xz" "$build"; } \
        || return 1
    # Binaries built off this machine (scripts/llama_cpp_source.sh cuda-build: the same source,
    # CUDA 13.0, one architecture) save minutes of nvcc here, when they are for this GPU and run.
    local prebuilt="$here/llama-cpp-cuda-sm$arch.tar.xz"
    if [ ! -x "$build/bin/llama-batched-bench" ] && [ -f "$prebuilt" ]; then
        untar "$prebuilt" "$build" || return 1
        if ! "$build/bin/llama-bench" --list-devices 2>&1 | grep -q CUDA0; then
            "$build/bin/llama-bench" --list-devices 2>&1 | tail -5
            echo "the prebuilt llama.cpp does not run here: building it"
            rm -rf "$build/bin"
        else
            echo "llama.cpp: prebuilt for sm_$arch ($(cat "$build/bin/BUILD" 2>/dev/null))"
        fi
    fi
    if [ ! -x "$build/bin/llama-batched-bench" ]; then
        cmake -S "$build/llama.cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
            -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
            -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$out/llama-cpp-build.log" 2>&1 \
            && cmake --build "$build" -j "$(nproc)" --target llama-bench llama-batched-bench \
                >> "$out/llama-cpp-build.log" 2>&1 || { tail -30 "$out/llama-cpp-build.log"; return 1; }
    fi
    : > "$out/llama-cpp.log"
    local vocab model gguf prefill=--prefill
    for vocab in 32768 128256; do
        model="$(bench_model "$vocab")" || return 1
        gguf="$build/$(basename "$model").gguf"
        [ -f "$gguf" ] || python3 "$here/to_gguf.py" "$build/llama.cpp" "$model" "$gguf" \
            > "$out/to-gguf-$vocab.log" 2>&1 || { tail -20 "$out/to-gguf-$vocab.log"; return 1; }
        python3 "$here/gpu_peers.py" llama "$build/bin" "$gguf" --vocab "$vocab" $prefill \
            | tee -a "$out/llama-cpp.log" || return 1
        prefill=
    done
    peer_table
}
step llama_cpp llama_cpp

if [ "${QUICK:-0}" != 1 ]; then
    engine="$bin/engine"
    model="$INFER_CACHE/llama-1b-bf16"
    [ -f "$model/model.safetensors" ] || step make_model "$engine" make-model --arch llama \
        --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --head-dim 64 --intermediate 8192 \
        --vocab 32768 --max-pos 4096 --dtype bf16 --out "$model"
    step generate "$engine" generate --device cuda --model "$model" --prompt "The GPU check" \
        --max-tokens 64 --ignore-eos
    step generate_graphs "$engine" generate --device cuda --cuda-graphs --model "$model" \
        --prompt "The GPU check" --max-tokens 64 --ignore-eos
    serve_and_bench() {
        "$engine" serve --device cuda --cuda-graphs --device-sampling \
            --gpu-memory-utilization 0.85 --model "$model" --port 8765 \
            --step-log "$out/serve-steps.csv" >"$out/serve.log" 2>&1 &
        local pid=$!
        wait_port 8765 $pid "$out/serve.log" || return 1
        head -5 "$out/serve.log"
        "$engine" bench --server http://localhost:8765 \
            --scenario "$here/scenarios/chunked_prefill.toml" --no-progress --out "$out/bench-serve"
        local rc=$?
        # Constrained rows beside free ones, the grammars' masks applied on the GPU.
        python3 "$here/structured_smoke.py" http://localhost:8765 || rc=1
        stop_server $pid
        # The host's share of each step: what overlapping it with the GPU could save.
        python3 "$here/step_log_host.py" "$out/serve-steps.csv" 5 || true
        return $rc
    }
    step serve_bench serve_and_bench
    step profile "$engine" profile --device cuda --model "$model" --out "$out/profile-gpu.json"
    seeds=()
    for s in baseline continuous_batching paged_attention chunked_prefill prefix_caching; do
        seeds+=("$here/scenarios/$s.toml")
    done
    step verify "$engine" verify "${seeds[@]}" --device cuda --model "$model" \
        --profile "$out/profile-gpu.json" --out "$out/verify"
    if [ -f "$out/verify/fidelity.md" ]; then
        cp "$out/verify/fidelity.md" "$out/fidelity-gpu.md"
        # Every run directory in one file (the step logs show where predictions miss).
        tar -czf "$out/verify.tgz" -C "$out" verify && rm -rf "$out/verify"
    fi
    step phase_table "$bin/phase_table" --device cuda --model "$model" --out "$out/phase-table"
    [ -d "$out/phase-table" ] && tar -czf "$out/phase-table.tgz" -C "$out" phase-table \
        && rm -rf "$out/phase-table"
fi

echo "log and reports in $out"
exit $status
