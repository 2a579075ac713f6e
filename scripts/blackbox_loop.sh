#!/usr/bin/env bash
# The black-box predict -> verify loop on this machine, as a user would run it against a
# server that is not theirs: probe the server (`engine probe`), fit a calibration to the
# probes (`sim calibrate`, no profile: the mechanisms and the main coefficients, then the
# step jitter and the decode's costs as a second stage; it also prints which KV layout the
# probes support, paged blocks or slots, beside the one SERVER gives), predict the five seed workloads
# with it (`sim run`) and measure them (`engine bench`, REPEATS times: default 2), then print
# both side by side with the repeats' spread (`scripts/blackbox_compare.py`).
#
#   [SERVER=infer|llama.cpp|transformers] scripts/blackbox_loop.sh [MODEL_DIR] [OUT_DIR]
#
# MODEL_DIR: a Hugging Face model directory (default: the 0.5B Llama that
# `cargo run --release -p infer-engine --example runner_bench` generates). Needs the
# release binaries (`cargo build --release -p infer-engine -p infer-sim`).
#
# SERVER picks the server measured, each with the configuration it is started with said
# once more for the simulator (what a user knows of their own server):
# - infer (default): `engine serve`; its step log ($OUT/steps.csv) is kept for a
#   step-by-step check (`cargo run --release -p infer-engine --example step_check`);
# - llama.cpp: `llama-server` ($LLAMA_SERVER) on the GGUF of the same weights ($GGUF), 16
#   slots of 4,096 tokens, logical batch 2,048, micro-batch 512;
# - transformers: `transformers serve --continuous-batching` on the model directory, through
#   scripts/transformers_step_log.py: each server start's steps in $OUT/steps/STAGE.csv.
# `scripts/foreign_servers.sh` installs the two foreign servers and writes the GGUF.
set -euo pipefail
MODEL=${1:-${INFER_CACHE:-$HOME/.cache/infer}/bench-llama-0.5b-v1}
OUT=${2:-runs/blackbox-$(date +%s)}
SERVER=${SERVER:-infer}
PORT=${PORT:-8397}
REQUESTS=${REQUESTS:-16}
BIN=target/release
URL="http://127.0.0.1:$PORT"
FOREIGN=${FOREIGN:-$HOME/.cache/infer/foreign}
mkdir -p "$OUT"

