#!/usr/bin/env bash
# On the device (the repository root, .llama carried): unpacks .llama/llama.cpp.tar.xz (benchmarks/engine/llamacpp/
# source.sh) and builds llama-bench with CUDA for sm_90 into .llama/build (kept while the machine stays warm), then
# converts a model to GGUF bf16: MODEL (default grown-olmoe-routing) is saved by psr_hf as a transformers checkpoint
# and converted with llama.cpp's convert_hf_to_gguf.py into .llama/MODEL.gguf. Prints the build's time.
set -euo pipefail
MODEL=${MODEL:-grown-olmoe-routing}
SRC=.llama/src
# A later call on the warm machine that does not carry .llama keeps .llama/build but not the sources: they come
# from a copy of the tarball in .gpu (cp .llama/llama.cpp.tar.xz .gpu/ before that call)
TAR=.llama/llama.cpp.tar.xz
[ -f "$TAR" ] || TAR=.gpu/llama.cpp.tar.xz
if [ ! -d "$SRC/conversion" ]; then
    rm -rf "$SRC" && mkdir -p "$SRC" && tar xJf "$TAR" -C "$SRC"
fi
# A build brought back from an earlier call (SAVE_BUILD=1 in gpu_vs_llamacpp.sh: .llama/build_bin.tar.xz.part-*,
# carried in .llama) is unpacked instead of built again
if [ ! -x .llama/build/bin/llama-bench ] && ls .llama/build_bin.tar.xz.part-* > /dev/null 2>&1; then
    cat .llama/build_bin.tar.xz.part-* | tar xJf - -C .llama && echo "llama-bench unpacked from an earlier build"
fi
if [ ! -x .llama/build/bin/llama-bench ]; then
    printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(llama-bench)\n' \
        > "$SRC/tools/CMakeLists.txt"  # llama-bench alone (the trimmed source has no other tool)
    sed -i '/add_subdirectory(miniaudio)/d' "$SRC/vendor/CMakeLists.txt"
    START=$SECONDS
    cmake -S "$SRC" -B .llama/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DGGML_CCACHE=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF > .llama/cmake.log
    cmake --build .llama/build --target llama-bench -j "$(nproc)" > .llama/build.log 2>&1 \
        || { tail -30 .llama/build.log; exit 1; }
    echo "llama-bench built in $((SECONDS - START)) s"
fi
if [ ! -f ".llama/$MODEL.gguf" ]; then
    python3 - "$MODEL" <<'PY'
import sys

import torch

from psr_hf.assets.loading import load_model

model, tokenizer, _ = load_model(sys.argv[1], "cuda" if torch.cuda.is_available() else "cpu")
model.to(torch.bfloat16).save_pretrained(f".llama/{sys.argv[1]}-hf")
tokenizer.save_pretrained(f".llama/{sys.argv[1]}-hf")
PY
    # The grown models' tokenizers are trained here, so llama.cpp knows no hash of them; tg64 reads no text, so its
    # default pre-tokenizer stands in rather than a refusal.
    sed -i 's/raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")/res = "default"/' \
        "$SRC/conversion/base.py"
    PYTHONPATH="$SRC/gguf-py:${PYTHONPATH:-}" python3 "$SRC/convert_hf_to_gguf.py" ".llama/$MODEL-hf" \
        --outtype bf16 --outfile ".llama/$MODEL.gguf" > .llama/convert.log 2>&1 || { tail -20 .llama/convert.log; exit 1; }
    echo "converted $MODEL to .llama/$MODEL.gguf"
fi
