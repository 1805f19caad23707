#!/usr/bin/env bash
# On the lent GPU: train from the carried token files and bring the model back under $OUT.
#   device run, carry ["shards_tiny_moe"]:  bash examples/train_tiny_moe/gpu_train.sh
# MINUTES (default 8) leaves room for the start and the export inside one 10-minute command; the bf16
# model.safetensors of the default shape is 16.7 MB (15.9 MiB), under the 16 MiB a returned file may have.
set -euo pipefail
SHARDS=${SHARDS:-shards_tiny_moe}
RUN=${RUN:-/tmp/run_tiny_moe}
MINUTES=${MINUTES:-8}
nvidia-smi --query-gpu=name --format=csv,noheader
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # deterministic cuBLAS (torch.use_deterministic_algorithms)
PYTHONUNBUFFERED=1 python3 examples/train_tiny_moe/train.py --shards "$SHARDS" --out "$RUN" --minutes "$MINUTES" "$@"
mkdir -p "$OUT/model"
cp "$RUN"/model/* "$OUT/model/"
cp "$RUN/train_log.json" "$OUT/"
ls -la "$OUT" "$OUT/model"
