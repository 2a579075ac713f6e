#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU and driver (no toolkit needed), build the
# CUDA feature, compile every kernel through NVRTC, check each kernel against its CPU
# reference on random inputs (relative error <= 1e-2 in bf16), and print the kernel figures
# as `name: value unit` lines (paged-attention decode GB/s at batch 1/8/32, graph replay vs
# eager, ...). The engine's GPU backend (`engine serve --device cuda`) is not built yet, so
# the decode tokens/s and graph ITL of the engine itself are not part of this check.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
bash kernels/fetch-nvrtc.sh
cargo build --release -p infer-engine --features cuda
cargo test --release -p infer-kernels --features cuda --test nvrtc_compile -- --nocapture
cargo test --release -p infer-kernels --features cuda --test gpu_kernels -- --ignored --nocapture
cargo run --release -p infer-kernels --features cuda --example kernel_bench
