#!/usr/bin/env bash
# Build everything the GPU check needs into gpu-pack/ (git-ignored), on a machine with Rust
# (no GPU or CUDA toolkit needed): the engine with the CUDA backend, the kernel and parity
# test binaries, the GPU benchmark, the seed scenarios, gpu-check.sh and llama.cpp's source.
# The GPU machines here have a driver, nvcc and PyTorch but no Rust toolchain and no network,
# so the check runs from this folder alone:
#   scripts/gpu-pack.sh                        # here
#   (on the GPU machine, folder carried over)  bash gpu-pack/gpu-check.sh
# or, through the device tool (one time-boxed call, logs packed): bash gpu-pack/gpu-device-run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-pack
rm -rf "$out" && mkdir -p "$out/bin"

cargo build --release -p infer-engine --features cuda --bin engine --example gpu_bench \
    --example phase_table --example oracle_run
cp target/release/engine target/release/examples/{gpu_bench,phase_table,oracle_run} "$out/bin/"
cargo build --release -p infer-kernels --features cuda --example kernel_bench
cp target/release/examples/kernel_bench "$out/bin/"

# Test binaries: cargo prints their paths as JSON; keep the ones the check runs.
test_bin() { # package test-name
    cargo test --release -p "$1" --features cuda --test "$2" --no-run --message-format=json \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$2"
}
cp "$(test_bin infer-kernels gpu_kernels)" "$out/bin/gpu_kernels"
cp "$(test_bin infer-kernels nvrtc_compile)" "$out/bin/nvrtc_compile"
cp "$(test_bin infer-engine gpu_parity)" "$out/bin/gpu_parity"
strip "$out"/bin/*
# xz-compressed (64 MB -> 16 MB): gpu-check.sh unpacks it where it runs.
tar cf - -C "$out" bin | xz -T0 -6 > "$out/bin.tar.xz"
rm -rf "$out/bin"

cp -r scenarios "$out/"
cp scripts/gpu-check.sh scripts/gpu-device-run.sh scripts/oracle_check.py scripts/served_oracle.py \
    scripts/gpu_peers.py scripts/step_log_host.py scripts/structured_smoke.py \
    scripts/to_gguf.py "$out/"
# llama.cpp's source, trimmed to what its CUDA benchmarks and converter need (~2 MB).
scripts/llama_cpp_source.sh pack "$out/llama.cpp.tar.xz"
# Its CUDA tools built here for Hopper (H100, H200), if made once with
#   scripts/llama_cpp_source.sh cuda-build 90 ~/.cache/infer/foreign/llama-cpp-cuda-sm90.tar.xz
# (tens of minutes; gpu-check.sh builds there when this is absent or does not run).
prebuilt=${FOREIGN:-$HOME/.cache/infer/foreign}/llama-cpp-cuda-sm90.tar.xz
[ -f "$prebuilt" ] && cp "$prebuilt" "$out/"
du -sh "$out"
echo "packed $out: run 'bash $out/gpu-check.sh' on the GPU machine"