# Per server: how it starts, how its prefix cache is emptied before each measured workload
# (the simulator starts each one from an empty cache; the workloads share seed 42, so
# without it a workload or repeat finds the prompts of the one before cached), and the same
# configuration for the simulator (SERVER_SET) and for `sim calibrate` (CALIBRATE_SET).
NAME=()
# CLIENT: more flags for `engine probe` and `engine bench`, per server.
CLIENT=()
# FIT_MORE: coefficients the second stage fits beside its own (below), per server.
FIT_MORE=""
case $SERVER in
  infer)
    start_server() {
      "$BIN/engine" serve --model "$MODEL" --port "$PORT" --max-batch-size 16 \
        --num-gpu-blocks 2048 --block-size 16 --prefill-chunk-size 512 --max-model-len 4096 \
        --dtype bf16 --step-log "$OUT/steps.csv" >> "$OUT/serve.log" 2>&1 &
      SERVER_PID=$!
    }
    reset_cache() { curl -sf -X POST "$URL/reset_prefix_cache" > /dev/null; }
    SERVER_SET=(--set server.max_batch_size=16 --set server.num_gpu_blocks=2048
      --set server.block_size=16 --set server.prefill_chunk_size=512
      --set server.max_model_len=4096 --set server.chunked_prefill=true
      --set server.prefix_caching=true)
    # The prompt batching is given — a fact about the server's kind, as its model is:
    # infer, like vLLM, SGLang and TGI, packs prompts with the decodes, each sequence's
    # queries against its own keys — and the other mechanisms searched (searched too,
    # noisy probes picked padded prompts in two measurements of five).
    CALIBRATE_SET=(--prefill-batching packed --packed-attention ragged)
    ;;
  llama.cpp)
    LLAMA_SERVER=${LLAMA_SERVER:-$FOREIGN/llama-server}
    GGUF=${GGUF:-$FOREIGN/$(basename "$MODEL")-bf16.gguf}
    # The host-RAM prompt cache (--cache-ram) is off so that a slot's prompt lives only in
    # the slot. Each probe and workload starts on a fresh server, as the simulator's does:
    # a slot erased through the API keeps its place in the server's least-recently-used
    # order, and that order decides which decodes share a micro-batch (below).
    start_server() {
      "$LLAMA_SERVER" -m "$GGUF" --port "$PORT" -np 16 -c 65536 -b 2048 -ub 512 -t 2 \
        --cache-ram 0 >> "$OUT/serve.log" 2>&1 &
      SERVER_PID=$!
    }
    reset_cache() {
      kill "$SERVER_PID"; wait "$SERVER_PID" 2> /dev/null || true
      start_server; wait_ready
    }
    # llama.cpp's server as the core describes it: one 4,096-token slot per sequence (-c
    # 65536 over -np 16) with per-slot prompt reuse, and every step's tokens up to the
    # logical batch (-b 2048), decodes first, run as micro-batches of -ub 512 tokens. With a
    # KV stream per slot a micro-batch holds only sequences in consecutive slots: decodes in
    # slots 0, 4, 8 and 12 run as four passes (scripts/llama_slot_passes.py).
    SERVER_SET=(--set server.max_batch_size=16 --set server.kv_cache_backend=contiguous
      --set server.num_gpu_blocks=4096 --set server.block_size=16
      --set server.max_model_len=4096 --set server.chunked_prefill=true
      --set server.prefill_chunk_size=2048 --set server.prefix_caching=true)
    # Its CPU flash attention skips every key the mask hides (`ggml_compute_forward_flash_
    # attn_ext_f16_one_chunk`: `mv == -INFINITY`), so a decode computes over its own keys
    # however far its pass's key count is padded: ragged decodes, not searched (the probes'
    # equal lengths hardly tell them apart, and chose padded in runs/bb-llama-5).
    CALIBRATE_SET=(--prefill-batching packed --micro-batch-tokens 512 --micro-batches slot-runs
      --contiguous-decode ragged)
    # Its CPU backend decodes one sequence by matrix-vector products, far faster than the
    # line through larger batches (probes: 55-66 ms at one sequence, 134-159 at four,
    # 173-196 at sixteen): that decode's own bandwidth, with the per-sequence and matmul
    # costs that the first stage had bent to the single stream, fitted again beside it.
    FIT_MORE=",single_decode_bandwidth_efficiency,per_seq_overhead_s,compute_efficiency"
    # It streams nothing while the text ends mid-character, and the random-weight model
    # generates runs of partial-character tokens: one request's first chunk came 44 s after
    # its first token (runs/bb-llama-2, paged_attention). Those tokens are banned.
    CLIENT=(--whole-characters)
    ;;
  transformers)
    # Its stream sends nothing for an id its tokenizer lacks, and a generated model's
    # tokenizer has 3,043 entries for 32,768 ids: served with every id whole text
    # (scripts/whole_vocab.py: the weights linked, the tokenizer filled).
    python3 scripts/whole_vocab.py "$MODEL" "$OUT/model"
    MODEL=$OUT/model
    # Its defaults: 256-token pages, 8,192 batch tokens; the pool sized here (64 pages,
    # 16,384 tokens) rather than from free memory. Its scheduler's steps are logged, one
    # file per start (STAGE: what the start is for).
    mkdir -p "$OUT/steps"
    start_server() {
      TRANSFORMERS_STEP_LOG="$OUT/steps/${STAGE:-start}.csv" python3 \
        scripts/transformers_step_log.py serve "$MODEL" --continuous-batching --device cpu \
        --port "$PORT" --cb-block-size 256 --cb-num-blocks 64 --cb-max-batch-tokens 8192 \
        >> "$OUT/serve.log" 2>&1 &
      SERVER_PID=$!
    }
    # No endpoint empties its prefix cache: the server is started again.
    reset_cache() {
      kill "$SERVER_PID"; wait "$SERVER_PID" 2> /dev/null || true
      start_server; wait_ready
    }
    # Its FIFO scheduler: prompts join a step only while 15% of the pool is free (else one
    # alone), a prompt that does not fit passed over; an evicted request recomputes. A
    # step reads at most the pool's 16,384 tokens of context, shared prefixes once per
    # reader: without flash attention its keys go through an index of the pool's size. Its
    # weights and KV in the model's own f32 (the config's torch_dtype).
    SERVER_SET=(--set server.max_batch_size=1024 --set server.num_gpu_blocks=64
      --set server.block_size=256 --set server.max_model_len=4096
      --set server.chunked_prefill=true --set server.prefill_chunk_size=8192
      --set server.prefix_caching=true --set server.kv_admission=free_margin
      --set server.kv_watermark=0.15 --set server.max_step_read_tokens=16384
      --set workload.ignore_eos=false --set sim.dtype=f32)
    # Its sdpa attention on a CPU runs PyTorch's fused kernel (no score matrix kept: the
    # materialised one planned 21-217 GiB of activations and failed a prediction,
    # runs/bb-tf-2). With a mask and grouped-query heads it repeats a pass's keys and
    # values for every query head, buffers that past 32 MiB glibc maps afresh every time:
    # the page faults' cost is fitted beside the decode's.
    CALIBRATE_SET=(--prefill-batching packed --attention-scores fused)
    FIT_MORE=",page_fault_s_per_gib"
    # Its /v1/models answers 500 for a local directory: the model is named.
    NAME=(--model "$MODEL")
    ;;
  *)
    echo "SERVER must be infer, llama.cpp or transformers, not \`$SERVER'" >&2
    exit 2
    ;;
