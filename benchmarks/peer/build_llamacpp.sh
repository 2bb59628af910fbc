#!/usr/bin/env bash
# Build the llama.cpp peer for benchmarks/bench_llamacpp.py: the llama.cpp that the llama-cpp-python
# 0.3.36 source package vendors (it carries DeepSeek-V4 support: src/models/deepseek4.cpp,
# conversion/deepseek.py), CPU backend only, Release, native CPU flags, no GPU, no curl/OpenSSL.
# Then the benchmark's driver (benchmarks/peer/llama_driver.c) is compiled against that libllama.
#
# Nothing built here is committed: the sdist, its sources and the build live under --workdir
# (default benchmarks/.peer, ignored by git).
#
# Usage: benchmarks/peer/build_llamacpp.sh [--workdir DIR] [--sdist PATH] [--jobs N]
#   --sdist PATH   use an already downloaded llama_cpp_python-0.3.36.tar.gz instead of pip download
#   --jobs N       parallel compile jobs (default 2; the build runs under `nice`)
# Needs: cmake >= 3.14, a C/C++ compiler, pip (only when --sdist is not given).
set -euo pipefail

VERSION=0.3.36
# sha256 of llama_cpp_python-0.3.36.tar.gz as published on PyPI: the vendored llama.cpp is pinned by it.
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORKDIR="$HERE/../.peer"
SDIST=""
JOBS=2
PYTHON="${PYTHON:-python3}"

while [[ $# -gt 0 ]]; do
    case "$1" in
        --workdir) WORKDIR="$2"; shift 2 ;;
        --sdist) SDIST="$2"; shift 2 ;;
        --jobs) JOBS="$2"; shift 2 ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "build_llamacpp.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done

mkdir -p "$WORKDIR"
WORKDIR="$(cd "$WORKDIR" && pwd)"
NAME="llama_cpp_python-$VERSION"
if [[ -z "$SDIST" ]]; then
    SDIST="$WORKDIR/$NAME.tar.gz"
    if [[ ! -f "$SDIST" ]]; then
        "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORKDIR"
    fi
fi
echo "$SDIST_SHA256  $SDIST" | sha256sum --check --quiet \
    || { echo "build_llamacpp.sh: $SDIST is not the published llama-cpp-python $VERSION sdist (sha256)" >&2; exit 1; }

SRC="$WORKDIR/$NAME/vendor/llama.cpp"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    tar -xzf "$SDIST" -C "$WORKDIR"
fi

BUILD="$WORKDIR/build"
# GGML_NATIVE: -march=native, as a user building llama.cpp on this machine gets by default.
# Shared libraries so the driver links libllama the way llama-cpp-python does.
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
    -DBUILD_SHARED_LIBS=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF
# llama-bench: llama.cpp's own decode/prefill timer, a cross-check of the driver's numbers.
nice cmake --build "$BUILD" --config Release -j "$JOBS" --target llama llama-bench

cc -O2 -std=c11 -Wall -Wextra -o "$BUILD/bin/llama_driver" "$HERE/llama_driver.c" \
    -I"$SRC/include" -I"$SRC/ggml/include" -L"$BUILD/bin" -lllama -lggml -lggml-base -lm \
    -Wl,-rpath,"$BUILD/bin"
echo "peer built: $BUILD/bin (llama_driver, llama-bench); converter: $SRC/conversion, gguf-py: $SRC/gguf-py"
