#!/usr/bin/env bash
# On the lent GPU: train from the carried token files and bring the model back under $OUT.
#   device run, carry ["shards_tiny_moe"]:  bash examples/train_tiny_moe/gpu_train.sh
# MINUTES (default 8) leaves room for the start and the export inside one 10-minute command; the bf16
# model.safetensors of the default shape is 16.7 MB (15.9 MiB), under the 16 MiB a returned file may have.
#
# Several presets at once, one GPU each, in parallel (e.g. on nvidia-h200-x2):
#   device run, kind nvidia-h200-x2, carry ["shards_tiny_moe"]:
#     ARCHS="olmoe-routing moonlight-routing" bash examples/train_tiny_moe/gpu_train.sh
# The i-th preset of ARCHS runs on GPU i (CUDA_VISIBLE_DEVICES=i) for MINUTES (default 7 here), with BATCH
# windows of 512 tokens (default 128); each brings back $OUT/<arch>/model/ (bf16 shards of at most 15 MiB),
# $OUT/<arch>/train_log.json and $OUT/<arch>/train_stdout.log. The script waits for all of them, copies what
# each one produced, and exits non-zero, naming the failed presets, if any of them failed.
# Extra arguments go to every train.py. Measured on one H200 (torch 2.11, transformers 5.17), batch 128 x 512:
# olmoe-routing 178 ms/step (about 2,300 steps in 7 min, 20 GiB), moonlight-routing 295 ms/step (about 1,400
# steps, 24 GiB); with start-up, evaluation and export the command takes about 8 minutes.
set -euo pipefail
SHARDS=${SHARDS:-shards_tiny_moe}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # deterministic cuBLAS (torch.use_deterministic_algorithms)

if [ -z "${ARCHS:-}" ]; then  # one run: the shipped tiny-moe's command
    RUN=${RUN:-/tmp/run_tiny_moe}
    MINUTES=${MINUTES:-8}
    PYTHONUNBUFFERED=1 python3 examples/train_tiny_moe/train.py --shards "$SHARDS" --out "$RUN" --minutes "$MINUTES" "$@"
    mkdir -p "$OUT/model"
    cp "$RUN"/model/* "$OUT/model/"
    cp "$RUN/train_log.json" "$OUT/"
    ls -la "$OUT" "$OUT/model"
    exit 0
fi

RUNS=${RUNS:-/tmp/runs_tiny_moe}
MINUTES=${MINUTES:-7}
BATCH=${BATCH:-128}
read -r -a archs <<< "$ARCHS"
gpus=$(nvidia-smi -L | wc -l)
if (( ${#archs[@]} > gpus )); then
    echo "ARCHS has ${#archs[@]} presets but this machine has $gpus GPUs (one preset per GPU)" >&2
    exit 2
fi
pids=()
for i in "${!archs[@]}"; do
    arch=${archs[$i]}
    rm -rf "${RUNS:?}/$arch"
    mkdir -p "$RUNS/$arch"
    # a subshell per preset: its exit status is train.py's (pipefail), its lines are prefixed with the preset
    ( set -o pipefail
      CUDA_VISIBLE_DEVICES=$i PYTHONUNBUFFERED=1 python3 examples/train_tiny_moe/train.py --arch "$arch" \
          --shards "$SHARDS" --out "$RUNS/$arch" --minutes "$MINUTES" --batch "$BATCH" "$@" 2>&1 \
          | tee "$RUNS/$arch/train_stdout.log" | sed -u "s/^/[$arch gpu$i] /" ) &
    pids+=($!)
done
failed=()
for i in "${!archs[@]}"; do
    arch=${archs[$i]}
    if wait "${pids[$i]}"; then rc=0; else rc=$?; fi
    mkdir -p "$OUT/$arch"
    [ -d "$RUNS/$arch/model" ] && cp -r "$RUNS/$arch/model" "$OUT/$arch/"
    [ -f "$RUNS/$arch/train_log.json" ] && cp "$RUNS/$arch/train_log.json" "$OUT/$arch/"
    cp "$RUNS/$arch/train_stdout.log" "$OUT/$arch/" || true
    if (( rc != 0 )); then
        echo "!!! $arch FAILED (train.py exit $rc); see $OUT/$arch/train_stdout.log" >&2
        failed+=("$arch")
    fi
done
ls -laR "$OUT"
if (( ${#failed[@]} )); then
    echo "!!! FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "all presets done: ${archs[*]}"