esac
# SIM_SET: more `--set key=value` words for the simulator's description (e.g. to try
# another reading of the server: SIM_SET="--set server.kv_cache_backend=paged").
read -ra sim_set <<< "${SIM_SET:-}"
SERVER_SET=(--set "server.model=$MODEL" --set server.hardware=cpu-zen4-2c "${SERVER_SET[@]}"
  "${sim_set[@]}")

wait_ready() {
  for _ in $(seq 1 300); do
    curl -sf "$URL/health" > /dev/null && return 0
    sleep 1
  done
  echo "$SERVER: no answer from $URL/health in 300 s (log: $OUT/serve.log)" >&2
  exit 1
}
start_server
trap 'kill $SERVER_PID 2>/dev/null || true' EXIT
wait_ready

# Each probe from an emptied cache, as the simulator replays it: run together, a probe found
# the slots holding the last one's prompts, which share their start (BOS, "Request N:") with
# its own, and llama.cpp computed 1,019 of each 1,024-token decode-long prompt — enough to
# fit two prompts and two decodes in one 2,048-token step where the simulation's 2,050 did
# not (runs/bb-llama-3). The names are engine probe's (engine/src/loadgen/probe.rs).
: > "$OUT/probe.txt"
for probe in single-128 single-512 single-1024 decode-1 decode-4 decode-16 decode-long \
  interference shared-prefix; do
  STAGE=probe-$probe
  reset_cache
  "$BIN/engine" probe --server "$URL" --scenario scenarios/baseline.toml "${SERVER_SET[@]}" \
    "${NAME[@]}" "${CLIENT[@]}" --tokenizer "$MODEL" --only "$probe" --out "$OUT/probe" \
    | tee -a "$OUT/probe.txt"
done
"$BIN/sim" calibrate "$OUT"/probe/*/ --search-mechanisms --search-policies "${CALIBRATE_SET[@]}" \
  --engine "$SERVER on cpu-zen4-2c" --out "$OUT/calibration.toml" | tee "$OUT/calibrate.txt"
# Second stage, under the mechanisms just chosen: the random pause per step that puts a
# single stream's ITL P99 above its P50 (with the step overhead, whose mean it shares), and
# the decode's two costs — the bandwidth that sets a single stream's floor and the decode
# attention that grows with context. Fitted without the bandwidth, the decode attention made
# held-out ITL P50 worse in three measurements of four; with it, the server's own step log
# agrees better (median decode step +13% -> +1%, runs/blackbox-9; docs/results/blackbox-cpu.md).
# Its last step also refits those four on 8 bootstrap resamples of the probes: their spread,
# which the predictions' intervals take (with the fit's errors on the probes).
"$BIN/sim" calibrate "$OUT"/probe/*/ --start "$OUT/calibration.toml" \
  --fit "step_jitter_s,step_overhead_s,bandwidth_efficiency,decode_attention_efficiency$FIT_MORE" \
  --bootstrap 8 --out "$OUT/calibration.toml" | tee -a "$OUT/calibrate.txt"

# Each workload is measured REPEATS times, round-robin (so that the repeats sample the
# machine's state minutes apart), each from an empty prefix cache as its simulation starts
# (the workloads share seed 42: without the reset a workload or repeat finds prompts of the
# one before cached), and predicted once; the prediction is compared with the repeats' mean,
# and the repeats with each other: the measurement's own spread.
REPEATS=${REPEATS:-2}
WORKLOADS=(baseline continuous_batching paged_attention chunked_prefill prefix_caching)
SET=("${SERVER_SET[@]}" --set "workload.num_requests=$REQUESTS")
for r in $(seq 1 "$REPEATS"); do
  dir=measured; [ "$r" -gt 1 ] && dir=measured-$r
  for w in "${WORKLOADS[@]}"; do
    STAGE=$dir-$w
    reset_cache
    "$BIN/engine" bench --server "$URL" --scenario "scenarios/$w.toml" "${SET[@]}" \
      "${NAME[@]}" "${CLIENT[@]}" --tokenizer "$MODEL" --no-progress --out "$OUT/$dir/$w" > /dev/null
  done
done
for w in "${WORKLOADS[@]}"; do
  "$BIN/sim" run "scenarios/$w.toml" "${SET[@]}" \
    --set "sim.calibration=$OUT/calibration.toml" --quiet --out "$OUT/predicted/$w" > /dev/null
done
python3 scripts/blackbox_compare.py "$OUT" "$REPEATS" "${WORKLOADS[@]}" | tee "$OUT/loop.txt"
