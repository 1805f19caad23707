#!/usr/bin/env bash
# Here, before a device call that builds llama.cpp: writes .llama/llama.cpp.tar.xz (ignored by git, carried to the
# device) from the llama.cpp sources vendored in the llama-cpp-python sdist, trimmed to what llama-bench and
# convert_hf_to_gguf.py need (about 2.4 MB): the CPU (x86) and CUDA backends of ggml, llama, common, llama-bench, the
# converter and gguf-py. The device has nvcc, CMake and ninja but no network (benchmarks/engine/llamacpp/build.sh).
#
#   bash benchmarks/engine/llamacpp/source.sh [VERSION]    (default 0.3.36)
set -euo pipefail
VERSION=${1:-0.3.36}
ROOT=$(git rev-parse --show-toplevel)
grep -qx '/.llama/' "$ROOT/.git/info/exclude" || echo '/.llama/' >> "$ROOT/.git/info/exclude"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download --quiet --no-deps --no-binary=:all: "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
mkdir -p "$ROOT/.llama"
tar cJf "$ROOT/.llama/llama.cpp.tar.xz" -C "$SRC" \
    --exclude='ggml/src/ggml-et' --exclude='ggml/src/ggml-metal' --exclude='ggml/src/ggml-hexagon' \
    --exclude='ggml/src/ggml-sycl' --exclude='ggml/src/ggml-vulkan' --exclude='ggml/src/ggml-opencl' \
    --exclude='ggml/src/ggml-cann' --exclude='ggml/src/ggml-openvino' --exclude='ggml/src/ggml-webgpu' \
    --exclude='ggml/src/ggml-virtgpu' --exclude='ggml/src/ggml-zdnn' --exclude='ggml/src/ggml-zendnn' \
    --exclude='ggml/src/ggml-cpu/spacemit' --exclude='ggml/src/ggml-cpu/kleidiai' \
    --exclude='ggml/src/ggml-cpu/arch/arm' --exclude='ggml/src/ggml-cpu/arch/loongarch' \
    --exclude='ggml/src/ggml-cpu/arch/powerpc' --exclude='ggml/src/ggml-cpu/arch/riscv' \
    --exclude='ggml/src/ggml-cpu/arch/s390' --exclude='ggml/src/ggml-cpu/arch/wasm' \
    --exclude='vendor/miniaudio' \
    CMakeLists.txt cmake common include src ggml tools/llama-bench vendor conversion gguf-py convert_hf_to_gguf.py \
    LICENSE licenses
echo "wrote .llama/llama.cpp.tar.xz ($(du -h "$ROOT/.llama/llama.cpp.tar.xz" | cut -f1), llama-cpp-python $VERSION)"
