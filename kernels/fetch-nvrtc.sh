#!/usr/bin/env bash
# Install NVRTC from PyPI's nvidia-cuda-nvrtc-cu12 wheel into kernels/.cache/nvrtc/ (git-ignored),
# where infer-kernels looks for it (see src/cuda/nvrtc.rs). No CUDA toolkit or GPU needed; this
# is enough to run the NVRTC compile test:
#   kernels/fetch-nvrtc.sh
#   cargo test -p infer-kernels --features cuda --test nvrtc_compile -- --nocapture
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dest="$here/.cache/nvrtc"
python3 -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
    --target "$dest" "nvidia-cuda-nvrtc-cu12>=12.8"
lib="$dest/nvidia/cuda_nvrtc/lib"
ls "$lib"/libnvrtc.so.* >/dev/null
echo "NVRTC installed in $lib (or point INFER_NVRTC_LIB at any libnvrtc.so)"
