#!/usr/bin/env bash
# One device command (10-minute limit): `make moonlight-routing` on the lent GPU. The tree plus carried files must
# stay under 64 MiB, so carry capped token files (about 12 MiB of training tokens), made beforehand with
#   python examples/train_tiny_moe/make_shards.py --corpus CORPUS --tokenizer psr_hf/assets/tiny_moe \
#       --out shards_small --max-train-mb 12
#   device run, carry ["shards_small"]:  bash benchmarks/grown/gpu_moonlight.sh
# Brings back $OUT/moonlight-routing.tar.part-* (model, calibration, card, train log; a returned file must stay
# under 16 MiB): `cat moonlight-routing.tar.part-* | tar x -C ~/.cache/psr_hf/models/` (or $PSR_HF_MODELS).
# MINUTES (default 6) leaves room for the card.
set -euo pipefail
python3 -c "import psr_hf.patches" 2>/dev/null || ln -sfn ../patches psr_hf/patches
export PYTHONPATH=$PWD CUBLAS_WORKSPACE_CONFIG=:4096:8
export PSR_HF_MODELS=${PSR_HF_MODELS:-$(mktemp -d)}
SHARDS=${SHARDS:-shards_small} MINUTES=${MINUTES:-6} PYTHON=${PYTHON:-python3} \
    CARD_ARGS=${CARD_ARGS:---windows 16 --tokens 512 --calibration-tokens 131072} \
    bash examples/train_tiny_moe/build_routing_model.sh moonlight-routing
tar cf - -C "$PSR_HF_MODELS" moonlight-routing | split -b 15M - "$OUT/moonlight-routing.tar.part-"
ls -la "$PSR_HF_MODELS/moonlight-routing"
