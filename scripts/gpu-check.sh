#!/usr/bin/env bash
# The GPU check, run on a GPU machine from the folder scripts/gpu-pack.sh made (no Rust, no
# network needed). Prints `name: value unit` lines and writes its log and reports under
# $OUT (default gpu-pack/out):
#   1. every CUDA kernel against its CPU reference (relative error <= 1e-2 in bf16);
#   2. GPU-vs-CPU logits parity for generated Llama, Qwen3 and Gemma 3 models, mixed steps
#      and CUDA-graph replays;
#   3. decode tok/s at batch 1/8/32 with GB/s and its fraction of the device copy bandwidth,
#      batch-1 ITL eager vs graphs, prefill tok/s at 512 and 2,048 tokens (gpu_bench);
#   4. kernel figures (kernel_bench).
# Not yet here: `engine profile` / `engine verify` with --device cuda (they take no --device
# yet; the GPU-engine issue's note says what is left).
# Steps run in order and the script goes on after a failure, so one run shows everything.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
out="${OUT:-$here/out}"
mkdir -p "$out"
export INFER_CACHE="${INFER_CACHE:-$out/cache}"
status=0
step() { # name command...
    echo "=== $1" | tee -a "$out/check.log"
    shift
    if ! "$@" 2>&1 | tee -a "$out/check.log"; then
        echo "FAILED: $*" | tee -a "$out/check.log"
        status=1
    fi
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
step gpu_kernels "$bin/gpu_kernels" --ignored --nocapture --test-threads 1
step gpu_parity "$bin/gpu_parity" --ignored --nocapture --test-threads 1
step gpu_bench "$bin/gpu_bench"
step kernel_bench "$bin/kernel_bench"

echo "log and reports in $out"
exit $status
